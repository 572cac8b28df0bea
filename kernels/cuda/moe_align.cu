// MoE align: group the P = T * top_k (token, slot) pairs by expert on the device, for the grouped expert
// GEMMs (w4a16_gemm.cu). Outputs, all device-side (no host sync):
//   sorted [P] i32: pair indices, ascending expert, and within an expert ascending pair index (stable);
//   tiles [3, max_tiles] i32: per row tile (expert, start in sorted, count <= tile_rows), ascending expert;
//   n_tiles [1] i32. Tiles past n_tiles are left untouched (the GEMM's blocks for them exit at once).
// max_tiles = min(E, P) + ceil(P / tile_rows) bounds the tile count (wrapper computes it on the host).
// CPU twin: the per-expert token lists of engine model::ffn::moe (ascending expert id, tokens in order);
// the test's local reference builds the same lists. Test: engine/tests/cuda_ops.rs (moe_align cases).
// Wrapper: engine/src/cuda/ops/moe_align.rs. Limits: E <= 1024; one block of 1024 threads, dynamic shared memory
// 8 E ints (the chunked placement's cursors).
#include "common.cuh"

constexpr int ALIGN_MAX_E = 1024;
constexpr int ALIGN_PW = 8;          // warps placing the pairs above ALIGN_ONE_WARP (dynamic smem ALIGN_PW * E ints)
constexpr int ALIGN_ONE_WARP = 512;  // pairs warp 0 places alone (a decode step: 8 per token)

// ids [P] i32 (experts, row-major [T, top_k]); this rank holds experts first .. first + E (expert parallel;
// first = 0 otherwise) and the lists use local ids id - first. An id outside them is dropped from every list.
extern "C" __global__ void __launch_bounds__(1024) kdtree_moe_align_i32(const int* __restrict__ ids, int first, int P, int E,
                                                                         int tile_rows, int max_tiles,
                                                                         int* __restrict__ sorted,
                                                                         int* __restrict__ tiles,
                                                                         int* __restrict__ n_tiles) {
    __shared__ int count[ALIGN_MAX_E];
    __shared__ int offset[ALIGN_MAX_E];   // exclusive scan of count
    __shared__ int toff[ALIGN_MAX_E];     // exclusive scan of tiles per expert
    __shared__ int cursor[ALIGN_MAX_E];
    __shared__ int wsum[32], wtsum[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < ALIGN_MAX_E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) {
        const int e = ids[p] - first;
        if (e >= 0 && e < E) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    // Exclusive scans over E (<= 1024 = blockDim.x) of count and of ceil(count / tile_rows).
    const int c = tid < E ? count[tid] : 0;
    const int nt = (c + tile_rows - 1) / tile_rows;
    int ic = c, it = nt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(kdtree::FULL_MASK, ic, o), b = __shfl_up_sync(kdtree::FULL_MASK, it, o);
        if (lane >= o) {
            ic += a;
            it += b;
        }
    }
    if (lane == 31) {
        wsum[warp] = ic;
        wtsum[warp] = it;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        int a = lane < nw ? wsum[lane] : 0, b = lane < nw ? wtsum[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int x = __shfl_up_sync(kdtree::FULL_MASK, a, o), y = __shfl_up_sync(kdtree::FULL_MASK, b, o);
            if (lane >= o) {
                a += x;
                b += y;
            }
        }
        wsum[lane] = a;  // inclusive over warps
        wtsum[lane] = b;
    }
    __syncthreads();
    const int base_c = warp > 0 ? wsum[warp - 1] : 0, base_t = warp > 0 ? wtsum[warp - 1] : 0;
    if (tid < E) {
        offset[tid] = base_c + ic - c;
        toff[tid] = base_t + it - nt;
        cursor[tid] = offset[tid];
    }
    if (tid == blockDim.x - 1) *n_tiles = base_t + it;
    __syncthreads();
    if (tid < E) {
        for (int j = 0; j < nt; j++) {
            const int z = toff[tid] + j;
            if (z < max_tiles) {
                tiles[z] = tid;
                tiles[max_tiles + z] = offset[tid] + j * tile_rows;
                tiles[2 * max_tiles + z] = min(tile_rows, c - j * tile_rows);
            }
        }
    }
    // Stable placement: pair p goes to offset[e] + (pairs of expert e before p). Up to ALIGN_ONE_WARP pairs, warp 0
    // places them 32 at a time in pair order. Above, ALIGN_PW warps each take a contiguous chunk of the pairs (in
    // order): each counts its chunk's pairs per expert into its row of wcur, the rows become each chunk's
    // starting cursors (offset plus the earlier chunks' counts), and each warp places its chunk as warp 0 would,
    // so `sorted` is the same; warp 0 alone took ~0.9 ms for the 131,072 pairs of a 16K-token prefill chunk (ncu,
    // K2.6 TP8 rank-0 slice, run 85).
    if (P > ALIGN_ONE_WARP) {
        extern __shared__ int wcur[];  // [ALIGN_PW][E]: counts, then cursors
        for (int i = tid; i < ALIGN_PW * E; i += blockDim.x) wcur[i] = 0;
        __syncthreads();
        const int chunk = (P + ALIGN_PW - 1) / ALIGN_PW;
        const int lo = warp * chunk, hi = min(P, lo + chunk);
        if (warp < ALIGN_PW) {
            for (int p0 = lo; p0 < hi; p0 += 32) {
                const int p = p0 + lane;
                const int e = p < hi ? ids[p] - first : -1;
                const bool ok = e >= 0 && e < E;
                const unsigned peers = __match_any_sync(kdtree::FULL_MASK, ok ? e : -1);
                if (ok && lane == __ffs(peers) - 1) wcur[warp * E + e] += __popc(peers);
                __syncwarp();
            }
        }
        __syncthreads();
        for (int e = tid; e < E; e += blockDim.x) {
            int c0 = offset[e];
            for (int w = 0; w < ALIGN_PW; w++) {
                const int n = wcur[w * E + e];
                wcur[w * E + e] = c0;
                c0 += n;
            }
        }
        __syncthreads();
        if (warp < ALIGN_PW) {
            for (int p0 = lo; p0 < hi; p0 += 32) {
                const int p = p0 + lane;
                const int e = p < hi ? ids[p] - first : -1;
                const bool ok = e >= 0 && e < E;
                const unsigned peers = __match_any_sync(kdtree::FULL_MASK, ok ? e : -1);
                const int rank = __popc(peers & ((1u << lane) - 1));
                int pos = 0;
                if (ok) pos = wcur[warp * E + e] + rank;
                __syncwarp();
                if (ok) {
                    sorted[pos] = p;
                    if (lane == __ffs(peers) - 1) wcur[warp * E + e] += __popc(peers);
                }
                __syncwarp();
            }
        }
        return;
    }
    if (warp == 0) {
        for (int p0 = 0; p0 < P; p0 += 32) {
            const int p = p0 + lane;
            const int e = p < P ? ids[p] - first : -1;
            const bool ok = e >= 0 && e < E;
            const unsigned peers = __match_any_sync(kdtree::FULL_MASK, ok ? e : -1);
            const int rank = __popc(peers & ((1u << lane) - 1));
            const int leader = __ffs(peers) - 1;
            int pos = 0;
            if (ok) pos = cursor[e] + rank;
            __syncwarp();
            if (ok) {
                sorted[pos] = p;
                if (lane == leader) cursor[e] += __popc(peers);
            }
            __syncwarp();
        }
    }
}
