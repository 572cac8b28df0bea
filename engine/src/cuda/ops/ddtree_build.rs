//! DDTree build wrapper for kernels/cuda/ddtree_build.cu. CPU twin: `crate::ddtree::build_tree_from_top_k`.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "ddtree_build";

/// Largest node budget (root excluded) the kernel's shared arrays hold.
pub const MAX_BUDGET: usize = 2048;
/// Largest depth (draft rows) its candidates encode.
pub const MAX_DEPTH: usize = 255;
/// Top-K log-probs (`depths × k` f32) the kernel holds in shared memory; larger ones are read from global.
pub const LP_SMEM_MAX: usize = 16384;
const KERNEL: &str = "kdtree_ddtree_build";
const KERNEL_SEGS: &str = "kdtree_ddtree_build_segs";

/// Dynamic shared memory of a launch: lp when it fits (padded to 8 bytes), then the nodes' f64 log_q.
fn smem_bytes(lp_floats: usize, in_smem: bool, budget: usize) -> usize {
    (if in_smem { lp_floats.div_ceil(2) * 8 } else { 0 }) + (budget + 1) * 8
}

/// Lets the kernel take the largest dynamic shared memory a launch asks for on top of its ~47 KB static
/// arrays (called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    let need = smem_bytes(LP_SMEM_MAX, true, MAX_BUDGET);
    for f in [KERNEL, KERNEL_SEGS] {
        gpu.func(f)
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                need as i32,
            )
            .map_err(drv("ddtree_build configure"))?;
    }
    Ok(())
}

/// The builder's outputs, `[budget + 1]` each, nodes in pop order (node 0 = root); `n_nodes` `[1]` = nodes
/// in use including the root (fewer than budget + 1 only when the top-K runs out).
pub struct TreeOut<'a, 'b> {
    pub tokens: &'a mut CudaViewMut<'b, u32>,
    pub depths: &'a mut CudaViewMut<'b, u32>,
    pub parents: &'a mut CudaViewMut<'b, i32>,
    pub log_q: &'a mut CudaViewMut<'b, f64>,
    pub first_child: &'a mut CudaViewMut<'b, i32>,
    pub next_sibling: &'a mut CudaViewMut<'b, i32>,
    pub n_nodes: &'a mut CudaViewMut<'b, i32>,
}

/// The limits every build launch checks: the budget, the draft rows and the top-K width its kernel holds.
fn check_limits(budget: usize, depths: usize, k: usize) -> Result<()> {
    ensure(OP, budget <= MAX_BUDGET, || {
        format!("budget={budget} exceeds {MAX_BUDGET}")
    })?;
    ensure(OP, depths <= MAX_DEPTH, || {
        format!("{depths} draft rows exceed {MAX_DEPTH}")
    })?;
    ensure(OP, k <= super::topk_logprobs::MAX_K, || {
        format!("k={k} exceeds {}", super::topk_logprobs::MAX_K)
    })
}

/// The lengths of a tree's bonus, tokens, depths and parents buffers against a tree of `n` nodes.
fn check_tree(n: usize, [bonus, tokens, depths, parents]: [usize; 4]) -> Result<()> {
    need_len(OP, "bonus", bonus, 1)?;
    need_len(OP, "tokens", tokens, n)?;
    need_len(OP, "depths", depths, n)?;
    need_len(OP, "parents", parents, n)
}

/// Build the tree of root `bonus` (`[1]` u32 on the device) from the per-depth top-K `lp` / `tok`
/// (`[depths, k]`, rank order) with `budget` nodes. One warp; lp in shared memory when `depths × k <=
/// LP_SMEM_MAX`. Launch contract: no allocation, no host sync,
/// graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn ddtree_build(
    gpu: &Gpu,
    lp: &CudaView<'_, f32>,
    tok: &CudaView<'_, u32>,
    depths: usize,
    k: usize,
    budget: usize,
    bonus: &CudaView<'_, u32>,
    out: TreeOut<'_, '_>,
) -> Result<()> {
    check_limits(budget, depths, k)?;
    need_len(OP, "lp", lp.len(), depths * k)?;
    need_len(OP, "tok", tok.len(), depths * k)?;
    let n = budget + 1;
    check_tree(n, [bonus.len(), out.tokens.len(), out.depths.len(), out.parents.len()])?;
    need_len(OP, "log_q", out.log_q.len(), n)?;
    need_len(OP, "first_child", out.first_child.len(), n)?;
    need_len(OP, "next_sibling", out.next_sibling.len(), n)?;
    need_len(OP, "n_nodes", out.n_nodes.len(), 1)?;
    let (l, kk, bb) = (
        as_i32(OP, "depths", depths)?,
        as_i32(OP, "k", k)?,
        as_i32(OP, "budget", budget)?,
    );
    let in_smem = depths * k <= LP_SMEM_MAX;
    let smem = smem_bytes(depths * k, in_smem, budget) as u32;
    let flag = in_smem as i32;
    let mut b = gpu.stream.launch_builder(gpu.func(KERNEL));
    b.arg(lp).arg(tok).arg(&l).arg(&kk).arg(&bb).arg(bonus);
    b.arg(out.tokens)
        .arg(out.depths)
        .arg(out.parents)
        .arg(out.log_q)
        .arg(out.first_child)
        .arg(out.next_sibling)
        .arg(out.n_nodes)
        .arg(&flag);
    // SAFETY: lengths checked above; budget, depths and k are within the kernel's packed limits; the dynamic
    // shared memory (lp when it fits) is at most what `configure` allowed.
    unsafe { b.launch(launch_cfg((1, 1, 1), 32, smem)) }.map_err(drv(OP))?;
    Ok(())
}

/// Trees one [`ddtree_build_segs`] launch builds (`BUILD_SEGS` in the kernel).
pub const MAX_SEGS: usize = 32;

/// One tree of [`ddtree_build_segs`]: its root and its outputs (as [`TreeOut`]'s; `log_q` the budget + 1 f64 of
/// its round-result buffer `walk_out` from i32 index `log_q_at`, 8-byte aligned) and its ancestor bitmask
/// (`[budget + 1, words]` u64).
pub struct BuildSeg<'b> {
    pub bonus: CudaView<'b, u32>,
    pub tokens: CudaViewMut<'b, u32>,
    pub depths: CudaViewMut<'b, u32>,
    pub parents: CudaViewMut<'b, i32>,
    pub walk_out: CudaViewMut<'b, i32>,
    pub log_q_at: usize,
    pub first_child: CudaViewMut<'b, i32>,
    pub next_sibling: CudaViewMut<'b, i32>,
    pub n_nodes: CudaViewMut<'b, i32>,
    pub mask: CudaViewMut<'b, u64>,
}

/// The kernel's by-value table (`struct BuildSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct BuildSegsArg {
    bonus: [u64; MAX_SEGS],
    tokens: [u64; MAX_SEGS],
    depths: [u64; MAX_SEGS],
    parents: [u64; MAX_SEGS],
    log_q: [u64; MAX_SEGS],
    first_child: [u64; MAX_SEGS],
    next_sibling: [u64; MAX_SEGS],
    n_nodes: [u64; MAX_SEGS],
    mask: [u64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct BuildSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for BuildSegsArg {}

/// [`ddtree_build`] of up to [`MAX_SEGS`] trees of one shape in one launch (a block per tree, all at once): tree
/// t from rows `[t·depths, (t+1)·depths)` of `lp` / `tok`, then its ancestor bitmask (`words` u64 a row, as
/// `visibility` writes it). Each tree's outputs equal [`ddtree_build`]'s then `visibility`'s on its rows.
/// Launch contract: no allocation, no host sync, graph-capturable.
#[allow(clippy::too_many_arguments)]
pub fn ddtree_build_segs(
    gpu: &Gpu,
    lp: &CudaView<'_, f32>,
    tok: &CudaView<'_, u32>,
    depths: usize,
    k: usize,
    budget: usize,
    words: usize,
    segs: &mut [BuildSeg<'_>],
) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} trees in one launch (at most {MAX_SEGS})")
    })?;
    check_limits(budget, depths, k)?;
    ensure(OP, words >= (budget + 1).div_ceil(64), || {
        format!("{words} mask words a row for {} nodes", budget + 1)
    })?;
    need_len(OP, "lp", lp.len(), nseg * depths * k)?;
    need_len(OP, "tok", tok.len(), nseg * depths * k)?;
    if nseg == 0 {
        return Ok(());
    }
    let n = budget + 1;
    let mut arg = BuildSegsArg {
        bonus: [0; MAX_SEGS],
        tokens: [0; MAX_SEGS],
        depths: [0; MAX_SEGS],
        parents: [0; MAX_SEGS],
        log_q: [0; MAX_SEGS],
        first_child: [0; MAX_SEGS],
        next_sibling: [0; MAX_SEGS],
        n_nodes: [0; MAX_SEGS],
        mask: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(9 * nseg);
    for (i, t) in segs.iter_mut().enumerate() {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        check_tree(n, [t.bonus.len(), t.tokens.len(), t.depths.len(), t.parents.len()])?;
        ensure(OP, t.log_q_at.is_multiple_of(2), || {
            format!("log_q at i32 index {} is not 8-byte aligned", t.log_q_at)
        })?;
        need_len(OP, "walk_out", t.walk_out.len(), t.log_q_at + 2 * n)?;
        need_len(OP, "first_child", t.first_child.len(), n)?;
        need_len(OP, "next_sibling", t.next_sibling.len(), n)?;
        need_len(OP, "n_nodes", t.n_nodes.len(), 1)?;
        need_len(OP, "mask", t.mask.len(), n * words)?;
        let s = &gpu.stream;
        let (p0, g0) = t.bonus.device_ptr(s);
        let (p1, g1) = t.tokens.device_ptr_mut(s);
        let (p2, g2) = t.depths.device_ptr_mut(s);
        let (p3, g3) = t.parents.device_ptr_mut(s);
        let (p4, g4) = t.walk_out.device_ptr_mut(s);
        let p4 = p4 + 4 * t.log_q_at as u64; // the f64 log_q after the walk
        let (p5, g5) = t.first_child.device_ptr_mut(s);
        let (p6, g6) = t.next_sibling.device_ptr_mut(s);
        let (p7, g7) = t.n_nodes.device_ptr_mut(s);
        let (p8, g8) = t.mask.device_ptr_mut(s);
        guards.push(g0);
        guards.extend([g1, g2, g3, g4, g5, g6, g7, g8]);
        (arg.bonus[i], arg.tokens[i], arg.depths[i], arg.parents[i], arg.log_q[i]) = (p0, p1, p2, p3, p4);
        (arg.first_child[i], arg.next_sibling[i], arg.n_nodes[i], arg.mask[i]) = (p5, p6, p7, p8);
    }
    let (l, kk, bb, ww) = (
        as_i32(OP, "depths", depths)?,
        as_i32(OP, "k", k)?,
        as_i32(OP, "budget", budget)?,
        as_i32(OP, "words", words)?,
    );
    let in_smem = depths * k <= LP_SMEM_MAX;
    let smem = smem_bytes(depths * k, in_smem, budget) as u32;
    let flag = in_smem as i32;
    let mut b = gpu.stream.launch_builder(gpu.func(KERNEL_SEGS));
    b.arg(&arg)
        .arg(lp)
        .arg(tok)
        .arg(&l)
        .arg(&kk)
        .arg(&bb)
        .arg(&ww)
        .arg(&flag);
    // SAFETY: every output was length-checked for budget + 1 nodes (the mask for its words), lp / tok for
    // nseg trees of depths x k; the dynamic shared memory is at most what `configure` allowed.
    unsafe { b.launch(launch_cfg((nseg as u32, 1, 1), 32, smem)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}
