// Causal prefill attention in MLA's expanded (multi-head) form, flash-attention style on tensor cores:
//   out[t, h, :DV] = Σ_{s <= committed + t} softmax_s(scale · q[t, h, :] · k_h[s, :]) · v_h[s, :]
// for the T new rows of one sequence after `committed` cached rows, each head over its own expanded rows
// kv[h · head_stride + s · EW ..] = v_h (DV) | k_h (QW) (kv_b's expansion of the latent cache: v, k_nope, then
// the shared k_pe), queries q [T, Hr, QW] (q_nope | q_pe, roped). One kernel, no split, no partials: a prefill
// has T · Hr query rows, enough CTAs without splitting the keys.
// CPU twin: the expanded attention of engine cpu::ops::mla_attention (the same sums in f32). Test:
// engine/tests/cuda_mla_prefill.rs (against an f32 reference, the split kernel's expanded form, twice for the
// same bits). Bench: engine/tests/cuda_bench_layers.rs (mla_prefill). Wrapper: engine/src/cuda/ops/mla_prefill.rs.
//
// Why not the split kernel's expanded form (kdtree_mla_attention_split_heads_bf16): it is built for the 576-wide
// latent rows (32-row chunks, the scores' softmax through shared memory between two warp halves, f32 partials
// and a merge kernel); at a 16K-token chunk of the K2.6 TP8 rank-0 slice it ran at 54 TFLOP/s (ncu, run 85).
// Here (FlashAttention-2's structure):
//   * a CTA holds 128 query rows of one head (8 warps, 16 rows each), the queries in registers as mma A
//     fragments (QW / 16 k-steps), and streams the keys and values in tiles of 64 rows through shared memory
//     (cp.async, double-buffered; rows padded to EW + 8 elements: ldmatrix conflict-free);
//   * per tile a warp computes S = Q · Kᵀ (16 x 64, mma m16n8k16, f32), the online softmax in registers (row max
//     over the quad by shuffles; scale folded into exp2), and O += P · V with P as mma A fragments straight from
//     the S accumulators: two bf16 operands, its rounding and the remainder (as the split kernel does: one bf16
//     P moved the tiny model's attention far enough to flip a router near-tie), so P keeps ~17 bits; the `_p1`
//     kernel (K2.6's widths; the default since run 99, `KDTREE_MLA_PREFILL_P1=0` the A/B) feeds P as one bf16
//     operand, as FlashAttention and torch's SDPA do: half the value mma's, 15 % faster a 16K chunk, max error
//     2.9e-3 of the largest output against the f32 reference (1.95e-3 with P split);
//   * causality: a CTA reads key tiles up to its last row only; a tile past a warp's last row is skipped by that
//     warp; the mask is applied on the tiles that cross a warp's rows; the largest query tiles launch first.
// A row's arithmetic depends on its own query, the key tiles (64-row boundaries from row 0) and the row's own
// visibility only, not on T, committed's split into chunks aside, or on which rows share its CTA.
// Shapes (template): (QW, DV) = (192, 128) K2.6, (64, 32) the trained pair, (48, 32) the synthetic tiny model.
#include "common.cuh"

namespace mla_prefill {

constexpr int BM = 128;  // query rows a CTA
constexpr int BN = 64;   // key rows a tile
constexpr int WARPS = 8;
constexpr int THREADS = 32 * WARPS;

template <int QW, int DV>
struct Dims {
    static constexpr int EW = DV + QW;       // an expanded row: v_h | k_h
    static constexpr int LDK = EW + 8;       // smem row (elements); EW % 16 == 0 makes LDK / 8 odd: conflict-free
    static constexpr int LDQ = QW + 8;
    static constexpr int Q_BYTES = BM * LDQ * 2;
    static constexpr int KV_BYTES = BN * LDK * 2;
    static constexpr int SMEM = Q_BYTES + 2 * KV_BYTES;
    static_assert(QW % 16 == 0 && DV % 16 == 0, "QW and DV multiples of 16");
};

// (a, b) as two bf16 pairs: the rounded values and the rounding's remainder (a = hi + lo to ~2^-17).
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
    const bf162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    const bf162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = *reinterpret_cast<const uint32_t*>(&l);
}

// PLO: P as two bf16 operands (its rounding and the remainder); false: one (the rounding alone).
template <int QW, int DV, bool PLO>
__device__ __forceinline__ void prefill_tile(const bf16* __restrict__ q, const bf16* __restrict__ kv,
                                             size_t head_stride, int T, int Hr, int committed, float scale_log2,
                                             bf16* __restrict__ out) {
    using D = Dims<QW, DV>;
    constexpr int EW = D::EW, LDK = D::LDK, LDQ = D::LDQ, KS = QW / 16, NT = BN / 8, OT = DV / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16* qs = reinterpret_cast<bf16*>(smem);
    bf16* kvs = reinterpret_cast<bf16*>(smem + D::Q_BYTES);

    const int n_qt = (T + BM - 1) / BM;
    const int qt = n_qt - 1 - (int)blockIdx.x;  // the longest rows first
    const int h = blockIdx.y;
    const int q0 = qt * BM;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int S = committed + T;
    const int s_lim = min(S, committed + q0 + BM);  // no row of the CTA sees a key at or past this
    const int n_kv = (s_lim + BN - 1) / BN;
    kv += (size_t)h * head_stride;

    const auto load_kv = [&](int j, int buf) {
        bf16* dst = kvs + buf * BN * LDK;
        constexpr int PIECES = EW / 8;
        for (int i = tid; i < BN * PIECES; i += THREADS) {
            const int r = i / PIECES, c = (i % PIECES) * 8, s = j * BN + r;
            const bool ok = s < s_lim;
            kdtree::cp_async16(dst + r * LDK + c, ok ? kv + (size_t)s * EW + c : kv, ok);
        }
    };
    {
        constexpr int PIECES = QW / 8;
        for (int i = tid; i < BM * PIECES; i += THREADS) {
            const int r = i / PIECES, c = (i % PIECES) * 8;
            const bool ok = q0 + r < T;
            const bf16* src = ok ? q + ((size_t)(q0 + r) * Hr + h) * QW + c : q;
            kdtree::cp_async16(qs + r * LDQ + c, src, ok);
        }
    }
    load_kv(0, 0);
    kdtree::cp_async_commit();
    kdtree::cp_async_wait_all();
    __syncthreads();

    // This warp's 16 query rows as A fragments: row (16 warp + g [+ 8]), k-step kk.
    const int jm = lane >> 3, rr = lane & 7;
    uint32_t qf[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
        kdtree::ldsm_x4(qf[kk], qs + (16 * warp + rr + (jm & 1) * 8) * LDQ + 16 * kk + (jm >> 1) * 8);

    float o[OT][4];
#pragma unroll
    for (int i = 0; i < OT; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[i][e] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int row0 = q0 + 16 * warp + g;  // this lane's rows: row0 and row0 + 8 (new-row indices)
    const int warp_last = committed + q0 + 16 * warp + 15;  // the warp's last row sees keys up to here

    for (int j = 0; j < n_kv; j++) {
        if (j + 1 < n_kv) load_kv(j + 1, (j + 1) & 1);
        kdtree::cp_async_commit();
        kdtree::cp_async_wait<1>();
        __syncthreads();  // tile j is in buffer j & 1 for every thread
        const bf16* ks = kvs + (j & 1) * BN * LDK;
        const int s0 = j * BN;
        if (s0 <= warp_last) {
            float sc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sc[nt][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
#pragma unroll
                for (int jj = 0; jj < NT / 2; jj++) {
                    uint32_t b[4];
                    kdtree::ldsm_x4(b, ks + (16 * jj + rr + (jm >> 1) * 8) * LDK + DV + 16 * kk + (jm & 1) * 8);
                    kdtree::mma_bf16(sc[2 * jj], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[0], b[1]);
                    kdtree::mma_bf16(sc[2 * jj + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[2], b[3]);
                }
            }
            // Scale (log2 units), mask where the tile crosses the warp's rows, running max.
            const bool crosses = s0 + BN - 1 > committed + q0 + 16 * warp;
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = sc[nt][e] * scale_log2;
                    if (crosses && s0 + 8 * nt + 2 * t4 + (e & 1) > committed + row0 + 8 * (e >> 1)) v = -INFINITY;
                    sc[nt][e] = v;
                    mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            }
            // Tile 0 holds key 0, which every row sees, so the max is finite from the first tile on.
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                alpha[r] = exp2f(m[r] - mx[r]);
                m[r] = mx[r];
                l[r] *= alpha[r];
            }
#pragma unroll
            for (int i = 0; i < OT; i++) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[0];
                o[i][2] *= alpha[1];
                o[i][3] *= alpha[1];
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float p = exp2f(sc[nt][e] - m[e >> 1]);
                    sc[nt][e] = p;
                    l[e >> 1] += p;
                }
            // O += P · V, P's k16 step kk2 = key columns 16 kk2 .. of the tile (S tiles 2 kk2, 2 kk2 + 1).
#pragma unroll
            for (int kk2 = 0; kk2 < BN / 16; kk2++) {
                if (s0 + 16 * kk2 > warp_last) break;  // keys past the warp's rows weigh 0
                uint32_t ph[4], pl[4];
                split2(sc[2 * kk2][0], sc[2 * kk2][1], ph[0], pl[0]);
                split2(sc[2 * kk2][2], sc[2 * kk2][3], ph[1], pl[1]);
                split2(sc[2 * kk2 + 1][0], sc[2 * kk2 + 1][1], ph[2], pl[2]);
                split2(sc[2 * kk2 + 1][2], sc[2 * kk2 + 1][3], ph[3], pl[3]);
#pragma unroll
                for (int dj = 0; dj < DV / 16; dj++) {
                    uint32_t b[4];
                    kdtree::ldsm_x4_trans(b, ks + (16 * kk2 + rr + (jm & 1) * 8) * LDK + 16 * dj + (jm >> 1) * 8);
                    kdtree::mma_bf16(o[2 * dj], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
                    kdtree::mma_bf16(o[2 * dj + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
                    if (PLO) {
                        kdtree::mma_bf16(o[2 * dj], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
                        kdtree::mma_bf16(o[2 * dj + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with buffer j & 1 before tile j + 2 overwrites it
    }

    // Normalise (the row sum over the quad's lanes) and store rows below T.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        l[r] = 1.f / l[r];
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= T) continue;
        bf16* dst = out + ((size_t)row * Hr + h) * DV + 2 * t4;
#pragma unroll
        for (int i = 0; i < OT; i++)
            *reinterpret_cast<bf162*>(dst + 8 * i) = __floats2bfloat162_rn(o[i][2 * r] * l[r], o[i][2 * r + 1] * l[r]);
    }
}

}  // namespace mla_prefill

// Grid (ceil(T / 128), Hr), block 256, dynamic smem mla_prefill::Dims<QW, DV>::SMEM. scale_log2 = the softmax
// scale times log2(e). head_stride: elements between heads' rows in kv (>= (committed + T) (QW + DV)).
static_assert(mla_prefill::THREADS == 256, "the launch bounds below");
#define KDTREE_MLA_PREFILL_ARGS                                                                                \
    const bf16 *__restrict__ q, const bf16 *__restrict__ kv, unsigned long long head_stride, int T, int Hr,     \
        int committed, float scale_log2, bf16 *__restrict__ out
#define KDTREE_MLA_PREFILL_BODY(QW, DV, PLO) \
    mla_prefill::prefill_tile<QW, DV, PLO>(q, kv, (size_t)head_stride, T, Hr, committed, scale_log2, out)
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_prefill_bf16_q192_v128(KDTREE_MLA_PREFILL_ARGS) {
    KDTREE_MLA_PREFILL_BODY(192, 128, true);
}
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_prefill_bf16_q192_v128_p1(KDTREE_MLA_PREFILL_ARGS) {
    KDTREE_MLA_PREFILL_BODY(192, 128, false);
}
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_prefill_bf16_q64_v32(KDTREE_MLA_PREFILL_ARGS) {
    KDTREE_MLA_PREFILL_BODY(64, 32, true);
}
extern "C" __global__ void __launch_bounds__(256, 1) kdtree_mla_prefill_bf16_q48_v32(KDTREE_MLA_PREFILL_ARGS) {
    KDTREE_MLA_PREFILL_BODY(48, 32, true);
}
