// Embedding gather: out[t, :] = table[ids[t], :] (bf16 rows copied bit for bit).
// CPU twin: row indexing of embed_tokens (the test's local reference). An id outside [0, V) writes a
// NaN row (no host sync to report it; NaN fails every downstream check). Test: engine/tests/cuda_ops.rs.
// Wrapper: engine/src/cuda/ops/embed.rs. Vocab-parallel form (kdtree_embed_gather_shard_bf16): one launch per
// shard of ids [base, base + V) writes only its own ids' rows; the last shard also writes the NaN rows of
// ids outside [0, V_total).
#include "common.cuh"

// ids [T] i32, table [V, H] bf16, out [T, H] bf16. One block per token.
extern "C" __global__ void kdtree_embed_gather_bf16(const int* __restrict__ ids, const bf16* __restrict__ table,
                                                    bf16* __restrict__ out, int H, int V) {
    const int id = ids[blockIdx.x];
    bf16* o = out + (size_t)blockIdx.x * H;
    if (id < 0 || id >= V) {
        for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __ushort_as_bfloat16((unsigned short)0x7fc0);
        return;
    }
    const bf16* src = table + (size_t)id * H;
    if (H % 8 == 0 && kdtree::aligned16(src) && kdtree::aligned16(o)) {
        for (int i = threadIdx.x; i < H / 8; i += blockDim.x)
            reinterpret_cast<uint4*>(o)[i] = reinterpret_cast<const uint4*>(src)[i];
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = src[i];
    }
}

// ids [T] i32, table [V, H] bf16 (ids base .. base + V), out [T, H] bf16: rows of this shard's ids; with
// nan_owner, NaN rows for ids outside [0, v_total). One block per token.
extern "C" __global__ void kdtree_embed_gather_shard_bf16(const int* __restrict__ ids, const bf16* __restrict__ table,
                                                          bf16* __restrict__ out, int H, int V, int base, int v_total,
                                                          int nan_owner) {
    const int gid = ids[blockIdx.x], id = gid - base;
    bf16* o = out + (size_t)blockIdx.x * H;
    if (gid < 0 || gid >= v_total) {
        if (nan_owner)
            for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __ushort_as_bfloat16((unsigned short)0x7fc0);
        return;
    }
    if (id < 0 || id >= V) return;
    const bf16* src = table + (size_t)id * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = src[i];
}
