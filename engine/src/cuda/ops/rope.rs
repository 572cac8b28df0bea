//! Interleaved YaRN RoPE wrapper for kernels/cuda/rope.cu. CPU twin: `crate::cpu::ops::rope_interleaved`
//! with cos/sin from `crate::cpu::ops::rope_cos_sin`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "rope_interleaved";

/// Where the rope slice sits: element (t, h, d) is `x[t * ld_token + h * ld_head + offset + d]`.
#[derive(Clone, Copy, Debug)]
pub struct RopeLayout {
    pub tokens: usize,
    pub heads: usize,
    pub ld_token: usize,
    pub ld_head: usize,
    pub offset: usize,
    /// Rope dims D (even); pairs (2i, 2i+1) rotate with `inv_freq[i]`.
    pub dim: usize,
}

/// Rotates the rope slice of every (token, head) in place by `pos[t] * inv_freq[i]`; cos/sin are scaled by
/// `attention_factor` (YaRN, 1.0 on K2.6). `pos` `[tokens]` i32 absolute positions, `inv_freq` `[dim/2]` f32
/// (`crate::cpu::ops::yarn_inv_freq`). Launch contract: no allocation, no host sync, graph-capturable.
pub fn rope_interleaved(
    gpu: &Gpu,
    x: &mut CudaViewMut<'_, bf16>,
    pos: &CudaView<'_, i32>,
    inv_freq: &CudaView<'_, f32>,
    l: RopeLayout,
    attention_factor: f64,
) -> Result<()> {
    ensure(OP, l.dim > 0 && l.dim.is_multiple_of(2), || {
        format!("rope dim {} must be even and > 0", l.dim)
    })?;
    ensure(OP, inv_freq.len() == l.dim / 2, || {
        format!("inv_freq has {} elements, expected dim/2={}", inv_freq.len(), l.dim / 2)
    })?;
    ensure(OP, pos.len() == l.tokens, || {
        format!("pos has {} elements, expected tokens={}", pos.len(), l.tokens)
    })?;
    ensure(OP, l.heads <= 1 || l.offset + l.dim <= l.ld_head, || {
        format!("offset={} + dim={} exceeds ld_head={}", l.offset, l.dim, l.ld_head)
    })?;
    if l.tokens == 0 || l.heads == 0 {
        return Ok(());
    }
    ensure(OP, l.heads == 1 || l.ld_token >= l.heads * l.ld_head, || {
        format!("ld_token={} < heads={} x ld_head={}", l.ld_token, l.heads, l.ld_head)
    })?;
    let last = (l.tokens - 1) * l.ld_token + (l.heads - 1) * l.ld_head + l.offset + l.dim;
    need_len(OP, "x", x.len(), last)?;
    ensure(OP, l.tokens <= 65535, || {
        format!("tokens={} exceeds the grid limit 65535", l.tokens)
    })?;
    let pairs = l.heads * l.dim / 2;
    let (h, lt, lh, off, d) = (
        as_i32(OP, "heads", l.heads)?,
        as_i32(OP, "ld_token", l.ld_token)?,
        as_i32(OP, "ld_head", l.ld_head)?,
        as_i32(OP, "offset", l.offset)?,
        as_i32(OP, "dim", l.dim)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_rope_interleaved_bf16"));
    b.arg(x)
        .arg(pos)
        .arg(inv_freq)
        .arg(&h)
        .arg(&lt)
        .arg(&lh)
        .arg(&off)
        .arg(&d)
        .arg(&attention_factor);
    // SAFETY: the largest index touched is `last - 1`, checked against x.len() above.
    unsafe { b.launch(launch_cfg((pairs.div_ceil(128) as u32, l.tokens as u32, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
