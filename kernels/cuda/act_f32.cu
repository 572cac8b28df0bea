// The f32 activation ops of the CUDA backend (engine/src/cuda/backend.rs): the model keeps its residual
// stream and activations in f32 like the CPU reference, and rounds to bf16 only where a bf16 kernel or a
// tensor-core GEMM reads them. One family per file: conversions, add, SwiGLU, RMSNorm over strided rows,
// RoPE from a host cos/sin table (interleaved or NeoX, the very cos/sin values of the CPU twin), strided
// row copies. CPU twins: cpu::ops::{add_assign, silu_mul, rms_norm, rope_interleaved, rope_neox}.
// Test: engine/tests/cuda_target.rs (the whole forward against the CPU backend). Wrappers:
// engine/src/cuda/ops/act_f32.rs.
#include "common.cuh"

// dst[i] = bf16(src[i]) / f32(src[i]); grid-stride over n.
extern "C" __global__ void kdtree_f32_to_bf16(const float* __restrict__ src, bf16* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}
extern "C" __global__ void kdtree_bf16_to_f32(const bf16* __restrict__ src, float* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

// acc[i] += x[i] (f32).
extern "C" __global__ void kdtree_add_f32(float* __restrict__ acc, const float* __restrict__ x, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc[i] += x[i];
}

// out = silu(gate) * up with silu(z) = z / (1 + e^-z) (f32, as the twin). Element (r, c) of `rows` x `width`:
// gate[r * ld_g + c], up[r * ld_u + c] (the gate and up blocks of one [gate | up] linear's rows; ld = width when
// they are apart), out[r * width + c].
extern "C" __global__ void kdtree_silu_mul_f32(const float* __restrict__ gate, long long ld_g, const float* __restrict__ up,
                                               long long ld_u, float* __restrict__ out, long long rows, long long width) {
    const long long n = rows * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width, c = i - r * width;
        const float g = gate[r * ld_g + c];
        out[i] = g * (1.0f / (1.0f + expf(-g))) * up[r * ld_u + c];
    }
}
// The same value rounded once to bf16 (the bits of kdtree_silu_mul_f32 then kdtree_f32_to_bf16): a SwiGLU whose
// output only feeds the down projection's bf16 GEMM. Elements as kdtree_silu_mul_f32's.
extern "C" __global__ void kdtree_silu_mul_f32_bf16(const float* __restrict__ gate, long long ld_g, const float* __restrict__ up,
                                                long long ld_u, bf16* __restrict__ out, long long rows, long long width) {
    const long long n = rows * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width, c = i - r * width;
        const float g = gate[r * ld_g + c];
        const float v = g * (1.0f / (1.0f + expf(-g))) * up[r * ld_u + c];
        out[i] = __float2bfloat16_rn(v);
    }
}

// y[r, :D] = w * (x[r, :D] * rsqrt(mean(x²) + eps)) for each row r; rows ld_x / ld_y apart; w [D] bf16.
// One block per row, blockDim.x a multiple of 32 (the wrapper sizes it to the row). When D % 4 == 0, the rows
// are 16-byte aligned and D / 4 <= RMS_VEC * blockDim.x, each thread loads its float4s at once and keeps
// them in registers for the scaling (one read of x, every load in flight together: a decode step's single
// row is one block, so the loads must not wait on each other); otherwise the plain strided loop.
// ADD: x[r] += a[r] first (written back, as kdtree_add_f32 adds), then the norm of the sum; BF16: y is bf16, the
// f32 value rounded once (as kdtree_f32_to_bf16 rounds it). The same threads and order in every form, so the
// fused forms give the bits of the separate kernels.
constexpr int RMS_VEC = 8;
template <bool ADD, typename Y>
__device__ __forceinline__ void rms_norm_row(float* __restrict__ x, int ld_x, const float* __restrict__ a, int ld_a,
                                             const bf16* __restrict__ w, Y* __restrict__ y, int ld_y, int D, float eps) {
    __shared__ float scratch[32];
    float* xr = x + (size_t)blockIdx.x * ld_x;
    const float* ar = ADD ? a + (size_t)blockIdx.x * ld_a : nullptr;
    Y* yr = y + (size_t)blockIdx.x * ld_y;
    const int n4 = D / 4;
    const auto store4 = [&](int i, float4 f) {
        if constexpr (sizeof(Y) == 4) {
            reinterpret_cast<float4*>(yr)[i] = f;
        } else {
            const bf162 lo = __floats2bfloat162_rn(f.x, f.y), hi = __floats2bfloat162_rn(f.z, f.w);
            uint2 u;
            u.x = *reinterpret_cast<const uint32_t*>(&lo);
            u.y = *reinterpret_cast<const uint32_t*>(&hi);
            reinterpret_cast<uint2*>(yr)[i] = u;
        }
    };
    const bool vec = D % 4 == 0 && kdtree::aligned16(xr) && (!ADD || kdtree::aligned16(ar)) && kdtree::aligned16(yr) &&
                     kdtree::aligned16(w) && n4 <= RMS_VEC * (int)blockDim.x;
    if (vec) {
        // Every load of x and a first, then the sums and stores: with the store of x + a between them the
        // compiler issued each j's loads only after the last store, 2 RMS_VEC dependent trips to memory (~9 us a
        // 7,168-wide row, ncu run 92); the weight's loads likewise all at once after the sum. At most 64
        // registers (launch bounds): the wrapper takes up to 1024 threads a row.
        float4 v[RMS_VEC], av[RMS_VEC];
#pragma unroll
        for (int j = 0; j < RMS_VEC; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            const bool in = i < n4;
            v[j] = in ? reinterpret_cast<const float4*>(xr)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            if (ADD) av[j] = in ? __ldg(reinterpret_cast<const float4*>(ar) + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if (ADD) {
#pragma unroll
            for (int j = 0; j < RMS_VEC; j++) {
                const int i = threadIdx.x + j * blockDim.x;
                v[j].x += av[j].x;
                v[j].y += av[j].y;
                v[j].z += av[j].z;
                v[j].w += av[j].w;
                if (i < n4) reinterpret_cast<float4*>(xr)[i] = v[j];
            }
        }
        // The sum of squares with explicit roundings (no contraction left to the compiler), so that every form
        // of the kernel sums the same way.
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < RMS_VEC; j++) {
            float q = __fmul_rn(v[j].x, v[j].x);
            q = __fmaf_rn(v[j].y, v[j].y, q);
            q = __fmaf_rn(v[j].z, v[j].z, q);
            q = __fmaf_rn(v[j].w, v[j].w, q);
            ss = __fadd_rn(ss, q);
        }
        ss = kdtree::block_sum(ss, scratch);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        uint2 wb[RMS_VEC];  // all the weight loads in flight together, then the stores
#pragma unroll
        for (int j = 0; j < RMS_VEC; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            wb[j] = i < n4 ? __ldg(reinterpret_cast<const uint2*>(w) + i) : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < RMS_VEC; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i >= n4) continue;
            const float2 w01 = __bfloat1622float2(*reinterpret_cast<const bf162*>(&wb[j].x));
            const float2 w23 = __bfloat1622float2(*reinterpret_cast<const bf162*>(&wb[j].y));
            store4(i, make_float4(w01.x * (v[j].x * r), w01.y * (v[j].y * r), w23.x * (v[j].z * r), w23.y * (v[j].w * r)));
        }
        return;
    }
    if (ADD) {
        for (int i = threadIdx.x; i < D; i += blockDim.x) xr[i] += ar[i];
        __syncthreads();  // (each thread reads back only what it wrote; kept for clarity of the two phases)
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss = __fmaf_rn(xr[i], xr[i], ss);
    ss = kdtree::block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float f = __bfloat162float(w[i]) * (xr[i] * r);
        if constexpr (sizeof(Y) == 4) {
            yr[i] = f;
        } else {
            yr[i] = __float2bfloat16_rn(f);
        }
    }
}
extern "C" __global__ void __launch_bounds__(1024) kdtree_rms_norm_f32(const float* __restrict__ x, int ld_x, const bf16* __restrict__ w, float* __restrict__ y,
                                               int ld_y, int D, float eps) {
    rms_norm_row<false, float>(const_cast<float*>(x), ld_x, nullptr, 0, w, y, ld_y, D, eps);
}
// x += a (if a is not null), then y = bf16(rms_norm(x)): the bits of kdtree_add_f32, kdtree_rms_norm_f32 and
// kdtree_f32_to_bf16 in one launch (the residual add and the next norm of a decoder layer, its output the
// linears' bf16 input).
extern "C" __global__ void __launch_bounds__(1024) kdtree_add_rms_norm_bf16(float* __restrict__ x, int ld_x, const float* __restrict__ a, int ld_a,
                                                    const bf16* __restrict__ w, bf16* __restrict__ y, int ld_y, int D,
                                                    float eps) {
    if (a)
        rms_norm_row<true, bf16>(x, ld_x, a, ld_a, w, y, ld_y, D, eps);
    else
        rms_norm_row<false, bf16>(x, ld_x, nullptr, 0, w, y, ld_y, D, eps);
}

// The latent cache rows of T new tokens in one launch (kv_append_latent): row *row0 + t of dst [cap, w] bf16 =
// bf16(rms_norm(ckv[t, :C]) with `weight`) | bf16(interleaved RoPE of ckv[t, C:w] from the table row t): the bits of
// kdtree_rms_norm_f32, kdtree_rope_table_f32 and kdtree_store_rows_bf16 on a copy of ckv (the same threads, sums
// and roundings; the wrapper takes it when w % 8 == 0, so that the norm takes the same register path as the f32
// one). ckv's rows are ld apart (the kv_a block of a stacked [q_a | kv_a] linear; ld = w alone). One block a
// token (blockDim as the norm's wrapper sizes it), then the rope pairs.
extern "C" __global__ void __launch_bounds__(1024) kdtree_kv_latent_rows_bf16(const float* __restrict__ ckv, int ld, int w, int C,
                                                                               const bf16* __restrict__ weight, float eps,
                                                                               const float* __restrict__ cos_t,
                                                                               const float* __restrict__ sin_t,
                                                                               bf16* __restrict__ dst, const int* __restrict__ row0) {
    bf16* y = dst + (size_t)row0[0] * w;
    rms_norm_row<false, bf16>(const_cast<float*>(ckv), ld, nullptr, 0, weight, y, w, C, eps);
    const int t = blockIdx.x, half = (w - C) / 2;
    const float* v = ckv + (size_t)t * ld + C;
    bf16* o = y + (size_t)t * w + C;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = cos_t[(size_t)t * half + i], s = sin_t[(size_t)t * half + i];
        const float a = v[2 * i], b = v[2 * i + 1];
        o[2 * i] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
        o[2 * i + 1] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
    }
}

// RoPE in place on x (f32) from a cos/sin table [T, D/2] (row t for token t): element (t, h, d) at
// x[t * ld_token + h * ld_head + offset + d]. neox = 0: pairs (2i, 2i+1) (interleaved, GPT-J); neox = 1:
// pairs (i, i + D/2) (rotate_half). Separately rounded multiplies and adds, like the twin.
// grid (ceil(heads * D/2 / blockDim.x), T).
extern "C" __global__ void kdtree_rope_table_f32(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                 int heads, int ld_token, int ld_head, int offset, int D, int neox) {
    const int half = D / 2, t = blockIdx.y;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= heads * half) return;
    const int h = p / half, i = p % half;
    const float c = cos_t[(size_t)t * half + i], s = sin_t[(size_t)t * half + i];
    float* v = x + (size_t)t * ld_token + (size_t)h * ld_head + offset;
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float a = v[ia], b = v[ib];
    v[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// dst[r * ld_dst + c] = src[r * ld_src + c] (f32), r < rows, c < width. grid (ceil(width / 256), rows).
extern "C" __global__ void kdtree_copy_rows_f32(const float* __restrict__ src, int ld_src, float* __restrict__ dst, int ld_dst, int rows,
                                                int width) {
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && c < width) dst[(size_t)r * ld_dst + c] = src[(size_t)r * ld_src + c];
}
