// The DDTree verification walk on the device (ddtree.md §3.1): from the root, take the target's decision at
// the current node; if a child carries that token move to it and repeat, else stop; the decision at the last
// accepted node is the bonus (next root). CPU twin: engine ddtree::walk (greedy decisions = the argmax
// kernel, sampled = the sample_rows kernel, both per node). Test: engine/tests/cuda_ddtree.rs. Wrapper:
// engine/src/cuda/ops/ddtree_walk.rs.
//
// One thread: a walk visits at most depth + 1 nodes and each step scans one child list.
#include "common.cuh"

// The walk of one tree of `used` nodes: the path and its decisions (at most max_len nodes); returns its length.
__device__ __forceinline__ int ddtree_walk_one(const unsigned* __restrict__ decisions,
                                               const unsigned* __restrict__ tokens, const int* __restrict__ first_child,
                                               const int* __restrict__ next_sibling, int used, int max_len,
                                               int* __restrict__ path, unsigned* __restrict__ path_dec) {
    int cur = 0, k = 0;
    while (k < max_len) {
        const unsigned d = decisions[cur];
        path[k] = cur;
        path_dec[k] = d;
        k++;
        int c = first_child[cur];
        while (c >= 0 && c < used && tokens[c] != d) c = next_sibling[c];
        if (c < 0 || c >= used) break;
        cur = c;
    }
    return k;
}

// decisions [nodes] u32 (per node); tokens, first_child, next_sibling [nodes] (the builder's outputs);
// n [1] i32 nodes in use. Outputs: path [max_len] i32 (accepted nodes, root first), path_dec [max_len] u32
// (decision at each path node: path_dec[i] chose tokens[path[i+1]], the last is the bonus), len [1] i32.
// A walk longer than max_len stops there (the wrapper sizes max_len = max depth + 1). grid (1), block 1.
extern "C" __global__ void kdtree_ddtree_walk(const unsigned* __restrict__ decisions, const unsigned* __restrict__ tokens,
                                              const int* __restrict__ first_child, const int* __restrict__ next_sibling,
                                              const int* __restrict__ n, int max_len, int* __restrict__ path,
                                              unsigned* __restrict__ path_dec, int* __restrict__ len) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    len[0] = ddtree_walk_one(decisions, tokens, first_child, next_sibling, n[0], max_len, path, path_dec);
}

// A batch's walks in one launch (trees of one shape): tree t walks the decisions at its own pointer (its rows of
// the batch's decision buffer) over its own tree, into its walk_out = [len, path[max_len], path_dec[max_len]].
// The same steps as kdtree_ddtree_walk. grid (nseg), block 32 (lane 0 walks).
constexpr int WALK_SEGS = 32;
struct WalkSegs {
    unsigned long long decisions[WALK_SEGS], tokens[WALK_SEGS], first_child[WALK_SEGS], next_sibling[WALK_SEGS];
    unsigned long long n[WALK_SEGS], walk_out[WALK_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_ddtree_walk_segs(const WalkSegs segs, int max_len) {
    const int t = blockIdx.x;
    if (t >= segs.nseg || threadIdx.x != 0) return;
    const unsigned* decisions = reinterpret_cast<const unsigned*>(segs.decisions[t]);
    const unsigned* tokens = reinterpret_cast<const unsigned*>(segs.tokens[t]);
    const int* first_child = reinterpret_cast<const int*>(segs.first_child[t]);
    const int* next_sibling = reinterpret_cast<const int*>(segs.next_sibling[t]);
    int* out = reinterpret_cast<int*>(segs.walk_out[t]);
    int* path = out + 1;
    unsigned* path_dec = reinterpret_cast<unsigned*>(out + 1 + max_len);
    const int used = reinterpret_cast<const int*>(segs.n[t])[0];
    out[0] = ddtree_walk_one(decisions, tokens, first_child, next_sibling, used, max_len, path, path_dec);
}
