//! Embedding gather wrapper for kernels/cuda/embed.cu. CPU twin: row indexing of `embed_tokens` (the CPU
//! model copies `embed[id * H..]`; the parity test carries that reference).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "embed_gather";

/// `out[t, :] = table[ids[t], :]` for t < ids.len(); table is `[v, h]`, out `[T, h]`. An id outside
/// `[0, v)` yields a NaN row (no host sync to report it; callers validate ids on the host where they come
/// from the host). Launch contract: no allocation, no host sync, graph-capturable.
pub fn embed_gather(
    gpu: &Gpu,
    ids: &CudaView<'_, i32>,
    table: &CudaView<'_, bf16>,
    out: &mut CudaViewMut<'_, bf16>,
    v: usize,
    h: usize,
) -> Result<()> {
    let t = ids.len();
    ensure(OP, table.len() == v * h, || {
        format!("table has {} elements, expected v={v} x h={h}", table.len())
    })?;
    need_len(OP, "out", out.len(), t * h)?;
    if t == 0 {
        return Ok(());
    }
    ensure(OP, t <= i32::MAX as usize, || format!("T={t} exceeds i32"))?;
    let (hh, vv) = (as_i32(OP, "h", h)?, as_i32(OP, "v", v)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_embed_gather_bf16"));
    b.arg(ids).arg(table).arg(out).arg(&hh).arg(&vv);
    // SAFETY: table is v x h, out holds T rows of h; ids are range-checked in the kernel.
    unsafe { b.launch(launch_cfg((t as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Vocab-parallel embedding: `out[t, :] = shards[r][ids[t] - base_r, :]` for the shard `r` holding `ids[t]`
/// (shards `[V_r, h]` in rank order, the first holding ids `[first, first + V_0)`, the next following it),
/// a NaN row for an id outside `[0, v_total)` when the shards end the vocabulary. Rows of ids no shard here
/// holds are left as they are (zero them first: the other GPUs' rows of a multi-GPU run, summed in by the
/// communicator). One launch per shard; every held row is written by exactly one of them.
pub fn embed_gather_sharded(
    gpu: &Gpu,
    ids: &CudaView<'_, i32>,
    shards: &[(&CudaView<'_, bf16>, usize)],
    out: &mut CudaViewMut<'_, bf16>,
    h: usize,
    first: usize,
    v_total: usize,
) -> Result<()> {
    let t = ids.len();
    need_len(OP, "out", out.len(), t * h)?;
    let held: usize = shards.iter().map(|s| s.1).sum();
    ensure(OP, first + held <= v_total, || {
        format!(
            "shards hold rows {first}..{} of a {v_total}-row vocabulary",
            first + held
        )
    })?;
    if t == 0 || shards.is_empty() {
        return Ok(());
    }
    ensure(OP, t <= i32::MAX as usize, || format!("T={t} exceeds i32"))?;
    let (hh, vt) = (as_i32(OP, "h", h)?, as_i32(OP, "v_total", v_total)?);
    let mut base = first;
    for (r, (table, v)) in shards.iter().enumerate() {
        ensure(OP, table.len() == v * h, || {
            format!("shard {r} has {} elements, expected v={v} x h={h}", table.len())
        })?;
        let owner = i32::from(r + 1 == shards.len() && base + v == v_total);
        let (vv, bb) = (as_i32(OP, "v", *v)?, as_i32(OP, "base", base)?);
        let mut b = gpu.stream.launch_builder(gpu.func("kdtree_embed_gather_shard_bf16"));
        b.arg(ids)
            .arg(*table)
            .arg(&mut *out)
            .arg(&hh)
            .arg(&vv)
            .arg(&bb)
            .arg(&vt)
            .arg(&owner);
        // SAFETY: the shard is v x h, out holds T rows of h; ids are range-checked in the kernel.
        unsafe { b.launch(launch_cfg((t as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
        base += v;
    }
    Ok(())
}
