//! MLA absorbed attention wrapper for kernels/cuda/mla_attn.cu (split-KV partials + log-sum-exp merge).
//! CPU twin: the `AttnMode::Absorbed` branch of `crate::model::attention::mla` (scores over the committed
//! prefix plus the node's ancestors, softmax, latent average). STATUS: not yet run on a GPU (written after
//! the 2026-12-01 session's device calls were spent); its parity test is engine/tests/cuda_mla.rs.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{addr, as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "mla_attn";
/// Latent + rope width of a cache row and of an absorbed query head (kv_lora 512 + qk_rope 64).
pub const D: usize = 576;
/// Latent width (kv_lora).
pub const DL: usize = 512;
const HEADS_PER_CTA: usize = 8;
const TILE: usize = 32;

/// Split-KV plan: `splits` blocks along the visible rows, `rows_per_split` rows each (a multiple of 32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub splits: usize,
    pub rows_per_split: usize,
}

impl Plan {
    /// Workspace lengths (f32): partial outputs `[S, T, H, 512]` and (max, sum) `[S, T, H, 2]`.
    pub fn workspace_lens(&self, t: usize, h: usize) -> (usize, usize) {
        (self.splits * t * h * DL, self.splits * t * h * 2)
    }
}

/// Plan for `t` nodes of `h` heads over `committed + t` cache rows: about two blocks per SM.
pub fn plan(gpu: &Gpu, t: usize, h: usize, committed: usize) -> Plan {
    let total = (committed + t).max(1);
    let base = t.max(1) * h.div_ceil(HEADS_PER_CTA).max(1);
    let want = (2 * gpu.sms).div_ceil(base).clamp(1, total.div_ceil(TILE));
    let rows_per_split = total.div_ceil(want).div_ceil(TILE) * TILE;
    Plan { splits: total.div_ceil(rows_per_split), rows_per_split }
}

/// Tree / causal / decode attention of `t` new nodes, `h` heads each: `q [t, h, 576]` bf16 (q_nope absorbed
/// through W_UK, then q_pe roped), `kv [committed + t, 576]` bf16 latent rows (tree node j at slot
/// committed + j), `mask [t, words]` u64 (bit j of row i: node j is node i or an ancestor; words >=
/// ceil(t / 64)), `scale` the softmax scale. Writes `out [t, h, 512]` bf16 (apply W_UV next). `o_part` and
/// `ml_part` are f32 workspaces of `plan(..).workspace_lens(t, h)`. Two launches.
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn mla_attn(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    kv: &CudaView<'_, bf16>,
    mask: &CudaView<'_, u64>,
    t: usize,
    h: usize,
    committed: usize,
    words: usize,
    scale: f32,
    o_part: &mut CudaViewMut<'_, f32>,
    ml_part: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    ensure(OP, h > 0, || "heads h=0".into())?;
    ensure(OP, words >= t.div_ceil(64), || format!("mask words={words} cannot hold t={t} nodes (needs {})", t.div_ceil(64)))?;
    ensure(OP, q.len() == t * h * D, || format!("q has {} elements, expected t={t} x h={h} x {D}", q.len()))?;
    need_len(OP, "kv", kv.len(), (committed + t) * D)?;
    ensure(OP, mask.len() == t * words, || format!("mask has {} words, expected t={t} x words={words}", mask.len()))?;
    need_len(OP, "out", out.len(), t * h * DL)?;
    if t == 0 {
        return Ok(());
    }
    ensure(OP, addr(gpu, q) % 16 == 0 && addr(gpu, kv) % 16 == 0, || "q and kv must be 16-byte aligned".into())?;
    let p = plan(gpu, t, h, committed);
    let (lo, lm) = p.workspace_lens(t, h);
    need_len(OP, "o_part", o_part.len(), lo)?;
    need_len(OP, "ml_part", ml_part.len(), lm)?;
    ensure(OP, p.splits <= 65535 && h.div_ceil(HEADS_PER_CTA) <= 65535, || format!("grid too large: {} splits, {h} heads", p.splits))?;
    let (tt, hh, c, w, r) = (
        as_i32(OP, "t", t)?,
        as_i32(OP, "h", h)?,
        as_i32(OP, "committed", committed)?,
        as_i32(OP, "words", words)?,
        as_i32(OP, "rows_per_split", p.rows_per_split)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_attn_bf16"));
    b.arg(q).arg(kv).arg(mask).arg(&tt).arg(&hh).arg(&c).arg(&w).arg(&scale).arg(&r).arg(&mut *o_part).arg(&mut *ml_part);
    let grid = (t as u32, h.div_ceil(HEADS_PER_CTA) as u32, p.splits as u32);
    // SAFETY: lengths checked above; the kernel reads kv rows < committed + t and mask words < t x words.
    unsafe { b.launch(launch_cfg(grid, 256, 0)) }.map_err(drv(OP))?;
    let (s, th) = (as_i32(OP, "splits", p.splits)?, as_i32(OP, "t*h", t * h)?);
    let (ov, mv) = (o_part.as_view(), ml_part.as_view());
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_mla_merge_f32"));
    b.arg(&ov).arg(&mv).arg(&s).arg(&th).arg(out);
    // SAFETY: the partials hold splits x t x h entries (checked above); out holds t x h x 512.
    unsafe { b.launch(launch_cfg(((t * h) as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
