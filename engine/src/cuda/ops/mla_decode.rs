//! MLA decode attention (one node, up to 8 heads, K2.6's latent widths), wrapper for kernels/cuda/mla_decode.cu:
//! the split kernel's partials from a kernel whose mma rows are latent rows and whose columns are the heads, then
//! the same log-sum-exp merge. CPU twin: the latent core of `crate::cpu::ops::mla_attention` (absorbed form).
//! [`super::mla_attention::mla_attention`] takes it for `T = 1` when the `mla_decode` option is on.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::mla_attention::{merge, MlaShape, MlaSplit};
use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "mla_decode";
const KERNEL: &str = "kdtree_mla_decode_bf16";
/// The kernel's widths: latent (value) columns C and rope columns P a row, and the most heads (the mma's N).
const C: usize = 512;
const P: usize = 64;
const MAX_HEADS: usize = 8;
/// Dynamic shared memory (mirror of `mla_decode::SMEM`): the queries, four warps' two 16-row stages, their Pᵀ.
pub const SMEM: usize = (MAX_HEADS * (C + P + 8) + 4 * 2 * 16 * (C + P + 8) + 4 * 2 * MAX_HEADS * 24) * 2;
// An H200 block holds it (227 KiB opt-in); sm_120's 99 KiB does not, so it keeps the split kernel.
const _: () = assert!(SMEM <= 232_448 - 1024 && SMEM > 101_376);
/// Rows per split are a multiple of this (as the split kernel's; the kernel rounds to it when it divides them).
const CHUNK: usize = 32;

/// Whether this device runs the decode kernel for `s`: one node, K2.6's widths, 1..=8 heads, and a block may have
/// its 158 KiB of shared memory (sm_90; not sm_120's 99 KiB).
pub fn supported(gpu: &Gpu, s: &MlaShape) -> bool {
    s.t == 1 && s.kv_lora == C && s.rope == P && (1..=MAX_HEADS).contains(&s.heads) && SMEM <= gpu.max_smem
}

/// Raises the kernel's dynamic shared memory limit where the device has it (called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    if SMEM > gpu.max_smem {
        return Ok(());
    }
    gpu.func(KERNEL)
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            SMEM as i32,
        )
        .map_err(drv("mla_decode configure"))
}

/// `out[h, :512] = Σ_s softmax_s(scale · q[h, :] · lat[s, :]) · lat[s, :512]` over rows `[0, committed]` (the
/// committed prefix and the node's own row), for `q` `[Hr, 576]` bf16, `lat` `[>= committed + 1, 576]` bf16, `out`
/// `[Hr, 512]` bf16; partials and `committed_dev` as [`super::mla_attention::mla_attention`] (the same workspace,
/// `split.rows_per_split == 0` with the device length). Launch contract: two kernels, no allocation, no host sync,
/// graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn mla_decode(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    lat: &CudaView<'_, bf16>,
    committed_dev: Option<&CudaView<'_, i32>>,
    s: &MlaShape,
    split: &MlaSplit,
    scale: f32,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    ensure(OP, supported(gpu, s), || {
        format!(
            "T={} Hr={} C={} P={} (shared memory {} of {}): the kernel takes one node of 1..=8 heads at C=512, P=64",
            s.t, s.heads, s.kv_lora, s.rope, SMEM, gpu.max_smem
        )
    })?;
    let even = split.rows_per_split == 0;
    ensure(OP, !even || committed_dev.is_some(), || {
        "rows_per_split = 0 (even split in the kernel) needs the device committed length".into()
    })?;
    let rows = s.committed + 1;
    ensure(
        OP,
        split.splits > 0
            && split.splits <= super::mla_attention::MERGE_MAX_SPLITS
            && split.rows_per_split.is_multiple_of(CHUNK)
            && (even || split.splits * split.rows_per_split >= rows),
        || {
            format!(
                "{} splits x {} rows for {rows} rows (at most {} splits, rows a multiple of {CHUNK})",
                split.splits,
                split.rows_per_split,
                super::mla_attention::MERGE_MAX_SPLITS
            )
        },
    )?;
    if let Some(c) = committed_dev {
        need_len(OP, "committed_dev", c.len(), 1)?;
    }
    need_len(OP, "q", q.len(), s.heads * (C + P))?;
    need_len(OP, "lat", lat.len(), rows * (C + P))?;
    let (wo, wml) = split.workspace(s);
    need_len(OP, "part_o", part_o.len(), wo)?;
    need_len(OP, "part_ml", part_ml.len(), wml)?;
    need_len(OP, "out", out.len(), s.heads * C)?;
    let (hr, committed, rps) = (
        as_i32(OP, "heads", s.heads)?,
        as_i32(OP, "committed", s.committed)?,
        as_i32(OP, "rows_per_split", split.rows_per_split)?,
    );
    let null: u64 = 0;
    let mut b = gpu.stream.launch_builder(gpu.func(KERNEL));
    b.arg(q)
        .arg(lat)
        .arg(&mut *part_o)
        .arg(&mut *part_ml)
        .arg(&hr)
        .arg(&committed);
    match committed_dev {
        Some(d) => b.arg(d),
        None => b.arg(&null),
    };
    b.arg(&rps).arg(&scale);
    // SAFETY: every buffer the kernel reads or writes was length-checked above for these shapes (the rows it reads
    // are [0, committed + 1) of lat; with the device length the caller's cache holds them, as for the split kernel).
    unsafe { b.launch(launch_cfg((split.splits as u32, 1, 1), 128, SMEM as u32)) }.map_err(drv(OP))?;
    merge(gpu, part_o, part_ml, out, (1, split.splits, s.heads), hr, C as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smem_mirrors_the_kernel() {
        // (8 query rows + 4 warps x 2 stages x 16 rows) of 584 bf16, and 4 warps x 2 x 8 heads x 24 bf16 of Pᵀ.
        assert_eq!(SMEM, 161_920);
    }
}
