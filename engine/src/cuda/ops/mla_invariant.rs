//! Batch-invariant MLA, absorbed form (kernels/cuda/mla_invariant.cu; `Gpu::batch_invariant`): the absorption,
//! the attention over each node's key list in chunks of [`INV_CHUNK`] list positions cut at absolute positions,
//! and W_UV, every output summed in one order that depends on the node's own keys only. A token gets the same
//! bits in an AR step and in a tree verify. f32 on CUDA cores (correct first; the tensor-core form is
//! `mla_attention`). CPU twin: the absorbed branch of `crate::cpu::ops::mla_attention`. Tests:
//! engine/tests/cuda_mla.rs (`mla_invariant_parity`, `mla_invariant_rows_equal_ar_and_verify`).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::mla_absorb::AbsorbDims;
use super::mla_attention::MlaShape;
use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "mla_invariant";

/// List positions a chunk holds (its cuts at multiples of this, whatever the call).
pub const INV_CHUNK: usize = 256;

/// Chunks a node of a cache of `cap` rows can have: the partial kernel's grid and its workspace.
pub fn inv_chunks(cap: usize) -> usize {
    cap.div_ceil(INV_CHUNK).max(1)
}

/// f32 elements of (`part_o`, `part_ml`) for `s` over a cache of `cap` rows.
pub fn inv_workspace(s: &MlaShape, cap: usize) -> (usize, usize) {
    let n = s.t * s.heads * inv_chunks(cap);
    (n * s.kv_lora, 2 * n)
}

/// [`super::mla_absorb::absorb_q`] in one fixed order: `qcat[t, h, c] = Σ_d q_nope[t, h, d] · W_UK_h[d, c]`, d
/// ascending (columns `0..C` of each head's row; `p` = P).
pub fn absorb_q_inv(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    p: usize,
    kv_b: &CudaView<'_, bf16>,
    qcat: &mut CudaViewMut<'_, bf16>,
    d: AbsorbDims,
) -> Result<()> {
    if !super::mla_absorb::check_absorb(OP, (q.len(), kv_b.len(), qcat.len()), p, d)? {
        return Ok(());
    }
    let (hr, c, pp, dn, dv) = (
        as_i32(OP, "heads", d.heads)?,
        as_i32(OP, "kv_lora", d.kv_lora)?,
        as_i32(OP, "rope", p)?,
        as_i32(OP, "nope", d.nope)?,
        as_i32(OP, "v", d.v)?,
    );
    ensure(OP, d.t <= 65535 && d.heads <= 65535, || {
        format!("{} nodes of {} heads", d.t, d.heads)
    })?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_inv_absorb_bf16"));
    b.arg(q).arg(kv_b).arg(qcat).arg(&hr).arg(&c).arg(&pp).arg(&dn).arg(&dv);
    let grid = (d.kv_lora.div_ceil(128) as u32, d.heads as u32, d.t as u32);
    // SAFETY: q holds T rows of Hr (Dn + P), kv_b Hr (Dn + Dv) rows of C, qcat T rows of Hr (C + P) (checked).
    unsafe { b.launch(launch_cfg(grid, 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// [`super::mla_absorb::apply_uv`] in one fixed order: `o[t, h·Dv + v] = Σ_c o_lat[t, h, c] · W_UV_h[v, c]`.
pub fn apply_uv_inv(
    gpu: &Gpu,
    o_lat: &CudaView<'_, bf16>,
    kv_b: &CudaView<'_, bf16>,
    o: &mut CudaViewMut<'_, bf16>,
    d: AbsorbDims,
) -> Result<()> {
    if !super::mla_absorb::check_uv(OP, (o_lat.len(), kv_b.len(), o.len()), d)? {
        return Ok(());
    }
    ensure(OP, d.t <= 65535 && d.heads <= 65535, || {
        format!("{} nodes of {} heads", d.t, d.heads)
    })?;
    let (hr, c, dn, dv) = (
        as_i32(OP, "heads", d.heads)?,
        as_i32(OP, "kv_lora", d.kv_lora)?,
        as_i32(OP, "nope", d.nope)?,
        as_i32(OP, "v", d.v)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_inv_uv_bf16"));
    b.arg(o_lat).arg(kv_b).arg(o).arg(&hr).arg(&c).arg(&dn).arg(&dv);
    let grid = (d.v.div_ceil(8) as u32, d.heads as u32, d.t as u32);
    // SAFETY: o_lat holds T rows of Hr C, kv_b Hr (Dn + Dv) rows of C, o T rows of Hr Dv (checked).
    unsafe { b.launch(launch_cfg(grid, 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// The attention of `s.t` nodes over their key lists (the committed rows, then each node's visible tree rows in
/// ascending order: `mask` bit j of node i, or `j <= i` without one), `o_lat` `[T, Hr, C]` bf16. `lat` is the
/// layer's cache (`cap` rows of C + P); the committed length is read from `committed_dev` when given (a captured
/// round), else `s.committed`. Two kernels (partials per chunk, the merge), no allocation, no host sync.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_inv(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    lat: &CudaView<'_, bf16>,
    cap: usize,
    mask: Option<(&CudaView<'_, u64>, usize)>,
    committed_dev: Option<&CudaView<'_, i32>>,
    s: &MlaShape,
    scale: f32,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let lw = s.kv_lora + s.rope;
    ensure(
        OP,
        s.kv_lora > 0 && s.kv_lora <= 512 && lw <= 576 && lw.is_multiple_of(8),
        || {
            format!(
                "kv_lora={} + rope={}: at most 512 + 64, a multiple of 8",
                s.kv_lora, s.rope
            )
        },
    )?;
    ensure(OP, s.committed + s.t <= cap, || {
        format!(
            "{} committed + {} nodes exceed the cache's {cap} rows",
            s.committed, s.t
        )
    })?;
    need_len(OP, "q", q.len(), s.t * s.heads * lw)?;
    need_len(OP, "lat", lat.len(), cap * lw)?;
    let (wo, wml) = inv_workspace(s, cap);
    need_len(OP, "part_o", part_o.len(), wo)?;
    need_len(OP, "part_ml", part_ml.len(), wml)?;
    need_len(OP, "out", out.len(), s.t * s.heads * s.kv_lora)?;
    if let Some(c) = committed_dev {
        need_len(OP, "committed_dev", c.len(), 1)?;
    }
    let words = super::mla_attention::mask_words(OP, mask, s.t)?;
    if s.t == 0 || s.heads == 0 {
        return Ok(());
    }
    let nch = inv_chunks(cap);
    ensure(OP, s.t <= 65535 && nch <= i32::MAX as usize, || {
        format!("{} nodes in one launch", s.t)
    })?;
    let (committed, w, hr, c, p, width) = (
        as_i32(OP, "committed", s.committed)?,
        as_i32(OP, "words", words)?,
        as_i32(OP, "heads", s.heads)?,
        as_i32(OP, "kv_lora", s.kv_lora)?,
        as_i32(OP, "rope", s.rope)?,
        as_i32(OP, "width", lw)?,
    );
    let (chunk, nchi) = (INV_CHUNK as i32, as_i32(OP, "chunks", nch)?);
    let null: u64 = 0;
    let smem = (8 * lw + 8 * INV_CHUNK) * 4 + INV_CHUNK * 4;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_inv_partial_bf16"));
    b.arg(q).arg(lat).arg(&width);
    match committed_dev {
        Some(cd) => b.arg(cd),
        None => b.arg(&null),
    };
    b.arg(&committed);
    match mask {
        Some((m, _)) => b.arg(m),
        None => b.arg(&null),
    };
    b.arg(&w)
        .arg(&hr)
        .arg(&c)
        .arg(&p)
        .arg(&scale)
        .arg(&chunk)
        .arg(&nchi)
        .arg(&mut *part_o)
        .arg(&mut *part_ml);
    let grid = (nch as u32, s.t as u32, s.heads.div_ceil(8) as u32);
    // SAFETY: every buffer holds what the kernel reads and writes for these shapes (checked above); the
    // dynamic shared memory is 8 (C + P) + 8 S floats and S ints.
    unsafe { b.launch(launch_cfg(grid, 256, smem as u32)) }.map_err(drv(OP))?;
    let (po, pml) = (part_o.as_view(), part_ml.as_view());
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_inv_merge_bf16"));
    b.arg(&po).arg(&pml);
    match committed_dev {
        Some(cd) => b.arg(cd),
        None => b.arg(&null),
    };
    b.arg(&committed);
    match mask {
        Some((m, _)) => b.arg(m),
        None => b.arg(&null),
    };
    b.arg(&w).arg(&hr).arg(&c).arg(&chunk).arg(&nchi).arg(out);
    // SAFETY: as above; the merge reads each node's ceil(len / S) chunks, all written by the partial kernel.
    unsafe { b.launch(launch_cfg((s.heads as u32, s.t as u32, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
