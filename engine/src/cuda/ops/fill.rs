//! Seeded dummy-weight fills, wrapper for kernels/cuda/fill.cu. CPU twin and spec: `crate::cpu::ops::fill`
//! (bit-identical). Test: engine/tests/cuda_target.rs (`dummy_fill_matches_the_cpu`).

use cudarc::driver::{CudaViewMut, PushKernelArg};
use half::bf16;

use super::launch_cfg;
use crate::backend::Fill;
use crate::cuda::{drv, ensure, CudaError, Gpu, Result};

const OP: &str = "fill";

/// Grid of a fill of `n` elements, `per` elements per thread (a grid-stride loop covers the rest).
fn grid(gpu: &Gpu, n: usize, per: usize) -> u32 {
    let threads = n.div_ceil(per).max(1);
    threads.div_ceil(256).min(gpu.sms * 32).max(1) as u32
}

fn uniform(f: &Fill, what: &str) -> Result<(u64, f32, f32)> {
    match (f, f.center_step()) {
        (Fill::Uniform { seed, .. }, Some((c, s))) => Ok((*seed, c, s)),
        _ => Err(CudaError::Shape {
            op: OP,
            msg: format!("a byte fill asked for a {what} buffer"),
        }),
    }
}

/// `out[i]` = the uniform fill `f` of element i (bf16), for every element of `out`.
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn fill_bf16(gpu: &Gpu, out: &mut CudaViewMut<'_, bf16>, f: &Fill) -> Result<()> {
    let (seed, center, step) = uniform(f, "bf16")?;
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_fill_uniform_bf16"));
    b.arg(out).arg(&n64).arg(&seed).arg(&center).arg(&step);
    // SAFETY: the kernel writes elements [0, n) of `out`, which holds n.
    unsafe { b.launch(launch_cfg((grid(gpu, n, 4), 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// [`fill_bf16`] for an f32 buffer. Same launch contract.
pub fn fill_f32(gpu: &Gpu, out: &mut CudaViewMut<'_, f32>, f: &Fill) -> Result<()> {
    let (seed, center, step) = uniform(f, "f32")?;
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_fill_uniform_f32"));
    b.arg(out).arg(&n64).arg(&seed).arg(&center).arg(&step);
    // SAFETY: as in fill_bf16.
    unsafe { b.launch(launch_cfg((grid(gpu, n, 4), 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// `out[i]` = byte i of the byte fill `f` (INT4 nibble stacks). Same launch contract.
pub fn fill_u8(gpu: &Gpu, out: &mut CudaViewMut<'_, u8>, f: &Fill) -> Result<()> {
    let Fill::Bytes { seed } = *f else {
        return Err(CudaError::Shape {
            op: OP,
            msg: "a uniform fill asked for a u8 buffer".into(),
        });
    };
    let n = out.len();
    ensure(OP, n < u64::MAX as usize / 2, || format!("n={n} too large"))?;
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_fill_bytes_u8"));
    b.arg(out).arg(&n64).arg(&seed);
    // SAFETY: as in fill_bf16.
    unsafe { b.launch(launch_cfg((grid(gpu, n, 16), 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}

/// Every byte of `out` = 0, by a kernel (`Gpu::zeros` inside a captured round: no memset node).
/// Launch contract: no allocation, no host sync, graph-capturable.
pub fn zero<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, out: &mut cudarc::driver::CudaSlice<T>) -> Result<()> {
    let n = out.len() * std::mem::size_of::<T>();
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let mut b = gpu.stream.launch_builder(gpu.func("kdtree_zero_bytes"));
    b.arg(out).arg(&n64);
    // SAFETY: the kernel writes the n bytes of `out`, which holds them.
    unsafe { b.launch(launch_cfg((grid(gpu, n, 16), 1, 1), 256, 0)) }.map_err(drv(OP))?;
    Ok(())
}
