//! The one CPU model loader and the device switch in front of it.
//!
//! [`open_cpu`] opens a converted model directory (kdtree_formats::ModelDir, mmapped) and builds the CPU
//! target and, when the directory holds a DFlash drafter, the drafter; [`open_with`] / [`open`] check the
//! device and box what `open_cpu` returns. Rank-first: every rank's target weights are views of that
//! rank's own shard files (`ModelDir::tensor(name, rank)`), never gathered; the drafter borrows the
//! target's per-rank embed_tokens / lm_head (vocab-parallel, merged in global id order) and gets the
//! target taps it was trained on (`dflash_config.target_layer_ids`). The drafter's own `drafter.*` weights
//! are gathered to logical tensors (its forward has no TP split yet). Interface:
//! docs/design/interfaces.md "engine → tools". Tests: engine/tests/target_plans.rs
//! (`open_loads_target_and_drafter`, `cuda_without_the_feature_is_a_typed_error`).

use super::attention::AttnMode;
use super::source::TensorSource;
use super::target::CpuTarget;
use super::weights::Weights;
use crate::api::{Drafter, Target};
use crate::backend::BackendError;
use crate::drafter::DFlashDrafter;
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

/// A loaded model: the backend's name, the target session, the drafter session (if any).
pub struct Loaded {
    pub backend: String,
    pub target: Box<dyn Target>,
    pub drafter: Option<Box<dyn Drafter>>,
}

/// Options of [`open_with`] and [`open_cpu`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// MLA form of the CPU target (both give the same logits to ~1e-6 relative).
    pub attn_mode: AttnMode,
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
    open_with(dir, device, OpenOptions { attn_mode: AttnMode::Absorbed })
}

/// Open `dir` on `device`. `Device::Cuda` is a [`BackendError`]: `NoCuda` in a build without the `cuda`
/// feature, `CudaNotWired` in one with it (until the CUDA backend lands); `Auto` takes the CPU.
pub fn open_with(dir: &Path, device: Device, opts: OpenOptions) -> Result<Loaded> {
    if device == Device::Cuda {
        return Err(BackendError::cuda_unavailable().into());
    }
    let m = open_cpu(dir, opts)?;
    Ok(Loaded {
        backend: "cpu".into(),
        target: Box::new(m.target),
        drafter: m.drafter.map(|d| Box::new(d) as Box<dyn Drafter>),
    })
}

/// Open `dir` on the CPU backend: the target (tapping the layers the drafter was trained on) and, when the
/// directory holds one, the DFlash drafter over the target's tables.
pub fn open_cpu(dir: &Path, opts: OpenOptions) -> Result<CpuModel> {
    let md = ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    open_cpu_source(Arc::new(md), opts)
}

/// [`open_cpu`] over any [`TensorSource`] (a `ModelDir`, or an in-memory `MemSource` in tests).
pub fn open_cpu_source(src: Arc<dyn TensorSource>, opts: OpenOptions) -> Result<CpuModel> {
    let taps = src.drafter_config().map(|c| c.dflash_config.target_layer_ids.clone()).unwrap_or_default();
    let w = Arc::new(Weights::load(src.clone())?);
    let target = CpuTarget::new(w.clone(), taps, opts.attn_mode)?;
    let drafter = match src.drafter_config() {
        Some(_) => Some(DFlashDrafter::load(&*src, w)?),
        None => None,
    };
    Ok(CpuModel { target, drafter })
}
