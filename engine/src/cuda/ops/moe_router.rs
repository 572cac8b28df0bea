//! MoE router wrapper for kernels/cuda/moe_router.cu. CPU twin: `crate::cpu::ops::moe_route`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "moe_router";

/// Router settings: the CPU twin's own (`cpu::ops::Router`, from config.json's n_routed_experts, n_group,
/// topk_group, num_experts_per_tok, norm_topk_prob, routed_scaling_factor).
pub use crate::backend::Router as RouterCfg;

/// For each of `tokens` rows of f32 `logits` `[tokens, n_experts]`: selected expert ids
/// `ids [tokens, top_k]` (selection order) and weights `weights [tokens, top_k]` f32. `bias` is
/// `e_score_correction_bias` `[n_experts]` (selection only). Without expert groups (`n_group == 1`) one warp a
/// token, else one block a token ([`moe_router_block`]); the two give the same ids and weights.
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn moe_router(
    gpu: &Gpu,
    logits: &CudaView<'_, f32>,
    bias: Option<&CudaView<'_, f32>>,
    tokens: usize,
    c: RouterCfg,
    ids: &mut CudaViewMut<'_, i32>,
    weights: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    route(
        gpu,
        (logits, c.n_experts),
        bias,
        tokens,
        c,
        ids,
        weights,
        c.n_group == 1,
    )
}

/// [`moe_router`] of logits in rows `ld >= n_experts` apart (the router's block of a stacked linear).
#[allow(clippy::too_many_arguments)]
pub fn moe_router_ld(
    gpu: &Gpu,
    logits: &CudaView<'_, f32>,
    ld: usize,
    bias: Option<&CudaView<'_, f32>>,
    tokens: usize,
    c: RouterCfg,
    ids: &mut CudaViewMut<'_, i32>,
    weights: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    route(gpu, (logits, ld), bias, tokens, c, ids, weights, c.n_group == 1)
}

/// [`moe_router`] in its one-block-a-token form whatever the groups (the tests compare the two forms).
pub fn moe_router_block(
    gpu: &Gpu,
    logits: &CudaView<'_, f32>,
    bias: Option<&CudaView<'_, f32>>,
    tokens: usize,
    c: RouterCfg,
    ids: &mut CudaViewMut<'_, i32>,
    weights: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    route(gpu, (logits, c.n_experts), bias, tokens, c, ids, weights, false)
}

#[allow(clippy::too_many_arguments)]
fn route(
    gpu: &Gpu,
    (logits, ld): (&CudaView<'_, f32>, usize),
    bias: Option<&CudaView<'_, f32>>,
    tokens: usize,
    c: RouterCfg,
    ids: &mut CudaViewMut<'_, i32>,
    weights: &mut CudaViewMut<'_, f32>,
    warp: bool,
) -> Result<()> {
    let e = c.n_experts;
    ensure(OP, (1..=1024).contains(&e), || {
        format!("n_experts={e} must be in 1..=1024")
    })?;
    ensure(OP, (1..=32).contains(&c.top_k), || {
        format!("top_k={} must be in 1..=32", c.top_k)
    })?;
    ensure(
        OP,
        c.n_group >= 1 && c.n_group <= 64 && e.is_multiple_of(c.n_group),
        || format!("n_group={} must divide n_experts={e} and be <= 64", c.n_group),
    )?;
    ensure(OP, (1..=c.n_group).contains(&c.topk_group), || {
        format!("topk_group={} must be in 1..=n_group={}", c.topk_group, c.n_group)
    })?;
    ensure(OP, c.top_k <= c.topk_group * (e / c.n_group), || {
        format!(
            "top_k={} exceeds the {} experts of topk_group={} groups",
            c.top_k,
            c.topk_group * (e / c.n_group),
            c.topk_group
        )
    })?;
    ensure(OP, ld >= e, || {
        format!("logit rows {ld} apart hold fewer than n_experts={e}")
    })?;
    need_len(
        OP,
        "logits",
        logits.len(),
        if tokens == 0 { 0 } else { (tokens - 1) * ld + e },
    )?;
    need_len(OP, "ids", ids.len(), tokens * c.top_k)?;
    need_len(OP, "weights", weights.len(), tokens * c.top_k)?;
    if let Some(b) = bias {
        ensure(OP, b.len() == e, || {
            format!("bias has {} elements, expected n_experts={e}", b.len())
        })?;
    }
    if tokens == 0 {
        return Ok(());
    }
    ensure(OP, tokens <= u32::MAX as usize, || {
        format!("tokens={tokens} exceeds u32")
    })?;
    let (ee, ng, tg, k) = (
        as_i32(OP, "e", e)?,
        as_i32(OP, "n_group", c.n_group)?,
        as_i32(OP, "topk_group", c.topk_group)?,
        as_i32(OP, "top_k", c.top_k)?,
    );
    let norm = c.norm_topk_prob as i32;
    let (null, ld) = (0u64, ld as i64);
    if warp {
        let name = match e {
            0..=128 => "kdtree_moe_router_warp4_f32",
            129..=384 => "kdtree_moe_router_warp12_f32",
            _ => "kdtree_moe_router_warp32_f32",
        };
        let t = as_i32(OP, "tokens", tokens)?;
        let mut b = gpu.stream.launch_builder(gpu.func(name));
        b.arg(logits).arg(&ld);
        match bias {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&t)
            .arg(&ee)
            .arg(&k)
            .arg(&norm)
            .arg(&c.routed_scaling)
            .arg(ids)
            .arg(weights);
        // SAFETY: lengths checked above (E <= 1024 = 32 lanes x 32, top_k <= 32); a null bias is handled by the
        // kernel; warps past the last token return at once.
        unsafe { b.launch(launch_cfg((tokens.div_ceil(8) as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
        return Ok(());
    }
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_moe_router_f32"));
    b.arg(logits).arg(&ld);
    match bias {
        Some(v) => b.arg(v),
        None => b.arg(&null),
    };
    b.arg(&ee)
        .arg(&ng)
        .arg(&tg)
        .arg(&k)
        .arg(&norm)
        .arg(&c.routed_scaling)
        .arg(ids)
        .arg(weights);
    // SAFETY: lengths checked above; a null bias is handled by the kernel.
    unsafe { b.launch(launch_cfg((tokens as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
