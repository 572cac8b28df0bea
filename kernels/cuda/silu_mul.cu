// SwiGLU combine: out[t, i] = bf16(silu(gate[t, i]) * up[t, i]), silu(z) = z * (1 / (1 + e^-z)) in f32.
// CPU twin: engine cpu::ops::silu_mul. Test: engine/tests/cuda_ops.rs (silu_mul cases).
// Wrapper: engine/src/cuda/ops/silu_mul.rs. gate and up may live in one fused [T, 2I] buffer (ld_in = 2I,
// up = gate + I, as vLLM's SiluAndMul: first half gate, second half up, k26-format §4.6).
#include "common.cuh"

// gate, up: rows of ld_in elements (first I used); out [T, I] bf16. Grid (ceil(I / blockDim.x), min(T, 65535)):
// block row y handles rows y, y + gridDim.y, ... (a prefill's (token, slot) pairs exceed the grid's 65535).
extern "C" __global__ void kdtree_silu_mul_bf16(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                                bf16* __restrict__ out, int I, int ld_in, int T) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= I) return;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const size_t r = (size_t)t * ld_in + i;
        const float g = __bfloat162float(gate[r]), u = __bfloat162float(up[r]);
        const float s = g * (1.0f / (1.0f + expf(-g)));
        out[(size_t)t * I + i] = __float2bfloat16_rn(s * u);
    }
}
