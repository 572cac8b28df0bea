//! MoE align wrapper for kernels/cuda/moe_align.cu: groups (token, slot) pairs by expert on the device for
//! the grouped expert GEMM ([`super::w4a16_gemm::moe_w4a16`]). CPU twin: the per-expert token lists
//! built in `crate::model::ffn::moe` (ascending expert, tokens in order).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "moe_align";

/// Warps of the kernel's chunked placement (`ALIGN_PW`): its dynamic shared memory is this many cursors an expert.
const PLACE_WARPS: usize = 8;

/// Dynamic shared memory of a launch over `n_experts` experts.
fn smem_bytes(n_experts: usize) -> usize {
    PLACE_WARPS * n_experts * 4
}

/// Lets the kernel take the dynamic shared memory of 1024 experts next to its static 16.3 KiB (over the 48 KiB a
/// block gets without asking; called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    gpu.func("kdtree_moe_align_i32")
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem_bytes(1024) as i32,
        )
        .map_err(drv("moe_align configure"))
}

/// Upper bound on the row tiles for `pairs` (token, slot) pairs over `n_experts` experts with tiles of
/// `tile_rows`: `min(E, P) + ceil(P / tile_rows)`. Known on the host without reading the ids.
pub fn max_tiles(pairs: usize, n_experts: usize, tile_rows: usize) -> usize {
    pairs.min(n_experts) + pairs.div_ceil(tile_rows)
}

/// Device-side grouping of `ids` `[P]` (row-major `[T, top_k]` expert ids from the router):
/// `sorted [P]` pair indices by ascending expert (stable), `tiles [3, max_tiles]` (expert, start, count)
/// and `n_tiles [1]`. `tile_rows` must be the GEMM's row tile (8, 16 or 32; 128 for the large-M form). One block
/// of 1024 threads.
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn moe_align(
    gpu: &Gpu,
    ids: &CudaView<'_, i32>,
    n_experts: usize,
    tile_rows: usize,
    sorted: &mut CudaViewMut<'_, i32>,
    tiles: &mut CudaViewMut<'_, i32>,
    n_tiles: &mut CudaViewMut<'_, i32>,
) -> Result<()> {
    moe_align_rank(gpu, ids, 0, n_experts, tile_rows, sorted, tiles, n_tiles)
}

/// [`moe_align`] on a rank that holds experts `first .. first + n_experts` of the global ids (expert
/// parallel): the tiles name local experts (`id - first`), other ids are dropped.
#[allow(clippy::too_many_arguments)]
pub fn moe_align_rank(
    gpu: &Gpu,
    ids: &CudaView<'_, i32>,
    first: usize,
    n_experts: usize,
    tile_rows: usize,
    sorted: &mut CudaViewMut<'_, i32>,
    tiles: &mut CudaViewMut<'_, i32>,
    n_tiles: &mut CudaViewMut<'_, i32>,
) -> Result<()> {
    let p = ids.len();
    ensure(OP, (1..=1024).contains(&n_experts), || {
        format!("n_experts={n_experts} must be in 1..=1024")
    })?;
    ensure(OP, matches!(tile_rows, 8 | 16 | 32 | 128), || {
        format!("tile_rows={tile_rows} must be 8, 16, 32 or 128")
    })?;
    let mt = max_tiles(p, n_experts, tile_rows);
    need_len(OP, "sorted", sorted.len(), p)?;
    need_len(OP, "tiles", tiles.len(), 3 * mt)?;
    need_len(OP, "n_tiles", n_tiles.len(), 1)?;
    let (pp, e, tr, m) = (
        as_i32(OP, "pairs", p)?,
        as_i32(OP, "n_experts", n_experts)?,
        as_i32(OP, "tile_rows", tile_rows)?,
        as_i32(OP, "max_tiles", mt)?,
    );
    let f = as_i32(OP, "first", first)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_moe_align_i32"));
    b.arg(ids)
        .arg(&f)
        .arg(&pp)
        .arg(&e)
        .arg(&tr)
        .arg(&m)
        .arg(sorted)
        .arg(tiles)
        .arg(n_tiles);
    // SAFETY: lengths checked above; the kernel writes sorted[< P], tiles[< 3 max_tiles], n_tiles[0].
    unsafe { b.launch(launch_cfg((1, 1, 1), 1024, smem_bytes(n_experts) as u32)) }.map_err(drv(OP))?;
    Ok(())
}
