// MLA attention in the weight-absorbed form over the 576-wide latent cache, for decode, causal prefill
// and tree verification alike: node i (of T new nodes) attends to the committed prefix [0, committed) and
// to the tree nodes j whose bit is set in its ancestor mask (itself and its ancestors; a chain gives the
// causal mask). Per (node i, head h):
//   score(s) = scale * (q[i, h, :512] . kv[s, :512] + q[i, h, 512:] . kv[s, 512:])   (q already absorbed
//   through W_UK and roped; kv rows are rms_norm(c_kv) | rope(k_pe), slot committed + j for tree node j)
//   o[i, h, :] = softmax(score) . kv[:, :512]                                        (W_UV applied after)
// CPU twin: the `AttnMode::Absorbed` branch of engine model::attention::mla (scores, softmax, latent
// average); the parity test carries it as a local reference. Test: engine/tests/cuda_mla.rs.
// Wrapper: engine/src/cuda/ops/mla_attn.rs. STATUS: written 2026-12-01 after the session's GPU calls were
// spent: compile-checked for sm_90a/sm_120a, NOT yet run on a GPU.
//
// Design (v1, CUDA cores; the tensor-core path is the speed issue's): flash-decoding split-KV. Grid
// (T, ceil(H / 8), S splits); a block's 8 warps are 8 heads of one node and share each 32-row KV tile in
// shared memory (the latent cache is shared by all heads, so it is read once per block, not per head).
// Lane l owns latent dims [16 l, 16 l + 16) and rope dims [2 l, 2 l + 2): one warp-sum per row gives the
// score; online softmax keeps (max, sum, 16 accumulators) per lane. Each split writes unnormalised partials
// and its (max, sum); kdtree_mla_merge_f32 merges the splits with log-sum-exp weights (SGLang/FlashInfer's
// merge_state) and rounds to bf16. Mask: [T, words] u64, bit j of row i = tree node j visible to node i,
// any width (words = ceil(T / 64); 16 words for 1024 nodes).
#include "common.cuh"

namespace mla {

constexpr int D = 576, DL = 512;   // latent + rope, latent
constexpr int HEADS_PER_CTA = 8;    // one warp per head
constexpr int TILE = 32;            // KV rows per shared-memory tile (36 KB)

}  // namespace mla

// q [T, H, 576] bf16, kv [committed + T, 576] bf16, mask [T, words] u64;
// o_part [S, T, H, 512] f32 (unnormalised), ml_part [S, T, H, 2] f32 (running max, sum of exp).
// Grid (T, ceil(H / 8), S), block 256, static smem 36 KB.
extern "C" __global__ void __launch_bounds__(256) kdtree_mla_attn_bf16(
    const bf16* __restrict__ q, const bf16* __restrict__ kv, const unsigned long long* __restrict__ mask, int T,
    int H, int committed, int words, float scale, int rows_per_split, float* __restrict__ o_part,
    float* __restrict__ ml_part) {
    using namespace mla;
    __shared__ __align__(16) bf16 tile[TILE * D];
    const int i = blockIdx.x, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.y * HEADS_PER_CTA + warp;
    const bool head_ok = h < H;
    const unsigned long long* mrow = mask + (size_t)i * words;
    const int total = committed + T;
    const int s_lo = split * rows_per_split, s_hi = min(total, s_lo + rows_per_split);

    // This lane's query slice: latent dims [16 lane, +16), rope dims [512 + 2 lane, +2).
    float ql[16], qr[2];
    {
        const bf16* qh = q + ((size_t)i * H + (head_ok ? h : 0)) * D;
        const uint4 a = *reinterpret_cast<const uint4*>(qh + 16 * lane);
        const uint4 b = *reinterpret_cast<const uint4*>(qh + 16 * lane + 8);
        const bf162* pa = reinterpret_cast<const bf162*>(&a);
        const bf162* pb = reinterpret_cast<const bf162*>(&b);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 fa = __bfloat1622float2(pa[j]), fb = __bfloat1622float2(pb[j]);
            ql[2 * j] = fa.x;
            ql[2 * j + 1] = fa.y;
            ql[8 + 2 * j] = fb.x;
            ql[8 + 2 * j + 1] = fb.y;
        }
        const float2 r = __bfloat1622float2(*reinterpret_cast<const bf162*>(qh + DL + 2 * lane));
        qr[0] = r.x;
        qr[1] = r.y;
    }
    float m = -INFINITY, l = 0.f, acc[16];
#pragma unroll
    for (int j = 0; j < 16; j++) acc[j] = 0.f;

    for (int t0 = s_lo; t0 < s_hi; t0 += TILE) {
        const int rows = min(TILE, s_hi - t0);
        __syncthreads();  // the previous tile is no longer read
        for (int c = threadIdx.x; c < rows * (D / 8); c += blockDim.x) {
            const int r = c / (D / 8), k = c % (D / 8);
            reinterpret_cast<uint4*>(tile + r * D)[k] = reinterpret_cast<const uint4*>(kv + (size_t)(t0 + r) * D)[k];
        }
        __syncthreads();
        if (!head_ok) continue;
        for (int r = 0; r < rows; r++) {
            const int s = t0 + r;
            if (s >= committed) {
                const int j = s - committed;
                if (!((mrow[j >> 6] >> (j & 63)) & 1ull)) continue;
            }
            const bf16* row = tile + r * D;
            const uint4 a = *reinterpret_cast<const uint4*>(row + 16 * lane);
            const uint4 b = *reinterpret_cast<const uint4*>(row + 16 * lane + 8);
            const bf162* pa = reinterpret_cast<const bf162*>(&a);
            const bf162* pb = reinterpret_cast<const bf162*>(&b);
            float kvl[16];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 fa = __bfloat1622float2(pa[j]), fb = __bfloat1622float2(pb[j]);
                kvl[2 * j] = fa.x;
                kvl[2 * j + 1] = fa.y;
                kvl[8 + 2 * j] = fb.x;
                kvl[8 + 2 * j + 1] = fb.y;
            }
            const float2 kr = __bfloat1622float2(*reinterpret_cast<const bf162*>(row + DL + 2 * lane));
            float part = qr[0] * kr.x + qr[1] * kr.y;
#pragma unroll
            for (int j = 0; j < 16; j++) part += ql[j] * kvl[j];
            const float score = kdtree::warp_sum(part) * scale;
            const float m_new = fmaxf(m, score);
            const float corr = expf(m - m_new);  // m = -inf on the first row: corr = 0
            const float p = expf(score - m_new);
            l = l * corr + p;
#pragma unroll
            for (int j = 0; j < 16; j++) acc[j] = acc[j] * corr + p * kvl[j];
            m = m_new;
        }
    }
    if (!head_ok) return;
    const size_t o = ((size_t)split * T + i) * H + h;
    float4* dst = reinterpret_cast<float4*>(o_part + o * DL + 16 * lane);
#pragma unroll
    for (int j = 0; j < 4; j++) dst[j] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    if (lane == 0) {
        ml_part[o * 2] = m;
        ml_part[o * 2 + 1] = l;
    }
}

// Merge S split partials: out[i, h, :] = bf16(sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s), M = max m_s.
// out [T, H, 512] bf16 (a fully masked row, impossible with the self bit, gives zeros). Grid (T * H), block 128.
extern "C" __global__ void kdtree_mla_merge_f32(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                                                int S, int TH, bf16* __restrict__ out) {
    const int ih = blockIdx.x;
    float M = -INFINITY;
    for (int s = 0; s < S; s++) M = fmaxf(M, ml_part[((size_t)s * TH + ih) * 2]);
    float L = 0.f;
    for (int s = 0; s < S; s++) {
        const float ms = ml_part[((size_t)s * TH + ih) * 2];
        if (ms != -INFINITY) L += expf(ms - M) * ml_part[((size_t)s * TH + ih) * 2 + 1];
    }
    const float inv = L > 0.f ? 1.0f / L : 0.f;
    for (int d = threadIdx.x; d < mla::DL; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; s++) {
            const float ms = ml_part[((size_t)s * TH + ih) * 2];
            if (ms != -INFINITY) a += expf(ms - M) * o_part[((size_t)s * TH + ih) * mla::DL + d];
        }
        out[(size_t)ih * mla::DL + d] = __float2bfloat16_rn(a * inv);
    }
}
