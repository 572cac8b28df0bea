//! CUDA backend building blocks: a [`Gpu`] context (device, one stream, the kernels' module, cuBLAS) and
//! one checked wrapper per op in [`ops`], each the twin of a CPU op (index: kernels/README.md).
//!
//! Kernels come from `kdtree_kernels::FATBIN` (compiled at build time by nvcc for sm_90a + sm_120a + PTX),
//! loaded with the driver API; libcuda and libcublas are dlopened at run time (cudarc `dynamic-loading`),
//! so a binary built here runs on a machine with only the NVIDIA driver and the CUDA 13 libraries.
//! Wrappers check every shape and length before launching (messages print both numbers) and map failures
//! to [`CudaError`] naming the op. Parity tests: engine/tests/cuda_ops.rs.

pub mod backend;
pub mod comm;
mod composite;
mod compute;
mod load;
pub mod ops;
pub mod profile;
pub mod tree;
mod tree_ops;
pub mod types;

pub use crate::options::GpuOptions;
pub use backend::CudaBackend;

use crate::backend::WeightCheck;
use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

/// Errors of the CUDA backend; every variant names the op (or step) that failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable GPU: the driver library is missing, no device exists, or the device cannot run the fatbin.
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    /// A shape, length or alignment precondition of an op failed (checked before any launch).
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("{op}: CUDA driver error: {source}")]
    Driver {
        op: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("{op}: cuBLAS error: {source}")]
    Blas {
        op: &'static str,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Shape check helper: `ensure(op, cond, || format!(..))`.
pub(crate) fn ensure(op: &'static str, cond: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(CudaError::Shape { op, msg: msg() })
    }
}

/// Maps a driver error to [`CudaError::Driver`] for `op`.
pub(crate) fn drv(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |source| CudaError::Driver { op, source }
}

/// One GPU: context, the stream every op launches on (capturable into a CUDA graph), the kernels module
/// and a cuBLAS handle bound to that stream. Not `Clone`; share it by reference (ops take `&Gpu`).
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    /// Number of streaming multiprocessors (sizes split-K grids).
    pub sms: usize,
    /// Largest dynamic shared memory a block may opt into (bytes).
    pub max_smem: usize,
    /// Shared memory of one SM (bytes), shared by the blocks resident on it.
    pub smem_per_sm: usize,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    /// cuBLAS's workspace, set once (so a captured GEMM uses the same algorithms as an eager one).
    _blas_workspace: CudaSlice<u8>,
    /// Capture DDTree rounds into CUDA graphs (`GpuOptions::graphs`; [`Gpu::set_graphs`]).
    graphs: std::sync::atomic::AtomicBool,
    /// Why the first failed capture failed.
    capture_failure: std::sync::Mutex<Option<String>>,
    /// Loading weights: pinned staging buffers and progress (see [`Gpu::begin_load`]).
    load: std::sync::Mutex<Option<load::Load>>,
    /// What this GPU was asked to do so far (kernel launches, cuBLAS calls, copies): the round tests
    /// print these per round.
    pub stats: GpuStats,
    /// Arrival counters of the W4A16 GEMMs' in-kernel split-K reduction (zero between launches: the last
    /// block of each tile resets its counter).
    pub(crate) gemm_counters: CudaSlice<u32>,
    /// The node census of the last graph captured on this GPU (see [`Gpu::last_graph`]).
    last_graph: std::sync::Mutex<Option<GraphCensus>>,
    /// Blocks per SM the W4A16 split count aims at (1..=4; `GpuOptions::w4a16_blocks_per_sm`, default 4).
    w4a16_bps: std::sync::atomic::AtomicUsize,
    /// At most this many W4A16 k-splits (`GpuOptions::w4a16_max_splits`, default 64: measured on the H200, a cap of
    /// 16 or 8 made the TP8 slices slower, 512x7168 M=1 9.3 / 11.3 us against 6.9 us).
    w4a16_max_splits: std::sync::atomic::AtomicUsize,
    /// bf16 GEMMs of up to this many rows through the small-M tensor-core GEMM instead of cuBLAS
    /// (`GpuOptions::small_gemm_rows`; 0: cuBLAS always).
    small_gemm_rows: std::sync::atomic::AtomicUsize,
    /// The small-M GEMM's split-K workspace ([`ops::gemm_bf16::SMALL_WS`] f32) and arrival counters (zero between
    /// launches: the last CTA of each tile resets its counter).
    pub(crate) small_ws: CudaSlice<f32>,
    /// CTAs per SM the small-M GEMM's k-split count aims at (`GpuOptions::small_ctas_per_sm`).
    small_ctas_per_sm: std::sync::atomic::AtomicUsize,
    pub(crate) small_counters: CudaSlice<u32>,
    /// Sums that do not depend on the row count (`GpuOptions::batch_invariant`; [`Gpu::batch_invariant`]).
    batch_invariant: std::sync::atomic::AtomicBool,
    /// Fill [`Gpu::out`] buffers with NaN bytes (`GpuOptions::poison`; test runs).
    poison: bool,
    /// The switches this GPU was opened with.
    opts: GpuOptions,
    /// Launch the W4A16 GEMMs with programmatic dependent launch (sm_90+; `GpuOptions::pdl`).
    pdl: std::sync::atomic::AtomicBool,
    /// How this GPU's rank sums meet those of the other GPUs of a run ([`comm::Communicator`]; `OneGpu` by default).
    comm: std::sync::RwLock<Arc<dyn comm::Communicator>>,
    /// Drain the stream before every pageable host copy ([`Gpu::set_drain_copies`]).
    drain_copies: std::sync::atomic::AtomicBool,
    /// The load check of weights loaded onto this GPU ([`Gpu::set_weight_check`]).
    weight_check: std::sync::Mutex<WeightCheck>,
    /// The op profile of eager work (`GpuOptions::op_profile`), printed on stderr when the GPU is dropped.
    pub profile: Option<profile::OpProfile>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.report());
        }
    }
}

/// What a captured CUDA graph holds, by node type (cuBLAS calls appear as their kernels; stream-ordered
/// allocations as alloc/free nodes, zero-filled buffers as memsets).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphCensus {
    pub kernels: usize,
    pub memsets: usize,
    pub memcpys: usize,
    pub allocs: usize,
    pub frees: usize,
    pub other: usize,
}

impl GraphCensus {
    /// All nodes.
    pub fn nodes(&self) -> usize {
        self.kernels + self.memsets + self.memcpys + self.allocs + self.frees + self.other
    }
    /// The nodes of `g`, by type.
    pub(crate) fn of(g: &cudarc::driver::CudaGraph) -> Result<GraphCensus> {
        use cudarc::driver::sys::{self, CUgraphNodeType as T};
        let mut n = 0usize;
        // SAFETY: the graph is live (owned by `g`); the first call only asks for the count, the second fills
        // a buffer of that many handles.
        unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }
            .result()
            .map_err(drv("graph nodes"))?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        unsafe { sys::cuGraphGetNodes(g.cu_graph(), nodes.as_mut_ptr(), &mut n) }
            .result()
            .map_err(drv("graph nodes"))?;
        let mut c = GraphCensus::default();
        for &node in &nodes[..n] {
            let mut t = T::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` belongs to the live graph.
            unsafe { sys::cuGraphNodeGetType(node, &mut t) }
                .result()
                .map_err(drv("graph node type"))?;
            match t {
                T::CU_GRAPH_NODE_TYPE_KERNEL => c.kernels += 1,
                T::CU_GRAPH_NODE_TYPE_MEMSET => c.memsets += 1,
                T::CU_GRAPH_NODE_TYPE_MEMCPY => c.memcpys += 1,
                T::CU_GRAPH_NODE_TYPE_MEM_ALLOC => c.allocs += 1,
                T::CU_GRAPH_NODE_TYPE_MEM_FREE => c.frees += 1,
                _ => c.other += 1,
            }
        }
        Ok(c)
    }
}

impl std::fmt::Display for GraphCensus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} nodes: {} kernels, {} memsets, {} copies, {} allocs, {} frees, {} other",
            self.nodes(),
            self.kernels,
            self.memsets,
            self.memcpys,
            self.allocs,
            self.frees,
            self.other
        )
    }
}

/// Counters of the W4A16 GEMMs' split-K reduction: one per (row block, row tile) of a launch.
pub(crate) const GEMM_COUNTERS: usize = 1 << 20;

/// Bytes of the cuBLAS workspace (the size cuBLAS recommends for Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// Counters of a [`Gpu`]'s work: kernel launches (every wrapper resolves its kernel once per launch),
/// cuBLAS calls, host-to-device copies and device-to-host reads (each read waits for the stream: a host
/// synchronisation).
#[derive(Debug, Default)]
pub struct GpuStats {
    pub launches: std::sync::atomic::AtomicU64,
    pub blas_calls: std::sync::atomic::AtomicU64,
    pub uploads: std::sync::atomic::AtomicU64,
    pub downloads: std::sync::atomic::AtomicU64,
    /// CUDA graph launches (a captured device round is one).
    pub graph_launches: std::sync::atomic::AtomicU64,
    /// Captures that failed (the round then ran eagerly); the first reason is in [`Gpu::capture_failure`].
    pub capture_failures: std::sync::atomic::AtomicU64,
    /// Graphs captured and instantiated, and the host's nanoseconds from the start of each capture to its first
    /// launch queued (recording the ops, instantiating, uploading the graph).
    pub captures: std::sync::atomic::AtomicU64,
    pub capture_ns: std::sync::atomic::AtomicU64,
}

impl GpuStats {
    /// (launches, cuBLAS calls, uploads, downloads) now.
    pub fn snapshot(&self) -> [u64; 4] {
        use std::sync::atomic::Ordering::Relaxed;
        [
            self.launches.load(Relaxed),
            self.blas_calls.load(Relaxed),
            self.uploads.load(Relaxed),
            self.downloads.load(Relaxed),
        ]
    }
    pub(crate) fn bump(c: &std::sync::atomic::AtomicU64) {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    /// The graph counters now.
    pub fn graphs(&self) -> crate::api::GraphStats {
        use std::sync::atomic::Ordering::Relaxed;
        crate::api::GraphStats {
            captures: self.captures.load(Relaxed),
            capture_s: self.capture_ns.load(Relaxed) as f64 * 1e-9,
            launches: self.graph_launches.load(Relaxed),
        }
    }
}

/// GPUs the driver can see (0 when libcuda is absent or fails to initialise).
pub fn device_count() -> usize {
    // SAFETY: only probes whether the shared library can be dlopened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

impl Gpu {
    /// Opens device `ordinal`, loads the embedded fatbin and resolves every kernel in
    /// `kdtree_kernels::KERNELS` (a missing one is an error naming it). Fails with
    /// [`CudaError::NoDevice`] (never panics) when libcuda is absent or no device exists.
    /// `opts`: the switches (graphs, poisoned outputs, PDL, the W4A16 plan, timeouts; `GpuOptions::from_env()`
    /// in the tools and tests).
    pub fn new(ordinal: usize, opts: GpuOptions) -> Result<Gpu> {
        // SAFETY: only probes whether the shared library can be dlopened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDevice(
                "libcuda (the NVIDIA driver library) was not found".into(),
            ));
        }
        let n =
            CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("cuInit/cuDeviceGetCount: {e}")))?;
        if ordinal >= n.max(0) as usize {
            return Err(CudaError::NoDevice(format!("device {ordinal} requested, {n} present")));
        }
        // SAFETY: as above, for libcublas.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoDevice(
                "libcublas (CUDA 13 libraries) was not found; add it to LD_LIBRARY_PATH".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("open device"))?;
        // SAFETY: a Gpu issues all work on its one stream, so cudarc's cross-stream event tracking (an event
        // record per buffer use, which also gets in the way of graph capture) is not needed.
        unsafe { ctx.disable_event_tracking() };
        // An own stream, not the legacy default stream: only a real stream can be captured into a graph.
        let stream = ctx.new_stream().map_err(drv("create stream"))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(kdtree_kernels::FATBIN.to_vec()))
            .map_err(|e| CudaError::NoDevice(format!("loading the kernels fatbin (sm_90a/sm_120a/compute_90): {e}")))?;
        let mut funcs = HashMap::new();
        for &(file, name) in kdtree_kernels::KERNELS {
            let f = module.load_function(name).map_err(|e| {
                CudaError::NoDevice(format!("kernel {name} (kernels/cuda/{file}) not in the fatbin: {e}"))
            })?;
            funcs.insert(name, f);
        }
        use cudarc::driver::sys::CUdevice_attribute as A;
        let sms = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("device attributes"))? as usize;
        let max_smem = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("device attributes"))? as usize;
        let smem_per_sm = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
            .map_err(drv("device attributes"))? as usize;
        let blas = CudaBlas::new(stream.clone()).map_err(|source| CudaError::Blas {
            op: "cublas init",
            source,
        })?;
        // cuBLAS documents that work captured into a graph needs a workspace the caller set (its own default
        // pool may be allocated on first use, which a capture cannot do).
        let ws = stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE)
            .map_err(drv("cublas workspace"))?;
        {
            use cudarc::driver::DevicePtr;
            let (p, _sync) = ws.device_ptr(&stream);
            // SAFETY: the handle is live and bound to `stream`; the workspace outlives it (both are fields of
            // Gpu, and `_blas_workspace` is declared after `blas`, so it is dropped after the handle).
            let st = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut std::ffi::c_void, BLAS_WORKSPACE)
            };
            if st != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(CudaError::NoDevice(format!("cublasSetWorkspace: {st:?}")));
            }
        }
        let gemm_counters = stream.alloc_zeros::<u32>(GEMM_COUNTERS).map_err(drv("gemm counters"))?;
        let small_ws = stream
            .alloc_zeros::<f32>(ops::gemm_bf16::SMALL_WS)
            .map_err(drv("small gemm workspace"))?;
        let small_counters = stream
            .alloc_zeros::<u32>(ops::gemm_bf16::SMALL_COUNTERS)
            .map_err(drv("small gemm counters"))?;
        let major = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(drv("device attributes"))?;
        let pdl = major >= 9 && opts.pdl;
        let gpu = Gpu {
            ctx,
            stream,
            blas,
            sms,
            max_smem,
            smem_per_sm,
            _module: module,
            funcs,
            _blas_workspace: ws,
            graphs: std::sync::atomic::AtomicBool::new(opts.graphs),
            capture_failure: std::sync::Mutex::new(None),
            load: std::sync::Mutex::new(None),
            stats: GpuStats::default(),
            gemm_counters,
            last_graph: std::sync::Mutex::new(None),
            w4a16_bps: std::sync::atomic::AtomicUsize::new(opts.w4a16_blocks_per_sm),
            w4a16_max_splits: std::sync::atomic::AtomicUsize::new(opts.w4a16_max_splits),
            small_gemm_rows: std::sync::atomic::AtomicUsize::new(opts.small_gemm_rows),
            small_ws,
            small_ctas_per_sm: std::sync::atomic::AtomicUsize::new(opts.small_ctas_per_sm.max(1)),
            small_counters,
            batch_invariant: std::sync::atomic::AtomicBool::new(opts.batch_invariant),
            poison: opts.poison,
            opts,
            pdl: std::sync::atomic::AtomicBool::new(pdl),
            comm: std::sync::RwLock::new(Arc::new(comm::OneGpu)),
            drain_copies: std::sync::atomic::AtomicBool::new(false),
            weight_check: std::sync::Mutex::new(WeightCheck::Off),
            profile: opts.op_profile.then(profile::OpProfile::default),
        };
        ops::w4a16_gemm::configure(&gpu)?;
        ops::gqa_attention::configure(&gpu)?;
        ops::mla_attention::configure(&gpu)?;
        ops::mla_prefill::configure(&gpu)?;
        ops::mla_decode::configure(&gpu)?;
        ops::moe_align::configure(&gpu)?;
        ops::ddtree_build::configure(&gpu)?;
        if opts.pool_keep {
            gpu.pool_keep()?;
        }
        Ok(gpu)
    }

    /// The kernel `name` (all are resolved in [`Gpu::new`]).
    pub(crate) fn func(&self, name: &'static str) -> &CudaFunction {
        GpuStats::bump(&self.stats.launches);
        &self.funcs[name]
    }

    /// The communicator the all-reduces of this GPU's forwards go through.
    pub fn comm(&self) -> Arc<dyn comm::Communicator> {
        self.comm.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    /// Use `c` from the next forward on (a captured round keeps the one it was captured with: set it before).
    pub fn set_comm(&self, c: Arc<dyn comm::Communicator>) {
        *self.comm.write().unwrap_or_else(|p| p.into_inner()) = c;
    }

    /// Wait for this GPU's stream before every copy from or to pageable host memory (on for the rank groups of a
    /// tensor-parallel run, `crate::tp`). The driver stages such copies through memory it shares among the
    /// streams of a context, and a copy may wait for its stream first: a group blocked there, its stream inside
    /// a sum that waits for another group, would keep that group's own copy (before it joins the sum) from
    /// ever running. With the stream drained first, a copy never waits for another group.
    pub fn set_drain_copies(&self, on: bool) {
        self.drain_copies.store(on, std::sync::atomic::Ordering::Relaxed);
    }
    /// Set the device's memory pool up for rank groups side by side on one GPU, which must never wait for each
    /// other outside their sums (a group waiting on a stream that sits in a sum waiting for it would hang):
    /// * no reuse that makes one stream wait for another: by default a stream-ordered allocation may take
    ///   memory another stream freed and wait for that stream to reach the free (the pool's "internal
    ///   dependencies"); memory whose free has completed is still reused;
    /// * no trimming: by default the pool gives its unused memory back at every synchronisation (a release
    ///   threshold of 0), unmapping memory while other groups' kernels run; it keeps what it holds instead.
    pub fn pool_for_groups(&self) -> Result<()> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        let mut pool = std::ptr::null_mut();
        // SAFETY: the device handle is this context's; the pool handle is written by the call.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(drv("memory pool"))?;
        let mut off: i32 = 0;
        // SAFETY: the attribute takes an int flag; `pool` is the device's default pool.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                (&mut off as *mut i32).cast(),
            )
        }
        .result()
        .map_err(drv("memory pool"))?;
        self.pool_keep()
    }
    /// The device's default memory pool keeps the memory it has reserved (a release threshold of all of it)
    /// instead of unmapping what is unused at every synchronisation (a threshold of 0, CUDA's default): a long
    /// prefill's transient buffers (hundreds of MB a layer) are then reused, not mapped again after each sync.
    /// On for rank groups ([`Gpu::pool_for_groups`]); `GpuOptions::pool_keep` (off by default: a 32K prefill of
    /// the K2.6 rank-0 slice took 6.90 s with it, 5.78 s without, run 93) for one controller.
    /// [`Gpu::mem_info`] counts what the pool keeps unused as free.
    pub fn pool_keep(&self) -> Result<()> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        let mut pool = std::ptr::null_mut();
        // SAFETY: the device handle is this context's; the pool handle is written by the call.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(drv("memory pool"))?;
        let mut keep: u64 = u64::MAX;
        // SAFETY: the release threshold is a u64 byte count.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        }
        .result()
        .map_err(drv("memory pool"))?;
        Ok(())
    }
    /// Have cuBLAS size its kernels for `sms` SMs instead of all of them (`cublasSetSmCountTarget`): rank groups
    /// side by side on one GPU keep some SMs partly taken by their sums' waiting blocks, and a GEMM whose blocks
    /// rely on all being resident at once (persistent and stream-K kernels) must not wait for those SMs.
    pub fn set_blas_sms(&self, sms: usize) -> Result<()> {
        let n = sms.clamp(1, self.sms) as i32;
        // SAFETY: the handle is this GPU's live cuBLAS handle.
        let st = unsafe { cudarc::cublas::sys::cublasSetSmCountTarget(*self.blas.handle(), n) };
        if st != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::Shape {
                op: "cublasSetSmCountTarget",
                msg: format!("{st:?}"),
            });
        }
        Ok(())
    }
    /// [`Gpu::set_drain_copies`]'s wait (nothing while the stream is capturing: no copy runs inside a capture).
    pub(crate) fn drain(&self) -> Result<()> {
        use cudarc::driver::sys::CUstreamCaptureStatus as S;
        if self.drain_copies.load(std::sync::atomic::Ordering::Relaxed)
            && self.stream.capture_status().map_err(drv("capture status"))? == S::CU_STREAM_CAPTURE_STATUS_NONE
        {
            let trace = self.opts.tp_trace;
            let who = std::thread::current().name().unwrap_or("?").to_string();
            if trace {
                eprintln!("kdtree tp: {who}: drain ...");
            }
            self.stream.synchronize().map_err(drv("synchronize"))?;
            if trace {
                eprintln!("kdtree tp: {who}: drain done");
            }
        }
        Ok(())
    }

    /// How the weights loaded onto this GPU from now on are checked ([`WeightCheck`]): `Device` hashes each
    /// upload's device bytes (XXH3-64, kernels/cuda/xxh3.cu) against the manifest's checksum (the GPU suite
    /// always), `Host` the shard bytes on the host while they upload (`kdtree-run`'s default).
    pub fn set_weight_check(&self, c: WeightCheck) {
        *self.weight_check.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }
    /// [`Gpu::set_weight_check`].
    pub fn weight_check(&self) -> WeightCheck {
        *self.weight_check.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the last CUDA graph captured on this GPU holds (a DDTree round, an AR step), by node type.
    pub fn last_graph(&self) -> Option<GraphCensus> {
        *self.last_graph.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(crate) fn set_last_graph(&self, c: GraphCensus) {
        *self.last_graph.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
    }

    /// Blocks per SM the W4A16 GEMMs' split-K plans aim at.
    pub fn w4a16_blocks_per_sm(&self) -> usize {
        self.w4a16_bps.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Sets [`Gpu::w4a16_blocks_per_sm`] (1..=4; the bench compares them).
    pub fn set_w4a16_blocks_per_sm(&self, bps: usize) {
        self.w4a16_bps
            .store(bps.clamp(1, 4), std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `f` between `cuProfilerStart` and `cuProfilerStop` (after a sync each side), so that a profiler
    /// started with profiling off (`ncu --profile-from-start off`) sees exactly `f`'s kernels.
    pub fn profiled<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        use cudarc::driver::sys;
        self.stream.synchronize().map_err(drv("profile"))?;
        // SAFETY: no arguments; the context is bound to this thread by the sync above.
        unsafe { sys::cuProfilerStart() }
            .result()
            .map_err(drv("profiler start"))?;
        let r = f();
        self.stream.synchronize().map_err(drv("profile"))?;
        unsafe { sys::cuProfilerStop() }
            .result()
            .map_err(drv("profiler stop"))?;
        Ok(r)
    }

    /// The most k-splits a W4A16 plan uses.
    pub fn w4a16_max_splits(&self) -> usize {
        self.w4a16_max_splits.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Sets [`Gpu::w4a16_max_splits`] (at least 1; the bench compares them).
    pub fn set_w4a16_max_splits(&self, s: usize) {
        self.w4a16_max_splits
            .store(s.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Rows up to which bf16 GEMMs take the small-M tensor-core GEMM (`GpuOptions::small_gemm_rows`; 0: none).
    pub fn small_gemm_rows(&self) -> usize {
        self.small_gemm_rows.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// CTAs per SM the small-M GEMM's k-split count aims at (`GpuOptions::small_ctas_per_sm`). A row's bits depend
    /// on it (through the split), so it is one setting for a whole run.
    pub fn small_ctas_per_sm(&self) -> usize {
        self.small_ctas_per_sm.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Sets [`Gpu::small_ctas_per_sm`] (at least 1; the bench compares them).
    pub fn set_small_ctas_per_sm(&self, n: usize) {
        self.small_ctas_per_sm
            .store(n.max(1), std::sync::atomic::Ordering::Relaxed);
    }
    /// Sets [`Gpu::small_gemm_rows`] (tests and the bench compare it with cuBLAS: 0).
    pub fn set_small_gemm_rows(&self, rows: usize) {
        self.small_gemm_rows.store(rows, std::sync::atomic::Ordering::Relaxed);
    }
    /// Whether a forward's sums do not depend on how many rows a call has (`GpuOptions::batch_invariant`, opt in),
    /// up to [`ops::w4a16_gemm::INVARIANT_MAX_ROWS`] tokens: the bf16 GEMMs through the small-M GEMM (its k-split is
    /// the weight's), the W4A16 GEMMs at one k-split per weight shape (one token's plan) in the small form, and
    /// MLA through `ops::mla_invariant` (each node's key list in absolute chunks). docs/design/batch-invariance.md.
    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Turns [`Gpu::batch_invariant`] on or off (tests compare both).
    pub fn set_batch_invariant(&self, on: bool) {
        self.batch_invariant.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the W4A16 GEMMs launch with programmatic dependent launch (on by default on sm_90+).
    pub fn pdl(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Turns programmatic dependent launch of the W4A16 GEMMs on or off (tests compare both).
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether device rounds are captured into CUDA graphs and replayed (on), or run eagerly.
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn graphs(&self) -> bool {
        self.graphs.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// The first failed capture's reason (None when every capture worked).
    pub fn capture_failure(&self) -> Option<String> {
        self.capture_failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    /// Keeps the first failure's reason and says it once on stderr (the round runs eagerly instead).
    pub(crate) fn note_capture_failure(&self, why: &str) {
        let mut g = self.capture_failure.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            eprintln!("kdtree: warning: capturing the DDTree round as a CUDA graph failed, running it eagerly: {why}");
            *g = Some(why.to_string());
        }
    }

    /// The switches this GPU was opened with.
    pub fn options(&self) -> &GpuOptions {
        &self.opts
    }

    /// Whether the driver loads every kernel of a module when the module loads (eager), rather than on a kernel's
    /// first launch (lazy, which synchronises the device). CUDA decides this once, when it starts, from
    /// `CUDA_MODULE_LOADING` (a tool sets it before the first CUDA call); this asks the driver what it decided.
    pub fn eager_module_loading(&self) -> Result<bool> {
        use cudarc::driver::sys::CUmoduleLoadingMode as M;
        let mut mode = M::CU_MODULE_LAZY_LOADING;
        // SAFETY: the driver is initialised (this GPU's context exists); `mode` is a valid place for the answer.
        unsafe { cudarc::driver::sys::cuModuleGetLoadingMode(&mut mode) }
            .result()
            .map_err(drv("module loading mode"))?;
        Ok(mode == M::CU_MODULE_EAGER_LOADING)
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// Device name and compute capability, e.g. "NVIDIA H200 (sm_90)".
    pub fn describe(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "?".into());
        let (ma, mi) = self.ctx.compute_capability().unwrap_or((0, 0));
        format!("{name} (sm_{ma}{mi}, {} SMs)", self.sms)
    }

    /// Host → device copy into a new buffer (allocates; not for the hot path). Between
    /// [`Gpu::begin_load`] and [`Gpu::end_load`] large copies go through pinned staging buffers and count
    /// towards the load's progress.
    pub fn upload<T: DeviceRepr + bytemuck::Pod + ValidAsZeroBits>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        GpuStats::bump(&self.stats.uploads);
        let mut g = self.load.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(l) => l.upload(self, host),
            None => {
                self.drain()?;
                self.stream.clone_htod(host).map_err(drv("upload"))
            }
        }
    }

    /// [`Gpu::upload`] and the xxh3-64 of `host`'s bytes (the host load check): within a load hashed in the
    /// staging buffers right after their copy ([`load::Load::upload_hashed`]), outside one before the copy.
    pub fn upload_hashed<T: DeviceRepr + bytemuck::Pod + ValidAsZeroBits>(
        &self,
        host: &[T],
    ) -> Result<(CudaSlice<T>, u64)> {
        let mut g = self.load.lock().unwrap_or_else(|p| p.into_inner());
        match g.as_mut() {
            Some(l) => {
                GpuStats::bump(&self.stats.uploads);
                l.upload_hashed(self, host)
            }
            None => {
                drop(g);
                let h = crate::xxh3::xxh3_64_par(bytemuck::cast_slice(host));
                Ok((self.upload(host)?, h))
            }
        }
    }

    /// Starts loading `total` bytes of weights: uploads go through two pinned staging buffers (the copy of
    /// one chunk out of the mmapped shard overlaps the DMA of the previous one) and, with `progress`, a line
    /// on stderr about once a second (GB loaded, GB/s, ETA).
    pub fn begin_load(&self, total: u64, progress: bool) -> Result<()> {
        let l = load::Load::new(self, total, progress)?;
        *self.load.lock().unwrap_or_else(|p| p.into_inner()) = Some(l);
        Ok(())
    }

    /// Ends the load (waits for the last copies, frees the staging buffers): (bytes, seconds); with
    /// progress, a last line with the rate.
    pub fn end_load(&self) -> Result<(u64, f64)> {
        let l = self.load.lock().unwrap_or_else(|p| p.into_inner()).take();
        match l {
            Some(l) => l.finish(self),
            None => Ok((0, 0.0)),
        }
    }

    /// Device → host copy (synchronises the stream; tests and final outputs only).
    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        GpuStats::bump(&self.stats.downloads);
        self.drain()?;
        self.stream.clone_dtoh(dev).map_err(drv("download"))
    }

    /// A zero-filled device buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        // Zeroed by a kernel, not a memset: in a captured round a memset node makes the graph's launch take a
        // launch-queue entry per node (a graph of kernels takes one), and the rounds ran 1.5-2.6 % faster
        // without them (bench/launch-queue.py, bench/GPU-RESULTS.md run 47).
        // SAFETY: every byte is zeroed by the kernel before anything reads it (zero bits are a valid T).
        let mut b = unsafe { self.stream.alloc::<T>(n) }.map_err(drv("alloc"))?;
        ops::fill::zero(self, &mut b)?;
        Ok(b)
    }

    /// A buffer of `n` elements that the op about to run writes in full: not zero-filled (a zero fill is one
    /// more node per buffer in a captured round). With `GpuOptions::poison` it is filled with 0xFF bytes
    /// instead (NaN as f32 and bf16), so that a test run catches an op reading what nobody wrote.
    pub fn out<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: the caller's op writes every element before anything reads it (checked by the poisoned
        // test runs); device memory holds plain bits, no drop glue.
        let mut b = unsafe { self.stream.alloc::<T>(n) }.map_err(drv("alloc"))?;
        if self.poison && n > 0 {
            use cudarc::driver::DevicePtrMut;
            let bytes = n * std::mem::size_of::<T>();
            let (p, _sync) = b.device_ptr_mut(&self.stream);
            // SAFETY: `p` addresses the `bytes` bytes of `b`, on this GPU's stream.
            unsafe { cudarc::driver::result::memset_d8_async(p, 0xFF, bytes, self.stream.cu_stream()) }
                .map_err(drv("alloc"))?;
        }
        Ok(b)
    }

    /// (free, total) device memory in bytes: `cuMemGetInfo`'s free memory plus what the device's memory pool holds
    /// reserved but unused (it kept it, [`Gpu::pool_keep`]; this process's allocations reuse it).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread().map_err(drv("mem_info"))?;
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(drv("mem_info"))?;
        Ok((free + self.pool_idle()?, total))
    }
    /// Bytes the device's default memory pool has reserved and not handed out.
    fn pool_idle(&self) -> Result<usize> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as A};
        let mut pool = std::ptr::null_mut();
        // SAFETY: the device handle is this context's; the pool handle is written by the call.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(drv("memory pool"))?;
        let get = |attr| -> Result<u64> {
            let mut v: u64 = 0;
            // SAFETY: both attributes are u64 byte counts; `pool` is the device's default pool.
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }
                .result()
                .map_err(drv("memory pool"))?;
            Ok(v)
        };
        let (reserved, used) = (
            get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        );
        Ok(reserved.saturating_sub(used) as usize)
    }

    /// Blocks until all work queued on the stream is done.
    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("synchronize"))
    }
}
