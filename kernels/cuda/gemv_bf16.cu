// bf16 GEMV for decode: y[m, n] = sum_k x[m, k] * w[n, k] for M rows of x (M = 1, 2, 3, 4, 8 or 16 a block; bf16
// x and W as nn.Linear weight [N, K], f32 accumulate), y f32 or bf16 with rows ld_y apart; grid.y row groups of
// M rows each (the wrapper covers any row count with a few launches). cuBLAS picks split-K plus a reduce
// kernel for these shapes at M = 1 and streams a few hundred GB/s on a decode step's 2–22 MB projections
// (bench/RESULTS.md, "Speed on the H200" §5); here every lane keeps UNROLL 16-byte weight loads in flight
// and the row's partial sums stay in the block.
// CPU twin: engine cpu::ops::matmul_bf16 (same products, f32 sums in another order). Test:
// engine/tests/cuda_gemm.rs (gemv cases through gemm_bf16; `gemv_rows_do_not_depend_on_the_row_count`).
// Wrapper: engine/src/cuda/ops/gemm_bf16.rs (taken for up to KDTREE_GEMV_ROWS rows, 4 by default, K % 8 == 0 and
// 16-byte aligned x and W when the GPU's GEMV switch is on: opt in, KDTREE_GEMV=1).
// Layout: WPR warps per row (1, 2, 4 or 8; more for short N so that the GPU has enough loads in flight), 8
// warps per block (8 / WPR rows). Warp j of a row takes the 16-byte chunks c = lane + 32 (j + WPR i); each lane
// sums its chunks in order, the warp by a fixed butterfly, the row's warps in warp order: deterministic, and the
// same order for a row whatever M and the row group (WPR depends on N only): a row's bits do not depend on how
// many rows the call has, so a decode step (1 row) and a tree verify (65) agree on the rows they share.
#include "common.cuh"

namespace gemv {

constexpr int UNROLL = 8;

template <int M, typename O>
__device__ __forceinline__ void gemv_row(const bf16* __restrict__ x, int ld_x, const bf16* __restrict__ w, O* __restrict__ y,
                                         int ld_y, int N, int K, int wpr) {
    __shared__ float part[8][M];
    // Row group blockIdx.y: rows [M y, M y + M) of x and y (one launch covers any multiple of M rows).
    x += (size_t)blockIdx.y * M * ld_x;
    y += (size_t)blockIdx.y * M * ld_y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row_in_block = warp / wpr, j = warp % wpr;
    const int n = blockIdx.x * (8 / wpr) + row_in_block;
    const int chunks = K / 8, stride = 32 * wpr;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = 0.f;
    if (n < N) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)n * K);
        for (int c0 = lane + 32 * j; c0 < chunks; c0 += UNROLL * stride) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int c = c0 + u * stride;
                v[u] = c < chunks ? __ldcs(wr + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int c = c0 + u * stride;
                if (c >= chunks) break;
                const bf162* pw = reinterpret_cast<const bf162*>(&v[u]);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * ld_x) + c);
                    const bf162* px = reinterpret_cast<const bf162*>(&xv);
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const float2 a = __bfloat1622float2(pw[q]), b = __bfloat1622float2(px[q]);
                        acc[m] = fmaf(a.x, b.x, acc[m]);
                        acc[m] = fmaf(a.y, b.y, acc[m]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) acc[m] = kdtree::warp_sum(acc[m]);
    if (lane == 0)
#pragma unroll
        for (int m = 0; m < M; m++) part[warp][m] = acc[m];
    __syncthreads();
    if (j == 0 && lane < M && n < N) {
        float s = 0.f;
        for (int i = 0; i < wpr; i++) s += part[warp + i][lane];
        if constexpr (sizeof(O) == 4)
            y[(size_t)lane * ld_y + n] = s;
        else
            y[(size_t)lane * ld_y + n] = __float2bfloat16_rn(s);
    }
}

}  // namespace gemv

// x [M, ld_x] bf16, w [N, K] bf16, y [M, ld_y]; grid ceil(N / (8 / wpr)), block 256.
#define GEMV_F32_KERNEL(MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) kdtree_gemv_bf16_f32_m##MT(                            \
        const bf16* __restrict__ x, int ld_x, const bf16* __restrict__ w, float* __restrict__ y, int ld_y,     \
        int N, int K, int wpr) {                                                                               \
        gemv::gemv_row<MT, float>(x, ld_x, w, y, ld_y, N, K, wpr);                                            \
    }
#define GEMV_BF16_KERNEL(MT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) kdtree_gemv_bf16_bf16_m##MT(                           \
        const bf16* __restrict__ x, int ld_x, const bf16* __restrict__ w, bf16* __restrict__ y, int ld_y,      \
        int N, int K, int wpr) {                                                                               \
        gemv::gemv_row<MT, bf16>(x, ld_x, w, y, ld_y, N, K, wpr);                                             \
    }
GEMV_F32_KERNEL(1)
GEMV_F32_KERNEL(2)
GEMV_F32_KERNEL(3)
GEMV_F32_KERNEL(4)
GEMV_F32_KERNEL(8)
GEMV_F32_KERNEL(16)
GEMV_BF16_KERNEL(1)
GEMV_BF16_KERNEL(2)
GEMV_BF16_KERNEL(3)
GEMV_BF16_KERNEL(4)
GEMV_BF16_KERNEL(8)
GEMV_BF16_KERNEL(16)
