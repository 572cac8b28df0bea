// Row argmax over the vocabulary (greedy decoding after lm_head). Tie rule: the lowest index wins; NaN
// never wins; an all-NaN row gives 0. CPU twin: engine sampling::argmax (same rules).
// The vocab-parallel form (tensor parallelism, issue 11): each vocab shard's argmax as a (value, global id)
// pair in its slot of a zeroed [T, slots, 2] f32 buffer, the buffer summed over the GPUs (each slot is written
// by one GPU and zero on the others, so the sum is exact: x + 0 = x), then the pairs merged in slot (= global
// vocab) order by the same rules. CPU twin: cpu::ops::lm_head_argmax_bf16 (the same merge).
// Test: engine/tests/cuda_ops.rs (argmax cases, bit for bit; the pairs and merge against the full-row argmax).
// Wrapper: engine/src/cuda/ops/argmax.rs.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<bf16>(bf16 v) { return __bfloat162float(v); }

// The best (value, index) of row blockIdx.x (every thread gets it); index INVALID for an all-NaN row.
template <typename T>
__device__ kdtree::Best best_of_row(const T* __restrict__ x, int V, int ld) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const T* r = x + (size_t)blockIdx.x * ld;
    kdtree::Best b{0.f, kdtree::INVALID};
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = to_f32<T>(r[i]);
        if (v == v) b = kdtree::best_of(b, kdtree::Best{v, i});
    }
    return kdtree::block_best(b, sv, si);
}

template <typename T>
__device__ void argmax_row(const T* __restrict__ x, int V, int ld, unsigned* __restrict__ out) {
    const kdtree::Best b = best_of_row<T>(x, V, ld);
    if (threadIdx.x == 0) out[blockIdx.x] = b.i == kdtree::INVALID ? 0u : (unsigned)b.i;
}

// x [T, ld] (first V used), out [T] u32. One block per row, blockDim.x multiple of 32.
extern "C" __global__ void kdtree_argmax_f32(const float* __restrict__ x, int V, int ld, unsigned* __restrict__ out) {
    argmax_row<float>(x, V, ld, out);
}

extern "C" __global__ void kdtree_argmax_bf16(const bf16* __restrict__ x, int V, int ld, unsigned* __restrict__ out) {
    argmax_row<bf16>(x, V, ld, out);
}

// x [T, ld] f32: one vocab shard's logits (columns 0..V, global ids id0..id0+V). pairs [T, slots, 2]: row t's
// pair goes to pairs[(t * slots + slot) * 2]: (its max, (float)(id0 + index)), or (NaN, 0) for an all-NaN row.
// Global ids must be below 2^24 (exact as f32). One block per row, blockDim.x multiple of 32.
extern "C" __global__ void kdtree_argmax_pair_f32(const float* __restrict__ x, int V, int ld, int id0, float* __restrict__ pairs, int slot,
                                                  int slots) {
    const kdtree::Best b = best_of_row<float>(x, V, ld);
    if (threadIdx.x == 0) {
        float* p = pairs + ((size_t)blockIdx.x * slots + slot) * 2;
        const bool none = b.i == kdtree::INVALID;
        p[0] = none ? __int_as_float(0x7fc00000) : b.v;
        p[1] = none ? 0.f : (float)(id0 + b.i);
    }
}

// pairs [T, slots, 2] (every slot filled, summed over the GPUs) -> out [T]: the pair with the largest value,
// NaN never winning, the earlier slot (lower global id) on ties; 0 when every value is NaN. One thread a row.
extern "C" __global__ void kdtree_argmax_merge_pairs(const float* __restrict__ pairs, int rows, int slots, unsigned* __restrict__ out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows) return;
    const float* p = pairs + (size_t)t * slots * 2;
    bool seen = false;
    float best = 0.f;
    unsigned id = 0;
    for (int s = 0; s < slots; ++s) {
        const float v = p[2 * s];
        if (v != v) continue;
        if (!seen || v > best) {
            seen = true;
            best = v;
            id = (unsigned)p[2 * s + 1];
        }
    }
    out[t] = id;
}
