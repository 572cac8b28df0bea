//! Drafter block attention wrapper for kernels/cuda/gqa_attention.cu (split-KV partials with an online
//! softmax, then the log-sum-exp merge): non-causal grouped-query attention of B block queries over
//! `[context ; block]` keys/values, f32 throughout. CPU twin: `crate::cpu::ops::gqa_attention`.
//! Test: engine/tests/cuda_drafter.rs.
//!
//! Letters: B block rows, C context rows, Hq query heads, Hk kv heads, G = Hq / Hk, D head_dim.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "gqa_attention";
const SPLIT: &str = "kdtree_gqa_attention_split_f32";
const MERGE: &str = "kdtree_gqa_attention_merge_f32";
/// Query rows per CTA and key/value rows per chunk of the kernel (rows per split are a multiple of this).
const QUERIES_PER_CTA: usize = 16;
const ROWS_PER_CHUNK: usize = 16;
/// Largest head_dim the kernel takes (its per-thread output registers are sized for it).
pub const MAX_HEAD_DIM: usize = 256;

/// Shapes of one drafter block attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaShape {
    /// B block rows (queries; also the block's own key/value rows).
    pub b: usize,
    /// C committed context rows (0 allowed).
    pub ctx: usize,
    /// Hq query heads, Hk kv heads (Hq a multiple of Hk).
    pub heads: usize,
    pub kv_heads: usize,
    /// D head_dim, 1..=256.
    pub head_dim: usize,
}

/// How the C + B rows are split over CTAs, and the workspace that takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaSplit {
    pub splits: usize,
    pub rows_per_split: usize,
}

impl GqaSplit {
    /// Enough CTAs to fill the GPU about twice (flash-decoding), at least 64 rows each.
    pub fn choose(gpu: &Gpu, s: &GqaShape) -> GqaSplit {
        Self::for_sms(gpu.sms, s)
    }
    /// [`GqaSplit::choose`] for a GPU of `sms` multiprocessors.
    pub fn for_sms(sms: usize, s: &GqaShape) -> GqaSplit {
        let rows = s.ctx + s.b;
        let group = s.heads.checked_div(s.kv_heads).unwrap_or(0);
        let ctas_per_split = s.kv_heads * (s.b * group).div_ceil(QUERIES_PER_CTA);
        let want = (2 * sms).div_ceil(ctas_per_split.max(1)).max(1);
        let splits = want.min((rows / 64).max(1));
        let rows_per_split = rows.div_ceil(splits).div_ceil(ROWS_PER_CHUNK).max(1) * ROWS_PER_CHUNK;
        GqaSplit {
            splits: rows.div_ceil(rows_per_split).max(1),
            rows_per_split,
        }
    }
    /// f32 elements of `part_o` `[splits, B, Hq, D]` and `part_ml` `[splits, B, Hq, 2]`.
    pub fn workspace(&self, s: &GqaShape) -> (usize, usize) {
        (
            self.splits * s.b * s.heads * s.head_dim,
            self.splits * s.b * s.heads * 2,
        )
    }
}

/// Dynamic shared memory of the split kernel for head_dim `d`: queries and one K and one V chunk, 16 rows
/// each of `d | 1` f32 (mirror of the kernel's layout).
pub fn smem_bytes(d: usize) -> usize {
    (QUERIES_PER_CTA + 2 * ROWS_PER_CHUNK) * (d | 1) * 4
}

/// Raises the split kernel's dynamic shared memory limit to what head_dim 256 needs (49,344 bytes, just
/// over the 48 KiB default; called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    let need = smem_bytes(MAX_HEAD_DIM);
    ensure(OP, need <= gpu.max_smem, || {
        format!(
            "needs {need} bytes of shared memory at head_dim {MAX_HEAD_DIM}, the device allows {}",
            gpu.max_smem
        )
    })?;
    for f in [SPLIT, SPLIT_SEGS] {
        gpu.func(f)
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                need as i32,
            )
            .map_err(drv("gqa_attention configure"))?;
    }
    Ok(())
}

/// The head shape both launches check: Hq a positive multiple of Hk, 1 <= D <= [`MAX_HEAD_DIM`].
fn check_heads(s: &GqaShape) -> Result<()> {
    let (hq, hk, d) = (s.heads, s.kv_heads, s.head_dim);
    ensure(OP, hk > 0 && hq > 0 && hq % hk == 0, || {
        format!("heads={hq} is not a positive multiple of kv_heads={hk}")
    })?;
    ensure(OP, (1..=MAX_HEAD_DIM).contains(&d), || {
        format!("head_dim={d} outside the kernel's 1..={MAX_HEAD_DIM}")
    })
}

/// `out[t, hq, :] = Σ_s softmax_s(D^-0.5 · q[t, hq, :] · k[s, hq / G, :]) · v[s, hq / G, :]` over all
/// S = C + B rows s: context rows `kc`/`vc` `[C, Hk·D]` first, then block rows `kb`/`vb` `[B, Hk·D]`
/// (no mask: the block attends to itself non-causally). `q` `[B, Hq·D]`, `out` `[B, Hq·D]`, all f32.
/// Preconditions (checked, errors name the numbers): Hk > 0, Hq a multiple of Hk, 1 <= D <= 256, every
/// buffer long enough for the shape, the split covering the S rows in multiples of 16; B = 0 writes nothing.
/// Workspace: `part_o`, `part_ml` of [`GqaSplit::workspace`] (the caller's; the backend allocates them per
/// call). `ctx_dev` (`[1]` i32) makes the kernel read C there (a captured round); `s.ctx` must then be its
/// current value and `split` may have `rows_per_split == 0` (the kernel splits the rows evenly).
/// Launch contract: two kernels, no allocation, no host sync, graph-capturable for fixed shapes.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention(
    gpu: &Gpu,
    q: &CudaView<'_, f32>,
    (kc, vc): (&CudaView<'_, f32>, &CudaView<'_, f32>),
    ctx_dev: Option<&CudaView<'_, i32>>,
    (kb, vb): (&CudaView<'_, f32>, &CudaView<'_, f32>),
    s: &GqaShape,
    split: &GqaSplit,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let (hq, hk, d) = (s.heads, s.kv_heads, s.head_dim);
    check_heads(s)?;
    let even = split.rows_per_split == 0;
    ensure(OP, !even || ctx_dev.is_some(), || {
        "rows_per_split = 0 (even split in the kernel) needs the device context length".into()
    })?;
    ensure(
        OP,
        split.rows_per_split.is_multiple_of(ROWS_PER_CHUNK) && split.splits > 0,
        || {
            format!(
                "{} splits x rows_per_split={}: need >= 1 split of a multiple of {ROWS_PER_CHUNK} rows",
                split.splits, split.rows_per_split
            )
        },
    )?;
    let rows = s.ctx + s.b;
    ensure(OP, even || split.splits * split.rows_per_split >= rows, || {
        format!(
            "{} splits x {} rows do not cover C={} + B={} rows",
            split.splits, split.rows_per_split, s.ctx, s.b
        )
    })?;
    if let Some(c) = ctx_dev {
        need_len(OP, "ctx_dev", c.len(), 1)?;
    }
    let (qw, kw) = (hq * d, hk * d);
    need_len(OP, "q", q.len(), s.b * qw)?;
    need_len(OP, "kc", kc.len(), s.ctx * kw)?;
    need_len(OP, "vc", vc.len(), s.ctx * kw)?;
    need_len(OP, "kb", kb.len(), s.b * kw)?;
    need_len(OP, "vb", vb.len(), s.b * kw)?;
    let (wo, wml) = split.workspace(s);
    need_len(OP, "part_o", part_o.len(), wo)?;
    need_len(OP, "part_ml", part_ml.len(), wml)?;
    need_len(OP, "out", out.len(), s.b * qw)?;
    if s.b == 0 {
        return Ok(());
    }
    let tiles = (s.b * (hq / hk)).div_ceil(QUERIES_PER_CTA);
    ensure(OP, hk <= 65535 && tiles <= 65535, || {
        format!("grid of kv_heads={hk} x {tiles} query tiles exceeds 65535")
    })?;
    // Every index the kernels form in int (not size_t) stays below these.
    as_i32(OP, "ctx + b", rows)?;
    as_i32(OP, "splits x rows_per_split", split.splits * split.rows_per_split)?;
    let (bi, ci, hqi, hki, di) = (
        as_i32(OP, "b", s.b)?,
        as_i32(OP, "ctx", s.ctx)?,
        as_i32(OP, "heads", hq)?,
        as_i32(OP, "kv_heads", hk)?,
        as_i32(OP, "head_dim", d)?,
    );
    let (rps, sp, bh) = (
        as_i32(OP, "rows_per_split", split.rows_per_split)?,
        as_i32(OP, "splits", split.splits)?,
        as_i32(OP, "b x heads", s.b * hq)?,
    );
    let scale = (d as f32).powf(-0.5); // as the twin
    let mut b = gpu.stream.launch_builder(gpu.func(SPLIT));
    b.arg(q)
        .arg(kc)
        .arg(vc)
        .arg(kb)
        .arg(vb)
        .arg(&mut *part_o)
        .arg(&mut *part_ml);
    let null: u64 = 0;
    b.arg(&bi).arg(&ci);
    match ctx_dev {
        Some(d) => b.arg(d),
        None => b.arg(&null),
    };
    b.arg(&hqi).arg(&hki).arg(&di).arg(&rps).arg(&scale);
    let grid = (split.splits as u32, hk as u32, tiles as u32);
    // SAFETY: every buffer the kernel reads or writes was length-checked above for these shapes (the
    // context buffers are not read when C = 0); the dynamic shared memory is at most what `configure` allowed.
    unsafe { b.launch(launch_cfg(grid, 256, smem_bytes(d) as u32)) }.map_err(drv(OP))?;
    let mut b = gpu.stream.launch_builder(gpu.func(MERGE));
    let (po, pml) = (part_o.as_view(), part_ml.as_view());
    b.arg(&po).arg(&pml).arg(&mut *out).arg(&sp).arg(&bh).arg(&di);
    // SAFETY: as above; the merge reads the partials the first kernel wrote and writes out [B, Hq·D].
    unsafe { b.launch(launch_cfg(((s.b * hq) as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Sequences one [`gqa_attention_segs`] launch takes (`GQA_SEGS` in the kernel).
pub const MAX_SEGS: usize = 64;
const SPLIT_SEGS: &str = "kdtree_gqa_attention_split_segs_f32";

/// One sequence of [`gqa_attention_segs`]: its context rows `[C, Hk·D]` (C read at `ctx_dev`, host mirror
/// `ctx`) and its split count (what [`GqaSplit::choose`] gives its own launch).
pub struct GqaSeg<'a> {
    pub kc: CudaView<'a, f32>,
    pub vc: CudaView<'a, f32>,
    pub ctx_dev: CudaView<'a, i32>,
    pub ctx: usize,
    pub splits: usize,
}

/// The kernel's by-value table (`struct GqaSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct GqaSegsArg {
    kc: [u64; MAX_SEGS],
    vc: [u64; MAX_SEGS],
    ctx: [u64; MAX_SEGS],
    splits: [i32; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct GqaSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for GqaSegsArg {}

/// [`gqa_attention`] of up to [`MAX_SEGS`] sequences' blocks in two launches: sequence s's `s.b` query rows are
/// rows `[s·b, (s+1)·b)` of `q`, `kb`, `vb` and `out`, over its own context (`segs[s]`) split evenly into its
/// own split count: each sequence's output is bit for bit what its own [`gqa_attention`] with `ctx_dev` and
/// `GqaSplit { splits, rows_per_split: 0 }` writes (a split past a sequence's count sees no row and is skipped
/// by the merge). Workspace `part_o`, `part_ml`: [`GqaSplit::workspace`] of the largest split count and
/// `nseg·b` rows. Launch contract: two kernels, no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_segs(
    gpu: &Gpu,
    segs: &[GqaSeg<'_>],
    q: &CudaView<'_, f32>,
    (kb, vb): (&CudaView<'_, f32>, &CudaView<'_, f32>),
    s: &GqaShape,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let (hq, hk, d, nseg) = (s.heads, s.kv_heads, s.head_dim, segs.len());
    check_heads(s)?;
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} sequences in one launch (at most {MAX_SEGS})")
    })?;
    let (qw, kw, rows) = (hq * d, hk * d, nseg * s.b);
    need_len(OP, "q", q.len(), rows * qw)?;
    need_len(OP, "kb", kb.len(), rows * kw)?;
    need_len(OP, "vb", vb.len(), rows * kw)?;
    need_len(OP, "out", out.len(), rows * qw)?;
    let splits = segs.iter().map(|g| g.splits).max().unwrap_or(0);
    let full = GqaShape { b: rows, ..*s };
    let (wo, wml) = GqaSplit {
        splits,
        rows_per_split: 0,
    }
    .workspace(&full);
    need_len(OP, "part_o", part_o.len(), wo)?;
    need_len(OP, "part_ml", part_ml.len(), wml)?;
    if rows == 0 {
        return Ok(());
    }
    let mut arg = GqaSegsArg {
        kc: [0; MAX_SEGS],
        vc: [0; MAX_SEGS],
        ctx: [0; MAX_SEGS],
        splits: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(3 * nseg);
    for (i, g) in segs.iter().enumerate() {
        use cudarc::driver::DevicePtr;
        ensure(OP, g.splits >= 1, || format!("sequence {i}: 0 splits"))?;
        need_len(OP, "ctx_dev", g.ctx_dev.len(), 1)?;
        need_len(OP, "kc", g.kc.len(), g.ctx * kw)?;
        need_len(OP, "vc", g.vc.len(), g.ctx * kw)?;
        as_i32(OP, "ctx + b", g.ctx + s.b)?;
        let (pk, gk) = g.kc.device_ptr(&gpu.stream);
        let (pv, gv) = g.vc.device_ptr(&gpu.stream);
        let (pc, gc) = g.ctx_dev.device_ptr(&gpu.stream);
        guards.extend([gk, gv, gc]);
        (arg.kc[i], arg.vc[i], arg.ctx[i]) = (pk, pv, pc);
        arg.splits[i] = as_i32(OP, "splits", g.splits)?;
    }
    let tiles = (s.b * (hq / hk)).div_ceil(QUERIES_PER_CTA);
    ensure(OP, hk <= 65535 && nseg * tiles <= 65535, || {
        format!("grid of kv_heads={hk} x {nseg} x {tiles} query tiles exceeds 65535")
    })?;
    let (bi, hqi, hki, di) = (
        as_i32(OP, "b", s.b)?,
        as_i32(OP, "heads", hq)?,
        as_i32(OP, "kv_heads", hk)?,
        as_i32(OP, "head_dim", d)?,
    );
    let (sp, bh) = (as_i32(OP, "splits", splits)?, as_i32(OP, "rows x heads", rows * hq)?);
    let scale = (d as f32).powf(-0.5); // as the twin
    let mut b = gpu.stream.launch_builder(gpu.func(SPLIT_SEGS));
    b.arg(&arg)
        .arg(q)
        .arg(kb)
        .arg(vb)
        .arg(&mut *part_o)
        .arg(&mut *part_ml)
        .arg(&bi)
        .arg(&hqi)
        .arg(&hki)
        .arg(&di)
        .arg(&scale);
    let grid = (splits as u32, hk as u32, (nseg * tiles) as u32);
    // SAFETY: every buffer was length-checked above (each context against its host mirror, which the device
    // counter equals outside a captured round and only advances with its rows written inside one); the
    // dynamic shared memory is at most what `configure` allowed.
    unsafe { b.launch(launch_cfg(grid, 256, smem_bytes(d) as u32)) }.map_err(drv(OP))?;
    drop(guards);
    let mut b = gpu.stream.launch_builder(gpu.func(MERGE));
    let (po, pml) = (part_o.as_view(), part_ml.as_view());
    b.arg(&po).arg(&pml).arg(&mut *out).arg(&sp).arg(&bh).arg(&di);
    // SAFETY: as above; the merge reads the partials the first kernel wrote and writes out [rows, Hq·D].
    unsafe { b.launch(launch_cfg(((rows * hq) as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mirror of the kernel's layout (kernels/cuda/gqa_attention.cu: `(QT + 2R) * (D | 1)` f32).
    #[test]
    fn smem_matches_the_kernel_layout() {
        assert_eq!(smem_bytes(128), 48 * 129 * 4);
        assert_eq!(smem_bytes(256), 49_344);
        assert_eq!(smem_bytes(15), 48 * 15 * 4);
    }

    /// The split covers the C + B rows in multiples of the chunk, with no empty split, for the drafter
    /// shapes (real K2.x: B 8, Hq 64, Hk 8) and contexts from 0 to 100k rows on 132 SMs (H200) and 1.
    #[test]
    fn split_covers_every_row_without_empty_splits() {
        for sms in [1, 132] {
            for (b, hq, hk) in [(8, 64, 8), (8, 16, 8), (1, 4, 2), (3, 6, 3)] {
                for ctx in [0, 1, 5, 15, 16, 100, 4096, 5000, 20_000, 100_000] {
                    let s = GqaShape {
                        b,
                        ctx,
                        heads: hq,
                        kv_heads: hk,
                        head_dim: 128,
                    };
                    let p = GqaSplit::for_sms(sms, &s);
                    let rows = ctx + b;
                    assert!(
                        p.splits >= 1 && p.rows_per_split.is_multiple_of(ROWS_PER_CHUNK),
                        "{s:?}: {p:?}"
                    );
                    assert!(
                        p.splits * p.rows_per_split >= rows && (p.splits - 1) * p.rows_per_split < rows,
                        "{s:?}: {p:?}"
                    );
                    assert!(p.splits == 1 || p.rows_per_split >= 64, "{s:?}: {p:?}");
                }
            }
        }
        // A long context spreads over enough CTAs to fill an H200 twice.
        let s = GqaShape {
            b: 8,
            ctx: 20_000,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
        };
        let p = GqaSplit::for_sms(132, &s);
        assert!(p.splits * 8 * 4 >= 264, "{p:?}");
    }
}
