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

/// Dynamic shared memory of a launch: lp when it fits (padded to 8 bytes), then the nodes' f64 log_q.
fn smem_bytes(lp_floats: usize, in_smem: bool, budget: usize) -> usize {
    (if in_smem { lp_floats.div_ceil(2) * 8 } else { 0 }) + (budget + 1) * 8
}

/// Lets the kernel take the largest dynamic shared memory a launch asks for on top of its ~47 KB static
/// arrays (called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    let need = smem_bytes(LP_SMEM_MAX, true, MAX_BUDGET);
    gpu.func(KERNEL)
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            need as i32,
        )
        .map_err(drv("ddtree_build configure"))
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
    ensure(OP, budget <= MAX_BUDGET, || {
        format!("budget={budget} exceeds {MAX_BUDGET}")
    })?;
    ensure(OP, depths <= MAX_DEPTH, || {
        format!("{depths} draft rows exceed {MAX_DEPTH}")
    })?;
    ensure(OP, k <= super::topk_logprobs::MAX_K, || {
        format!("k={k} exceeds {}", super::topk_logprobs::MAX_K)
    })?;
    need_len(OP, "lp", lp.len(), depths * k)?;
    need_len(OP, "tok", tok.len(), depths * k)?;
    need_len(OP, "bonus", bonus.len(), 1)?;
    let n = budget + 1;
    need_len(OP, "tokens", out.tokens.len(), n)?;
    need_len(OP, "depths", out.depths.len(), n)?;
    need_len(OP, "parents", out.parents.len(), n)?;
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
