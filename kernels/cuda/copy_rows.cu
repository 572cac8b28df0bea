// Strided row copy: dst[r * ld_dst + c] = src[r * ld_src + c] for r < rows, c < width (bf16). Used to place
// q_pe next to q_lat in the MLA query rows and to write the drafter taps (a layer's residual rows into
// their slot of the [T, n_taps * H] tap rows). CPU twin: a slice copy (`copy_from_slice`).
// Test: engine/tests/cuda_target.rs (through the forward). Wrapper: engine/src/cuda/ops/copy_rows.rs.
#include "common.cuh"

// grid (ceil(width / 256), rows), 256 threads.
extern "C" __global__ void kdtree_copy_rows_bf16(const bf16* __restrict__ src, int ld_src, bf16* __restrict__ dst, int ld_dst,
                                                 int rows, int width) {
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && c < width) dst[(size_t)r * ld_dst + c] = src[(size_t)r * ld_src + c];
}
