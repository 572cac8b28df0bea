//! Latent KV compaction wrapper for kernels/cuda/kv_compact.cu. CPU twin: `crate::cpu::ops::kv_compact`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "kv_compact";

/// For every layer of `cache` (`[layers, rows_per_layer, width]` bf16), move rows `committed + path[i]` to
/// `committed + i` in order. `path` `[n]` i32 holds strictly increasing node indices with `path[i] >= i`
/// (a root-to-node path of the last forward; the caller checks it on the host), all below
/// `rows_per_layer − committed`. Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn kv_compact(
    gpu: &Gpu,
    cache: &mut CudaViewMut<'_, bf16>,
    layers: usize,
    rows_per_layer: usize,
    width: usize,
    committed: usize,
    path: &CudaView<'_, i32>,
    n: usize,
) -> Result<()> {
    need_len(OP, "cache", cache.len(), layers * rows_per_layer * width)?;
    need_len(OP, "path", path.len(), n)?;
    ensure(OP, committed + n <= rows_per_layer, || {
        format!("committed={committed} + n={n} exceeds {rows_per_layer} rows")
    })?;
    if layers == 0 || n == 0 {
        return Ok(());
    }
    let stride = (rows_per_layer * width) as i64;
    let (w, c, nn) = (
        as_i32(OP, "width", width)?,
        as_i32(OP, "committed", committed)?,
        as_i32(OP, "n", n)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_kv_compact_bf16"));
    let null: u64 = 0;
    b.arg(cache)
        .arg(&stride)
        .arg(&w)
        .arg(&c)
        .arg(&null)
        .arg(path)
        .arg(&nn)
        .arg(&null);
    // SAFETY: the cache holds layers x rows_per_layer x width; path entries are checked by the caller.
    unsafe { b.launch(launch_cfg((layers as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// [`kv_compact`] of a path the device wrote: `committed` and the path length are read from `committed_dev`
/// and `n_dev` (`[1]` i32 each; the walk's length is at most `max_n` = `path.len()`), so a captured round
/// replays at any committed length. The caller reserved `committed + max_n <= rows_per_layer` on the host
/// (`committed_host`, the mirror of `committed_dev`). Launch contract: one kernel, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn kv_compact_dev(
    gpu: &Gpu,
    cache: &mut CudaViewMut<'_, bf16>,
    layers: usize,
    rows_per_layer: usize,
    width: usize,
    committed_host: usize,
    committed_dev: &CudaView<'_, i32>,
    path: &CudaView<'_, i32>,
    n_dev: &CudaView<'_, i32>,
) -> Result<()> {
    need_len(OP, "cache", cache.len(), layers * rows_per_layer * width)?;
    need_len(OP, "committed_dev", committed_dev.len(), 1)?;
    need_len(OP, "n_dev", n_dev.len(), 1)?;
    let max_n = path.len();
    ensure(OP, committed_host + max_n <= rows_per_layer, || {
        format!("committed={committed_host} + a path of up to {max_n} exceeds {rows_per_layer} rows")
    })?;
    if layers == 0 || max_n == 0 {
        return Ok(());
    }
    let stride = (rows_per_layer * width) as i64;
    let (w, mn) = (as_i32(OP, "width", width)?, as_i32(OP, "n", max_n)?);
    let zero = 0i32;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_kv_compact_bf16"));
    b.arg(cache)
        .arg(&stride)
        .arg(&w)
        .arg(&zero)
        .arg(committed_dev)
        .arg(path)
        .arg(&mn)
        .arg(n_dev);
    // SAFETY: the cache holds layers x rows_per_layer x width; the walk kernel wrote a strictly increasing
    // path of n_dev <= max_n node indices of the verified tree, all below its scratch rows.
    unsafe { b.launch(launch_cfg((layers as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
