// MoE router (noaux_tc, sigmoid), one token per block: s = sigmoid(logits) in f32; selection on
// s + e_score_correction_bias; with n_group > 1 or topk_group < n_group, groups are scored by the sum of
// their top-2 biased scores, the topk_group best kept and the rest set to 0.0; top_k experts by selection
// score (lowest index first on ties); weights are the unbiased s, divided by (sum + 1e-20) when norm,
// times routed_scaling_factor (k26-format §4.5).
// CPU twin: engine model::ffn::route (same order of operations; sigmoid through expf, so a weight may
// differ by an ulp). Test: engine/tests/cuda_ops.rs (moe_router cases; ids bit for bit on tie-free input).
// Wrapper: engine/src/cuda/ops/moe_router.rs. Limits: E <= 1024, top_k <= 32, n_group <= 64, E % n_group == 0.
// Without groups the wrapper takes the one-warp-a-token form below (kdtree_moe_router_warp{4,12,32}_f32).
#include "common.cuh"

constexpr int ROUTER_MAX_E = 1024;
constexpr int ROUTER_MAX_GROUPS = 64;
constexpr int ROUTER_MAX_TOPK = 32;

// logits [T, E] f32 in rows ld apart (the router's block of a stacked linear; ld = E alone), bias [E] f32 or
// null; ids [T, top_k] i32, weights [T, top_k] f32. blockDim.x = 256.
extern "C" __global__ void kdtree_moe_router_f32(const float* __restrict__ logits, long long ld, const float* __restrict__ bias,
                                                 int E, int n_group, int topk_group, int top_k, int norm,
                                                 float routed_scaling, int* __restrict__ ids,
                                                 float* __restrict__ weights) {
    __shared__ float s[ROUTER_MAX_E];       // unbiased sigmoid scores
    __shared__ float sel[ROUTER_MAX_E];     // selection scores (biased, group-masked)
    __shared__ float gscore[ROUTER_MAX_GROUPS];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int chosen[ROUTER_MAX_TOPK];
    const float* lr = logits + (size_t)blockIdx.x * ld;
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
        const float v = 1.0f / (1.0f + expf(-lr[i]));
        s[i] = v;
        sel[i] = bias ? v + bias[i] : v;
    }
    __syncthreads();
    if (n_group > 1 || topk_group < n_group) {
        const int gs = E / n_group, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        for (int g = warp; g < n_group; g += nwarps) {
            const float* grp = sel + g * gs;
            kdtree::Best b1{0.f, kdtree::INVALID};
            for (int i = lane; i < gs; i += 32) b1 = kdtree::best_of(b1, kdtree::Best{grp[i], i});
            b1 = kdtree::warp_best(b1);
            float score = 0.f + grp[b1.i];
            if (gs >= 2) {
                kdtree::Best b2{0.f, kdtree::INVALID};
                for (int i = lane; i < gs; i += 32)
                    if (i != b1.i) b2 = kdtree::best_of(b2, kdtree::Best{grp[i], i});
                b2 = kdtree::warp_best(b2);
                score = score + grp[b2.i];
            }
            if (lane == 0) gscore[g] = score;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // keep[g] marks the topk_group best groups (selection sort, lowest index first on ties).
            unsigned long long keep = 0;
            for (int r = 0; r < topk_group; r++) {
                int bi = -1;
                for (int g = 0; g < n_group; g++) {
                    if ((keep >> g) & 1ull) continue;
                    if (bi < 0 || gscore[g] > gscore[bi]) bi = g;
                }
                keep |= 1ull << bi;
            }
            for (int g = 0; g < n_group; g++) gscore[g] = ((keep >> g) & 1ull) ? 1.f : 0.f;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < E; i += blockDim.x)
            if (gscore[i / gs] == 0.f) sel[i] = 0.0f;
        __syncthreads();
    }
    for (int r = 0; r < top_k; r++) {
        kdtree::Best b{0.f, kdtree::INVALID};
        for (int i = threadIdx.x; i < E; i += blockDim.x) {
            bool taken = false;
            for (int j = 0; j < r; j++) taken |= chosen[j] == i;
            const float v = sel[i];
            if (!taken && v == v) b = kdtree::best_of(b, kdtree::Best{v, i});
        }
        b = kdtree::block_best(b, sv, si);
        if (threadIdx.x == 0) chosen[r] = b.i;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float w[ROUTER_MAX_TOPK];
        float sum = 0.f;
        for (int r = 0; r < top_k; r++) {
            w[r] = chosen[r] == kdtree::INVALID ? 0.f : s[chosen[r]];  // fewer than top_k non-NaN scores
            sum = sum + w[r];
        }
        const float den = sum + 1e-20f;
        for (int r = 0; r < top_k; r++) {
            float v = norm ? w[r] / den : w[r];
            v = v * routed_scaling;
            ids[(size_t)blockIdx.x * top_k + r] = chosen[r] == kdtree::INVALID ? -1 : chosen[r];
            weights[(size_t)blockIdx.x * top_k + r] = v;
        }
    }
}

// The same router without groups (n_group == 1: K2.6, the tiny models), one warp per token instead of one block:
// lane l holds experts l, l + 32, ... (V a lane) in registers, and each of the top_k rounds is a lane-local scan
// and one warp argmax (larger selection score, then lower index: the block kernel's order, so the same ids);
// round r's expert and its unbiased score stay on lane r, the sum runs over the rounds in order on every lane,
// and lane r writes its weight (the block kernel's arithmetic, so the same bits). A token with fewer than top_k
// non-NaN scores gets id -1 and weight 0 for the rest (moe_align and the combine drop ids outside the experts),
// as in the block kernel.
// 8 tokens a block of 256 threads; grid ceil(T / 8). The block kernel took ~11.7 us a call at T = 1 for its 8
// rounds of block-wide argmax (0.70 ms over the 60 MoE layers of the K2.6 TP8 rank-0 AR step; ncu, issue 26).
namespace moe_router_warp {
template <int V>
__device__ __forceinline__ void route(const float* __restrict__ logits, long long ld, const float* __restrict__ bias, int T, int E,
                                      int top_k, int norm, float routed_scaling, int* __restrict__ ids,
                                      float* __restrict__ weights) {
    const int tok = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (tok >= T) return;
    const float* lr = logits + (size_t)tok * ld;
    // Every load first, then the arithmetic: with the loads inside the branchy sigmoid (IEEE divide, its slow path
    // a call) the compiler issued them one after another, 2 V dependent trips to memory (~17 us a call, ncu run
    // 92); here they are all in flight together.
    float lg[V], bs_[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
        const int i = lane + 32 * j;
        lg[j] = i < E ? __ldg(lr + i) : 0.f;
        bs_[j] = (bias && i < E) ? __ldg(bias + i) : 0.f;
    }
    float s[V], sel[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
        const int i = lane + 32 * j;
        if (i < E) {
            const float v = 1.0f / (1.0f + expf(-lg[j]));
            s[j] = v;
            sel[j] = bias ? v + bs_[j] : v;
        } else {
            s[j] = 0.f;
            sel[j] = __int_as_float(0x7fffffff);  // NaN: never selected
        }
    }
    unsigned taken = 0;
    int my_id = -1;
    float my_s = 0.f;
    for (int r = 0; r < top_k; r++) {
        kdtree::Best b{0.f, kdtree::INVALID};
        float bs = 0.f;  // the unbiased score of this lane's best
#pragma unroll
        for (int j = 0; j < V; j++) {
            const float v = sel[j];
            if (!((taken >> j) & 1u) && v == v) {
                const kdtree::Best c{v, lane + 32 * j};
                if (kdtree::better(c, b)) {
                    b = c;
                    bs = s[j];
                }
            }
        }
        const kdtree::Best w = kdtree::warp_best(b);
        const bool valid = w.i != kdtree::INVALID;
        const int owner = valid ? (w.i & 31) : 0;
        const float ws = __shfl_sync(kdtree::FULL_MASK, bs, owner);
        if (valid && lane == owner) taken |= 1u << (w.i >> 5);
        if (lane == r) {
            my_id = valid ? w.i : -1;
            my_s = valid ? ws : 0.f;
        }
    }
    float sum = 0.f;
    for (int r = 0; r < top_k; r++) sum = sum + __shfl_sync(kdtree::FULL_MASK, my_s, r);
    if (lane < top_k) {
        const float den = sum + 1e-20f;
        float v = norm ? my_s / den : my_s;
        v = v * routed_scaling;
        ids[(size_t)tok * top_k + lane] = my_id;
        weights[(size_t)tok * top_k + lane] = v;
    }
}
}  // namespace moe_router_warp

// logits [T, E] f32 in rows ld apart, bias [E] f32 or null; ids, weights [T, top_k]. E <= 32 V, top_k <= 32;
// block 256, grid ceil(T / 8).
#define KDTREE_ROUTER_WARP_ARGS                                                                                  \
    const float *__restrict__ logits, long long ld, const float *__restrict__ bias, int T, int E, int top_k,      \
        int norm, float routed_scaling, int *__restrict__ ids, float *__restrict__ weights
#define KDTREE_ROUTER_WARP(V) \
    moe_router_warp::route<V>(logits, ld, bias, T, E, top_k, norm, routed_scaling, ids, weights)
extern "C" __global__ void __launch_bounds__(256) kdtree_moe_router_warp4_f32(KDTREE_ROUTER_WARP_ARGS) {
    KDTREE_ROUTER_WARP(4);
}
extern "C" __global__ void __launch_bounds__(256) kdtree_moe_router_warp12_f32(KDTREE_ROUTER_WARP_ARGS) {
    KDTREE_ROUTER_WARP(12);
}
extern "C" __global__ void __launch_bounds__(256) kdtree_moe_router_warp32_f32(KDTREE_ROUTER_WARP_ARGS) {
    KDTREE_ROUTER_WARP(32);
}
