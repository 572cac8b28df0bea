// MLA attention in the absorbed (latent) form over the 576-wide latent cache, for decode, tree verify
// (each node sees the committed prefix plus its ancestors: an ancestor bitmask of any width) and causal
// prefill (no mask: node i sees tree rows 0..=i). Split-KV (flash-decoding): kernel 1 computes, per
// (split of the rows, tile of query rows), the running max m, the sum l and the unnormalised weighted sum of
// latent values of each query row; kernel 2 merges the splits with log-sum-exp and writes o_lat.
// CPU twin: the latent core of engine cpu::ops::mla_attention (absorbed form): scores
// `scale * (q_lat · c_kv + q_pe · k_pe)`, softmax over visible rows, `o_lat = Σ p · c_kv`; the query
// absorption (q_lat = W_UK^T q_nope) and W_UV are GEMMs around it. Test: engine/tests/cuda_mla.rs.
// Wrapper: engine/src/cuda/ops/mla_attention.rs. Bench: engine/tests/cuda_bench_layers.rs (mla_verify).
// Dimension letters: T new nodes, S latent rows (committed prefix + T scratch rows), Hr heads of the rank,
// C kv_lora (<= 512, multiple of 8), P rope dims (C + P <= 576, multiple of 8), W mask words per node.
//
// Version 2: tensor cores (mma.sync m16n8k16 bf16, f32 accumulate; issue 27). A CTA takes a tile of 16·MT
// query rows, a query row being one (node, head): HPT = min(Hr, 16·MT) heads of NPT = max(1, 16·MT / HPT)
// consecutive nodes, so the latent rows are read once per tile, not once per node and head group. The tile's
// queries stay in shared memory; the latent rows stream through it in chunks of R = 32 (cp.async, two buffers
// on the large form so the next chunk loads while this one computes). Per chunk, with 2·MT warps (warp w: query
// m-tile w % MT, half w / MT):
//   scores  S[16 rows, 16 latent rows of its half] = Q · Lᵀ over C + P (ldmatrix + mma), scaled, masked;
//   softmax the row max over both halves through shared memory, p = e^{s - m} in f32 (the sum l), P in bf16
//           to shared memory;
//   values  O[16 rows, 256 columns of its half] += P · L[:, :C] (ldmatrix.trans + mma), 128 f32 registers.
// A query row's arithmetic depends on its own query, the split and the chunk boundaries only (an mma's output
// row depends on its own A row; masked rows weigh exactly 0): not on T, on which rows share its tile, or on the
// form (large or small), so every form gives the same bits. Rows past the last node of a tile are skipped: a
// node sees only rows up to itself (masks are ancestor masks, parents precede children), which makes causal
// prefill and large trees triangular. P goes to the value mma as two bf16 operands (its rounding and the
// remainder): one bf16 P (as FlashMLA has it) moved the tiny test model's attention far enough from the CPU's
// (2e-2) to flip a router near-tie in cuda_target; with both, P keeps ~17 bits.
#include "common.cuh"

namespace {
constexpr int R = 32;          // latent rows per chunk (rows per split are a multiple of this)
constexpr int LW_MAX = 576;    // C + P
constexpr int LDS = LW_MAX + 8;  // smem row (bf16): 1168 bytes, 16-byte aligned, consecutive rows 4 banks apart
constexpr int PLD = R + 8;       // P row (bf16): 80 bytes, conflict-free ldmatrix

using kdtree::cp_async16;
using kdtree::cp_async_commit;
using kdtree::cp_async_wait_all;
using kdtree::ldsm_x4;
using kdtree::ldsm_x4_trans;

// (a, b) as two bf16 pairs: the rounded values, and what rounding left (exact in f32, then rounded): a = hi + lo
// to about 2^-17 relative, so the value mma with both equals a product with P in f32 up to that.
__device__ __forceinline__ void split_bf16(float a, float b, uint32_t& hi, uint32_t& lo) {
    const bf162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    const bf162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = *reinterpret_cast<const uint32_t*>(&l);
}
}  // namespace

// Dynamic shared memory of a form (MT query m-tiles, NB latent buffers); the wrapper mirrors it.
template <int MT, int NB>
constexpr int mla_smem_bytes() {
    return (16 * MT * LDS + NB * R * LDS + 2 * 16 * MT * PLD) * 2 + 2 * 2 * 16 * MT * 4;
}

// One (split, query tile) of the split kernel, over one sequence: q [T, Hr, C+P] its nodes' queries; lat
// [S, C+P] its latent rows (rows [committed, committed + T) its nodes'); mask [T, W] u64 or null (causal over the
// T nodes: node t sees tree rows 0..=t); the split covers rows [split * rps, +rps) of S = committed + T
// (rps <= 0: ceil(S / splits) rounded up to the chunk; a split >= splits is empty). Query tile `tile` holds nodes
// [tile * NPT, +NPT) x heads [htile * HPT, +HPT). Partials of node t, head h: part_o[((node0 + t) * gsplits +
// split) * Hr + h][C], part_ml[..][2] (an empty split: m = -inf, l = 0, o = 0).
template <int MT, int NB>
static __device__ __forceinline__ void mla_tile(const bf16* __restrict__ q, const bf16* __restrict__ lat,
                                                const unsigned long long* __restrict__ mask, int W, int T, int committed,
                                                int rows_per_split, int split, int splits, int tile, int htile, int Hr,
                                                int C, int P, float scale, float* __restrict__ part_o,
                                                float* __restrict__ part_ml, int gsplits, int node0, int QW,
                                                size_t head_stride) {
    constexpr int ROWS = 16 * MT, THREADS = 64 * MT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);        // [ROWS][LDS]
    bf16* ks = qs + ROWS * LDS;                           // [NB][R][LDS]
    bf16* ps = ks + NB * R * LDS;                         // [ROWS][PLD] P rounded to bf16
    bf16* ps_lo = ps + ROWS * PLD;                        // [ROWS][PLD] P minus that, rounded to bf16
    float* red_max = reinterpret_cast<float*>(ps_lo + ROWS * PLD);  // [2][ROWS]
    float* red_sum = red_max + 2 * ROWS;                  // [2][ROWS]

    const int LW = C + P, LWP = (LW + 15) / 16 * 16, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int mi = warp % MT, hf = warp / MT;
    const int HPT = head_stride ? 1 : min(Hr, ROWS), NPT = max(1, ROWS / HPT);
    const int n_first = tile * NPT, h_first = htile * HPT;
    const int KS = LW - QW;              // the scores' first column (the queries fill [KS, LW) of their rows)
    const int HALF = (C + 31) / 32 * 16;  // value columns per warp half
    if (head_stride) lat += (size_t)h_first * head_stride;  // this head's own rows
    const int n_last = min(T, n_first + NPT) - 1;  // the tile's last node
    // Query row r of the tile: node n_first + r / HPT, head h_first + r % HPT; valid when both exist.
    const auto row_valid = [&](int r) {
        return r < NPT * HPT && n_first + r / HPT < T && h_first + r % HPT < Hr;
    };

    const int S = committed + T;
    if (rows_per_split <= 0) rows_per_split = ((S + splits - 1) / splits + R - 1) / R * R;
    const int s_begin = split * rows_per_split;
    const int s_end = split < splits ? min(S, s_begin + rows_per_split) : s_begin;
    const int s_lim = min(s_end, committed + n_last + 1);  // no node of the tile sees a row past its last node
    const int n_chunks = s_lim > s_begin ? (s_lim - s_begin + R - 1) / R : 0;

    const auto load_chunk = [&](int c, bf16* buf) {
        const int s0 = s_begin + c * R, pieces = LW / 8;
        for (int i = tid; i < R * pieces; i += THREADS) {
            const int r = i / pieces, col = (i % pieces) * 8;
            const bool ok = s0 + r < s_lim;
            cp_async16(buf + r * LDS + col, ok ? lat + (size_t)(s0 + r) * LW + col : lat, ok);
        }
        cp_async_commit();
    };
    // Queries (zero rows where no query), the zero pad columns [LW, LWP) of every buffer, the first chunk.
    {
        const int pieces = QW / 8;
        for (int i = tid; i < ROWS * pieces; i += THREADS) {
            const int r = i / pieces, col = (i % pieces) * 8;
            const bool ok = row_valid(r);
            const size_t src = ok ? ((size_t)(n_first + r / HPT) * Hr + h_first + r % HPT) * QW + col : 0;
            cp_async16(qs + r * LDS + KS + col, q + src, ok);
        }
        if (LWP > LW)
            for (int r = tid; r < ROWS + NB * R; r += THREADS)
                *reinterpret_cast<uint4*>((r < ROWS ? qs + r * LDS : ks + (r - ROWS) * LDS) + LW) = make_uint4(0, 0, 0, 0);
        if (NB == 2 && n_chunks > 0) load_chunk(0, ks);
        else cp_async_commit();
    }

    const int r_lo = 16 * mi + g, r_hi = r_lo + 8;  // this thread's two query rows
    const bool v_lo = row_valid(r_lo), v_hi = row_valid(r_hi);
    const int nd_lo = n_first + r_lo / HPT, nd_hi = n_first + r_hi / HPT;
    const bool active = row_valid(16 * mi);        // the warp's m-tile holds a query (rows fill in order)
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
    float o[16][8];
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int k = 0; k < 8; k++) o[j][k] = 0.f;

    const auto visible = [&](int s, int nd) {
        if (s >= s_lim) return false;
        if (s < committed) return true;
        const int j = s - committed;
        return mask ? ((mask[(size_t)nd * W + (j >> 6)] >> (j & 63)) & 1ull) != 0ull : j <= nd;
    };

    for (int c = 0; c < n_chunks; c++) {
        if (NB == 1) load_chunk(c, ks);
        cp_async_wait_all();
        __syncthreads();  // chunk c (and the queries) in shared memory; every warp done with chunk c - 1
        if (NB == 2 && c + 1 < n_chunks) load_chunk(c + 1, ks + ((c + 1) & 1) * R * LDS);
        const bf16* kb = ks + (NB == 2 ? (c & 1) : 0) * R * LDS;
        const int s0 = s_begin + c * R;

        // Scores of rows (r_lo, r_hi) x latent rows s0 + 16 hf + 8 nt + 2 t4 + {0, 1}.
        float sc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[nt][e] = 0.f;
        if (active) {
            // Two accumulator chains (even and odd 16-column steps, added at the end): half the dependent mma
            // latency of one chain; a fixed order all the same.
            float sd[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sd[nt][e] = 0.f;
            const int j = lane >> 3, rr = lane & 7;
            const bf16* qa = qs + (16 * mi + rr + (j & 1) * 8) * LDS + (j >> 1) * 8;
            const bf16* kbb = kb + (16 * hf + rr + (j >> 1) * 8) * LDS + (j & 1) * 8;
            int k0 = KS;
            for (; k0 + 16 < LWP; k0 += 32) {
                uint32_t a[4], b[4], a2[4], b2[4];
                ldsm_x4(a, qa + k0);
                ldsm_x4(b, kbb + k0);
                ldsm_x4(a2, qa + k0 + 16);
                ldsm_x4(b2, kbb + k0 + 16);
                kdtree::mma_bf16(sc[0], a[0], a[1], a[2], a[3], b[0], b[1]);
                kdtree::mma_bf16(sc[1], a[0], a[1], a[2], a[3], b[2], b[3]);
                kdtree::mma_bf16(sd[0], a2[0], a2[1], a2[2], a2[3], b2[0], b2[1]);
                kdtree::mma_bf16(sd[1], a2[0], a2[1], a2[2], a2[3], b2[2], b2[3]);
            }
            if (k0 < LWP) {
                uint32_t a[4], b[4];
                ldsm_x4(a, qa + k0);
                ldsm_x4(b, kbb + k0);
                kdtree::mma_bf16(sc[0], a[0], a[1], a[2], a[3], b[0], b[1]);
                kdtree::mma_bf16(sc[1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sc[nt][e] += sd[nt][e];
        }
        float cm_lo = -INFINITY, cm_hi = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int s = s0 + 16 * hf + 8 * nt + 2 * t4 + e;
                sc[nt][e] = v_lo && visible(s, nd_lo) ? sc[nt][e] * scale : -INFINITY;
                sc[nt][2 + e] = v_hi && visible(s, nd_hi) ? sc[nt][2 + e] * scale : -INFINITY;
                cm_lo = fmaxf(cm_lo, sc[nt][e]);
                cm_hi = fmaxf(cm_hi, sc[nt][2 + e]);
            }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            cm_lo = fmaxf(cm_lo, __shfl_xor_sync(kdtree::FULL_MASK, cm_lo, off));
            cm_hi = fmaxf(cm_hi, __shfl_xor_sync(kdtree::FULL_MASK, cm_hi, off));
        }
        if (t4 == 0) {
            red_max[hf * ROWS + r_lo] = cm_lo;
            red_max[hf * ROWS + r_hi] = cm_hi;
        }
        __syncthreads();  // both halves' row maxima
        const float mn_lo = fmaxf(m_lo, fmaxf(red_max[r_lo], red_max[ROWS + r_lo]));
        const float mn_hi = fmaxf(m_hi, fmaxf(red_max[r_hi], red_max[ROWS + r_hi]));
        const float a_lo = mn_lo == -INFINITY ? 1.f : __expf(m_lo - mn_lo);
        const float a_hi = mn_hi == -INFINITY ? 1.f : __expf(m_hi - mn_hi);
        float p_lo = 0.f, p_hi = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float mn = e < 2 ? mn_lo : mn_hi;
                p[e] = sc[nt][e] == -INFINITY ? 0.f : __expf(sc[nt][e] - mn);
            }
            p_lo += p[0] + p[1];
            p_hi += p[2] + p[3];
            const int col = 16 * hf + 8 * nt + 2 * t4;
            split_bf16(p[0], p[1], *reinterpret_cast<uint32_t*>(ps + r_lo * PLD + col),
                       *reinterpret_cast<uint32_t*>(ps_lo + r_lo * PLD + col));
            split_bf16(p[2], p[3], *reinterpret_cast<uint32_t*>(ps + r_hi * PLD + col),
                       *reinterpret_cast<uint32_t*>(ps_lo + r_hi * PLD + col));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            p_lo += __shfl_xor_sync(kdtree::FULL_MASK, p_lo, off);
            p_hi += __shfl_xor_sync(kdtree::FULL_MASK, p_hi, off);
        }
        if (t4 == 0) {
            red_sum[hf * ROWS + r_lo] = p_lo;
            red_sum[hf * ROWS + r_hi] = p_hi;
        }
        m_lo = mn_lo;
        m_hi = mn_hi;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            o[j][0] *= a_lo, o[j][1] *= a_lo, o[j][4] *= a_lo, o[j][5] *= a_lo;
            o[j][2] *= a_hi, o[j][3] *= a_hi, o[j][6] *= a_hi, o[j][7] *= a_hi;
        }
        __syncthreads();  // P and both halves' row sums
        l_lo = l_lo * a_lo + (red_sum[r_lo] + red_sum[ROWS + r_lo]);
        l_hi = l_hi * a_hi + (red_sum[r_hi] + red_sum[ROWS + r_hi]);

        // Values: O[rows, columns 256 hf + 16 j + (0..16)] += P[rows, 32] · L[32, those columns], P as its bf16
        // part and its bf16 remainder (two mma each: the weights keep f32's precision, as the CPU's do).
        if (active) {
            const int jm = lane >> 3, rr = lane & 7;
            uint32_t pa[2][4], pl[2][4];
#pragma unroll
            for (int ks16 = 0; ks16 < 2; ks16++) {
                const int at = (16 * mi + rr + (jm & 1) * 8) * PLD + 16 * ks16 + (jm >> 1) * 8;
                ldsm_x4(pa[ks16], ps + at);
                ldsm_x4(pl[ks16], ps_lo + at);
            }
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int d0 = HALF * hf + 16 * j;
                if (16 * j >= HALF || d0 >= C) break;
#pragma unroll
                for (int ks16 = 0; ks16 < 2; ks16++) {
                    uint32_t b[4];
                    ldsm_x4_trans(b, kb + (16 * ks16 + rr + (jm & 1) * 8) * LDS + d0 + (jm >> 1) * 8);
                    float(&o0)[4] = *reinterpret_cast<float(*)[4]>(&o[j][0]);
                    float(&o1)[4] = *reinterpret_cast<float(*)[4]>(&o[j][4]);
                    kdtree::mma_bf16(o0, pa[ks16][0], pa[ks16][1], pa[ks16][2], pa[ks16][3], b[0], b[1]);
                    kdtree::mma_bf16(o1, pa[ks16][0], pa[ks16][1], pa[ks16][2], pa[ks16][3], b[2], b[3]);
                    kdtree::mma_bf16(o0, pl[ks16][0], pl[ks16][1], pl[ks16][2], pl[ks16][3], b[0], b[1]);
                    kdtree::mma_bf16(o1, pl[ks16][0], pl[ks16][1], pl[ks16][2], pl[ks16][3], b[2], b[3]);
                }
            }
        }
        if (NB == 1) __syncthreads();  // every warp done with the buffer before the next chunk overwrites it
    }
    cp_async_wait_all();  // nothing left in flight when the CTA exits (an empty split's committed group)

    // Partials of this thread's rows: (m, l) once per row, o columns 256 hf + 16 j + 8 nt + 2 t4 + {0, 1} < C.
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half ? r_hi : r_lo;
        if (!(half ? v_hi : v_lo)) continue;
        const size_t row = ((size_t)(node0 + n_first + r / HPT) * gsplits + split) * Hr + h_first + r % HPT;
        if (hf == 0 && t4 == 0) {
            part_ml[row * 2] = half ? m_hi : m_lo;
            part_ml[row * 2 + 1] = half ? l_hi : l_lo;
        }
        float* dst = part_o + row * C;
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int d = HALF * hf + 16 * j + 8 * nt + 2 * t4;
                if (16 * j < HALF && d < C) *reinterpret_cast<float2*>(dst + d) = make_float2(o[j][4 * nt + 2 * half], o[j][4 * nt + 2 * half + 1]);
            }
    }
}

// q [T, Hr, C+P] bf16 (q_lat | q_pe per node and head); lat [S, C+P] bf16 (c_kv | k_pe), rows
// [committed, committed + T) are the nodes' own; mask [T, W] u64 or null (causal over the T nodes).
// committed_dev [1] or null: when set, the committed length is read from it (and `committed` ignored);
// rows_per_split <= 0: ceil(S / splits) rounded up to the chunk (empty splits write m = -inf, l = 0).
// part_o [T, splits, Hr, C] f32; part_ml [T, splits, Hr, 2] f32. grid (splits, node tiles, head tiles),
// 64·MT threads, mla_smem_bytes<MT, NB>() of dynamic shared memory.
template <int MT, int NB>
static __device__ __forceinline__ void mla_split_kernel(const bf16* __restrict__ q, const bf16* __restrict__ lat,
                                                        const unsigned long long* __restrict__ mask, float* __restrict__ part_o,
                                                        float* __restrict__ part_ml, int T, int Hr, int C, int P, int committed,
                                                        const int* __restrict__ committed_dev, int W, int rows_per_split,
                                                        float scale, int QW, size_t head_stride) {
    // A captured round reads the committed length from the device, and splits its rows evenly.
    if (committed_dev) committed = committed_dev[0];
    mla_tile<MT, NB>(q, lat, mask, W, T, committed, rows_per_split, blockIdx.x, gridDim.x, blockIdx.y, blockIdx.z, Hr, C, P,
                     scale, part_o, part_ml, gridDim.x, 0, QW, head_stride);
}
#define KDTREE_MLA_SPLIT_ARGS                                                                                          \
    const bf16 *__restrict__ q, const bf16 *__restrict__ lat, const unsigned long long *__restrict__ mask,                \
        float *__restrict__ part_o, float *__restrict__ part_ml, int T, int Hr, int C, int P, int committed,              \
        const int *__restrict__ committed_dev, int W, int rows_per_split, float scale
// The large form (64 query rows, two latent buffers: 157 KiB of shared memory) and the small one for devices
// with less (32 rows, one buffer: 79 KiB); the same bits.
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_attention_split_bf16(KDTREE_MLA_SPLIT_ARGS) {
    mla_split_kernel<4, 2>(q, lat, mask, part_o, part_ml, T, Hr, C, P, committed, committed_dev, W, rows_per_split, scale,
                           C + P, 0);
}
extern "C" __global__ void __launch_bounds__(128, 1) kdtree_mla_attention_split_small_bf16(KDTREE_MLA_SPLIT_ARGS) {
    mla_split_kernel<2, 1>(q, lat, mask, part_o, part_ml, T, Hr, C, P, committed, committed_dev, W, rows_per_split, scale,
                           C + P, 0);
}
// The expanded (multi-head) form, for prefill: head h has its own rows at lat + h * head_stride, each [v_h (C) | keys]
// of C + P, and its queries q [T, Hr, QW] score against the last QW columns of those rows (QW <= C + P, C + P - QW a
// multiple of 16), so that o[t, h] = softmax(scale · q[t, h] · k_h) · v_h: the MHA form of MLA with k_h = [k_nope_h |
// k_pe], v_h from kv_b's expansion of the latent rows. A tile holds 16·MT consecutive nodes of one head; grid (splits,
// node tiles, Hr). The same partials and merge as the latent form.
#define KDTREE_MLA_HEADS_ARGS KDTREE_MLA_SPLIT_ARGS, int QW, unsigned long long head_stride
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_attention_split_heads_bf16(KDTREE_MLA_HEADS_ARGS) {
    mla_split_kernel<4, 2>(q, lat, mask, part_o, part_ml, T, Hr, C, P, committed, committed_dev, W, rows_per_split, scale,
                           QW, head_stride);
}
extern "C" __global__ void __launch_bounds__(128, 1) kdtree_mla_attention_split_heads_small_bf16(KDTREE_MLA_HEADS_ARGS) {
    mla_split_kernel<2, 1>(q, lat, mask, part_o, part_ml, T, Hr, C, P, committed, committed_dev, W, rows_per_split, scale,
                           QW, head_stride);
}

// A batch's segments (sequences) in one launch, by value: segment s owns rows [row0[s], row0[s + 1]) of the
// launch (q, part_o, part_ml rows) and node tiles [tile0[s], tile0[s + 1]) of grid y, its latent cache lat[s]
// (this layer's [cap, C+P] bf16), its tree mask mask[s] ([T_s, words[s]] u64), its committed length at pos[s] (an
// i32 on the device) and its own split count splits[s] <= gridDim.x (its rows split evenly; the launch's extra
// splits are empty for it), so every node's partials and their merge are those of the segment's own launch of
// the kernel above.
constexpr int MLA_SEGS = 64;
struct MlaSegs {
    unsigned long long lat[MLA_SEGS], mask[MLA_SEGS], pos[MLA_SEGS];
    int row0[MLA_SEGS + 1], tile0[MLA_SEGS + 1], words[MLA_SEGS], splits[MLA_SEGS];
    int nseg;
};
// grid (max splits, node tiles, head tiles), 64·MT threads; part_o [rows, gridDim.x, Hr, C], part_ml [rows,
// gridDim.x, Hr, 2].
template <int MT, int NB>
static __device__ __forceinline__ void mla_split_seg_kernel(const bf16* __restrict__ q, const MlaSegs& segs,
                                                            float* __restrict__ part_o, float* __restrict__ part_ml, int Hr,
                                                            int C, int P, float scale) {
    const int y = blockIdx.y;
    int s = 0;
    while (s + 1 < segs.nseg && segs.tile0[s + 1] <= y) s++;
    const int T = segs.row0[s + 1] - segs.row0[s];
    const int committed = reinterpret_cast<const int*>(segs.pos[s])[0];
    mla_tile<MT, NB>(q + (size_t)segs.row0[s] * Hr * (C + P), reinterpret_cast<const bf16*>(segs.lat[s]),
                     reinterpret_cast<const unsigned long long*>(segs.mask[s]), segs.words[s], T, committed, 0, blockIdx.x,
                     segs.splits[s], y - segs.tile0[s], blockIdx.z, Hr, C, P, scale, part_o, part_ml, gridDim.x, segs.row0[s],
                     C + P, 0);
}
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_attention_split_seg_bf16(const bf16* __restrict__ q, const MlaSegs segs,
                                float* __restrict__ part_o, float* __restrict__ part_ml, int Hr, int C, int P, float scale) {
    mla_split_seg_kernel<4, 2>(q, segs, part_o, part_ml, Hr, C, P, scale);
}
extern "C" __global__ void __launch_bounds__(128, 1) kdtree_mla_attention_split_seg_small_bf16(const bf16* __restrict__ q,
                                const MlaSegs segs, float* __restrict__ part_o, float* __restrict__ part_ml, int Hr, int C,
                                int P, float scale) {
    mla_split_seg_kernel<2, 1>(q, segs, part_o, part_ml, Hr, C, P, scale);
}

// Merge the splits: o_lat[t, h, :] = Σ_i e^{m_i − M} o_i / Σ_i e^{m_i − M} l_i (M = max_i m_i).
// part_o [T, splits, Hr, C] f32, part_ml [T, splits, Hr, 2] f32 -> out [T, Hr, C] bf16. Every split's partials
// are written (an empty split: m = -inf, l = 0, o = 0). grid (T, Hr, ceil(C / 128)), 256 threads, splits <=
// MLA_MERGE_MAX_SPLITS. Each block recomputes the split weights e^{m_i − M} into shared memory and L (each thread
// its strided splits in order, then the block sum); its 128 columns are 32 lanes x 4, each summing 1/8 of the
// splits (i ≡ warp mod 8, in order, all loads independent), then the eight sums in warp order. A fixed order
// for a given split count, whatever T.
constexpr int MLA_MERGE_MAX_SPLITS = 1024;
extern "C" __global__ void __launch_bounds__(256) kdtree_mla_attention_merge_bf16(const float* __restrict__ part_o,
                                                                                 const float* __restrict__ part_ml,
                                                                                 bf16* __restrict__ out, int splits, int Hr,
                                                                                 int C) {
    __shared__ float ws[MLA_MERGE_MAX_SPLITS];  // e^{m_i − M}; 0 for an empty split (m_i = -inf)
    __shared__ float red[32];
    __shared__ float4 part[8][32];
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const auto row = [&](int i) { return ((size_t)t * splits + i) * Hr + h; };
    float mx = -INFINITY;
    for (int i = tid; i < splits; i += 256) mx = fmaxf(mx, part_ml[row(i) * 2]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kdtree::FULL_MASK, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; i++) M = fmaxf(M, red[i]);
    float lsum = 0.f;
    for (int i = tid; i < splits; i += 256) {
        const float w = kdtree::lse_weight(part_ml[row(i) * 2], M);
        ws[i] = w;
        if (w != 0.f) lsum += w * part_ml[row(i) * 2 + 1];
    }
    const float inv = 1.f / kdtree::block_sum(lsum, red);  // its barriers also publish ws
    const int c = blockIdx.z * 128 + 4 * lane;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < C) {
#pragma unroll 8
        for (int i = warp; i < splits; i += 8) {
            const float w = ws[i];
            const float4 v = __ldg(reinterpret_cast<const float4*>(part_o + row(i) * C + c));
            a.x = fmaf(w, v.x, a.x);
            a.y = fmaf(w, v.y, a.y);
            a.z = fmaf(w, v.z, a.z);
            a.w = fmaf(w, v.w, a.w);
        }
    }
    part[warp][lane] = a;
    __syncthreads();
    if (warp == 0 && c < C) {
        float4 s = part[0][lane];
#pragma unroll
        for (int k = 1; k < 8; k++) {
            const float4 v = part[k][lane];
            s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
        }
        bf16* dst = out + ((size_t)t * Hr + h) * C + c;
        reinterpret_cast<bf162*>(dst)[0] = __floats2bfloat162_rn(s.x * inv, s.y * inv);
        reinterpret_cast<bf162*>(dst)[1] = __floats2bfloat162_rn(s.z * inv, s.w * inv);
    }
}
