//! Opening a converted model directory: the engine's target and drafter (`kdtree_engine::open`, which
//! picks the backend), and the text side from the same directory (tiktoken.model, chat template),
//! plus the stop token ids (config `eos_token_id`, and `<|im_end|>` / `[EOS]` when the tokenizer
//! names them). Tested end to end by tests/run_cli.rs.
//!
//! Under `--verify` the CPU model is opened by `kdtree_golden::reference::open_cpu` in
//! `GOLDEN_ATTN_MODE` instead: the loader kdtree-golden records its bundles with, so the CPU re-run is
//! the recording code and compares exactly (engine::open's default absorbed MLA form agrees only to
//! ~1e-6). Backends without a measured tolerance are refused before anything loads (verify.rs).

use std::path::Path;

use anyhow::{Context, Result};
use kdtree_engine::api::{Drafter, Target};
use kdtree_text::{ChatTemplate, Tokenizer};

use crate::args::DeviceArg;

pub struct Model {
    /// Backend the engine took ("cpu", "cuda", ...).
    pub backend: String,
    pub target: Box<dyn Target>,
    pub drafter: Option<Box<dyn Drafter>>,
    pub tokenizer: Option<Tokenizer>,
    pub chat: Option<ChatTemplate>,
    pub stop_token_ids: Vec<u32>,
    /// Directory name, the default `model` of OpenAI bodies.
    pub name: String,
}

/// The engine side for `--verify`: the golden loader on the CPU; CUDA is refused while its tolerance is
/// unmeasured. `auto` in a CUDA build asks the engine which backend it would take.
fn open_for_verify(dir: &Path, device: kdtree_engine::Device) -> Result<kdtree_engine::Loaded> {
    use kdtree_engine::Device;
    let cpu = || -> Result<kdtree_engine::Loaded> {
        let m = kdtree_golden::reference::open_cpu(dir, kdtree_golden::reference::GOLDEN_ATTN_MODE)?;
        Ok(kdtree_engine::Loaded {
            backend: "cpu".into(),
            target: Box::new(m.target),
            drafter: m.drafter.map(|d| Box::new(d) as Box<dyn Drafter>),
        })
    };
    match device {
        Device::Cpu => cpu(),
        Device::Cuda => {
            crate::verify::logit_tolerance("cuda")?;
            kdtree_engine::open(dir, device)
        }
        Device::Auto if cfg!(feature = "cuda") => {
            let loaded = kdtree_engine::open(dir, device)?;
            if loaded.backend == "cpu" {
                drop(loaded);
                return cpu();
            }
            crate::verify::logit_tolerance(&loaded.backend)?;
            Ok(loaded)
        }
        Device::Auto => cpu(),
    }
}

/// Load everything `dir` holds (`verify`: the engine side the way the golden bundles were made).
pub fn load(dir: &Path, device: DeviceArg, verify: bool) -> Result<Model> {
    let device = match device {
        DeviceArg::Auto => kdtree_engine::Device::Auto,
        DeviceArg::Cuda => kdtree_engine::Device::Cuda,
        DeviceArg::Cpu => kdtree_engine::Device::Cpu,
    };
    let eos = kdtree_formats::ModelDir::open(dir)
        .with_context(|| format!("opening model {}", dir.display()))?
        .text_config()
        .eos_token_id;
    let loaded = if verify { open_for_verify(dir, device) } else { kdtree_engine::open(dir, device) }
        .with_context(|| format!("loading model {}", dir.display()))?;
    let tokenizer = if dir.join("tiktoken.model").exists() { Some(Tokenizer::from_dir(dir)?) } else { None };
    let has_template = dir.join("chat_template.jinja").exists() || {
        let cfg = dir.join("tokenizer_config.json");
        cfg.exists() && std::fs::read_to_string(&cfg).is_ok_and(|s| s.contains("\"chat_template\""))
    };
    let chat = if has_template { Some(ChatTemplate::from_dir(dir)?) } else { None };
    let mut stop_token_ids: Vec<u32> = eos.into_iter().collect();
    if let Some(tok) = &tokenizer {
        stop_token_ids.extend(["<|im_end|>", "[EOS]"].iter().filter_map(|n| tok.special_id(n)));
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let name = crate::records::model_name(dir);
    Ok(Model {
        backend: loaded.backend,
        target: loaded.target,
        drafter: loaded.drafter,
        tokenizer,
        chat,
        stop_token_ids,
        name,
    })
}
