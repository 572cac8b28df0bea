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
//!   (kernels/cuda/group_all_reduce.cu), captured into every group's graphs like NCCL's.
//!
//! The ranks of one process (NCCL's group and the shared GPU's) also pace their launches at a [`LaunchGate`], so
//! that no rank's queued work can keep another from launching the work that leads to a collective.
//!
//! Tests: engine/tests/cuda_comm.rs (one NCCL rank: the all-reduce, whole rounds and AR steps with the `OneGpu`
//! tokens), engine/tests/cuda_tp.rs (`SharedGpu`: the rank-order sum over R streams; R rank threads on one GPU
//! give one controller's tokens). Plan and status: docs/design/tensor-parallel.md.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{CudaError, Gpu, GpuOptions, Result};

/// Sums a GPU's rank partial over the GPUs of a run.
pub trait Communicator: Send + Sync {
    /// "one-gpu", "nccl".
    fn name(&self) -> &'static str;
    /// GPUs in the run.
    fn world(&self) -> usize;
    /// `x` = the sum of every GPU's `x`, in place, on this GPU's stream (no host sync).
    fn all_reduce_sum(&self, gpu: &Gpu, x: &mut CudaSlice<f32>) -> Result<()>;
    /// Wait until every rank of the run has reached the same point of its launches ([`LaunchGate`]); nothing
    /// for a communicator whose ranks do not share a process. Called after a CUDA graph is captured and before
    /// it is first launched.
    fn gate(&self) -> Result<()> {
        Ok(())
    }
    /// Wake the ranks waiting in [`Communicator::gate`] with an error (a rank failed).
    fn abort(&self, _why: &str) {}
}

/// The ranks of one process pacing their launches so that none can keep another from launching.
///
/// CUDA queues the work of a process's streams in launch queues of bounded size: when they are full, a launch
/// blocks the launching thread until queued work has run. A rank whose stream waits inside a collective for
/// another rank keeps its queued work there, and a rank that had run ahead (launched the work of several
/// layers eagerly, or a round's graph) can fill the queues with work that waits, so that the rank it waits for
/// blocks in a launch before it reaches the collective: a deadlock (the fresh-process hangs of runs 42-43,
/// bench/GPU-RESULTS.md). With a gate after every collective it launches eagerly, a rank never launches past
/// collective k before every rank has launched collective k: the work the ranks have queued beyond the slowest
/// one's is at most one stretch between two collectives each, and the slowest one's launches always go in.
///
/// Every rank passes the same gates in the same order, so gate g is open once `g x world` arrivals were counted;
/// a rank never waits for a gate that its own arrival cannot help open. A wait longer than `timeout` (a rank
/// stopped, or runs a different sequence) is an error naming the gates each rank has passed.
pub struct LaunchGate {
    arrivals: std::sync::atomic::AtomicU64,
    passed: Vec<std::sync::atomic::AtomicU64>,
    aborted: std::sync::Mutex<Option<String>>,
    is_aborted: std::sync::atomic::AtomicBool,
    timeout: std::time::Duration,
}

impl LaunchGate {
    pub fn new(world: usize, timeout: std::time::Duration) -> Arc<LaunchGate> {
        Arc::new(LaunchGate {
            arrivals: 0.into(),
            passed: (0..world).map(|_| 0.into()).collect(),
            aborted: std::sync::Mutex::new(None),
            is_aborted: false.into(),
            timeout,
        })
    }
    /// Rank `rank` arrives at its next gate and waits until every rank has (spinning briefly, then yielding).
    pub fn pass(&self, rank: usize) -> Result<()> {
        use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
        let world = self.passed.len() as u64;
        if world <= 1 {
            return Ok(());
        }
        let aborted = || {
            let why = self
                .aborted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_default();
            Err(CudaError::Shape {
                op: "launch gate",
                msg: format!("rank {rank}: the group was aborted: {why}"),
            })
        };
        if self.is_aborted.load(Acquire) {
            return aborted();
        }
        let g = self.passed[rank].fetch_add(1, Relaxed) + 1;
        self.arrivals.fetch_add(1, SeqCst);
        let t0 = std::time::Instant::now();
        let mut spins = 0u32;
        while self.arrivals.load(Acquire) < g * world {
            if self.is_aborted.load(Acquire) {
                return aborted();
            }
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else if t0.elapsed() < std::time::Duration::from_millis(2) {
                std::thread::yield_now();
            } else if t0.elapsed() > self.timeout {
                let at: Vec<u64> = self.passed.iter().map(|p| p.load(Relaxed)).collect();
                return Err(CudaError::Shape {
                    op: "launch gate",
                    msg: format!(
                        "rank {rank} waited {:.0} s at gate {g} for the other ranks (gates reached per rank: \
                         {at:?}): a rank stopped or ran different launches",
                        self.timeout.as_secs_f64()
                    ),
                });
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        Ok(())
    }
    /// Every waiting rank (and every later arrival) fails with `why`.
    pub fn abort(&self, why: &str) {
        self.aborted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(|| why.to_string());
        self.is_aborted.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Whether `gpu`'s stream is capturing a graph (a capture queues nothing, so it needs no gate).
fn capturing(gpu: &Gpu) -> Result<bool> {
    use cudarc::driver::sys::CUstreamCaptureStatus as S;
    Ok(gpu.stream.capture_status().map_err(super::drv("capture status"))? != S::CU_STREAM_CAPTURE_STATUS_NONE)
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
    gate: Arc<LaunchGate>,
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
        Self::group(&[gpu])?.pop().ok_or_else(|| CudaError::Shape {
            op: "nccl",
            msg: "no communicator for the one rank".into(),
        })
    }

    /// One communicator per GPU of a run, in rank order (`ncclCommInitAll` over their streams: one process,
    /// each GPU then driven by its own thread). The GPUs must be distinct devices (NCCL refuses two ranks on
    /// one GPU: that is [`SharedGpu`]'s case).
    pub fn group(gpus: &[&Gpu]) -> Result<Vec<Nccl>> {
        if !Self::available() {
            return Err(CudaError::Shape {
                op: "nccl",
                msg: "libnccl is not on the library path (pip's nvidia-nccl-cu13 ships lib/libnccl.so.2: link it as \
                      libnccl.so)"
                    .into(),
            });
        }
        let streams = gpus.iter().map(|g| g.stream.clone()).collect();
        let comms = cudarc::nccl::safe::Comm::from_devices(streams).map_err(|e| CudaError::Shape {
            op: "nccl",
            msg: format!("ncclCommInitAll over {} GPUs: {e:?}", gpus.len()),
        })?;
        // Every GPU of a run is opened with the same switches: the first one's say how long a gate waits.
        let wait = gpus
            .first()
            .map_or(GpuOptions::default().gate_timeout, |g| g.options().gate_timeout);
        let gate = LaunchGate::new(gpus.len(), wait);
        Ok(comms
            .into_iter()
            .map(|comm| Nccl {
                comm,
                gate: gate.clone(),
            })
            .collect())
    }
}

impl Communicator for Nccl {
    fn name(&self) -> &'static str {
        "nccl"
    }
    fn world(&self) -> usize {
        self.comm.world_size()
    }
    fn all_reduce_sum(&self, gpu: &Gpu, x: &mut CudaSlice<f32>) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        self.comm
            .all_reduce_in_place(x, &cudarc::nccl::safe::ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| CudaError::Shape {
                op: "nccl all_reduce",
                msg: format!("{e:?}"),
            })?;
        if !capturing(gpu)? {
            self.gate.pass(self.comm.rank())?;
        }
        Ok(())
    }
    fn gate(&self) -> Result<()> {
        self.gate.pass(self.comm.rank())
    }
    fn abort(&self, why: &str) {
        self.gate.abort(why)
    }
}

/// Blocks of a group all-reduce launch (`GROUP_BLOCKS` in kernels/cuda/group_all_reduce.cu): few, since while
/// they wait for the other groups they hold part of an SM each.
pub const GROUP_BLOCKS: usize = 4;
/// Floats one block stages per launch; a larger buffer is summed in several launches.
const GROUP_CAP: usize = 131072;

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
    gate: Arc<LaunchGate>,
    timeout_ns: u64,
}

impl SharedGpu {
    /// The group's device memory on `gpu` (the GPU every rank runs on), zeroed, then one handle per rank.
    pub fn ranks(gpu: &Gpu, world: usize) -> Result<Vec<SharedRank>> {
        super::ensure("shared-gpu group", (1..=64).contains(&world), || {
            format!("{world} ranks (1..=64)")
        })?;
        let staging = gpu.zeros::<f32>(2 * world * GROUP_BLOCKS * GROUP_CAP)?;
        let (flags, epochs) = (
            gpu.zeros::<u32>(world * GROUP_BLOCKS)?,
            gpu.zeros::<u32>(world * GROUP_BLOCKS)?,
        );
        gpu.sync()?;
        let g = Arc::new(SharedGpu {
            world,
            staging,
            flags,
            epochs,
            gate: LaunchGate::new(world, gpu.options().gate_timeout),
            timeout_ns: gpu.options().group_timeout.as_nanos() as u64,
        });
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
        let (rank, world, cap, timeout) = (self.rank as i32, g.world as i32, GROUP_CAP as i32, g.timeout_ns);
        let chunk = GROUP_BLOCKS * GROUP_CAP;
        let mut at = 0;
        // Every rank cuts the same buffer length into the same chunks, so their launches pair up.
        while at < x.len() {
            let n = chunk.min(x.len() - at);
            let mut part = x.slice_mut(at..at + n);
            let nn = n as i32;
            let mut b = gpu.stream.launch_builder(gpu.func("kdtree_group_all_reduce_f32"));
            b.arg(&mut part)
                .arg(&nn)
                .arg(&g.staging)
                .arg(&g.flags)
                .arg(&g.epochs)
                .arg(&rank)
                .arg(&world)
                .arg(&cap)
                .arg(&timeout);
            // SAFETY: `part` holds n <= GROUP_BLOCKS * GROUP_CAP floats; staging, flags and epochs are the group's
            // (sized for `world` ranks); only this rank's staging slots, flags and epochs are written by it.
            unsafe { b.launch(super::ops::launch_cfg((GROUP_BLOCKS as u32, 1, 1), 128, 0)) }.map_err(super::drv(OP))?;
            at += n;
        }
        if !capturing(gpu)? {
            g.gate.pass(self.rank)?;
        }
        Ok(())
    }
    fn gate(&self) -> Result<()> {
        self.group.gate.pass(self.rank)
    }
    fn abort(&self, why: &str) {
        self.group.gate.abort(why)
    }
}

/// The GPUs and communicators of `groups` tensor-parallel rank groups (engine/src/tp): every group on GPU `ordinal`
/// (the one-GPU communicator, [`SharedGpu`]) or group g on `gpus[g]` (NCCL, [`Nccl::group`]), each GPU opened with
/// `opts` and given its communicator. Returns the GPUs and the communicators (to wake the other groups when one
/// fails).
#[allow(clippy::type_complexity)]
pub fn open_groups(
    groups: usize,
    ordinal: usize,
    gpus: Option<&[usize]>,
    opts: GpuOptions,
) -> anyhow::Result<(Vec<Arc<Gpu>>, Vec<Arc<dyn Communicator>>)> {
    use anyhow::ensure;
    let devs: Vec<Arc<Gpu>> = match gpus {
        None => (0..groups)
            .map(|_| Gpu::new(ordinal, opts).map(Arc::new))
            .collect::<std::result::Result<_, _>>()?,
        Some(o) => {
            let mut seen = o.to_vec();
            seen.sort_unstable();
            seen.dedup();
            ensure!(
                seen.len() == o.len(),
                "GPUs {o:?} are not distinct (several groups on one GPU: the shared-GPU communicator)"
            );
            o.iter()
                .map(|&i| Gpu::new(i, opts).map(Arc::new))
                .collect::<std::result::Result<_, _>>()?
        }
    };
    // Lazy module loading (CUDA's default) loads a kernel on its first launch and synchronises the device to do
    // so: a group waiting inside a sum for another group that is loading a kernel would never finish. CUDA reads
    // `CUDA_MODULE_LOADING` when it starts, so a tool sets it before (kdtree-run does for runs of several
    // groups); the driver says what it decided.
    ensure!(
        groups == 1 || devs[0].eager_module_loading()?,
        "{groups} rank groups need CUDA_MODULE_LOADING=EAGER set before the first CUDA call (lazy loading \
         synchronises the device when a kernel first runs, which deadlocks groups that meet inside their kernels)"
    );
    let comms: Vec<Arc<dyn Communicator>> = match gpus {
        None => SharedGpu::ranks(&devs[0], groups)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect(),
        Some(_) => Nccl::group(&devs.iter().map(|g| &**g).collect::<Vec<_>>())?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect(),
    };
    for (g, c) in devs.iter().zip(comms.clone()) {
        g.set_comm(c);
        g.set_drain_copies(groups > 1);
    }
    if gpus.is_none() && groups > 1 {
        devs[0].pool_for_groups()?;
        // Up to GROUP_BLOCKS SMs per group partly held by a waiting sum: cuBLAS plans for the rest.
        for g in &devs {
            g.set_blas_sms(g.sms.saturating_sub(groups * GROUP_BLOCKS))?;
        }
    }
    Ok((devs, comms))
}

#[cfg(test)]
mod tests {
    use super::LaunchGate;
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    use std::time::Duration;

    #[test]
    fn no_rank_passes_a_gate_before_every_rank_reached_it() {
        // Each rank records how many gates every other rank had reached when it passed one: never fewer than its own.
        let world = 4;
        let gate = LaunchGate::new(world, Duration::from_secs(30));
        let reached: Vec<AtomicU64> = (0..world).map(|_| AtomicU64::new(0)).collect();
        std::thread::scope(|s| {
            for r in 0..world {
                let (gate, reached) = (&gate, &reached);
                s.spawn(move || {
                    for g in 1..=200u64 {
                        if (g as usize + r).is_multiple_of(7) {
                            std::thread::sleep(Duration::from_micros(200)); // ranks arrive out of step
                        }
                        reached[r].store(g, SeqCst);
                        gate.pass(r).unwrap();
                        for (o, x) in reached.iter().enumerate() {
                            assert!(
                                x.load(SeqCst) >= g,
                                "rank {r} passed gate {g} before rank {o} reached it"
                            );
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn a_missing_rank_is_an_error_naming_the_gates_not_a_hang() {
        let gate = LaunchGate::new(2, Duration::from_millis(50));
        let e = gate.pass(0).unwrap_err().to_string();
        assert!(e.contains("gate 1") && e.contains("[1, 0]"), "{e}");
    }

    #[test]
    fn an_abort_wakes_a_waiting_rank() {
        let gate = LaunchGate::new(2, Duration::from_secs(30));
        std::thread::scope(|s| {
            let w = s.spawn(|| gate.pass(1));
            std::thread::sleep(Duration::from_millis(20));
            gate.abort("group 0 failed: test");
            let e = w.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("group 0 failed: test"), "{e}");
        });
        assert!(gate.pass(0).is_err(), "a later arrival fails at once");
    }
}
