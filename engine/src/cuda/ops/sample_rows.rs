//! Per-row token decision wrapper for kernels/cuda/sample_rows.cu (greedy argmax, or a seeded sample after
//! temperature, top-k and top-p, every row drawing with the uniform of its own position). CPU twin:
//! `crate::sampling::sample` (its module header is the spec). Test: engine/tests/cuda_sample.rs.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};
use crate::sampling::Sampling;

const OP: &str = "sample_rows";
/// Threads per block: the kernel's block scans assume exactly 1024 (32 warps).
const THREADS: u32 = 1024;
/// Largest vocabulary accepted (2^30; K2.6 has 163,840).
pub const MAX_V: usize = 1 << 30;

/// `out[r] = sampling::sample(logits[r * ld .. r * ld + v], s, position(r))` for r < rows, where
/// `position(r) = start + depth[r] + 1` (a DDTree node of depth `depth[r]` under a root at `start`), or
/// `start + r` when `depth` is None (consecutive autoregressive positions); positions wrap mod 2^64.
/// logits `[rows, ld]` f32 (first v used), depth `[rows]` u32, out `[rows]` u32 token ids. Equal to the CPU
/// token for token except when u·Z or P lies within f64 rounding of a boundary (kernel header). One block of
/// 1024 threads per row; scratch in shared memory.
/// Launch contract: no allocation, no host sync, graph-capturable (`start` is an argument, the depths live
/// on the device).
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    gpu: &Gpu,
    logits: &CudaView<'_, f32>,
    rows: usize,
    v: usize,
    ld: usize,
    s: &Sampling,
    start: u64,
    start_dev: Option<&CudaView<'_, i32>>,
    depth: Option<&CudaView<'_, u32>>,
    out: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    ensure(OP, v > 0 && ld >= v, || {
        format!("vocab v={v} must be > 0 and <= ld={ld}")
    })?;
    // The kernel's id loops step by 1024 in i32: keep them far from overflow.
    ensure(OP, v <= MAX_V, || format!("vocab v={v} exceeds {MAX_V}"))?;
    need_len(OP, "logits", logits.len(), span(rows, ld, v))?;
    need_len(OP, "out", out.len(), rows)?;
    if let Some(d) = depth {
        need_len(OP, "depth", d.len(), rows)?;
    }
    if rows == 0 {
        return Ok(());
    }
    ensure(OP, rows <= i32::MAX as usize, || {
        format!("rows={rows} exceeds the grid (i32)")
    })?;
    let (vv, l) = (as_i32(OP, "v", v)?, as_i32(OP, "ld", ld)?);
    // top_k >= v keeps every token (sampling::Survivors: top-k applies only when 0 < k < V).
    let k = if s.top_k < v { s.top_k as i32 } else { 0 };
    let null: u64 = 0;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_sample_rows_f32"));
    b.arg(logits)
        .arg(&vv)
        .arg(&l)
        .arg(&s.temperature)
        .arg(&s.top_p)
        .arg(&k)
        .arg(&s.seed)
        .arg(&start);
    match start_dev {
        Some(d) => b.arg(d),
        None => b.arg(&null),
    };
    match depth {
        Some(d) => b.arg(d),
        None => b.arg(&null),
    };
    b.arg(out);
    // SAFETY: lengths checked above; a null depth is handled by the kernel (position = start + row).
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), THREADS, 0)) }.map_err(drv(OP))?;
    Ok(())
}
