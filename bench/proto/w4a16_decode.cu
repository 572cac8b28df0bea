// Prototype for issue 26 (the decode step at the memory floor), item 2 and 3: a W4A16 group-32 decode kernel
// family on the converter's INT4 layout, measured against the device copy, with its CPU reference and
// checks in this one file (the llm.c habit). Not used by the engine yet: this file is the evidence that the
// design reaches the bandwidth before it is ported into kernels/cuda (with the engine's CPU twin, wrappers and
// poisoned parity tests).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Werror all-warnings -o w4a16_decode bench/proto/w4a16_decode.cu && ./w4a16_decode [--quick]
//
// Layout (formats/FORMAT.md "i4g32"): packed [E, N, K/2] u8, byte m of a row holds k = 2m (low nibble) and
// 2m + 1 (high), q = nibble - 8; scales [E, N, K/32] bf16; w = q * scale.
//
// Design (what differs from kernels/cuda/w4a16_gemm.cu):
//  * a warp owns one m16 tile (16 weight rows, the mma's A operand) and a run of 128-k blocks of it; lane
//    (g, t) loads group 4 kb + t of rows g and g + 8 (16 B each: one 32-k group, one scale) into a rolling
//    register ring of S blocks, refilled as each block is used (S x 2 x 16 B per lane always in flight);
//  * x (the B operand, <= 8 tokens per n8 tile) is read from global memory (L1/L2 resident) in a permuted
//    order written by its producer: within each 32-k group, per 8-k chunk k0 k4 k1 k5 k2 k6 k3 k7, so that a
//    lane's 16 u32 of a group are its B registers of the 8 mma steps in order (four 16-byte loads);
//  * the KS warps of a CTA split K; their f32 tiles meet in shared memory and are summed in warp order by one
//    thread per output: no workspace, no counters, no second kernel, and
//  * batch invariance: the split (blocks per warp) depends on the matrix shape only, never on M, and an mma column's result
//    depends on its own column alone, so a token's output bits are the same in a batch of 1 or of 32;
//  * MoE at decode: kernel 1 computes a (token, slot) pair's gate and up rows as one m16 tile (rows g: gate,
//    g + 8: up, so the lane holding gate[j] also holds up[j]) and writes silu(gate) * up, bf16, already
//    permuted for kernel 2; kernel 2 computes a token's 16 output rows for all its top-k slots in one CTA
//    (warps = slots x K-splits) and combines them in slot order with the router weights (fmaf over the slots'
//    bf16-rounded outputs, as kernels/cuda/moe_combine.cu does): the routed MoE of a token in two launches.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

#define CK(x)                                                                                        \
    do {                                                                                             \
        cudaError_t e_ = (x);                                                                        \
        if (e_ != cudaSuccess) {                                                                     \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
            exit(2);                                                                                 \
        }                                                                                            \
    } while (0)

constexpr int KB = 128;  // k per block (4 groups of 32)

// A streamed 16-byte load that skips L1 (kernels/cuda/w4a16_gemm.cu has the same; the port shares one).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Nibbles sh/4 and sh/4 + 4 of w -> bf16x2 ((n - 8) * s, (n' - 8) * s), one rounding each.
__device__ __forceinline__ uint32_t deq2(uint32_t w, int sh, bf162 s2) {
    const uint32_t m = ((w >> sh) & 0x000F000Fu) | 0x43004300u;  // bf16x2 (128 + n, 128 + n')
    bf162 v = *reinterpret_cast<const bf162*>(&m);
    v = __hsub2(v, __floats2bfloat162_rn(136.f, 136.f));  // exact
    v = __hmul2(v, s2);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where element k of a row of x sits in the permuted form (u16 index).
__host__ __device__ __forceinline__ int perm_pos(int k) {
    const int r = k & 7;
    return (k & ~7) + 2 * (r & 3) + (r >> 2);
}

#ifndef MINB
#define MINB 1  // CTAs an SM the register allocation must allow (-DMINB=4: <= 64 registers a thread, 32 warps an SM)
#endif
#ifndef PF
#define PF 0  // with PF > 0, block b + S + PF is prefetched into L2 as block b + S is loaded (-DPF=N)
#endif
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p)); }

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Programmatic dependent launch (sm_90): with the launch attribute set (--pdl), a kernel starts while the one
// before it drains; it may only read the weights (which nothing writes) before pdl_wait().
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Lane (g, t)'s column of x in each of the NT n8 tiles (token 8 m + g, clamped to M - 1; u32 at group t of block 0).
template <int NT>
__device__ __forceinline__ void x_columns(const uint32_t* (&xq)[NT], const bf16* xp, int M, int K) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < NT; m++) xq[m] = reinterpret_cast<const uint32_t*>(xp + (size_t)min(8 * m + g, M - 1) * K) + 16 * t;
}

// One 128-k block of a warp's m16 tile: lane (g, t)'s weights w0 (row g) and w1 (row g + 8) of group t with their
// scales, x of NT column tiles (16 u32 each, permuted), 8 mma steps into c.
template <int NT>
__device__ __forceinline__ void block_mma(float (&c)[NT][4], const uint4& w0, const uint4& w1, bf16 q0, bf16 q1,
                                          const uint4 (&xv)[NT][4]) {
    const bf162 sc0 = __halves2bfloat162(q0, q0), sc1 = __halves2bfloat162(q1, q1);
#pragma unroll
    for (int st = 0; st < 8; st++) {
        const int j = 2 * (st & 1);
        const uint32_t v0 = word_of(w0, st >> 1), v1 = word_of(w1, st >> 1);
        const uint32_t r0 = deq2(v0, 4 * j, sc0), r1 = deq2(v1, 4 * j, sc1);
        const uint32_t r2 = deq2(v0, 4 * j + 4, sc0), r3 = deq2(v1, 4 * j + 4, sc1);
#pragma unroll
        for (int m = 0; m < NT; m++) {
            const uint32_t* xr = reinterpret_cast<const uint32_t*>(&xv[m][0]);
            mma(c[m], r0, r1, r2, r3, xr[2 * st], xr[2 * st + 1]);
        }
    }
}

// SwiGLU epilogue of a gate/up CTA: red holds nw warps' [gate 8 | up 8] f32 sums; threads 0-7 sum them in warp
// order and write silu(bf16(gate)) * bf16(up), rounded to bf16, at the permuted position of row 8 x + j of pair p.
__device__ __forceinline__ void swiglu_store(const float* red, int nw, int p, int I, bf16* __restrict__ hp) {
    if (threadIdx.x < 8) {
        const int j = threadIdx.x;
        float gs = red[j], us = red[8 + j];
        for (int w = 1; w < nw; w++) gs += red[w * 16 + j], us += red[w * 16 + 8 + j];
        const float gv = __bfloat162float(__float2bfloat16_rn(gs)), uv = __bfloat162float(__float2bfloat16_rn(us));
        const float h = gv * (1.0f / (1.0f + expf(-gv))) * uv;
        hp[(size_t)p * I + perm_pos(blockIdx.x * 8 + j)] = __float2bfloat16_rn(h);
    }
}

// Dense epilogue: red holds nw warps' NT x 4 x 32 f32 fragments; their sum in warp order, rounded to bf16, to y.
template <int NT>
__device__ __forceinline__ void dense_store(const float* red, int nw, int M, int N, bf16* __restrict__ y) {
    for (int v = threadIdx.x; v < NT * 128; v += blockDim.x) {
        float s = red[v];
        for (int w = 1; w < nw; w++) s += red[w * NT * 128 + v];
        const int m = v / 128, i = (v / 32) % 4, l = v % 32;
        const int col = 8 * m + 2 * (l & 3) + (i & 1), row = blockIdx.x * 16 + (l >> 2) + 8 * (i >> 1);
        if (col < M) y[(size_t)col * N + row] = __float2bfloat16_rn(s);
    }
}

// One warp: NT column tiles of one m16 tile over nb 128-k blocks, streamed through a rolling register ring of S
// blocks (S even): block b + S is loaded into the slot of block b as soon as b has been used, so S blocks stay
// in flight while the warp computes. a0/a1: rows g and g + 8 at group t of the first block; s0/s1: their
// scales; xp[m]: the lane's column of tile m (u32) at that group. x of block b + 1 is loaded while block b
// computes (NT <= 2; else x of block b first). Two accumulators (even and odd blocks, added at the end) halve
// the mma chain. The order of every sum depends on nb and the block index only: the same for every M.
template <int S, int NT>
__device__ __forceinline__ void tile_stream(float (&c)[NT][4], const uint8_t* a0, const uint8_t* a1, const bf16* s0,
                                            const bf16* s1, const uint32_t* const (&xp)[NT], int nb) {
    static_assert(S % 2 == 0, "S even: slot parity == block parity");
    constexpr int XB = NT <= 2 ? 2 : 1;
    uint4 w0[S], w1[S];
    bf16 q0[S], q1[S];
    auto load_w = [&](int b, int i) {
        w0[i] = ld_stream(a0 + (size_t)b * 64);
        w1[i] = ld_stream(a1 + (size_t)b * 64);
        q0[i] = __ldg(s0 + (size_t)b * 4);
        q1[i] = __ldg(s1 + (size_t)b * 4);
    };
#pragma unroll
    for (int i = 0; i < S; i++)
        if (i < nb) load_w(i, i);
    pdl_trigger();
    pdl_wait();
    uint4 xv[XB][NT][4];
    auto load_x = [&](int b, int slot) {
#pragma unroll
        for (int m = 0; m < NT; m++) {
            const uint4* p = reinterpret_cast<const uint4*>(xp[m] + (size_t)b * 64);
#pragma unroll
            for (int i = 0; i < 4; i++) xv[slot][m][i] = __ldg(p + i);
        }
    };
    if (XB == 2 && nb > 0) load_x(0, 0);
    float c2[NT][4] = {};
    for (int base = 0; base < nb; base += S) {
#pragma unroll
        for (int i = 0; i < S; i++) {
            const int b = base + i;
            if (b >= nb) break;
            const int xs = XB == 2 ? (i & 1) : 0;
            if (XB == 2) {
                if (b + 1 < nb) load_x(b + 1, (i + 1) & 1);
            } else {
                load_x(b, 0);
            }
            if (i & 1) block_mma<NT>(c2, w0[i], w1[i], q0[i], q1[i], xv[xs]);
            else block_mma<NT>(c, w0[i], w1[i], q0[i], q1[i], xv[xs]);
            if (b + S < nb) load_w(b + S, i);
            if (PF > 0 && b + S + PF < nb) {
                prefetch_l2(a0 + (size_t)(b + S + PF) * 64);
                prefetch_l2(a1 + (size_t)(b + S + PF) * 64);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[m][i] += c2[m][i];
}

// x [M, K] bf16 -> xp [M, K] bf16 in the permuted order (in the engine: written by x's producer).
__global__ void permute_x(const bf16* __restrict__ x, bf16* __restrict__ xp, int M, int K) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)M * K) return;
    const int k = (int)(i % K);
    xp[i - k + perm_pos(k)] = x[i];
}

// Dense: y[M, N] = x W^T. grid N / 16 tiles, block KS warps (warp w: blocks [w bpw, w bpw + bpw)).
// Shared: KS x NT x 4 x 32 floats.
template <int S, int NT>
__global__ void __launch_bounds__(256, MINB) dense_i4g32(const bf16* __restrict__ xp, int M, const uint8_t* __restrict__ packed,
                                                    const bf16* __restrict__ scales, int N, int K, int bpw,
                                                    bf16* __restrict__ y) {
    extern __shared__ float red[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, KS = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nbt = K / KB, kb0 = warp * bpw, nb = min(bpw, nbt - kb0);
    const size_t r0 = (size_t)blockIdx.x * 16 + g;
    float c[NT][4] = {};
    if (nb > 0) {
        const uint32_t* xq[NT];
#pragma unroll
        for (int m = 0; m < NT; m++) {
            const int col = min(8 * m + g, M - 1);
            xq[m] = reinterpret_cast<const uint32_t*>(xp + (size_t)col * K) + (size_t)kb0 * 64 + 16 * t;
        }
        const size_t ka = (size_t)kb0 * 64 + 16 * t, ks = (size_t)kb0 * 4 + t;
        tile_stream<S, NT>(c, packed + r0 * (K / 2) + ka, packed + (r0 + 8) * (K / 2) + ka,
                          scales + r0 * (K / 32) + ks, scales + (r0 + 8) * (K / 32) + ks, xq, nb);
    }
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[((warp * NT + m) * 4 + i) * 32 + lane] = c[m][i];
    __syncthreads();
    dense_store<NT>(red, KS, M, N, y);
}

// MoE 1: pair p (token pair_token[p], expert pair_expert[p]); grid (I / 8, pairs), block KS warps.
// hp [pairs, I] bf16 permuted: silu(bf16(gate)) * bf16(up), rounded to bf16. Shared: KS x 2 x 32 floats.
template <int S>
__global__ void __launch_bounds__(256, MINB) moe_gate_up(const bf16* __restrict__ xp, const int* __restrict__ pair_token,
                                                    const int* __restrict__ pair_expert, const uint8_t* __restrict__ gate,
                                                    const bf16* __restrict__ gate_s, const uint8_t* __restrict__ up,
                                                    const bf16* __restrict__ up_s, int I, int K, int bpw, bf16* __restrict__ hp) {
    extern __shared__ float red[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, KS = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3, p = blockIdx.y;
    const int nbt = K / KB, kb0 = warp * bpw, nb = min(bpw, nbt - kb0);
    const size_t e = pair_expert[p];
    const size_t row = e * I + (size_t)blockIdx.x * 8 + g;
    float c[1][4] = {};
    if (nb > 0) {
        const uint32_t* xq[1] = {reinterpret_cast<const uint32_t*>(xp + (size_t)pair_token[p] * K) + (size_t)kb0 * 64 +
                                 16 * t};
        const size_t ka = (size_t)kb0 * 64 + 16 * t, ks = (size_t)kb0 * 4 + t;
        tile_stream<S, 1>(c, gate + row * (K / 2) + ka, up + row * (K / 2) + ka, gate_s + row * (K / 32) + ks,
                         up_s + row * (K / 32) + ks, xq, nb);
    }
    if (t == 0) red[(warp * 2 + 0) * 8 + g] = c[0][0], red[(warp * 2 + 1) * 8 + g] = c[0][2];
    __syncthreads();
    swiglu_store(red, KS, p, I, hp);
}

// MoE 2: token tok's 16 output rows; grid (H / 16, T), block topk x KS warps (warp = slot * KS + split).
// y [T, H] f32 = sum over slots in order of fmaf(weight, bf16(down_slot(h)), acc). Shared: topk x KS x 2 x 32.
template <int S>
__global__ void __launch_bounds__(256, MINB) moe_down_combine(const bf16* __restrict__ hp, const int* __restrict__ pair_expert,
                                                         const float* __restrict__ pair_weight, int topk, int KS, int bpw,
                                                         const uint8_t* __restrict__ down, const bf16* __restrict__ down_s,
                                                         int H, int I, float* __restrict__ y) {
    extern __shared__ float red[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, tok = blockIdx.y;
    const int slot = warp / KS, split = warp % KS;
    const int p = tok * topk + slot;
    const int nbt = I / KB, kb0 = split * bpw, nb = min(bpw, nbt - kb0);
    const size_t row = (size_t)pair_expert[p] * H + (size_t)blockIdx.x * 16 + g;
    float c[1][4] = {};
    if (nb > 0) {
        const uint32_t* xq[1] = {reinterpret_cast<const uint32_t*>(hp + (size_t)p * I) + (size_t)kb0 * 64 + 16 * t};
        const size_t ka = (size_t)kb0 * 64 + 16 * t, ks = (size_t)kb0 * 4 + t;
        tile_stream<S, 1>(c, down + row * (I / 2) + ka, down + (row + 8) * (I / 2) + ka, down_s + row * (I / 32) + ks,
                         down_s + (row + 8) * (I / 32) + ks, xq, nb);
    }
    if (t == 0) red[warp * 16 + g] = c[0][0], red[warp * 16 + 8 + g] = c[0][2];
    __syncthreads();
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
        float acc = 0.f;
        for (int s = 0; s < topk; s++) {
            float d = red[(s * KS) * 16 + r];
            for (int w = 1; w < KS; w++) d += red[(s * KS + w) * 16 + r];
            acc = fmaf(pair_weight[tok * topk + s], __bfloat162float(__float2bfloat16_rn(d)), acc);
        }
        y[(size_t)tok * H + blockIdx.x * 16 + r] = acc;
    }
}

// ---- v4: the weight stream through a shared-memory ring (run 62: right, but 12-25 % of copy: too many tiny TMA ops) --
// One producer warp per CTA bulk-copies (cp.async.bulk, completion on an mbarrier) each stage of the CTA's 16
// rows (2 blocks: 128 weight bytes and 16 scale bytes a row) into a ring of V4R slots; V4C consumer warps take
// the stages round-robin (stage s to consumer s % V4C), read their A fragments from shared memory (the same 16
// bytes a lane loads in tile_stream), and release the slot. Bytes in flight cost shared memory, not registers.
// The order of every sum is fixed by the shape (stage s to consumer s % V4C; per consumer, blocks in order into
// two accumulators; the consumers summed in order), so it is as batch-invariant as tile_stream.
#ifndef V4R
#define V4R 8  // stages in the ring (<= 8: the barriers fit the first 128 bytes)
#endif
#ifndef V4C
#define V4C 4  // consumer warps a CTA
#endif
constexpr int V4_WSTR = 192;                      // a row's 128 bytes of a stage, padded: rows g, g + 1 16 banks apart
constexpr int V4_SLOT = 16 * V4_WSTR + 16 * 16;   // one stage: 16 rows of weights, then 16 rows of 16 scale bytes
constexpr int V4_TX = 16 * 128 + 16 * 16;         // the bytes a stage's 32 copies bring
constexpr int V4_RING_OFF = 128;                  // the ring after the 2 x V4R barriers
static_assert(V4R <= 8, "2 x V4R barriers in 128 bytes");

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx_arrive(uint64_t* b, uint32_t tx) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(smem_u32(b)), "r"(parity)
            : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

// The CTA's 16 rows: rows 0-7 from A0 (+ r x rb bytes), rows 8-15 from A1; their scales likewise from S0 / S1
// (sb scales a row); nbt 128-k blocks (even). Consumer warp cw leaves its tile in c (the producer's c stays 0).
template <int NT>
__device__ __forceinline__ void v4_stream(float (&c)[NT][4], unsigned char* sm, const uint8_t* A0, const uint8_t* A1,
                                          const bf16* S0, const bf16* S1, size_t rb, size_t sb, int nbt,
                                          const uint32_t* const (&xq)[NT]) {
    uint64_t* full = reinterpret_cast<uint64_t*>(sm);
    uint64_t* empty = full + V4R;
    unsigned char* ring = sm + V4_RING_OFF;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nst = nbt / 2;
    if (threadIdx.x == 0) {
        for (int i = 0; i < V4R; i++) mbar_init(&full[i], 1), mbar_init(&empty[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {
        const int r = lane & 15;
        const unsigned char* wsrc = r < 8 ? A0 + (size_t)r * rb : A1 + (size_t)(r - 8) * rb;
        const unsigned char* ssrc =
            reinterpret_cast<const unsigned char*>(r < 8 ? S0 + (size_t)r * sb : S1 + (size_t)(r - 8) * sb);
        for (int s = 0; s < nst; s++) {
            const int slot = s % V4R;
            if (s >= V4R) mbar_wait(&empty[slot], ((s / V4R) - 1) & 1);
            if (lane == 0) mbar_expect_tx_arrive(&full[slot], V4_TX);
            __syncwarp();
            unsigned char* base = ring + (size_t)slot * V4_SLOT;
            if (lane < 16) bulk_g2s(base + r * V4_WSTR, wsrc + (size_t)s * 128, 128, &full[slot]);
            else bulk_g2s(base + 16 * V4_WSTR + r * 16, ssrc + (size_t)s * 16, 16, &full[slot]);
        }
        return;
    }
    const int cw = warp - 1, g = lane >> 2, t = lane & 3;
    float c2[NT][4] = {};
    pdl_trigger();
    pdl_wait();
    for (int s = cw; s < nst; s += V4C) {
        const int slot = s % V4R;
        uint4 xv[2][NT][4];  // x of the stage's two blocks (L1/L2), issued before the wait
#pragma unroll
        for (int blk = 0; blk < 2; blk++)
#pragma unroll
            for (int m = 0; m < NT; m++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    xv[blk][m][i] = __ldg(reinterpret_cast<const uint4*>(xq[m] + (size_t)(2 * s + blk) * 64) + i);
        mbar_wait(&full[slot], (s / V4R) & 1);
        const unsigned char* base = ring + (size_t)slot * V4_SLOT;
#pragma unroll
        for (int blk = 0; blk < 2; blk++) {
            const uint4 w0 = *reinterpret_cast<const uint4*>(base + g * V4_WSTR + blk * 64 + t * 16);
            const uint4 w1 = *reinterpret_cast<const uint4*>(base + (g + 8) * V4_WSTR + blk * 64 + t * 16);
            const bf16 q0 = *reinterpret_cast<const bf16*>(base + 16 * V4_WSTR + g * 16 + (blk * 4 + t) * 2);
            const bf16 q1 = *reinterpret_cast<const bf16*>(base + 16 * V4_WSTR + (g + 8) * 16 + (blk * 4 + t) * 2);
            if (blk) block_mma<NT>(c2, w0, w1, q0, q1, xv[1]);
            else block_mma<NT>(c, w0, w1, q0, q1, xv[0]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
    }
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[m][i] += c2[m][i];
}

static size_t v4_smem(int nt_or_2) { return V4_RING_OFF + (size_t)V4R * V4_SLOT + (size_t)V4C * nt_or_2 * 128 * 4; }

// Dense, v4: grid N / 16 tiles, 32 x (1 + V4C) threads; the consumers' tiles summed in consumer order.
template <int NT>
__global__ void __launch_bounds__(32 * (1 + V4C)) dense_v4(const bf16* __restrict__ xp, int M,
                                                           const uint8_t* __restrict__ packed,
                                                           const bf16* __restrict__ scales, int N, int K,
                                                           bf16* __restrict__ y) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* red = reinterpret_cast<float*>(sm + V4_RING_OFF + (size_t)V4R * V4_SLOT);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t rb = (size_t)K / 2, sb = (size_t)K / 32, r0 = (size_t)blockIdx.x * 16;
    const uint32_t* xq[NT];
    x_columns<NT>(xq, xp, M, K);
    float c[NT][4] = {};
    v4_stream<NT>(c, sm, packed + r0 * rb, packed + (r0 + 8) * rb, scales + r0 * sb, scales + (r0 + 8) * sb, rb, sb,
                  K / KB, xq);
    if (warp > 0) {
#pragma unroll
        for (int m = 0; m < NT; m++)
#pragma unroll
            for (int i = 0; i < 4; i++) red[(((warp - 1) * NT + m) * 4 + i) * 32 + lane] = c[m][i];
    }
    __syncthreads();
    pdl_wait();  // the producer warp too, before anything is written
    dense_store<NT>(red, V4C, M, N, y);
}

// MoE 1, v4: as moe_gate_up, the stream through the ring; grid (I / 8, pairs), 32 x (1 + V4C) threads.
__global__ void __launch_bounds__(32 * (1 + V4C)) moe_gate_up_v4(const bf16* __restrict__ xp,
                                                                 const int* __restrict__ pair_token,
                                                                 const int* __restrict__ pair_expert,
                                                                 const uint8_t* __restrict__ gate,
                                                                 const bf16* __restrict__ gate_s,
                                                                 const uint8_t* __restrict__ up,
                                                                 const bf16* __restrict__ up_s, int I, int K,
                                                                 bf16* __restrict__ hp) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* red = reinterpret_cast<float*>(sm + V4_RING_OFF + (size_t)V4R * V4_SLOT);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, p = blockIdx.y;
    const size_t rb = (size_t)K / 2, sb = (size_t)K / 32;
    const size_t row = (size_t)pair_expert[p] * I + (size_t)blockIdx.x * 8;
    const uint32_t* xq[1] = {reinterpret_cast<const uint32_t*>(xp + (size_t)pair_token[p] * K) + 16 * t};
    float c[1][4] = {};
    v4_stream<1>(c, sm, gate + row * rb, up + row * rb, gate_s + row * sb, up_s + row * sb, rb, sb, K / KB, xq);
    if (warp > 0 && t == 0) red[((warp - 1) * 2 + 0) * 8 + g] = c[0][0], red[((warp - 1) * 2 + 1) * 8 + g] = c[0][2];
    __syncthreads();
    pdl_wait();
    swiglu_store(red, V4C, p, I, hp);
}

// ---- v5: Marlin's form (runs 63, 65: right, 25-37 % of copy on the 14.7 MB matrix, no better than v1) ---------
// Every thread of a 4-warp CTA issues 16-byte cp.async copies of the CTA's 16 rows, V5B 128-k blocks a stage
// (512 weight bytes + 64 scale bytes a row at V5B = 8), into a ring of V5S stages; one commit group a stage,
// cp.async.wait_group + one __syncthreads a stage, and the stage's blocks split over the warps (warp w: blocks
// w * V5B / 4 ...; the first into c, the second into c2). Bytes in flight are shared memory (V5S - 1 stages of
// ~9.5 KB a CTA), the copies few and large-ish (16 B each, 4.5 a thread a stage), no producer/consumer hand-off.
// Batch-invariant as the others: the order of every sum depends on K only (stage, then the warp's blocks, then
// the warps in order).
#ifndef V5S
#define V5S 4  // stages in the ring
#endif
#ifndef V5B
#define V5B 8  // 128-k blocks a stage
#endif
#ifndef V5W
#define V5W 4  // warps a CTA (-DV5W=8: twice the warps an SM at the same CTAs and shared memory)
#endif
constexpr int V5_WROW = V5B * 64 + 64;         // a row's weight bytes in a stage, padded: rows g, g + 1 64 bytes apart
constexpr int V5_SROW = V5B * 8 + 16;          // a row's scale bytes in a stage, padded: 8 rows on distinct banks
constexpr int V5_STAGE = 16 * V5_WROW + 16 * V5_SROW;
static_assert(V5B % V5W == 0, "whole blocks a warp a stage (two or more: c and c2 alternate; one: c alone)");
static_assert((16 * V5B * 4) % (32 * V5W) == 0 && 16 * (V5B / 2) <= 32 * V5W, "a stage's copies split evenly");

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Stage `b0 / V5B` of the CTA's 16 rows (0-7 at A0 + r x rb, 8-15 at A1; scales at S0 / S1, sb a row) into slot
// st: this thread's share of the 16-byte copies (blocks past nbt skipped).
__device__ __forceinline__ void v5_issue(unsigned char* st, const uint8_t* A0, const uint8_t* A1, const bf16* S0,
                                         const bf16* S1, size_t rb, size_t sb, int b0, int nbt) {
    const int tid = threadIdx.x;
    constexpr int WCH = V5B * 4;  // 16-byte chunks a row
#pragma unroll
    for (int i = 0; i < 16 * WCH / (32 * V5W); i++) {
        const int ch = tid + i * 32 * V5W, r = ch / WCH, col = ch % WCH;
        if (b0 + col / 4 < nbt) {
            const uint8_t* src = (r < 8 ? A0 + (size_t)r * rb : A1 + (size_t)(r - 8) * rb) + (size_t)b0 * 64 + col * 16;
            cp_async16(st + r * V5_WROW + col * 16, src);
        }
    }
    constexpr int SCH = V5B / 2;  // 16-byte scale chunks a row (2 blocks each)
    if (tid < 16 * SCH) {
        const int r = tid / SCH, part = tid % SCH;
        if (b0 + 2 * part < nbt) {
            const bf16* src = (r < 8 ? S0 + (size_t)r * sb : S1 + (size_t)(r - 8) * sb) + (size_t)b0 * 4 + part * 8;
            cp_async16(st + 16 * V5_WROW + r * V5_SROW + part * 16, src);
        }
    }
}

// x of this warp's blocks of stage stg (zeros past nbt), issued before the stage's wait.
template <int NT>
__device__ __forceinline__ void v5_load_x(uint4 (&xv)[V5B / V5W][NT][4], const uint32_t* const (&xq)[NT], int stg, int nbt) {
    constexpr int PW = V5B / V5W;
#pragma unroll
    for (int jj = 0; jj < PW; jj++) {
        const int b = stg * V5B + (threadIdx.x >> 5) * PW + jj;
#pragma unroll
        for (int m = 0; m < NT; m++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                xv[jj][m][i] = b < nbt ? __ldg(reinterpret_cast<const uint4*>(xq[m] + (size_t)b * 64) + i) : make_uint4(0, 0, 0, 0);
    }
}

// This warp's blocks of stage stg from slot st: the first into c, the second into c2.
template <int NT>
__device__ __forceinline__ void v5_compute(float (&c)[NT][4], float (&c2)[NT][4], const unsigned char* st, int stg, int nbt,
                                           const uint4 (&xv)[V5B / V5W][NT][4]) {
    constexpr int PW = V5B / V5W;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int jj = 0; jj < PW; jj++) {
        const int j = (threadIdx.x >> 5) * PW + jj;
        if (stg * V5B + j >= nbt) break;
        const uint4 w0 = *reinterpret_cast<const uint4*>(st + g * V5_WROW + j * 64 + t * 16);
        const uint4 w1 = *reinterpret_cast<const uint4*>(st + (g + 8) * V5_WROW + j * 64 + t * 16);
        const bf16 q0 = *reinterpret_cast<const bf16*>(st + 16 * V5_WROW + g * V5_SROW + (j * 4 + t) * 2);
        const bf16 q1 = *reinterpret_cast<const bf16*>(st + 16 * V5_WROW + (g + 8) * V5_SROW + (j * 4 + t) * 2);
        if (jj & 1) block_mma<NT>(c2, w0, w1, q0, q1, xv[jj]);
        else block_mma<NT>(c, w0, w1, q0, q1, xv[jj]);
    }
}

// The CTA's 16 rows (rows 0-7 from A0 + r x rb, 8-15 from A1; scales from S0 / S1, sb a row) over nbt blocks
// (even); each warp leaves its tile in c. sm: V5S stages.
template <int NT>
__device__ __forceinline__ void v5_stream(float (&c)[NT][4], unsigned char* sm, const uint8_t* A0, const uint8_t* A1,
                                          const bf16* S0, const bf16* S1, size_t rb, size_t sb, int nbt,
                                          const uint32_t* const (&xq)[NT]) {
    const int nst = (nbt + V5B - 1) / V5B;
    auto issue = [&](int s) {
        if (s < nst) v5_issue(sm + (size_t)(s % V5S) * V5_STAGE, A0, A1, S0, S1, rb, sb, s * V5B, nbt);
        cp_commit();  // one group a stage, empty past the end: the wait counts stay exact
    };
#pragma unroll
    for (int s = 0; s < V5S - 1; s++) issue(s);
    pdl_trigger();
    pdl_wait();
    float c2[NT][4] = {};
    for (int s = 0; s < nst; s++) {
        uint4 xv[V5B / V5W][NT][4];
        v5_load_x<NT>(xv, xq, s, nbt);
        cp_wait<V5S - 2>();
        __syncthreads();  // stage s landed for every thread; every warp is done with stage s - 1's slot
        issue(s + V5S - 1);
        v5_compute<NT>(c, c2, sm + (size_t)(s % V5S) * V5_STAGE, s, nbt, xv);
    }
    cp_wait<0>();
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[m][i] += c2[m][i];
}

static size_t v5_smem(int nt_or_2) { return (size_t)V5S * V5_STAGE + (size_t)V5W * nt_or_2 * 128 * 4; }

// Dense, v5: grid N / 16 tiles, 128 threads; the warps' tiles summed in warp order.
template <int NT>
__global__ void __launch_bounds__(32 * V5W) dense_v5(const bf16* __restrict__ xp, int M, const uint8_t* __restrict__ packed,
                                                     const bf16* __restrict__ scales, int N, int K, bf16* __restrict__ y) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* red = reinterpret_cast<float*>(sm + (size_t)V5S * V5_STAGE);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t rb = (size_t)K / 2, sb = (size_t)K / 32, r0 = (size_t)blockIdx.x * 16;
    const uint32_t* xq[NT];
    x_columns<NT>(xq, xp, M, K);
    float c[NT][4] = {};
    v5_stream<NT>(c, sm, packed + r0 * rb, packed + (r0 + 8) * rb, scales + r0 * sb, scales + (r0 + 8) * sb, rb, sb,
                  K / KB, xq);
#pragma unroll
    for (int m = 0; m < NT; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[((warp * NT + m) * 4 + i) * 32 + lane] = c[m][i];
    __syncthreads();
    dense_store<NT>(red, V5W, M, N, y);
}

// MoE 1, v5: as moe_gate_up; grid (I / 8, pairs), 128 threads.
__global__ void __launch_bounds__(32 * V5W) moe_gate_up_v5(const bf16* __restrict__ xp, const int* __restrict__ pair_token,
                                                           const int* __restrict__ pair_expert, const uint8_t* __restrict__ gate,
                                                           const bf16* __restrict__ gate_s, const uint8_t* __restrict__ up,
                                                           const bf16* __restrict__ up_s, int I, int K, bf16* __restrict__ hp) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* red = reinterpret_cast<float*>(sm + (size_t)V5S * V5_STAGE);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, p = blockIdx.y;
    const size_t rb = (size_t)K / 2, sb = (size_t)K / 32;
    const size_t row = (size_t)pair_expert[p] * I + (size_t)blockIdx.x * 8;
    const uint32_t* xq[1] = {reinterpret_cast<const uint32_t*>(xp + (size_t)pair_token[p] * K) + 16 * t};
    float c[1][4] = {};
    v5_stream<1>(c, sm, gate + row * rb, up + row * rb, gate_s + row * sb, up_s + row * sb, rb, sb, K / KB, xq);
    if (t == 0) red[(warp * 2 + 0) * 8 + g] = c[0][0], red[(warp * 2 + 1) * 8 + g] = c[0][2];
    __syncthreads();
    swiglu_store(red, V5W, p, I, hp);
}

// ---- v5 persistent: one launch over R matrices (the fixed-cost experiment; run 66: still 40 % of copy) -------
// The same stages, ring and per-tile order as dense_v5, but each CTA walks a flat list of (matrix r, tile, stage)
// for R matrices of one shape (y_r = x W_r^T), its tiles t = blockIdx.x, + gridDim.x, ...; the ring never drains
// between tiles or matrices, and a tile's reduce and store run between two stages. A tile's sums are those of
// dense_v5 (same stage split, same warp blocks, same warp order): the outputs are bit-identical to it.
template <int NT>
__global__ void __launch_bounds__(32 * V5W) dense_multi_v5(const bf16* __restrict__ xp, int M,
                                                           const uint8_t* const* __restrict__ packs,
                                                           const bf16* const* __restrict__ scls, int R, int N, int K,
                                                           bf16* const* __restrict__ ys) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* red = reinterpret_cast<float*>(sm + (size_t)V5S * V5_STAGE);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nbt = K / KB, nst = (nbt + V5B - 1) / V5B, tiles = N / 16;
    const int mine = tiles > (int)blockIdx.x ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int total = R * mine * nst;
    const size_t rb = (size_t)K / 2, sb = (size_t)K / 32;
    auto where = [&](int s, int& r, int& tile, int& st) {
        const int item = s / nst;
        st = s % nst;
        r = item / mine;
        tile = (int)blockIdx.x + (item % mine) * (int)gridDim.x;
    };
    auto issue = [&](int s) {
        if (s < total) {
            int r, tile, stg;
            where(s, r, tile, stg);
            const size_t r0 = (size_t)tile * 16;
            v5_issue(sm + (size_t)(s % V5S) * V5_STAGE, packs[r] + r0 * rb, packs[r] + (r0 + 8) * rb, scls[r] + r0 * sb,
                     scls[r] + (r0 + 8) * sb, rb, sb, stg * V5B, nbt);
        }
        cp_commit();
    };
#pragma unroll
    for (int s = 0; s < V5S - 1; s++) issue(s);
    pdl_trigger();
    pdl_wait();
    const uint32_t* xq[NT];
    x_columns<NT>(xq, xp, M, K);
    float c[NT][4] = {}, c2[NT][4] = {};
    for (int s = 0; s < total; s++) {
        int r, tile, stg;
        where(s, r, tile, stg);
        uint4 xv[V5B / V5W][NT][4];
        v5_load_x<NT>(xv, xq, stg, nbt);
        cp_wait<V5S - 2>();
        __syncthreads();
        issue(s + V5S - 1);
        v5_compute<NT>(c, c2, sm + (size_t)(s % V5S) * V5_STAGE, stg, nbt, xv);
        if (stg == nst - 1) {  // the tile's last stage: its reduce and store, then fresh accumulators
#pragma unroll
            for (int m = 0; m < NT; m++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    red[((warp * NT + m) * 4 + i) * 32 + lane] = c[m][i] + c2[m][i];
                    c[m][i] = 0.f;
                    c2[m][i] = 0.f;
                }
            __syncthreads();
            for (int v = tid; v < NT * 128; v += blockDim.x) {
                float a = red[v];
                for (int w = 1; w < V5W; w++) a += red[w * NT * 128 + v];
                const int m = v / 128, i = (v / 32) % 4, l = v % 32;
                const int col = 8 * m + 2 * (l & 3) + (i & 1), row = tile * 16 + (l >> 2) + 8 * (i >> 1);
                if (col < M) ys[r][(size_t)col * N + row] = __float2bfloat16_rn(a);
            }
            __syncthreads();  // red is read before the next tile writes it
        }
    }
    cp_wait<0>();
}

// ---- data ------------------------------------------------------------------------------------------------

__host__ __device__ inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__global__ void fill_bytes(uint8_t* p, size_t n, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n / 8; i += (size_t)gridDim.x * blockDim.x)
        reinterpret_cast<uint64_t*>(p)[i] = mix64(seed ^ (i * 0x2545F4914F6CDD1Dull));
}
// bf16 in [lo, hi) (scales: positive; x: signed)
__global__ void fill_bf16(bf16* p, size_t n, uint64_t seed, float lo, float hi) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16_rn(lo + (hi - lo) * (float)(mix64(seed ^ (i * 0x9E3779B97F4A7C15ull)) >> 40) / 16777216.f);
}

static float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f2bf(float f) {  // round to nearest even (finite inputs)
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
template <class T>
static std::vector<T> down_load(const void* d, size_t n) {
    std::vector<T> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}
static void* dalloc(size_t bytes) {
    void* p;
    CK(cudaMalloc(&p, bytes));
    return p;
}
static void fill(uint8_t* p, size_t n, uint64_t seed) {
    fill_bytes<<<1024, 256>>>(p, n, seed);
    CK(cudaGetLastError());
}
static void fillb(bf16* p, size_t n, uint64_t seed, float lo, float hi) {
    fill_bf16<<<1024, 256>>>(p, n, seed, lo, hi);
    CK(cudaGetLastError());
}

// CPU reference: row `row` of an i4g32 matrix dotted with x (f64, exact dequantisation).
static double ref_dot(const uint8_t* packed, const uint16_t* scales, size_t row, int K, const uint16_t* x) {
    double s = 0;
    for (int k = 0; k < K; k++) {
        const uint8_t b = packed[row * (K / 2) + k / 2];
        const int q = (k & 1 ? b >> 4 : b & 15) - 8;
        s += (double)q * bf2f(scales[row * (K / 32) + k / 32]) * bf2f(x[k]);
    }
    return s;
}

// ---- timing ----------------------------------------------------------------------------------------------

// Median milliseconds of `work(st)` between two events, over `reps` runs after 2 warm-up runs.
template <class F>
static double median_ms(F work, cudaStream_t st, int reps) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ts;
    for (int r = 0; r < reps + 2; r++) {
        CK(cudaEventRecord(e0, st));
        work(st);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) ts.push_back(ms);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
}

static double copy_gbps() {
    const size_t n = 1ull << 30;
    uint8_t *a = (uint8_t*)dalloc(n), *b = (uint8_t*)dalloc(n);
    fill(a, n, 1);
    const double ms = median_ms([&](cudaStream_t st) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st)); }, 0, 10);
    CK(cudaFree(a));
    CK(cudaFree(b));
    return 2.0 * n / (ms * 1e-3) / 1e9;
}

// Median per-call microseconds of `launch(i)` for i = 0..calls-1, captured as one graph, replayed.
template <class F>
static double time_graph(F launch, int calls, int replays = 15) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < calls; i++) launch(i, st);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    const double ms = median_ms([&](cudaStream_t q) { CK(cudaGraphLaunch(exec, q)); }, st, replays);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(st));
    return ms * 1e3 / calls;
}

static int failures = 0;
static void check(bool ok, const char* what) {
    if (!ok) failures++;
    printf("CHECK %-4s %s\n", ok ? "ok" : "FAIL", what);
}

// Launches with programmatic stream serialization when g_pdl (captured into the graph as programmatic edges).
static bool g_pdl = false;
static bool g_v4 = false;  // --v4: the dense and gate/up kernels of the shared-memory ring
static bool g_v5 = false;  // --v5: the dense and gate/up kernels of Marlin's form
template <class... KArgs, class... Args>
static void launch(void (*k)(KArgs...), dim3 grid, int threads, size_t smem, cudaStream_t st, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = g_pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k, ((KArgs)args)...));
}

// ---- dense -----------------------------------------------------------------------------------------------

#ifndef RING
#define RING 6
#endif
constexpr int S = RING;  // blocks in flight per warp (the ring; -DRING=N)
static int g_warps = 1100;  // target warps a launch (about 8 an SM): the split policy's one knob (--warps)

// Blocks per warp for `tiles` m16 tiles of nbt blocks: enough warps to keep ~g_warps streaming, at least S
// blocks a warp where K allows, at most max_ks warps a CTA (256 threads: up to 255 registers a thread). A function
// of the shape alone (never of M): the sums are batch-invariant.
static int blocks_per_warp(int tiles, int nbt, int max_ks = 8) {
    int ks = std::max(1, std::min({std::max(1, nbt / S), (g_warps + tiles - 1) / tiles, max_ks}));
    const int bpw = (nbt + ks - 1) / ks;
    return bpw;
}

template <int NT>
static void launch_dense_v4(const bf16* xp, int M, const uint8_t* p, const bf16* s, int N, int K, bf16* y,
                            cudaStream_t st) {
    if ((K / KB) % 2) fprintf(stderr, "v4: K / 128 must be even (K %d)\n", K), exit(2);
    const size_t smem = v4_smem(NT);
    static bool attr = false;
    if (!attr) {
        CK(cudaFuncSetAttribute(dense_v4<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        attr = true;
    }
    launch(dense_v4<NT>, dim3(N / 16), 32 * (1 + V4C), smem, st, xp, M, p, s, N, K, y);
}
template <int NT>
static void launch_dense_v5(const bf16* xp, int M, const uint8_t* p, const bf16* s, int N, int K, bf16* y,
                            cudaStream_t st) {
    if ((K / KB) % 2) fprintf(stderr, "v5: K / 128 must be even (K %d)\n", K), exit(2);
    const size_t smem = v5_smem(NT);
    static bool attr = false;
    if (!attr) {
        CK(cudaFuncSetAttribute(dense_v5<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        attr = true;
    }
    launch(dense_v5<NT>, dim3(N / 16), 32 * V5W, smem, st, xp, M, p, s, N, K, y);
}
template <int NT>
static void launch_dense(const bf16* xp, int M, const uint8_t* p, const bf16* s, int N, int K, bf16* y,
                         cudaStream_t st) {
    if (g_v4) return launch_dense_v4<NT>(xp, M, p, s, N, K, y, st);
    if (g_v5) return launch_dense_v5<NT>(xp, M, p, s, N, K, y, st);
    const int nbt = K / KB, bpw = blocks_per_warp(N / 16, nbt), KS = (nbt + bpw - 1) / bpw;
    const size_t smem = (size_t)KS * NT * 128 * sizeof(float);
    launch(dense_i4g32<S, NT>, dim3(N / 16), KS * 32, smem, st, xp, M, p, s, N, K, bpw, y);
}
static void dense(const bf16* xp, int M, const uint8_t* p, const bf16* s, int N, int K, bf16* y, cudaStream_t st) {
    switch ((M + 7) / 8) {
        case 1: launch_dense<1>(xp, M, p, s, N, K, y, st); break;
        case 2: launch_dense<2>(xp, M, p, s, N, K, y, st); break;
        case 3: launch_dense<3>(xp, M, p, s, N, K, y, st); break;
        case 4: launch_dense<4>(xp, M, p, s, N, K, y, st); break;
        default: fprintf(stderr, "M %d > 32\n", M); exit(2);
    }
}

static void run_dense(int N, int K, double copy, bool quick) {
    const size_t wbytes = (size_t)N * K / 2, sbytes = (size_t)N * (K / 32) * 2;
    const int copies = (int)std::max<size_t>(2, (512ull << 20) / (wbytes + sbytes));
    std::vector<uint8_t*> P(copies);
    std::vector<bf16*> S(copies);
    for (int c = 0; c < copies; c++) {
        P[c] = (uint8_t*)dalloc(wbytes);
        S[c] = (bf16*)dalloc(sbytes);
        fill(P[c], wbytes, 100 + c);
        fillb(S[c], sbytes / 2, 200 + c, 0.002f, 0.02f);
    }
    const int MMAX = 32;
    bf16* x = (bf16*)dalloc((size_t)MMAX * K * 2);
    bf16* xp = (bf16*)dalloc((size_t)MMAX * K * 2);
    bf16* y = (bf16*)dalloc((size_t)MMAX * N * 2);
    bf16* y1 = (bf16*)dalloc((size_t)MMAX * N * 2);
    fillb(x, (size_t)MMAX * K, 7, -1.f, 1.f);
    permute_x<<<(MMAX * K + 255) / 256, 256>>>(x, xp, MMAX, K);
    CK(cudaDeviceSynchronize());

    // Checks: M = 5 against the f64 reference (rows sampled), M = 1 / 5 / 32 column 0 bits, two runs equal.
    dense(xp, 5, P[0], S[0], N, K, y, 0);
    CK(cudaDeviceSynchronize());
    auto hy = down_load<uint16_t>(y, (size_t)5 * N);
    auto hp = down_load<uint8_t>(P[0], wbytes);
    auto hs = down_load<uint16_t>(S[0], sbytes / 2);
    auto hx = down_load<uint16_t>(x, (size_t)5 * K);
    double maxerr = 0, maxref = 0;
    for (int m = 0; m < 5; m++)
        for (int n = 0; n < N; n += (quick ? 7 : 1)) {
            const double r = ref_dot(hp.data(), hs.data(), n, K, hx.data() + (size_t)m * K);
            maxerr = std::max(maxerr, std::fabs(r - bf2f(hy[(size_t)m * N + n])));
            maxref = std::max(maxref, std::fabs(r));
        }
    char msg[256];
    snprintf(msg, sizeof msg, "dense %dx%d M=5 vs f64 reference: max err %.3g of max |y| %.3g (rel %.2e <= 1e-2)", N, K,
             maxerr, maxref, maxerr / maxref);
    check(maxerr / maxref <= 1e-2, msg);
    bool inv = true, rep = true;
    std::vector<uint16_t> col0;
    for (int M : {1, 5, 8, 9, 32}) {
        dense(xp, M, P[0], S[0], N, K, y1, 0);
        CK(cudaDeviceSynchronize());
        auto h = down_load<uint16_t>(y1, (size_t)M * N);
        if (col0.empty()) col0.assign(h.begin(), h.begin() + N);
        inv &= std::equal(col0.begin(), col0.end(), h.begin());
        if (M >= 5) rep &= std::equal(hy.begin(), hy.end(), h.begin());  // rows 0..4: the same bits as the M = 5 run
    }
    snprintf(msg, sizeof msg, "dense %dx%d: token 0's bits equal at M = 1, 5, 8, 9, 32 (batch-invariant)", N, K);
    check(inv, msg);
    snprintf(msg, sizeof msg, "dense %dx%d: rows 0..4 equal across runs and M = 5, 8, 9, 32", N, K);
    check(rep, msg);

    for (int pdl : {0, 1})
    for (int M : {1, 2, 4, 8, 16, 32}) {
        g_pdl = pdl;
        const double us = time_graph([&](int i, cudaStream_t st) { dense(xp, M, P[i % copies], S[i % copies], N, K, y, st); },
                                     copies * 4);
        const double gbps = (wbytes + sbytes) / (us * 1e-6) / 1e9;
        printf("BENCH dense N=%d K=%d M=%d pdl=%d: %.2f us, %.0f GB/s, %.0f%% of copy\n", N, K, M, pdl, us, gbps, 100 * gbps / copy);
    }
    for (int c = 0; c < copies; c++)
        for (void* q : {(void*)P[c], (void*)S[c]}) CK(cudaFree(q));
    for (void* q : {(void*)x, (void*)xp, (void*)y, (void*)y1}) CK(cudaFree(q));
}

// ---- the fixed-cost experiment: dense_multi_v5 over all rotated copies in one launch -----------------------

template <int NT>
static void launch_multi(const bf16* xp, int M, const uint8_t* const* P, const bf16* const* Sc, int R, int N, int K,
                         bf16* const* Y, int grid, cudaStream_t st) {
    const size_t smem = v5_smem(NT);
    static bool attr = false;
    if (!attr) {
        CK(cudaFuncSetAttribute(dense_multi_v5<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        attr = true;
    }
    launch(dense_multi_v5<NT>, dim3(grid), 32 * V5W, smem, st, xp, M, P, Sc, R, N, K, Y);
}

static void run_multi(int N, int K, double copy) {
    const size_t wbytes = (size_t)N * K / 2, sbytes = (size_t)N * (K / 32) * 2;
    const int R = (int)std::max<size_t>(4, (1024ull << 20) / (wbytes + sbytes));
    std::vector<uint8_t*> P(R);
    std::vector<bf16*> Sc(R), Y(R);
    for (int c = 0; c < R; c++) {
        P[c] = (uint8_t*)dalloc(wbytes);
        Sc[c] = (bf16*)dalloc(sbytes);
        Y[c] = (bf16*)dalloc((size_t)8 * N * 2);
        fill(P[c], wbytes, 300 + c);
        fillb(Sc[c], sbytes / 2, 400 + c, 0.002f, 0.02f);
    }
    const uint8_t** dP = (const uint8_t**)dalloc(R * sizeof(void*));
    const bf16** dS = (const bf16**)dalloc(R * sizeof(void*));
    bf16** dY = (bf16**)dalloc(R * sizeof(void*));
    CK(cudaMemcpy(dP, P.data(), R * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dS, Sc.data(), R * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dY, Y.data(), R * sizeof(void*), cudaMemcpyHostToDevice));
    bf16* x = (bf16*)dalloc((size_t)8 * K * 2);
    bf16* xp = (bf16*)dalloc((size_t)8 * K * 2);
    bf16* y1 = (bf16*)dalloc((size_t)8 * N * 2);
    fillb(x, (size_t)8 * K, 9, -1.f, 1.f);
    permute_x<<<(8 * K + 255) / 256, 256>>>(x, xp, 8, K);
    CK(cudaDeviceSynchronize());
    const int tiles = N / 16, sms = 132;
    char msg[256];
    for (int M : {1, 8}) {
        bool same = true;
        launch_multi<1>(xp, M, dP, dS, R, N, K, dY, std::min(tiles, 2 * sms), 0);
        CK(cudaDeviceSynchronize());
        for (int r = 0; r < R; r += std::max(1, R / 4)) {
            launch_dense_v5<1>(xp, M, P[r], Sc[r], N, K, y1, 0);
            CK(cudaDeviceSynchronize());
            same &= down_load<uint16_t>(Y[r], (size_t)M * N) == down_load<uint16_t>(y1, (size_t)M * N);
        }
        snprintf(msg, sizeof msg, "multi %dx%d M=%d: each matrix's output == dense_v5's, bit for bit (R = %d)", N, K, M, R);
        check(same, msg);
    }
    g_pdl = false;
    for (int grid : {tiles, sms, 2 * sms, 3 * sms}) {
        if (grid > tiles) continue;
        const double us = time_graph([&](int, cudaStream_t st) { launch_multi<1>(xp, 1, dP, dS, R, N, K, dY, grid, st); }, 1) / R;
        const double gbps = (wbytes + sbytes) / (us * 1e-6) / 1e9;
        printf("BENCH multi N=%d K=%d M=1 grid=%d: %d matrices in one launch, %.2f us a matrix, %.0f GB/s, %.0f%% of copy\n", N,
               K, grid, R, us, gbps, 100 * gbps / copy);
    }
    const double us1 = time_graph([&](int i, cudaStream_t st) { launch_dense_v5<1>(xp, 1, P[i % R], Sc[i % R], N, K, y1, st); }, R);
    printf("BENCH multi N=%d K=%d M=1: the same %d matrices as %d dense_v5 launches in a graph: %.2f us a matrix, %.0f%% of copy\n",
           N, K, R, R, us1, 100 * (wbytes + sbytes) / (us1 * 1e-6) / 1e9 / copy);
    for (int c = 0; c < R; c++)
        for (void* q : {(void*)P[c], (void*)Sc[c], (void*)Y[c]}) CK(cudaFree(q));
    for (void* q : {(void*)dP, (void*)dS, (void*)dY, (void*)x, (void*)xp, (void*)y1}) CK(cudaFree(q));
}

// ---- MoE -------------------------------------------------------------------------------------------------

// Splits by shape: the gate/up tiles of one token's top-k pairs (T = 1) set the gate/up split; the down kernel's
// CTA holds the top-k slots and splits each slot's K only when one CTA would hold fewer than 8 warps.
static void launch_gate_up(const bf16* xp, const int* ptok, const int* pexp, int pairs, int topk, const uint8_t* gp,
                           const bf16* gs, const uint8_t* upp, const bf16* us, int I, int K, bf16* hp, cudaStream_t st) {
    if (g_v4) {
        if ((K / KB) % 2) fprintf(stderr, "v4: K / 128 must be even (K %d)\n", K), exit(2);
        const size_t smem = v4_smem(2);
        static bool attr = false;
        if (!attr) {
            CK(cudaFuncSetAttribute(moe_gate_up_v4, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            attr = true;
        }
        launch(moe_gate_up_v4, dim3(I / 8, pairs), 32 * (1 + V4C), smem, st, xp, ptok, pexp, gp, gs, upp, us, I, K, hp);
        return;
    }
    if (g_v5) {
        if ((K / KB) % 2) fprintf(stderr, "v5: K / 128 must be even (K %d)\n", K), exit(2);
        const size_t smem = v5_smem(2);
        static bool attr = false;
        if (!attr) {
            CK(cudaFuncSetAttribute(moe_gate_up_v5, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            attr = true;
        }
        launch(moe_gate_up_v5, dim3(I / 8, pairs), 32 * V5W, smem, st, xp, ptok, pexp, gp, gs, upp, us, I, K, hp);
        return;
    }
    const int nbt = K / KB, bpw = blocks_per_warp(I / 8 * topk, nbt), KS = (nbt + bpw - 1) / bpw;
    launch(moe_gate_up<S>, dim3(I / 8, pairs), KS * 32, (size_t)KS * 16 * sizeof(float), st, xp, ptok, pexp, gp, gs, upp,
           us, I, K, bpw, hp);
}
static void launch_down(const bf16* hp, const int* pexp, const float* pw, int T, int topk, const uint8_t* dp,
                        const bf16* ds, int H, int I, float* y, cudaStream_t st) {
    const int nbt = I / KB, bpw = blocks_per_warp(H / 16 * topk, nbt, std::max(1, 8 / topk)), KS = (nbt + bpw - 1) / bpw;
    launch(moe_down_combine<S>, dim3(H / 16, T), topk * KS * 32, (size_t)topk * KS * 16 * sizeof(float), st, hp, pexp,
           pw, topk, KS, bpw, dp, ds, H, I, y);
}

struct Moe {
    int E, H, I;
    uint8_t *g, *u, *d;
    bf16 *gs, *us, *ds;
};

static void moe_step(const Moe& w, const bf16* xp, const int* ptok, const int* pexp, const float* pw, int T, int topk,
                     bf16* hp, float* y, cudaStream_t st) {
    launch_gate_up(xp, ptok, pexp, T * topk, topk, w.g, w.gs, w.u, w.us, w.I, w.H, hp, st);
    launch_down(hp, pexp, pw, T, topk, w.d, w.ds, w.H, w.I, y, st);
}

static void run_moe(const char* name, int E, int H, int I, double copy, bool quick) {
    const int topk = 8, TMAX = 8;
    Moe w{E, H, I};
    const size_t gu_b = (size_t)E * I * H / 2, gu_s = (size_t)E * I * (H / 32), d_b = (size_t)E * H * I / 2,
                 d_s = (size_t)E * H * (I / 32);
    w.g = (uint8_t*)dalloc(gu_b), w.u = (uint8_t*)dalloc(gu_b), w.d = (uint8_t*)dalloc(d_b);
    w.gs = (bf16*)dalloc(gu_s * 2), w.us = (bf16*)dalloc(gu_s * 2), w.ds = (bf16*)dalloc(d_s * 2);
    fill(w.g, gu_b, 11), fill(w.u, gu_b, 12), fill(w.d, d_b, 13);
    fillb(w.gs, gu_s, 14, 0.002f, 0.02f), fillb(w.us, gu_s, 15, 0.002f, 0.02f), fillb(w.ds, d_s, 16, 0.002f, 0.02f);
    // Routing sets: set r gives token t the experts (r * 8 * TMAX + t * 8 + s) mod E, weights 1/(s + 2).
    const int sets = std::max(1, E / topk);
    std::vector<int> htok, hexp;
    std::vector<float> hw;
    for (int r = 0; r < sets; r++)
        for (int t = 0; t < TMAX; t++)
            for (int s = 0; s < topk; s++) {
                htok.push_back(t);
                hexp.push_back((r * topk * TMAX + t * topk + s * 7) % E);
                hw.push_back(1.0f / (s + 2));
            }
    int *ptok = (int*)dalloc(htok.size() * 4), *pexp = (int*)dalloc(hexp.size() * 4);
    float* pw = (float*)dalloc(hw.size() * 4);
    CK(cudaMemcpy(ptok, htok.data(), htok.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pexp, hexp.data(), hexp.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pw, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    bf16* x = (bf16*)dalloc((size_t)TMAX * H * 2);
    bf16* xp = (bf16*)dalloc((size_t)TMAX * H * 2);
    bf16* hp = (bf16*)dalloc((size_t)TMAX * topk * I * 2);
    float* y = (float*)dalloc((size_t)TMAX * H * 4);
    fillb(x, (size_t)TMAX * H, 21, -1.f, 1.f);
    permute_x<<<(TMAX * H + 255) / 256, 256>>>(x, xp, TMAX, H);
    CK(cudaDeviceSynchronize());

    // Checks on routing set 0: h against f64 (gate, up rounded to bf16 as the engine's GEMM outputs are), y
    // against the f64 combine of the GPU's own h; then token 0's bits at T = 1 and T = 8, and two runs equal.
    const int T = 4;
    moe_step(w, xp, ptok, pexp, pw, T, topk, hp, y, 0);
    CK(cudaDeviceSynchronize());
    auto hh = down_load<uint16_t>(hp, (size_t)T * topk * I);
    auto hy = down_load<float>(y, (size_t)T * H);
    auto hx = down_load<uint16_t>(x, (size_t)T * H);
    double herr = 0, href = 0, yerr = 0, yref = 0;
    {
        std::vector<uint8_t> pg((size_t)I * H / 2), pu((size_t)I * H / 2), pd((size_t)H * I / 2);
        std::vector<uint16_t> sg((size_t)I * H / 32), su((size_t)I * H / 32), sd((size_t)H * I / 32);
        for (int p = 0; p < T * topk; p++) {
            const size_t e = hexp[p];
            CK(cudaMemcpy(pg.data(), w.g + e * pg.size(), pg.size(), cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(pu.data(), w.u + e * pu.size(), pu.size(), cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(sg.data(), w.gs + e * sg.size(), sg.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(su.data(), w.us + e * su.size(), su.size() * 2, cudaMemcpyDeviceToHost));
            for (int j = 0; j < I; j += (quick ? 3 : 1)) {
                const double gv = bf2f(f2bf((float)ref_dot(pg.data(), sg.data(), j, H, hx.data() + (size_t)htok[p] * H)));
                const double uv = bf2f(f2bf((float)ref_dot(pu.data(), su.data(), j, H, hx.data() + (size_t)htok[p] * H)));
                const double h = gv / (1 + std::exp(-gv)) * uv;
                herr = std::max(herr, std::fabs(h - bf2f(hh[(size_t)p * I + perm_pos(j)])));
                href = std::max(href, std::fabs(h));
            }
        }
        for (int tok = 0; tok < T; tok++) {
            std::vector<double> acc(H, 0.0);
            for (int s = 0; s < topk; s++) {
                const int p = tok * topk + s;
                const size_t e = hexp[p];
                CK(cudaMemcpy(pd.data(), w.d + e * pd.size(), pd.size(), cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(sd.data(), w.ds + e * sd.size(), sd.size() * 2, cudaMemcpyDeviceToHost));
                std::vector<uint16_t> h(I);
                for (int j = 0; j < I; j++) h[j] = hh[(size_t)p * I + perm_pos(j)];
                for (int n = 0; n < H; n += (quick ? 5 : 1)) acc[n] += hw[p] * ref_dot(pd.data(), sd.data(), n, I, h.data());
            }
            for (int n = 0; n < H; n += (quick ? 5 : 1)) {
                yerr = std::max(yerr, std::fabs(acc[n] - hy[(size_t)tok * H + n]));
                yref = std::max(yref, std::fabs(acc[n]));
            }
        }
    }
    char msg[256];
    snprintf(msg, sizeof msg, "moe %s T=%d: silu(gate)*up vs f64: max err %.3g of %.3g (rel %.2e <= 1e-2)", name, T, herr,
             href, herr / href);
    check(herr / href <= 1e-2, msg);
    snprintf(msg, sizeof msg, "moe %s T=%d: combined down vs f64 of the GPU's h: max err %.3g of %.3g (rel %.2e <= 1e-2)",
             name, T, yerr, yref, yerr / yref);
    check(yerr / yref <= 1e-2, msg);
    bool inv = true;
    for (int TT : {1, 2, 8, 4}) {
        moe_step(w, xp, ptok, pexp, pw, TT, topk, hp, y, 0);
        CK(cudaDeviceSynchronize());
        auto h2 = down_load<float>(y, (size_t)TT * H);
        const size_t n = (size_t)std::min(TT, T) * H;
        inv &= memcmp(h2.data(), hy.data(), n * 4) == 0;
    }
    snprintf(msg, sizeof msg, "moe %s: each token's bits equal at T = 1, 2, 4, 8 and across runs", name);
    check(inv, msg);

    for (int pdl : {0, 1})
    for (int TT : {1, 2, 4, 8}) {
        g_pdl = pdl;
        // Distinct experts touched per call (the bytes a call must read).
        const int calls = sets * 2;
        double bytes = 0;
        {
            std::vector<char> seen(E);
            for (int t = 0; t < TT * topk; t++) seen[hexp[t]] = 1;
            const double per_e = (double)(2 * gu_b + d_b + 2 * (2 * gu_s + d_s)) / E;
            bytes = per_e * std::count(seen.begin(), seen.end(), 1);
        }
        const double us = time_graph(
            [&](int i, cudaStream_t st) {
                const int r = i % sets;
                const size_t o = (size_t)r * TMAX * topk;
                moe_step(w, xp, ptok + o, pexp + o, pw + o, TT, topk, hp, y, st);
            },
            calls);
        const double gbps = bytes / (us * 1e-6) / 1e9;
        printf("BENCH moe %s pdl=%d T=%d (%d pairs): %.2f us for both kernels, %.1f MB of distinct experts, %.0f GB/s, %.0f%% of copy\n",
               name, pdl, TT, TT * topk, us, bytes / 1e6, gbps, 100 * gbps / copy);
    }
    // Each kernel alone at T = 1.
    for (int pdl : {0, 1}) {
        g_pdl = pdl;
        const int calls = sets * 2;
        const double us1 = time_graph(
            [&](int i, cudaStream_t st) {
                const size_t o = (size_t)(i % sets) * TMAX * topk;
                launch_gate_up(xp, ptok + o, pexp + o, topk, topk, w.g, w.gs, w.u, w.us, w.I, w.H, hp, st);
            },
            calls);
        const double us2 = time_graph(
            [&](int i, cudaStream_t st) {
                const size_t o = (size_t)(i % sets) * TMAX * topk;
                launch_down(hp, pexp + o, pw + o, 1, topk, w.d, w.ds, w.H, w.I, y, st);
            },
            calls);
        const double b1 = 8.0 * (2 * gu_b + 2 * 2 * gu_s) / E, b2 = 8.0 * (d_b + 2 * d_s) / E;
        printf("BENCH moe %s pdl=%d T=1 gate_up alone: %.2f us, %.0f%% of copy; down+combine alone: %.2f us, %.0f%% of copy\n", name, pdl,
               us1, 100 * b1 / (us1 * 1e-6) / 1e9 / copy, us2, 100 * b2 / (us2 * 1e-6) / 1e9 / copy);
    }
    for (void* q : {(void*)w.g, (void*)w.u, (void*)w.d, (void*)w.gs, (void*)w.us, (void*)w.ds, (void*)ptok, (void*)pexp,
                    (void*)pw, (void*)x, (void*)xp, (void*)hp, (void*)y})
        CK(cudaFree(q));
}

int main(int argc, char** argv) {
    bool quick = false, multi = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--warps") && i + 1 < argc) g_warps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--v4")) g_v4 = true;
        else if (!strcmp(argv[i], "--v5")) g_v5 = true;
        else if (!strcmp(argv[i], "--multi")) multi = true;
        else { fprintf(stderr, "usage: %s [--quick] [--warps N] [--v4 | --v5 | --multi]\n", argv[0]); return 2; }
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const double copy = copy_gbps();
    printf("GPU %s, %d SMs; device copy %.0f GB/s (read + write of 1 GiB); ring %d blocks, L2 prefetch %d ahead, >= %d CTAs "
           "an SM, target %d warps a launch; v4 %s (ring %d stages, %d consumer warps); v5 %s (%d stages of %d blocks)\n",
           prop.name, prop.multiProcessorCount, copy, S, PF, MINB, g_warps, g_v4 ? "on" : "off", V4R, V4C,
           g_v5 ? "on" : "off", V5S, V5B);
    // The K2.6 expert shapes (gate+up rows 2 x 2048, down 7168 x 2048) and their TP8 slices.
    if (multi) {  // the fixed-cost experiment alone
        for (auto s : {std::make_pair(4096, 7168), std::make_pair(7168, 2048), std::make_pair(512, 7168)})
            run_multi(s.first, s.second, copy);
        printf("RESULT %s: %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
        return failures ? 1 : 0;
    }
    const int shapes[][2] = {{4096, 7168}, {7168, 2048}, {512, 7168}, {7168, 256}};
    for (auto& s : shapes) run_dense(s[0], s[1], copy, quick);
    // A K2.6 MoE layer on one rank: TP8 (384 experts, each sliced to I = 256) and EP8 (48 whole experts).
    run_moe("tp8 E=384 I=256", 384, 7168, 256, copy, quick);
    run_moe("ep8 E=48 I=2048", 48, 7168, 2048, copy, quick);
    printf("RESULT %s: %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
