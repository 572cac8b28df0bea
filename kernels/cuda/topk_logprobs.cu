// Per-row top-K of draft logits as log-probs (the DDTree builder's input, ddtree.md §2.2): for each row,
// the K best tokens in the engine's rank order (value descending, id ascending; -0 == +0; NaN last) and
// `logit - logsumexp(row)` in f32. CPU twin: engine ddtree::top_k_log_probs (sampling::top_k_into and
// sampling::log_sum_exp). Test: engine/tests/cuda_ddtree.rs. Wrapper: engine/src/cuda/ops/topk_logprobs.rs.
//
// One block of 1024 threads per row; the row stays in L2 between passes.
// 1. logsumexp: max in f32 (NaN ignored), then sum of exp(f64(x - m)) in f64, `lz = f32(f64(m) + ln s)`
//    (the CPU sums in index order, here in a tree: the f64 sums differ by ~1e-16 relative, so lz is the
//    same f32 except when f64(m) + ln s lies within that of an f32 rounding boundary).
// 2. Radix select of the K-th largest u64 rank key `ord(x) << 32 | (2^32 - 1 - id)` (sampling.rs header),
//    8 bits per pass from the top, stopping as soon as a whole digit bin is selected (keys are distinct,
//    so exactly K keys are >= the final prefix). Histograms are warp-aggregated (__match_any_sync).
// 3. The K selected keys are gathered into shared memory, bitonic-sorted descending and written out.
// K <= 2048 (the wrapper checks), V < 2^31.
#include "common.cuh"

namespace topk_logprobs {

constexpr int MAX_K = 2048;

__device__ __forceinline__ unsigned long long rank_key(float x, unsigned id) {
    unsigned ord = 0;
    if (x == x) {
        const unsigned b = __float_as_uint(x + 0.0f);  // -0 + 0 = +0
        ord = (b >> 31) ? ~b : (b | 0x80000000u);
    }
    return ((unsigned long long)ord << 32) | (0xffffffffu - id);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kdtree::FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < (int)((blockDim.x + 31) >> 5) ? scratch[lane] : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) r = fmaxf(r, __shfl_xor_sync(kdtree::FULL_MASK, r, o));
    return r;
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kdtree::FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double r = lane < (int)((blockDim.x + 31) >> 5) ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(kdtree::FULL_MASK, r, o);
    return r;
}

}  // namespace topk_logprobs

// x [rows, ld] f32 (first V used); lp [rows, K] f32 and tok [rows, K] u32, each row in rank order.
// grid (rows), block 1024, no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(1024) kdtree_topk_logprobs_f32(const float* __restrict__ x, int V, int ld, int K,
                                                                            float* __restrict__ lp, unsigned* __restrict__ tok) {
    using namespace topk_logprobs;
    __shared__ unsigned hist[256];
    __shared__ unsigned long long keys[MAX_K];
    __shared__ double dscratch[32];
    __shared__ float fscratch[32];
    __shared__ unsigned long long s_prefix;
    __shared__ unsigned s_need, s_done, s_count;
    const float* r = x + (size_t)blockIdx.x * ld;
    const int tid = threadIdx.x, lane = tid & 31;

    // 1. logsumexp (sampling::log_sum_exp).
    float m = -INFINITY;
    for (int i = tid; i < V; i += blockDim.x) m = fmaxf(m, r[i]);
    m = block_max(m, fscratch);
    float lz = m;
    if (isfinite(m)) {
        double s = 0.0;
        for (int i = tid; i < V; i += blockDim.x) s += exp((double)(r[i] - m));
        s = block_sum_f64(s, dscratch);
        lz = (float)((double)m + log(s));
    }

    // 2. Radix select: after the loop, exactly K keys are >= s_prefix.
    if (tid == 0) {
        s_prefix = 0ull;
        s_need = (unsigned)K;
        s_done = 0u;
    }
    unsigned long long mask = 0ull;  // bits decided so far (same in every thread)
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        if (s_done) break;
        const unsigned long long prefix = s_prefix;
        for (int base = 0; base < V; base += blockDim.x) {
            const int i = base + tid;
            bool in = false;
            unsigned digit = 0;
            if (i < V) {
                const unsigned long long k = rank_key(r[i], (unsigned)i);
                in = (k & mask) == prefix;
                digit = (unsigned)(k >> shift) & 0xffu;
            }
            const unsigned active = __ballot_sync(kdtree::FULL_MASK, in);
            if (in) {
                const unsigned peers = __match_any_sync(active, digit);
                if ((__ffs(peers) - 1) == lane) atomicAdd(&hist[digit], (unsigned)__popc(peers));
            }
        }
        __syncthreads();
        if (tid == 0) {
            unsigned need = s_need, above = 0u;
            int b = 255;
            for (; b > 0; b--) {
                if (above + hist[b] >= need) break;
                above += hist[b];
            }
            need -= above;
            s_prefix = prefix | ((unsigned long long)b << shift);
            s_need = need;
            s_done = hist[b] == need ? 1u : 0u;
        }
        mask |= 0xffull << shift;
        __syncthreads();
    }

    // 3. Gather the K keys >= prefix, sort them descending, write out.
    const unsigned long long prefix = s_prefix;
    int pad = 1;
    while (pad < K) pad <<= 1;
    for (int i = tid; i < pad; i += blockDim.x) keys[i] = 0ull;  // 0 is no real key (id would be 2^32-1)
    if (tid == 0) s_count = 0u;
    __syncthreads();
    for (int base = 0; base < V; base += blockDim.x) {
        const int i = base + tid;
        unsigned long long k = 0ull;
        bool in = false;
        if (i < V) {
            k = rank_key(r[i], (unsigned)i);
            in = k >= prefix;
        }
        const unsigned ballot = __ballot_sync(kdtree::FULL_MASK, in);
        unsigned at = 0u;
        if (lane == 0 && ballot) at = atomicAdd(&s_count, (unsigned)__popc(ballot));
        at = __shfl_sync(kdtree::FULL_MASK, at, 0);
        if (in) {
            const unsigned slot = at + (unsigned)__popc(ballot & ((1u << lane) - 1u));
            if (slot < (unsigned)MAX_K) keys[slot] = k;
        }
    }
    __syncthreads();
    // Bitonic sort of keys[0, pad), descending.
    for (int size = 2; size <= pad; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < pad; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool desc = (i & size) == 0;
                    const unsigned long long a = keys[i], b = keys[j];
                    if (desc ? (a < b) : (a > b)) {
                        keys[i] = b;
                        keys[j] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < K; i += blockDim.x) {
        const unsigned id = 0xffffffffu - (unsigned)keys[i];
        tok[(size_t)blockIdx.x * K + i] = id;
        lp[(size_t)blockIdx.x * K + i] = r[id] - lz;
    }
}
