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
    ensure(OP, v > 0 && ld >= v, || {
        format!("vocab v={v} must be > 0 and <= ld={ld}")
    })?;
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

/// The vocab-parallel argmax, part one: for r < rows, the best (value, global id) of `x[r * ld .. r * ld + v]`
/// (one vocab shard's logits, global ids `id0..id0 + v`) into `pairs[(r * slots + slot) * 2 ..][..2]`; (NaN, 0)
/// for an all-NaN row. `pairs` is `[rows, slots, 2]`; the other slots are left alone (zero, for the
/// communicator's exact sum). Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn argmax_pairs(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    rows: usize,
    v: usize,
    ld: usize,
    id0: usize,
    pairs: &mut CudaViewMut<'_, f32>,
    slot: usize,
    slots: usize,
) -> Result<()> {
    ensure(OP, v > 0 && ld >= v, || {
        format!("vocab v={v} must be > 0 and <= ld={ld}")
    })?;
    ensure(OP, slot < slots, || format!("slot {slot} of {slots}"))?;
    ensure(OP, id0 + v <= 1 << 24, || {
        format!("global ids up to {} are not exact as f32 (2^24)", id0 + v)
    })?;
    need_len(OP, "x", x.len(), span(rows, ld, v))?;
    need_len(OP, "pairs", pairs.len(), rows * slots * 2)?;
    if rows == 0 {
        return Ok(());
    }
    ensure(OP, rows <= u32::MAX as usize, || format!("rows={rows} exceeds u32"))?;
    let (vv, l, i0, sl, ss) = (
        as_i32(OP, "v", v)?,
        as_i32(OP, "ld", ld)?,
        as_i32(OP, "id0", id0)?,
        as_i32(OP, "slot", slot)?,
        as_i32(OP, "slots", slots)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_argmax_pair_f32"));
    b.arg(x).arg(&vv).arg(&l).arg(&i0).arg(pairs).arg(&sl).arg(&ss);
    // SAFETY: lengths checked above; the kernel writes only slot `slot` of each row's pairs.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// The vocab-parallel argmax, part two: `out[r]` = the id of the best of row r's `slots` pairs (larger value
/// wins, NaN never, the earlier slot on ties; 0 when all are NaN): with the slots in global vocab order, the
/// argmax of the whole row. Launch contract: no allocation, no host sync, graph-capturable.
pub fn merge_pairs(
    gpu: &Gpu,
    pairs: &CudaView<'_, f32>,
    rows: usize,
    slots: usize,
    out: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    need_len(OP, "pairs", pairs.len(), rows * slots * 2)?;
    need_len(OP, "out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (r, ss) = (as_i32(OP, "rows", rows)?, as_i32(OP, "slots", slots)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_argmax_merge_pairs"));
    b.arg(pairs).arg(&r).arg(&ss).arg(out);
    // SAFETY: lengths checked above; one thread per row.
    unsafe { b.launch(launch_cfg((rows.div_ceil(128) as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
