//! Residual add wrapper for kernels/cuda/residual_add.cu. CPU twin: the f32 add of the residual stream
//! (`h += d` inline in the CPU model; the parity test carries a one-line reference).

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};
use half::bf16;

use super::launch_cfg;
use crate::cuda::{drv, ensure, Gpu, Result};

const OP: &str = "residual_add";

/// `h[i] = bf16(h[i] + d[i])` over all of `h` (f32 add). `d` must have the same length.
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn residual_add(gpu: &Gpu, h: &mut CudaViewMut<'_, bf16>, d: &CudaView<'_, bf16>) -> Result<()> {
    ensure(OP, h.len() == d.len(), || {
        format!("h has {} elements, d has {}", h.len(), d.len())
    })?;
    let n = h.len() as i64;
    if n == 0 {
        return Ok(());
    }
    let blocks = (h.len().div_ceil(8 * 256)).clamp(1, gpu.sms * 8) as u32;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_residual_add_bf16"));
    b.arg(h).arg(d).arg(&n);
    // SAFETY: both buffers hold n elements; the kernel touches indices < n only.
    unsafe { b.launch(launch_cfg((blocks, 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
