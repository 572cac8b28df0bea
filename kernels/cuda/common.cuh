// Shared helpers for the kdtree kernels: bf16 types, warp and block reductions, 16-byte vector types.
// Every .cu in this folder includes this header and compiles on its own (kernels/check.sh checks each file
// for sm_90a and sm_120a with warnings as errors); build.rs compiles them together into one fatbin.
// Build line: nvcc -fatbin -Werror all-warnings -gencode arch=compute_90a,code=sm_90a
//             -gencode arch=compute_120a,code=sm_120a -gencode arch=compute_90,code=compute_90
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

namespace kdtree {

constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats. blockDim.x % 32 == 0.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(r);
}

// (value, index) candidate for argmax / top-k. Order: a valid (non-NaN, not excluded) entry beats an
// invalid one; larger value wins; on equal values the lower index wins (the engine's tie rule).
struct Best {
    float v;
    int i;      // index, or INT_MAX when invalid
};

__device__ __forceinline__ bool better(Best a, Best b) {
    const bool av = a.i != 0x7fffffff, bv = b.i != 0x7fffffff;
    if (av != bv) return av;
    if (a.v != b.v) return a.v > b.v;
    return a.i < b.i;
}

__device__ __forceinline__ Best best_of(Best a, Best b) { return better(b, a) ? b : a; }

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best c{__shfl_xor_sync(FULL_MASK, b.v, o), __shfl_xor_sync(FULL_MASK, b.i, o)};
        b = best_of(b, c);
    }
    return b;
}

// Block-wide best; every thread gets the result. `sv`/`si` hold >= 32 entries. blockDim.x % 32 == 0.
__device__ __forceinline__ Best block_best(Best b, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    b = warp_best(b);
    __syncthreads();
    if (lane == 0) {
        sv[warp] = b.v;
        si[warp] = b.i;
    }
    __syncthreads();
    Best r = lane < nwarps ? Best{sv[lane], si[lane]} : Best{0.f, 0x7fffffff};
    return warp_best(r);
}

constexpr int INVALID = 0x7fffffff;

// Programmatic dependent launch (sm_90+; the wrappers launch the GEMMs with programmatic stream
// serialization): a GEMM may start while the kernel before it drains. Everything before pdl_wait() only
// reads the weights (which no kernel writes); x, the workspace, the counters and the output are touched after
// it. pdl_trigger() lets the next PDL-launched kernel start early (it waits for this whole grid in its own
// pdl_wait()). Both are no-ops when the kernel was launched without the attribute.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, asynchronous; `full` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(full ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Four 8x8 bf16 matrices; lane i gives the address of row i % 8 of matrix i / 8. Plain: lane (g, t) gets
// M[g][2t], M[g][2t+1] of each; trans: M[2t][g], M[2t+1][g].
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}
// Waits until at most N committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// One tensor-core step D = A·B + D: m16n8k16, bf16 inputs, f32 accumulate. Fragments (g = lane / 4,
// t = lane % 4; each u32 two bf16, the lower index in the low half): a0 = A[g][2t..], a1 = A[g+8][2t..],
// a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..][g], b1 = B[2t+8..][g]; c = D[g][2t..], D[g+8][2t..].
// An output element depends only on its own row of A and column of B.
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of the online softmax (flash attention) over a chunk of R key rows, one score per lane of R
// consecutive lanes (a group of a warp): m, l are the running max and sum of e^{s - m} of the query row the
// group serves. Returns through `a` the factor the running output must be scaled by (e^{m_old - m_new}) and
// through `p` this lane's row weight e^{s - m_new}. A score of -inf (a masked or missing row) weighs 0; a group
// that has seen no row keeps m = -inf and a = 1. One definition for every attention kernel (the MLA latent
// attention and the drafter's GQA), with the fast exponential.
template <int R>
__device__ __forceinline__ void online_softmax_step(float sc, float& m, float& l, float& a, float& p) {
    float cm = sc;
#pragma unroll
    for (int off = R / 2; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(FULL_MASK, cm, off, R));
    const float m_new = fmaxf(m, cm);
    a = m_new == -INFINITY ? 1.f : __expf(m - m_new);
    p = sc == -INFINITY ? 0.f : __expf(sc - m_new);
    float ls = p;
#pragma unroll
    for (int off = R / 2; off > 0; off >>= 1) ls += __shfl_xor_sync(FULL_MASK, ls, off, R);
    l = l * a + ls;
    m = m_new;
}

// The log-sum-exp merge weight of a split whose running max is mi, against the largest max M over the splits:
// e^{mi - M}, and 0 for a split that saw no row (mi = -inf).
__device__ __forceinline__ float lse_weight(float mi, float M) { return mi != -INFINITY ? __expf(mi - M) : 0.f; }

}  // namespace kdtree
