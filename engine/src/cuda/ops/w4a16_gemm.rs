//! W4A16 group-32 GEMM wrappers for kernels/cuda/w4a16_gemm.cu (dense and grouped-MoE forms) and the
//! split-K plan they share. CPU twin: `crate::cpu::ops::matmul_i4g32` (weights in the converter's layout:
//! packed `[N, K/2]` u8, low nibble = even k, offset 8; scales `[N, K/32]` bf16; formats/FORMAT.md).
//!
//! Plan: the grid is (N/128 row blocks) x (S k-splits) x (row tiles of 8, 16 or 32 rows). S is chosen so
//! that there are about four blocks per SM (M = 1 decode on a 512-row TP slice still fills the GPU), and
//! limited so that the shared memory holding the block's slice of x lets four blocks stay resident. Partials go to an
//! f32 workspace `[S, rows, N]`, summed in split order inside the GEMM by the last split block of each tile to arrive
//! (deterministic; one launch per GEMM). The GEMMs launch with programmatic dependent launch
//! ([`super::launch_pdl`]) so that the dense form's weight loads overlap the previous kernel.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut};
use half::bf16;

use super::{addr, addr_mut, as_i32, launch_cfg, launch_pdl, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "w4a16_gemm";
const OP_MOE: &str = "moe_w4a16";
/// k per kernel step (4 groups of 32) and rows per block (4 warps x 32); N and K must be multiples.
pub const K_STEP: usize = 128;
pub const N_STEP: usize = 32;
const ROWS_PER_CTA: usize = 128;
const GROUP_BYTES_SMEM: usize = 72;
/// Blocks per SM the split-K count aims at (4 fit by registers: 128 threads x 128 registers); enough
/// warps with 192 bytes in flight per lane to cover HBM latency at M = 1.
const BLOCKS_PER_SM: usize = 4;

const DENSE: [&str; 3] = [
    "kdtree_w4a16_gemm_i4g32_m1",
    "kdtree_w4a16_gemm_i4g32_m2",
    "kdtree_w4a16_gemm_i4g32_m4",
];
/// The large-M grouped form (prefill): 128 x 128 tiles over the whole K, no split, no workspace.
const LARGE: &str = "kdtree_moe_w4a16_gemm_i4g32_large";
/// Its dynamic shared memory (2 stages of x 128 x 128 bf16, weights 128 x 64 bytes, scales 128 x 8 bytes).
const LARGE_SMEM: usize = 2 * (128 * 128 * 2 + 128 * 64 + 128 * 8);
/// Its row tile (it steps K by K_STEP = 128, the small form's block, in the small form's k order: a pair's
/// output is the small form's bits whenever that form runs one split, as it does at K <= 512).
const LARGE_TILE: usize = 128;
/// Mean rows per active expert from which the grouped GEMM takes the large-M form. Below it a 128-row tile
/// would be mostly empty; above it the small form dequantises every weight once per 32 rows and sums splits
/// through an f32 workspace.
pub const LARGE_MIN_ROWS: usize = 64;

const GROUPED: [&str; 3] = [
    "kdtree_moe_w4a16_gemm_i4g32_m1",
    "kdtree_moe_w4a16_gemm_i4g32_m2",
    "kdtree_moe_w4a16_gemm_i4g32_m4",
];
/// The grouped form that stages x as the SwiGLU of `[gate | up]` rows (the down projection): a kernel of its own,
/// so that the plain form keeps fewer registers (127 against 167 at m1: four CTAs an SM instead of three).
const GROUPED_SILU: [&str; 3] = [
    "kdtree_moe_w4a16_gemm_i4g32_silu_m1",
    "kdtree_moe_w4a16_gemm_i4g32_silu_m2",
    "kdtree_moe_w4a16_gemm_i4g32_silu_m4",
];

/// Raises the dynamic shared memory limit of the GEMM kernels to the device's opt-in maximum (called once
/// by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    let smem = gpu.max_smem.saturating_sub(1024) as i32;
    for name in DENSE
        .iter()
        .chain(GROUPED.iter())
        .chain(GROUPED_SILU.iter())
        .chain([LARGE].iter())
    {
        gpu.func(name)
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem,
            )
            .map_err(drv("w4a16_gemm configure"))?;
    }
    Ok(())
}

/// Shared-memory row stride of the staged x slice (mirror of `smem_row_stride` in the kernel).
fn smem_row_stride(kbps: usize) -> usize {
    let s8 = kbps * 4 * (GROUP_BYTES_SMEM / 8);
    (s8 + (4 + 16 * 64 - s8 % 16) % 16) * 8
}

/// Launch plan of one W4A16 GEMM: row tile (8 * mt rows), k-splits and shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// n8 token subtiles per block: 1, 2 or 4 (row tile of 8, 16 or 32 rows).
    pub mt: usize,
    /// k-splits S (f32 partials per split).
    pub splits: usize,
    /// 128-k steps per split.
    pub kbps: usize,
    /// Dynamic shared memory per block (bytes).
    pub smem: usize,
    /// The grouped large-M form (`kdtree_moe_w4a16_gemm_i4g32_large`): row tiles of 128, the whole K per
    /// block, no workspace; x must be plain rows ([`MoeX::Rows`]).
    pub large: bool,
}

impl Plan {
    pub fn tile_rows(&self) -> usize {
        8 * self.mt
    }
    /// Workspace elements (f32) for `rows` output rows of width `n`: `[splits, rows, n]`.
    pub fn workspace_len(&self, rows: usize, n: usize) -> usize {
        if self.large {
            0
        } else {
            self.splits * rows * n
        }
    }
}

/// Row tile for an expected `rows_per_tile_hint` rows per weight matrix (8, 16 or 32).
fn mt_for(rows: usize) -> usize {
    match rows {
        0..=8 => 1,
        9..=16 => 2,
        _ => 4,
    }
}

/// The plan for `row_tiles` tiles of `8 mt` rows over an `[n, k]` weight matrix, `rows` rows of x in all.
fn plan_for(gpu: &Gpu, mt: usize, row_tiles: usize, rows: usize, n: usize, k: usize) -> Plan {
    let d = Device {
        sms: gpu.sms,
        smem_per_sm: gpu.smem_per_sm,
        max_smem: gpu.max_smem,
        blocks_per_sm: gpu.w4a16_blocks_per_sm(),
        max_splits: gpu.w4a16_max_splits(),
    };
    plan_on(d, mt, row_tiles, rows, n, k)
}

/// The device figures a plan depends on.
#[derive(Clone, Copy)]
struct Device {
    sms: usize,
    smem_per_sm: usize,
    max_smem: usize,
    /// Blocks per SM the split count aims at ([`crate::cuda::Gpu::w4a16_blocks_per_sm`]).
    blocks_per_sm: usize,
    /// At most this many k-splits ([`crate::cuda::Gpu::w4a16_max_splits`]; the last split block sums them in
    /// order, but on the H200 the extra blocks of more splits win over that tail).
    max_splits: usize,
}

fn plan_on(gpu: Device, mt: usize, row_tiles: usize, rows: usize, n: usize, k: usize) -> Plan {
    let nkb = (k / K_STEP).max(1);
    let bps = gpu.blocks_per_sm.clamp(1, BLOCKS_PER_SM);
    let blocks = n.div_ceil(ROWS_PER_CTA) * row_tiles.max(1);
    // Splits fill the GPU, but their f32 partials (written and read once: 8 bytes per row, output and split)
    // stay under a quarter of the weight bytes (n k / 2 packed + n k / 16 scales).
    let by_traffic = ((n * k * 9 / 16) / (4 * 8 * rows.max(1) * n)).max(1);
    let want = (bps * gpu.sms)
        .div_ceil(blocks)
        .clamp(1, nkb)
        .min(by_traffic)
        .min(gpu.max_splits.max(1));
    let mut kbps = nkb.div_ceil(want);
    let budget = smem_budget(gpu.smem_per_sm, gpu.max_smem, bps);
    while kbps > 1 && 8 * mt * smem_row_stride(kbps) > budget {
        kbps -= 1;
    }
    Plan {
        mt,
        splits: nkb.div_ceil(kbps),
        kbps,
        smem: 8 * mt * smem_row_stride(kbps),
        large: false,
    }
}

/// Shared memory per block small enough for `bps` blocks to be resident on an SM of `smem_per_sm` bytes (1 KB per
/// block is reserved by the system, plus the static row maps), within the opt-in limit `max_smem`.
fn smem_budget(smem_per_sm: usize, max_smem: usize, bps: usize) -> usize {
    (smem_per_sm / bps.max(1))
        .saturating_sub(1024 + 512)
        .min(max_smem.saturating_sub(1024))
}

/// Plan of the dense form for `m` rows of x over an `[n, k]` matrix.
pub fn plan_dense(gpu: &Gpu, m: usize, n: usize, k: usize) -> Plan {
    let mt = mt_for(m);
    if gpu.batch_invariant() && m <= INVARIANT_MAX_ROWS {
        return invariant_plan(gpu, mt, plan_for(gpu, 1, 1, 1, n, k).kbps, n, k);
    }
    plan_for(gpu, mt, m.div_ceil(8 * mt), m, n, k)
}

/// Rows (dense) or pairs / 8 (grouped) up to which a batch-invariant GPU ([`Gpu::batch_invariant`]) keeps one
/// k-split per weight shape: a decode step, a tree verify of up to 2,047 nodes (a budget of 2,046), a batch of them.
pub const INVARIANT_MAX_ROWS: usize = 2048;

/// The small form with `kbps` k-blocks a split whatever the rows: a row's sums are then the same in any call (the
/// row tile changes only which rows share a CTA, not a row's order), capped so that the largest row tile's x
/// slice fits the shared memory at the blocks per SM the plans aim at.
fn invariant_plan(gpu: &Gpu, mt: usize, kbps: usize, _n: usize, k: usize) -> Plan {
    // The shared-memory budget of a block as plan_on computes it, for the largest row tile (32 rows).
    let bps = gpu.w4a16_blocks_per_sm().clamp(1, BLOCKS_PER_SM);
    let budget = smem_budget(gpu.smem_per_sm, gpu.max_smem, bps);
    let nkb = (k / K_STEP).max(1);
    let mut kbps = kbps.clamp(1, nkb);
    while kbps > 1 && 32 * smem_row_stride(kbps) > budget {
        kbps -= 1;
    }
    Plan {
        mt,
        splits: nkb.div_ceil(kbps),
        kbps,
        smem: 8 * mt * smem_row_stride(kbps),
        large: false,
    }
}

/// Whether the grouped GEMM over `pairs` rows and `n_experts` experts takes the large-M form. It depends on
/// these two only, so the gate/up and down plans of one layer agree and one routing (row tile 128) serves
/// them; every shape the grouped GEMM takes (K % 128, N % 32) suits the large form.
pub fn large_moe(pairs: usize, n_experts: usize) -> bool {
    pairs.div_ceil(pairs.min(n_experts).max(1)) >= LARGE_MIN_ROWS
}

/// Plan of the grouped form for `pairs` (token, slot) rows over `n_experts` experts of `[n, k]`: the row
/// tile follows the mean rows per active expert, the split count assumes `min(E, P)` active experts.
pub fn plan_moe(gpu: &Gpu, pairs: usize, n_experts: usize, n: usize, k: usize) -> Plan {
    let active = pairs.min(n_experts).max(1);
    if gpu.batch_invariant() && pairs <= 8 * INVARIANT_MAX_ROWS {
        // One token's plan (its top-8 experts, a row each) for every row count.
        let one = plan_for(gpu, 1, 8.min(n_experts.max(1)), 8, n, k).kbps;
        return invariant_plan(gpu, mt_for(pairs.div_ceil(active)), one, n, k);
    }
    if large_moe(pairs, n_experts) && gpu.max_smem >= LARGE_SMEM {
        return Plan {
            mt: LARGE_TILE / 8,
            splits: 1,
            kbps: k / K_STEP,
            smem: LARGE_SMEM,
            large: true,
        };
    }
    let mt = mt_for(pairs.div_ceil(active));
    plan_for(gpu, mt, active, pairs, n, k)
}

fn check_weights(
    op: &'static str,
    packed: &CudaView<'_, u8>,
    scales: &CudaView<'_, bf16>,
    experts: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    ensure(op, k > 0 && k.is_multiple_of(K_STEP), || {
        format!("K={k} must be a positive multiple of {K_STEP}")
    })?;
    ensure(op, n > 0 && n.is_multiple_of(N_STEP), || {
        format!("N={n} must be a positive multiple of {N_STEP}")
    })?;
    ensure(op, packed.len() == experts * n * k / 2, || {
        format!(
            "packed has {} bytes, expected E={experts} x N={n} x K/2={}",
            packed.len(),
            k / 2
        )
    })?;
    ensure(op, scales.len() == experts * n * k / 32, || {
        format!(
            "scales has {} elements, expected E={experts} x N={n} x K/32={}",
            scales.len(),
            k / 32
        )
    })?;
    Ok(())
}

fn check_x(op: &'static str, gpu: &Gpu, x: &CudaView<'_, bf16>, rows: usize, ld_x: usize, k: usize) -> Result<()> {
    ensure(op, ld_x >= k && ld_x.is_multiple_of(8), || {
        format!("ld_x={ld_x} must be >= K={k} and a multiple of 8")
    })?;
    need_len(op, "x", x.len(), span(rows, ld_x, k))?;
    ensure(op, addr(gpu, x).is_multiple_of(16), || {
        format!("x must be 16-byte aligned (address {:#x})", addr(gpu, x))
    })
}

/// Checks that a launch's (row block, tile) counters fit [`crate::cuda::GEMM_COUNTERS`].
fn check_counters(op: &'static str, grid: (u32, u32, u32)) -> Result<()> {
    let need = grid.0 as usize * grid.2 as usize;
    ensure(op, need <= crate::cuda::GEMM_COUNTERS, || {
        format!(
            "{need} (row block, tile) pairs exceed the {} split-K counters",
            crate::cuda::GEMM_COUNTERS
        )
    })
}

/// Dense W4A16 GEMM: `out[m, :n] = bf16(x[m, :k] · dequant(packed, scales)^T)` for m < `m_rows`, x rows
/// `ld_x` apart (16-byte aligned), out rows `ld_out` apart. `ws` is an f32 workspace of at least
/// `plan_dense(gpu, m_rows, n, k).workspace_len(m_rows, n)` elements. One launch (split-K reduced inside).
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn w4a16_gemm(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    ld_x: usize,
    m_rows: usize,
    packed: &CudaView<'_, u8>,
    scales: &CudaView<'_, bf16>,
    n: usize,
    k: usize,
    ws: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
    ld_out: usize,
) -> Result<()> {
    check_weights(OP, packed, scales, 1, n, k)?;
    check_x(OP, gpu, x, m_rows, ld_x, k)?;
    ensure(OP, ld_out >= n, || format!("ld_out={ld_out} must be >= N={n}"))?;
    need_len(OP, "out", out.len(), span(m_rows, ld_out, n))?;
    if m_rows == 0 {
        return Ok(());
    }
    let p = plan_dense(gpu, m_rows, n, k);
    need_len(OP, "workspace", ws.len(), p.workspace_len(m_rows, n))?;
    let tiles = m_rows.div_ceil(p.tile_rows());
    ensure(OP, tiles <= 65535, || {
        format!("M={m_rows} needs {tiles} row tiles, over the grid limit 65535")
    })?;
    let (lx, mm, nn, kk, kb) = (
        as_i32(OP, "ld_x", ld_x)?,
        as_i32(OP, "M", m_rows)?,
        as_i32(OP, "N", n)?,
        as_i32(OP, "K", k)?,
        as_i32(OP, "kbps", p.kbps)?,
    );
    let name = DENSE[p.mt.trailing_zeros() as usize];
    let grid = (n.div_ceil(ROWS_PER_CTA) as u32, p.splits as u32, tiles as u32);
    check_counters(OP, grid)?;
    let lo = as_i32(OP, "ld_out", ld_out)?;
    let (mut xp, mut wp, mut sp, mut wsp, mut op, mut cp) = (
        addr(gpu, x),
        addr(gpu, packed),
        addr(gpu, scales),
        addr_mut(gpu, ws),
        addr_mut(gpu, out),
        counters(gpu),
    );
    let (mut lx, mut mm, mut nn, mut kk, mut kb, mut lo) = (lx, mm, nn, kk, kb, lo);
    let mut params = [
        arg(&mut xp),
        arg(&mut lx),
        arg(&mut mm),
        arg(&mut wp),
        arg(&mut sp),
        arg(&mut nn),
        arg(&mut kk),
        arg(&mut kb),
        arg(&mut wsp),
        arg(&mut op),
        arg(&mut lo),
        arg(&mut cp),
    ];
    // SAFETY: weights, x, workspace and out lengths checked above, the counters cover the grid; the kernel
    // reads x rows < M, k < K, writes ws[s, m < M, n < N] and out[m < M, n < N].
    unsafe { launch_pdl(gpu, OP, name, launch_cfg(grid, 128, p.smem as u32), &mut params) }
}

/// A kernel argument for [`launch_pdl`].
fn arg<T>(v: &mut T) -> *mut std::ffi::c_void {
    (v as *mut T).cast()
}

/// The device address of the GPU's split-K counters.
fn counters(gpu: &Gpu) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = gpu.gemm_counters.device_ptr(&gpu.stream);
    p
}

/// Device-side routing of the grouped form, from [`super::moe_align::moe_align`].
pub struct Routing<'a> {
    /// `[P]` pair indices grouped by expert.
    pub sorted: &'a CudaView<'a, i32>,
    /// `[3, max_tiles]` (expert, start, count) per row tile.
    pub tiles: &'a CudaView<'a, i32>,
    pub max_tiles: usize,
    /// `[1]` number of valid tiles.
    pub n_tiles: &'a CudaView<'a, i32>,
    /// Row tile used by moe_align (must equal the plan's `tile_rows()`).
    pub tile_rows: usize,
}

/// The x operand of [`moe_w4a16`].
#[derive(Clone, Copy)]
pub enum MoeX<'a, 'b> {
    /// Pair p reads row `p / row_div` of `x` (rows `ld` apart, `k` wide): `row_div` = top_k when x is the
    /// tokens' hidden state, 1 when x is per pair.
    Rows {
        x: &'a CudaView<'b, bf16>,
        ld: usize,
        row_div: usize,
    },
    /// Pair p reads `silu(gate) * up` of the `[gate | up]` row p of `gu` (gate `k` wide, up after it, rows
    /// `ld >= 2k` apart): the down projection's SwiGLU fused into the GEMM's x staging and rounded to bf16
    /// exactly as [`super::silu_mul::silu_mul`] does.
    SiluGateUp { gu: &'a CudaView<'b, bf16>, ld: usize },
}

/// The sizes of a [`moe_w4a16`] launch: `pairs` (token, slot) rows, `n_experts` experts whose weights are
/// `[E, n, k/2]` packed with `[E, n, k/32]` scales.
#[derive(Clone, Copy, Debug)]
pub struct MoeDims {
    pub pairs: usize,
    pub n_experts: usize,
    pub n: usize,
    pub k: usize,
}

/// Grouped MoE W4A16 GEMM over `d.pairs` (token, slot) rows: row p uses expert `ids[p]` (through `r`,
/// computed on the device) and the x row [`MoeX`] names. With one weight matrix `(packed, scales)`,
/// `out[p, :n]`; with two (gate and up: the `[gate | up]` rows [`MoeX::SiluGateUp`] reads), the first's
/// columns at `out[p, :n]` and the second's at `out[p, n..2n]`; rows `ld_out` apart. `ws` holds
/// `plan_moe(gpu, pairs, E, width, k).workspace_len(pairs, width)` f32, width = n × matrices. Blocks
/// beyond the device-side tile count exit at once. Launch contract: no allocation, no host sync,
/// graph-capturable; one launch.
pub fn moe_w4a16(
    gpu: &Gpu,
    x: MoeX<'_, '_>,
    r: &Routing<'_>,
    mats: &[(&CudaView<'_, u8>, &CudaView<'_, bf16>)],
    d: MoeDims,
    ws: &mut CudaViewMut<'_, f32>,
    (out, ld_out): (&mut CudaViewMut<'_, bf16>, usize),
) -> Result<()> {
    let MoeDims { pairs, n_experts, n, k } = d;
    let nmat = mats.len();
    ensure(OP_MOE, nmat == 1 || nmat == 2, || {
        format!("{nmat} weight matrices (1 or 2)")
    })?;
    for (packed, scales) in mats {
        check_weights(OP_MOE, packed, scales, n_experts, n, k)?;
    }
    let (x, ld_x, x_row_div, silu) = match x {
        MoeX::Rows { x, ld, row_div } => (x, ld, row_div, false),
        MoeX::SiluGateUp { gu, ld } => {
            ensure(OP_MOE, ld >= 2 * k, || {
                format!("ld_gu={ld} must hold gate and up ({} elements)", 2 * k)
            })?;
            (gu, ld, 1, true)
        }
    };
    ensure(OP_MOE, x_row_div >= 1, || "x_row_div must be >= 1".into())?;
    let x_width = if silu { 2 * k } else { k };
    check_x(OP_MOE, gpu, x, pairs.div_ceil(x_row_div), ld_x, x_width)?;
    let width = nmat * n;
    ensure(OP_MOE, ld_out >= width, || {
        format!("ld_out={ld_out} must be >= {width}")
    })?;
    need_len(OP_MOE, "out", out.len(), span(pairs, ld_out, width))?;
    if pairs == 0 {
        return Ok(());
    }
    let p = plan_moe(gpu, pairs, n_experts, width, k);
    ensure(OP_MOE, r.tile_rows == p.tile_rows(), || {
        format!(
            "routing tiles have {} rows, the plan needs {}",
            r.tile_rows,
            p.tile_rows()
        )
    })?;
    ensure(
        OP_MOE,
        r.max_tiles == super::moe_align::max_tiles(pairs, n_experts, r.tile_rows),
        || format!("max_tiles={} does not match P={pairs}, E={n_experts}", r.max_tiles),
    )?;
    need_len(OP_MOE, "sorted", r.sorted.len(), pairs)?;
    need_len(OP_MOE, "tiles", r.tiles.len(), 3 * r.max_tiles)?;
    need_len(OP_MOE, "n_tiles", r.n_tiles.len(), 1)?;
    need_len(OP_MOE, "workspace", ws.len(), p.workspace_len(pairs, width))?;
    ensure(OP_MOE, r.max_tiles <= 65535, || {
        format!("max_tiles={} exceeds the grid limit 65535", r.max_tiles)
    })?;
    if p.large {
        return launch_large(gpu, x, ld_x, x_row_div, silu, r, mats, d, (out, ld_out));
    }
    let grid = (
        (nmat * n.div_ceil(ROWS_PER_CTA)) as u32,
        p.splits as u32,
        r.max_tiles as u32,
    );
    check_counters(OP_MOE, grid)?;
    let (mut lx, mut div, mut silu_off, mut pp, mut mt, mut nm, mut nn, mut kk, mut kb, mut lo) = (
        as_i32(OP_MOE, "ld_x", ld_x)?,
        as_i32(OP_MOE, "x_row_div", x_row_div)?,
        as_i32(OP_MOE, "k", if silu { k } else { 0 })?,
        as_i32(OP_MOE, "P", pairs)?,
        as_i32(OP_MOE, "max_tiles", r.max_tiles)?,
        nmat as i32,
        as_i32(OP_MOE, "N", n)?,
        as_i32(OP_MOE, "K", k)?,
        as_i32(OP_MOE, "kbps", p.kbps)?,
        as_i32(OP_MOE, "ld_out", ld_out)?,
    );
    let mut xp = addr(gpu, x);
    let [mut sorted, mut tiles, mut n_tiles, mut p0, mut s0, mut p1, mut s1] = grouped_addrs(gpu, r, mats);
    let (mut wsp, mut op, mut cp) = (addr_mut(gpu, ws), addr_mut(gpu, out), counters(gpu));
    let mut params = [
        arg(&mut xp),
        arg(&mut lx),
        arg(&mut div),
        arg(&mut silu_off),
        arg(&mut pp),
        arg(&mut sorted),
        arg(&mut tiles),
        arg(&mut mt),
        arg(&mut n_tiles),
        arg(&mut p0),
        arg(&mut s0),
        arg(&mut p1),
        arg(&mut s1),
        arg(&mut nm),
        arg(&mut nn),
        arg(&mut kk),
        arg(&mut kb),
        arg(&mut wsp),
        arg(&mut op),
        arg(&mut lo),
        arg(&mut cp),
    ];
    let name = if silu { GROUPED_SILU } else { GROUPED }[p.mt.trailing_zeros() as usize];
    // SAFETY: as the dense form; expert ids come from moe_align, which drops ids outside [0, E); with silu
    // the x rows hold 2k elements (checked).
    unsafe { launch_pdl(gpu, OP_MOE, name, launch_cfg(grid, 128, p.smem as u32), &mut params) }
}

/// Device addresses both grouped forms take: the routing (sorted, tiles, n_tiles), then the first matrix's packed
/// weights and scales and the second's (the first's again when there is one).
fn grouped_addrs(gpu: &Gpu, r: &Routing<'_>, mats: &[(&CudaView<'_, u8>, &CudaView<'_, bf16>)]) -> [u64; 7] {
    let (p0, s0) = (addr(gpu, mats[0].0), addr(gpu, mats[0].1));
    let (p1, s1) = match mats.get(1) {
        Some((pk, sc)) => (addr(gpu, pk), addr(gpu, sc)),
        None => (p0, s0),
    };
    [
        addr(gpu, r.sorted),
        addr(gpu, r.tiles),
        addr(gpu, r.n_tiles),
        p0,
        s0,
        p1,
        s1,
    ]
}

/// The large-M grouped form of [`moe_w4a16`] (checked there: weights, x, out, routing).
#[allow(clippy::too_many_arguments)]
fn launch_large(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    ld_x: usize,
    x_row_div: usize,
    silu: bool,
    r: &Routing<'_>,
    mats: &[(&CudaView<'_, u8>, &CudaView<'_, bf16>)],
    d: MoeDims,
    (out, ld_out): (&mut CudaViewMut<'_, bf16>, usize),
) -> Result<()> {
    let MoeDims { pairs, n, k, .. } = d;
    ensure(OP_MOE, !silu, || {
        format!("{pairs} pairs take the large-M form, whose x is plain rows: run silu_mul before the down GEMM")
    })?;
    ensure(OP_MOE, ld_x.is_multiple_of(8) && ld_out.is_multiple_of(8), || {
        format!("the large-M form needs ld_x ({ld_x}) and ld_out ({ld_out}) multiples of 8")
    })?;
    let (mut xp, mut op) = (addr(gpu, x), addr_mut(gpu, out));
    ensure(OP_MOE, xp % 16 == 0 && op % 16 == 0, || {
        "the large-M form needs x and out 16-byte aligned".into()
    })?;
    let nmat = mats.len();
    let grid = ((nmat * n.div_ceil(LARGE_TILE)) as u32, r.max_tiles as u32, 1);
    let (mut lx, mut div, mut mt, mut nm, mut nn, mut kk, mut lo) = (
        as_i32(OP_MOE, "ld_x", ld_x)?,
        as_i32(OP_MOE, "x_row_div", x_row_div)?,
        as_i32(OP_MOE, "max_tiles", r.max_tiles)?,
        nmat as i32,
        as_i32(OP_MOE, "N", n)?,
        as_i32(OP_MOE, "K", k)?,
        as_i32(OP_MOE, "ld_out", ld_out)?,
    );
    let [mut sorted, mut tiles, mut n_tiles, mut p0, mut s0, mut p1, mut s1] = grouped_addrs(gpu, r, mats);
    let mut params = [
        arg(&mut xp),
        arg(&mut lx),
        arg(&mut div),
        arg(&mut sorted),
        arg(&mut tiles),
        arg(&mut mt),
        arg(&mut n_tiles),
        arg(&mut p0),
        arg(&mut s0),
        arg(&mut p1),
        arg(&mut s1),
        arg(&mut nm),
        arg(&mut nn),
        arg(&mut kk),
        arg(&mut op),
        arg(&mut lo),
    ];
    // SAFETY: shapes, lengths and alignment checked here and by moe_w4a16; rows come from moe_align (ids
    // outside [0, E) dropped), every x row read is < ceil(pairs / x_row_div) and every out row < pairs.
    unsafe {
        launch_pdl(
            gpu,
            OP_MOE,
            LARGE,
            launch_cfg(grid, LARGE_TILE as u32, LARGE_SMEM as u32),
            &mut params,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// H200 figures (132 SMs, 228 KB of shared memory per SM, 227 KB per block opt-in).
    const H200: Device = Device {
        sms: 132,
        smem_per_sm: 233_472,
        max_smem: 232_448,
        blocks_per_sm: BLOCKS_PER_SM,
        max_splits: 64,
    };

    #[test]
    fn smem_row_stride_avoids_bank_conflicts_and_holds_the_slice() {
        for kbps in 1..=56 {
            let rs = smem_row_stride(kbps);
            assert_eq!(rs / 8 % 16, 4, "kbps={kbps}: stride {rs} / 8 must be 4 mod 16");
            assert!(
                rs >= kbps * 4 * GROUP_BYTES_SMEM && rs < kbps * 4 * GROUP_BYTES_SMEM + 128,
                "kbps={kbps}: stride {rs}"
            );
            assert_eq!(rs % 16, 0, "kbps={kbps}: rows must stay 16-byte aligned");
        }
    }

    #[test]
    fn plans_cover_k_with_nonempty_splits_and_fit_four_blocks_per_sm() {
        for &(n, k) in &[
            (4096, 7168),
            (7168, 2048),
            (512, 7168),
            (7168, 256),
            (32, 128),
            (160, 384),
        ] {
            for mt in [1, 2, 4] {
                for tiles in [1, 2, 8, 40] {
                    let p = plan_on(H200, mt, tiles, 8 * mt * tiles, n, k);
                    let nkb = k / K_STEP;
                    assert!(
                        p.kbps >= 1 && p.splits * p.kbps >= nkb && (p.splits - 1) * p.kbps < nkb,
                        "{p:?} for K={k}"
                    );
                    assert!(
                        p.smem * BLOCKS_PER_SM <= H200.smem_per_sm || p.kbps == 1,
                        "{p:?}: smem over a quarter SM"
                    );
                    assert_eq!(p.smem, 8 * mt * smem_row_stride(p.kbps));
                }
            }
        }
    }

    /// The large form gives the small form's bits where the small form runs one split (the kernel's comment): at
    /// K <= 512 from 5 rows on, at every row tile and tile count, on the H200's figures; at K = 7168 never.
    #[test]
    fn small_form_runs_one_split_at_k_up_to_512() {
        for k in [128, 256, 384, 512] {
            for n in [96, 256, 512, 7168] {
                for mt in [1, 2, 4] {
                    for tiles in [1, 2, 8, 40, 400] {
                        for rows in [5, 8 * mt * tiles, 10_000] {
                            let p = plan_on(H200, mt, tiles, rows, n, k);
                            assert_eq!(p.splits, 1, "{p:?} for N={n} K={k} rows={rows}");
                        }
                    }
                }
            }
        }
        for mt in [1, 2, 4] {
            for tiles in [1, 8, 400] {
                let p = plan_on(H200, mt, tiles, 100_000, 256, 7168);
                assert!(
                    p.splits > 1,
                    "{p:?}: K = 7168 in one split would need {} B of x",
                    8 * mt * 7168 * 2
                );
            }
        }
    }
}
