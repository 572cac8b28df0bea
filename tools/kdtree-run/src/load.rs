//! Opening a converted model directory: the engine's target and drafter (`kdtree_engine::open`, which
//! picks the backend), and the text side from the same directory (tiktoken.model, chat template),
//! plus the stop token ids (config `eos_token_id`, and `<|im_end|>` / `[EOS]` when the tokenizer
//! names them); or, with `--load-format dummy`, seeded dummy weights from the config alone ([`load_dummy`]).
//! Tested end to end by tests/run_cli.rs and tests/dummy_cli.rs.
//!
//! `--verify` uses the very same loader and configuration (kdtree-golden records its bundles through
//! `engine::open` too), so what is verified is what runs.

use std::path::Path;

use anyhow::{Context, Result};
use kdtree_engine::Loaded;
use kdtree_text::{ChatTemplate, Tokenizer};

use crate::args::DeviceArg;

pub struct Model {
    /// Backend the engine took ("cpu", "cuda", ...) and the model on it.
    pub loaded: Loaded,
    pub tokenizer: Option<Tokenizer>,
    pub chat: Option<ChatTemplate>,
    pub stop_token_ids: Vec<u32>,
    /// Directory name, the default `model` of OpenAI bodies.
    pub name: String,
}

/// `--load-format dummy`: the plan of `dir`'s config.json (+ drafter/config.json when present) for
/// `ranks` ranks, rank `rank` alone, every tensor filled from `seed` on the device (engine
/// `open_dummy`). No tokenizer (the tokens are noise: prompt_token_ids lines only, `text` null) and no
/// stop tokens (every line decodes max_tokens: a timing run).
pub fn load_dummy(
    dir: &Path,
    device: DeviceArg,
    progress: bool,
    (ranks, rank, seed): (usize, usize, u64),
) -> Result<Model> {
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    let config = read("config.json")?;
    let drafter = if dir.join("drafter/config.json").exists() {
        Some(read("drafter/config.json")?)
    } else {
        None
    };
    let (cpath, dpath) = (
        dir.join("config.json").display().to_string(),
        dir.join("drafter/config.json").display().to_string(),
    );
    let src = kdtree_engine::model::DummySource::from_json(
        &cpath,
        &config,
        drafter.as_deref().map(|d| (dpath.as_str(), d)),
        ranks,
        rank,
        seed,
    )?;
    let opts = kdtree_engine::OpenOptions {
        attn_mode: kdtree_engine::model::AttnMode::Absorbed,
        progress,
        gpu: kdtree_engine::GpuOptions::from_env(),
        ..Default::default()
    };
    let loaded = kdtree_engine::model::open::open_dummy(src, engine_device(device), opts)
        .with_context(|| format!("loading dummy weights for {}", dir.display()))?;
    Ok(Model {
        loaded,
        tokenizer: None,
        chat: None,
        stop_token_ids: Vec::new(),
        name: crate::records::model_name(dir),
    })
}

fn engine_device(device: DeviceArg) -> kdtree_engine::Device {
    match device {
        DeviceArg::Auto => kdtree_engine::Device::Auto,
        DeviceArg::Cuda => kdtree_engine::Device::Cuda,
        DeviceArg::Cpu => kdtree_engine::Device::Cpu,
    }
}

/// How the model's ranks are spread (`--gpus`, `--share-gpu`): None = every rank on one device (one
/// controller), Some((groups, placement)) = rank groups on threads of their own (`kdtree_engine::tp`).
pub fn placement(
    dir: &Path,
    device: DeviceArg,
    gpus: Option<u64>,
    share: bool,
) -> Result<Option<(usize, kdtree_engine::tp::Placement)>> {
    use kdtree_engine::tp::Placement;
    let ranks = kdtree_formats::ModelDir::open(dir)
        .with_context(|| format!("opening model {}", dir.display()))?
        .manifest()
        .plan
        .ranks;
    let visible = gpu_count(device);
    let n = match gpus {
        Some(n) => n as usize,
        // The largest divisor of the ranks the visible GPUs hold.
        None => (1..=ranks.min(visible.max(1)))
            .rev()
            .find(|n| ranks.is_multiple_of(*n))
            .unwrap_or(1),
    };
    kdtree_engine::tp::group_ranks(ranks, n)?;
    if n == 1 && !share {
        return Ok(None);
    }
    if visible == 0 {
        anyhow::ensure!(device != DeviceArg::Cuda, "--device cuda: no GPU is visible");
        return Ok(Some((n, Placement::Cpu)));
    }
    if share {
        return Ok(Some((n, Placement::SharedGpu(0))));
    }
    anyhow::ensure!(
        n <= visible,
        "--gpus {n}: only {visible} GPU{} visible (add --share-gpu to run the {n} groups side by side on GPU 0)",
        if visible == 1 { " is" } else { "s are" }
    );
    Ok(Some((n, Placement::Gpus((0..n).collect()))))
}

/// A [`placement`] for people: "CPU threads", "side by side on GPU 0", "on GPUs 0, 1".
pub fn describe_placement(p: &kdtree_engine::tp::Placement) -> String {
    use kdtree_engine::tp::Placement;
    match p {
        Placement::Cpu => "one CPU thread each".into(),
        Placement::SharedGpu(g) => format!("side by side on GPU {g}"),
        Placement::Gpus(g) => format!(
            "on GPUs {}",
            g.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// Whether this run may spread its ranks over several groups on GPUs ([`placement`] > 1 group), decided before
/// CUDA starts: the GPUs counted from CUDA_VISIBLE_DEVICES or the driver's /proc entries.
pub fn may_run_groups(dir: &Path, device: DeviceArg, gpus: Option<u64>, share: bool) -> bool {
    if device == DeviceArg::Cpu || !cfg!(feature = "cuda") {
        return false;
    }
    match gpus {
        Some(n) => n > 1 || share,
        None => {
            let visible = match std::env::var("CUDA_VISIBLE_DEVICES") {
                Ok(v) => v.split(',').filter(|s| !s.trim().is_empty()).count(),
                Err(_) => std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count()),
            };
            let ranks = kdtree_formats::ModelDir::open(dir).map_or(1, |m| m.manifest().plan.ranks);
            visible > 1 && ranks > 1
        }
    }
}

/// GPUs this run may use: none on the CPU backend or in a build without CUDA.
fn gpu_count(device: DeviceArg) -> usize {
    if device == DeviceArg::Cpu {
        return 0;
    }
    #[cfg(feature = "cuda")]
    return kdtree_engine::cuda::device_count();
    #[cfg(not(feature = "cuda"))]
    0
}

/// Load everything `dir` holds.
/// `(progress, check_weights, drafter)`: load progress on stderr, the load check, and whether the drafter
/// loads (a run that never drafts leaves it out).
pub fn load(
    dir: &Path,
    device: DeviceArg,
    (progress, check_weights, drafter): (bool, kdtree_engine::WeightCheck, bool),
    place: Option<(usize, kdtree_engine::tp::Placement)>,
) -> Result<Model> {
    let device = engine_device(device);
    let eos = kdtree_formats::ModelDir::open(dir)
        .with_context(|| format!("opening model {}", dir.display()))?
        .text_config()
        .eos_token_id;
    let opts = kdtree_engine::OpenOptions {
        attn_mode: kdtree_engine::model::AttnMode::Absorbed,
        progress,
        check_weights,
        no_drafter: !drafter,
        gpu: kdtree_engine::GpuOptions::from_env(),
    };
    let loaded = match place {
        None => kdtree_engine::open_with(dir, device, opts),
        Some((groups, place)) => kdtree_engine::tp::open_tp(dir, groups, place, opts),
    }
    .with_context(|| format!("loading model {}", dir.display()))?;
    let tokenizer = if dir.join("tiktoken.model").exists() {
        Some(Tokenizer::from_dir(dir)?)
    } else {
        None
    };
    let has_template = dir.join("chat_template.jinja").exists() || {
        let cfg = dir.join("tokenizer_config.json");
        cfg.exists() && std::fs::read_to_string(&cfg).is_ok_and(|s| s.contains("\"chat_template\""))
    };
    let chat = if has_template {
        Some(ChatTemplate::from_dir(dir)?)
    } else {
        None
    };
    let mut stop_token_ids: Vec<u32> = eos.into_iter().collect();
    if let Some(tok) = &tokenizer {
        stop_token_ids.extend(["<|im_end|>", "[EOS]"].iter().filter_map(|n| tok.special_id(n)));
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let name = crate::records::model_name(dir);
    Ok(Model {
        loaded,
        tokenizer,
        chat,
        stop_token_ids,
        name,
    })
}
