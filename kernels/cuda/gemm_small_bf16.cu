// bf16 GEMM for few rows (decode steps, tree verifies, batched rounds) on tensor cores, one summation order per
// output whatever the row count: y[m, n] = sum_k x[m, k] * w[n, k], x [M, K] bf16 (rows ld_x apart), W [N, K] bf16
// (nn.Linear weight), f32 accumulate, y f32 or bf16 (rows ld_y apart).
// Why: at M = 1 cuBLAS picks split-K GEMMs plus a reduce kernel and streams a few hundred GB/s of a decode step's
// 2–300 MB of bf16 weights (bench/RESULTS.md "Speed on the H200" §5: 4.4 ms of the K2.6 TP8 rank-0 step against a
// 1.06 ms byte floor), and its tiles and splits follow M, so a tree verify's rows sum in another order than the
// AR step's row (issue 26 item 3).
// CPU twin: engine cpu::ops::matmul_bf16 (same products, f32 sums in another order). Wrapper:
// engine/src/cuda/ops/gemm_bf16.rs (`small`). Tests: engine/tests/cuda_gemm.rs (`gemm_bf16_parity`,
// `small_gemm_rows_do_not_depend_on_the_row_count`). Bench: engine/tests/cuda_bench.rs
// (`gemm_bf16_step_shapes`, and `gemm_bf16 … small` in `w4a16_bandwidth`).
// Measured (H200, bench/RESULTS.md 2026-12-04): 0.79–1.12× cuBLAS at M = 1 on the K2.6 TP8 rank-0 shapes, 1.2–3×
// slower from M = 17 (the last CTA's sum is a chain of L2 round trips that grows with the rows). So it is the
// batch-invariant forwards' bf16 GEMM and opt-in elsewhere (KDTREE_SMALL_GEMM_ROWS).
//
// Layout: swapped operands, y^T = W x^T, so W's rows fill the mma's 16-row A side and the tokens its 8-column B side
// (M = 1 wastes 7/8 of the tensor core's columns, which cost nothing here: the kernel is bound by W's bytes).
//   * A CTA is 4 warps; warp w owns output features n0 + 16 w .. + 16 (BN = 64 a CTA) and the CTA's k-range, in
//     steps of 64 k. Lane (g = lane / 4, q = lane % 4) loads the 16-byte chunks q and 4 + q of each step from W rows
//     g and g + 8 and from token g of each 8-token tile: a chunk's 8 k-values are, in order, the k-pairs 2q, 2q + 8
//     of two consecutive mma k16 steps. A and B take the same permutation of k, so the dot products are the true
//     ones. W goes global -> registers (plain 16-byte loads of a row, ST steps ahead); x goes through shared
//     memory in chunks of ST steps, two in flight (cp.async), read by all four warps.
//   * grid (ceil(N / 64), S k-splits, token groups of 8 MT): S and the steps a split takes depend on N, K and the
//     GPU's SM count only (the wrapper's plan, KDTREE_SMALL_CTAS_PER_SM a run), never on M. With S > 1 every CTA writes its f32 partial
//     ws[s, m, n] and the last CTA of its (column block, token group) to arrive (an arrival counter, reset by that
//     CTA) sums the S partials in split order.
// Sum order of y[m, n]: within a split, the k-steps ascending, in each step four mma k16 steps in chunk order, each
// element of an mma a function of its own row of A and column of B; then the splits in ascending order (0 +
// p0 + p1 ...). None of it depends on M, the token's place in its tile, or the tile's other tokens: a row's bits
// are the same in a call of 1 row and in a call of 2,048.
// Weight loads are streaming (evict-first) and issued before griddepcontrol.wait, so with programmatic dependent
// launch they overlap the previous kernel's tail; x, the workspace, the counters and y are touched after it.
#include "common.cuh"

namespace gemm_small {

constexpr int WARPS = 4;
constexpr int BN = 16 * WARPS;  // output features a CTA

// Steps whose weight loads are in flight at once, by token tiles (registers: 16 a stage, 4 MT accumulators).
template <int MT> struct Stages { static constexpr int value = MT <= 2 ? 4 : 2; };

__device__ __forceinline__ uint4 ld_w(const uint4* p) { return __ldcs(p); }

template <typename O> __device__ __forceinline__ void store(O* p, float v);
template <> __device__ __forceinline__ void store<float>(float* p, float v) { *p = v; }
template <> __device__ __forceinline__ void store<bf16>(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

template <int MT, typename O>
__device__ __forceinline__ void gemm(const bf16* __restrict__ x, int ld_x, int M, const bf16* __restrict__ w, int N,
                                     int K, int steps_per_split, float* __restrict__ ws, O* __restrict__ y, int ld_y,
                                     unsigned* __restrict__ counters) {
    constexpr int ST = Stages<MT>::value;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int nb0 = blockIdx.x * BN, n0 = nb0 + 16 * warp;
    const int chunks = K / 8;  // 16-byte chunks a row (K % 8 == 0)
    const int steps = (chunks + 7) / 8;
    const int s_lo = blockIdx.y * steps_per_split, s_hi = min(steps, s_lo + steps_per_split);
    const int m0 = blockIdx.z * 8 * MT;
    const bool va = n0 + g < N, vb = n0 + g + 8 < N;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)(va ? n0 + g : 0) * K);
    const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)(vb ? n0 + g + 8 : 0) * K);

    // wr[stage]: chunks q and 4 + q of rows g (0, 1) and g + 8 (2, 3) of one step.
    uint4 wr[ST][4];
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int st = 0; st < ST; st++) {
        const int s = s_lo + st, c0 = 8 * s + q, c1 = 8 * s + 4 + q;
        const bool on = s < s_hi;
        wr[st][0] = on && va && c0 < chunks ? ld_w(wa + c0) : zero;
        wr[st][1] = on && va && c1 < chunks ? ld_w(wa + c1) : zero;
        wr[st][2] = on && vb && c0 < chunks ? ld_w(wb + c0) : zero;
        wr[st][3] = on && vb && c1 < chunks ? ld_w(wb + c1) : zero;
    }
    kdtree::pdl_trigger();
    kdtree::pdl_wait();

    // x through shared memory, ST steps a chunk, two chunks in flight (cp.async): xs[buf][row][chunk], 8 ST
    // chunks a row; odd rows swap their chunk halves (c ^ 4) so that a warp's 16-byte reads of rows g and g + 1
    // fall on different banks.
    constexpr int ROWS = 8 * MT, RC = 8 * ST;
    __shared__ uint4 xs[2][ROWS][RC];
    auto stage_x = [&](int buf, int s_first) {
        for (int i = threadIdx.x; i < ROWS * RC; i += 128) {
            const int r = i / RC, c = i % RC, gc = 8 * s_first + c, m = m0 + r;
            const bool full = m < M && gc < chunks && s_first + c / 8 < s_hi;
            const bf16* src = full ? x + (size_t)m * ld_x + 8 * gc : x;
            kdtree::cp_async16(&xs[buf][r][c ^ ((r & 1) << 2)], src, full);
        }
        kdtree::cp_async_commit();
    };

    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;

    stage_x(0, s_lo);
    for (int s0 = s_lo, it = 0; s0 < s_hi; s0 += ST, it++) {
        const int buf = it & 1;
        if (s0 + ST < s_hi)
            stage_x(buf ^ 1, s0 + ST);
        else
            kdtree::cp_async_commit();  // an empty group keeps the count: wait<1> below waits for this chunk
        kdtree::cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int st = 0; st < ST; st++) {
            const int s = s0 + st;
            if (s < s_hi) {
#pragma unroll
                for (int j = 0; j < MT; j++) {
                    const int r = 8 * j + g, sw = (r & 1) << 2;
                    const uint4 xa = xs[buf][r][(8 * st + q) ^ sw], xb = xs[buf][r][(8 * st + 4 + q) ^ sw];
                    kdtree::mma_bf16(acc[j], wr[st][0].x, wr[st][2].x, wr[st][0].y, wr[st][2].y, xa.x, xa.y);
                    kdtree::mma_bf16(acc[j], wr[st][0].z, wr[st][2].z, wr[st][0].w, wr[st][2].w, xa.z, xa.w);
                    kdtree::mma_bf16(acc[j], wr[st][1].x, wr[st][3].x, wr[st][1].y, wr[st][3].y, xb.x, xb.y);
                    kdtree::mma_bf16(acc[j], wr[st][1].z, wr[st][3].z, wr[st][1].w, wr[st][3].w, xb.z, xb.w);
                }
            }
            // Refill this stage with the step ST ahead.
            const int sn = s + ST, c0 = 8 * sn + q, c1 = 8 * sn + 4 + q;
            const bool on = sn < s_hi;
            wr[st][0] = on && va && c0 < chunks ? ld_w(wa + c0) : zero;
            wr[st][1] = on && va && c1 < chunks ? ld_w(wa + c1) : zero;
            wr[st][2] = on && vb && c0 < chunks ? ld_w(wb + c0) : zero;
            wr[st][3] = on && vb && c1 < chunks ? ld_w(wb + c1) : zero;
        }
        __syncthreads();  // this buffer is refilled two chunks on
    }

    // acc[j][e]: feature n0 + g + 8 (e >> 1), token m0 + 8 j + 2 q + (e & 1).
    const int splits = gridDim.y;
    if (splits == 1) {
#pragma unroll
        for (int j = 0; j < MT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = n0 + g + 8 * (e >> 1), m = m0 + 8 * j + 2 * q + (e & 1);
                if (n < N && m < M) store<O>(y + (size_t)m * ld_y + n, acc[j][e]);
            }
        return;
    }
    float* wsl = ws + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int j = 0; j < MT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = n0 + g + 8 * (e >> 1), m = m0 + 8 * j + 2 * q + (e & 1);
            if (n < N && m < M) wsl[(size_t)m * N + n] = acc[j][e];
        }
    // The last of the S CTAs of this (column block, token group) to arrive sums the partials in split order.
    __shared__ unsigned is_last;
    unsigned* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) == (unsigned)(splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (threadIdx.x == 0) *counter = 0u;
    const int cols = min(BN, N - nb0), rows = min(8 * MT, M - m0), total = rows * cols;
    const size_t split_stride = (size_t)M * N;
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
        const size_t off = (size_t)(m0 + c / cols) * N + nb0 + c % cols;
        float a = 0.f;
#pragma unroll 8
        for (int sp = 0; sp < splits; sp++) a += __ldcg(ws + sp * split_stride + off);
        store<O>(y + (size_t)(m0 + c / cols) * ld_y + nb0 + c % cols, a);
    }
}

}  // namespace gemm_small

// x [M, ld_x] bf16, w [N, K] bf16, y [M, ld_y]; ws [S, M, N] f32 (S > 1), counters [gridDim.z * gridDim.x] (zero
// between launches); grid (ceil(N / 64), S, ceil(M / (8 MT))), block 128.
#define GEMM_SMALL_F32_KERNEL(MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) kdtree_gemm_small_bf16_f32_m##MT(                           \
        const bf16* __restrict__ x, int ld_x, int M, const bf16* __restrict__ w, int N, int K, int steps_per_split,  \
        float* __restrict__ ws, float* __restrict__ y, int ld_y, unsigned* __restrict__ counters) {                \
        gemm_small::gemm<MT, float>(x, ld_x, M, w, N, K, steps_per_split, ws, y, ld_y, counters);                  \
    }
#define GEMM_SMALL_BF16_KERNEL(MT)                                                                                    \
    extern "C" __global__ void __launch_bounds__(128) kdtree_gemm_small_bf16_bf16_m##MT(                          \
        const bf16* __restrict__ x, int ld_x, int M, const bf16* __restrict__ w, int N, int K, int steps_per_split,  \
        float* __restrict__ ws, bf16* __restrict__ y, int ld_y, unsigned* __restrict__ counters) {                 \
        gemm_small::gemm<MT, bf16>(x, ld_x, M, w, N, K, steps_per_split, ws, y, ld_y, counters);                   \
    }
GEMM_SMALL_F32_KERNEL(1)
GEMM_SMALL_F32_KERNEL(2)
GEMM_SMALL_F32_KERNEL(4)
GEMM_SMALL_F32_KERNEL(8)
GEMM_SMALL_BF16_KERNEL(1)
GEMM_SMALL_BF16_KERNEL(2)
GEMM_SMALL_BF16_KERNEL(4)
GEMM_SMALL_BF16_KERNEL(8)
