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
