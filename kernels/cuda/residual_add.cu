// Residual add in place: h[i] = bf16(f32(h[i]) + f32(d[i])) over n elements.
// CPU twin: a plain f32 add (the test's local reference; the CPU backend adds f32 residuals inline).
// Test: engine/tests/cuda_ops.rs (residual_add cases). Wrapper: engine/src/cuda/ops/residual_add.rs.
#include "common.cuh"

// h [n] bf16 (read-write), d [n] bf16. Grid-stride; 16-byte accesses when both are 16-byte aligned.
extern "C" __global__ void kdtree_residual_add_bf16(bf16* __restrict__ h, const bf16* __restrict__ d, long long n) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (kdtree::aligned16(h) && kdtree::aligned16(d)) {
        const long long nv = n / 8;
        for (long long v = tid; v < nv; v += stride) {
            uint4 a = reinterpret_cast<const uint4*>(h)[v];
            uint4 b = reinterpret_cast<const uint4*>(d)[v];
            bf162* pa = reinterpret_cast<bf162*>(&a);
            const bf162* pb = reinterpret_cast<const bf162*>(&b);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 x = __bfloat1622float2(pa[j]), y = __bfloat1622float2(pb[j]);
                pa[j] = __floats2bfloat162_rn(x.x + y.x, x.y + y.y);
            }
            reinterpret_cast<uint4*>(h)[v] = a;
        }
        for (long long i = nv * 8 + tid; i < n; i += stride) {
            h[i] = __float2bfloat16_rn(__bfloat162float(h[i]) + __bfloat162float(d[i]));
        }
    } else {
        for (long long i = tid; i < n; i += stride) {
            h[i] = __float2bfloat16_rn(__bfloat162float(h[i]) + __bfloat162float(d[i]));
        }
    }
}
