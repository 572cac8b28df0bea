//! Wrappers for kernels/cuda/act_f32.cu, the f32 activation ops of the CUDA backend (conversions, add,
//! SwiGLU, RMSNorm over strided rows, RoPE from a host cos/sin table, strided row copies). CPU twins:
//! `crate::cpu::ops::{add_assign, silu_mul, rms_norm, rope_interleaved, rope_neox}`.
//! Launch contract of every function: no allocation, no host sync, graph-capturable.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::rope::RopeLayout;
use super::{as_i32, launch_cfg, need_len, span};
use crate::cuda::{drv, ensure, Gpu, Result};

fn grid_1d(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1)
}

/// `dst[i] = bf16(src[i])`, i < src.len().
pub fn f32_to_bf16(gpu: &Gpu, src: &CudaView<'_, f32>, dst: &mut CudaViewMut<'_, bf16>) -> Result<()> {
    let n = src.len();
    need_len("f32_to_bf16", "dst", dst.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let nn = n as i64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_f32_to_bf16"));
    b.arg(src).arg(dst).arg(&nn);
    // SAFETY: dst holds at least n elements.
    unsafe { b.launch(launch_cfg(grid_1d(n), 256, 0)) }.map_err(drv("f32_to_bf16"))?;
    Ok(())
}

/// `dst[i] = f32(src[i])`, i < src.len().
pub fn bf16_to_f32(gpu: &Gpu, src: &CudaView<'_, bf16>, dst: &mut CudaViewMut<'_, f32>) -> Result<()> {
    let n = src.len();
    need_len("bf16_to_f32", "dst", dst.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let nn = n as i64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_bf16_to_f32"));
    b.arg(src).arg(dst).arg(&nn);
    // SAFETY: dst holds at least n elements.
    unsafe { b.launch(launch_cfg(grid_1d(n), 256, 0)) }.map_err(drv("bf16_to_f32"))?;
    Ok(())
}

/// `acc[i] += x[i]`, i < x.len().
pub fn add_f32(gpu: &Gpu, acc: &mut CudaViewMut<'_, f32>, x: &CudaView<'_, f32>) -> Result<()> {
    let n = x.len();
    ensure("add_f32", acc.len() == n, || {
        format!("acc has {} elements, x {n}", acc.len())
    })?;
    if n == 0 {
        return Ok(());
    }
    let nn = n as i64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_add_f32"));
    b.arg(acc).arg(x).arg(&nn);
    // SAFETY: both hold n elements.
    unsafe { b.launch(launch_cfg(grid_1d(n), 256, 0)) }.map_err(drv("add_f32"))?;
    Ok(())
}

/// `out[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul_f32(
    gpu: &Gpu,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let n = gate.len();
    silu_mul_launch(
        gpu,
        ("silu_mul_f32", "kdtree_silu_mul_f32"),
        (gate, n),
        (up, n),
        (1, n),
        out,
    )
}

/// [`silu_mul_f32`] rounded once to bf16 (the bits of it followed by [`f32_to_bf16`]), in one launch.
pub fn silu_mul_bf16(
    gpu: &Gpu,
    gate: &CudaView<'_, f32>,
    up: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    let n = gate.len();
    silu_mul_launch(
        gpu,
        ("silu_mul_bf16", "kdtree_silu_mul_f32_bf16"),
        (gate, n),
        (up, n),
        (1, n),
        out,
    )
}

/// [`silu_mul_bf16`] of `rows` x `width` elements read from rows `ld_g` / `ld_u` apart (the gate and up blocks of
/// a [gate | up] linear's output, each view starting at its block), `out` `[rows, width]`.
pub fn silu_mul_bf16_rows(
    gpu: &Gpu,
    gate: (&CudaView<'_, f32>, usize),
    up: (&CudaView<'_, f32>, usize),
    (rows, width): (usize, usize),
    out: &mut CudaViewMut<'_, bf16>,
) -> Result<()> {
    silu_mul_launch(
        gpu,
        ("silu_mul_bf16", "kdtree_silu_mul_f32_bf16"),
        gate,
        up,
        (rows, width),
        out,
    )
}

/// The SwiGLU kernel `kernel` (f32 gate and up in rows ld apart, `O` out) over `rows` x `width` elements.
fn silu_mul_launch<O: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    (op, kernel): (&'static str, &'static str),
    (gate, ld_g): (&CudaView<'_, f32>, usize),
    (up, ld_u): (&CudaView<'_, f32>, usize),
    (rows, width): (usize, usize),
    out: &mut CudaViewMut<'_, O>,
) -> Result<()> {
    let n = rows * width;
    ensure(op, ld_g >= width && ld_u >= width, || {
        format!("rows of {width} read {ld_g} / {ld_u} apart")
    })?;
    need_len(op, "gate", gate.len(), span(rows, ld_g, width))?;
    need_len(op, "up", up.len(), span(rows, ld_u, width))?;
    need_len(op, "out", out.len(), n)?;
    if rows == 1 && width == gate.len() {
        ensure(op, up.len() == n, || format!("gate {n}, up {} elements", up.len()))?;
    }
    if n == 0 {
        return Ok(());
    }
    let (lg, lu, r, w) = (ld_g as i64, ld_u as i64, rows as i64, width as i64);
    let mut b = gpu.stream.launch_builder(gpu.func(kernel));
    b.arg(gate).arg(&lg).arg(up).arg(&lu).arg(out).arg(&r).arg(&w);
    // SAFETY: gate and up hold `rows` rows of `width` at their strides, out rows x width (checked above).
    unsafe { b.launch(launch_cfg(grid_1d(n), 256, 0)) }.map_err(drv(op))?;
    Ok(())
}

/// RMSNorm of `rows` rows of width `w.len()`: x rows `ld_x` apart, y rows `ld_y` apart (f32), weight bf16.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_f32(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    ld_x: usize,
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, f32>,
    ld_y: usize,
    rows: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rms_norm_f32";
    let Some((lx, _, ly, dd)) = norm_args(OP, (x.len(), ld_x), None, w.len(), (y.len(), ld_y), rows)? else {
        return Ok(());
    };
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_rms_norm_f32"));
    b.arg(x).arg(&lx).arg(w).arg(y).arg(&ly).arg(&dd).arg(&eps);
    // SAFETY: spans checked by norm_args.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), norm_threads(w.len()), 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// `x += a`, then `y = bf16(rms_norm(x))` with weight `w` over `rows` rows of `D = w.len()`: the bits of
/// [`add_f32`], [`rms_norm_f32`] and [`f32_to_bf16`] in one launch (a decoder layer's residual add and the next
/// norm, its output the linears' bf16 input). Rows `ld_x` / `ld_a` / `ld_y` apart.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_bf16(
    gpu: &Gpu,
    x: &mut CudaViewMut<'_, f32>,
    ld_x: usize,
    (a, ld_a): (&CudaView<'_, f32>, usize),
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, bf16>,
    ld_y: usize,
    rows: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "add_rms_norm_bf16";
    let Some(args) = norm_args(
        OP,
        (x.len(), ld_x),
        Some((a.len(), ld_a)),
        w.len(),
        (y.len(), ld_y),
        rows,
    )?
    else {
        return Ok(());
    };
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_add_rms_norm_bf16"));
    b.arg(x)
        .arg(&args.0)
        .arg(a)
        .arg(&args.1)
        .arg(w)
        .arg(y)
        .arg(&args.2)
        .arg(&args.3)
        .arg(&eps);
    // SAFETY: spans checked by norm_args.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), norm_threads(w.len()), 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// The latent cache rows of `t` new tokens in one launch: rows `row0[0] + i` of `dst` (`[cap, w]` bf16) =
/// bf16(rms_norm(ckv[i, :c]) with `weight`) | bf16(interleaved RoPE of ckv[i, c..w] by the table row i), the bits of
/// a copy of `ckv`, [`rms_norm_f32`], [`rope_table_f32`] and `round_state::store_rows` (`row0_host` is the host's
/// copy of `row0`, for the bounds). `ckv`'s rows are `ld >= w` apart (the kv_a block of a stacked linear, the view
/// starting at it). Needs `w % 8 == 0` and `c % 4 == 0` ([`kv_latent_rows_fit`]).
#[allow(clippy::too_many_arguments)]
pub fn kv_latent_rows_bf16(
    gpu: &Gpu,
    (ckv, ld): (&CudaView<'_, f32>, usize),
    (t, w, c): (usize, usize, usize),
    weight: &CudaView<'_, bf16>,
    eps: f32,
    (cos, sin): (&CudaView<'_, f32>, &CudaView<'_, f32>),
    dst: &mut CudaViewMut<'_, bf16>,
    (row0, row0_host): (&CudaView<'_, i32>, usize),
) -> Result<()> {
    const OP: &str = "kv_latent_rows_bf16";
    ensure(OP, kv_latent_rows_fit(w, c) && weight.len() == c, || {
        format!(
            "width {w}, norm {c} (weight {}): needs w % 8 == 0, c % 4 == 0, c < w",
            weight.len()
        )
    })?;
    ensure(OP, ld >= w, || format!("rows of {w} read {ld} apart"))?;
    need_len(OP, "ckv", ckv.len(), span(t, ld, w))?;
    need_len(OP, "cos", cos.len(), t * (w - c) / 2)?;
    need_len(OP, "sin", sin.len(), t * (w - c) / 2)?;
    need_len(OP, "row0", row0.len(), 1)?;
    need_len(OP, "dst", dst.len(), (row0_host + t) * w)?;
    if t == 0 {
        return Ok(());
    }
    ensure(OP, t <= 65535, || format!("{t} tokens exceed the grid limit 65535"))?;
    let (wi, ci, li) = (as_i32(OP, "w", w)?, as_i32(OP, "c", c)?, as_i32(OP, "ld", ld)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_kv_latent_rows_bf16"));
    b.arg(ckv)
        .arg(&li)
        .arg(&wi)
        .arg(&ci)
        .arg(weight)
        .arg(&eps)
        .arg(cos)
        .arg(sin)
        .arg(dst)
        .arg(row0);
    // SAFETY: ckv holds t rows of w, ld apart, the tables t rows of (w - c) / 2, dst row0 + t rows of w (against the
    // host mirror of row0, checked); the norm's threads as rms_norm_f32 takes them.
    unsafe { b.launch(launch_cfg((t as u32, 1, 1), norm_threads(c), 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Whether [`kv_latent_rows_bf16`] takes a latent row of width `w` normed over its first `c` columns.
pub fn kv_latent_rows_fit(w: usize, c: usize) -> bool {
    w.is_multiple_of(8) && c.is_multiple_of(4) && c > 0 && c < w && (w - c).is_multiple_of(2)
}

/// `y = bf16(rms_norm(x))`: the bits of [`rms_norm_f32`] and [`f32_to_bf16`] in one launch (x is only read).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bf16_out(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    ld_x: usize,
    w: &CudaView<'_, bf16>,
    y: &mut CudaViewMut<'_, bf16>,
    ld_y: usize,
    rows: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rms_norm_bf16_out";
    let Some(args) = norm_args(OP, (x.len(), ld_x), None, w.len(), (y.len(), ld_y), rows)? else {
        return Ok(());
    };
    let null: u64 = 0;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_add_rms_norm_bf16"));
    b.arg(x)
        .arg(&args.0)
        .arg(&null)
        .arg(&args.1)
        .arg(w)
        .arg(y)
        .arg(&args.2)
        .arg(&args.3)
        .arg(&eps);
    // SAFETY: spans checked by norm_args; with a null `a` the kernel does not write x.
    unsafe { b.launch(launch_cfg((rows as u32, 1, 1), norm_threads(w.len()), 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Threads of a norm over rows of `d` (the same in every norm form: the same sums in the same order): enough that a
/// row's float4s fit RMS_VEC (8) a thread, one round of loads a row.
fn norm_threads(d: usize) -> u32 {
    d.div_ceil(4 * 8).next_multiple_of(32).clamp(128, 1024) as u32
}

/// Checks a norm's spans; the kernel's (ld_x, ld_a, ld_y, D), or None when there are no rows.
fn norm_args(
    op: &'static str,
    (x_len, ld_x): (usize, usize),
    a: Option<(usize, usize)>,
    d: usize,
    (y_len, ld_y): (usize, usize),
    rows: usize,
) -> Result<Option<(i32, i32, i32, i32)>> {
    let ld_a = a.map_or(d, |(_, l)| l);
    ensure(op, d > 0 && ld_x >= d && ld_y >= d && ld_a >= d, || match a {
        Some(_) => format!("width {d} with strides ld_x={ld_x}, ld_a={ld_a}, ld_y={ld_y}"),
        None => format!("width {d} with strides ld_x={ld_x}, ld_y={ld_y}"),
    })?;
    need_len(op, "x", x_len, span(rows, ld_x, d))?;
    if let Some((a_len, _)) = a {
        need_len(op, "a", a_len, span(rows, ld_a, d))?;
    }
    need_len(op, "y", y_len, span(rows, ld_y, d))?;
    if rows == 0 {
        return Ok(None);
    }
    ensure(op, rows <= i32::MAX as usize, || format!("rows={rows}"))?;
    Ok(Some((
        as_i32(op, "ld_x", ld_x)?,
        as_i32(op, "ld_a", ld_a)?,
        as_i32(op, "ld_y", ld_y)?,
        as_i32(op, "D", d)?,
    )))
}

/// RoPE in place from `cos`/`sin` `[tokens, dim/2]` (the host table of `backend::RopeTable`) on the slice
/// `r` describes (the layout of the bf16 rope op, `super::rope::RopeLayout`); `neox`: pairs (i, i + D/2)
/// (rotate_half, the drafter) instead of (2i, 2i + 1) (interleaved, the target).
pub fn rope_table_f32(
    gpu: &Gpu,
    x: &mut CudaViewMut<'_, f32>,
    cos: &CudaView<'_, f32>,
    sin: &CudaView<'_, f32>,
    r: RopeLayout,
    neox: bool,
) -> Result<()> {
    const OP: &str = "rope_table_f32";
    ensure(OP, r.dim.is_multiple_of(2) && r.dim > 0, || {
        format!("rope dim {} must be even", r.dim)
    })?;
    need_len(OP, "cos", cos.len(), r.tokens * r.dim / 2)?;
    need_len(OP, "sin", sin.len(), r.tokens * r.dim / 2)?;
    if r.tokens == 0 || r.heads == 0 {
        return Ok(());
    }
    let last = (r.tokens - 1) * r.ld_token + (r.heads - 1) * r.ld_head + r.offset + r.dim;
    need_len(OP, "x", x.len(), last)?;
    ensure(OP, r.tokens <= 65535, || {
        format!("tokens={} exceeds the grid limit 65535", r.tokens)
    })?;
    let (h, lt, lh, off, d, nx) = (
        as_i32(OP, "heads", r.heads)?,
        as_i32(OP, "ld_token", r.ld_token)?,
        as_i32(OP, "ld_head", r.ld_head)?,
        as_i32(OP, "offset", r.offset)?,
        as_i32(OP, "dim", r.dim)?,
        neox as i32,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_rope_table_f32"));
    b.arg(x)
        .arg(cos)
        .arg(sin)
        .arg(&h)
        .arg(&lt)
        .arg(&lh)
        .arg(&off)
        .arg(&d)
        .arg(&nx);
    // SAFETY: the last element touched is inside x (checked), tables hold tokens x dim/2.
    unsafe {
        b.launch(launch_cfg(
            ((r.heads * r.dim / 2).div_ceil(128) as u32, r.tokens as u32, 1),
            128,
            0,
        ))
    }
    .map_err(drv(OP))?;
    Ok(())
}

/// `dst[r·ld_dst + c] = src[r·ld_src + c]` (f32), r < rows, c < width.
pub fn copy_rows_f32(
    gpu: &Gpu,
    src: &CudaView<'_, f32>,
    ld_src: usize,
    dst: &mut CudaViewMut<'_, f32>,
    ld_dst: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    const OP: &str = "copy_rows_f32";
    ensure(OP, ld_src >= width && ld_dst >= width, || {
        format!("strides ld_src={ld_src}, ld_dst={ld_dst} < width={width}")
    })?;
    need_len(OP, "src", src.len(), span(rows, ld_src, width))?;
    need_len(OP, "dst", dst.len(), span(rows, ld_dst, width))?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    ensure(OP, rows <= 65535, || {
        format!("rows={rows} exceeds the grid limit 65535")
    })?;
    let (ls, ld, rr, w) = (
        as_i32(OP, "ld_src", ld_src)?,
        as_i32(OP, "ld_dst", ld_dst)?,
        as_i32(OP, "rows", rows)?,
        as_i32(OP, "width", width)?,
    );
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_copy_rows_f32"));
    b.arg(src).arg(&ls).arg(dst).arg(&ld).arg(&rr).arg(&w);
    // SAFETY: spans checked above.
    unsafe { b.launch(launch_cfg((width.div_ceil(256) as u32, rows as u32, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
