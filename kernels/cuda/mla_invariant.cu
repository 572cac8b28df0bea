// Batch-invariant MLA in the absorbed (latent) form (`KDTREE_BATCH_INVARIANT`, `Gpu::batch_invariant`): every
// output's sum in one fixed order that depends on the node's own keys only, not on T, on the tree's layout or on
// which rows share a launch, so that a token gets the same bits in an AR step (its predecessors committed) and in
// a tree verify (its predecessors ancestors in the tree). f32 on CUDA cores: the correct form first, not the fast
// one (kernels/cuda/mla_attention.cu is the tensor-core form; docs/design/batch-invariance.md).
// A node's keys are a list: the committed rows 0 .. committed-1, then its visible tree rows (the ancestor mask's set
// bits, ascending: parents precede children, so that is depth order) at committed + node index. List position p
// is the token at sequence position p in both an AR step and a verify. The list is cut into chunks of S positions
// at multiples of S (absolute, so the same cuts in both); per (node, head, chunk), kdtree_mla_inv_partial_bf16
// computes the scores (one lane a key, its dot product over the C + P dims in ascending order), the chunk's max m,
// p = e^{s - m}, l = sum p in key order and o = sum p v in key order; kdtree_mla_inv_merge_bf16 merges the node's
// chunks in chunk order. The absorption (q_lat = q_nope W_UK) and W_UV around it: one output a thread or a warp,
// in ascending order (kdtree_mla_inv_absorb_bf16, kdtree_mla_inv_uv_bf16).
// CPU twin: the absorbed branch of engine cpu::ops::mla_attention (same sums, another f32 order).
// Test: engine/tests/cuda_mla.rs (mla_invariant_parity, mla_invariant_rows_equal_ar_and_verify). Wrapper:
// engine/src/cuda/ops/mla_invariant.rs. Dimension letters: T nodes, Hr heads, C kv_lora (<= 512), P rope
// (C + P <= 576, (C + P) % 8 == 0), Dn / Dv nope / v dims of a head, W mask words a node, S chunk positions.
#include "common.cuh"

namespace mla_inv {

constexpr int C_MAX = 512;
constexpr int WARPS = 8;

// Visible tree rows of `node`: the set bits of its mask row, or node + 1 (causal, no mask).
__device__ __forceinline__ int tree_count(const unsigned long long* __restrict__ mask, int W, int node) {
    if (!mask) return node + 1;
    int n = 0;
    for (int w = 0; w < W; w++) n += __popcll(mask[(size_t)node * W + w]);
    return n;
}

// The tree index of the r-th visible row of `node` (ascending).
__device__ __forceinline__ int tree_nth(const unsigned long long* __restrict__ mask, int W, int node, int r) {
    if (!mask) return r;
    for (int w = 0; w < W; w++) {
        unsigned long long b = mask[(size_t)node * W + w];
        const int pc = __popcll(b);
        if (r < pc) {
            for (int i = 0; i < r; i++) b &= b - 1;
            return w * 64 + __ffsll((long long)b) - 1;
        }
        r -= pc;
    }
    return 0;  // not reached: r < tree_count
}

}  // namespace mla_inv

// qcat[t, h, c] = bf16(sum_{d < Dn} q[t, h·(Dn+P) + d] · kv_b[h·(Dn+Dv) + d, c]), d ascending, for c < C.
// q [T, Hr·(Dn+P)] bf16, kv_b [Hr·(Dn+Dv), C] bf16, qcat [T, Hr, C+P]. Grid (ceil(C / 128), Hr, T), block 128.
extern "C" __global__ void __launch_bounds__(128) kdtree_mla_inv_absorb_bf16(const bf16* __restrict__ q, const bf16* __restrict__ kv_b,
                                                                             bf16* __restrict__ qcat, int Hr, int C, int P, int Dn,
                                                                             int Dv) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, t = blockIdx.z;
    if (c >= C) return;
    const bf16* qr = q + (size_t)t * Hr * (Dn + P) + (size_t)h * (Dn + P);
    const bf16* w = kv_b + (size_t)h * (Dn + Dv) * C + c;
    float acc = 0.f;
    for (int d = 0; d < Dn; d++) acc = fmaf(__bfloat162float(qr[d]), __bfloat162float(w[(size_t)d * C]), acc);
    qcat[((size_t)t * Hr + h) * (C + P) + c] = __float2bfloat16_rn(acc);
}

// o[t, h·Dv + v] = bf16(sum_c o_lat[t, h, c] · kv_b[h·(Dn+Dv) + Dn + v, c]): a warp an output, lane l summing
// c = l, l + 32, ... in order, then the warp's fixed butterfly. o_lat [T, Hr, C] bf16, o [T, Hr·Dv] bf16.
// Grid (ceil(Dv / 8), Hr, T), block 256.
extern "C" __global__ void __launch_bounds__(256) kdtree_mla_inv_uv_bf16(const bf16* __restrict__ o_lat, const bf16* __restrict__ kv_b,
                                                                         bf16* __restrict__ o, int Hr, int C, int Dn, int Dv) {
    const int lane = threadIdx.x & 31, v = blockIdx.x * 8 + (threadIdx.x >> 5), h = blockIdx.y, t = blockIdx.z;
    if (v >= Dv) return;
    const bf16* x = o_lat + ((size_t)t * Hr + h) * C;
    const bf16* w = kv_b + ((size_t)h * (Dn + Dv) + Dn + v) * C;
    float acc = 0.f;
    for (int c = lane; c < C; c += 32) acc = fmaf(__bfloat162float(x[c]), __bfloat162float(w[c]), acc);
    acc = kdtree::warp_sum(acc);
    if (lane == 0) o[(size_t)t * Hr * Dv + (size_t)h * Dv + v] = __float2bfloat16_rn(acc);
}

// Per (chunk blockIdx.x, node blockIdx.y, heads 8 blockIdx.z .. +8): the chunk's partial of each (node, head):
// part_ml[(node·Hr + h)·nch + chunk] = (m, l), part_o[((node·Hr + h)·nch + chunk)·C + c] = o[c]. A chunk past the
// node's list writes nothing (the merge reads ceil(len / S) chunks). q [T, Hr, C+P] bf16 (q_lat | q_pe); lat
// [cap, width] bf16, rows c_kv | k_pe; the committed length from committed_dev[0] when set (a captured round),
// else `committed`; mask [T, W] u64 (bit j of row i: tree row j visible to node i) or null (causal).
// Block 256 (8 warps, warp w: head 8 blockIdx.z + w); dynamic smem (8 (C+P) + 8 S) floats + S ints.
extern "C" __global__ void __launch_bounds__(256) kdtree_mla_inv_partial_bf16(
    const bf16* __restrict__ q, const bf16* __restrict__ lat, int width, const int* __restrict__ committed_dev, int committed,
    const unsigned long long* __restrict__ mask, int W, int Hr, int C, int P, float scale, int S, int nch,
    float* __restrict__ part_o, float* __restrict__ part_ml) {
    using namespace mla_inv;
    extern __shared__ __align__(16) unsigned char smem[];  // the name and type every kernel file uses (one TU)
    const int lw = C + P, chunk = blockIdx.x, node = blockIdx.y;
    if (committed_dev) committed = committed_dev[0];
    const int len = committed + tree_count(mask, W, node), lo = chunk * S;
    if (lo >= len) return;
    const int n = min(S, len - lo);
    float* qs = reinterpret_cast<float*>(smem);  // [8][lw]
    float* ps = qs + WARPS * lw;  // [8][S]
    int* rows = reinterpret_cast<int*>(ps + WARPS * S);  // [S]
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const int pos = lo + k;
        rows[k] = pos < committed ? pos : committed + tree_nth(mask, W, node, pos - committed);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = blockIdx.z * WARPS + warp;
    if (h < Hr) {
        const bf16* qr = q + ((size_t)node * Hr + h) * lw;
        for (int d = lane; d < lw; d += 32) qs[warp * lw + d] = __bfloat162float(qr[d]);
    }
    __syncthreads();
    if (h >= Hr) return;
    const float* qw = qs + warp * lw;
    float* p = ps + warp * S;
    // Scores: lane k % 32 takes key k, its dot product over the dims in ascending order (8 a 16-byte load).
    for (int k = lane; k < n; k += 32) {
        const uint4* kr = reinterpret_cast<const uint4*>(lat + (size_t)rows[k] * width);
        float acc = 0.f;
        for (int d8 = 0; d8 < lw / 8; d8++) {
            const uint4 u = kr[d8];
            const bf162* b = reinterpret_cast<const bf162*>(&u);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f = __bfloat1622float2(b[j]);
                acc = fmaf(qw[8 * d8 + 2 * j], f.x, acc);
                acc = fmaf(qw[8 * d8 + 2 * j + 1], f.y, acc);
            }
        }
        p[k] = acc * scale;
    }
    __syncwarp();
    float m = -INFINITY;
    for (int k = lane; k < n; k += 32) m = fmaxf(m, p[k]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kdtree::FULL_MASK, m, o));
    for (int k = lane; k < n; k += 32) p[k] = expf(p[k] - m);
    __syncwarp();
    // l and o in key order (every lane sums l alike; lane l owns columns c = l, l + 32, ...).
    float l = 0.f, o[C_MAX / 32];
#pragma unroll
    for (int i = 0; i < C_MAX / 32; i++) o[i] = 0.f;
    for (int k = 0; k < n; k++) {
        const float pk = p[k];
        l += pk;
        const bf16* vr = lat + (size_t)rows[k] * width;
#pragma unroll
        for (int i = 0; i < C_MAX / 32; i++) {
            const int c = lane + 32 * i;
            if (c < C) o[i] = fmaf(pk, __bfloat162float(vr[c]), o[i]);
        }
    }
    const size_t r = ((size_t)node * Hr + h) * nch + chunk;
#pragma unroll
    for (int i = 0; i < C_MAX / 32; i++) {
        const int c = lane + 32 * i;
        if (c < C) part_o[r * C + c] = o[i];
    }
    if (lane == 0) {
        part_ml[2 * r] = m;
        part_ml[2 * r + 1] = l;
    }
}

// o_lat[node, h, c] = bf16(sum_ch w_ch o_ch[c] / sum_ch w_ch l_ch), w_ch = e^{m_ch - M}, M the max m, over the
// node's chunks ch = 0 .. ceil(len / S) - 1 in order. Grid (Hr, T), block 128.
extern "C" __global__ void __launch_bounds__(128) kdtree_mla_inv_merge_bf16(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ committed_dev, int committed,
    const unsigned long long* __restrict__ mask, int W, int Hr, int C, int S, int nch, bf16* __restrict__ o_lat) {
    const int h = blockIdx.x, node = blockIdx.y;
    if (committed_dev) committed = committed_dev[0];
    const int len = committed + mla_inv::tree_count(mask, W, node), chunks = (len + S - 1) / S;
    const size_t r0 = ((size_t)node * Hr + h) * nch;
    float M = -INFINITY;
    for (int ch = 0; ch < chunks; ch++) M = fmaxf(M, part_ml[2 * (r0 + ch)]);
    float L = 0.f;
    for (int ch = 0; ch < chunks; ch++) L = fmaf(expf(part_ml[2 * (r0 + ch)] - M), part_ml[2 * (r0 + ch) + 1], L);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.f;
        for (int ch = 0; ch < chunks; ch++) acc = fmaf(expf(part_ml[2 * (r0 + ch)] - M), part_o[(r0 + ch) * C + c], acc);
        o_lat[((size_t)node * Hr + h) * C + c] = __float2bfloat16_rn(acc / L);
    }
}
