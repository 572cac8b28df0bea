//! DDTree walk wrapper for kernels/cuda/ddtree_walk.cu. CPU twin: `crate::ddtree::walk`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "ddtree_walk";

/// Walk a tree of `nodes` (capacity; `n` `[1]` = nodes in use, on the device) given each node's decision
/// (`decisions` `[nodes]`, e.g. the argmax of its verify logits): `path` / `path_dec` `[max_len]` get the
/// accepted nodes (root first) and the decision at each, `len` `[1]` their count. `max_len` = the tree's
/// depth limit + 1. One thread. Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn ddtree_walk(
    gpu: &Gpu,
    decisions: &CudaView<'_, u32>,
    tokens: &CudaView<'_, u32>,
    first_child: &CudaView<'_, i32>,
    next_sibling: &CudaView<'_, i32>,
    n: &CudaView<'_, i32>,
    nodes: usize,
    max_len: usize,
    path: &mut CudaViewMut<'_, i32>,
    path_dec: &mut CudaViewMut<'_, u32>,
    len: &mut CudaViewMut<'_, i32>,
) -> Result<()> {
    ensure(OP, nodes > 0 && max_len > 0, || {
        format!("nodes={nodes} and max_len={max_len} must be > 0")
    })?;
    need_len(OP, "decisions", decisions.len(), nodes)?;
    need_len(OP, "tokens", tokens.len(), nodes)?;
    need_len(OP, "first_child", first_child.len(), nodes)?;
    need_len(OP, "next_sibling", next_sibling.len(), nodes)?;
    need_len(OP, "n", n.len(), 1)?;
    need_len(OP, "path", path.len(), max_len)?;
    need_len(OP, "path_dec", path_dec.len(), max_len)?;
    need_len(OP, "len", len.len(), 1)?;
    let m = as_i32(OP, "max_len", max_len)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_ddtree_walk"));
    b.arg(decisions)
        .arg(tokens)
        .arg(first_child)
        .arg(next_sibling)
        .arg(n)
        .arg(&m)
        .arg(path)
        .arg(path_dec)
        .arg(len);
    // SAFETY: lengths checked above; the kernel stops at max_len and never follows a child index >= n.
    unsafe { b.launch(launch_cfg((1, 1, 1), 1, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Trees one [`ddtree_walk_segs`] launch walks (`WALK_SEGS` in the kernel).
pub const MAX_SEGS: usize = 32;

/// One tree of [`ddtree_walk_segs`]: its decisions (`[nodes]`, e.g. its rows of a batch's decisions), its
/// builder's arrays and size, and its round-result buffer (`[len, path[max_len], path_dec[max_len], ..]`).
pub struct WalkSeg<'a> {
    pub decisions: CudaView<'a, u32>,
    pub tokens: CudaView<'a, u32>,
    pub first_child: CudaView<'a, i32>,
    pub next_sibling: CudaView<'a, i32>,
    pub n: CudaView<'a, i32>,
    pub walk_out: CudaViewMut<'a, i32>,
    pub nodes: usize,
}

/// The kernel's by-value table (`struct WalkSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct WalkSegsArg {
    decisions: [u64; MAX_SEGS],
    tokens: [u64; MAX_SEGS],
    first_child: [u64; MAX_SEGS],
    next_sibling: [u64; MAX_SEGS],
    n: [u64; MAX_SEGS],
    walk_out: [u64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct WalkSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for WalkSegsArg {}

/// [`ddtree_walk`] of up to [`MAX_SEGS`] trees in one launch, each into its `walk_out` (`len`, then `path`
/// and `path_dec` of `max_len` each): the same walks. Launch contract: no allocation, no host sync,
/// graph-capturable.
pub fn ddtree_walk_segs(gpu: &Gpu, segs: &mut [WalkSeg<'_>], max_len: usize) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} walks in one launch (at most {MAX_SEGS})")
    })?;
    ensure(OP, max_len > 0, || "a walk of 0 rows".into())?;
    if nseg == 0 {
        return Ok(());
    }
    let mut arg = WalkSegsArg {
        decisions: [0; MAX_SEGS],
        tokens: [0; MAX_SEGS],
        first_child: [0; MAX_SEGS],
        next_sibling: [0; MAX_SEGS],
        n: [0; MAX_SEGS],
        walk_out: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(6 * nseg);
    for (i, w) in segs.iter_mut().enumerate() {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        need_len(OP, "decisions", w.decisions.len(), w.nodes)?;
        need_len(OP, "tokens", w.tokens.len(), w.nodes)?;
        need_len(OP, "first_child", w.first_child.len(), w.nodes)?;
        need_len(OP, "next_sibling", w.next_sibling.len(), w.nodes)?;
        need_len(OP, "n", w.n.len(), 1)?;
        need_len(OP, "walk_out", w.walk_out.len(), 1 + 2 * max_len)?;
        let s = &gpu.stream;
        let (p0, g0) = w.decisions.device_ptr(s);
        let (p1, g1) = w.tokens.device_ptr(s);
        let (p2, g2) = w.first_child.device_ptr(s);
        let (p3, g3) = w.next_sibling.device_ptr(s);
        let (p4, g4) = w.n.device_ptr(s);
        let (p5, g5) = w.walk_out.device_ptr_mut(s);
        guards.extend([g0, g1, g2, g3, g4]);
        guards.push(g5);
        (arg.decisions[i], arg.tokens[i], arg.first_child[i]) = (p0, p1, p2);
        (arg.next_sibling[i], arg.n[i], arg.walk_out[i]) = (p3, p4, p5);
    }
    let m = as_i32(OP, "max_len", max_len)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_ddtree_walk_segs"));
    b.arg(&arg).arg(&m);
    // SAFETY: every tree's arrays hold its nodes (checked; the builder's children and the size stay below
    // them), every walk_out 1 + 2 max_len words.
    unsafe { b.launch(launch_cfg((nseg as u32, 1, 1), 32, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}
