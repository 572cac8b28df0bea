// MoE combine: out[t, :] = Σ_k w[t, k] · y[t·K + k, :] (f32, over the K routed outputs in selection order;
// pairs whose expert id is outside this rank's [first, first + count) — expert parallel — are skipped). y holds the down-projection of every
// (token, slot) pair from the grouped expert GEMM. CPU twin: the per-token weighted sum of
// engine cpu::ops::moe_experts_i4g32 (which adds in ascending expert id: a different f32 order).
// Test: engine/tests/cuda_target.rs (through the forward). Wrapper: engine/src/cuda/ops/moe_combine.rs.
#include "common.cuh"

// y [T*K, ld_y] bf16, w [T, K] f32, ids [T, K] i32, out [T, H] f32. grid (ceil(H / 256), T), 256 threads.
extern "C" __global__ void kdtree_moe_combine_f32(const bf16* __restrict__ y, int ld_y, const float* __restrict__ w,
                                                  const int* __restrict__ ids, int first, int count,
                                                  float* __restrict__ out, int T, int K, int H) {
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T || c >= H) return;
    float acc = 0.f;
    for (int k = 0; k < K; k++)
        if ((unsigned)(ids[t * K + k] - first) < (unsigned)count) acc = fmaf(w[t * K + k], __bfloat162float(y[((size_t)t * K + k) * ld_y + c]), acc);
    out[(size_t)t * H + c] = acc;
}
