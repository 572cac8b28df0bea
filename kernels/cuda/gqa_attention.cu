// Non-causal grouped-query attention of the DFlash drafter's block over [context ; block] (ddtree.md §1):
// every block query sees every committed context row and every block row; scores `q·k · D^-0.5`, softmax
// over the C + B rows, weighted sum of values. f32 in, f32 out, f32 accumulation. Split-KV
// (flash-decoding): kernel 1 computes, per (split of the C + B rows, kv head, tile of 16 query rows of that
// head), the running max m, the sum l and the unnormalised weighted sum of values (online softmax); kernel
// 2 merges the splits with log-sum-exp and writes the output. A context of tens of thousands of rows
// spreads over many CTAs.
// CPU twin: engine/src/cpu/ops/gqa_attention.rs. Test: engine/tests/cuda_drafter.rs
// (`gqa_attention_parity`, and the whole drafter against the CPU one). Wrapper:
// engine/src/cuda/ops/gqa_attention.rs. Bench: none yet (issue 10).
// Dimension letters: B block rows (queries), C context rows, Hq query heads, Hk kv heads, G = Hq / Hk
// query heads per kv head, D head_dim (1..=256), S = C + B rows seen by every query.
// Version 1: CUDA cores; 16 query rows x 16 key rows per step, queries and the K/V chunk in shared memory
// (odd row stride: the 16 rows a score step reads sit in 16 banks), each K/V row read once per (split,
// kv head, query tile). Build line: as common.cuh.
#include "common.cuh"

namespace gqa {
constexpr int QT = 16;            // query rows per CTA (all of one kv head)
constexpr int R = 16;             // key/value rows per chunk (= lanes per query row: shuffle width)
constexpr int D_MAX = 256;        // largest head_dim
constexpr int NJ = D_MAX / R;     // output columns per thread at D_MAX
constexpr int THREADS = QT * R;   // = the __launch_bounds__ below
}  // namespace gqa

// q [B, Hq*D]; kc, vc [C, Hk*D] (context); kb, vb [B, Hk*D] (block); row s < C of the S rows is context
// row s, row s >= C is block row s - C. Query row i in [0, B*G) of kv head hk is token t = i / G, head
// hq = hk*G + i % G. part_o [splits, B, Hq, D] f32; part_ml [splits, B, Hq, 2] f32 (m, l).
// ctx_dev [1] or null: when set, C is read from it; rows_per_split <= 0: ceil(S / splits) rounded up to
// the chunk (empty splits write m = -inf, l = 0).
// Thread tid: query row tid / 16 of the tile in both phases, lane tid % 16 = key row of the chunk (scores)
// and first output column (accumulation: columns lane + 16 j).
// The split kernel's body for one CTA: (split `split` of `nsplit`, kv head hk, query tile `tile`) of one
// sequence whose B query rows are rows [t0, t0 + B) of a partial layout of Bt rows. Both kernels below call it.
__device__ __forceinline__ void gqa_split_cta(const float* __restrict__ q, const float* __restrict__ kc,
                                              const float* __restrict__ vc, const float* __restrict__ kb,
                                              const float* __restrict__ vb, float* __restrict__ part_o,
                                              float* __restrict__ part_ml, int B, int Bt, int t0, int C, int Hq, int Hk,
                                              int D, int rows_per_split, int nsplit, float scale, int split, int hk,
                                              int tile, float* gqa_smem) {
    using namespace gqa;
    const int LD = D | 1;          // odd row stride
    float* qs = gqa_smem;          // [QT, LD]
    float* ks = qs + QT * LD;      // [R, LD]
    float* vs = ks + R * LD;       // [R, LD]
    const int i0 = tile * QT, tid = threadIdx.x;
    const int G = Hq / Hk, nq = min(QT, B * G - i0);
    const size_t qw = (size_t)Hq * D, kw = (size_t)Hk * D;
    // this tile's queries -> smem (zeros past the last query row)
    for (int x = tid; x < QT * D; x += THREADS) {
        const int i = x / D, c = x % D;
        float v = 0.f;
        if (i < nq) {
            const int qi = i0 + i;
            v = q[(size_t)(qi / G) * qw + (size_t)(hk * G + qi % G) * D + c];
        }
        qs[i * LD + c] = v;
    }
    const int S = C + B;
    if (rows_per_split <= 0) rows_per_split = ((S + nsplit - 1) / nsplit + R - 1) / R * R;
    const int s_begin = split * rows_per_split, s_end = min(S, s_begin + rows_per_split);
    const int qr = tid / R, lane = tid % R;
    float m = -INFINITY, l = 0.f;  // of query row qr (replicated over its 16 lanes)
    float o[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) o[j] = 0.f;
    for (int s0 = s_begin; s0 < s_end; s0 += R) {
        __syncthreads();  // previous chunk consumed (and queries stored, the first time)
        for (int x = tid; x < R * D; x += THREADS) {
            const int r = x / D, c = x % D, s = s0 + r;
            float kv = 0.f, vv = 0.f;
            if (s < s_end) {
                if (s < C) {
                    const size_t at = (size_t)s * kw + (size_t)hk * D + c;
                    kv = kc[at];
                    vv = vc[at];
                } else {
                    const size_t at = (size_t)(s - C) * kw + (size_t)hk * D + c;
                    kv = kb[at];
                    vv = vb[at];
                }
            }
            ks[r * LD + c] = kv;
            vs[r * LD + c] = vv;
        }
        __syncthreads();
        // score of (query row qr, row s0 + lane); -inf past the split's end or the last query row
        float sc = -INFINITY;
        if (s0 + lane < s_end && qr < nq) {
            const float* qh = qs + qr * LD;
            const float* kr = ks + lane * LD;
            float acc = 0.f;
            for (int c = 0; c < D; c++) acc = fmaf(qh[c], kr[c], acc);
            sc = acc * scale;
        }
        // online softmax over the chunk, per query row (16 consecutive lanes)
        float a, p;
        kdtree::online_softmax_step<R>(sc, m, l, a, p);
#pragma unroll
        for (int j = 0; j < NJ; j++) o[j] *= a;
        for (int r = 0; r < R; r++) {
            const float pr = __shfl_sync(kdtree::FULL_MASK, p, r, R);  // p of row s0 + r, from lane r
            const float* vr = vs + r * LD;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int c = lane + R * j;
                if (c < D) o[j] = fmaf(pr, vr[c], o[j]);
            }
        }
    }
    if (qr < nq) {
        const int qi = i0 + qr;
        const size_t row = ((size_t)split * Bt + t0 + qi / G) * Hq + (size_t)(hk * G + qi % G);
        if (lane == 0) {
            part_ml[row * 2] = m;
            part_ml[row * 2 + 1] = l;
        }
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int c = lane + R * j;
            if (c < D) part_o[row * D + c] = o[j];
        }
    }
}

// grid (splits, Hk, ceil(B*G / 16)), 256 threads, dynamic shared memory (16 + 2*16) * (D | 1) * 4 bytes.
extern "C" __global__ void __launch_bounds__(256) kdtree_gqa_attention_split_f32(const float* __restrict__ q, const float* __restrict__ kc,
                                const float* __restrict__ vc, const float* __restrict__ kb, const float* __restrict__ vb,
                                float* __restrict__ part_o, float* __restrict__ part_ml, int B, int C, const int* __restrict__ ctx_dev, int Hq,
                                int Hk, int D, int rows_per_split, float scale) {
    extern __shared__ float gqa_smem[];  // a name of its own: build.rs compiles every .cu as one translation unit
    if (ctx_dev) C = ctx_dev[0];  // a captured round reads the context length from the device
    gqa_split_cta(q, kc, vc, kb, vb, part_o, part_ml, B, B, 0, C, Hq, Hk, D, rows_per_split, (int)gridDim.x, scale,
                  blockIdx.x, blockIdx.y, blockIdx.z, gqa_smem);
}

// A batch's drafts in one launch: sequence s's B query rows are rows [s*B, (s+1)*B) of q, kb, vb and of the
// partials ([splits, nseg*B, Hq, D]); its context is kc[s], vc[s] ([C_s, Hk*D], C_s read at ctx[s]), split
// evenly into splits[s] <= gridDim.x parts (CTAs of a split past it see no row: m = -inf, l = 0, skipped by
// the merge), so each sequence's partials are those its own launch of splits[s] CTAs would write.
// grid (max splits, Hk, nseg * ceil(B*G / 16)), 256 threads, shared memory as above.
constexpr int GQA_SEGS = 64;
struct GqaSegs {
    unsigned long long kc[GQA_SEGS], vc[GQA_SEGS], ctx[GQA_SEGS];
    int splits[GQA_SEGS];
    int nseg;
};
extern "C" __global__ void __launch_bounds__(256) kdtree_gqa_attention_split_segs_f32(const GqaSegs segs, const float* __restrict__ q,
                                const float* __restrict__ kb, const float* __restrict__ vb, float* __restrict__ part_o,
                                float* __restrict__ part_ml, int B, int Hq, int Hk, int D, float scale) {
    extern __shared__ float gqa_smem_segs[];
    const int tiles = (B * (Hq / Hk) + gqa::QT - 1) / gqa::QT;
    const int s = blockIdx.z / tiles, tile = blockIdx.z % tiles;
    if (s >= segs.nseg) return;
    const int C = reinterpret_cast<const int*>(segs.ctx[s])[0];
    const size_t qw = (size_t)Hq * D, kw = (size_t)Hk * D, t0 = (size_t)s * B;
    gqa_split_cta(q + t0 * qw, reinterpret_cast<const float*>(segs.kc[s]), reinterpret_cast<const float*>(segs.vc[s]),
                  kb + t0 * kw, vb + t0 * kw, part_o, part_ml, B, B * segs.nseg, (int)t0, C, Hq, Hk, D, 0,
                  segs.splits[s], scale, blockIdx.x, blockIdx.y, tile, gqa_smem_segs);
}

// Merge the splits: out[t, hq*D + c] = Σ_i e^{m_i − M} o_i[c] / Σ_i e^{m_i − M} l_i (M = max_i m_i; a
// split that saw no row has m_i = -inf and is skipped). part_o [splits, B*Hq, D], part_ml [splits, B*Hq, 2]
// -> out [B, Hq*D] f32. grid (B*Hq), any blockDim.
extern "C" __global__ void kdtree_gqa_attention_merge_f32(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                          float* __restrict__ out, int splits, int rows, int D) {
    const size_t row = blockIdx.x;  // t * Hq + hq
    float M = -INFINITY;
    for (int i = 0; i < splits; i++) M = fmaxf(M, part_ml[((size_t)i * rows + row) * 2]);
    float L = 0.f;
    for (int i = 0; i < splits; i++) {
        const float mi = part_ml[((size_t)i * rows + row) * 2];
        if (mi != -INFINITY) L += kdtree::lse_weight(mi, M) * part_ml[((size_t)i * rows + row) * 2 + 1];
    }
    const float inv = 1.f / L;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0.f;
        for (int i = 0; i < splits; i++) {
            const size_t pr = (size_t)i * rows + row;
            const float mi = part_ml[pr * 2];
            if (mi != -INFINITY) acc = fmaf(kdtree::lse_weight(mi, M), part_o[pr * D + c], acc);
        }
        out[row * D + c] = acc * inv;
    }
}
