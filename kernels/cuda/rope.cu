// Interleaved (GPT-J) YaRN RoPE in place on the rope slice of each head: dims (offset + 2i, offset + 2i + 1)
// rotate by angle pos * inv_freq[i], i < D/2 (k26-format §4.4; DeepSeek/Kimi rope on the stored layout).
// CPU twin: engine cpu::ops::rope_interleaved with cos/sin from cpu::ops::rope_cos_sin: the angle is formed
// in f32 (pos as f32 * inv_freq), cos/sin in f64 times attention_factor, rounded to f32; the rotation uses
// separately rounded multiplies and adds (no FMA) like the twin, so only the final bf16 store differs.
// Test: engine/tests/cuda_ops.rs (rope cases). Wrapper: engine/src/cuda/ops/rope.rs.
// Layout: element (t, h, d) at x[t * ld_token + h * ld_head + offset + d]; q is [T, heads, 192] with the
// rope part at offset 128; the shared k_rope is [T, 576] at offset 512 with heads = 1.
#include "common.cuh"

// x bf16 (in place), pos [T] i32, inv_freq [D/2] f32. Grid (ceil(heads * D/2 / blockDim.x), T).
extern "C" __global__ void kdtree_rope_interleaved_bf16(bf16* __restrict__ x, const int* __restrict__ pos,
                                                        const float* __restrict__ inv_freq, int heads, int ld_token,
                                                        int ld_head, int offset, int D, double attention_factor) {
    const int half = D / 2;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= heads * half) return;
    const int h = p / half, i = p % half;
    const float ang = __fmul_rn((float)pos[blockIdx.y], inv_freq[i]);
    const float c = (float)(cos((double)ang) * attention_factor);
    const float s = (float)(sin((double)ang) * attention_factor);
    bf16* v = x + (size_t)blockIdx.y * ld_token + (size_t)h * ld_head + offset + 2 * i;
    const float a = __bfloat162float(v[0]), b = __bfloat162float(v[1]);
    v[0] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    v[1] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}
