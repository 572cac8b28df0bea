// Commit of an accepted path in the latent KV cache: for each layer, rows committed + path[i] move to
// committed + i, for i = 0, 1, ... in order (path[i] >= i and strictly increasing, so a row is always read
// before any later step could overwrite it). CPU twin: engine cpu::ops::kv_compact.
// Test: engine/tests/cuda_target.rs (tree verify then commit == chain). Wrapper: engine/src/cuda/ops/kv_compact.rs.
#include "common.cuh"

// cache [layers, rows_per_layer, width] bf16; path [n] i32 (node indices of the last forward).
// committed_dev / n_dev [1] or null: when set, committed / n are read from them (a captured round: the walk
// wrote the path and its length on the device).
// grid (layers), 128 threads; rows move one after another (n <= the tree depth + 1: a few rows).
extern "C" __global__ void kdtree_kv_compact_bf16(bf16* __restrict__ cache, long long layer_stride, int width, int committed,
                                                  const int* __restrict__ committed_dev, const int* __restrict__ path, int n,
                                                  const int* __restrict__ n_dev) {
    if (committed_dev) committed = committed_dev[0];
    if (n_dev) n = n_dev[0];
    bf16* c = cache + (size_t)blockIdx.x * layer_stride;
    for (int i = 0; i < n; i++) {
        const int from = committed + path[i], to = committed + i;
        if (from != to)
            for (int j = threadIdx.x; j < width; j += blockDim.x) c[(size_t)to * width + j] = c[(size_t)from * width + j];
        __syncthreads();
    }
}

// A batch's commits in one launch: segment s compacts its own cache (cache[s], layer stride stride[s], committed
// read at pos[s]) along its walk (walk[s] = [len, path...]), as kdtree_kv_compact_bf16 with both read on the
// device. grid (layers, nseg), 128 threads.
constexpr int COMPACT_SEGS = 64;
struct CompactSegs {
    unsigned long long cache[COMPACT_SEGS], pos[COMPACT_SEGS], walk[COMPACT_SEGS];
    long long stride[COMPACT_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_kv_compact_segs_bf16(const CompactSegs segs, int width) {
    const int s = blockIdx.y;
    if (s >= segs.nseg) return;
    const int committed = reinterpret_cast<const int*>(segs.pos[s])[0];
    const int* walk = reinterpret_cast<const int*>(segs.walk[s]);
    const int n = walk[0];
    bf16* c = reinterpret_cast<bf16*>(segs.cache[s]) + (size_t)blockIdx.x * segs.stride[s];
    for (int i = 0; i < n; i++) {
        const int from = committed + walk[1 + i], to = committed + i;
        if (from != to)
            for (int j = threadIdx.x; j < width; j += blockDim.x) c[(size_t)to * width + j] = c[(size_t)from * width + j];
        __syncthreads();
    }
}
