// Row argmax over the vocabulary (greedy decoding after lm_head). Tie rule: the lowest index wins; NaN
// never wins; an all-NaN row gives 0. CPU twin: engine sampling::argmax (same rules).
// Test: engine/tests/cuda_ops.rs (argmax cases, bit for bit). Wrapper: engine/src/cuda/ops/argmax.rs.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<bf16>(bf16 v) { return __bfloat162float(v); }

template <typename T>
__device__ void argmax_row(const T* __restrict__ x, int V, int ld, unsigned* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const T* r = x + (size_t)blockIdx.x * ld;
    kdtree::Best b{0.f, kdtree::INVALID};
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = to_f32<T>(r[i]);
        if (v == v) b = kdtree::best_of(b, kdtree::Best{v, i});
    }
    b = kdtree::block_best(b, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = b.i == kdtree::INVALID ? 0u : (unsigned)b.i;
}

// x [T, ld] (first V used), out [T] u32. One block per row, blockDim.x multiple of 32.
extern "C" __global__ void kdtree_argmax_f32(const float* __restrict__ x, int V, int ld, unsigned* __restrict__ out) {
    argmax_row<float>(x, V, ld, out);
}

extern "C" __global__ void kdtree_argmax_bf16(const bf16* __restrict__ x, int V, int ld, unsigned* __restrict__ out) {
    argmax_row<bf16>(x, V, ld, out);
}
