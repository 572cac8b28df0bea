// The DDTree round's position state on the device (issue 9, one CUDA graph per round): the small ops that
// read or advance the committed-length counters, so a captured round replays at any position.
// - pos_add: counter += n (an eager commit of n rows); pos_add_segs: a batch's counters in one launch.
// - round_advance: after the walk, target counter += len, drafter context counter += len, root = bonus;
//   round_advance_segs: a batch's in one launch.
// - rope_at: cos/sin of positions *base + offset[i] (or *base + i), the CPU's rope_cos_sin: angle
//   (float)pos * inv_freq in f32, cos/sin in f64, times the attention factor, rounded to f32.
// - store_rows: rows [*row0, *row0 + n) of a [cap, w] buffer = src [n, w] (f32 -> bf16 for the latent cache,
//   f32 -> f32 for the drafter's context K/V); store_rows_seg: a batch's, each segment at its own counter.
// - rope_at_segs: a batch's rope_at tables stacked, each segment at its own base and offsets, in one launch.
// - ids_blocks: a batch's draft blocks, [root, fill x (block - 1)] per sequence, each root read on the device.
// - stash_rows_seg: a feed step's row per sequence into that sequence's drafter stash at its counter, counter
//   += 1 (the taps whose context rows the drafter writes before its next draft).
// - path_rows: out[i] = x[path[i]] for i < len of the walk, zero rows up to `rows_out`; path_rows_segs: a
//   batch's walks, each into its own rows_out rows of one output.
// - copy_segs_u32: a batch's small copies (token ids, result words) into one buffer, in one launch.
// CPU twins: engine backend.rs RopeTable / cpu::ops::rope_cos_sin, cpu backend write_rows_at, stash_rows,
// ids_blocks, tree_path_rows, tree_commit (the batch forms: the backend trait's per-segment defaults). Wrappers: engine/src/cuda/ops/round_state.rs. Tests: engine/tests/cuda_ops.rs
// (rope_at, store_rows, stash_rows_seg, path_rows, and the batch forms), engine/tests/cuda_round.rs (the captured round).
#include "common.cuh"

// pos [1] += n. One thread.
extern "C" __global__ void kdtree_pos_add(int* __restrict__ pos, int n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) pos[0] += n;
}

// A batch's counters: *pos[s] += n for each s < nseg. One block, a thread per counter.
constexpr int POS_SEGS = 64;
struct PosSegs {
    unsigned long long pos[POS_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_pos_add_segs(const PosSegs segs, int n) {
    const int s = threadIdx.x;
    if (blockIdx.x == 0 && s < segs.nseg) reinterpret_cast<int*>(segs.pos[s])[0] += n;
}

// walk_out = [len, path[m], decisions[m]] (ddtree_walk). kv_pos and ctx_pos [1] += len; root [1] = the
// walk's last decision (the bonus token, the next round's root). One thread; ctx_pos may be null.
extern "C" __global__ void kdtree_round_advance(const int* __restrict__ walk_out, int m, int* __restrict__ kv_pos,
                                                int* __restrict__ ctx_pos, unsigned* __restrict__ root) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const int len = walk_out[0];
    kv_pos[0] += len;
    if (ctx_pos) ctx_pos[0] += len;
    root[0] = (unsigned)walk_out[1 + m + len - 1];
}

// cos, sin [t, half] f32; inv_freq [half] f32; base [1]; offsets [t] u32 or null. grid (t), block >= 32.
extern "C" __global__ void kdtree_rope_at_f32(const float* __restrict__ inv_freq, int half, double factor,
                                              const int* __restrict__ base, const unsigned* __restrict__ offsets, int t,
                                              float* __restrict__ cos_out, float* __restrict__ sin_out) {
    const int i = blockIdx.x;
    if (i >= t) return;
    const long long pos = (long long)base[0] + (offsets ? (long long)offsets[i] : (long long)i);
    const float p = (float)pos;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const double a = (double)__fmul_rn(p, inv_freq[j]);
        cos_out[(size_t)i * half + j] = (float)(cos(a) * factor);
        sin_out[(size_t)i * half + j] = (float)(sin(a) * factor);
    }
}

// dst [cap, w] bf16 (one layer); rows [*row0, *row0 + n) = src [n, w] f32 rounded to bf16. grid-stride.
extern "C" __global__ void kdtree_store_rows_bf16(bf16* __restrict__ dst, int w, const int* __restrict__ row0,
                                                  const float* __restrict__ src, int n) {
    const size_t at = (size_t)row0[0] * w, total = (size_t)n * w;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x)
        dst[at + k] = __float2bfloat16_rn(src[k]);
}

// A batch's stores in one launch, by value: segment s writes src rows [row0[s], row0[s + 1]) (f32, [.., w]) to
// rows [*pos[s], ...) of its cache layer dst[s] ([cap, w] bf16), rounded. grid (x, nseg), grid-stride in x.
constexpr int STORE_SEGS = 64;
struct StoreSegs {
    unsigned long long dst[STORE_SEGS], pos[STORE_SEGS];
    int row0[STORE_SEGS + 1];
    int nseg;
};
__device__ __forceinline__ void store_elem(bf16* d, float v) { *d = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_elem(float* d, float v) { *d = v; }
template <typename T>
__device__ __forceinline__ void store_rows_seg(const StoreSegs& segs, int w, const float* __restrict__ src) {
    const int s = blockIdx.y;
    if (s >= segs.nseg) return;
    T* dst = reinterpret_cast<T*>(segs.dst[s]);
    const size_t at = (size_t)reinterpret_cast<const int*>(segs.pos[s])[0] * w, from = (size_t)segs.row0[s] * w;
    const size_t total = (size_t)(segs.row0[s + 1] - segs.row0[s]) * w;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x)
        store_elem(dst + at + k, src[from + k]);
}
extern "C" __global__ void kdtree_store_rows_seg_bf16(const StoreSegs segs, int w, const float* __restrict__ src) {
    store_rows_seg<bf16>(segs, w, src);
}
// The same into f32 row caches (the drafter's context K/V of a batch): copied, not rounded.
extern "C" __global__ void kdtree_store_rows_seg_f32(const StoreSegs segs, int w, const float* __restrict__ src) {
    store_rows_seg<float>(segs, w, src);
}

// A batch's RoPE tables in one launch: segment s's rows [row0[s], row0[s + 1]) of cos/sin ([rows, half] f32)
// are kdtree_rope_at_f32's of its base (*base[s]) and offsets (offsets[s], or 0: row i at base + i).
// grid (most rows of a segment, nseg), block >= 32.
constexpr int ROPE_SEGS = 64;
struct RopeSegs {
    unsigned long long base[ROPE_SEGS], offsets[ROPE_SEGS];
    int row0[ROPE_SEGS + 1];
    int nseg;
};
extern "C" __global__ void kdtree_rope_at_segs_f32(const RopeSegs segs, const float* __restrict__ inv_freq, int half,
                                                   double factor, float* __restrict__ cos_out,
                                                   float* __restrict__ sin_out) {
    const int s = blockIdx.y, i = blockIdx.x;
    if (s >= segs.nseg || i >= segs.row0[s + 1] - segs.row0[s]) return;
    const unsigned* off = reinterpret_cast<const unsigned*>(segs.offsets[s]);
    const long long pos = (long long)reinterpret_cast<const int*>(segs.base[s])[0] + (off ? (long long)off[i] : (long long)i);
    const float p = (float)pos;
    const size_t row = (size_t)segs.row0[s] + i;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const double a = (double)__fmul_rn(p, inv_freq[j]);
        cos_out[row * half + j] = (float)(cos(a) * factor);
        sin_out[row * half + j] = (float)(sin(a) * factor);
    }
}

// A batch's draft blocks: dst[s*block] = *root[s], dst[s*block + 1 .. (s+1)*block] = fill. grid (nseg),
// block >= 32.
constexpr int BLOCK_SEGS = 64;
struct BlockRoots {
    unsigned long long root[BLOCK_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_ids_blocks(const BlockRoots roots, unsigned* __restrict__ dst, int block,
                                             unsigned fill) {
    const int s = blockIdx.x;
    if (s >= roots.nseg) return;
    unsigned* d = dst + (size_t)s * block;
    for (int i = threadIdx.x; i < block; i += blockDim.x)
        d[i] = i == 0 ? reinterpret_cast<const unsigned*>(roots.root[s])[0] : fill;
}

// A batch's feed step: row s of src [nseg, w] f32 into row *pos[s] of stash s ([cap, w] f32), then
// *pos[s] += 1. One block a segment: every thread reads the count before thread 0 moves it.
constexpr int STASH_SEGS = 64;
struct StashSegs {
    unsigned long long dst[STASH_SEGS], pos[STASH_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_stash_rows_seg_f32(const StashSegs segs, int w, const float* __restrict__ src) {
    const int s = blockIdx.x;
    if (s >= segs.nseg) return;
    int* pos = reinterpret_cast<int*>(segs.pos[s]);
    const int at = pos[0];
    float* dst = reinterpret_cast<float*>(segs.dst[s]) + (size_t)at * w;
    const float* row = src + (size_t)s * w;
    for (int k = threadIdx.x; k < w; k += blockDim.x) dst[k] = row[k];
    __syncthreads();
    if (threadIdx.x == 0) pos[0] = at + 1;
}

// dst [cap, w] f32; rows [*row0, *row0 + n) = src [n, w]. grid-stride.
extern "C" __global__ void kdtree_store_rows_f32(float* __restrict__ dst, int w, const int* __restrict__ row0,
                                                 const float* __restrict__ src, int n) {
    const size_t at = (size_t)row0[0] * w, total = (size_t)n * w;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x)
        dst[at + k] = src[k];
}

// x [N, cols] f32; walk_out = [len, path[m], ...]; out [rows_out, cols]: row i = x[path[i]] for i < len,
// zeros after. grid (rows_out), grid-stride over the columns.
extern "C" __global__ void kdtree_path_rows_f32(const float* __restrict__ x, int cols, const int* __restrict__ walk_out,
                                                int rows_out, float* __restrict__ out) {
    const int i = blockIdx.x;
    if (i >= rows_out) return;
    const int len = walk_out[0];
    float* o = out + (size_t)i * cols;
    if (i < len) {
        const float* r = x + (size_t)walk_out[1 + i] * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = r[c];
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = 0.f;
    }
}

// A batch's walked-path rows: segment s's rows [s*rows_out, (s+1)*rows_out) of out ([nseg*rows_out, cols] f32)
// are kdtree_path_rows_f32's of its walk (walk_out[s] = [len, path...]) over rows row0[s] + path[i] of x.
// grid (rows_out, nseg), grid-stride over the columns.
constexpr int PATH_SEGS = 64;
struct PathSegs {
    unsigned long long walk_out[PATH_SEGS];
    int row0[PATH_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_path_rows_segs_f32(const PathSegs segs, const float* __restrict__ x, int cols,
                                                     int rows_out, float* __restrict__ out) {
    const int i = blockIdx.x, s = blockIdx.y;
    if (s >= segs.nseg || i >= rows_out) return;
    const int* walk = reinterpret_cast<const int*>(segs.walk_out[s]);
    const int len = walk[0];
    float* o = out + ((size_t)s * rows_out + i) * cols;
    if (i < len) {
        const float* r = x + ((size_t)segs.row0[s] + walk[1 + i]) * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = r[c];
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = 0.f;
    }
}

// A batch's small copies in one launch: dst[at[s] .. at[s] + n[s]) = src[s][0 .. n[s]) (32-bit words: token ids,
// a round's result words). grid (nseg), block 128.
constexpr int COPY_SEGS = 64;
struct CopySegs {
    unsigned long long src[COPY_SEGS];
    int n[COPY_SEGS], at[COPY_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_copy_segs_u32(const CopySegs segs, unsigned* __restrict__ dst) {
    const int s = blockIdx.x;
    if (s >= segs.nseg) return;
    const unsigned* src = reinterpret_cast<const unsigned*>(segs.src[s]);
    unsigned* d = dst + segs.at[s];
    for (int i = threadIdx.x; i < segs.n[s]; i += blockDim.x) d[i] = src[i];
}

// A batch's advances after its walks (after every cache's compaction, which reads the counters): segment s's
// kdtree_round_advance (kv_pos[s] and ctx_pos[s] += len, root[s] = the bonus) from walk[s]. One block, a thread
// per segment.
constexpr int ADVANCE_SEGS = 64;
struct AdvanceSegs {
    unsigned long long walk[ADVANCE_SEGS], kv_pos[ADVANCE_SEGS], ctx_pos[ADVANCE_SEGS], root[ADVANCE_SEGS];
    int nseg;
};
extern "C" __global__ void kdtree_round_advance_segs(const AdvanceSegs segs, int m) {
    const int s = threadIdx.x;
    if (blockIdx.x != 0 || s >= segs.nseg) return;
    const int* walk = reinterpret_cast<const int*>(segs.walk[s]);
    const int len = walk[0];
    reinterpret_cast<int*>(segs.kv_pos[s])[0] += len;
    reinterpret_cast<int*>(segs.ctx_pos[s])[0] += len;
    reinterpret_cast<unsigned*>(segs.root[s])[0] = (unsigned)walk[1 + m + len - 1];
}
