//! Ancestor-bitmask wrapper for kernels/cuda/visibility.cu. CPU twin: `crate::ddtree::Visibility::from_parents`.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{as_i32, launch_cfg, need_len};
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "visibility";

/// `bits` `[rows, words]` u64: row i < n = node i and its ancestors (from `parents` `[rows]` i32, each -1 or
/// an earlier node: the caller guarantees it, e.g. the tree builder's output), rows n.. zero. `n` is read
/// on the device (`None` = all rows), so a captured graph serves any tree size up to `rows`.
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn visibility(
    gpu: &Gpu,
    parents: &CudaView<'_, i32>,
    n: Option<&CudaView<'_, i32>>,
    rows: usize,
    words: usize,
    bits: &mut CudaViewMut<'_, u64>,
) -> Result<()> {
    ensure(OP, words * 64 >= rows && words > 0, || {
        format!("{words} words per row cannot hold {rows} nodes")
    })?;
    need_len(OP, "parents", parents.len(), rows)?;
    need_len(OP, "bits", bits.len(), rows * words)?;
    if let Some(n) = n {
        need_len(OP, "n", n.len(), 1)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let (r, w) = (as_i32(OP, "rows", rows)?, as_i32(OP, "words", words)?);
    let null = 0u64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_visibility_from_parents"));
    b.arg(parents);
    match n {
        Some(n) => b.arg(n),
        None => b.arg(&null),
    };
    b.arg(&r).arg(&w).arg(bits);
    // SAFETY: lengths checked above; a null `n` pointer means all rows.
    unsafe { b.launch(launch_cfg((rows.div_ceil(128) as u32, 1, 1), 128, 0)) }.map_err(drv(OP))?;
    Ok(())
}
