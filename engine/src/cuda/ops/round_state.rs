//! Wrappers for kernels/cuda/round_state.cu: the position state of the DDTree round on the device (counters
//! of the committed rows, cos/sin of positions read from them, row stores at a counter, the walked path's
//! rows, the advance after a walk). With these a captured round replays at any position. CPU twins:
//! `cpu::ops::rope_cos_sin` (rope_at), the CPU backend's `write_rows_at`, `tree_path_rows`, `tree_commit`.
//! Tests: engine/tests/cuda_ops.rs, engine/tests/cuda_round.rs.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "round_state";

fn grid_for(total: usize) -> u32 {
    total.div_ceil(256).clamp(1, 1024) as u32
}

/// `pos[0] += n` on the device.
pub fn pos_add(gpu: &Gpu, pos: &mut CudaViewMut<'_, i32>, n: usize) -> Result<()> {
    need_len(OP, "pos", pos.len(), 1)?;
    let n = as_i32(OP, "n", n)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_pos_add"));
    b.arg(&mut *pos).arg(&n);
    // SAFETY: pos holds one i32.
    unsafe { b.launch(launch_cfg((1, 1, 1), 32, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// The kernel's by-value table (`struct PosSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct PosSegsArg {
    pos: [u64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct PosSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for PosSegsArg {}

/// [`pos_add`] of up to [`MAX_SEGS`] counters in one launch: `pos_s[0] += n` for each s.
pub fn pos_add_segs(gpu: &Gpu, pos: &mut [CudaViewMut<'_, i32>], n: usize) -> Result<()> {
    let nseg = pos.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} counters in one launch (at most {MAX_SEGS})")
    })?;
    if nseg == 0 {
        return Ok(());
    }
    let mut arg = PosSegsArg {
        pos: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(nseg);
    for (i, p) in pos.iter_mut().enumerate() {
        use cudarc::driver::DevicePtrMut;
        need_len(OP, "pos", p.len(), 1)?;
        let (pp, g) = p.device_ptr_mut(&gpu.stream);
        guards.push(g);
        arg.pos[i] = pp;
    }
    let n = as_i32(OP, "n", n)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_pos_add_segs"));
    b.arg(&arg).arg(&n);
    // SAFETY: each counter holds one i32 (checked); one thread per counter.
    unsafe { b.launch(launch_cfg((1, 1, 1), MAX_SEGS as u32, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// After a walk (`walk_out` = `[len, path[m], decisions[m]]`): `kv_pos += len`, `ctx_pos += len` (when
/// given), `root = decisions[len − 1]` (the bonus token).
pub fn round_advance(
    gpu: &Gpu,
    walk_out: &CudaView<'_, i32>,
    m: usize,
    kv_pos: &mut CudaViewMut<'_, i32>,
    ctx_pos: Option<&mut CudaViewMut<'_, i32>>,
    root: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    need_len(OP, "walk_out", walk_out.len(), 1 + 2 * m)?;
    need_len(OP, "kv_pos", kv_pos.len(), 1)?;
    need_len(OP, "root", root.len(), 1)?;
    ensure(OP, m > 0, || "a walk of 0 rows".into())?;
    let mi = as_i32(OP, "m", m)?;
    let null: u64 = 0;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_round_advance"));
    b.arg(walk_out).arg(&mi).arg(&mut *kv_pos);
    let mut ctx = ctx_pos;
    match ctx.as_mut() {
        Some(c) => {
            need_len(OP, "ctx_pos", c.len(), 1)?;
            b.arg(&mut **c)
        }
        None => b.arg(&null),
    };
    b.arg(&mut *root);
    // SAFETY: walk_out holds 1 + 2m values with 1 <= len <= m (ddtree_walk), the counters one i32 each.
    unsafe { b.launch(launch_cfg((1, 1, 1), 32, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// cos/sin `[t, half]` of positions `base[0] + offsets[i]` (or `base[0] + i`): `cpu::ops::rope_cos_sin`.
#[allow(clippy::too_many_arguments)]
pub fn rope_at(
    gpu: &Gpu,
    inv_freq: &CudaView<'_, f32>,
    factor: f64,
    base: &CudaView<'_, i32>,
    offsets: Option<&CudaView<'_, u32>>,
    t: usize,
    cos: &mut CudaViewMut<'_, f32>,
    sin: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let half = inv_freq.len();
    need_len(OP, "base", base.len(), 1)?;
    need_len(OP, "cos", cos.len(), t * half)?;
    need_len(OP, "sin", sin.len(), t * half)?;
    if let Some(o) = offsets {
        need_len(OP, "offsets", o.len(), t)?;
    }
    if t == 0 || half == 0 {
        return Ok(());
    }
    ensure(OP, t <= 65535 * 32768, || format!("t={t} rows exceed the grid"))?;
    let (h, ti) = (as_i32(OP, "half", half)?, as_i32(OP, "t", t)?);
    let null: u64 = 0;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_rope_at_f32"));
    b.arg(inv_freq).arg(&h).arg(&factor).arg(base);
    match offsets {
        Some(o) => b.arg(o),
        None => b.arg(&null),
    };
    b.arg(&ti).arg(&mut *cos).arg(&mut *sin);
    // SAFETY: lengths checked above; a null offsets pointer means position base + row.
    unsafe { b.launch(launch_cfg((t as u32, 1, 1), 64, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// An element type rows can be stored as: bf16 (rounded from f32) or f32 (copied), each its own kernel.
pub trait StoreElem: cudarc::driver::DeviceRepr {
    const KERNEL: &'static str;
    /// The batch form ([`store_rows_seg`]).
    const SEG_KERNEL: &'static str;
}
impl StoreElem for bf16 {
    const KERNEL: &'static str = "kdtree_store_rows_bf16";
    const SEG_KERNEL: &'static str = "kdtree_store_rows_seg_bf16";
}
impl StoreElem for f32 {
    const KERNEL: &'static str = "kdtree_store_rows_f32";
    const SEG_KERNEL: &'static str = "kdtree_store_rows_seg_f32";
}

/// Rows `[row0[0], row0[0] + n)` of `dst` (`[cap, w]`, bf16 or f32) = `src` `[n, w]` f32 (rounded to bf16
/// for a bf16 `dst`). The caller guarantees `row0[0] + n <= cap` (`row0_host` is the host mirror, checked
/// here).
pub fn store_rows<T: StoreElem>(
    gpu: &Gpu,
    dst: &mut CudaViewMut<'_, T>,
    w: usize,
    row0: &CudaView<'_, i32>,
    row0_host: usize,
    src: &CudaView<'_, f32>,
    n: usize,
) -> Result<()> {
    need_len(OP, "row0", row0.len(), 1)?;
    need_len(OP, "src", src.len(), n * w)?;
    need_len(OP, "dst", dst.len(), (row0_host + n) * w)?;
    if n == 0 || w == 0 {
        return Ok(());
    }
    let (wi, ni) = (as_i32(OP, "w", w)?, as_i32(OP, "n", n)?);
    let mut b = gpu.stream.launch_builder(gpu.func(T::KERNEL));
    b.arg(&mut *dst).arg(&wi).arg(row0).arg(src).arg(&ni);
    // SAFETY: dst holds row0 + n rows of w (checked against the host mirror of row0).
    unsafe { b.launch(launch_cfg((grid_for(n * w), 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// `out` `[rows_out, cols]`: row i = row `path[i]` of `x` `[nodes, cols]` for i < the walk's length, zeros
/// after (`walk_out` = `[len, path[..]]`, len <= rows_out, path entries < nodes).
pub fn path_rows(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    nodes: usize,
    cols: usize,
    walk_out: &CudaView<'_, i32>,
    rows_out: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    need_len(OP, "x", x.len(), nodes * cols)?;
    need_len(OP, "walk_out", walk_out.len(), 1 + rows_out)?;
    need_len(OP, "out", out.len(), rows_out * cols)?;
    if rows_out == 0 || cols == 0 {
        return Ok(());
    }
    let (c, r) = (as_i32(OP, "cols", cols)?, as_i32(OP, "rows_out", rows_out)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_path_rows_f32"));
    b.arg(x).arg(&c).arg(walk_out).arg(&r).arg(&mut *out);
    // SAFETY: the walk wrote len <= rows_out node indices below `nodes` (ddtree_walk over this tree).
    unsafe { b.launch(launch_cfg((rows_out as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// One sequence of a feed step's stash: its stash (`[cap, w]` f32), its count where the ops read it (host
/// mirror `at`, checked against the room).
pub struct StashSeg<'a> {
    pub dst: CudaViewMut<'a, f32>,
    pub pos: CudaViewMut<'a, i32>,
    pub at: usize,
}

/// The kernel's by-value table (`struct StashSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct StashSegsArg {
    dst: [u64; MAX_SEGS],
    pos: [u64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct StashSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for StashSegsArg {}

/// Up to [`MAX_SEGS`] sequences' feed-step stashes in one launch: row s of `src` (`[nseg, w]` f32) into row
/// `pos_s` of stash s, then `pos_s += 1` (the kernel writes through the table's device addresses).
pub fn stash_rows_seg_f32(gpu: &Gpu, segs: &mut [StashSeg<'_>], w: usize, src: &CudaView<'_, f32>) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} segments in one launch (at most {MAX_SEGS})")
    })?;
    need_len(OP, "src", src.len(), nseg * w)?;
    if nseg == 0 || w == 0 {
        return Ok(());
    }
    let mut arg = StashSegsArg {
        dst: [0; MAX_SEGS],
        pos: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(2 * nseg);
    for (i, s) in segs.iter_mut().enumerate() {
        need_len(OP, "pos", s.pos.len(), 1)?;
        need_len(OP, "stash", s.dst.len(), (s.at + 1) * w)?;
        use cudarc::driver::DevicePtrMut;
        let (pd, gd) = s.dst.device_ptr_mut(&gpu.stream);
        let (pp, gp) = s.pos.device_ptr_mut(&gpu.stream);
        guards.extend([gd, gp]);
        (arg.dst[i], arg.pos[i]) = (pd, pp);
    }
    let wi = as_i32(OP, "w", w)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_stash_rows_seg_f32"));
    b.arg(&arg).arg(&wi).arg(src);
    // SAFETY: each stash holds its count + 1 rows of w (checked against the host mirrors), src nseg rows.
    unsafe { b.launch(launch_cfg((nseg as u32, 1, 1), 256, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// Segments one batched launch of this module takes (`STORE_SEGS` and the other tables in round_state.cu).
pub const MAX_SEGS: usize = 64;

/// One sequence of a batched store: its cache layer (`[cap, w]` bf16), its committed length where the ops
/// read it (host mirror `committed`, checked), its row count.
pub struct StoreSeg<'a, T = bf16> {
    pub dst: CudaViewMut<'a, T>,
    pub pos: CudaView<'a, i32>,
    pub committed: usize,
    pub n: usize,
}

/// The kernel's by-value table (`struct StoreSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct StoreSegsArg {
    dst: [u64; MAX_SEGS],
    pos: [u64; MAX_SEGS],
    row0: [i32; MAX_SEGS + 1],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct StoreSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for StoreSegsArg {}

/// [`store_rows`] of up to [`MAX_SEGS`] sequences in one launch: segment s's rows of `src` (`[Σ n, w]` f32, in
/// segment order) into rows `[pos_s, pos_s + n_s)` of its `dst` (bf16: rounded; f32: copied; the kernel
/// writes through the table's device addresses).
pub fn store_rows_seg<T: StoreElem>(
    gpu: &Gpu,
    segs: &mut [StoreSeg<'_, T>],
    w: usize,
    src: &CudaView<'_, f32>,
) -> Result<()> {
    ensure(OP, segs.len() <= MAX_SEGS, || {
        format!("{} segments in one launch (at most {MAX_SEGS})", segs.len())
    })?;
    let n: usize = segs.iter().map(|s| s.n).sum();
    need_len(OP, "src", src.len(), n * w)?;
    if n == 0 || w == 0 {
        return Ok(());
    }
    let nseg = segs.len();
    let mut arg = StoreSegsArg {
        dst: [0; MAX_SEGS],
        pos: [0; MAX_SEGS],
        row0: [0; MAX_SEGS + 1],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(2 * segs.len());
    let (mut row, mut most) = (0, 0);
    for (i, s) in segs.iter_mut().enumerate() {
        need_len(OP, "pos", s.pos.len(), 1)?;
        need_len(OP, "dst", s.dst.len(), (s.committed + s.n) * w)?;
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (pd, gd) = s.dst.device_ptr_mut(&gpu.stream);
        let (pp, gp) = s.pos.device_ptr(&gpu.stream);
        guards.extend([gd, gp]);
        (arg.dst[i], arg.pos[i], arg.row0[i]) = (pd, pp, as_i32(OP, "row", row)?);
        row += s.n;
        most = most.max(s.n);
    }
    arg.row0[nseg] = as_i32(OP, "rows", row)?;
    let wi = as_i32(OP, "w", w)?;
    let mut b = gpu.stream.launch_builder(gpu.func(T::SEG_KERNEL));
    b.arg(&arg).arg(&wi).arg(src);
    // SAFETY: each dst holds its committed + n rows of w (checked against the host mirrors), src all rows.
    unsafe { b.launch(launch_cfg((grid_for(most * w), nseg as u32, 1), 256, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// One segment of [`rope_at_segs`]: its base counter where the ops read it, its offsets (None: row i at
/// base + i) and its row count.
pub struct RopeSeg<'a> {
    pub base: CudaView<'a, i32>,
    pub offsets: Option<CudaView<'a, u32>>,
    pub rows: usize,
}

/// The kernel's by-value table (`struct RopeSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct RopeSegsArg {
    base: [u64; MAX_SEGS],
    offsets: [u64; MAX_SEGS],
    row0: [i32; MAX_SEGS + 1],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct RopeSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for RopeSegsArg {}

/// [`rope_at`] of up to [`MAX_SEGS`] segments in one launch: cos/sin `[Σ rows, half]`, segment s's rows (in
/// segment order) those of its own base and offsets, the same values as its own [`rope_at`].
pub fn rope_at_segs(
    gpu: &Gpu,
    inv_freq: &CudaView<'_, f32>,
    factor: f64,
    segs: &[RopeSeg<'_>],
    cos: &mut CudaViewMut<'_, f32>,
    sin: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let (half, nseg) = (inv_freq.len(), segs.len());
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} rope segments in one launch (at most {MAX_SEGS})")
    })?;
    let t: usize = segs.iter().map(|s| s.rows).sum();
    need_len(OP, "cos", cos.len(), t * half)?;
    need_len(OP, "sin", sin.len(), t * half)?;
    if t == 0 || half == 0 {
        return Ok(());
    }
    let mut arg = RopeSegsArg {
        base: [0; MAX_SEGS],
        offsets: [0; MAX_SEGS],
        row0: [0; MAX_SEGS + 1],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(2 * nseg);
    let (mut row, mut most) = (0, 0);
    for (i, s) in segs.iter().enumerate() {
        use cudarc::driver::DevicePtr;
        need_len(OP, "base", s.base.len(), 1)?;
        let (pb, gb) = s.base.device_ptr(&gpu.stream);
        guards.push(gb);
        arg.base[i] = pb;
        if let Some(o) = &s.offsets {
            need_len(OP, "offsets", o.len(), s.rows)?;
            let (po, go) = o.device_ptr(&gpu.stream);
            guards.push(go);
            arg.offsets[i] = po;
        }
        arg.row0[i] = as_i32(OP, "row", row)?;
        row += s.rows;
        most = most.max(s.rows);
    }
    arg.row0[nseg] = as_i32(OP, "rows", row)?;
    ensure(OP, most <= i32::MAX as usize, || format!("{most} rows in one segment"))?;
    let h = as_i32(OP, "half", half)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_rope_at_segs_f32"));
    b.arg(&arg)
        .arg(inv_freq)
        .arg(&h)
        .arg(&factor)
        .arg(&mut *cos)
        .arg(&mut *sin);
    // SAFETY: cos/sin hold Σ rows of half (checked), each segment's offsets its rows; a null offsets pointer
    // means position base + row.
    unsafe { b.launch(launch_cfg((most as u32, nseg as u32, 1), 64, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// The kernel's by-value table (`struct BlockRoots`).
#[repr(C)]
#[derive(Clone, Copy)]
struct BlockRootsArg {
    root: [u64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct BlockRoots`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for BlockRootsArg {}

/// Up to [`MAX_SEGS`] draft blocks in one launch: `dst[s·block] = roots[s][0]`, the block's other ids `fill`.
pub fn ids_blocks(
    gpu: &Gpu,
    dst: &mut CudaViewMut<'_, u32>,
    roots: &[CudaView<'_, u32>],
    block: usize,
    fill: u32,
) -> Result<()> {
    let nseg = roots.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} blocks in one launch (at most {MAX_SEGS})")
    })?;
    need_len(OP, "dst", dst.len(), nseg * block)?;
    if nseg == 0 || block == 0 {
        return Ok(());
    }
    let mut arg = BlockRootsArg {
        root: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(nseg);
    for (i, r) in roots.iter().enumerate() {
        use cudarc::driver::DevicePtr;
        need_len(OP, "root", r.len(), 1)?;
        let (p, g) = r.device_ptr(&gpu.stream);
        guards.push(g);
        arg.root[i] = p;
    }
    let bl = as_i32(OP, "block", block)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_ids_blocks"));
    b.arg(&arg).arg(&mut *dst).arg(&bl).arg(&fill);
    // SAFETY: dst holds nseg blocks (checked), each root one id.
    unsafe { b.launch(launch_cfg((nseg as u32, 1, 1), 64, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// The kernel's by-value table (`struct PathSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct PathSegsArg {
    walk_out: [u64; MAX_SEGS],
    row0: [i32; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct PathSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for PathSegsArg {}

/// [`path_rows`] of up to [`MAX_SEGS`] walks in one launch: segment s = (its walk_out `[len, path..]`, the row of
/// `x` its node 0 is, its node count) fills rows `[s·rows_out, (s+1)·rows_out)` of `out` (`[nseg·rows_out,
/// cols]`): the rows its own [`path_rows`] would write.
pub fn path_rows_segs(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    cols: usize,
    segs: &[(CudaView<'_, i32>, usize, usize)],
    rows_out: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} walks in one launch (at most {MAX_SEGS})")
    })?;
    need_len(OP, "out", out.len(), nseg * rows_out * cols)?;
    if nseg == 0 || rows_out == 0 || cols == 0 {
        return Ok(());
    }
    let mut arg = PathSegsArg {
        walk_out: [0; MAX_SEGS],
        row0: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(nseg);
    for (i, (w, row0, nodes)) in segs.iter().enumerate() {
        use cudarc::driver::DevicePtr;
        need_len(OP, "walk_out", w.len(), 1 + rows_out)?;
        need_len(OP, "x", x.len(), (row0 + nodes) * cols)?;
        let (p, g) = w.device_ptr(&gpu.stream);
        guards.push(g);
        (arg.walk_out[i], arg.row0[i]) = (p, as_i32(OP, "row0", *row0)?);
    }
    let (c, r) = (as_i32(OP, "cols", cols)?, as_i32(OP, "rows_out", rows_out)?);
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_path_rows_segs_f32"));
    b.arg(&arg).arg(x).arg(&c).arg(&r).arg(&mut *out);
    // SAFETY: each walk wrote len <= rows_out node indices below its node count (ddtree_walk over its tree),
    // whose rows of x were checked.
    unsafe { b.launch(launch_cfg((rows_out as u32, nseg as u32, 1), 256, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// The kernel's by-value table (`struct CopySegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct CopySegsArg {
    src: [u64; MAX_SEGS],
    n: [i32; MAX_SEGS],
    at: [i32; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct CopySegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for CopySegsArg {}

/// Up to [`MAX_SEGS`] small copies of 32-bit words in one launch: `dst[at_s .. at_s + n_s] = src_s[..n_s]`.
pub fn copy_segs_u32(
    gpu: &Gpu,
    segs: &[(CudaView<'_, u32>, usize, usize)],
    dst: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} copies in one launch (at most {MAX_SEGS})")
    })?;
    if nseg == 0 {
        return Ok(());
    }
    let mut arg = CopySegsArg {
        src: [0; MAX_SEGS],
        n: [0; MAX_SEGS],
        at: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(nseg);
    for (i, (src, n, at)) in segs.iter().enumerate() {
        use cudarc::driver::DevicePtr;
        need_len(OP, "src", src.len(), *n)?;
        need_len(OP, "dst", dst.len(), at + n)?;
        let (p, g) = src.device_ptr(&gpu.stream);
        guards.push(g);
        (arg.src[i], arg.n[i], arg.at[i]) = (p, as_i32(OP, "n", *n)?, as_i32(OP, "at", *at)?);
    }
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_copy_segs_u32"));
    b.arg(&arg).arg(&mut *dst);
    // SAFETY: each source holds its n words and dst every at + n (checked).
    unsafe { b.launch(launch_cfg((nseg as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}

/// The kernel's by-value table (`struct AdvanceSegs`).
#[repr(C)]
#[derive(Clone, Copy)]
struct AdvanceSegsArg {
    walk: [u64; MAX_SEGS],
    kv_pos: [u64; MAX_SEGS],
    ctx_pos: [u64; MAX_SEGS],
    root: [u64; MAX_SEGS],
    nseg: i32,
}
// SAFETY: plain old data with the C layout of `struct AdvanceSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for AdvanceSegsArg {}

/// One sequence of [`round_advance_segs`]: its walk and its counters and root.
pub struct AdvanceSeg<'a> {
    pub walk_out: CudaView<'a, i32>,
    pub kv_pos: CudaViewMut<'a, i32>,
    pub ctx_pos: CudaViewMut<'a, i32>,
    pub root: CudaViewMut<'a, u32>,
}

/// [`round_advance`] of up to [`MAX_SEGS`] sequences in one launch (walks of `m` rows at most).
pub fn round_advance_segs(gpu: &Gpu, segs: &mut [AdvanceSeg<'_>], m: usize) -> Result<()> {
    let nseg = segs.len();
    ensure(OP, nseg <= MAX_SEGS, || {
        format!("{nseg} advances in one launch (at most {MAX_SEGS})")
    })?;
    ensure(OP, m > 0, || "a walk of 0 rows".into())?;
    if nseg == 0 {
        return Ok(());
    }
    let mut arg = AdvanceSegsArg {
        walk: [0; MAX_SEGS],
        kv_pos: [0; MAX_SEGS],
        ctx_pos: [0; MAX_SEGS],
        root: [0; MAX_SEGS],
        nseg: nseg as i32,
    };
    let mut guards = Vec::with_capacity(4 * nseg);
    for (i, a) in segs.iter_mut().enumerate() {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        need_len(OP, "walk_out", a.walk_out.len(), 1 + 2 * m)?;
        need_len(OP, "kv_pos", a.kv_pos.len(), 1)?;
        need_len(OP, "ctx_pos", a.ctx_pos.len(), 1)?;
        need_len(OP, "root", a.root.len(), 1)?;
        let s = &gpu.stream;
        let (p0, g0) = a.walk_out.device_ptr(s);
        let (p1, g1) = a.kv_pos.device_ptr_mut(s);
        let (p2, g2) = a.ctx_pos.device_ptr_mut(s);
        let (p3, g3) = a.root.device_ptr_mut(s);
        guards.push(g0);
        guards.extend([g1, g2]);
        guards.push(g3);
        (arg.walk[i], arg.kv_pos[i], arg.ctx_pos[i], arg.root[i]) = (p0, p1, p2, p3);
    }
    let mi = as_i32(OP, "m", m)?;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_round_advance_segs"));
    b.arg(&arg).arg(&mi);
    // SAFETY: each walk_out holds 1 + 2m values with 1 <= len <= m (ddtree_walk), the counters one i32 each.
    unsafe { b.launch(launch_cfg((1, 1, 1), MAX_SEGS as u32, 0)) }.map_err(drv(OP))?;
    drop(guards);
    Ok(())
}
