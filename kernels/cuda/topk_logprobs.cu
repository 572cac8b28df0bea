// Per-row top-K of draft logits as log-probs (the DDTree builder's input, ddtree.md §2.2): for each row,
// the K best tokens in the engine's rank order (value descending, id ascending; -0 == +0; NaN last) and
// `logit - logsumexp(row)` in f32. CPU twin: engine ddtree::top_k_log_probs (sampling::top_k_into and
// sampling::log_sum_exp). Test: engine/tests/cuda_ddtree.rs. Wrapper: engine/src/cuda/ops/topk_logprobs.rs.
//
// Each row is split over S chunks, one block each, so the whole GPU works on a few rows (three kernels):
// 1. topk_max: the max of each chunk (f32, NaN ignored).
// 2. topk_partial: every block takes the row max M over the chunk maxima, sums exp(f64(x - M)) over its
//    chunk in f64 (the same terms as the CPU's, summed in a tree), and selects its chunk's K best u64 rank
//    keys `ord(x) << 32 | (2^32 - 1 - id)` (sampling.rs header) by radix select: 8 bits per pass from the
//    top, stopping as soon as a whole digit bin is selected (keys are distinct, so exactly K keys are >= the
//    final prefix). Histograms are warp-aggregated (__match_any_sync). The keys go to a candidate buffer
//    (zero keys pad a chunk shorter than K: no real key is 0).
// 3. topk_merge, one block per row: lz = f32(f64(M) + ln Σ partial sums) (the CPU sums the same terms in
//    index order: the f64 sums differ by ~1e-16 relative, so lz is the same f32 except within that of an
//    f32 rounding boundary); the K best of the S·K candidates by the same radix select, bitonic-sorted
//    descending in shared memory, written out with their log-probs.
// K <= 2048, S <= 64 (the wrapper checks), V < 2^31.
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


// Radix select over n keys key(i), i < n: returns the prefix such that exactly K keys are >= it (K <= n).
// Block-wide; every thread returns the same value. hist [256], s_prefix / s_need / s_done in shared memory.
template <typename KeyOf>
__device__ unsigned long long radix_select(int n, int K, KeyOf key, unsigned* hist, unsigned long long* s_prefix, unsigned* s_need,
                                           unsigned* s_done) {
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        *s_prefix = 0ull;
        *s_need = (unsigned)K;
        *s_done = 0u;
    }
    unsigned long long mask = 0ull;  // bits decided so far (same in every thread)
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        if (*s_done) break;
        const unsigned long long prefix = *s_prefix;
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + tid;
            bool in = false;
            unsigned digit = 0;
            if (i < n) {
                const unsigned long long k = key(i);
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
            unsigned need = *s_need, above = 0u;
            int b = 255;
            for (; b > 0; b--) {
                if (above + hist[b] >= need) break;
                above += hist[b];
            }
            need -= above;
            *s_prefix = prefix | ((unsigned long long)b << shift);
            *s_need = need;
            *s_done = hist[b] == need ? 1u : 0u;
        }
        mask |= 0xffull << shift;
        __syncthreads();
    }
    return *s_prefix;
}

// Writes every key(i) >= prefix, i < n, to out[0, count) in any order (count starts at *s_count = 0).
template <typename KeyOf>
__device__ void gather_keys(int n, KeyOf key, unsigned long long prefix, unsigned long long* out, unsigned cap, unsigned* s_count) {
    const int tid = threadIdx.x, lane = tid & 31;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + tid;
        unsigned long long k = 0ull;
        bool in = false;
        if (i < n) {
            k = key(i);
            in = k >= prefix;
        }
        const unsigned ballot = __ballot_sync(kdtree::FULL_MASK, in);
        unsigned at = 0u;
        if (lane == 0 && ballot) at = atomicAdd(s_count, (unsigned)__popc(ballot));
        at = __shfl_sync(kdtree::FULL_MASK, at, 0);
        if (in) {
            const unsigned slot = at + (unsigned)__popc(ballot & ((1u << lane) - 1u));
            if (slot < cap) out[slot] = k;
        }
    }
}

}  // namespace topk_logprobs

// x [rows, ld] f32 (first V used), chunk = ceil(V / S); pmax [rows, S] f32. grid (S, rows), block 256.
extern "C" __global__ void __launch_bounds__(256) kdtree_topk_max_f32(const float* __restrict__ x, int V, int ld, int chunk,
                                                                      float* __restrict__ pmax) {
    using namespace topk_logprobs;
    __shared__ float fscratch[32];
    const float* r = x + (size_t)blockIdx.y * ld;
    const int c0 = blockIdx.x * chunk, c1 = min(V, c0 + chunk);
    float m = -INFINITY;
    for (int i = c0 + (int)threadIdx.x; i < c1; i += blockDim.x) m = fmaxf(m, r[i]);
    m = block_max(m, fscratch);
    if (threadIdx.x == 0) pmax[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = m;
}

// psum [rows, S] f64; cand [rows, S, K] u64 (this chunk's K best keys, any order, zero-padded).
// grid (S, rows), block 1024.
extern "C" __global__ void __launch_bounds__(1024) kdtree_topk_partial_f32(const float* __restrict__ x, int V, int ld, int K, int chunk,
                                                                           const float* __restrict__ pmax, double* __restrict__ psum,
                                                                           unsigned long long* __restrict__ cand) {
    using namespace topk_logprobs;
    __shared__ unsigned hist[256];
    __shared__ double dscratch[32];
    __shared__ float fscratch[32];
    __shared__ unsigned long long s_prefix;
    __shared__ unsigned s_need, s_done, s_count;
    const int S = gridDim.x, row = blockIdx.y, tid = threadIdx.x;
    const float* r = x + (size_t)row * ld;
    const int c0 = blockIdx.x * chunk, n = max(0, min(V, c0 + chunk) - c0);
    float m = -INFINITY;
    for (int i = tid; i < S; i += blockDim.x) m = fmaxf(m, pmax[(size_t)row * S + i]);
    m = block_max(m, fscratch);
    double sum = 0.0;
    if (isfinite(m))
        for (int i = tid; i < n; i += blockDim.x) sum += exp((double)(r[c0 + i] - m));
    sum = block_sum_f64(sum, dscratch);
    if (tid == 0) psum[(size_t)row * S + blockIdx.x] = sum;
    unsigned long long* out = cand + ((size_t)row * S + blockIdx.x) * K;
    const auto key = [&](int i) { return rank_key(r[c0 + i], (unsigned)(c0 + i)); };
    const unsigned long long prefix = n > K ? radix_select(n, K, key, hist, &s_prefix, &s_need, &s_done) : 0ull;
    if (tid == 0) s_count = 0u;
    __syncthreads();
    gather_keys(n, key, prefix, out, (unsigned)K, &s_count);
    for (int i = min(n, K) + tid; i < K; i += blockDim.x) out[i] = 0ull;  // a short chunk: zero keys
}

// lp [rows, K] f32 and tok [rows, K] u32, each row in rank order. grid (rows), block 1024.
extern "C" __global__ void __launch_bounds__(1024) kdtree_topk_merge_f32(const float* __restrict__ x, int ld, int K, int S,
                                                                         const float* __restrict__ pmax, const double* __restrict__ psum,
                                                                         const unsigned long long* __restrict__ cand,
                                                                         float* __restrict__ lp, unsigned* __restrict__ tok) {
    using namespace topk_logprobs;
    __shared__ unsigned hist[256];
    __shared__ unsigned long long keys[MAX_K];
    __shared__ float fscratch[32];
    __shared__ float s_lz;
    __shared__ unsigned long long s_prefix;
    __shared__ unsigned s_need, s_done, s_count;
    const int row = blockIdx.x, tid = threadIdx.x;
    const float* r = x + (size_t)row * ld;
    // logsumexp from the chunk maxima and sums (sampling::log_sum_exp)
    float m = -INFINITY;
    for (int i = tid; i < S; i += blockDim.x) m = fmaxf(m, pmax[(size_t)row * S + i]);
    m = block_max(m, fscratch);
    if (tid == 0) {
        float lz = m;
        if (isfinite(m)) {
            double sum = 0.0;
            for (int i = 0; i < S; i++) sum += psum[(size_t)row * S + i];
            lz = (float)((double)m + log(sum));
        }
        s_lz = lz;
    }
    const unsigned long long* c = cand + (size_t)row * S * K;
    const auto key = [&](int i) { return c[i]; };
    const unsigned long long prefix = radix_select(S * K, K, key, hist, &s_prefix, &s_need, &s_done);
    int pad = 1;
    while (pad < K) pad <<= 1;
    for (int i = tid; i < pad; i += blockDim.x) keys[i] = 0ull;  // 0 is no real key (id would be 2^32-1)
    if (tid == 0) s_count = 0u;
    __syncthreads();
    gather_keys(S * K, key, prefix, keys, (unsigned)MAX_K, &s_count);
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
    const float lz = s_lz;
    for (int i = tid; i < K; i += blockDim.x) {
        const unsigned id = 0xffffffffu - (unsigned)keys[i];
        tok[(size_t)row * K + i] = id;
        lp[(size_t)row * K + i] = r[id] - lz;
    }
}
