// Seeded fills of dummy weights (`--load-format dummy`): element i is a pure function of (seed, i), so
// every thread writes its own elements and the result equals the CPU twin bit for bit. CPU twin and spec:
// engine cpu::ops::fill (engine/src/cpu/ops/fill.rs: word j = word j%4 of Philox4x32-10 at counter j/4,
// key = seed; uniform x = center + m * step with m = (word >> 8) - 2^23, each op rounded once; bytes = the
// words' bytes, little end first). Wrapper: engine/src/cuda/ops/fill.rs. Test: engine/tests/cuda_target.rs.
// Grid-stride loops over 64-bit indices (a K2.6 expert stack holds more than 2^31 bytes). No shared memory.
#include "common.cuh"
#include "philox.cuh"

namespace {

// Philox block c of `seed`: words 4c..4c+3 of the stream.
__device__ __forceinline__ uint4 fill_block(uint64_t seed, uint64_t c) {
    return kdtree::philox4x32_10(make_uint4((unsigned)c, (unsigned)(c >> 32), 0u, 0u), make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
}

__device__ __forceinline__ unsigned word_of(uint4 x, unsigned k) {
    return k == 0 ? x.x : k == 1 ? x.y : k == 2 ? x.z : x.w;
}

// center + m * step without contraction into an FMA (the CPU twin rounds the product, then the sum).
__device__ __forceinline__ float uniform_of(unsigned word, float center, float step) {
    const int m = (int)(word >> 8) - (1 << 23);
    return __fadd_rn(center, __fmul_rn((float)m, step));
}

}  // namespace

// out [n] bf16: element i = uniform of word i.
extern "C" __global__ void kdtree_fill_uniform_bf16(bf16* __restrict__ out, uint64_t n, uint64_t seed, float center, float step) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t c = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; c * 4 < n; c += stride) {
        const uint4 x = fill_block(seed, c);
#pragma unroll
        for (unsigned k = 0; k < 4; ++k) {
            const uint64_t i = c * 4 + k;
            if (i < n) out[i] = __float2bfloat16_rn(uniform_of(word_of(x, k), center, step));
        }
    }
}

// out [n] f32: element i = uniform of word i.
extern "C" __global__ void kdtree_fill_uniform_f32(float* __restrict__ out, uint64_t n, uint64_t seed, float center, float step) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t c = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; c * 4 < n; c += stride) {
        const uint4 x = fill_block(seed, c);
#pragma unroll
        for (unsigned k = 0; k < 4; ++k) {
            const uint64_t i = c * 4 + k;
            if (i < n) out[i] = uniform_of(word_of(x, k), center, step);
        }
    }
}

// out [n] u8: byte i = byte i%4 of word i/4 (16 bytes per Philox block).
extern "C" __global__ void kdtree_fill_bytes_u8(uint8_t* __restrict__ out, uint64_t n, uint64_t seed) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t c = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; c * 16 < n; c += stride) {
        const uint4 x = fill_block(seed, c);
        if (c * 16 + 16 <= n && (((uintptr_t)(out + c * 16)) & 15) == 0) {
            *reinterpret_cast<uint4*>(out + c * 16) = x;  // little-endian: byte b of word k is byte 4k+b
            continue;
        }
        for (unsigned b = 0; b < 16; ++b) {
            const uint64_t i = c * 16 + b;
            if (i < n) out[i] = (uint8_t)(word_of(x, b / 4) >> (8 * (b % 4)));
        }
    }
}

// out [n] bytes = 0 (what a zeroed buffer of a captured round gets instead of a memset node: a graph with
// memset nodes takes a launch-queue entry per node, one of kernels only takes one, bench/launch-queue.py).
// 16-byte stores where aligned, bytes at the ends.
extern "C" __global__ void kdtree_zero_bytes(uint8_t* __restrict__ out, uint64_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    const uint64_t lead = (16 - ((uintptr_t)out & 15)) & 15;
    const uint64_t head = lead < n ? lead : n;
    const uint64_t body = (n - head) / 16;
    const uint64_t i0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4* q = reinterpret_cast<uint4*>(out + head);
    for (uint64_t i = i0; i < body; i += stride) q[i] = make_uint4(0u, 0u, 0u, 0u);
    for (uint64_t i = i0; i < head; i += stride) out[i] = 0;
    for (uint64_t i = head + body * 16 + i0; i < n; i += stride) out[i] = 0;
}
