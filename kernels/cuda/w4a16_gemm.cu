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
//   * each lane keeps up to four k-steps of weights in flight (256 bytes), all issued first: with the decode
//     plans (<= 4 k-steps per split) a block's whole weight slice is one round trip. The dense form issues
//     them before griddepcontrol.wait (programmatic dependent launch), so they overlap the previous kernel;
//   * grid (N / 128, S, row tiles): 4 warps per block share the staged x; every split writes f32 partials
//     ws[S, M, N], and the last split block of each (row block, tile) to arrive (an atomic counter, reset by
//     that block) sums them in split order (deterministic, the same sum whichever block is last) and rounds
//     to bf16. The host picks S so that there are >= 4 blocks per SM (M = 1 needs split-K to fill the GPU).
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

struct Tile {
    int count;          // rows in this tile (<= 8 * MT)
    const int* xrow;    // smem: x row per tile row
    const int* orow;    // smem: output row per tile row
};

// Where a CTA's results go: f32 partials ws[S, ws_rows, ld_ws] (column col0 + n), then, by the last of the S
// split CTAs of this (row block, tile) to arrive, bf16 out[row, col0 + n] (rows ld_out apart).
struct Out {
    float* ws;
    int ws_rows, ld_ws, col0;
    bf16* out;
    int ld_out;
    unsigned* counter;  // arrivals of this (row block, tile); 0 between launches (the last CTA resets it)
    int splits;
};

// x row r of the tile: plain (silu_off == 0), or silu(gate) * up of a [gate | up] row (up silu_off elements
// after gate), rounded to bf16 exactly as kdtree_silu_mul_bf16 does (the fused SwiGLU of the MoE down GEMM).
__device__ __forceinline__ uint4 load_x8(const bf16* src, int silu_off) {
    uint4 v = *reinterpret_cast<const uint4*>(src);
    if (silu_off == 0) return v;
    const uint4 u = *reinterpret_cast<const uint4*>(src + silu_off);
    const bf162* g2 = reinterpret_cast<const bf162*>(&v);
    const bf162* u2 = reinterpret_cast<const bf162*>(&u);
    uint4 r;
    bf162* r2 = reinterpret_cast<bf162*>(&r);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 g = __bfloat1622float2(g2[i]), uu = __bfloat1622float2(u2[i]);
        const float s0 = g.x * (1.0f / (1.0f + expf(-g.x))), s1 = g.y * (1.0f / (1.0f + expf(-g.y)));
        r2[i] = __halves2bfloat162(__float2bfloat16_rn(s0 * uu.x), __float2bfloat16_rn(s1 * uu.y));
    }
    return r;
}

// One 128-k step of a warp: weights w (4 rows x 16 B) with scales s, x from smem at xs.
template <int MT>
__device__ __forceinline__ void k_step(float (&acc)[2][MT][4], const uint4 (&w)[4], const bf16 (&s)[4],
                                       const unsigned char* xs, int rs) {
    bf162 sc[4];
#pragma unroll
    for (int i = 0; i < 4; i++) sc[i] = __halves2bfloat162(s[i], s[i]);
#pragma unroll
    for (int st = 0; st < 8; st++) {
        const int word = st >> 1, j = (st & 1) * 2;
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t v = word == 0 ? w[i].x : word == 1 ? w[i].y : word == 2 ? w[i].z : w[i].w;
            lo[i] = deq2(v, 4 * j, sc[i]);
            hi[i] = deq2(v, 4 * (j + 1), sc[i]);
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const uint2 b = *reinterpret_cast<const uint2*>(xs + m * 8 * rs + word * 16 + 4 * j);
            kdtree::mma_bf16(acc[0][m], lo[0], lo[1], hi[0], hi[1], b.x, b.y);
            kdtree::mma_bf16(acc[1][m], lo[2], lo[3], hi[2], hi[3], b.x, b.y);
        }
    }
}

// One CTA: rows [n0, n0 + 128) of one weight matrix, k-blocks [kb_lo, kb_hi), one row tile. ST k-steps of
// weights are in flight per lane (ST x 64 bytes), all issued before anything else: with kbps <= ST (the
// decode plans) a CTA's whole weight slice is one round trip, and it overlaps the previous kernel's tail.
template <int MT, int ST>
__device__ __forceinline__ void w4a16_cta(const bf16* __restrict__ x, int ld_x, int silu_off,
                                          const uint8_t* __restrict__ packed, const bf16* __restrict__ scales,
                                          int N, int K, int kbps, int kb_lo, int kb_hi, int n0, Tile tile, Out o,
                                          unsigned char* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rs = smem_row_stride(kbps);
    const int nkb = kb_hi - kb_lo;

    const int n_warp = n0 + warp * ROWS_PER_WARP;
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
    uint4 w[ST][4];
    bf16 s[ST][4];
#pragma unroll
    for (int st = 0; st < ST; st++) {
        const bool on = active && st < nkb;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[st][i] = on ? ld_stream(wp[i] + (size_t)(kb_lo + st) * 64) : make_uint4(0, 0, 0, 0);
            s[st][i] = on ? sp[i][(size_t)(kb_lo + st) * 4] : __float2bfloat16_rn(0.f);
        }
    }
    kdtree::pdl_trigger();
    kdtree::pdl_wait();

    // Stage x[tile rows, kb_lo*128 .. kb_hi*128) into smem, permuted (k0 k4 k1 k5 k2 k6 k3 k7 per 8-k chunk).
    const int chunks_per_row = nkb * (KB / 8);
    for (int c = threadIdx.x; c < tile.count * chunks_per_row; c += blockDim.x) {
        const int r = c / chunks_per_row, ck = c % chunks_per_row;
        const uint4 v = load_x8(x + (size_t)tile.xrow[r] * ld_x + (size_t)kb_lo * KB + ck * 8, silu_off);
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
        // A ring of ST steps: step kb uses slot (kb - kb_lo) % ST, then refills it with step kb + ST.
        for (int kb0 = kb_lo; kb0 < kb_hi; kb0 += ST) {
#pragma unroll
            for (int st = 0; st < ST; st++) {
                const int kb = kb0 + st;
                if (kb < kb_hi) {
                    k_step<MT>(acc, w[st], s[st], smem + g * rs + ((kb - kb_lo) * 4 + t) * GROUP_BYTES_SMEM, rs);
                    if (kb + ST < kb_hi) {
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            w[st][i] = ld_stream(wp[i] + (size_t)(kb + ST) * 64);
                            s[st][i] = sp[i][(size_t)(kb + ST) * 4];
                        }
                    }
                }
            }
        }
        float* wsl = o.ws + (size_t)blockIdx.y * o.ws_rows * o.ld_ws + o.col0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int n = n_warp + 16 * i + g;
#pragma unroll
            for (int m = 0; m < MT; m++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = m * 8 + 2 * t + (e & 1);
                    const int nn = n + (e >> 1) * 8;
                    if (r < tile.count) wsl[(size_t)tile.orow[r] * o.ld_ws + nn] = acc[i][m][e];
                }
            }
        }
    }

    // Split-K reduction in the GEMM: the last of the S CTAs of this (row block, tile) to arrive sums the S
    // partials in split order (deterministic: the same sum whichever CTA is last) and rounds to bf16.
    __shared__ unsigned is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(o.counter, 1u) == (unsigned)(o.splits - 1);
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (threadIdx.x == 0) *o.counter = 0u;
    // Up to four outputs per thread at a time (only real ones), their S partials loaded ahead of the
    // (in-order) sums.
    const int cols = min(ROWS_PER_CTA, N - n0), total = tile.count * cols;
    const size_t split_stride = (size_t)o.ws_rows * o.ld_ws;
    for (int c0 = threadIdx.x; c0 < total; c0 += 4 * blockDim.x) {
        const int nj = min(4, (total - c0 + (int)blockDim.x - 1) / (int)blockDim.x);
        size_t off[4];
        float a[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = min(c0 + j * (int)blockDim.x, total - 1);
            off[j] = (size_t)tile.orow[c / cols] * o.ld_ws + o.col0 + n0 + c % cols;
            a[j] = 0.f;
        }
        if (nj == 1) {
#pragma unroll 8
            for (int sp_ = 0; sp_ < o.splits; sp_++) a[0] += __ldcg(o.ws + sp_ * split_stride + off[0]);
        } else {
#pragma unroll 4
            for (int sp_ = 0; sp_ < o.splits; sp_++) {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (j < nj) a[j] += __ldcg(o.ws + sp_ * split_stride + off[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = c0 + j * (int)blockDim.x;
            if (j < nj && c < total) o.out[(size_t)tile.orow[c / cols] * o.ld_out + o.col0 + n0 + c % cols] = __float2bfloat16_rn(a[j]);
        }
    }
}

// Steps in flight per lane by row tile (registers: 16 per step, plus 8 MT accumulators). The SwiGLU staging (the
// down projection, K = a TP slice of the expert's width: 2 k-steps on a K2.6 TP8 rank) keeps 2: 112 / 127 registers
// at m1 / m2 instead of 167 / 168, four CTAs an SM. The stages change when a load is issued, not the sums' order.
template <int MT, bool SILU = false> struct Stages { static constexpr int value = (MT == 4 || SILU) ? 2 : 4; };

}  // namespace w4a16

using namespace w4a16;

// Dense: x [M, ld_x] bf16, packed [N, K/2] u8, scales [N, K/32] bf16 -> out [M, ld_out] bf16 through the f32
// workspace ws [S, M, N] and counters [tiles * ceil(N / 128)] (zero between launches).
// Grid (ceil(N / 128), S, ceil(M / (8 MT))), block 128, dynamic smem 8 MT * row stride (wrapper computes it).
#define DENSE_KERNEL(MT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) kdtree_w4a16_gemm_i4g32_m##MT(                         \
        const bf16* __restrict__ x, int ld_x, int M, const uint8_t* __restrict__ packed,                      \
        const bf16* __restrict__ scales, int N, int K, int kbps, float* __restrict__ ws,                     \
        bf16* __restrict__ out, int ld_out, unsigned* __restrict__ counters) {                               \
        extern __shared__ __align__(16) unsigned char smem[];                                                \
        __shared__ int rows[8 * MT];                                                                          \
        const int r0 = blockIdx.z * 8 * MT;                                                                   \
        if (threadIdx.x < 8 * MT) rows[threadIdx.x] = r0 + threadIdx.x;                                      \
        const int nkb = K / KB, kb_lo = blockIdx.y * kbps, kb_hi = min(nkb, kb_lo + kbps);                   \
        Tile tile{min(8 * MT, M - r0), rows, rows};                                                           \
        Out o{ws, M, N, 0, out, ld_out, counters + blockIdx.z * gridDim.x + blockIdx.x, (int)gridDim.y};     \
        __syncthreads();                                                                                       \
        w4a16_cta<MT, Stages<MT>::value>(x, ld_x, 0, packed, scales, N, K, kbps, kb_lo, kb_hi,               \
                                         blockIdx.x * ROWS_PER_CTA, tile, o, smem);                          \
    }
DENSE_KERNEL(1)
DENSE_KERNEL(2)
DENSE_KERNEL(4)

// Grouped MoE: rows are P = T * top_k (token, slot) pairs; x row of pair p is p / x_row_div (top_k for the
// gate/up projections, whose input is the token's hidden state; 1 for down, whose input is per pair). With
// silu_off > 0 the x row is silu(gate) * up of a [gate | up] row (the down projection after a fused
// gate+up). nmat weight matrices (1, or 2: gate and up in one launch, written side by side as out[p] =
// [gate | up], 2N wide): packed{0,1} [E, N, K/2], scales{0,1} [E, N, K/32]; sorted [P], tiles [3, max_tiles]
// (expert, start, count) and n_tiles [1] come from kdtree_moe_align_i32. ws [S, P, nmat N] f32, counters
// [max_tiles * nmat * ceil(N / 128)]. Grid (nmat * ceil(N / 128), S, max_tiles).
// Two kernels a tile size: `_m*` reads plain x rows (silu_off must be 0; without the SwiGLU path the m1 kernel
// takes 127 registers, so four CTAs an SM fit, against 167 and three with it), `_silu_m*` the SwiGLU of
// [gate | up] rows (silu_off > 0; two stages: 112 registers at m1). The same arithmetic either way.
#define GROUPED_ARGS                                                                                            \
        const bf16* __restrict__ x, int ld_x, int x_row_div, int silu_off, int P,                               \
        const int* __restrict__ sorted, const int* __restrict__ tiles, int max_tiles,                           \
        const int* __restrict__ n_tiles, const uint8_t* __restrict__ packed0,                                   \
        const bf16* __restrict__ scales0, const uint8_t* __restrict__ packed1,                                  \
        const bf16* __restrict__ scales1, int nmat, int N, int K, int kbps, float* __restrict__ ws,             \
        bf16* __restrict__ out, int ld_out, unsigned* __restrict__ counters
#define GROUPED_BODY(MT, SILU)                                                                                  \
    {                                                                                                           \
        extern __shared__ __align__(16) unsigned char smem[];                                                   \
        __shared__ int xrow[8 * MT], orow[8 * MT];                                                              \
        const int z = blockIdx.z;                                                                               \
        kdtree::pdl_wait(); /* the routing comes from the kernel before: no weight prefetch ahead of it here */         \
        if (z >= *n_tiles) return;                                                                              \
        const int e = tiles[z], start = tiles[max_tiles + z], count = tiles[2 * max_tiles + z];                 \
        if (threadIdx.x < 8 * MT) {                                                                             \
            const int p = threadIdx.x < count ? sorted[start + threadIdx.x] : 0;                                \
            orow[threadIdx.x] = p;                                                                              \
            xrow[threadIdx.x] = p / x_row_div;                                                                  \
        }                                                                                                       \
        const int nbx = gridDim.x / nmat, mat = blockIdx.x / nbx;                                               \
        const uint8_t* packed = mat == 0 ? packed0 : packed1;                                                   \
        const bf16* scales = mat == 0 ? scales0 : scales1;                                                      \
        const int nkb = K / KB, kb_lo = blockIdx.y * kbps, kb_hi = min(nkb, kb_lo + kbps);                      \
        Tile tile{count, xrow, orow};                                                                           \
        Out o{ws, P, nmat * N, mat * N, out, ld_out, counters + z * gridDim.x + blockIdx.x, (int)gridDim.y};    \
        __syncthreads();                                                                                        \
        w4a16_cta<MT, Stages<MT, SILU>::value>(x, ld_x, SILU ? silu_off : 0, packed + (size_t)e * N * (K / 2), \
                                         scales + (size_t)e * N * (K / 32), N, K, kbps, kb_lo, kb_hi,           \
                                         (blockIdx.x % nbx) * ROWS_PER_CTA, tile, o, smem);                     \
    }
#define GROUPED_KERNEL(MT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) kdtree_moe_w4a16_gemm_i4g32_m##MT(GROUPED_ARGS)         \
        GROUPED_BODY(MT, false)
#define GROUPED_SILU_KERNEL(MT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) kdtree_moe_w4a16_gemm_i4g32_silu_m##MT(GROUPED_ARGS)    \
        GROUPED_BODY(MT, true)
GROUPED_KERNEL(1)
GROUPED_KERNEL(2)
GROUPED_KERNEL(4)
GROUPED_SILU_KERNEL(1)
GROUPED_SILU_KERNEL(2)
GROUPED_SILU_KERNEL(4)

// ---------------------------------------------------------------------------------------------------------
// Large-M grouped form (prefill: tens to thousands of rows per expert), kdtree_moe_w4a16_gemm_i4g32_large.
// The small-M form above dequantises a weight once per 32-row tile and sums k-splits through an f32
// workspace; at prefill sizes that runs at ~22 TFLOP/s (ncu, 16K-token prefill of the K2.6 TP8 rank-0
// slice, run 78). Here a CTA computes a 128 (weight rows n) x 128 (pairs) tile over the whole K, so each weight
// is dequantised once per 128 pairs, with no workspace and no split.
// Batch invariance: a pair's output is the bits the small form gives it whenever that form runs one split (at
// K <= 512 from 5 pairs on: the trained pair's experts, a TP8 rank's down projection), so a row does not change
// when more rows (a batch) tip the engine into this form. At K = 7168 the small form always splits K (its x
// slice must fit the shared memory), so K2.6's gate|up rows still differ between the forms in their last bits. Hence the same k order inside every mma as the small form (per 128-k block,
// steps st = 0..7: lane quad t supplies group t's word st / 2, nibble pairs (j, j + 4) and (j + 1, j + 5),
// j = 2 (st % 2)), the same dequantisation (deq2: bf16((q - 8) s), rounded once), one f32 accumulator chain
// per output (k blocks ascending, steps in order) and the same final rounding (bf16(0 + acc)).
//   * stages of BK = 128 k through shared memory by cp.async, double-buffered: x rows of the tile (gathered by
//     the routing, 256 bytes a row, 16-byte chunk c = 4 group + word stored at c ^ 2 (c / 8 % 2) ^ (row % 2):
//     a quarter-warp's eight 16-byte reads (two rows, four groups) hit eight distinct bank groups; rows past
//     the tile's count are zero-filled), the weight rows' 64 packed bytes and their four group scales;
//   * 4 warps, 2 (n) x 2 (pairs), each 64 n x 64 pairs: A = weights (m16 tiles over n) dequantised in
//     registers from a 4-byte word of its group, B = x, one 16-byte read per n8 tile and word, its (k, k + 4)
//     pairs made by byte_perm; mma.sync m16n8k16, f32 accumulate;
//   * the tile goes out through shared memory as 16-byte row segments, rounded to bf16.
// Rows: pair p = sorted[start + r] of tile (expert, start, count) from kdtree_moe_align_i32 at 128 rows a
// tile; x row p / x_row_div; out row p, columns col0 + n (col0 = matrix * N: gate and up side by side).
// Limits (wrapper checks): K % 128 == 0, N % 8 == 0, ld_x and ld_out multiples of 8, x and out 16-byte aligned.
namespace w4a16_large {

constexpr int BM = 128;     // pairs per tile
constexpr int BN = 128;     // weight rows per CTA
constexpr int BK = 128;     // k per stage (four groups: one block of the small form)
constexpr int STAGES = 2;
constexpr int THREADS = 128;
constexpr int X_BYTES = BM * BK * 2;      // 32768
constexpr int W_BYTES = BN * BK / 2;      // 8192
constexpr int S_BYTES = BN * 8;           // 1024: four bf16 scales a row
constexpr int STAGE_BYTES = X_BYTES + W_BYTES + S_BYTES;
constexpr int SMEM = STAGES * STAGE_BYTES;  // 83968
constexpr int C_LD = BN + 8;                // epilogue tile row (bf16), 272 bytes
static_assert(2 * SMEM <= 227 * 1024, "two CTAs an SM on sm_90");
static_assert(BM * C_LD * 2 <= SMEM, "the epilogue tile fits the stages' memory");

__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool full) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(kdtree::smem_addr(dst)), "l"(src),
                 "r"(full ? 8 : 0)
                 : "memory");
}

// Byte offset of x chunk c (0..15: group c / 4, word c % 4) of tile row r in a stage.
__device__ __forceinline__ int x_off(int r, int c) { return r * (BK * 2) + ((c ^ (((c >> 3) & 1) << 1) ^ (r & 1)) << 4); }

}  // namespace w4a16_large

// Grid (nmat * ceil(N / 128), max_tiles), block 128, dynamic smem w4a16_large::SMEM. Arguments as the grouped
// small-M form, without silu, split and workspace.
extern "C" __global__ void __launch_bounds__(w4a16_large::THREADS, 2) kdtree_moe_w4a16_gemm_i4g32_large(
    const bf16* __restrict__ x, int ld_x, int x_row_div, const int* __restrict__ sorted,
    const int* __restrict__ tiles, int max_tiles, const int* __restrict__ n_tiles,
    const uint8_t* __restrict__ packed0, const bf16* __restrict__ scales0, const uint8_t* __restrict__ packed1,
    const bf16* __restrict__ scales1, int nmat, int N, int K, bf16* __restrict__ out, int ld_out) {
    using namespace w4a16_large;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int xrow[BM], orow[BM];
    const int z = blockIdx.y;
    kdtree::pdl_wait();  // the routing and x come from the kernels before
    kdtree::pdl_trigger();
    if (z >= *n_tiles) return;
    const int e = tiles[z], start = tiles[max_tiles + z], count = tiles[2 * max_tiles + z];
    const int nbx = gridDim.x / nmat, mat = blockIdx.x / nbx, n0 = (blockIdx.x % nbx) * BN;
    const uint8_t* packed = (mat == 0 ? packed0 : packed1) + (size_t)e * N * (K / 2);
    const bf16* scales = (mat == 0 ? scales0 : scales1) + (size_t)e * N * (K / 32);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int r = tid; r < BM; r += THREADS) {
        const int p = r < count ? sorted[start + r] : -1;
        orow[r] = p;
        xrow[r] = p < 0 ? -1 : p / x_row_div;
    }
    __syncthreads();

    const int nk = K / BK;
    // Stage kt into slot: x 2048 chunks (16 a thread), weights 512 (4 a thread), scales 128 x 8 bytes (1 a thread).
    auto load = [&](int slot, int kt) {
        unsigned char* xs = smem + slot * STAGE_BYTES;
        unsigned char* wsm = xs + X_BYTES;
        unsigned char* ssm = wsm + W_BYTES;
        const int k0 = kt * BK;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int c = tid + j * THREADS, r = c >> 4, ch = c & 15;
            const int xr = xrow[r];
            const bf16* src = x + (size_t)(xr < 0 ? 0 : xr) * ld_x + k0 + ch * 8;
            kdtree::cp_async16(xs + x_off(r, ch), src, xr >= 0);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = tid + j * THREADS, r = c >> 2, h = c & 3;
            const bool ok = n0 + r < N;
            const uint8_t* src = packed + (size_t)(ok ? n0 + r : 0) * (K / 2) + k0 / 2 + h * 16;
            kdtree::cp_async16(wsm + r * 64 + h * 16, src, ok);
        }
        {
            const bool ok = n0 + tid < N;
            cp_async8(ssm + tid * 8, scales + (size_t)(ok ? n0 + tid : 0) * (K / 32) + k0 / 32, ok);
        }
    };

    const int wn = warp & 1, wm = warp >> 1;  // warp's 64 weight rows and 64 pairs
    const int g = lane >> 2, t = lane & 3;
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) load(s, s);
        kdtree::cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        kdtree::cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage kt landed for every thread; slot (kt - 1) % STAGES is free
        if (kt + STAGES - 1 < nk) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        kdtree::cp_async_commit();
        const unsigned char* xs = smem + (kt % STAGES) * STAGE_BYTES;
        const unsigned char* wsm = xs + X_BYTES;
        const bf16* ssm = reinterpret_cast<const bf16*>(wsm + W_BYTES);
#pragma unroll 1  // unrolled, ptxas hoists the four words' addresses and spills (255 registers); rolled, 216
        for (int w = 0; w < 4; w++) {  // word w of group t: small-form steps 2w (j = 0) and 2w + 1 (j = 2)
            uint32_t b[8][2][2];
#pragma unroll
            for (int jt = 0; jt < 8; jt++) {
                const uint4 v = *reinterpret_cast<const uint4*>(xs + x_off(wm * 64 + jt * 8 + g, 4 * t + w));
                b[jt][0][0] = __byte_perm(v.x, v.z, 0x5410);  // (k0, k4)
                b[jt][0][1] = __byte_perm(v.x, v.z, 0x7632);  // (k1, k5)
                b[jt][1][0] = __byte_perm(v.y, v.w, 0x5410);  // (k2, k6)
                b[jt][1][1] = __byte_perm(v.y, v.w, 0x7632);  // (k3, k7)
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r0 = wn * 64 + i * 16 + g;
                const uint32_t w0 = *reinterpret_cast<const uint32_t*>(wsm + r0 * 64 + t * 16 + w * 4);
                const uint32_t w1 = *reinterpret_cast<const uint32_t*>(wsm + (r0 + 8) * 64 + t * 16 + w * 4);
                const bf16 s0 = ssm[r0 * 4 + t], s1 = ssm[(r0 + 8) * 4 + t];  // group t's scales
                const bf162 sc0 = __halves2bfloat162(s0, s0), sc1 = __halves2bfloat162(s1, s1);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * h;
                    const uint32_t lo0 = deq2(w0, 4 * j, sc0), lo1 = deq2(w1, 4 * j, sc1);
                    const uint32_t hi0 = deq2(w0, 4 * (j + 1), sc0), hi1 = deq2(w1, 4 * (j + 1), sc1);
#pragma unroll
                    for (int jt = 0; jt < 8; jt++)
                        kdtree::mma_bf16(acc[i][jt], lo0, lo1, hi0, hi1, b[jt][h][0], b[jt][h][1]);
                }
            }
        }
    }
    kdtree::cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: the epilogue tile reuses their memory

    // C[n][pair] -> smem [pair][n] bf16 (0 + acc, rounded as the small form's split sum), then 16-byte
    // segments of out rows.
    bf16* ct = reinterpret_cast<bf16*>(smem);
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int n = wn * 64 + i * 16 + g, r = wm * 64 + j * 8 + 2 * t;
            ct[r * C_LD + n] = __float2bfloat16_rn(__fadd_rn(0.f, acc[i][j][0]));
            ct[(r + 1) * C_LD + n] = __float2bfloat16_rn(__fadd_rn(0.f, acc[i][j][1]));
            ct[r * C_LD + n + 8] = __float2bfloat16_rn(__fadd_rn(0.f, acc[i][j][2]));
            ct[(r + 1) * C_LD + n + 8] = __float2bfloat16_rn(__fadd_rn(0.f, acc[i][j][3]));
        }
    }
    __syncthreads();
    const int cols = min(BN, N - n0);
    for (int c = tid; c < BM * (BN / 8); c += THREADS) {
        const int r = c / (BN / 8), seg = c % (BN / 8);
        if (r < count && seg * 8 < cols) {
            *reinterpret_cast<uint4*>(out + (size_t)orow[r] * ld_out + mat * N + n0 + seg * 8) =
                *reinterpret_cast<const uint4*>(ct + r * C_LD + seg * 8);
        }
    }
}
