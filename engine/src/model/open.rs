//! `engine::open(dir, Device)`: open a converted model directory (kdtree_formats::ModelDir, mmapped) and
//! build the target session and, when the directory holds a DFlash drafter, the drafter, which borrows the
//! target's embed_tokens / lm_head (vocab-parallel shards, gathered in global id order) and gets the
//! target taps it was trained on (`dflash_config.target_layer_ids`). Interface: docs/design/interfaces.md
//! "engine → tools". Test: engine/tests/target_plans.rs (`open_loads_target_and_drafter`).

use super::attention::AttnMode;
use super::source::{gather_bf16, TensorSource};
use super::target::CpuTarget;
use super::weights::Weights;
use crate::api::{Drafter, Target};
use crate::drafter::{DFlashDrafter, DrafterDims, DrafterWeights};
use anyhow::{bail, ensure, Context, Result};
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

/// Options of [`open_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// MLA form of the CPU target (both give the same logits to ~1e-6 relative).
    pub attn_mode: AttnMode,
}

/// Open `dir` on `device` with default options (CPU target uses the absorbed MLA form: it does not
/// re-expand every cached latent through kv_b at each step).
pub fn open(dir: &Path, device: Device) -> Result<Loaded> {
    open_with(dir, device, OpenOptions { attn_mode: AttnMode::Absorbed })
}

/// Open `dir` on `device`.
pub fn open_with(dir: &Path, device: Device, opts: OpenOptions) -> Result<Loaded> {
    if device == Device::Cuda {
        bail!("the CUDA backend is not available in this build (use --device cpu)");
    }
    let md = ModelDir::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let drafter_cfg = md.drafter_config().cloned();
    let src: Arc<dyn TensorSource> = Arc::new(md);
    let (target, weights) = open_cpu_target(
        src.clone(),
        drafter_cfg.as_ref().map(|c| c.dflash_config.target_layer_ids.clone()).unwrap_or_default(),
        opts.attn_mode,
    )?;
    let drafter: Option<Box<dyn Drafter>> = match &drafter_cfg {
        None => None,
        Some(cfg) => {
            let dims = DrafterDims::from_config(cfg)?;
            let dw = DrafterWeights::load_with(&dims, |name, shape| {
                let (v, s) = gather_bf16(&*src, name)?;
                ensure!(s == shape, "{name}: logical shape {s:?}, the drafter expects {shape:?}");
                Ok(v)
            })?;
            Some(Box::new(DFlashDrafter::new(cfg, dw, weights)?))
        }
    };
    Ok(Loaded { backend: "cpu".into(), target: Box::new(target), drafter })
}

/// The CPU target over any [`TensorSource`], with taps at `tap_layers`; also returns the shared weights
/// (for the drafter's tables).
pub fn open_cpu_target(src: Arc<dyn TensorSource>, tap_layers: Vec<usize>, mode: AttnMode) -> Result<(CpuTarget, Arc<Weights>)> {
    let w = Arc::new(Weights::load(src)?);
    Ok((CpuTarget::new(w.clone(), tap_layers, mode)?, w))
}
