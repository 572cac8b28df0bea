//! The one CPU model loader and the device switch in front of it.
//!
//! [`open_cpu`] opens a converted model directory (kdtree_formats::ModelDir, mmapped) and builds the CPU
//! target and, when the directory holds a DFlash drafter, the drafter; [`open_with`] / [`open`] check the
//! device and box what `open_cpu` returns, or, with the `cuda` feature, the CUDA target and drafter (both
//! on GPU 0, the drafter over the CUDA target's tables). Rank-first: every rank's target weights are views of that
//! rank's own shard files (`ModelDir::tensor(name, rank)`), never gathered; the drafter borrows the
//! target's per-rank embed_tokens / lm_head (vocab-parallel, merged in global id order) and gets the
//! target taps it was trained on (`dflash_config.target_layer_ids`). The drafter's own `drafter.*` weights
//! are gathered to logical tensors (its forward has no TP split yet). Interface:
//! docs/design/interfaces.md "engine → tools". [`open_dummy`] does the same from a [`DummySource`] (a rank
//! slice of seeded dummy weights, filled where the model runs; the CUDA path takes a slice of any rank count).
//! Tests: engine/tests/target_plans.rs (`open_loads_target_and_drafter`, `cuda_without_the_feature_is_a_typed_error`),
//! engine/tests/dummy_load.rs, cuda_target.rs (dummy on the GPU).

use super::attention::AttnMode;
use super::dummy::DummySource;
use super::seq::Model;
use super::source::TensorSource;
use super::target::CpuTarget;
use super::weights::Weights;
use crate::api::{Drafter, Target, TargetInfo};
#[cfg(not(feature = "cuda"))]
use crate::backend::BackendError;
use crate::backend::WeightCheck;
use crate::drafter::DFlashDrafter;
use crate::session::{Mode, Session};
use crate::session_batch::Batch;
use anyhow::{Context, Result};
use kdtree_formats::ModelDir;
use std::path::Path;
use std::sync::Arc;

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// CUDA when this build has a CUDA backend and a device, else the CPU reference.
    Auto,
    Cpu,
    Cuda,
}

/// A loaded model: the backend's name, the device it runs on, the target session, the drafter session (if
/// any).
pub struct Loaded {
    pub backend: String,
    /// "cpu", or the GPU's name ("NVIDIA H200"): what a measured cost (`--budget auto`) is tied to.
    pub device: String,
    pub target: Box<dyn Target>,
    pub drafter: Option<Box<dyn Drafter>>,
}

impl Loaded {
    /// `m` as a loaded model of backend `backend` on `device`: its target and drafter sessions (views of
    /// one [`Model`], so the device round and the batched steps reach both).
    pub fn of<B: crate::backend::Backend>(backend: &str, device: String, m: Model<B>) -> Loaded {
        let (target, drafter) = m.into_sessions();
        Loaded {
            backend: backend.into(),
            device,
            target,
            drafter,
        }
    }
    /// A session over this model in `mode` (borrows the model; one session at a time).
    pub fn session(&mut self, mode: Mode) -> Result<Session<'_>> {
        let d = match mode.drafts() {
            true => self
                .drafter
                .as_deref_mut()
                .map(|d| Box::new(d) as Box<dyn Drafter + '_>),
            false => None,
        };
        Session::new(Box::new(&mut *self.target), d, mode)
    }
    /// Static facts of the target.
    pub fn info(&self) -> &TargetInfo {
        self.target.info()
    }
    /// Drafter block size B (0 without a drafter).
    pub fn block_size(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.block_size())
    }
    pub fn has_drafter(&self) -> bool {
        self.drafter.is_some()
    }
    /// A batch of `slots` sequences in `mode` over this model (sessions forked from it: no weight is copied).
    /// KV memory: what the device has free now, less room for the activations of the batch's largest step
    /// ([`crate::session_batch::act_bytes`]), at most `kv_cap` bytes when given (on the host: `kv_cap`, or not
    /// limited).
    pub fn batch(&self, mode: Mode, slots: usize, kv_cap: Option<usize>) -> Result<Batch> {
        Batch::over(self, mode, slots, kv_cap)
    }
}

/// Options of [`open_with`] and [`open_cpu`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// MLA form of the CPU target (both give the same logits to ~1e-6 relative).
    pub attn_mode: AttnMode,
    /// Progress lines on stderr while the weights load onto a GPU (GB, GB/s, ETA); a library stays quiet
    /// unless asked.
    pub progress: bool,
    /// The load check ([`WeightCheck`]): every weight's shard bytes (`Host`) or its bytes where the ops read
    /// them (`Device`) against the manifest's xxh3-64; a difference fails the load naming the tensor
    /// (`kdtree-run --check-weights`).
    pub check_weights: WeightCheck,
    /// Leave the drafter out even when the directory holds one (an autoregressive run never drafts: its
    /// weights need neither the load time nor the memory).
    pub no_drafter: bool,
    /// The GPU's switches (CUDA graphs, poisoned outputs, ...) where a GPU is opened: the tools pass
    /// `GpuOptions::from_env()`; the default is a run with none of the `KDTREE_*` switches set.
    pub gpu: crate::options::GpuOptions,
}

/// A converted model on the CPU reference backend, with its concrete types (the golden tool needs
/// `CpuTarget`'s trace hook).
pub struct CpuModel {
    pub target: CpuTarget,
    pub drafter: Option<DFlashDrafter>,
}

/// Open `dir` on `device` with default options (CPU target uses the absorbed MLA form: it does not
/// re-expand every cached latent through kv_b at each step).
pub fn open(dir: &Path, device: Device) -> Result<Loaded> {
    open_with(
        dir,
        device,
        OpenOptions {
            attn_mode: AttnMode::Absorbed,
            ..OpenOptions::default()
        },
    )
}

/// Open `dir` on `device`. `Device::Cuda` in a build without the `cuda` feature is
/// [`BackendError::NoCuda`]; with it, the CUDA target and drafter (GPU 0), or the error saying why no GPU
/// is usable. `Auto` takes CUDA when this build has it and a GPU is usable, else the CPU.
pub fn open_with(dir: &Path, device: Device, opts: OpenOptions) -> Result<Loaded> {
    #[cfg(feature = "cuda")]
    match device {
        Device::Cuda => return open_cuda(dir, crate::cuda::Gpu::new(0, opts.gpu)?, opts),
        Device::Auto => {
            if let Ok(gpu) = crate::cuda::Gpu::new(0, opts.gpu) {
                return open_cuda(dir, gpu, opts);
            }
        }
        Device::Cpu => {}
    }
    #[cfg(not(feature = "cuda"))]
    if device == Device::Cuda {
        return Err(BackendError::NoCuda.into());
    }
    let m = open_cpu(dir, opts)?;
    Ok(Loaded::of("cpu", "cpu".into(), Model::new(m.target, m.drafter)))
}

/// Open `dir` on the CPU backend: the target (tapping the layers the drafter was trained on) and, when the
/// directory holds one, the DFlash drafter over the target's tables.
pub fn open_cpu(dir: &Path, opts: OpenOptions) -> Result<CpuModel> {
    let md = ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    open_cpu_source(Arc::new(md), opts)
}

/// [`open_cpu`] over any [`TensorSource`] (a `ModelDir`, or an in-memory `MemSource` in tests).
pub fn open_cpu_source(src: Arc<dyn TensorSource>, opts: OpenOptions) -> Result<CpuModel> {
    let taps = drafter_taps(&*src, opts);
    let b = crate::cpu::CpuBackend {
        check_weights: opts.check_weights,
        ..Default::default()
    };
    let w = Arc::new(Weights::load_on(b.clone(), src.clone())?);
    let target = CpuTarget::new(w.clone(), taps, opts.attn_mode)?;
    let drafter = match src.drafter_config() {
        Some(_) if !opts.no_drafter => Some(DFlashDrafter::load_on(b, &*src, w)?),
        _ => None,
    };
    Ok(CpuModel { target, drafter })
}

/// The target layers the drafter reads (none when no drafter loads).
fn drafter_taps(src: &dyn TensorSource, opts: OpenOptions) -> Vec<usize> {
    match src.drafter_config() {
        Some(c) if !opts.no_drafter => c.dflash_config.target_layer_ids.clone(),
        _ => Vec::new(),
    }
}

/// The CUDA target on `gpu` (weights uploaded through the CUDA backend, absorbed MLA) and, when the
/// directory holds one, the DFlash drafter on the same GPU, borrowing the CUDA target's embed_tokens /
/// lm_head (one copy of each on the device). DDTree rounds then run on the device (`Target::device_round`:
/// draft, top-K, tree, mask, verify, walk and commit on the GPU, one read back per round).
#[cfg(feature = "cuda")]
fn open_cuda(dir: &Path, gpu: crate::cuda::Gpu, opts: OpenOptions) -> Result<Loaded> {
    gpu.set_weight_check(opts.check_weights);
    open_cuda_opts(dir, Arc::new(gpu), opts)
}

/// [`open_with`] on the CUDA device `gpu` the caller keeps (tests read its [`crate::cuda::GpuStats`]).
#[cfg(feature = "cuda")]
pub fn open_cuda_on(dir: &Path, gpu: Arc<crate::cuda::Gpu>) -> Result<Loaded> {
    open_cuda_with(dir, gpu, false)
}

/// [`open_cuda_on`], with progress lines while the weights load when `progress`.
#[cfg(feature = "cuda")]
pub fn open_cuda_with(dir: &Path, gpu: Arc<crate::cuda::Gpu>, progress: bool) -> Result<Loaded> {
    open_cuda_opts(
        dir,
        gpu,
        OpenOptions {
            progress,
            ..OpenOptions::default()
        },
    )
}

#[cfg(feature = "cuda")]
fn open_cuda_opts(dir: &Path, gpu: Arc<crate::cuda::Gpu>, opts: OpenOptions) -> Result<Loaded> {
    let md = ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    // Every rank's shards: a model converted for R ranks runs as R ranks side by side on this one GPU (their
    // partial sums reduced on the device in rank order, as the CPU reference does).
    let needed: u64 = md
        .manifest()
        .tensors
        .iter()
        .filter(|t| !(opts.no_drafter && t.name.starts_with("drafter.")))
        .map(|t| t.nbytes)
        .sum();
    open_cuda_source(Arc::new(md), needed, gpu, opts, true).with_context(|| format!("uploading {}", dir.display()))
}

/// `src` (target and drafter, `needed` bytes) onto `gpu` after checking the bytes fit; `staged`: through
/// the pinned staging buffers of [`crate::cuda::Gpu::begin_load`] (host bytes), else filled in place
/// (dummy weights). Every rank of the source loads (R ranks on one GPU), or one rank slice (`slice_rank`).
#[cfg(feature = "cuda")]
fn open_cuda_source(
    src: Arc<dyn TensorSource>,
    needed: u64,
    gpu: Arc<crate::cuda::Gpu>,
    opts: OpenOptions,
    staged: bool,
) -> Result<Loaded> {
    use crate::cuda::CudaBackend;
    use crate::model::target::TargetModel;
    // The target's and the drafter's weights must fit the GPU, with room left for the caches and activations.
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let (free, total) = gpu.mem_info()?;
    anyhow::ensure!(
        needed + (1u64 << 30) <= free as u64,
        "the weights (target and drafter) need {:.2} GiB on {} (+1 GiB for the caches and activations), but only \
         {:.2} GiB of {:.2} GiB are free",
        gib(needed),
        gpu.describe(),
        gib(free as u64),
        gib(total as u64)
    );
    let taps = drafter_taps(&*src, opts);
    let name = gpu.describe();
    let device = gpu.name();
    let backend = CudaBackend::new(gpu.clone());
    // Host bytes go through pinned staging buffers, with progress when asked (the staging ends even on an error).
    if staged {
        gpu.begin_load(needed, opts.progress)?;
    }
    let loaded = (|| -> Result<Loaded> {
        let w = Arc::new(
            Weights::load_on(backend.clone(), src.clone())
                .with_context(|| format!("loading the target onto {name}"))?,
        );
        let target = TargetModel::new(w.clone(), taps, AttnMode::Absorbed)?;
        let drafter = match src.drafter_config() {
            Some(_) if !opts.no_drafter => Some(
                DFlashDrafter::load_on(backend, &*src, w)
                    .with_context(|| format!("loading the drafter onto {name}"))?,
            ),
            _ => None,
        };
        Ok(Loaded::of("cuda", device, Model::new(target, drafter)))
    })();
    let ended = if staged { gpu.end_load().map(|_| ()) } else { gpu.sync() };
    let loaded = loaded?;
    ended?;
    Ok(loaded)
}

/// Open dummy weights (`--load-format dummy`): `src`'s rank slice, every tensor filled from its seed on
/// `device` (on a GPU in place: no weight byte on the host). With `opts.progress`, one line on stderr with
/// the bytes filled and the time.
pub fn open_dummy(src: DummySource, device: Device, opts: OpenOptions) -> Result<Loaded> {
    let (bytes, (rank, ranks), seed) = (src.bytes(), src.rank(), src.seed());
    let t0 = std::time::Instant::now();
    let loaded = open_dummy_inner(src, device, opts)?;
    if opts.progress {
        eprintln!(
            "kdtree: filled {:.2} GB of dummy weights (rank {rank} of {ranks}, seed {seed}) on {} in {:.1} s",
            bytes as f64 / 1e9,
            loaded.backend,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(loaded)
}

fn open_dummy_inner(src: DummySource, device: Device, opts: OpenOptions) -> Result<Loaded> {
    #[cfg(feature = "cuda")]
    match device {
        Device::Cuda => return open_dummy_cuda_on(src, Arc::new(crate::cuda::Gpu::new(0, opts.gpu)?)),
        Device::Auto => {
            if let Ok(gpu) = crate::cuda::Gpu::new(0, opts.gpu) {
                return open_dummy_cuda_on(src, Arc::new(gpu));
            }
        }
        Device::Cpu => {}
    }
    #[cfg(not(feature = "cuda"))]
    if device == Device::Cuda {
        return Err(BackendError::NoCuda.into());
    }
    // The CPU fills every tensor in host memory: refuse what cannot fit rather than being killed mid-fill.
    let needed = src.bytes();
    if let Some(avail) = mem_available() {
        anyhow::ensure!(
            needed + (1u64 << 30) <= avail,
            "dummy weights of {:.2} GiB (rank {} of {}) do not fit the {:.2} GiB of host memory available (+1 GiB \
             kept); use --device cuda or a smaller preset",
            needed as f64 / (1u64 << 30) as f64,
            src.rank().0,
            src.rank().1,
            avail as f64 / (1u64 << 30) as f64
        );
    }
    let m = open_cpu_source(Arc::new(src), opts)?;
    Ok(Loaded::of("cpu", "cpu".into(), Model::new(m.target, m.drafter)))
}

/// Host memory available for new allocations (Linux `MemAvailable`), None where it cannot be read.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// [`open_dummy`] on the CUDA device `gpu` the caller keeps (the GPU tests and the k26 slice timing).
#[cfg(feature = "cuda")]
pub fn open_dummy_cuda_on(src: DummySource, gpu: Arc<crate::cuda::Gpu>) -> Result<Loaded> {
    let needed = src.bytes();
    open_cuda_source(Arc::new(src), needed, gpu, OpenOptions::default(), false).context("filling dummy weights")
}
