//! MoE combine wrapper for kernels/cuda/moe_combine.cu. CPU twin: the weighted per-token sum of
//! `crate::cpu::ops::moe_experts_i4g32`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "moe_combine";

/// `out[t, :] = Σ_k w[t, k] · y[t·K + k, :]` over the pairs whose `ids[t, k] >= 0` (f32), t < `tokens`.
/// `y` rows (`[tokens·K, ≥ H]` bf16) are `ld_y` apart, `w` `[tokens, K]` f32, `ids` `[tokens, K]` i32,
/// `out` `[tokens, H]` f32. Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    gpu: &Gpu,
    y: &CudaView<'_, bf16>,
    ld_y: usize,
    w: &CudaView<'_, f32>,
    ids: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    tokens: usize,
    k: usize,
    hidden: usize,
) -> Result<()> {
    moe_combine_rank(gpu, y, ld_y, w, ids, (0, i32::MAX as usize), out, tokens, k, hidden)
}

/// [`moe_combine`] on a rank holding experts `held.0 .. held.0 + held.1` (expert parallel): the pairs of
/// other experts are skipped.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine_rank(
    gpu: &Gpu,
    y: &CudaView<'_, bf16>,
    ld_y: usize,
    w: &CudaView<'_, f32>,
    ids: &CudaView<'_, i32>,
    held: (usize, usize),
    out: &mut CudaViewMut<'_, f32>,
    tokens: usize,
    k: usize,
    hidden: usize,
) -> Result<()> {
    ensure(OP, ld_y >= hidden, || format!("ld_y={ld_y} must be >= H={hidden}"))?;
    need_len(OP, "y", y.len(), span(tokens * k, ld_y, hidden))?;
    need_len(OP, "w", w.len(), tokens * k)?;
    need_len(OP, "ids", ids.len(), tokens * k)?;
    need_len(OP, "out", out.len(), tokens * hidden)?;
    if tokens == 0 || hidden == 0 {
        return Ok(());
    }
    ensure(OP, tokens <= 65535, || {
        format!("tokens={tokens} exceeds the grid limit 65535")
    })?;
    let (ly, t, kk, hh) = (
        as_i32(OP, "ld_y", ld_y)?,
        as_i32(OP, "tokens", tokens)?,
        as_i32(OP, "k", k)?,
        as_i32(OP, "hidden", hidden)?,
    );
    let (first, count) = (as_i32(OP, "first", held.0)?, as_i32(OP, "count", held.1)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_moe_combine_f32"));
    b.arg(y)
        .arg(&ly)
        .arg(w)
        .arg(ids)
        .arg(&first)
        .arg(&count)
        .arg(out)
        .arg(&t)
        .arg(&kk)
        .arg(&hh);
    // SAFETY: every buffer was length-checked above for tokens x K pairs and H columns.
    unsafe { b.launch(launch_cfg((hidden.div_ceil(256) as u32, tokens as u32, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
