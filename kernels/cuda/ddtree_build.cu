// DDTree draft-tree build on the device (ddtree.md §2.2): best-first expansion of prefixes from the per-depth
// top-K log-probs, node for node equal to the CPU builder engine ddtree::build_tree_from_top_k (which equals
// the reference builder), including its total order on ties. Test: engine/tests/cuda_ddtree.rs.
// Wrapper: engine/src/cuda/ops/ddtree_build.rs.
//
// The order (build.rs header): candidate a pops before b iff -a.logw < -b.logw, or the scores are equal
// (IEEE ==) and then by the rank tuple (lexicographic, a prefix before its extensions; compared by walking
// both parent chains), parent, depth, rank. A NaN score (e.g. -inf - -inf from rows with fewer than K
// finite logits) counts as -inf, as in the CPU builder. Scores are f64, accumulated from the f32 log-probs
// with the reference's formulas: sibling `logw - lp[d][r] + lp[d][r+1]`, child `logw + lp[d+1][0]`.
//
// One warp. Since the order is total, the candidate set can be an unordered array instead of a heap, split
// over the lanes by index (lane l holds slots l, l + 32, ...). Each lane keeps the best of its own slots in
// registers; a pop takes the best lane best by two warp max-reductions of an order-preserving score key (a
// butterfly with the full tie order only when lanes tie exactly; all lanes agree), then lane 0 appends the
// node and rewrites at most two slots (the popped one becomes its sibling, or its child, or the last slot;
// a child may be appended), and only the lanes owning a changed slot update their best (the owner of the
// popped slot rescans its ~n/32 slots). The top-K log-probs sit in shared memory when they fit (64 KB); the
// nodes are kept in shared memory and written out once at the end. Candidates and node parents/ranks live in shared memory
// (budget <= 2048, K <= 2048, depths <= 255, checked by the wrapper).
#include "common.cuh"

namespace ddtree_build {

constexpr int MAX_NODES = 2049;  // budget 2048 + root

struct Shared {
    double logw[MAX_NODES];      // candidate scores (at most popped + 1 candidates live)
    unsigned meta[MAX_NODES];    // candidate parent (12 bits) | depth (8) << 12 | rank (12) << 20
    short parent[MAX_NODES];     // node parents (-1 for the root)
    short rank[MAX_NODES];       // node ranks
    short last_child[MAX_NODES];
    short first_child[MAX_NODES];    // node child lists (written out at the end)
    short next_sibling[MAX_NODES];
    unsigned char depth[MAX_NODES];  // node depths
};

__device__ __forceinline__ unsigned pack(unsigned parent, unsigned depth, unsigned rank) { return parent | depth << 12 | rank << 20; }
__device__ __forceinline__ int c_parent(unsigned m) { return (int)(m & 0xfffu); }
__device__ __forceinline__ int c_depth(unsigned m) { return (int)((m >> 12) & 0xffu); }
__device__ __forceinline__ int c_rank(unsigned m) { return (int)(m >> 20); }
__device__ __forceinline__ double score(double x) { return x != x ? -INFINITY : x; }

// Rank-tuple order of candidates a, b (build.rs Nodes::cmp_ranks): -1, 0, 1.
__device__ int cmp_ranks(const Shared& s, unsigned a, unsigned b) {
    const int da = c_depth(a), db = c_depth(b), m = min(da, db);
    int pa = c_parent(a), ra = c_rank(a), pb = c_parent(b), rb = c_rank(b);
    for (int d = da; d > m; d--) {
        ra = s.rank[pa];
        pa = s.parent[pa];
    }
    for (int d = db; d > m; d--) {
        rb = s.rank[pb];
        pb = s.parent[pb];
    }
    if (pa == pb && ra == rb) return da < db ? -1 : (da > db ? 1 : 0);
    while (pa != pb) {
        ra = s.rank[pa];
        pa = s.parent[pa];
        rb = s.rank[pb];
        pb = s.parent[pb];
    }
    return ra < rb ? -1 : (ra > rb ? 1 : 0);
}

// Whether candidate slot i (score wi) pops before slot j (score wj); -1 = no candidate (never pops first).
// The scores are never NaN (score()): unequal scores decide, equal ones (IEEE ==) take the tie order.
__device__ __forceinline__ bool better(const Shared& s, int i, double wi, int j, double wj) {
    if (j < 0) return i >= 0;
    if (i < 0) return false;
    if (wi != wj) return wi > wj;
    const unsigned a = s.meta[i], b = s.meta[j];
    const int c = cmp_ranks(s, a, b);
    if (c != 0) return c < 0;
    if (c_parent(a) != c_parent(b)) return c_parent(a) < c_parent(b);
    if (c_depth(a) != c_depth(b)) return c_depth(a) < c_depth(b);
    return c_rank(a) < c_rank(b);
}

// An order-preserving u64 of a candidate's score (larger score, larger key; -0 == +0; no candidate: 0, below
// every real key, -inf included).
__device__ __forceinline__ unsigned long long score_key(int slot, double w) {
    if (slot < 0) return 0ull;
    const unsigned long long b = (unsigned long long)__double_as_longlong(w + 0.0);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

// The best of this lane's slots lane, lane + stride, ... below nc.
__device__ __forceinline__ void rescan(const Shared& s, int lane, int stride, int nc, int& best, double& bw) {
    best = -1;
    bw = -INFINITY;
    for (int i = lane; i < nc; i += stride) {
        const double w = s.logw[i];
        if (better(s, i, w, best, bw)) {
            best = i;
            bw = w;
        }
    }
}

}  // namespace ddtree_build

// One tree's build by the calling warp (the kernels below): `s` the block's static arrays, `ddtree_lp` its dynamic
// shared memory. Returns the nodes built (root included), the same in every lane.
__device__ int ddtree_build_warp(const float* __restrict__ lp, const unsigned* __restrict__ tok, int L, int K, int budget,
                                 const unsigned* __restrict__ bonus, unsigned* __restrict__ tokens,
                                 unsigned* __restrict__ depths, int* __restrict__ parents, double* __restrict__ log_q,
                                 int* __restrict__ first_child, int* __restrict__ next_sibling,
                                 int* __restrict__ n_nodes, int lp_in_smem, ddtree_build::Shared& s, float* ddtree_lp) {
    using namespace ddtree_build;
    const int lane = threadIdx.x, W = 32;
    if (lp_in_smem)
        for (int i = lane; i < L * K; i += W) ddtree_lp[i] = lp[i];
    const float* lpp = lp_in_smem ? ddtree_lp : lp;
    double* lq = reinterpret_cast<double*>(ddtree_lp + (lp_in_smem ? (L * K + 1) / 2 * 2 : 0));  // node log_q
    const auto LP = [&](int d, int r) { return (double)lpp[(size_t)(d - 1) * K + r]; };  // depth d is 1-based
    const bool any = budget > 0 && L > 0 && K > 0;
    if (lane == 0) {
        lq[0] = 0.0;
        s.first_child[0] = -1;
        s.next_sibling[0] = -1;
        s.parent[0] = -1;
        s.rank[0] = 0;
        s.last_child[0] = -1;
        s.depth[0] = 0;
    }
    __syncwarp();
    if (lane == 0 && any) {
        s.logw[0] = score(LP(1, 0));
        s.meta[0] = pack(0u, 1u, 0u);
    }
    __syncwarp();
    int n = 1, nc = any ? 1 : 0;  // nodes (root included), live candidate slots: the same in every lane
    int mb;
    double mw;
    rescan(s, lane, W, nc, mb, mw);
    while (n - 1 < budget && nc > 0) {
        // The best lane best: the largest score key by two warp max-reductions (hardware __reduce_max_sync);
        // only when several lanes hold that exact score does the butterfly with the full tie order run.
        const unsigned long long key = score_key(mb, mw);
        const unsigned hi = __reduce_max_sync(kdtree::FULL_MASK, (unsigned)(key >> 32));
        const unsigned lo = __reduce_max_sync(kdtree::FULL_MASK, (unsigned)(key >> 32) == hi ? (unsigned)key : 0u);
        const unsigned tied = __ballot_sync(kdtree::FULL_MASK, key == ((unsigned long long)hi << 32 | lo));
        int best = mb;
        double bw = mw;
        if (__popc(tied) == 1) {
            const int w = __ffs(tied) - 1;
            best = __shfl_sync(kdtree::FULL_MASK, mb, w);
            bw = __shfl_sync(kdtree::FULL_MASK, mw, w);
        } else {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const int ob = __shfl_xor_sync(kdtree::FULL_MASK, best, o);
                const double ow = __shfl_xor_sync(kdtree::FULL_MASK, bw, o);
                if (better(s, ob, ow, best, bw)) {
                    best = ob;
                    bw = ow;
                }
            }
        }
        const unsigned m = s.meta[best];
        const int p = c_parent(m), d = c_depth(m), r = c_rank(m);
        const bool sib = r + 1 < K, child = d < L;
        const double sw = sib ? score(bw - LP(d, r) + LP(d, r + 1)) : 0.0;
        const double cw = child ? score(bw + LP(d + 1, 0)) : 0.0;
        // Where the new candidates go: the sibling replaces the popped slot; the child is appended (or takes the
        // slot when there is no sibling); with neither, the last slot moves into the popped one.
        const int child_at = sib ? nc : best;
        const bool removed = !sib && !child;
        __syncwarp();  // every lane has read the popped slot before lane 0 rewrites it
        if (lane == 0) {
            lq[n] = bw;
            s.first_child[n] = -1;
            s.next_sibling[n] = -1;
            const int lc = s.last_child[p];
            if (lc < 0)
                s.first_child[p] = (short)n;
            else
                s.next_sibling[lc] = (short)n;
            s.last_child[p] = (short)n;
            s.parent[n] = (short)p;
            s.rank[n] = (short)r;
            s.last_child[n] = -1;
            s.depth[n] = (unsigned char)d;
            if (sib) {
                s.logw[best] = sw;
                s.meta[best] = pack((unsigned)p, (unsigned)d, (unsigned)(r + 1));
            }
            if (child) {
                s.logw[child_at] = cw;
                s.meta[child_at] = pack((unsigned)n, (unsigned)(d + 1), 0u);
            }
            if (removed) {
                s.logw[best] = s.logw[nc - 1];
                s.meta[best] = s.meta[nc - 1];
            }
        }
        const int moved_from = removed ? nc - 1 : -1;
        n++;
        nc += (sib && child) ? 1 : (removed ? -1 : 0);
        __syncwarp();
        if (best % W == lane || (moved_from >= 0 && mb == moved_from)) {
            rescan(s, lane, W, nc, mb, mw);  // this lane's popped slot was rewritten (or its best slot moved)
        } else if (sib && child && child_at % W == lane) {
            const double w = s.logw[child_at];  // an appended child in this lane's slots
            if (better(s, child_at, w, mb, mw)) {
                mb = child_at;
                mw = w;
            }
        }
    }
    __syncwarp();
    for (int i = lane; i < n; i += W) {
        tokens[i] = i == 0 ? bonus[0] : tok[(size_t)(s.depth[i] - 1) * K + s.rank[i]];
        depths[i] = s.depth[i];
        parents[i] = s.parent[i];
        log_q[i] = lq[i];
        first_child[i] = s.first_child[i];
        next_sibling[i] = s.next_sibling[i];
    }
    if (lane == 0) n_nodes[0] = n;
    return n;
}

// lp [L, K] f32, tok [L, K] u32 (per-depth top-K, rank order); bonus [1] u32 (the root token, on the device).
// Outputs, [budget + 1] each (nodes in pop order, node 0 = root): tokens u32, depths u32, parents i32,
// log_q f64, first_child i32, next_sibling i32; n_nodes [1] i32 = nodes including the root.
// Dynamic shared memory: lp (L * K f32, when lp_in_smem; padded to 8 bytes), then log_q of the nodes
// ((budget + 1) f64). Every output is kept in shared memory during the pops and written out at the end (a
// global store before a __syncwarp would make the warp wait for it every pop).
// grid (1), block 32.
extern "C" __global__ void __launch_bounds__(32) kdtree_ddtree_build(const float* __restrict__ lp, const unsigned* __restrict__ tok, int L,
                                                                     int K, int budget, const unsigned* __restrict__ bonus,
                                                                     unsigned* __restrict__ tokens, unsigned* __restrict__ depths,
                                                                     int* __restrict__ parents, double* __restrict__ log_q,
                                                                     int* __restrict__ first_child, int* __restrict__ next_sibling,
                                                                     int* __restrict__ n_nodes, int lp_in_smem) {
    __shared__ ddtree_build::Shared s;
    extern __shared__ float ddtree_lp[];  // a name of its own: build.rs compiles every .cu as one translation unit
    ddtree_build_warp(lp, tok, L, K, budget, bonus, tokens, depths, parents, log_q, first_child, next_sibling, n_nodes,
                      lp_in_smem, s, ddtree_lp);
}

// A batch's trees of one shape (L draft rows, top-K, budget) in one launch, one block (a warp) per tree: tree t
// builds from rows [t*L, (t+1)*L) of lp / tok into its own outputs (the table), then writes its ancestor bitmask
// (`words` u64 a row, budget + 1 rows: kdtree_visibility_from_parents's, from the parents still in shared
// memory; rows past the tree's size zero). Every output equals the single-tree kernels' on the same rows.
// grid (nseg), block 32, dynamic shared memory as kdtree_ddtree_build's.
constexpr int BUILD_SEGS = 32;
struct BuildSegs {
    unsigned long long bonus[BUILD_SEGS], tokens[BUILD_SEGS], depths[BUILD_SEGS], parents[BUILD_SEGS];
    unsigned long long log_q[BUILD_SEGS], first_child[BUILD_SEGS], next_sibling[BUILD_SEGS], n_nodes[BUILD_SEGS];
    unsigned long long mask[BUILD_SEGS];
    int nseg;
};
extern "C" __global__ void __launch_bounds__(32) kdtree_ddtree_build_segs(const BuildSegs segs, const float* __restrict__ lp,
                                                                          const unsigned* __restrict__ tok, int L, int K,
                                                                          int budget, int words, int lp_in_smem) {
    __shared__ ddtree_build::Shared s;
    extern __shared__ float ddtree_lp_segs[];
    const int t = blockIdx.x, lane = threadIdx.x;
    if (t >= segs.nseg) return;
    const size_t at = (size_t)t * L * K;
    const int n = ddtree_build_warp(lp + at, tok + at, L, K, budget, reinterpret_cast<const unsigned*>(segs.bonus[t]),
                                    reinterpret_cast<unsigned*>(segs.tokens[t]), reinterpret_cast<unsigned*>(segs.depths[t]),
                                    reinterpret_cast<int*>(segs.parents[t]), reinterpret_cast<double*>(segs.log_q[t]),
                                    reinterpret_cast<int*>(segs.first_child[t]), reinterpret_cast<int*>(segs.next_sibling[t]),
                                    reinterpret_cast<int*>(segs.n_nodes[t]), lp_in_smem, s, ddtree_lp_segs);
    __syncwarp();
    unsigned long long* bits = reinterpret_cast<unsigned long long*>(segs.mask[t]);
    for (int i = lane; i <= budget; i += 32) {
        unsigned long long* row = bits + (size_t)i * words;
        for (int w = 0; w < words; w++) row[w] = 0ull;
        if (i < n)
            for (int j = i; j >= 0; j = s.parent[j]) row[j >> 6] |= 1ull << (j & 63);
    }
}
