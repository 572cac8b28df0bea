//! MLA latent attention wrapper for kernels/cuda/mla_attention.cu (split-KV partials, then the
//! log-sum-exp merge). CPU twin: the latent core of `crate::cpu::ops::mla_attention` (absorbed form).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "mla_attention";
/// Latent rows per chunk of the kernel (rows per split are a multiple of this).
const ROWS_PER_CHUNK: usize = 32;
/// The largest grid y (and z) dimension a launch may have.
const GRID_Y_MAX: usize = 65535;
/// Shared memory row of the kernel (bf16): C + P <= 576, padded.
const LDS: usize = 576 + 8;

/// One form of the split kernel (`mla_split_kernel<MT, NB>` in mla_attention.cu): `16·MT` query rows per CTA,
/// `NB` latent chunk buffers. Both give the same bits; the large one needs 157 KiB of shared memory a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaForm {
    m_tiles: usize,
    buffers: usize,
    split: &'static str,
    seg: &'static str,
    heads: &'static str,
}

const LARGE: MlaForm = MlaForm {
    m_tiles: 4,
    buffers: 2,
    split: "kdtree_mla_attention_split_bf16",
    seg: "kdtree_mla_attention_split_seg_bf16",
    heads: "kdtree_mla_attention_split_heads_bf16",
};
const SMALL: MlaForm = MlaForm {
    m_tiles: 2,
    buffers: 1,
    split: "kdtree_mla_attention_split_small_bf16",
    seg: "kdtree_mla_attention_split_seg_small_bf16",
    heads: "kdtree_mla_attention_split_heads_small_bf16",
};

impl MlaForm {
    /// The form this GPU runs: the large one where a block may have its shared memory.
    pub fn of(gpu: &Gpu) -> MlaForm {
        if LARGE.smem_bytes() <= gpu.max_smem {
            LARGE
        } else {
            SMALL
        }
    }
    /// Query rows (node, head) per CTA.
    pub fn rows(&self) -> usize {
        16 * self.m_tiles
    }
    fn threads(&self) -> u32 {
        64 * self.m_tiles as u32
    }
    /// Dynamic shared memory (mirror of `mla_smem_bytes` in the kernel): queries, latent chunks, P (its bf16
    /// rounding and remainder), two row reductions.
    pub fn smem_bytes(&self) -> usize {
        let rows = self.rows();
        (rows * LDS + self.buffers * ROWS_PER_CHUNK * LDS + 2 * rows * (ROWS_PER_CHUNK + 8)) * 2 + 2 * 2 * rows * 4
    }
    /// The query tiles of `t` nodes of `heads` heads: (node tiles, head tiles). A tile holds min(Hr, rows) heads
    /// of max(1, rows / that) consecutive nodes.
    pub fn tiles(&self, t: usize, heads: usize) -> (usize, usize) {
        let hpt = heads.clamp(1, self.rows());
        let npt = (self.rows() / hpt).max(1);
        (t.div_ceil(npt), heads.div_ceil(hpt))
    }
    /// The query tiles of the expanded form ([`mla_attention_heads`]): `rows` consecutive nodes of one head.
    pub fn head_tiles(&self, t: usize, heads: usize) -> (usize, usize) {
        (t.div_ceil(self.rows()), heads)
    }
}

/// Raises the split kernels' dynamic shared memory limit to their form's need (called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    let f = MlaForm::of(gpu);
    ensure(OP, f.smem_bytes() <= gpu.max_smem, || {
        format!(
            "needs {} bytes of shared memory, the device allows {}",
            f.smem_bytes(),
            gpu.max_smem
        )
    })?;
    for name in [f.split, f.seg, f.heads] {
        gpu.func(name)
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                f.smem_bytes() as i32,
            )
            .map_err(drv("mla_attention configure"))?;
    }
    Ok(())
}

/// Shapes of one MLA attention call on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    /// T new nodes (queries); their latent rows are `[committed, committed + t)` of the cache.
    pub t: usize,
    /// Hr heads of the rank.
    pub heads: usize,
    /// C = kv_lora (values and the latent part of keys), P = rope dims; C + P <= 576, both multiples of 8.
    pub kv_lora: usize,
    pub rope: usize,
    /// Committed prefix rows every node sees.
    pub committed: usize,
}

/// How the rows are split over CTAs, and the workspace that takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaSplit {
    pub splits: usize,
    pub rows_per_split: usize,
}

impl MlaSplit {
    /// As many splits as fit the GPU in one wave (flash-decoding; a CTA holds an SM's shared memory, and a
    /// second wave of a few CTAs would double the time), at least 64 rows each.
    pub fn choose(gpu: &Gpu, s: &MlaShape) -> MlaSplit {
        let (nt, ht) = MlaForm::of(gpu).tiles(s.t, s.heads);
        Self::for_ctas(gpu, s, nt * ht)
    }
    /// [`MlaSplit::choose`] for the expanded form ([`mla_attention_heads`]: its tiles hold one head each).
    pub fn choose_heads(gpu: &Gpu, s: &MlaShape) -> MlaSplit {
        let (nt, ht) = MlaForm::of(gpu).head_tiles(s.t, s.heads);
        Self::for_ctas(gpu, s, nt * ht)
    }
    fn for_ctas(gpu: &Gpu, s: &MlaShape, ctas_per_split: usize) -> MlaSplit {
        let rows = s.committed + s.t;
        let want = (gpu.sms / ctas_per_split.max(1)).max(1);
        let max_splits = rows.div_ceil(64).max(1);
        let splits = want.min(max_splits);
        let rows_per_split = rows.div_ceil(splits).div_ceil(ROWS_PER_CHUNK) * ROWS_PER_CHUNK;
        MlaSplit {
            splits: rows.div_ceil(rows_per_split),
            rows_per_split,
        }
    }
    /// f32 elements of `part_o` and `part_ml`.
    pub fn workspace(&self, s: &MlaShape) -> (usize, usize) {
        (s.t * self.splits * s.heads * s.kv_lora, s.t * self.splits * s.heads * 2)
    }
}

/// The words per node of an ancestor mask for `t` nodes (checked to hold them and to fill `t` rows), 0 without one.
pub(crate) fn mask_words(op: &'static str, mask: Option<(&CudaView<'_, u64>, usize)>, t: usize) -> Result<usize> {
    let Some((m, w)) = mask else { return Ok(0) };
    ensure(op, w * 64 >= t, || {
        format!("{w} mask words per node cannot hold {t} nodes")
    })?;
    need_len(op, "mask", m.len(), t * w)?;
    Ok(w)
}

/// Splits the merge kernel holds in shared memory (`MLA_MERGE_MAX_SPLITS` in mla_attention.cu).
pub(crate) const MERGE_MAX_SPLITS: usize = 1024;

/// `out[t, h, :C] = Σ_s softmax_s(scale · q[t, h, :] · lat[s, :]) · lat[s, :C]` over the rows node t sees:
/// the committed prefix `[0, committed)` and `committed + j` for each node j set in `mask` row t (`words`
/// u64 per node; bit j of row i = node j is i or an ancestor of i), or, with no mask, `j <= t` (causal
/// prefill). `q` `[T, Hr, C+P]` bf16 (q_lat | q_pe), `lat` `[>= committed + T, C+P]` bf16 (c_kv | k_pe),
/// `out` `[T, Hr, C]` bf16. Every node must see at least one row (itself: the mask's diagonal).
/// `committed_dev` (`[1]` i32) makes the kernel read the committed length there (a captured round replays
/// at any length); `s.committed` must then be its current value (the checks use it) and `split` may have
/// `rows_per_split == 0`: the kernel splits the rows it finds evenly over `split.splits`.
/// Launch contract: two kernels, no allocation, no host sync, graph-capturable for fixed shapes.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    lat: &CudaView<'_, bf16>,
    mask: Option<(&CudaView<'_, u64>, usize)>,
    committed_dev: Option<&CudaView<'_, i32>>,
    s: &MlaShape,
    split: &MlaSplit,
    scale: f32,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let lw = s.kv_lora + s.rope;
    ensure(
        OP,
        s.kv_lora.is_multiple_of(8) && s.rope.is_multiple_of(8) && s.kv_lora > 0,
        || format!("kv_lora={} and rope={} must be multiples of 8", s.kv_lora, s.rope),
    )?;
    ensure(OP, s.kv_lora <= 512 && lw <= 576, || {
        format!("kv_lora={} + rope={} exceeds the kernel's 512 + 64", s.kv_lora, s.rope)
    })?;
    let even = split.rows_per_split == 0;
    ensure(OP, !even || committed_dev.is_some(), || {
        "rows_per_split = 0 (even split in the kernel) needs the device committed length".into()
    })?;
    ensure(
        OP,
        split.rows_per_split.is_multiple_of(ROWS_PER_CHUNK) && split.splits > 0,
        || {
            format!(
                "rows_per_split={} is not a multiple of {ROWS_PER_CHUNK}",
                split.rows_per_split
            )
        },
    )?;
    let rows = s.committed + s.t;
    ensure(OP, split.splits <= MERGE_MAX_SPLITS, || {
        format!("{} splits: the merge takes at most {MERGE_MAX_SPLITS}", split.splits)
    })?;
    ensure(OP, even || split.splits * split.rows_per_split >= rows, || {
        format!(
            "{} splits x {} rows do not cover {rows} rows",
            split.splits, split.rows_per_split
        )
    })?;
    if let Some(c) = committed_dev {
        need_len(OP, "committed_dev", c.len(), 1)?;
    }
    need_len(OP, "q", q.len(), s.t * s.heads * lw)?;
    need_len(OP, "lat", lat.len(), rows * lw)?;
    let (wo, wml) = split.workspace(s);
    need_len(OP, "part_o", part_o.len(), wo)?;
    need_len(OP, "part_ml", part_ml.len(), wml)?;
    need_len(OP, "out", out.len(), s.t * s.heads * s.kv_lora)?;
    let words = mask_words(OP, mask, s.t)?;
    if s.t == 0 || s.heads == 0 {
        return Ok(());
    }
    // One node sees every row up to its own whatever its mask (the diagonal): the decode kernel's case.
    if gpu.options().mla_decode && super::mla_decode::supported(gpu, s) {
        return super::mla_decode::mla_decode(gpu, q, lat, committed_dev, s, split, scale, part_o, part_ml, out);
    }
    let (t, hr, c, p) = (
        as_i32(OP, "t", s.t)?,
        as_i32(OP, "heads", s.heads)?,
        as_i32(OP, "kv_lora", s.kv_lora)?,
        as_i32(OP, "rope", s.rope)?,
    );
    let (committed, w, rps) = (
        as_i32(OP, "committed", s.committed)?,
        as_i32(OP, "words", words)?,
        as_i32(OP, "rows_per_split", split.rows_per_split)?,
    );
    // Node tiles go in grid y (at most 65535): a longer forward is split by the caller; past the limit the launch
    // would fail with an opaque driver error, so say it here.
    let form = MlaForm::of(gpu);
    let (nt, ht) = form.tiles(s.t, s.heads);
    ensure(OP, nt <= GRID_Y_MAX && ht <= GRID_Y_MAX, || {
        format!(
            "{} nodes of {} heads ({nt} tiles of {} query rows) in one launch exceed the grid limit {GRID_Y_MAX}",
            s.t,
            s.heads,
            form.rows()
        )
    })?;
    let grid = (split.splits as u32, nt as u32, ht as u32);
    let null: u64 = 0;
    let mut b = gpu.stream.launch_builder(gpu.func(form.split));
    b.arg(q).arg(lat);
    match mask {
        Some((m, _)) => b.arg(m),
        None => b.arg(&null),
    };
    b.arg(&mut *part_o)
        .arg(&mut *part_ml)
        .arg(&t)
        .arg(&hr)
        .arg(&c)
        .arg(&p)
        .arg(&committed);
    match committed_dev {
        Some(d) => b.arg(d),
        None => b.arg(&null),
    };
    b.arg(&w).arg(&rps).arg(&scale);
    // SAFETY: every buffer the kernel reads or writes was length-checked above for these shapes; the mask
    // argument is a device pointer or 0 (the kernel's causal case).
    unsafe { b.launch(launch_cfg(grid, form.threads(), form.smem_bytes() as u32)) }.map_err(drv(OP))?;
    merge(gpu, part_o, part_ml, out, (s.t, split.splits, s.heads), hr, c)
}

/// The expanded (multi-head) form for prefill: `out[t, h, :C] = Σ_s softmax_s(scale · q[t, h, :] · k_h[s, :]) ·
/// v_h[s, :]` over the rows node t sees (as [`mla_attention`]), each head over its own rows: head h's rows are
/// `lat[h · head_stride ..]`, `[S, C + P]` bf16, each `v_h (C) | k_h (P)`, and `q` is `[T, Hr, QW]` bf16 with QW = the
/// key width P (its keys are the rows' last QW columns; P a multiple of 16). `s.kv_lora` = C (the value width, <= 512),
/// `s.rope` = P (C + P <= 576). Partials and merge as [`mla_attention`], `split` from [`MlaSplit::choose_heads`].
/// Launch contract: two kernels, no allocation, no host sync.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_heads(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    lat: &CudaView<'_, bf16>,
    head_stride: usize,
    mask: Option<(&CudaView<'_, u64>, usize)>,
    s: &MlaShape,
    split: &MlaSplit,
    scale: f32,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let (c, p) = (s.kv_lora, s.rope);
    let lw = c + p;
    ensure(
        OP,
        c.is_multiple_of(16) && c > 0 && c <= 512 && p.is_multiple_of(16) && p > 0 && lw <= 576,
        || format!("value width {c} and key width {p}: multiples of 16, C <= 512, C + P <= 576"),
    )?;
    ensure(
        OP,
        split.splits > 0
            && split.splits <= MERGE_MAX_SPLITS
            && split.rows_per_split.is_multiple_of(ROWS_PER_CHUNK)
            && split.splits * split.rows_per_split >= s.committed + s.t,
        || {
            format!(
                "{} splits x {} rows for {} rows",
                split.splits,
                split.rows_per_split,
                s.committed + s.t
            )
        },
    )?;
    let rows = s.committed + s.t;
    ensure(OP, head_stride >= rows * lw, || {
        format!("head stride {head_stride} < {rows} rows x {lw}")
    })?;
    need_len(OP, "q", q.len(), s.t * s.heads * p)?;
    need_len(OP, "lat", lat.len(), (s.heads.max(1) - 1) * head_stride + rows * lw)?;
    let (wo, wml) = split.workspace(s);
    need_len(OP, "part_o", part_o.len(), wo)?;
    need_len(OP, "part_ml", part_ml.len(), wml)?;
    need_len(OP, "out", out.len(), s.t * s.heads * c)?;
    let words = mask_words(OP, mask, s.t)?;
    if s.t == 0 || s.heads == 0 {
        return Ok(());
    }
    let form = MlaForm::of(gpu);
    let (nt, ht) = form.head_tiles(s.t, s.heads);
    ensure(OP, nt <= GRID_Y_MAX && ht <= GRID_Y_MAX, || {
        format!(
            "{} nodes of {} heads ({nt} tiles) exceed the grid limit {GRID_Y_MAX}",
            s.t, s.heads
        )
    })?;
    let (t, hr, ci, pi) = (
        as_i32(OP, "t", s.t)?,
        as_i32(OP, "heads", s.heads)?,
        as_i32(OP, "value width", c)?,
        as_i32(OP, "key width", p)?,
    );
    let (committed, w, rps, qw) = (
        as_i32(OP, "committed", s.committed)?,
        as_i32(OP, "words", words)?,
        as_i32(OP, "rows_per_split", split.rows_per_split)?,
        pi,
    );
    let (null, stride) = (0u64, head_stride as u64);
    let mut b = gpu.stream.launch_builder(gpu.func(form.heads));
    b.arg(q).arg(lat);
    match mask {
        Some((m, _)) => b.arg(m),
        None => b.arg(&null),
    };
    b.arg(&mut *part_o)
        .arg(&mut *part_ml)
        .arg(&t)
        .arg(&hr)
        .arg(&ci)
        .arg(&pi)
        .arg(&committed)
        .arg(&null)
        .arg(&w)
        .arg(&rps)
        .arg(&scale)
        .arg(&qw)
        .arg(&stride);
    // SAFETY: q, every head's rows, the mask and the partials were length-checked above for these shapes.
    unsafe {
        b.launch(launch_cfg(
            (split.splits as u32, nt as u32, ht as u32),
            form.threads(),
            form.smem_bytes() as u32,
        ))
    }
    .map_err(drv(OP))?;
    merge(gpu, part_o, part_ml, out, (s.t, split.splits, s.heads), hr, ci)
}

/// The log-sum-exp merge of `splits` partials of `(t, heads)` nodes into `out` `[t, Hr, C]` bf16 (the
/// partials' lengths were checked by the caller).
pub(crate) fn merge(
    gpu: &Gpu,
    part_o: &CudaViewMut<'_, f32>,
    part_ml: &CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
    (t, splits, heads): (usize, usize, usize),
    hr: i32,
    c: i32,
) -> Result<()> {
    let sp = as_i32(OP, "splits", splits)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_attention_merge_bf16"));
    let (po, pml) = (part_o.as_view(), part_ml.as_view());
    b.arg(&po).arg(&pml).arg(&mut *out).arg(&sp).arg(&hr).arg(&c);
    // SAFETY: the merge reads the partials the split kernel wrote and writes out [T, Hr, C].
    let col_blocks = (c as u32).div_ceil(128);
    unsafe { b.launch(launch_cfg((t as u32, heads as u32, col_blocks), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Segments one [`mla_attention_seg`] launch takes (`MLA_SEGS` in mla_attention.cu).
pub const MAX_SEGS: usize = 64;

/// One sequence of a batched MLA launch: its cache layer (`[cap, C+P]` bf16, rows `[0, committed + t)` in use),
/// its tree mask (`[t, words]` u64) and committed length where the ops read it, its node count and the split
/// count its own launch would use ([`MlaSplit::choose`] of its room).
pub struct MlaSeg<'a> {
    pub lat: CudaView<'a, bf16>,
    pub mask: CudaView<'a, u64>,
    pub words: usize,
    pub pos: CudaView<'a, i32>,
    /// Host mirror of the committed length (the checks use it).
    pub committed: usize,
    pub t: usize,
    pub splits: usize,
}

/// The kernel's by-value segment table (`struct MlaSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct MlaSegsArg {
    lat: [u64; MAX_SEGS],
    mask: [u64; MAX_SEGS],
    pos: [u64; MAX_SEGS],
    row0: [i32; MAX_SEGS + 1],
    tile0: [i32; MAX_SEGS + 1],
    words: [i32; MAX_SEGS],
    splits: [i32; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct MlaSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for MlaSegsArg {}

/// [`mla_attention`] of up to [`MAX_SEGS`] sequences in two launches: segment s's nodes are rows
/// `[Σ_{r<s} t_r, +t_s)` of `q` (`[T, Hr, C+P]` bf16) and of `out` (`[T, Hr, C]` bf16), each over its own cache
/// and mask with its own split, so each node's result is the one its sequence's own launch gives (the merge
/// skips the splits a segment does not use). `part_o` / `part_ml`: `[T, max splits, Hr, C]` / `[.., 2]` f32.
/// Launch contract: two kernels, no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_seg(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    segs: &[MlaSeg<'_>],
    heads: usize,
    kv_lora: usize,
    rope: usize,
    scale: f32,
    part_o: &mut CudaViewMut<'_, f32>,
    part_ml: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let lw = kv_lora + rope;
    ensure(OP, (1..=MAX_SEGS).contains(&segs.len()), || {
        format!("{} segments in one launch (1..={MAX_SEGS})", segs.len())
    })?;
    ensure(
        OP,
        kv_lora.is_multiple_of(8) && rope.is_multiple_of(8) && kv_lora > 0 && kv_lora <= 512 && lw <= 576,
        || format!("kv_lora={kv_lora} and rope={rope}: multiples of 8, at most 512 + 64"),
    )?;
    let t: usize = segs.iter().map(|s| s.t).sum();
    let splits = segs.iter().map(|s| s.splits).max().unwrap_or(1);
    ensure(OP, (1..=MERGE_MAX_SPLITS).contains(&splits), || {
        format!("{splits} splits: the merge takes 1..={MERGE_MAX_SPLITS}")
    })?;
    need_len(OP, "q", q.len(), t * heads * lw)?;
    need_len(OP, "part_o", part_o.len(), t * splits * heads * kv_lora)?;
    need_len(OP, "part_ml", part_ml.len(), t * splits * heads * 2)?;
    need_len(OP, "out", out.len(), t * heads * kv_lora)?;
    if t == 0 || heads == 0 {
        return Ok(());
    }
    let mut arg = MlaSegsArg {
        lat: [0; MAX_SEGS],
        mask: [0; MAX_SEGS],
        pos: [0; MAX_SEGS],
        row0: [0; MAX_SEGS + 1],
        tile0: [0; MAX_SEGS + 1],
        words: [0; MAX_SEGS],
        splits: [0; MAX_SEGS],
        nseg: segs.len() as i32,
    };
    let form = MlaForm::of(gpu);
    let mut guards = Vec::with_capacity(3 * segs.len());
    let (mut row, mut tile) = (0, 0);
    for (i, s) in segs.iter().enumerate() {
        ensure(OP, s.splits >= 1 && s.words * 64 >= s.t, || {
            format!(
                "segment {i}: {} splits, {} mask words for {} nodes",
                s.splits, s.words, s.t
            )
        })?;
        need_len(OP, "lat", s.lat.len(), (s.committed + s.t) * lw)?;
        need_len(OP, "mask", s.mask.len(), s.t * s.words)?;
        need_len(OP, "pos", s.pos.len(), 1)?;
        use cudarc::driver::DevicePtr;
        let (pl, gl) = s.lat.device_ptr(&gpu.stream);
        let (pm, gm) = s.mask.device_ptr(&gpu.stream);
        let (pp, gp) = s.pos.device_ptr(&gpu.stream);
        guards.extend([gl, gm, gp]);
        (arg.lat[i], arg.mask[i], arg.pos[i]) = (pl, pm, pp);
        (arg.row0[i], arg.tile0[i], arg.words[i], arg.splits[i]) = (
            as_i32(OP, "row", row)?,
            as_i32(OP, "tile", tile)?,
            as_i32(OP, "words", s.words)?,
            as_i32(OP, "splits", s.splits)?,
        );
        row += s.t;
        tile += form.tiles(s.t, heads).0;
    }
    arg.row0[segs.len()] = as_i32(OP, "rows", row)?;
    arg.tile0[segs.len()] = as_i32(OP, "tiles", tile)?;
    let (hr, c, p) = (
        as_i32(OP, "heads", heads)?,
        as_i32(OP, "kv_lora", kv_lora)?,
        as_i32(OP, "rope", rope)?,
    );
    let ht = form.tiles(1, heads).1;
    ensure(OP, tile <= GRID_Y_MAX && ht <= GRID_Y_MAX, || {
        format!("{t} rows ({tile} tiles) in one launch exceed the grid limit {GRID_Y_MAX}")
    })?;
    let grid = (splits as u32, tile as u32, ht as u32);
    let mut b = gpu.stream.launch_builder(gpu.func(form.seg));
    b.arg(q)
        .arg(&arg)
        .arg(&mut *part_o)
        .arg(&mut *part_ml)
        .arg(&hr)
        .arg(&c)
        .arg(&p)
        .arg(&scale);
    // SAFETY: every segment's buffers were length-checked above; the table holds their device addresses,
    // alive (guards) until the launch is queued; q, part_o, part_ml were checked for the launch's rows.
    unsafe { b.launch(launch_cfg(grid, form.threads(), form.smem_bytes() as u32)) }.map_err(drv(OP))?;
    drop(guards);
    merge(gpu, part_o, part_ml, out, (t, splits, heads), hr, c)
}
