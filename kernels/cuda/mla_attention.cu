// MLA attention in the absorbed (latent) form over the 576-wide latent cache, for decode, tree verify
// (each node sees the committed prefix plus its ancestors: an ancestor bitmask of any width) and causal
// prefill (no mask: node i sees tree rows 0..=i). Split-KV (flash-decoding): kernel 1 computes, per
// (node, split of the rows, group of heads), the running max m, the sum l and the unnormalised weighted
// sum of latent values; kernel 2 merges the splits with log-sum-exp and writes o_lat.
// CPU twin: the latent core of engine cpu::ops::mla_attention (absorbed form): scores
// `scale * (q_lat · c_kv + q_pe · k_pe)`, softmax over visible rows, `o_lat = Σ p · c_kv`; the query
// absorption (q_lat = W_UK^T q_nope) and W_UV are GEMMs around it. Test: engine/tests/cuda_mla.rs.
// Wrapper: engine/src/cuda/ops/mla_attention.rs. Bench: bench/ (issue 10).
// Dimension letters: T new nodes, S latent rows (committed prefix + T scratch rows), Hr heads of the rank,
// C kv_lora (<= 512, multiple of 8), P rope dims (C + P <= 576, multiple of 8), W mask words per node.
// Version 1: CUDA cores, 16 heads x 16 rows per step, K/V chunk and queries in shared memory, each latent
// row read once per (node, split, head group). Tensor-core (mma) version: issue 10.
#include "common.cuh"

namespace {
constexpr int HG = 16;         // heads per CTA
constexpr int R = 16;          // latent rows per chunk
constexpr int LW_MAX = 576;    // C + P
constexpr int LDS = LW_MAX + 8;  // padded smem row (bf16): spreads 16-byte loads of 16 rows over banks
constexpr int THREADS = 256;  // = the __launch_bounds__ below
}  // namespace

// One (node, split, head group) of the split kernel. qn: this node's queries [Hr, C+P]; lat [S, C+P] of its
// sequence (rows [committed, committed + T) are its nodes'); mrow: its mask row [W] u64, or null (causal over
// the T nodes: node t sees tree rows 0..=t); the split covers rows [split * rps, +rps) of S = committed + T
// (rps <= 0: ceil(S / splits) rounded up to the chunk; a split >= splits is empty); po / pml: this node's and
// split's partials [Hr, C] / [Hr, 2] (empty: m = -inf, l = 0, o = 0).
static __device__ __forceinline__ void mla_split(const bf16* __restrict__ qn, const bf16* __restrict__ lat,
                                                 const unsigned long long* __restrict__ mrow, int T, int t, int committed,
                                                 int rows_per_split, int split, int splits, int h0, int Hr, int C, int P,
                                                 float scale, float* __restrict__ po, float* __restrict__ pml) {
    __shared__ __align__(16) bf16 qs[HG * LDS];
    __shared__ __align__(16) bf16 ks[R * LDS];
    __shared__ float ps[HG * R];
    __shared__ float alpha_s[HG];
    const int LW = C + P, tid = threadIdx.x;
    const int nh = min(HG, Hr - h0);
    // queries of this node and head group -> smem (16-byte chunks)
    for (int i = tid; i < HG * (LW / 8); i += THREADS) {
        const int h = i / (LW / 8), c = (i % (LW / 8)) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (h < nh) v = *reinterpret_cast<const uint4*>(qn + (size_t)(h0 + h) * LW + c);
        *reinterpret_cast<uint4*>(qs + h * LDS + c) = v;
    }
    const int S = committed + T;
    if (rows_per_split <= 0) rows_per_split = ((S + splits - 1) / splits + R - 1) / R * R;
    const int s_begin = split * rows_per_split, s_end = split < splits ? min(S, s_begin + rows_per_split) : s_begin;
    // score thread: head sh, row sr of the chunk; accumulate thread: heads 4*ah.., columns ac..ac+8
    const int sh = tid / R, sr = tid % R;
    const int ah = tid / 64, ac = (tid % 64) * 8;
    float m = -INFINITY, l = 0.f;        // of head sh (replicated over its 16 lanes)
    float o[4][8];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int k = 0; k < 8; k++) o[j][k] = 0.f;
    for (int s0 = s_begin; s0 < s_end; s0 += R) {
        __syncthreads();  // previous chunk fully consumed (and queries stored, first time)
        for (int i = tid; i < R * (LW / 8); i += THREADS) {
            const int r = i / (LW / 8), c = (i % (LW / 8)) * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (s0 + r < s_end) v = *reinterpret_cast<const uint4*>(lat + (size_t)(s0 + r) * LW + c);
            *reinterpret_cast<uint4*>(ks + r * LDS + c) = v;
        }
        __syncthreads();
        // score of (head sh, row s0 + sr), -inf when not visible
        const int s = s0 + sr;
        bool vis = s < s_end && sh < nh;
        if (vis && s >= committed) {
            const int j = s - committed;
            vis = mrow ? ((mrow[j >> 6] >> (j & 63)) & 1ull) != 0ull : j <= t;
        }
        float sc = -INFINITY;
        if (vis) {
            float acc = 0.f;
            const bf16* qh = qs + sh * LDS;
            const bf16* kr = ks + sr * LDS;
            for (int c = 0; c < LW; c += 8) {
                uint4 a = *reinterpret_cast<const uint4*>(qh + c), b = *reinterpret_cast<const uint4*>(kr + c);
                const bf162* pa = reinterpret_cast<const bf162*>(&a);
                const bf162* pb = reinterpret_cast<const bf162*>(&b);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float2 x = __bfloat1622float2(pa[k]), y = __bfloat1622float2(pb[k]);
                    acc = fmaf(x.x, y.x, acc);
                    acc = fmaf(x.y, y.y, acc);
                }
            }
            sc = acc * scale;
        }
        // online softmax over the chunk, per head (16 consecutive lanes)
        float a, p;
        kdtree::online_softmax_step<R>(sc, m, l, a, p);
        ps[sh * R + sr] = p;
        if (sr == 0) alpha_s[sh] = a;
        __syncthreads();
        if (ac < C) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float aj = alpha_s[4 * ah + j];
#pragma unroll
                for (int k = 0; k < 8; k++) o[j][k] *= aj;
            }
            for (int r = 0; r < R; r++) {
                uint4 v = *reinterpret_cast<const uint4*>(ks + r * LDS + ac);
                const bf162* pv = reinterpret_cast<const bf162*>(&v);
                float vf[8];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float2 f = __bfloat1622float2(pv[k]);
                    vf[2 * k] = f.x;
                    vf[2 * k + 1] = f.y;
                }
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float pj = ps[(4 * ah + j) * R + r];
#pragma unroll
                    for (int k = 0; k < 8; k++) o[j][k] = fmaf(pj, vf[k], o[j][k]);
                }
            }
        }
    }
    if (sr == 0 && sh < nh) {
        pml[(h0 + sh) * 2] = m;
        pml[(h0 + sh) * 2 + 1] = l;
    }
    if (ac < C) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int h = 4 * ah + j;
            if (h >= nh) continue;
            float* dst = po + (size_t)(h0 + h) * C + ac;
            *reinterpret_cast<float4*>(dst) = make_float4(o[j][0], o[j][1], o[j][2], o[j][3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(o[j][4], o[j][5], o[j][6], o[j][7]);
        }
    }
}

// q [T, Hr, C+P] bf16 (q_lat | q_pe per node and head); lat [S, C+P] bf16 (c_kv | k_pe), rows
// [committed, committed + T) are the nodes' own; mask [T, W] u64 or null (causal over the T nodes).
// committed_dev [1] or null: when set, the committed length is read from it (and `committed` ignored);
// rows_per_split <= 0: ceil(S / splits) rounded up to the chunk (empty splits write m = -inf, l = 0).
// part_o [T, splits, Hr, C] f32; part_ml [T, splits, Hr, 2] f32. grid (splits, T, ceil(Hr/16)), 256 threads.
extern "C" __global__ void __launch_bounds__(256) kdtree_mla_attention_split_bf16(const bf16* __restrict__ q, const bf16* __restrict__ lat,
                                const unsigned long long* __restrict__ mask, float* __restrict__ part_o,
                                float* __restrict__ part_ml, int T, int Hr, int C, int P, int committed,
                                const int* __restrict__ committed_dev, int W, int rows_per_split, float scale) {
    const int split = blockIdx.x, t = blockIdx.y, splits = gridDim.x;
    // A captured round reads the committed length from the device, and splits its rows evenly.
    if (committed_dev) committed = committed_dev[0];
    const size_t base = ((size_t)t * splits + split) * Hr;
    mla_split(q + (size_t)t * Hr * (C + P), lat, mask ? mask + (size_t)t * W : nullptr, T, t, committed, rows_per_split, split,
              splits, blockIdx.z * HG, Hr, C, P, scale, part_o + base * C, part_ml + base * 2);
}

// A batch's segments (sequences) in one launch, by value: segment s owns rows [row0[s], row0[s + 1]) of the
// launch (q, part_o, part_ml rows), its latent cache lat[s] (this layer's [cap, C+P] bf16), its tree mask
// mask[s] ([T_s, words[s]] u64), its committed length at pos[s] (an i32 on the device) and its own split
// count splits[s] <= gridDim.x (its rows split evenly; the launch's extra splits are empty for it), so every
// node's partials and their merge are those of the segment's own launch of the kernel above.
constexpr int MLA_SEGS = 64;
struct MlaSegs {
    unsigned long long lat[MLA_SEGS], mask[MLA_SEGS], pos[MLA_SEGS];
    int row0[MLA_SEGS + 1], words[MLA_SEGS], splits[MLA_SEGS];
    int nseg;
};
// grid (max splits, rows, ceil(Hr/16)), 256 threads; part_o [rows, gridDim.x, Hr, C], part_ml [rows, gridDim.x, Hr, 2].
extern "C" __global__ void __launch_bounds__(256) kdtree_mla_attention_split_seg_bf16(const bf16* __restrict__ q, const MlaSegs segs,
                                float* __restrict__ part_o, float* __restrict__ part_ml, int Hr, int C, int P, float scale) {
    const int split = blockIdx.x, g = blockIdx.y;
    int s = 0;
    while (s + 1 < segs.nseg && segs.row0[s + 1] <= g) s++;
    const int t = g - segs.row0[s], T = segs.row0[s + 1] - segs.row0[s];
    const int committed = reinterpret_cast<const int*>(segs.pos[s])[0];
    const auto* mask = reinterpret_cast<const unsigned long long*>(segs.mask[s]);
    const size_t base = ((size_t)g * gridDim.x + split) * Hr;
    mla_split(q + (size_t)g * Hr * (C + P), reinterpret_cast<const bf16*>(segs.lat[s]), mask ? mask + (size_t)t * segs.words[s] : nullptr,
              T, t, committed, 0, split, segs.splits[s], blockIdx.z * HG, Hr, C, P, scale, part_o + base * C, part_ml + base * 2);
}

// Merge the splits: o_lat[t, h, :] = Σ_i e^{m_i − M} o_i / Σ_i e^{m_i − M} l_i (M = max_i m_i).
// part_o [T, splits, Hr, C] f32, part_ml [T, splits, Hr, 2] f32 -> out [T, Hr, C] bf16.
// grid (T, Hr), blockDim.x a multiple of 32 (<= 1024), splits <= MLA_MERGE_MAX_SPLITS. The split weights
// e^{m_i − M} are computed once per (node, head) into shared memory by the whole block, then every column
// sums its splits in split order (the same sums, in the same order, as one thread per column would).
constexpr int MLA_MERGE_MAX_SPLITS = 1024;
extern "C" __global__ void kdtree_mla_attention_merge_bf16(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                           bf16* __restrict__ out, int splits, int Hr, int C) {
    __shared__ float ws[MLA_MERGE_MAX_SPLITS];  // e^{m_i − M}; 0 for an empty split (m_i = -inf)
    __shared__ float ls[MLA_MERGE_MAX_SPLITS];  // l_i
    __shared__ float red[32];
    __shared__ float inv_s;
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const auto row = [&](int i) { return ((size_t)t * splits + i) * Hr + h; };
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < splits; i += blockDim.x) mx = fmaxf(mx, part_ml[row(i) * 2]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kdtree::FULL_MASK, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) M = fmaxf(M, red[i]);
    for (int i = threadIdx.x; i < splits; i += blockDim.x) {
        const float mi = part_ml[row(i) * 2];
        ws[i] = kdtree::lse_weight(mi, M);
        ls[i] = mi != -INFINITY ? part_ml[row(i) * 2 + 1] : 0.f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float L = 0.f;
        for (int i = 0; i < splits; i++)
            if (ws[i] != 0.f || ls[i] != 0.f) L += ws[i] * ls[i];
        inv_s = 1.f / L;
    }
    __syncthreads();
    const float inv = inv_s;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int i = 0; i < splits; i++)
            if (ws[i] != 0.f || ls[i] != 0.f) acc += ws[i] * part_o[row(i) * C + c];
        out[((size_t)t * Hr + h) * C + c] = __float2bfloat16_rn(acc * inv);
    }
}
