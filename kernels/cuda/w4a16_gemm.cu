// W4A16 group-32 GEMM on the converter's INT4 layout, tensor cores (mma.sync m16n8k16 bf16, f32 accumulate):
//   y[m, n] = sum_k x[m, k] * (q[n, k] * scale[n, k / 32]),   q = nibble - 8.
// CPU twin: engine cpu::ops::matmul_i4g32 (exact f32 dequant). Here each weight is dequantised to
// bf16(q * scale) (one rounding, as Marlin does) and x is bf16, products are exact, sums f32.
// Test: engine/tests/cuda_ops.rs (w4a16 cases, incl. K2.6 expert shapes). Bench: same file (timing test).
// Wrapper: engine/src/cuda/ops/w4a16_gemm.rs.
//
// Dimension letters: M rows of x (tokens, or (token, slot) pairs in the grouped MoE form), N outputs,
// K inputs (K % 128 == 0, N % 32 == 0), S split-K slices. Layout (formats/FORMAT.md, "i4g32"):
//   packed [E, N, K/2] u8, byte m of a row holds k = 2m in its low nibble and k = 2m + 1 in its high nibble;
//   scales [E, N, K/32] bf16.
// No repack: one 16-byte load of a row is exactly one 32-k group (one scale). The kernel uses that:
//   * a warp owns 32 output rows (two m16 tiles: A = weights, rows n) and walks 128-k blocks; lane
//     (g = lane / 4, t = lane % 4) loads group 4 * kb + t of rows g, g + 8, g + 16, g + 24 (4 x 16 B; a quad
//     reads 64 contiguous bytes of a row, fully coalesced), plus its 4 scales;
//   * the mma's k order inside a 128-block is permuted (a dot product does not care, as long as A and B
//     agree): in step s (0..7) lane t supplies the k of word s/2 of its own group, nibble pairs
//     (j, j + 4) and (j + 1, j + 5) with j = 2 (s % 2). Those pairs fall out of one lop3 each
//     ((w >> 4j) & 0x000F000F | 0x43004300 = bf16x2 (128 + n_j, 128 + n_{j+4})), then one bf16x2 sub and mul;
//   * x (B operand, 8 tokens per n8 tile) is staged once per block into shared memory in the same permuted
//     order: each 8-k chunk stored as k0 k4 k1 k5 k2 k6 k3 k7, so a lane's two B registers are one 8-byte
//     load. Each 32-k group is padded to 72 bytes and rows are padded so that row stride / 8 = 4 (mod 16):
//     the 16 lanes of a half-warp hit 16 distinct 8-byte bank pairs;
//   * each lane keeps three k-steps of weights in flight (the first two issued before x is staged);
//   * grid (N / 128, S, row tiles): 4 warps per block share the staged x; every split writes f32 partials
//     ws[S, M, N], and kdtree_w4a16_reduce_f32 sums them in split order (deterministic, no atomics) and rounds
//     to bf16. The host picks S so that there are >= 2 blocks per SM (M = 1 needs split-K to fill the GPU).
// Grouped MoE form (kdtree_moe_w4a16_gemm_i4g32): rows are (token, slot) pairs; kdtree_moe_align_i32
// (moe_align.cu) sorts them by expert on the device and emits row tiles (expert, start, count); blocks past
// the device-side tile count exit at once, so there is no host sync and the launch is graph-capturable.
#include "common.cuh"

// Named (not anonymous): build.rs compiles all op files as one translation unit.
namespace w4a16 {

constexpr int KB = 128;           // k per block step (4 groups of 32)
constexpr int WARPS = 4;          // warps per CTA
constexpr int ROWS_PER_WARP = 32;
constexpr int ROWS_PER_CTA = WARPS * ROWS_PER_WARP;
constexpr int GROUP_BYTES_SMEM = 72;  // 32 bf16 + 8 bytes of padding

__device__ __forceinline__ int smem_row_stride(int kbps) {
    const int groups = kbps * 4;
    int s8 = groups * (GROUP_BYTES_SMEM / 8);
    s8 += ((4 - s8) % 16 + 16) % 16;  // stride / 8 = 4 (mod 16)
    return s8 * 8;
}

__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ uint32_t as_u32(bf162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// Nibbles (sh / 4) and (sh / 4 + 4) of word w -> bf16x2 (q_lo * s, q_hi * s), each rounded once.
__device__ __forceinline__ uint32_t deq2(uint32_t w, int sh, bf162 s2) {
    const uint32_t m = ((w >> sh) & 0x000F000Fu) | 0x43004300u;  // bf16x2 (128 + n, 128 + n')
    bf162 v = *reinterpret_cast<const bf162*>(&m);
    const bf162 off = __floats2bfloat162_rn(136.f, 136.f);
    v = __hsub2(v, off);  // exact: n - 8
    return as_u32(__hmul2(v, s2));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Tile {
    int count;          // rows in this tile (<= 8 * MT)
    const int* xrow;    // smem: x row per tile row
    const int* orow;    // smem: output row per tile row
};

// One CTA: rows [n0, n0 + 128) of one weight matrix, k-blocks [kb_lo, kb_hi), one row tile.
template <int MT>
__device__ __forceinline__ void w4a16_cta(const bf16* __restrict__ x, int ld_x, const uint8_t* __restrict__ packed,
                                          const bf16* __restrict__ scales, int N, int K, int kbps, int kb_lo,
                                          int kb_hi, Tile tile, float* __restrict__ ws, int ws_rows,
                                          unsigned char* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rs = smem_row_stride(kbps);
    const int nkb = kb_hi - kb_lo;

    const int n_warp = blockIdx.x * ROWS_PER_CTA + warp * ROWS_PER_WARP;
    const bool active = n_warp < N;
    const size_t row_bytes = (size_t)K / 2, row_groups = (size_t)K / 32;
    const uint8_t* wp[4];
    const bf16* sp[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const size_t n = active ? (size_t)n_warp + g + 8 * i : 0;
        wp[i] = packed + n * row_bytes + (size_t)t * 16;
        sp[i] = scales + n * row_groups + t;
    }
    // Three k-steps of weights in flight per lane (192 bytes): the first two are issued before x is staged,
    // so the weight stream starts at once.
    uint4 w0[4], w1[4], w2[4];
    bf16 s0[4], s1[4], s2n[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w0[i] = w1[i] = w2[i] = make_uint4(0, 0, 0, 0);
        s0[i] = s1[i] = s2n[i] = __float2bfloat16_rn(0.f);
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w0[i] = ld_stream(wp[i] + (size_t)kb_lo * 64);
            s0[i] = sp[i][(size_t)kb_lo * 4];
            if (kb_lo + 1 < kb_hi) {
                w1[i] = ld_stream(wp[i] + (size_t)(kb_lo + 1) * 64);
                s1[i] = sp[i][(size_t)(kb_lo + 1) * 4];
            }
        }
    }

    // Stage x[tile rows, kb_lo*128 .. kb_hi*128) into smem, permuted (k0 k4 k1 k5 k2 k6 k3 k7 per 8-k chunk).
    const int chunks_per_row = nkb * (KB / 8);
    for (int c = threadIdx.x; c < tile.count * chunks_per_row; c += blockDim.x) {
        const int r = c / chunks_per_row, ck = c % chunks_per_row;
        const bf16* src = x + (size_t)tile.xrow[r] * ld_x + (size_t)kb_lo * KB + ck * 8;
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        // v holds bf16 pairs (k0,k1) (k2,k3) (k4,k5) (k6,k7); produce (k0,k4) (k1,k5) (k2,k6) (k3,k7).
        uint2 lo, hi;
        lo.x = __byte_perm(v.x, v.z, 0x5410);
        lo.y = __byte_perm(v.x, v.z, 0x7632);
        hi.x = __byte_perm(v.y, v.w, 0x5410);
        hi.y = __byte_perm(v.y, v.w, 0x7632);
        unsigned char* dst = smem + r * rs + (ck / 4) * GROUP_BYTES_SMEM + (ck % 4) * 16;
        *reinterpret_cast<uint2*>(dst) = lo;
        *reinterpret_cast<uint2*>(dst + 8) = hi;
    }
    // Rows past the tile's count are zero (their outputs are never stored; zeros keep the mma finite).
    for (int c = threadIdx.x; c < (8 * MT - tile.count) * (rs / 16); c += blockDim.x) {
        const int r = tile.count + c / (rs / 16);
        *reinterpret_cast<uint4*>(smem + r * rs + (c % (rs / 16)) * 16) = make_uint4(0, 0, 0, 0);
    }
    __syncthreads();

    float acc[2][MT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][m][e] = 0.f;

    if (active) {
        for (int kb = kb_lo; kb < kb_hi; kb++) {
            if (kb + 2 < kb_hi) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    w2[i] = ld_stream(wp[i] + (size_t)(kb + 2) * 64);
                    s2n[i] = sp[i][(size_t)(kb + 2) * 4];
                }
            }
            bf162 sc[4];
#pragma unroll
            for (int i = 0; i < 4; i++) sc[i] = __halves2bfloat162(s0[i], s0[i]);
            const unsigned char* xs = smem + g * rs + ((kb - kb_lo) * 4 + t) * GROUP_BYTES_SMEM;
#pragma unroll
            for (int s = 0; s < 8; s++) {
                const int word = s >> 1, j = (s & 1) * 2;
                uint32_t lo[4], hi[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const uint32_t w = word == 0 ? w0[i].x : word == 1 ? w0[i].y : word == 2 ? w0[i].z : w0[i].w;
                    lo[i] = deq2(w, 4 * j, sc[i]);
                    hi[i] = deq2(w, 4 * (j + 1), sc[i]);
                }
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    const uint2 b = *reinterpret_cast<const uint2*>(xs + m * 8 * rs + word * 16 + 4 * j);
                    mma_bf16(acc[0][m], lo[0], lo[1], hi[0], hi[1], b.x, b.y);
                    mma_bf16(acc[1][m], lo[2], lo[3], hi[2], hi[3], b.x, b.y);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                w0[i] = w1[i];
                s0[i] = s1[i];
                w1[i] = w2[i];
                s1[i] = s2n[i];
            }
        }
    }
    if (n_warp >= N) return;
    float* wsl = ws + (size_t)blockIdx.y * ws_rows * N;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int n = n_warp + 16 * i + g;
#pragma unroll
        for (int m = 0; m < MT; m++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = m * 8 + 2 * t + (e & 1);
                const int nn = n + (e >> 1) * 8;
                if (r < tile.count) wsl[(size_t)tile.orow[r] * N + nn] = acc[i][m][e];
            }
        }
    }
}

}  // namespace w4a16

using namespace w4a16;

// Dense: x [M, ld_x] bf16, packed [N, K/2] u8, scales [N, K/32] bf16 -> ws [S, M, N] f32 partials.
// Grid (ceil(N / 128), S, ceil(M / (8 MT))), block 128, dynamic smem 8 MT * row stride (wrapper computes it).
#define DENSE_KERNEL(MT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) kdtree_w4a16_gemm_i4g32_m##MT(                         \
        const bf16* __restrict__ x, int ld_x, int M, const uint8_t* __restrict__ packed,                      \
        const bf16* __restrict__ scales, int N, int K, int kbps, float* __restrict__ ws) {                   \
        extern __shared__ __align__(16) unsigned char smem[];                                                \
        __shared__ int rows[8 * MT];                                                                          \
        const int r0 = blockIdx.z * 8 * MT;                                                                   \
        if (threadIdx.x < 8 * MT) rows[threadIdx.x] = r0 + threadIdx.x;                                      \
        const int nkb = K / KB, kb_lo = blockIdx.y * kbps, kb_hi = min(nkb, kb_lo + kbps);                   \
        Tile tile{min(8 * MT, M - r0), rows, rows};                                                           \
        __syncthreads();                                                                                       \
        w4a16_cta<MT>(x, ld_x, packed, scales, N, K, kbps, kb_lo, kb_hi, tile, ws, M, smem);                 \
    }
DENSE_KERNEL(1)
DENSE_KERNEL(2)
DENSE_KERNEL(4)

// Grouped MoE: rows are P = T * top_k (token, slot) pairs; x row of pair p is p / x_row_div (top_k for the
// gate/up projections, whose input is the token's hidden state; 1 for down, whose input is per pair).
// packed [E, N, K/2], scales [E, N, K/32]; sorted [P] and tiles [3, max_tiles] (expert, start, count) and
// n_tiles [1] come from kdtree_moe_align_i32. ws [S, P, N] f32. Grid (ceil(N / 128), S, max_tiles).
#define GROUPED_KERNEL(MT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) kdtree_moe_w4a16_gemm_i4g32_m##MT(                     \
        const bf16* __restrict__ x, int ld_x, int x_row_div, int P, const int* __restrict__ sorted,          \
        const int* __restrict__ tiles, int max_tiles, const int* __restrict__ n_tiles,                       \
        const uint8_t* __restrict__ packed, const bf16* __restrict__ scales, int N, int K, int kbps,         \
        float* __restrict__ ws) {                                                                              \
        extern __shared__ __align__(16) unsigned char smem[];                                                \
        __shared__ int xrow[8 * MT], orow[8 * MT];                                                           \
        const int z = blockIdx.z;                                                                             \
        if (z >= *n_tiles) return;                                                                            \
        const int e = tiles[z], start = tiles[max_tiles + z], count = tiles[2 * max_tiles + z];              \
        if (threadIdx.x < 8 * MT) {                                                                           \
            const int p = threadIdx.x < count ? sorted[start + threadIdx.x] : 0;                              \
            orow[threadIdx.x] = p;                                                                            \
            xrow[threadIdx.x] = p / x_row_div;                                                               \
        }                                                                                                      \
        const int nkb = K / KB, kb_lo = blockIdx.y * kbps, kb_hi = min(nkb, kb_lo + kbps);                   \
        Tile tile{count, xrow, orow};                                                                         \
        __syncthreads();                                                                                       \
        w4a16_cta<MT>(x, ld_x, packed + (size_t)e * N * (K / 2), scales + (size_t)e * N * (K / 32), N, K,    \
                      kbps, kb_lo, kb_hi, tile, ws, P, smem);                                                 \
    }
GROUPED_KERNEL(1)
GROUPED_KERNEL(2)
GROUPED_KERNEL(4)

// Split-K reduce: out[r, n] = bf16(sum_{s < S} ws[s, r, n]) in split order. out [rows, ld_out] bf16.
extern "C" __global__ void kdtree_w4a16_reduce_f32(const float* __restrict__ ws, int S, int rows, int N,
                                                   bf16* __restrict__ out, int ld_out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * N) return;
    const long long r = i / N, n = i % N;
    float a = 0.f;
    for (int s = 0; s < S; s++) a += ws[(size_t)s * rows * N + i];
    out[r * ld_out + n] = __float2bfloat16_rn(a);
}
