// Philox4x32-10 (Random123, Salmon et al. SC'11) and the engine's uniform of a position, on the device.
// CPU twins: engine sampling::philox4x32_10 and sampling::uniform (the header of engine/src/sampling.rs is
// the spec: key (seed lo, seed hi), counter (position lo, position hi, 0, 0), u = ((x1 << 32 | x0) >> 11)
// * 2^-53 in [0, 1)). Integer-exact, so equal to the CPU bit for bit. Used by sample_rows.cu; meant for
// the DDTree walk kernels too. Test: engine/tests/cuda_sample.rs (through sample_rows).
#pragma once

#include <stdint.h>

namespace kdtree {

// Random123 philox4x32_R(10, ctr, key): per round (hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2,
// c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); the key is bumped by (W0, W1) before every round but the first.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
    constexpr unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k.x += W0;
            k.y += W1;
        }
        const unsigned hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const unsigned hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// The uniform in [0, 1) of the token at absolute `position` under `seed` (sampling::uniform).
__device__ __forceinline__ double philox_uniform(uint64_t seed, uint64_t position) {
    const uint4 x = philox4x32_10(make_uint4((unsigned)position, (unsigned)(position >> 32), 0u, 0u),
                                  make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
    const uint64_t bits = ((uint64_t)x.y << 32 | (uint64_t)x.x) >> 11;
    return (double)bits * 0x1p-53;
}

}  // namespace kdtree
