//! SwiGLU combine wrapper for kernels/cuda/silu_mul.cu. CPU twin: `crate::cpu::ops::silu_mul`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "silu_mul";

/// `out[t, j] = bf16(silu(gate[t, j]) * up[t, j])` for t < rows, j < i; gate and up rows are `ld_in` apart
/// (`ld_in = 2i` with `up` = gate + i for a fused gate_up buffer), out is `[rows, i]`.
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn silu_mul(
    gpu: &Gpu,
    gate: &CudaView<'_, bf16>,
    up: &CudaView<'_, bf16>,
    out: &mut CudaViewMut<'_, bf16>,
    rows: usize,
    i: usize,
    ld_in: usize,
) -> Result<()> {
    ensure(OP, ld_in >= i, || format!("ld_in={ld_in} must be >= i={i}"))?;
    need_len(OP, "gate", gate.len(), span(rows, ld_in, i))?;
    need_len(OP, "up", up.len(), span(rows, ld_in, i))?;
    need_len(OP, "out", out.len(), rows * i)?;
    if rows == 0 || i == 0 {
        return Ok(());
    }
    let (ii, ld, tt) = (
        as_i32(OP, "i", i)?,
        as_i32(OP, "ld_in", ld_in)?,
        as_i32(OP, "rows", rows)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_silu_mul_bf16"));
    b.arg(gate).arg(up).arg(out).arg(&ii).arg(&ld).arg(&tt);
    // SAFETY: lengths checked above; block rows stride over the rows past the grid's 65535.
    let grid = (i.div_ceil(256) as u32, rows.min(65535) as u32, 1);
    unsafe { b.launch(launch_cfg(grid, 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
