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
// One warp. Since the order is total, the candidate set can be an unordered array instead of a heap: each
// pop, every lane scans a 1/32 stride of it and a butterfly keeps the best (all lanes agree); lane 0 appends
// the node and replaces the popped entry by its sibling / child. Candidates and node parents/ranks live in
// shared memory (budget <= 2048, K <= 2048, depths <= 255, checked by the wrapper).
#include "common.cuh"

namespace ddtree_build {

constexpr int MAX_NODES = 2049;  // budget 2048 + root

struct Shared {
    double logw[MAX_NODES];      // candidate scores (at most popped + 1 candidates live)
    unsigned meta[MAX_NODES];    // candidate parent (12 bits) | depth (8) << 12 | rank (12) << 20
    short parent[MAX_NODES];     // node parents (-1 for the root)
    short rank[MAX_NODES];       // node ranks
    short last_child[MAX_NODES];
    int n_nodes, n_cand;
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

// Whether candidate i pops before candidate j.
__device__ bool before(const Shared& s, int i, int j) {
    const double x = -s.logw[i], y = -s.logw[j];
    if (x != y) return x < y;
    const unsigned a = s.meta[i], b = s.meta[j];
    const int c = cmp_ranks(s, a, b);
    if (c != 0) return c < 0;
    if (c_parent(a) != c_parent(b)) return c_parent(a) < c_parent(b);
    if (c_depth(a) != c_depth(b)) return c_depth(a) < c_depth(b);
    return c_rank(a) < c_rank(b);
}

}  // namespace ddtree_build

// lp [L, K] f32, tok [L, K] u32 (per-depth top-K, rank order); bonus [1] u32 (the root token, on the device).
// Outputs, [budget + 1] each (nodes in pop order, node 0 = root): tokens u32, depths u32, parents i32,
// log_q f64, first_child i32, next_sibling i32; n_nodes [1] i32 = nodes including the root.
// grid (1), block 32.
extern "C" __global__ void __launch_bounds__(32) kdtree_ddtree_build(const float* __restrict__ lp, const unsigned* __restrict__ tok, int L,
                                                                     int K, int budget, const unsigned* __restrict__ bonus,
                                                                     unsigned* __restrict__ tokens, unsigned* __restrict__ depths,
                                                                     int* __restrict__ parents, double* __restrict__ log_q,
                                                                     int* __restrict__ first_child, int* __restrict__ next_sibling,
                                                                     int* __restrict__ n_nodes) {
    using namespace ddtree_build;
    __shared__ Shared s;
    const int lane = threadIdx.x;
    const auto LP = [&](int d, int r) { return (double)lp[(size_t)(d - 1) * K + r]; };  // depth d is 1-based
    if (lane == 0) {
        tokens[0] = bonus[0];
        depths[0] = 0u;
        parents[0] = -1;
        log_q[0] = 0.0;
        first_child[0] = -1;
        next_sibling[0] = -1;
        s.parent[0] = -1;
        s.rank[0] = 0;
        s.last_child[0] = -1;
        s.n_nodes = 1;
        s.n_cand = 0;
        if (budget > 0 && L > 0 && K > 0) {
            s.logw[0] = score(LP(1, 0));
            s.meta[0] = pack(0u, 1u, 0u);
            s.n_cand = 1;
        }
    }
    __syncwarp();
    while (*(volatile int*)&s.n_nodes - 1 < budget && *(volatile int*)&s.n_cand > 0) {
        const int nc = *(volatile int*)&s.n_cand;
        int best = -1;
        for (int i = lane; i < nc; i += (int)blockDim.x)
            if (best < 0 || before(s, i, best)) best = i;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const int other = __shfl_xor_sync(kdtree::FULL_MASK, best, o);
            if (other >= 0 && (best < 0 || before(s, other, best))) best = other;
        }
        __syncwarp();  // every lane is done reading the candidates before lane 0 rewrites them
        if (lane == 0) {
            const double logw = s.logw[best];
            const unsigned m = s.meta[best];
            const int p = c_parent(m), d = c_depth(m), r = c_rank(m), n = s.n_nodes;
            tokens[n] = tok[(size_t)(d - 1) * K + r];
            depths[n] = (unsigned)d;
            parents[n] = p;
            log_q[n] = logw;
            first_child[n] = -1;
            next_sibling[n] = -1;
            if (s.last_child[p] < 0)
                first_child[p] = n;
            else
                next_sibling[s.last_child[p]] = n;
            s.last_child[p] = (short)n;
            s.parent[n] = (short)p;
            s.rank[n] = (short)r;
            s.last_child[n] = -1;
            s.n_nodes = n + 1;
            const bool sib = r + 1 < K, child = d < L;
            int nc2 = s.n_cand;
            if (sib) {
                s.logw[best] = score(logw - LP(d, r) + LP(d, r + 1));
                s.meta[best] = pack((unsigned)p, (unsigned)d, (unsigned)(r + 1));
            }
            if (child) {
                const int at = sib ? nc2++ : best;
                s.logw[at] = score(logw + LP(d + 1, 0));
                s.meta[at] = pack((unsigned)n, (unsigned)(d + 1), 0u);
            }
            if (!sib && !child) {
                nc2--;
                s.logw[best] = s.logw[nc2];
                s.meta[best] = s.meta[nc2];
            }
            s.n_cand = nc2;
        }
        __syncwarp();
    }
    if (lane == 0) n_nodes[0] = s.n_nodes;
}
