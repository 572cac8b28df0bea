//! Strided row copy wrapper for kernels/cuda/copy_rows.cu. CPU twin: `copy_from_slice` of each row.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "copy_rows";

/// `dst[r * ld_dst + c] = src[r * ld_src + c]` for r < `rows`, c < `width`.
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn copy_rows(
    gpu: &Gpu,
    src: &CudaView<'_, bf16>,
    ld_src: usize,
    dst: &mut CudaViewMut<'_, bf16>,
    ld_dst: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    ensure(OP, ld_src >= width && ld_dst >= width, || {
        format!("strides ld_src={ld_src}, ld_dst={ld_dst} must be >= width={width}")
    })?;
    need_len(OP, "src", src.len(), span(rows, ld_src, width))?;
    need_len(OP, "dst", dst.len(), span(rows, ld_dst, width))?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let (ls, ld, r, w) = (
        as_i32(OP, "ld_src", ld_src)?,
        as_i32(OP, "ld_dst", ld_dst)?,
        as_i32(OP, "rows", rows)?,
        as_i32(OP, "width", width)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_copy_rows_bf16"));
    b.arg(src).arg(&ls).arg(dst).arg(&ld).arg(&r).arg(&w);
    // SAFETY: both spans were length-checked above.
    // The kernel grid-strides over the rows, so any row count fits the grid's y limit.
    unsafe {
        b.launch(launch_cfg(
            (width.div_ceil(256) as u32, rows.min(65535) as u32, 1),
            256,
            0,
        ))
    }
    .map_err(drv(OP))?;
    Ok(())
}
