// The one-GPU communicator's all-reduce (engine/src/cuda/comm.rs `SharedGpu`): R ranks of a tensor-parallel run
// side by side on one GPU, each on its own stream (and in its own CUDA graph), sum a buffer in rank order
// with no host involvement. CPU twin: cpu::ops::all_reduce_sum's order (acc = p0; acc += p1; ... as the
// CUDA backend's own rank-order adds). Test: engine/tests/cuda_tp.rs (R streams on one GPU == the adds).
//
// Protocol (per block b of a fixed grid of GROUP_BLOCKS, so block b always owns the same staging slot):
// 1. epoch e = ++epochs[rank][b] (block-private counter; every rank runs the same collectives in the same
//    order, so the ranks' epochs agree); the parity p = e & 1 picks one of two staging buffers;
// 2. copy this block's slice of x into staging[p][rank][b]; fence; publish flags[rank][b] = e;
// 3. wait until every rank's flags[j][b] has reached e (a spin with a timeout that traps: a rank that never
//    arrives is an error, not a hang);
// 4. x[slice] = staging[p][0][b] + staging[p][1][b] + ... (rank order), read through L2 (ld.cg).
// Reuse is safe with two buffers: a rank writing parity p at epoch e has seen every rank arrive at e - 1,
// and each of them finished reading epoch e - 2 (parity p) before arriving at e - 1.
#include <cstdio>  // device printf (the wait diagnostic)

#include "common.cuh"

#define GROUP_BLOCKS 4

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// x [n] f32 (this rank's partial, in place: the sum); staging [2][world][GROUP_BLOCKS][cap]; flags and epochs
// [world][GROUP_BLOCKS] u32 (zero at creation). n <= GROUP_BLOCKS * cap (the wrapper splits larger buffers).
extern "C" __global__ void kdtree_group_all_reduce_f32(float* __restrict__ x, int n, float* staging, unsigned* flags,
                                                      unsigned* epochs, int rank, int world, int cap,
                                                      unsigned long long timeout_ns) {
    const int b = blockIdx.x;
    const int per = (n + GROUP_BLOCKS - 1) / GROUP_BLOCKS;
    const int lo = min(n, b * per), hi = min(n, lo + per);
    __shared__ unsigned ep;
    if (threadIdx.x == 0) {
        ep = epochs[rank * GROUP_BLOCKS + b] + 1;
        epochs[rank * GROUP_BLOCKS + b] = ep;
    }
    __syncthreads();
    const unsigned e = ep;
    const size_t slot = (size_t)GROUP_BLOCKS * cap;
    float* base = staging + (size_t)(e & 1u) * world * slot;
    float* mine = base + (size_t)rank * slot + (size_t)b * cap;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i - lo] = x[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicExch(&flags[rank * GROUP_BLOCKS + b], e);
        const unsigned long long t0 = global_ns();
        for (int j = 0; j < world; ++j) {
            volatile unsigned* f = flags + j * GROUP_BLOCKS + b;
            while ((int)(*f - e) < 0) {
                if (global_ns() - t0 > timeout_ns) {
                    printf("kdtree group all-reduce: rank %d waited %llu ms for rank %d (epoch %u, block %d)\n", rank,
                           timeout_ns / 1000000ull, j, e, b);
                    __trap();
                }
            }
        }
        __threadfence();
    }
    __syncthreads();
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float s = __ldcg(base + (size_t)b * cap + (i - lo));
        for (int j = 1; j < world; ++j) s += __ldcg(base + (size_t)j * slot + (size_t)b * cap + (i - lo));
        x[i] = s;
    }
}
