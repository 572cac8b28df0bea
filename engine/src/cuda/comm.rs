//! The communicator seam of tensor parallelism (issue 11): the CUDA backend sums the partials of the ranks a GPU
//! holds itself, in rank order (`Backend::all_reduce`), then hands the sum to the GPU's [`Communicator`], which
//! sums it over the GPUs of the run (the vocab merges of embed_tokens / lm_head go through the same sum:
//! `backend::VocabShards`). Three implementations:
//! * [`OneGpu`]: every rank on this one GPU, one controller; nothing to exchange (the default).
//! * [`Nccl`]: NCCL through cudarc (libnccl loaded at run time), an in-place sum on the GPU's stream, so it is
//!   captured into the round's CUDA graph with the rest (NCCL collectives are graph-capturable since 2.9).
//!   One communicator per GPU of a run ([`Nccl::group`]), each driven by its own thread (`crate::tp`).
//! * [`SharedGpu`]: the ranks of a run side by side on one GPU, each with its own thread, stream and weights,
//!   as if each had a GPU: the sum is a device-side rendezvous in a fixed rank order
//!   (kernels/cuda/group_all_reduce.cu), capturable like NCCL's (groups sharing a GPU run eagerly for now:
//!   docs/design/tensor-parallel.md "still open").
//!
//! Tests: engine/tests/cuda_comm.rs (one NCCL rank: the all-reduce, whole rounds and AR steps with the `OneGpu`
//! tokens), engine/tests/cuda_tp.rs (`SharedGpu`: the rank-order sum over R streams; R rank threads on one GPU
//! give one controller's tokens). Plan and status: docs/design/tensor-parallel.md.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, PushKernelArg};

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
        Self::group(&[gpu])?.pop().ok_or_else(|| CudaError::Shape { op: "nccl", msg: "no communicator for the one rank".into() })
    }

    /// One communicator per GPU of a run, in rank order (`ncclCommInitAll` over their streams: one process,
    /// each GPU then driven by its own thread). The GPUs must be distinct devices (NCCL refuses two ranks on
    /// one GPU: that is [`SharedGpu`]'s case).
    pub fn group(gpus: &[&Gpu]) -> Result<Vec<Nccl>> {
        if !Self::available() {
            return Err(CudaError::Shape { op: "nccl", msg: "libnccl is not on the library path (pip's nvidia-nccl-cu13 ships lib/libnccl.so.2: link it as libnccl.so)".into() });
        }
        let streams = gpus.iter().map(|g| g.stream.clone()).collect();
        let comms = cudarc::nccl::safe::Comm::from_devices(streams).map_err(|e| CudaError::Shape { op: "nccl", msg: format!("ncclCommInitAll over {} GPUs: {e:?}", gpus.len()) })?;
        Ok(comms.into_iter().map(|comm| Nccl { comm }).collect())
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

/// Blocks of a group all-reduce launch (`GROUP_BLOCKS` in kernels/cuda/group_all_reduce.cu): few, since while
/// they wait for the other groups they hold part of an SM each.
pub const GROUP_BLOCKS: usize = 4;
/// Floats one block stages per launch; a larger buffer is summed in several launches.
const GROUP_CAP: usize = 131072;
/// How long a rank waits for the others inside a sum before the kernel traps (an error, not a hang).
const GROUP_TIMEOUT_NS: u64 = 20_000_000_000;

/// The one-GPU communicator: `world` ranks on one GPU, each its own [`Gpu`] (stream, graphs) and thread, meeting
/// in device memory: two staging buffers of `world` x [`GROUP_BLOCKS`] x [`GROUP_CAP`] floats, and per rank and
/// block an arrival flag and an epoch counter (protocol: kernels/cuda/group_all_reduce.cu). Every rank must run
/// the same sums in the same order (`crate::tp` drives them in lock-step); a rank that never arrives makes the
/// others' kernels trap after 20 s.
pub struct SharedGpu {
    world: usize,
    staging: CudaSlice<f32>,
    flags: CudaSlice<u32>,
    epochs: CudaSlice<u32>,
}

impl SharedGpu {
    /// The group's device memory on `gpu` (the GPU every rank runs on), zeroed, then one handle per rank.
    pub fn ranks(gpu: &Gpu, world: usize) -> Result<Vec<SharedRank>> {
        super::ensure("shared-gpu group", (1..=64).contains(&world), || format!("{world} ranks (1..=64)"))?;
        let staging = gpu.zeros::<f32>(2 * world * GROUP_BLOCKS * GROUP_CAP)?;
        let (flags, epochs) = (gpu.zeros::<u32>(world * GROUP_BLOCKS)?, gpu.zeros::<u32>(world * GROUP_BLOCKS)?);
        gpu.sync()?;
        let g = Arc::new(SharedGpu { world, staging, flags, epochs });
        Ok((0..world).map(|rank| SharedRank { group: g.clone(), rank }).collect())
    }
}

/// One rank's handle on a [`SharedGpu`] group.
pub struct SharedRank {
    group: Arc<SharedGpu>,
    rank: usize,
}

// SAFETY: the group's buffers are plain device memory; the kernels are the only writers, and each rank's
// launches go to its own GPU stream from its own thread.
unsafe impl Send for SharedRank {}
// SAFETY: as above (`&self` only launches).
unsafe impl Sync for SharedRank {}

impl Communicator for SharedRank {
    fn name(&self) -> &'static str {
        "shared-gpu"
    }
    fn world(&self) -> usize {
        self.group.world
    }
    fn all_reduce_sum(&self, gpu: &Gpu, x: &mut CudaSlice<f32>) -> Result<()> {
        const OP: &str = "group all_reduce";
        let g = &*self.group;
        if g.world == 1 {
            return Ok(());
        }
        let (rank, world, cap, timeout) = (self.rank as i32, g.world as i32, GROUP_CAP as i32, GROUP_TIMEOUT_NS);
        let chunk = GROUP_BLOCKS * GROUP_CAP;
        let mut at = 0;
        // Every rank cuts the same buffer length into the same chunks, so their launches pair up.
        while at < x.len() {
            let n = chunk.min(x.len() - at);
            let mut part = x.slice_mut(at..at + n);
            let nn = n as i32;
            let mut b = gpu.stream.launch_builder(gpu.func("kdtree_group_all_reduce_f32"));
            b.arg(&mut part).arg(&nn).arg(&g.staging).arg(&g.flags).arg(&g.epochs).arg(&rank).arg(&world).arg(&cap).arg(&timeout);
            // SAFETY: `part` holds n <= GROUP_BLOCKS * GROUP_CAP floats; staging, flags and epochs are the group's
            // (sized for `world` ranks); only this rank's staging slots, flags and epochs are written by it.
            unsafe { b.launch(super::ops::launch_cfg((GROUP_BLOCKS as u32, 1, 1), 128, 0)) }.map_err(super::drv(OP))?;
            at += n;
        }
        Ok(())
    }
}
