// RMSNorm over rows: y = weight * (x * rsqrt(mean(x^2) + eps)), bf16 in and out, f32 math.
// CPU twin: engine cpu::ops::rms_norm (f32 throughout; the GPU rounds once, at the store). HF casts the
// normalised value to bf16 before the weight multiply (k26-format §4.2); the twin does not, nor does this.
// Test: engine/tests/cuda_ops.rs (rms_norm cases). Wrapper: engine/src/cuda/ops/rms_norm.rs.
// Dimension letters: T rows, H hidden. One block per row; 16-byte loads when rows are 16-byte aligned.
#include "common.cuh"

// x [T, ld_x] bf16 (first H used), weight [H] bf16, y [T, ld_y] bf16. blockDim.x multiple of 32.
extern "C" __global__ void kdtree_rms_norm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                                                bf16* __restrict__ y, int H, int ld_x, int ld_y, float eps) {
    __shared__ float scratch[32];
    const bf16* xr = x + (size_t)blockIdx.x * ld_x;
    bf16* yr = y + (size_t)blockIdx.x * ld_y;
    const bool vec = (H % 8 == 0) && kdtree::aligned16(xr) && kdtree::aligned16(yr) && kdtree::aligned16(weight);
    float ss = 0.f;
    if (vec) {
        for (int i = threadIdx.x * 8; i < H; i += blockDim.x * 8) {
            uint4 u = *reinterpret_cast<const uint4*>(xr + i);
            const bf162* p = reinterpret_cast<const bf162*>(&u);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 f = __bfloat1622float2(p[j]);
                ss += f.x * f.x + f.y * f.y;
            }
        }
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            float f = __bfloat162float(xr[i]);
            ss += f * f;
        }
    }
    ss = kdtree::block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    if (vec) {
        for (int i = threadIdx.x * 8; i < H; i += blockDim.x * 8) {
            uint4 u = *reinterpret_cast<const uint4*>(xr + i);
            uint4 w = *reinterpret_cast<const uint4*>(weight + i);
            const bf162* p = reinterpret_cast<const bf162*>(&u);
            const bf162* q = reinterpret_cast<const bf162*>(&w);
            uint4 o;
            bf162* po = reinterpret_cast<bf162*>(&o);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 f = __bfloat1622float2(p[j]);
                float2 g = __bfloat1622float2(q[j]);
                po[j] = __floats2bfloat162_rn(g.x * (f.x * r), g.y * (f.y * r));
            }
            *reinterpret_cast<uint4*>(yr + i) = o;
        }
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            yr[i] = __float2bfloat16_rn(__bfloat162float(weight[i]) * (__bfloat162float(xr[i]) * r));
        }
    }
}
