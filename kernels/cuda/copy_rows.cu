// Strided row copy: dst[r * ld_dst + c] = src[r * ld_src + c] for r < rows, c < width (bf16). Used to place
// q_pe next to q_lat in the MLA query rows and to write the drafter taps (a layer's residual rows into
// their slot of the [T, n_taps * H] tap rows). CPU twin: a slice copy (`copy_from_slice`).
// Test: engine/tests/cuda_target.rs (through the forward). Wrapper: engine/src/cuda/ops/copy_rows.rs.
#include "common.cuh"

// grid (ceil(width / 256), min(rows, 65535)), 256 threads; the rows grid-stride over blockIdx.y (a K2.6 tree
// verify of 1025 nodes x 64 heads copies 65,600 rows).
extern "C" __global__ void kdtree_copy_rows_bf16(const bf16* __restrict__ src, int ld_src, bf16* __restrict__ dst, int ld_dst,
                                                 int rows, int width) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) dst[(size_t)r * ld_dst + c] = src[(size_t)r * ld_src + c];
}
