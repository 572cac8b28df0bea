// MLA decode attention: one query node (T = 1) of Hr <= 8 heads over the latent cache, K2.6's widths (C = 512
// latent + P = 64 rope columns a row), the split kernel's partials for kdtree_mla_attention_merge_bf16.
// CPU twin: the latent core of engine cpu::ops::mla_attention (absorbed form), as for mla_attention.cu:
// scores `scale * (q_lat · c_kv + q_pe · k_pe)` over every row [0, committed] (no mask at T = 1: the node sees
// the committed prefix and itself), softmax, `o_lat = Σ p · c_kv`.
// Test: engine/tests/cuda_mla.rs (mla_decode_parity). Wrapper: engine/src/cuda/ops/mla_decode.rs. Bench:
// engine/tests/cuda_bench_layers.rs (mla_verify, T = 1).
//
// Why a kernel of its own: the split kernel packs 16·MT query rows (node, head) into its mma tiles; at T = 1 with
// a TP8 rank's 8 heads that is 8 of 64 rows, one CTA an SM with two busy warps, and a CTA-wide barrier and a
// shared-memory softmax per 32-row chunk: 52 µs at 32K rows, 5.8x the bytes' floor (run 91). Here the latent rows
// are the mma's M dimension and the heads its N = 8, so no tile row is empty:
//   scores  Sᵀ[16 rows, 8 heads] = L[16 rows, 576] · Qᵀ (ldmatrix of the rows, of Q kept in shared memory;
//           four accumulator chains over the 36 k-steps, summed (0 + 1) + (2 + 3));
//   softmax per head over the rows (shuffles across the 8 row lanes of a column), running max and sum per warp;
//   values  Oᵀ[512, 8 heads] += L[16 rows, :512]ᵀ · Pᵀ (ldmatrix.trans of the same rows; P through 768 bytes of
//           shared memory to become the B operand, as its bf16 rounding and the remainder, ~17 bits, as the
//           split kernel keeps it), 128 f32 registers a lane.
// Each of the 4 warps streams its own 16-row tiles (tiles w, w + 4, ... of the split) through a private
// two-stage cp.async ring, so the loop has no CTA barrier; at the end the warps' (m, l, o) are merged in warp
// order through shared memory into the split's one (m, l, o). Rows of a split: [split · rps, +rps), rps =
// ceil(S / splits) rounded up to 32 when the host passes 0 (a captured step: the committed length is read
// from the device), as the split kernel divides them. A split's result depends on its rows only, not on Hr.
#include "common.cuh"

namespace mla_decode {
constexpr int C = 512, P = 64, LW = C + P;
constexpr int LDS = LW + 8;  // smem row (bf16): 1168 bytes, rows 4 banks apart: conflict-free ldmatrix
constexpr int HEADS = 8;     // the mma's N
constexpr int WARPS = 4, TILE = 16, STAGES = 2;
constexpr int PLD = TILE + 8;  // Pᵀ row (bf16) of a head: 48 bytes
constexpr int CHUNK = 32;      // rows per split are rounded to this when the kernel divides them
constexpr int SMEM = (HEADS * LDS + WARPS * STAGES * TILE * LDS + WARPS * 2 * HEADS * PLD) * 2;  // 161,920
static_assert(SMEM <= 227 * 1024, "one block of sm_90 holds it (sm_120 allows 99 KB: the wrapper keeps the split kernel there)");
static_assert(WARPS * HEADS * C * 4 <= WARPS * STAGES * TILE * LDS * 2, "the merge scratch fits the row buffers");
}  // namespace mla_decode

// q [Hr, 576] bf16 (q_lat | q_pe); lat [S, 576] bf16 (c_kv | k_pe), S = committed + 1 (the node's own row last);
// committed_dev [1] or null (then `committed`); rows_per_split <= 0: divided in the kernel. part_o [splits, Hr, 512]
// f32, part_ml [splits, Hr, 2] f32 (an empty split: m = -inf, l = 0, o = 0). Grid (splits), 128 threads,
// mla_decode::SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(128, 1) kdtree_mla_decode_bf16(const bf16* __restrict__ q,
                                                                           const bf16* __restrict__ lat,
                                                                           float* __restrict__ part_o,
                                                                           float* __restrict__ part_ml, int Hr,
                                                                           int committed,
                                                                           const int* __restrict__ committed_dev,
                                                                           int rows_per_split, float scale) {
    // Local names (one translation unit holds every kernel file: mla_attention.cu has an LDS and a PLD of its own).
    constexpr int C = mla_decode::C, LW = mla_decode::LW, LDS = mla_decode::LDS, HEADS = mla_decode::HEADS;
    constexpr int WARPS = mla_decode::WARPS, TILE = mla_decode::TILE, STAGES = mla_decode::STAGES;
    constexpr int PLD = mla_decode::PLD, CHUNK = mla_decode::CHUNK;
    using kdtree::cp_async16;
    using kdtree::cp_async_commit;
    extern __shared__ __align__(16) unsigned char decode_smem[];
    bf16* qs = reinterpret_cast<bf16*>(decode_smem);  // [HEADS][LDS]
    bf16* ks = qs + HEADS * LDS;                     // [WARPS][STAGES][TILE][LDS]
    bf16* ps = ks + WARPS * STAGES * TILE * LDS;     // [WARPS][hi, lo][HEADS][PLD]
    __shared__ float red_m[WARPS][HEADS], red_l[WARPS][HEADS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int jm = lane >> 3, rr = lane & 7;  // ldmatrix: this lane addresses row rr of matrix jm
    if (committed_dev) committed = committed_dev[0];
    const int S = committed + 1, split = blockIdx.x, splits = gridDim.x;
    if (rows_per_split <= 0) rows_per_split = ((S + splits - 1) / splits + CHUNK - 1) / CHUNK * CHUNK;
    const int s_begin = split * rows_per_split, s_end = min(S, s_begin + rows_per_split);
    const int n_tiles = s_end > s_begin ? (s_end - s_begin + TILE - 1) / TILE : 0;
    const int n_mine = n_tiles > warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;  // tiles warp, warp + 4, ...

    bf16* kw = ks + warp * STAGES * TILE * LDS;
    const auto load_tile = [&](int i) {  // this warp's i-th tile into stage i % 2; rows past the split are zeros
        const int s0 = s_begin + (warp + i * WARPS) * TILE;
        bf16* dst = kw + (i & 1) * TILE * LDS;
        for (int k = lane; k < TILE * (LW / 8); k += 32) {
            const int r = k / (LW / 8), col = (k % (LW / 8)) * 8;
            const bool ok = s0 + r < s_end;
            cp_async16(dst + r * LDS + col, ok ? lat + (size_t)(s0 + r) * LW + col : lat, ok);
        }
        cp_async_commit();
    };
    // The queries (zero rows past Hr) as one group, this warp's first tile as the next.
    for (int k = tid; k < HEADS * (LW / 8); k += blockDim.x) {
        const int h = k / (LW / 8), col = (k % (LW / 8)) * 8;
        cp_async16(qs + h * LDS + col, q + (size_t)(h < Hr ? h : 0) * LW + col, h < Hr);
    }
    cp_async_commit();
    if (n_mine > 0) load_tile(0);
    else cp_async_commit();
    kdtree::cp_async_wait<1>();
    __syncthreads();  // the queries, from every thread's copies

    // Running max and sum of heads 2 t4 and 2 t4 + 1 (the same in the 8 lanes of a column), Oᵀ[16 j + g (+8), head].
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[C / 16][4];
#pragma unroll
    for (int j = 0; j < C / 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    bf16* pw = ps + warp * 2 * HEADS * PLD;  // this warp's Pᵀ: [hi, lo][head][row]

    for (int i = 0; i < n_mine; i++) {
        if (i + 1 < n_mine) load_tile(i + 1);
        else cp_async_commit();
        kdtree::cp_async_wait<1>();
        __syncwarp();  // tile i from every lane's copies
        const bf16* kb = kw + (i & 1) * TILE * LDS;
        const int s0 = s_begin + (warp + i * WARPS) * TILE;

        // Scores: chain c takes the k-steps ≡ c (mod 4).
        float sc[4][4];
#pragma unroll
        for (int c = 0; c < 4; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[c][e] = 0.f;
        const bf16* la = kb + (rr + (jm & 1) * 8) * LDS + (jm >> 1) * 8;  // A: rows, k halves
        const bf16* qb = qs + rr * LDS + jm * 8;                          // B: heads, four 8-k blocks
#pragma unroll
        for (int k2 = 0; k2 < LW / 32; k2++) {
            uint32_t a[4], a2[4], b[4];
            kdtree::ldsm_x4(a, la + 32 * k2);
            kdtree::ldsm_x4(a2, la + 32 * k2 + 16);
            kdtree::ldsm_x4(b, qb + 32 * k2);
            kdtree::mma_bf16(sc[(2 * k2) & 3], a[0], a[1], a[2], a[3], b[0], b[1]);
            kdtree::mma_bf16(sc[(2 * k2 + 1) & 3], a2[0], a2[1], a2[2], a2[3], b[2], b[3]);
        }
        // sc: rows g (e = 0, 1) and g + 8 (e = 2, 3), heads 2 t4 + (e & 1).
        float s[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = s0 + g + (e >> 1) * 8;
            const float v = (sc[0][e] + sc[1][e]) + (sc[2][e] + sc[3][e]);
            s[e] = row < s_end ? v * scale : -INFINITY;
        }
        float c0 = fmaxf(s[0], s[2]), c1 = fmaxf(s[1], s[3]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            c0 = fmaxf(c0, __shfl_xor_sync(kdtree::FULL_MASK, c0, off));
            c1 = fmaxf(c1, __shfl_xor_sync(kdtree::FULL_MASK, c1, off));
        }
        const float n0 = fmaxf(m0, c0), n1 = fmaxf(m1, c1);
        const float a0 = n0 == -INFINITY ? 1.f : __expf(m0 - n0), a1 = n1 == -INFINITY ? 1.f : __expf(m1 - n1);
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float mn = (e & 1) ? n1 : n0;
            p[e] = s[e] == -INFINITY ? 0.f : __expf(s[e] - mn);
        }
        float sum0 = p[0] + p[2], sum1 = p[1] + p[3];
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            sum0 += __shfl_xor_sync(kdtree::FULL_MASK, sum0, off);
            sum1 += __shfl_xor_sync(kdtree::FULL_MASK, sum1, off);
        }
        l0 = l0 * a0 + sum0;
        l1 = l1 * a1 + sum1;
        m0 = n0;
        m1 = n1;
        // Pᵀ[head][row] as bf16 and remainder: the value mma's B operand (k = rows, n = heads) by plain ldmatrix.
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int h = 2 * t4 + (e & 1), row = g + (e >> 1) * 8;
            const bf16 hi = __float2bfloat16_rn(p[e]);
            pw[h * PLD + row] = hi;
            pw[(HEADS + h) * PLD + row] = __float2bfloat16_rn(p[e] - __bfloat162float(hi));
        }
#pragma unroll
        for (int j = 0; j < C / 16; j++) {
            o[j][0] *= a0, o[j][1] *= a1, o[j][2] *= a0, o[j][3] *= a1;
        }
        __syncwarp();  // Pᵀ written by every lane
        uint32_t pb[4];  // hi rows 0-7, hi rows 8-15, lo rows 0-7, lo rows 8-15
        kdtree::ldsm_x4(pb, pw + ((jm >> 1) * HEADS + rr) * PLD + (jm & 1) * 8);
        // Values: A = the rows' first 512 columns transposed (d x rows), by ldmatrix.trans.
        const bf16* va = kb + (rr + (jm >> 1) * 8) * LDS + (jm & 1) * 8;
#pragma unroll
        for (int j = 0; j < C / 16; j++) {
            uint32_t a[4];
            kdtree::ldsm_x4_trans(a, va + 16 * j);
            kdtree::mma_bf16(o[j], a[0], a[1], a[2], a[3], pb[0], pb[1]);
            kdtree::mma_bf16(o[j], a[0], a[1], a[2], a[3], pb[2], pb[3]);
        }
        __syncwarp();  // every lane done with this tile's stage and Pᵀ before they are refilled
    }
    kdtree::cp_async_wait<0>();  // nothing in flight when the buffers become the merge scratch

    // Merge the warps in warp order: M = max m_w, weights e^{m_w - M}; o and l summed w = 0..3.
    if (g == 0) {
        red_m[warp][2 * t4] = m0, red_m[warp][2 * t4 + 1] = m1;
        red_l[warp][2 * t4] = l0, red_l[warp][2 * t4 + 1] = l1;
    }
    __syncthreads();  // every warp's tiles done: the row buffers are free
    float* scratch = reinterpret_cast<float*>(ks);  // [WARPS][HEADS][C]
#pragma unroll
    for (int j = 0; j < C / 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int d = 16 * j + g + (e >> 1) * 8, h = 2 * t4 + (e & 1);
            scratch[(warp * HEADS + h) * C + d] = o[j][e];
        }
    __syncthreads();
    for (int k = tid; k < Hr * C; k += blockDim.x) {
        const int h = k / C, d = k % C;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++) M = fmaxf(M, red_m[w][h]);
        float acc = 0.f, L = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float wt = kdtree::lse_weight(red_m[w][h], M);
            acc += wt * scratch[(w * HEADS + h) * C + d];
            L += wt * red_l[w][h];
        }
        const size_t row = (size_t)split * Hr + h;
        part_o[row * C + d] = acc;
        if (d == 0) {
            part_ml[row * 2] = M;
            part_ml[row * 2 + 1] = L;
        }
    }
}
