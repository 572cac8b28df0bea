// The decision of every row of logits at once: greedy argmax, or a seeded sample after temperature, top-k
// and top-p, row r drawing with the uniform of its own position (a DDTree node at depth d under a root at
// position `start` emits position start + d + 1, so all nodes of a tree are drawn in parallel).
// CPU twin: engine sampling::sample (= decide(row, s, uniform(seed, position)); the header of
// engine/src/sampling.rs is the spec, steps 1-4). Test: engine/tests/cuda_sample.rs (token for token);
// bench: engine/tests/cuda_bench.rs `sample_rows_time`. Wrapper: engine/src/cuda/ops/sample_rows.rs.
// Build line: see common.cuh. Versions: v1 (this file).
//
// Dimension letters: R = rows, V = vocab (first V of each row of stride ld used). One block of 1024 threads
// per row; everything is a pass over the row in global memory plus shared-memory histograms (no workspace,
// no host sync, graph-capturable). ord(x) is the 32-bit value order of sampling::rank_key (NaN -> 0, -0 ==
// +0); the rank order is ord descending, then id ascending.
//   greedy (T <= 0 or NaN): one pass, argmax rule (lowest id on ties, NaN never wins, all-NaN -> 0).
//   step 1: one pass: max l over non-NaN, #candidates n (0 -> token 0); m = f64(max) / f64(T);
//           w_j = 1 if f64(l_j)/f64(T) == m else exp(f64(l_j)/f64(T) - m).
//   step 2 (0 < k < n): radix select of the k-th largest ord (11/11/10-bit digits, count histograms, the
//           first digit folded into the step-1 pass); keep ord >= ord_k (= l >= v_k, ties survive).
//   step 3 (P < 1): Z_k = sum of the kept weights (a fixed-order block tree in f64); each kept token's mass
//           q_j = round(w_j / Z_k * 2^63) as an integer; radix select over ord (11/11/10) with mass
//           histograms finds the value of the cut (the largest ord whose rank-order cumulative mass reaches
//           ceil(P * 2^63)); within the tie group of that value (equal values, equal q) the cut is the
//           r-th in id order with r from integer arithmetic, and its id comes from a block prefix count.
//   step 4: Z = sum of the survivors' weights, per warp over a contiguous id segment then in warp order;
//           the warp(s) whose segment can hold the crossing walk it in id order with a warp scan; the
//           smallest survivor id whose prefix sum is > u * Z wins (the last survivor if none).
// Exactness vs the CPU: the greedy path, the candidate set, top-k, the tie rules, Philox and u are exact.
// Sums run in another order than the CPU's sequential ones (the top-p cumulative in 2^-63 fixed point,
// each term rounded once), and CUDA's f64 exp is within 1 ulp (the CPU's libm is too), so the token can
// differ from the CPU's only when u * Z, or P against the top-p cumulative, lies within f64 rounding
// (~1e-13 relative, V * 2^-63 for the fixed point) of a boundary between two tokens. The spec allows that
// (sampling.rs header); the parity test detects such rows in f64 on the host and reports them.
// All sums are in a fixed order (integer atomics only), so a replay gives the same tokens.
// Rows with exact ties hit such boundaries on purpose: P = 0.5 over an even group of equal weights puts the
// exact cumulative on P, and the CPU's sequential sum rounds it either way (about 1 in 1,500 of the
// settings x rows of a GPU-free model of this algorithm, all on quantized rows at top_p 0.5).
// Cost (v1): passes over each row: greedy 1, top-k 5, top-p 7, both 9, + 2 when the cut falls inside
// a tie group; and two f64 exps per token for top-p (Z_k and the first mass histogram). Not yet done: a
// shared-memory list of the candidates after the first digit, so later passes skip the row.
#include "common.cuh"
#include "philox.cuh"

// Named, not anonymous: build.rs compiles every .cu as one translation unit.
namespace sample_rows {

constexpr int THREADS = 1024;        // the wrapper launches exactly this many threads per block
constexpr int WARPS = THREADS / 32;  // 32: the block scans below finish with one warp over the warp totals
constexpr int BINS = 2048;           // 11-bit radix digits of ord: bits 31..21, 20..10, 9..0
constexpr int LEVELS = 3;
typedef unsigned long long u64;

__device__ __forceinline__ int digit_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__device__ __forceinline__ int digit_bins(int level) { return level == 2 ? 1024 : 2048; }
__device__ __forceinline__ unsigned digit_of(unsigned o, int level) {
    return (o >> digit_shift(level)) & (unsigned)(digit_bins(level) - 1);
}
// o agrees with `prefix` on the digits fixed before `level`.
__device__ __forceinline__ bool in_prefix(unsigned o, unsigned prefix, int level) {
    return level == 0 || (o >> digit_shift(level - 1)) == (prefix >> digit_shift(level - 1));
}

// sampling::rank_key's high word: NaN -> 0; else with b = bits(x) (-0 -> +0), !b when negative, b | 2^31.
__device__ __forceinline__ unsigned value_ord(float x) {
    if (x != x) return 0u;
    const unsigned b = x == 0.f ? 0u : __float_as_uint(x);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

// Step 1 weight (Survivors::weight): 1 at the maximum, else exp(x - m), all in f64.
__device__ __forceinline__ double weight(float l, double t, double m) {
    const double x = (double)l / t;
    return x == m ? 1.0 : exp(x - m);
}

// Which tokens survive: ord > o, or ord == o and id <= id_lim (a cut inside a tie group). NaN (ord 0)
// never survives: o >= 0 and a tie cut has o >= 1.
struct Keep {
    unsigned o;
    int id_lim;
    __device__ __forceinline__ bool operator()(unsigned ord, int id) const { return ord > o || (ord == o && id <= id_lim); }
};

struct Smem {
    unsigned count[BINS];  // radix histogram: tokens per digit
    u64 mass[BINS];        // radix histogram: fixed-point mass per digit (top-p)
    unsigned sc[WARPS];    // block-scan scratch
    u64 sm[WARPS];
    double wsum[WARPS];    // step 4: per-warp survivor weight sums, then offsets
    double woff[WARPS + 1];
    int wlast[WARPS];
    unsigned wcnt[WARPS];
    unsigned wcoff[WARPS];
    float bv[32];          // block_best scratch
    int bi[32];
    // Broadcast results.
    int pick_digit;
    unsigned pick_cnt_above, pick_cnt;
    u64 pick_mass_above, pick_mass;
    int last, found, tie_id;
    unsigned n;
};

// Inclusive scan over the block of (c, m) in thread order (integers: any association gives the same sums).
__device__ __forceinline__ void block_scan2(unsigned& c, u64& m, Smem& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned c2 = __shfl_up_sync(kdtree::FULL_MASK, c, o);
        const u64 m2 = __shfl_up_sync(kdtree::FULL_MASK, m, o);
        if (lane >= o) {
            c += c2;
            m += m2;
        }
    }
    __syncthreads();  // sc / sm may still be read by a previous call
    if (lane == 31) {
        s.sc[warp] = c;
        s.sm[warp] = m;
    }
    __syncthreads();
    if (warp == 0) {
        unsigned wc = s.sc[lane];
        u64 wm = s.sm[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned c2 = __shfl_up_sync(kdtree::FULL_MASK, wc, o);
            const u64 m2 = __shfl_up_sync(kdtree::FULL_MASK, wm, o);
            if (lane >= o) {
                wc += c2;
                wm += m2;
            }
        }
        s.sc[lane] = wc;
        s.sm[lane] = wm;
    }
    __syncthreads();
    if (warp > 0) {
        c += s.sc[warp - 1];
        m += s.sm[warp - 1];
    }
}

// Scans the histogram (nb bins) from the highest digit down and stores in s.pick_*: count mode (by_mass
// false), the digit where the count through it first reaches `need` (>= 1); mass mode, the first nonempty
// digit where the mass through it reaches `need`; and the count and mass above it and in it. pick_digit
// is -1 when no digit qualifies. Readable after the next __syncthreads().
__device__ void pick(Smem& s, int nb, bool by_mass, u64 need) {
    const int t = threadIdx.x;
    if (t == 0) s.pick_digit = -1;
    unsigned c[2];
    u64 m[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i, d = nb - 1 - r;  // r: position in descending digit order
        c[i] = r < nb ? s.count[d] : 0u;
        m[i] = r < nb && by_mass ? s.mass[d] : 0ull;
    }
    unsigned ce = c[0] + c[1];
    u64 me = m[0] + m[1];
    block_scan2(ce, me, s);  // inclusive; orders the pick_digit = -1 above before any write below
    ce -= c[0] + c[1];
    me -= m[0] + m[1];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i;
        // Mass mode: qualifies if nonempty and reaches need; first such = no nonempty digit above reaches it
        // (the last nonempty digit above has the cumulative me).
        const bool hit = by_mass ? c[i] > 0 && me + m[i] >= need && !(ce > 0 && me >= need)
                                 : ce + c[i] >= need && ce < need;
        if (r < nb && hit) {
            s.pick_digit = nb - 1 - r;
            s.pick_cnt_above = ce;
            s.pick_mass_above = me;
            s.pick_cnt = c[i];
            s.pick_mass = m[i];
        }
        ce += c[i];
        me += m[i];
    }
}

__device__ __forceinline__ void clear_hist(Smem& s, bool with_mass) {
    for (int i = threadIdx.x; i < BINS; i += THREADS) {
        s.count[i] = 0u;
        if (with_mass) s.mass[i] = 0ull;
    }
}

// Adds the active lanes' tokens to the histograms; called by all 32 lanes of a warp together. Lanes with
// the same digit are aggregated for the count (match), and for the mass too when the whole warp agrees.
__device__ __forceinline__ void hist_add(Smem& s, bool active, unsigned d, u64 q, bool with_mass) {
    const int lane = threadIdx.x & 31;
    const unsigned act = __ballot_sync(kdtree::FULL_MASK, active);
    if (act == 0u) return;
    const unsigned d0 = __shfl_sync(kdtree::FULL_MASK, d, __ffs(act) - 1);
    if (__all_sync(kdtree::FULL_MASK, !active || d == d0)) {
        u64 sum = active ? q : 0ull;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kdtree::FULL_MASK, sum, o);
        if (lane == 0) {
            atomicAdd(&s.count[d0], (unsigned)__popc(act));
            if (with_mass && sum) atomicAdd(&s.mass[d0], sum);
        }
        return;
    }
    if (!active) return;
    const unsigned peers = __match_any_sync(act, d);
    if (__ffs(peers) - 1 == lane) atomicAdd(&s.count[d], (unsigned)__popc(peers));
    if (with_mass && q) atomicAdd(&s.mass[d], q);
}

// Deterministic block sum of f64 (fixed shuffle tree per warp, then warp 0 over the warp sums); every
// thread gets the result.
__device__ __forceinline__ double block_sum_f64(double v, Smem& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kdtree::FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) s.wsum[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double w = s.wsum[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) w += __shfl_down_sync(kdtree::FULL_MASK, w, o);
        if (lane == 0) s.woff[0] = w;
    }
    __syncthreads();
    return s.woff[0];
}

// Block-wide count; every thread gets the result.
__device__ __forceinline__ unsigned block_count(unsigned v, Smem& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = __reduce_add_sync(kdtree::FULL_MASK, v);
    __syncthreads();
    if (lane == 0) s.wcnt[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const unsigned w = __reduce_add_sync(kdtree::FULL_MASK, s.wcnt[lane]);
        if (lane == 0) s.n = w;
    }
    __syncthreads();
    return s.n;
}

// Id of the r-th (1-based, r <= count) token with ord == o in id order: per-warp counts over contiguous
// id segments, offsets in warp order, then the one warp holding it walks its segment with ballots.
__device__ int tie_select(const float* __restrict__ x, int V, int seg, unsigned o, unsigned r, Smem& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b0 = min(warp * seg, V), b1 = min(b0 + seg, V);
    unsigned cnt = 0;
    for (int base = b0; base < b1; base += 32) {
        const int i = base + lane;
        cnt += __popc(__ballot_sync(kdtree::FULL_MASK, i < b1 && value_ord(x[min(i, V - 1)]) == o));
    }
    if (lane == 0) s.wcnt[warp] = cnt;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned acc = 0;
        for (int w = 0; w < WARPS; ++w) {
            s.wcoff[w] = acc;
            acc += s.wcnt[w];
        }
    }
    __syncthreads();
    const unsigned off = s.wcoff[warp];
    if (off < r && r <= off + s.wcnt[warp]) {
        unsigned need = r - off;
        for (int base = b0; base < b1; base += 32) {
            const int i = base + lane;
            unsigned bal = __ballot_sync(kdtree::FULL_MASK, i < b1 && value_ord(x[min(i, V - 1)]) == o);
            const unsigned pc = __popc(bal);
            if (need <= pc) {
                for (unsigned j = 1; j < need; ++j) bal &= bal - 1;
                if (lane == 0) s.tie_id = base + __ffs(bal) - 1;
                break;
            }
            need -= pc;
        }
    }
    __syncthreads();
    return s.tie_id;
}

// logits [R, ld] f32 (first V used); depth [R] u32 or nullptr; out [R] u32. One block of 1024 threads per
// row. Row r decides the token at position start + depth[r] + 1 (depth == nullptr: start + r) with
// u = uniform(seed, position). top_k: 0 or >= V disables; top_p >= 1 or NaN disables; temperature <= 0
// or NaN is greedy.
__device__ __forceinline__ void sample_row(const float* __restrict__ logits, int V, int ld, float temperature, float top_p,
                                           int top_k, u64 seed, u64 start, const unsigned* __restrict__ depth,
                                           unsigned* __restrict__ out) {
    __shared__ Smem s;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const float* x = logits + (size_t)blockIdx.x * ld;
    const bool sampled = temperature > 0.f;
    const bool want_k = sampled && top_k > 0 && top_k < V;

    // Step 1 (and greedy): max, argmax, #candidates; the first top-k digit histogram on the way.
    if (want_k) clear_hist(s, false);
    __syncthreads();
    kdtree::Best b{0.f, kdtree::INVALID};
    unsigned n = 0;
    for (int base = t - lane; base < V; base += THREADS) {
        const int i = base + lane;
        const float l = i < V ? x[i] : __int_as_float(0x7fffffff);
        const bool ok = l == l;
        if (ok) {
            b = kdtree::best_of(b, kdtree::Best{l, i});
            ++n;
        }
        if (want_k) hist_add(s, ok, digit_of(value_ord(l), 0), 0ull, false);
    }
    b = kdtree::block_best(b, s.bv, s.bi);
    if (!sampled) {
        if (t == 0) out[blockIdx.x] = b.i == kdtree::INVALID ? 0u : (unsigned)b.i;
        return;
    }
    const unsigned cand = block_count(n, s);
    if (cand == 0u) {  // step 1: no candidate -> token 0
        if (t == 0) out[blockIdx.x] = 0u;
        return;
    }
    const double tt = (double)temperature, m = (double)b.v / tt;  // b.v = max over candidates
    // Step 4 and tie_select: warp w owns ids [w * seg, (w + 1) * seg) (a multiple of 32 wide).
    const int seg = ((V + WARPS - 1) / WARPS + 31) / 32 * 32;

    // Step 2: ord_k = the k-th largest ord (with multiplicity); kept: ord >= lo2 (1: every candidate).
    unsigned lo2 = 1u;
    if (want_k && (unsigned)top_k < cand) {
        unsigned prefix = 0u, rem = (unsigned)top_k;
        for (int level = 0; level < LEVELS; ++level) {
            if (level > 0) {
                clear_hist(s, false);
                __syncthreads();
                for (int base = t - lane; base < V; base += THREADS) {
                    const int i = base + lane;
                    const unsigned o = i < V ? value_ord(x[i]) : 0u;
                    hist_add(s, o != 0u && in_prefix(o, prefix, level), digit_of(o, level), 0ull, false);
                }
            }
            __syncthreads();
            pick(s, digit_bins(level), false, rem);
            __syncthreads();
            prefix |= (unsigned)s.pick_digit << digit_shift(level);  // found: rem <= tokens in the prefix
            rem -= s.pick_cnt_above;
        }
        lo2 = prefix;
    }

    // Step 3: the cut of the nucleus in rank order, over the step-2 survivors.
    Keep keep{lo2 - 1u, -1};
    if (top_p < 1.f) {
        double zk = 0.0;
        for (int i = t; i < V; i += THREADS) {
            const float l = x[i];
            if (value_ord(l) >= lo2) zk += weight(l, tt, m);
        }
        zk = block_sum_f64(zk, s);  // >= 1: the maximum is kept and weighs 1
        const double p = (double)top_p;
        const u64 tq = p > 0.0 ? (u64)ceil(p * 0x1p63) : 0ull;  // P in 2^-63 units; P < 1
        unsigned prefix = 0u;
        u64 need = tq;  // mass still to reach below the fixed digits
        bool cut = true;
        for (int level = 0; level < LEVELS && cut; ++level) {
            clear_hist(s, true);
            __syncthreads();
            for (int base = t - lane; base < V; base += THREADS) {
                const int i = base + lane;
                const float l = i < V ? x[i] : 0.f;
                const unsigned o = i < V ? value_ord(l) : 0u;
                const bool act = o >= lo2 && in_prefix(o, prefix, level);
                // w / Z_k <= 1 (Z_k sums w and nonnegative others), so q <= 2^63 and the total < 2^64.
                const u64 q = act ? __double2ull_rn(weight(l, tt, m) / zk * 0x1p63) : 0ull;
                hist_add(s, act, digit_of(o, level), q, true);
            }
            __syncthreads();
            pick(s, digit_bins(level), true, need);
            __syncthreads();
            if (s.pick_digit < 0) {
                cut = false;  // only at level 0: the whole mass stays below P (rounding), keep every token
            } else {
                prefix |= (unsigned)s.pick_digit << digit_shift(level);
                need -= s.pick_mass_above;
            }
        }
        if (cut) {
            // prefix = ord of the cut value; its ct tokens weigh qc each (equal values), need <= ct * qc.
            const unsigned ct = s.pick_cnt;
            const u64 qc = s.pick_mass / ct;
            const unsigned r = need <= qc ? 1u : (unsigned)((need + qc - 1) / qc);
            if (r < ct) {
                keep = Keep{prefix, tie_select(x, V, seg, prefix, r, s)};
            } else {
                keep = Keep{prefix - 1u, -1};
            }
        }
    }

    // Step 4: the smallest survivor whose id-order prefix sum of weights is > u * Z.
    const u64 pos = depth != nullptr ? start + (u64)depth[blockIdx.x] + 1ull : start + (u64)blockIdx.x;
    const double u = kdtree::philox_uniform(seed, pos);
    const int b0 = min(warp * seg, V), b1 = min(b0 + seg, V);
    double z = 0.0;
    int last = -1;
    for (int i = b0 + lane; i < b1; i += 32) {
        const float l = x[i];
        if (keep(value_ord(l), i)) {
            z += weight(l, tt, m);
            last = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        z += __shfl_down_sync(kdtree::FULL_MASK, z, o);
        last = max(last, __shfl_xor_sync(kdtree::FULL_MASK, last, o));
    }
    __syncthreads();  // wsum may still be read by block_sum_f64
    if (lane == 0) {
        s.wsum[warp] = z;
        s.wlast[warp] = last;
    }
    if (t == 0) s.found = kdtree::INVALID;
    __syncthreads();
    if (t == 0) {
        double acc = 0.0;
        int l = -1;
        for (int w = 0; w < WARPS; ++w) {
            s.woff[w] = acc;
            acc += s.wsum[w];
            l = max(l, s.wlast[w]);
        }
        s.woff[WARPS] = acc;
        s.last = l;
    }
    __syncthreads();
    const double target = u * s.woff[WARPS];
    if (s.woff[warp + 1] > target) {  // this warp's segment can hold the crossing (or a later first survivor)
        double cum = s.woff[warp];
        for (int base = b0; base < b1; base += 32) {
            const int i = base + lane;
            const float l = i < b1 ? x[i] : 0.f;
            const bool k = i < b1 && keep(value_ord(l), i);
            double c = k ? weight(l, tt, m) : 0.0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const double y = __shfl_up_sync(kdtree::FULL_MASK, c, o);
                if (lane >= o) c += y;
            }
            const unsigned hit = __ballot_sync(kdtree::FULL_MASK, k && cum + c > target);
            if (hit != 0u) {
                if (lane == 0) atomicMin(&s.found, base + __ffs(hit) - 1);
                break;
            }
            cum += __shfl_sync(kdtree::FULL_MASK, c, 31);
        }
    }
    __syncthreads();
    if (t == 0) out[blockIdx.x] = (unsigned)(s.found != kdtree::INVALID ? s.found : s.last);
}

}  // namespace sample_rows

// Launch: grid (R), block (1024), no dynamic shared memory. Arguments as sample_rows::sample_row above.
extern "C" __global__ void __launch_bounds__(1024) kdtree_sample_rows_f32(const float* __restrict__ logits, int V, int ld,
                                                                          float temperature, float top_p, int top_k,
                                                                          unsigned long long seed, unsigned long long start,
                                                                          const int* __restrict__ start_dev,
                                                                          const unsigned* __restrict__ depth,
                                                                          unsigned* __restrict__ out) {
    // start_dev [1] or null: a captured round adds the committed length it reads from the device.
    if (start_dev) start += (unsigned long long)start_dev[0];
    sample_rows::sample_row(logits, V, ld, temperature, top_p, top_k, seed, start, depth, out);
}
