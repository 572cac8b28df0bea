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

/// Caches one [`kv_compact_segs`] launch compacts (`COMPACT_SEGS` in the kernel).
pub const MAX_SEGS: usize = 64;

/// One cache of [`kv_compact_segs`]: its storage (`[layers, rows_per_layer, width]` bf16), its committed length
/// where the ops read it (`committed_host` its mirror), and its walk (`[len, path[max_n], ..]`).
pub struct CompactSeg<'a> {
    pub cache: CudaViewMut<'a, bf16>,
    pub rows_per_layer: usize,
    pub committed_host: usize,
    pub committed_dev: CudaView<'a, i32>,
    pub walk: CudaView<'a, i32>,
    pub max_n: usize,
}

/// The kernel's by-value table (`struct CompactSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct CompactSegsArg {
    cache: [u64; MAX_SEGS],
    pos: [u64; MAX_SEGS],
    walk: [u64; MAX_SEGS],
    stride: [i64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct CompactSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for CompactSegsArg {}

/// [`kv_compact_dev`] of up to [`MAX_SEGS`] caches of `layers` layers in one launch, each along its own walk:
/// the same moves. Launch contract: one kernel, graph-capturable.
pub fn kv_compact_segs(gpu: &Gpu, segs: &mut [CompactSeg<'_>], layers: usize, width: usize) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} caches in one launch (at most {MAX_SEGS})")
    })?;
    if nseg == 0 || layers == 0 {
        return Ok(());
    }
    let mut arg = CompactSegsArg {
        cache: [0; MAX_SEGS],
        pos: [0; MAX_SEGS],
        walk: [0; MAX_SEGS],
        stride: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(3 * nseg);
    for (i, c) in segs.iter_mut().enumerate() {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        need_len(OP, "cache", c.cache.len(), layers * c.rows_per_layer * width)?;
        need_len(OP, "committed_dev", c.committed_dev.len(), 1)?;
        need_len(OP, "walk", c.walk.len(), 1 + c.max_n)?;
        ensure(OP, c.committed_host + c.max_n <= c.rows_per_layer, || {
            format!(
                "committed={} + a path of up to {} exceeds {} rows",
                c.committed_host, c.max_n, c.rows_per_layer
            )
        })?;
        let s = &gpu.stream;
        let (p0, g0) = c.cache.device_ptr_mut(s);
        let (p1, g1) = c.committed_dev.device_ptr(s);
        let (p2, g2) = c.walk.device_ptr(s);
        guards.push(g0);
        guards.extend([g1, g2]);
        (arg.cache[i], arg.pos[i], arg.walk[i]) = (p0, p1, p2);
        arg.stride[i] = (c.rows_per_layer * width) as i64;
    }
    let w = as_i32(OP, "width", width)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_kv_compact_segs_bf16"));
    b.arg(&arg).arg(&w);
    // SAFETY: each cache holds layers x rows_per_layer x width and room for its committed rows + max_n (checked
    // against the host mirrors); each walk is a strictly increasing path of at most max_n of its tree's nodes.
    unsafe { b.launch(launch_cfg((layers as u32, nseg as u32, 1), 128, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}
