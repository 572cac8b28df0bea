//! RMSNorm wrapper for kernels/cuda/rms_norm.cu. CPU twin: `crate::cpu::ops::rms_norm`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "rms_norm";

/// `y[r, :h] = weight * (x[r, :h] * rsqrt(mean(x[r, :h]²) + eps))` for `rows` rows; x rows are `ld_x`
/// apart, y rows `ld_y` apart (so the 512-wide latent inside a 576-wide row can be normalised in place or
/// out of place). bf16 in/out, f32 math. One block per row.
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    weight: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, bf16>,
    rows: usize,
    h: usize,
    ld_x: usize,
    ld_y: usize,
    eps: f32,
) -> Result<()> {
    ensure(OP, h > 0, || "hidden size h=0".into())?;
    ensure(OP, ld_x >= h && ld_y >= h, || {
        format!("row strides ld_x={ld_x}, ld_y={ld_y} must be >= h={h}")
    })?;
    ensure(OP, weight.len() == h, || {
        format!("weight has {} elements, expected h={h}", weight.len())
    })?;
    need_len(OP, "x", x.len(), span(rows, ld_x, h))?;
    need_len(OP, "y", y.len(), span(rows, ld_y, h))?;
    if rows == 0 {
        return Ok(());
    }
    let (hh, lx, ly) = (
        as_i32(OP, "h", h)?,
        as_i32(OP, "ld_x", ld_x)?,
        as_i32(OP, "ld_y", ld_y)?,
    );
    let grid = u32::try_from(rows).map_err(|_| crate::cuda::CudaError::Shape {
        op: OP,
        msg: format!("rows={rows} exceeds u32"),
    })?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_rms_norm_bf16"));
    b.arg(x).arg(weight).arg(y).arg(&hh).arg(&lx).arg(&ly).arg(&eps);
    // SAFETY: lengths checked above cover every element the kernel touches (rows x [0, h) at the strides).
    unsafe { b.launch(launch_cfg((grid, 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
