//! One wrapper per op (engine/src/cuda/ops/<op>.rs wraps kernels/cuda/<op>.cu; the CPU twin is named in
//! each file). Every wrapper checks shapes and lengths before it launches, launches on `gpu.stream`, and
//! maps failures to [`super::CudaError`] naming the op. Unless a wrapper says otherwise, a launch does no
//! allocation and no host sync, and is graph-capturable.

pub mod act_f32;
pub mod argmax;
pub mod copy_rows;
pub mod ddtree_build;
pub mod ddtree_walk;
pub mod embed;
pub mod fill;
pub mod gather_rows;
pub mod gemm_bf16;
pub mod gqa_attention;
pub mod kv_compact;
pub mod mla_absorb;
pub mod mla_attention;
pub mod mla_decode;
pub mod mla_invariant;
pub mod mla_prefill;
pub mod moe_align;
pub mod moe_combine;
pub mod moe_router;
pub mod residual_add;
pub mod rms_norm;
pub mod rope;
pub mod round_state;
pub mod sample_rows;
pub mod silu_mul;
pub mod topk_logprobs;
pub mod visibility;
pub mod w4a16_gemm;
pub mod xxh3;

use cudarc::driver::{CudaView, LaunchConfig};

use super::{ensure, Result};

/// Launches kernel `name` with programmatic dependent launch when the GPU allows it ([`super::Gpu::pdl`]):
/// the kernel may start while the one before it drains, so it must execute `griddepcontrol.wait` before it
/// reads anything an earlier kernel writes (kernels/cuda/w4a16_gemm.cu `pdl_wait`). `params` point at the
/// kernel's arguments in order (device addresses as `u64`, scalars as their C types).
///
/// # Safety
/// As `cuLaunchKernel`: `params` must match the kernel's signature and every address must be valid for what
/// the kernel reads and writes.
pub(crate) unsafe fn launch_pdl(
    gpu: &super::Gpu,
    op: &'static str,
    name: &'static str,
    cfg: LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    use cudarc::driver::sys;
    let f = gpu.func(name);
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: gpu.stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(gpu.pdl()),
    };
    gpu.ctx.bind_to_thread().map_err(super::drv(op))?;
    sys::cuLaunchKernelEx(&lc, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut())
        .result()
        .map_err(super::drv(op))
}

/// The device address of a mutable view (for [`launch_pdl`] arguments).
pub(crate) fn addr_mut<T>(gpu: &super::Gpu, v: &mut cudarc::driver::CudaViewMut<'_, T>) -> u64 {
    use cudarc::driver::DevicePtrMut;
    let (p, _sync) = v.device_ptr_mut(&gpu.stream);
    p
}

pub(crate) fn launch_cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Checks that a buffer named `what` holds at least `need` elements.
pub(crate) fn need_len(op: &'static str, what: &str, have: usize, need: usize) -> Result<()> {
    ensure(op, have >= need, || {
        format!("{what} has {have} elements, needs at least {need}")
    })
}

/// Elements spanned by `rows` rows of `width` with row stride `ld` (0 when rows = 0).
pub(crate) fn span(rows: usize, ld: usize, width: usize) -> usize {
    if rows == 0 {
        0
    } else {
        (rows - 1) * ld + width
    }
}

/// Converts a size to the kernels' `int`, naming the op and quantity when it does not fit.
pub(crate) fn as_i32(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| super::CudaError::Shape {
        op,
        msg: format!("{what}={v} exceeds i32"),
    })
}

/// Device address of a view (for alignment checks).
pub(crate) fn addr<T>(gpu: &super::Gpu, v: &CudaView<'_, T>) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = v.device_ptr(&gpu.stream);
    p
}
