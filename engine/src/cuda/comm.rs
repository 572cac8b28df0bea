//! The communicator seam of tensor parallelism (issue 11): the CUDA backend sums the partials of the ranks a GPU
//! holds itself, in rank order (`Backend::all_reduce`), then hands the sum to the GPU's [`Communicator`], which
//! sums it over the GPUs of the run. Two implementations:
//! * [`OneGpu`]: every rank on this one GPU; nothing to exchange (the default).
//! * [`Nccl`]: NCCL through cudarc (libnccl loaded at run time), an in-place sum on the GPU's stream, so it is
//!   captured into the round's CUDA graph with the rest (NCCL collectives are graph-capturable since 2.9).
//!
//! Built and tested so far: one NCCL rank on one GPU (engine/tests/cuda_comm.rs: the all-reduce, and whole
//! rounds and AR steps through it, with the `OneGpu` tokens). Not built: several GPUs (a thread, stream and
//! graph per rank, the replicated parts on every rank, the vocab merges over GPUs): docs/design/tensor-parallel.md.

use cudarc::driver::CudaSlice;

use super::{CudaError, Gpu, Result};

/// Sums a GPU's rank partial over the GPUs of a run.
pub trait Communicator: Send + Sync {
    /// "one-gpu", "nccl".
    fn name(&self) -> &'static str;
    /// GPUs in the run.
    fn world(&self) -> usize;
    /// `x` = the sum of every GPU's `x`, in place, on this GPU's stream (no host sync).
    fn all_reduce_sum(&self, gpu: &Gpu, x: &mut CudaSlice<f32>) -> Result<()>;
}

/// All ranks on one GPU: the backend's own rank-order sum is the whole sum.
pub struct OneGpu;

impl Communicator for OneGpu {
    fn name(&self) -> &'static str {
        "one-gpu"
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _gpu: &Gpu, _x: &mut CudaSlice<f32>) -> Result<()> {
        Ok(())
    }
}

/// An NCCL communicator of this GPU's rank.
pub struct Nccl {
    comm: cudarc::nccl::safe::Comm,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not concurrent; the engine
// issues them from the one thread that drives this GPU's stream (Backend ops take the backend by reference on
// that thread), and cudarc's Comm holds only the handle and the stream.
unsafe impl Send for Nccl {}
// SAFETY: as above: every use goes through `&self` on the GPU's driving thread, never two at once.
unsafe impl Sync for Nccl {}

impl Nccl {
    /// Whether libnccl can be loaded here (cudarc loads it at run time: `libnccl.so` or a versioned name on the
    /// library path).
    pub fn available() -> bool {
        // SAFETY: only tries to open the library by its candidate names.
        unsafe { cudarc::nccl::sys::is_culib_present() }
    }

    /// A communicator of one rank on `gpu` (a run of one GPU through NCCL).
    pub fn one_rank(gpu: &Gpu) -> Result<Nccl> {
        if !Self::available() {
            return Err(CudaError::Shape { op: "nccl", msg: "libnccl is not on the library path (pip's nvidia-nccl-cu13 ships lib/libnccl.so.2: link it as libnccl.so)".into() });
        }
        let mut comms = cudarc::nccl::safe::Comm::from_devices(vec![gpu.stream.clone()]).map_err(|e| CudaError::Shape { op: "nccl", msg: format!("ncclCommInitAll: {e:?}") })?;
        let comm = comms.pop().ok_or_else(|| CudaError::Shape { op: "nccl", msg: "no communicator for the one rank".into() })?;
        Ok(Nccl { comm })
    }
}

impl Communicator for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn world(&self) -> usize {
        self.comm.world_size()
    }
    fn all_reduce_sum(&self, _gpu: &Gpu, x: &mut CudaSlice<f32>) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        self.comm.all_reduce_in_place(x, &cudarc::nccl::safe::ReduceOp::Sum).map(|_| ()).map_err(|e| CudaError::Shape { op: "nccl all_reduce", msg: format!("{e:?}") })
    }
}
