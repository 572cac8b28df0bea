// Ancestor-or-self bitmask of tree nodes from their parents (the target's tree-attention mask, ddtree.md §6):
// row i has `words` u64, bit j % 64 of word j / 64 set iff node j is i or an ancestor of i. CPU twin:
// engine ddtree::Visibility::from_parents. Test: engine/tests/cuda_ddtree.rs. Wrapper:
// engine/src/cuda/ops/visibility.rs.
//
// Rows i < n (n read on the device, so a captured graph replays it for any tree size up to `rows`) walk
// their parent chain (a draft tree is at most the block size deep); rows n..rows are zero. Parents must be
// -1 or earlier nodes (the builder's are; the wrapper's host path checks others).
#include "common.cuh"

// parents [rows] i32; n [1] i32 (nodes in use, <= rows) or nullptr for all rows; bits [rows, words] u64.
// grid (ceil(rows / 128)), block 128.
extern "C" __global__ void kdtree_visibility_from_parents(const int* __restrict__ parents, const int* __restrict__ n, int rows, int words,
                                                          unsigned long long* __restrict__ bits) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    unsigned long long* row = bits + (size_t)i * words;
    for (int w = 0; w < words; w++) row[w] = 0ull;
    const int used = n ? n[0] : rows;
    if (i >= used) return;
    for (int j = i; j >= 0; j = parents[j]) row[j >> 6] |= 1ull << (j & 63);
}
