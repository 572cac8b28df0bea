//! W4A16 group-32 GEMM wrappers for kernels/cuda/w4a16_gemm.cu (dense and grouped-MoE forms) and the
//! split-K plan they share. CPU twin: `crate::cpu::ops::matmul_i4g32` (weights in the converter's layout:
//! packed `[N, K/2]` u8, low nibble = even k, offset 8; scales `[N, K/32]` bf16; formats/FORMAT.md).
//!
//! Plan: the grid is (N/128 row blocks) x (S k-splits) x (row tiles of 8, 16 or 32 rows). S is chosen so
//! that there are about four blocks per SM (M = 1 decode on a 512-row TP slice still fills the GPU), and
//! limited so that the shared memory holding the block's slice of x lets four blocks stay resident. Partials go to an f32 workspace
//! `[S, rows, N]`, reduced in split order by a second kernel (deterministic; no atomics).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{addr, as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "w4a16_gemm";
const OP_MOE: &str = "moe_w4a16_gemm";
/// k per kernel step (4 groups of 32) and rows per block (4 warps x 32); N and K must be multiples.
pub const K_STEP: usize = 128;
pub const N_STEP: usize = 32;
const ROWS_PER_CTA: usize = 128;
const GROUP_BYTES_SMEM: usize = 72;
/// Blocks per SM the split-K count aims at (4 fit by registers: 128 threads x 128 registers); enough
/// warps with 192 bytes in flight per lane to cover HBM latency at M = 1.
const BLOCKS_PER_SM: usize = 4;

const DENSE: [&str; 3] = ["kdtree_w4a16_gemm_i4g32_m1", "kdtree_w4a16_gemm_i4g32_m2", "kdtree_w4a16_gemm_i4g32_m4"];
const GROUPED: [&str; 3] = ["kdtree_moe_w4a16_gemm_i4g32_m1", "kdtree_moe_w4a16_gemm_i4g32_m2", "kdtree_moe_w4a16_gemm_i4g32_m4"];

/// Raises the dynamic shared memory limit of the GEMM kernels to the device's opt-in maximum (called once
/// by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    let smem = gpu.max_smem.saturating_sub(1024) as i32;
    for name in DENSE.iter().chain(GROUPED.iter()) {
        gpu.func(name)
            .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
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
}

impl Plan {
    pub fn tile_rows(&self) -> usize {
        8 * self.mt
    }
    /// Workspace elements (f32) for `rows` output rows of width `n`: `[splits, rows, n]`.
    pub fn workspace_len(&self, rows: usize, n: usize) -> usize {
        self.splits * rows * n
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

/// The plan for `row_tiles` tiles of `8 mt` rows over an `[n, k]` weight matrix.
fn plan_for(gpu: &Gpu, mt: usize, row_tiles: usize, n: usize, k: usize) -> Plan {
    plan_on(Device { sms: gpu.sms, smem_per_sm: gpu.smem_per_sm, max_smem: gpu.max_smem }, mt, row_tiles, n, k)
}

/// The device figures a plan depends on.
#[derive(Clone, Copy)]
struct Device {
    sms: usize,
    smem_per_sm: usize,
    max_smem: usize,
}

fn plan_on(gpu: Device, mt: usize, row_tiles: usize, n: usize, k: usize) -> Plan {
    let nkb = (k / K_STEP).max(1);
    let blocks = n.div_ceil(ROWS_PER_CTA) * row_tiles.max(1);
    let want = (BLOCKS_PER_SM * gpu.sms).div_ceil(blocks).clamp(1, nkb);
    let mut kbps = nkb.div_ceil(want);
    // Shared memory per block small enough for BLOCKS_PER_SM blocks to be resident (1 KB per block is
    // reserved by the system, plus the static row maps).
    let budget = (gpu.smem_per_sm / BLOCKS_PER_SM).saturating_sub(1024 + 512).min(gpu.max_smem.saturating_sub(1024));
    while kbps > 1 && 8 * mt * smem_row_stride(kbps) > budget {
        kbps -= 1;
    }
    Plan { mt, splits: nkb.div_ceil(kbps), kbps, smem: 8 * mt * smem_row_stride(kbps) }
}

/// Plan of the dense form for `m` rows of x over an `[n, k]` matrix.
pub fn plan_dense(gpu: &Gpu, m: usize, n: usize, k: usize) -> Plan {
    let mt = mt_for(m);
    plan_for(gpu, mt, m.div_ceil(8 * mt), n, k)
}

/// Plan of the grouped form for `pairs` (token, slot) rows over `n_experts` experts of `[n, k]`: the row
/// tile follows the mean rows per active expert, the split count assumes `min(E, P)` active experts.
pub fn plan_moe(gpu: &Gpu, pairs: usize, n_experts: usize, n: usize, k: usize) -> Plan {
    let active = pairs.min(n_experts).max(1);
    let mt = mt_for(pairs.div_ceil(active));
    plan_for(gpu, mt, active, n, k)
}

fn check_weights(
    op: &'static str,
    packed: &CudaView<'_, u8>,
    scales: &CudaView<'_, bf16>,
    experts: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    ensure(op, k > 0 && k.is_multiple_of(K_STEP), || format!("K={k} must be a positive multiple of {K_STEP}"))?;
    ensure(op, n > 0 && n.is_multiple_of(N_STEP), || format!("N={n} must be a positive multiple of {N_STEP}"))?;
    ensure(op, packed.len() == experts * n * k / 2, || {
        format!("packed has {} bytes, expected E={experts} x N={n} x K/2={}", packed.len(), k / 2)
    })?;
    ensure(op, scales.len() == experts * n * k / 32, || {
        format!("scales has {} elements, expected E={experts} x N={n} x K/32={}", scales.len(), k / 32)
    })?;
    Ok(())
}

fn check_x(op: &'static str, gpu: &Gpu, x: &CudaView<'_, bf16>, rows: usize, ld_x: usize, k: usize) -> Result<()> {
    ensure(op, ld_x >= k && ld_x.is_multiple_of(8), || format!("ld_x={ld_x} must be >= K={k} and a multiple of 8"))?;
    need_len(op, "x", x.len(), span(rows, ld_x, k))?;
    ensure(op, addr(gpu, x).is_multiple_of(16), || format!("x must be 16-byte aligned (address {:#x})", addr(gpu, x)))
}

/// Split-K reduce: `out[r, :n] = bf16(sum_s ws[s, r, :])`, rows `ld_out` apart.
#[allow(clippy::too_many_arguments)]
fn reduce(
    gpu: &Gpu,
    op: &'static str,
    ws: &CudaView<'_, f32>,
    splits: usize,
    rows: usize,
    n: usize,
    out: &mut CudaViewMut<'_, bf16>,
    ld_out: usize,
) -> Result<()> {
    let total = rows * n;
    let (s, r, nn, l) = (as_i32(op, "splits", splits)?, as_i32(op, "rows", rows)?, as_i32(op, "N", n)?, as_i32(op, "ld_out", ld_out)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_w4a16_reduce_f32"));
    b.arg(ws).arg(&s).arg(&r).arg(&nn).arg(out).arg(&l);
    // SAFETY: ws holds splits x rows x n (checked by the callers), out holds rows rows of ld_out >= n.
    unsafe { b.launch(launch_cfg((total.div_ceil(256) as u32, 1, 1), 256, 0)) }.map_err(drv(op))?;
    Ok(())
}

/// Dense W4A16 GEMM: `out[m, :n] = bf16(x[m, :k] · dequant(packed, scales)^T)` for m < `m_rows`, x rows
/// `ld_x` apart (16-byte aligned), out rows `ld_out` apart. `ws` is an f32 workspace of at least
/// `plan_dense(gpu, m_rows, n, k).workspace_len(m_rows, n)` elements. Two launches (GEMM, split reduce).
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
    ensure(OP, tiles <= 65535, || format!("M={m_rows} needs {tiles} row tiles, over the grid limit 65535"))?;
    let (lx, mm, nn, kk, kb) =
        (as_i32(OP, "ld_x", ld_x)?, as_i32(OP, "M", m_rows)?, as_i32(OP, "N", n)?, as_i32(OP, "K", k)?, as_i32(OP, "kbps", p.kbps)?);
    let name = DENSE[p.mt.trailing_zeros() as usize];
    let mut b = gpu.stream.launch_builder(gpu.func(name));
    b.arg(x).arg(&lx).arg(&mm).arg(packed).arg(scales).arg(&nn).arg(&kk).arg(&kb).arg(&mut *ws);
    let grid = (n.div_ceil(ROWS_PER_CTA) as u32, p.splits as u32, tiles as u32);
    // SAFETY: weights, x, workspace lengths checked above; the kernel reads x rows < M, k < K and writes
    // ws[s, m < M, n < N].
    unsafe { b.launch(launch_cfg(grid, 128, p.smem as u32)) }.map_err(drv(OP))?;
    reduce(gpu, OP, &ws.as_view(), p.splits, m_rows, n, out, ld_out)
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

/// Grouped MoE W4A16 GEMM over `pairs` (token, slot) rows: row p uses expert `ids[p]` (through `r`,
/// computed on the device), x row `p / x_row_div` (`top_k` when x is the tokens' hidden state, 1 when x is
/// per pair), weights `packed [E, n, k/2]`, `scales [E, n, k/32]`. `out[p, :n]` rows `ld_out` apart; `ws`
/// holds `plan_moe(gpu, pairs, E, n, k).workspace_len(pairs, n)` f32. Blocks beyond the device-side tile
/// count exit at once. Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn moe_w4a16_gemm(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    ld_x: usize,
    x_row_div: usize,
    pairs: usize,
    r: &Routing<'_>,
    packed: &CudaView<'_, u8>,
    scales: &CudaView<'_, bf16>,
    n_experts: usize,
    n: usize,
    k: usize,
    ws: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
    ld_out: usize,
) -> Result<()> {
    check_weights(OP_MOE, packed, scales, n_experts, n, k)?;
    ensure(OP_MOE, x_row_div >= 1, || "x_row_div must be >= 1".into())?;
    check_x(OP_MOE, gpu, x, pairs.div_ceil(x_row_div), ld_x, k)?;
    ensure(OP_MOE, ld_out >= n, || format!("ld_out={ld_out} must be >= N={n}"))?;
    need_len(OP_MOE, "out", out.len(), span(pairs, ld_out, n))?;
    if pairs == 0 {
        return Ok(());
    }
    let p = plan_moe(gpu, pairs, n_experts, n, k);
    ensure(OP_MOE, r.tile_rows == p.tile_rows(), || format!("routing tiles have {} rows, the plan needs {}", r.tile_rows, p.tile_rows()))?;
    ensure(OP_MOE, r.max_tiles == super::moe_align::max_tiles(pairs, n_experts, r.tile_rows), || {
        format!("max_tiles={} does not match P={pairs}, E={n_experts}", r.max_tiles)
    })?;
    need_len(OP_MOE, "sorted", r.sorted.len(), pairs)?;
    need_len(OP_MOE, "tiles", r.tiles.len(), 3 * r.max_tiles)?;
    need_len(OP_MOE, "n_tiles", r.n_tiles.len(), 1)?;
    need_len(OP_MOE, "workspace", ws.len(), p.workspace_len(pairs, n))?;
    ensure(OP_MOE, r.max_tiles <= 65535, || format!("max_tiles={} exceeds the grid limit 65535", r.max_tiles))?;
    let (lx, div, pp, mt, nn, kk, kb) = (
        as_i32(OP_MOE, "ld_x", ld_x)?,
        as_i32(OP_MOE, "x_row_div", x_row_div)?,
        as_i32(OP_MOE, "P", pairs)?,
        as_i32(OP_MOE, "max_tiles", r.max_tiles)?,
        as_i32(OP_MOE, "N", n)?,
        as_i32(OP_MOE, "K", k)?,
        as_i32(OP_MOE, "kbps", p.kbps)?,
    );
    let name = GROUPED[p.mt.trailing_zeros() as usize];
    let mut b = gpu.stream.launch_builder(gpu.func(name));
    b.arg(x).arg(&lx).arg(&div).arg(&pp).arg(r.sorted).arg(r.tiles).arg(&mt).arg(r.n_tiles);
    b.arg(packed).arg(scales).arg(&nn).arg(&kk).arg(&kb).arg(&mut *ws);
    let grid = (n.div_ceil(ROWS_PER_CTA) as u32, p.splits as u32, r.max_tiles as u32);
    // SAFETY: as the dense form; expert ids come from moe_align, which drops ids outside [0, E).
    unsafe { b.launch(launch_cfg(grid, 128, p.smem as u32)) }.map_err(drv(OP_MOE))?;
    reduce(gpu, OP_MOE, &ws.as_view(), p.splits, pairs, n, out, ld_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// H200 figures (132 SMs, 228 KB of shared memory per SM, 227 KB per block opt-in).
    const H200: Device = Device { sms: 132, smem_per_sm: 233_472, max_smem: 232_448 };

    #[test]
    fn smem_row_stride_avoids_bank_conflicts_and_holds_the_slice() {
        for kbps in 1..=56 {
            let rs = smem_row_stride(kbps);
            assert_eq!(rs / 8 % 16, 4, "kbps={kbps}: stride {rs} / 8 must be 4 mod 16");
            assert!(rs >= kbps * 4 * GROUP_BYTES_SMEM && rs < kbps * 4 * GROUP_BYTES_SMEM + 128, "kbps={kbps}: stride {rs}");
            assert_eq!(rs % 16, 0, "kbps={kbps}: rows must stay 16-byte aligned");
        }
    }

    #[test]
    fn plans_cover_k_with_nonempty_splits_and_fit_four_blocks_per_sm() {
        for &(n, k) in &[(4096, 7168), (7168, 2048), (512, 7168), (7168, 256), (32, 128), (160, 384)] {
            for mt in [1, 2, 4] {
                for tiles in [1, 2, 8, 40] {
                    let p = plan_on(H200, mt, tiles, n, k);
                    let nkb = k / K_STEP;
                    assert!(p.kbps >= 1 && p.splits * p.kbps >= nkb && (p.splits - 1) * p.kbps < nkb, "{p:?} for K={k}");
                    assert!(p.smem * BLOCKS_PER_SM <= H200.smem_per_sm || p.kbps == 1, "{p:?}: smem over a quarter SM");
                    assert_eq!(p.smem, 8 * mt * smem_row_stride(p.kbps));
                }
            }
        }
    }
}
