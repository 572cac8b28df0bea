// XXH3-64 (seed 0, the default 192-byte secret) of device bytes: the manifest's per-tensor checksum
// (formats/src/manifest.rs, `xxh3`), computed where the weights were uploaded, so that a load can prove that
// the bytes on the GPU are the bytes the converter wrote (issue 24: a staging race once corrupted them).
// CPU twin: xxhash_rust::xxh3::xxh3_64 (what the converter's writer computes). Test: engine/tests/cuda_ops.rs
// (`xxh3_of_device_bytes_equals_the_cpu`, every short-input path, unaligned views, and buffers past 2^32 bytes).
// Wrapper: engine/src/cuda/ops/xxh3.rs.
//
// The long form (more than 240 bytes) keeps 8 u64 accumulators. Each 1024-byte block adds to lane i the sum of
// its 16 stripes' contributions (additive mod 2^64: data_val of lane i ^ 1 plus lo32 * hi32 of lane i's keyed
// word), then scrambles every lane (acc ^= acc >> 47; acc ^= key; acc *= PRIME32_1), which is not additive. So:
//   * kdtree_xxh3_deltas: for a segment of blocks, every block's 8 additive deltas in parallel (8 threads a
//     block, one per lane; lane i's data_val goes to lane i ^ 1 through a shuffle);
//   * kdtree_xxh3_chain: 8 threads (one per accumulator lane, the lanes are independent) walk the segment's
//     blocks in order: acc = scramble(acc + delta);
//   * kdtree_xxh3_finish: one thread: the inputs of at most 240 bytes (their own short paths), or the last
//     partial block, the last stripe, the merge and the avalanche.
// Offsets are 64-bit throughout (expert stacks are several GB). Data is read with byte loads where the view
// is not 8-byte aligned.
#include "common.cuh"

namespace xxh3 {

__constant__ unsigned char SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9,
    0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78,
    0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f,
    0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff,
    0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

constexpr unsigned long long P32_1 = 0x9E3779B1ull, P32_2 = 0x85EBCA77ull, P32_3 = 0xC2B2AE3Dull;
constexpr unsigned long long P64_1 = 0x9E3779B185EBCA87ull, P64_2 = 0xC2B2AE3D27D4EB4Full, P64_3 = 0x165667B19E3779F9ull,
                             P64_4 = 0x85EBCA77C2B2AE63ull, P64_5 = 0x27D4EB2F165667C5ull;
constexpr int STRIPE = 64, BLOCK = 1024, STRIPES_PER_BLOCK = 16, SECRET_SIZE = 192;

// Little-endian u64 / u32 of bytes at p (any alignment).
__device__ __forceinline__ unsigned long long rd64(const unsigned char* p) {
    unsigned long long v = 0;
#pragma unroll
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
__device__ __forceinline__ unsigned rd32(const unsigned char* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24);
}
__device__ __forceinline__ unsigned long long sec64(int off) { return rd64(SECRET + off); }
__device__ __forceinline__ unsigned long long data64(const unsigned char* p, bool aligned) {
    return aligned ? __ldg(reinterpret_cast<const unsigned long long*>(p)) : rd64(p);
}

__device__ __forceinline__ unsigned long long mul_fold(unsigned long long a, unsigned long long b) {
    return a * b ^ __umul64hi(a, b);
}
__device__ __forceinline__ unsigned long long avalanche3(unsigned long long h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}
__device__ __forceinline__ unsigned long long avalanche64(unsigned long long h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}
// Byte swap of a u64 (the 9-16 byte path).
__device__ __forceinline__ unsigned long long bswap64(unsigned long long v) {
    const unsigned lo = (unsigned)v, hi = (unsigned)(v >> 32);
    return ((unsigned long long)__byte_perm(lo, 0, 0x0123) << 32) | __byte_perm(hi, 0, 0x0123);
}
__device__ __forceinline__ unsigned long long rotl(unsigned long long v, int r) { return (v << r) | (v >> (64 - r)); }
__device__ __forceinline__ unsigned long long mix16(const unsigned char* in, int soff) {
    return mul_fold(rd64(in) ^ sec64(soff), rd64(in + 8) ^ sec64(soff + 8));
}

// One stripe into the 8 accumulators (one thread; the finish kernel's tail).
__device__ __forceinline__ void accumulate_stripe(unsigned long long (&acc)[8], const unsigned char* in, int soff) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const unsigned long long v = rd64(in + 8 * i), k = v ^ sec64(soff + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFull) * (k >> 32);
    }
}

__device__ unsigned long long short_hash(const unsigned char* p, unsigned long long len) {
    if (len == 0) return avalanche64(sec64(56) ^ sec64(64));
    if (len <= 3) {
        const unsigned c1 = p[0], c2 = p[len >> 1], c3 = p[len - 1];
        const unsigned combo = (c1 << 16) | (c2 << 24) | c3 | ((unsigned)len << 8);
        const unsigned long long flip = (unsigned long long)(rd32(SECRET) ^ rd32(SECRET + 4));
        return avalanche64((unsigned long long)combo ^ flip);
    }
    if (len <= 8) {
        const unsigned long long in1 = rd32(p), in2 = rd32(p + len - 4);
        const unsigned long long flip = sec64(8) ^ sec64(16);
        unsigned long long h = (in2 + (in1 << 32)) ^ flip;
        h ^= rotl(h, 49) ^ rotl(h, 24);
        h *= 0x9FB21C651E98DF25ull;
        h ^= (h >> 35) + len;
        h *= 0x9FB21C651E98DF25ull;
        return h ^ (h >> 28);
    }
    if (len <= 16) {
        const unsigned long long lo = rd64(p) ^ (sec64(24) ^ sec64(32)), hi = rd64(p + len - 8) ^ (sec64(40) ^ sec64(48));
        return avalanche3(len + bswap64(lo) + hi + mul_fold(lo, hi));
    }
    unsigned long long acc = len * P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(p + 48, 96);
                    acc += mix16(p + len - 64, 112);
                }
                acc += mix16(p + 32, 64);
                acc += mix16(p + len - 48, 80);
            }
            acc += mix16(p + 16, 32);
            acc += mix16(p + len - 32, 48);
        }
        acc += mix16(p, 0);
        acc += mix16(p + len - 16, 16);
        return avalanche3(acc);
    }
    const int rounds = (int)(len / 16);
    for (int i = 0; i < 8; i++) acc += mix16(p + 16 * i, 16 * i);
    acc = avalanche3(acc);
    for (int i = 8; i < rounds; i++) acc += mix16(p + 16 * i, 16 * (i - 8) + 3);
    acc += mix16(p + len - 16, 136 - 17);
    return avalanche3(acc);
}

}  // namespace xxh3

// deltas[b - block0][i], b in [block0, block0 + nblocks): lane i's additive part of block b of data.
// Grid ceil(8 nblocks / 256), block 256.
extern "C" __global__ void __launch_bounds__(256) kdtree_xxh3_deltas(const unsigned char* __restrict__ data,
                                                                    unsigned long long block0, unsigned long long nblocks,
                                                                    unsigned long long* __restrict__ deltas) {
    using namespace xxh3;
    const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long b = t >> 3;
    const int i = (int)(t & 7);
    const bool aligned = (reinterpret_cast<uintptr_t>(data) & 7) == 0;
    unsigned long long own = 0, give = 0;
    if (b < nblocks) {
        const unsigned char* p = data + (block0 + b) * BLOCK + 8 * i;
#pragma unroll
        for (int s = 0; s < STRIPES_PER_BLOCK; s++) {
            const unsigned long long v = data64(p + (size_t)s * STRIPE, aligned), k = v ^ sec64(8 * s + 8 * i);
            give += v;
            own += (k & 0xFFFFFFFFull) * (k >> 32);
        }
    }
    // Lane i receives the data words of lane i ^ 1 (the neighbour thread: t ^ 1 is in the same warp).
    const unsigned long long got = __shfl_xor_sync(kdtree::FULL_MASK, give, 1);
    if (b < nblocks) deltas[b * 8 + i] = own + got;
}

// acc[i] = scramble(acc[i] + deltas[b][i]) for b = 0 .. nblocks - 1, in order. One block of 32 threads (8 used).
extern "C" __global__ void kdtree_xxh3_chain(unsigned long long* __restrict__ acc, const unsigned long long* __restrict__ deltas,
                                             unsigned long long nblocks) {
    using namespace xxh3;
    const int i = threadIdx.x;
    if (i >= 8) return;
    const unsigned long long key = sec64(SECRET_SIZE - STRIPE + 8 * i);
    unsigned long long a = acc[i];
    unsigned long long b = 0;
    for (; b + 8 <= nblocks; b += 8) {
        unsigned long long d[8];
#pragma unroll
        for (int j = 0; j < 8; j++) d[j] = __ldg(deltas + (b + j) * 8 + i);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            a += d[j];
            a ^= a >> 47;
            a ^= key;
            a *= P32_1;
        }
    }
    for (; b < nblocks; b++) {
        a += deltas[b * 8 + i];
        a ^= a >> 47;
        a ^= key;
        a *= P32_1;
    }
    acc[i] = a;
}

// out[0] = XXH3-64 of data[0, len): the short paths (len <= 240, acc unused), else the tail of the long form
// after kdtree_xxh3_chain went through the (len - 1) / 1024 full blocks from the initial accumulators.
extern "C" __global__ void kdtree_xxh3_finish(const unsigned char* __restrict__ data, unsigned long long len,
                                              const unsigned long long* __restrict__ acc_in,
                                              unsigned long long* __restrict__ out) {
    using namespace xxh3;
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (len <= 240) {
        out[0] = short_hash(data, len);
        return;
    }
    unsigned long long acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = acc_in[i];
    const unsigned long long full = (len - 1) / BLOCK;
    const unsigned char* last = data + full * BLOCK;
    const int stripes = (int)(((len - 1) - full * BLOCK) / STRIPE);
    for (int s = 0; s < stripes; s++) accumulate_stripe(acc, last + (size_t)s * STRIPE, 8 * s);
    accumulate_stripe(acc, data + len - STRIPE, SECRET_SIZE - STRIPE - 7);
    unsigned long long h = len * P64_1;
#pragma unroll
    for (int j = 0; j < 4; j++) h += mul_fold(acc[2 * j] ^ sec64(11 + 16 * j), acc[2 * j + 1] ^ sec64(11 + 16 * j + 8));
    out[0] = avalanche3(h);
}

// The accumulators' starting values (written by the wrapper's first launch): acc[0..8).
extern "C" __global__ void kdtree_xxh3_init(unsigned long long* __restrict__ acc) {
    using namespace xxh3;
    const unsigned long long init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    if (threadIdx.x < 8) acc[threadIdx.x] = init[threadIdx.x];
}
