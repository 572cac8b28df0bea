//! Row argmax wrapper for kernels/cuda/argmax.cu. CPU twin: `crate::sampling::argmax` (lowest index on
//! ties, NaN never wins, all-NaN row gives 0).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "argmax";

/// Element type of the logits: f32 (lm_head through cuBLAS with f32 output) or bf16.
pub trait ArgmaxInput: cudarc::driver::DeviceRepr {
    const KERNEL: &'static str;
}
impl ArgmaxInput for f32 {
    const KERNEL: &'static str = "kdtree_argmax_f32";
}
impl ArgmaxInput for bf16 {
    const KERNEL: &'static str = "kdtree_argmax_bf16";
}

/// `out[r] = argmax(x[r * ld .. r * ld + v])` for r < rows. One block of 1024 threads per row.
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn argmax<T: ArgmaxInput>(
    gpu: &Gpu,
    x: &CudaView<'_, T>,
    rows: usize,
    v: usize,
    ld: usize,
    out: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    ensure(OP, v > 0 && ld >= v, || format!("vocab v={v} must be > 0 and <= ld={ld}"))?;
    need_len(OP, "x", x.len(), span(rows, ld, v))?;
    need_len(OP, "out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    ensure(OP, rows <= u32::MAX as usize, || format!("rows={rows} exceeds u32"))?;
    let (vv, l) = (as_i32(OP, "v", v)?, as_i32(OP, "ld", ld)?);
    let mut b = gpu.stream.launch_builder(gpu.func(T::KERNEL));
    b.arg(x).arg(&vv).arg(&l).arg(out);
    // SAFETY: lengths checked above.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(drv(OP))?;
    Ok(())
}
