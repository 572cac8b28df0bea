// Row gather of an f32 table: dst[t, :] = src[idx[t], :] (a tree forward's RoPE rows from its node depths,
// which live on the device). CPU twin: `backend::Backend::rope_gather` of the CPU backend (row copies).
// Test: engine/tests/cuda_round.rs (the device round == the host round). Wrapper:
// engine/src/cuda/ops/gather_rows.rs.
#include "common.cuh"

// src [rows_src, ld_src] f32; idx [rows] u32 (< rows_src, checked in the kernel: an index outside gives a
// NaN row); dst [rows, ld_dst]. grid (ceil(width / 128), rows), block 128.
extern "C" __global__ void kdtree_gather_rows_f32(const float* __restrict__ src, int ld_src, int rows_src, const unsigned* __restrict__ idx,
                                                  float* __restrict__ dst, int ld_dst, int width) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (c >= width) return;
    const unsigned i = idx[r];
    dst[(size_t)r * ld_dst + c] = i < (unsigned)rows_src ? src[(size_t)i * ld_src + c] : __int_as_float(0x7fc00000);
}
