//! Row gather wrapper for kernels/cuda/gather_rows.cu. CPU twin: row copies by index (the CPU backend's
//! `rope_gather`).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "gather_rows";

/// `dst[r * ld_dst + c] = src[idx[r] * ld_src + c]` for r < `rows`, c < `width`; `src` has `rows_src` rows
/// (an index outside them gives a NaN row). Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn gather_rows(
    gpu: &Gpu,
    src: &CudaView<'_, f32>,
    ld_src: usize,
    rows_src: usize,
    idx: &CudaView<'_, u32>,
    dst: &mut CudaViewMut<'_, f32>,
    ld_dst: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    ensure(OP, ld_src >= width && ld_dst >= width, || {
        format!("strides ld_src={ld_src}, ld_dst={ld_dst} must be >= width={width}")
    })?;
    need_len(OP, "src", src.len(), span(rows_src, ld_src, width))?;
    need_len(OP, "idx", idx.len(), rows)?;
    need_len(OP, "dst", dst.len(), span(rows, ld_dst, width))?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    ensure(OP, rows <= 65535, || {
        format!("rows={rows} exceeds the grid limit 65535")
    })?;
    let (ls, rs, ld, w) = (
        as_i32(OP, "ld_src", ld_src)?,
        as_i32(OP, "rows_src", rows_src)?,
        as_i32(OP, "ld_dst", ld_dst)?,
        as_i32(OP, "width", width)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_gather_rows_f32"));
    b.arg(src).arg(&ls).arg(&rs).arg(idx).arg(dst).arg(&ld).arg(&w);
    // SAFETY: spans checked above; the kernel range-checks every index.
    unsafe { b.launch(launch_cfg((width.div_ceil(128) as u32, rows as u32, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
