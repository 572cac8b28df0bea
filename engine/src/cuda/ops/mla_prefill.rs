//! Causal prefill attention in MLA's expanded form, wrapper for kernels/cuda/mla_prefill.cu (one kernel, no
//! split). CPU twin: the expanded attention of `crate::cpu::ops::mla_attention`.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::mla_attention::MlaShape;
use super::{addr, addr_mut, as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "mla_prefill";
/// Query rows a CTA, threads a CTA, key rows a tile (the kernel's BM, THREADS, BN).
const BM: usize = 128;
const THREADS: u32 = 256;
const BN: usize = 64;
/// The largest grid x dimension is 2^31 - 1; y (heads) 65535.
const GRID_Y_MAX: usize = 65535;

/// The kernel of a (key width QW, value width DV), if one is built; `p1`: the one that feeds P to the value mma as
/// one bf16 operand (K2.6's widths only; the others feed its rounding and remainder).
fn kernel(qw: usize, dv: usize, p1: bool) -> Option<&'static str> {
    match (qw, dv, p1) {
        (192, 128, false) => Some("kdtree_mla_prefill_bf16_q192_v128"),
        (192, 128, true) => Some("kdtree_mla_prefill_bf16_q192_v128_p1"),
        (64, 32, false) => Some("kdtree_mla_prefill_bf16_q64_v32"),
        (48, 32, false) => Some("kdtree_mla_prefill_bf16_q48_v32"),
        _ => None,
    }
}

/// Dynamic shared memory of the (QW, DV) kernel (`mla_prefill::Dims::SMEM`).
fn smem_bytes(qw: usize, dv: usize) -> usize {
    BM * (qw + 8) * 2 + 2 * BN * (qw + dv + 8) * 2
}

/// Whether this device runs the causal prefill kernel for key width `qw` and value width `dv` (a kernel is built
/// for it and its shared memory fits: K2.6's needs 132 KiB, more than sm_120's 99 KiB).
pub fn supported(gpu: &Gpu, qw: usize, dv: usize) -> bool {
    kernel(qw, dv, false).is_some() && smem_bytes(qw, dv) <= gpu.max_smem
}

/// Raises the kernels' dynamic shared memory limit where the device has it (called once by `Gpu::new`).
pub(crate) fn configure(gpu: &Gpu) -> Result<()> {
    for (qw, dv) in [(192, 128), (64, 32), (48, 32)] {
        if !supported(gpu, qw, dv) {
            continue;
        }
        for name in [kernel(qw, dv, false), kernel(qw, dv, true)].into_iter().flatten() {
            gpu.func(name)
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_bytes(qw, dv) as i32,
                )
                .map_err(drv("mla_prefill configure"))?;
        }
    }
    Ok(())
}

/// `out[t, h, :DV] = Σ_{s <= committed + t} softmax_s(scale · q[t, h, :] · k_h[s, :]) · v_h[s, :]`: the causal
/// attention of one sequence's `s.t` new rows after `s.committed` cached ones, each head over its own expanded
/// rows `kv[h · head_stride + s · (DV + QW) ..] = v_h (DV) | k_h (QW)` (as
/// [`super::mla_attention::mla_attention_heads`] takes them), queries `q [T, Hr, QW]`. `s.kv_lora` = DV, `s.rope` =
/// QW (the key width). Errors when no kernel is built for the widths or the device lacks the shared memory
/// ([`supported`]). P goes to the value mma as its bf16 rounding and remainder, or, with the GPU's
/// `mla_prefill_p1` option where that kernel is built (K2.6's widths), as one bf16 operand. Launch contract: one
/// kernel, no allocation, no host sync.
pub fn mla_prefill(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    kv: &CudaView<'_, bf16>,
    head_stride: usize,
    s: &MlaShape,
    scale: f32,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let p1 = gpu.options().mla_prefill_p1 && kernel(s.rope, s.kv_lora, true).is_some();
    mla_prefill_with(gpu, q, kv, head_stride, s, scale, p1, out)
}

/// [`mla_prefill`] with P's form given: `p1` one bf16 operand (an error where that kernel is not built), else two.
#[allow(clippy::too_many_arguments)]
pub fn mla_prefill_with(
    gpu: &Gpu,
    q: &CudaView<'_, bf16>,
    kv: &CudaView<'_, bf16>,
    head_stride: usize,
    s: &MlaShape,
    scale: f32,
    p1: bool,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let (dv, qw) = (s.kv_lora, s.rope);
    let name = kernel(qw, dv, p1);
    ensure(OP, name.is_some(), || {
        format!(
            "no kernel for key width {qw} and value width {dv}{} (built: 192/128, 64/32, 48/32; P as one bf16: \
             192/128)",
            if p1 { " with P as one bf16" } else { "" }
        )
    })?;
    ensure(OP, smem_bytes(qw, dv) <= gpu.max_smem, || {
        format!(
            "key width {qw}, value width {dv} need {} bytes of shared memory, the device allows {}",
            smem_bytes(qw, dv),
            gpu.max_smem
        )
    })?;
    let rows = s.committed + s.t;
    let ew = dv + qw;
    ensure(OP, head_stride >= rows * ew, || {
        format!("head stride {head_stride} < {rows} rows x {ew}")
    })?;
    // 16-byte cp.async rows: q, kv and every head's rows 16-byte aligned; the output's bf16 pairs 4-byte aligned.
    ensure(OP, head_stride.is_multiple_of(8), || {
        format!("head stride {head_stride} must be a multiple of 8 elements")
    })?;
    ensure(
        OP,
        addr(gpu, q).is_multiple_of(16) && addr(gpu, kv).is_multiple_of(16) && addr_mut(gpu, out).is_multiple_of(4),
        || "q and kv must be 16-byte aligned, out 4-byte aligned".into(),
    )?;
    need_len(OP, "q", q.len(), s.t * s.heads * qw)?;
    need_len(OP, "kv", kv.len(), (s.heads.max(1) - 1) * head_stride + rows * ew)?;
    need_len(OP, "out", out.len(), s.t * s.heads * dv)?;
    if s.t == 0 || s.heads == 0 {
        return Ok(());
    }
    ensure(OP, s.heads <= GRID_Y_MAX, || {
        format!("{} heads exceed the grid limit {GRID_Y_MAX}", s.heads)
    })?;
    let (t, hr, committed) = (
        as_i32(OP, "t", s.t)?,
        as_i32(OP, "heads", s.heads)?,
        as_i32(OP, "committed", s.committed)?,
    );
    // Row indices inside the kernel are int: committed + t and the last query row must fit.
    as_i32(OP, "rows", rows + BM)?;
    let (stride, scale_log2) = (head_stride as u64, scale * std::f32::consts::LOG2_E);
    let grid = (s.t.div_ceil(BM) as u32, s.heads as u32, 1);
    let mut b = gpu.stream.launch_builder(gpu.func(name.unwrap_or_default()));
    b.arg(q)
        .arg(kv)
        .arg(&stride)
        .arg(&t)
        .arg(&hr)
        .arg(&committed)
        .arg(&scale_log2)
        .arg(out);
    // SAFETY: q, kv and out were length-checked above for these shapes and strides; the kernel reads rows below
    // committed + t of every head and writes rows below t.
    unsafe { b.launch(launch_cfg(grid, THREADS, smem_bytes(qw, dv) as u32)) }.map_err(drv(OP))?;
    Ok(())
}
