//! Per-row top-K log-probs wrapper for kernels/cuda/topk_logprobs.cu. CPU twin:
//! `crate::ddtree::top_k_log_probs` (rank order of `sampling::top_k`, `logit - sampling::log_sum_exp`).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "topk_logprobs";

/// Largest K the kernel selects (its shared-memory sort holds 2048 keys).
pub const MAX_K: usize = 2048;

/// Largest split of a row over blocks.
pub const MAX_SPLITS: usize = 64;

/// The workspace of [`topk_logprobs`] for (rows, vocab, K): per-chunk maxima and sums and the chunks'
/// candidate keys, allocated once (the DDTree round's tree workspace holds one).
pub struct TopkWork {
    pub rows: usize,
    pub v: usize,
    pub k: usize,
    /// Chunks per row (S).
    pub splits: usize,
    pmax: CudaSlice<f32>,
    psum: CudaSlice<f64>,
    cand: CudaSlice<u64>,
}

impl TopkWork {
    /// S = enough blocks to fill the GPU about twice, chunks of at least 2048 tokens, at most 32K candidate
    /// keys per row for the merge block, at most [`MAX_SPLITS`].
    pub fn new(gpu: &Gpu, rows: usize, v: usize, k: usize) -> Result<TopkWork> {
        ensure(OP, k > 0 && k <= MAX_K && rows > 0 && v > 0, || {
            format!("rows={rows}, v={v}, k={k}: need rows, v > 0 and 1 <= k <= {MAX_K}")
        })?;
        let splits = (2 * gpu.sms)
            .div_ceil(rows)
            .min(v.div_ceil(2048))
            .min((32768 / k).max(1))
            .clamp(1, MAX_SPLITS);
        Self::with_splits(gpu, rows, v, k, splits)
    }

    /// A workspace for `rows` rows cut into `splits` chunks each (a batch's trees, each row split as its own
    /// tree's workspace splits it: the same log-probs bit for bit).
    pub fn with_splits(gpu: &Gpu, rows: usize, v: usize, k: usize, splits: usize) -> Result<TopkWork> {
        ensure(OP, k > 0 && k <= MAX_K && rows > 0 && v > 0, || {
            format!("rows={rows}, v={v}, k={k}: need rows, v > 0 and 1 <= k <= {MAX_K}")
        })?;
        ensure(OP, (1..=MAX_SPLITS).contains(&splits), || {
            format!("{splits} chunks a row (1..={MAX_SPLITS})")
        })?;
        Ok(TopkWork {
            rows,
            v,
            k,
            splits,
            pmax: gpu.zeros(rows * splits)?,
            psum: gpu.zeros(rows * splits)?,
            cand: gpu.zeros(rows * splits * k)?,
        })
    }
}

/// For each of `rows` rows of `x` (`[rows, ld]` f32, first `v` used): the `k` best tokens in rank order into
/// `tok` `[rows, k]` and their `logit - logsumexp(row)` into `lp` `[rows, k]`. `k <= min(v, MAX_K)`; `work`
/// made for (rows, v, k). Three kernels (chunk maxima, chunk sums and candidates, merge per row).
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn topk_logprobs(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    rows: usize,
    v: usize,
    ld: usize,
    k: usize,
    lp: &mut CudaViewMut<'_, f32>,
    tok: &mut CudaViewMut<'_, u32>,
    work: &mut TopkWork,
) -> Result<()> {
    ensure(OP, v > 0 && ld >= v, || {
        format!("vocab v={v} must be > 0 and <= ld={ld}")
    })?;
    ensure(OP, k > 0 && k <= v && k <= MAX_K, || {
        format!("k={k} must be in 1..=min(v={v}, {MAX_K})")
    })?;
    ensure(OP, (work.rows, work.v, work.k) == (rows, v, k), || {
        format!(
            "a workspace for rows={}, v={}, k={} used for rows={rows}, v={v}, k={k}",
            work.rows, work.v, work.k
        )
    })?;
    need_len(OP, "x", x.len(), span(rows, ld, v))?;
    need_len(OP, "lp", lp.len(), rows * k)?;
    need_len(OP, "tok", tok.len(), rows * k)?;
    if rows == 0 {
        return Ok(());
    }
    ensure(OP, rows <= 65535, || format!("rows={rows} exceeds the grid"))?;
    let s = work.splits;
    let chunk = v.div_ceil(s);
    let (vv, l, kk, ch, si) = (
        as_i32(OP, "v", v)?,
        as_i32(OP, "ld", ld)?,
        as_i32(OP, "k", k)?,
        as_i32(OP, "chunk", chunk)?,
        as_i32(OP, "splits", s)?,
    );
    let grid = (s as u32, rows as u32, 1);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_topk_max_f32"));
    b.arg(x).arg(&vv).arg(&l).arg(&ch).arg(&mut work.pmax);
    // SAFETY: lengths checked above; pmax holds rows x S.
    unsafe { b.launch(launch_cfg(grid, 256, 0)) }.map_err(drv(OP))?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_topk_partial_f32"));
    b.arg(x)
        .arg(&vv)
        .arg(&l)
        .arg(&kk)
        .arg(&ch)
        .arg(&work.pmax)
        .arg(&mut work.psum)
        .arg(&mut work.cand);
    // SAFETY: as above; psum holds rows x S, cand rows x S x k.
    unsafe { b.launch(launch_cfg(grid, 1024, 0)) }.map_err(drv(OP))?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_topk_merge_f32"));
    b.arg(x)
        .arg(&l)
        .arg(&kk)
        .arg(&si)
        .arg(&work.pmax)
        .arg(&work.psum)
        .arg(&work.cand)
        .arg(lp)
        .arg(tok);
    // SAFETY: as above; k <= MAX_K bounds the merge's shared arrays.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), 1024, 0)) }.map_err(drv(OP))?;
    Ok(())
}
