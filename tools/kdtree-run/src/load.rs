//! Opening a converted model directory: the engine's target and drafter (`kdtree_engine::open`, which
//! picks the backend), and the text side from the same directory (tiktoken.model, chat template),
//! plus the stop token ids (config `eos_token_id`, and `<|im_end|>` / `[EOS]` when the tokenizer
//! names them). Tested end to end by tests/run_cli.rs.
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

/// Load everything `dir` holds.
pub fn load(dir: &Path, device: DeviceArg, progress: bool) -> Result<Model> {
    let device = match device {
        DeviceArg::Auto => kdtree_engine::Device::Auto,
        DeviceArg::Cuda => kdtree_engine::Device::Cuda,
        DeviceArg::Cpu => kdtree_engine::Device::Cpu,
    };
    let eos = kdtree_formats::ModelDir::open(dir)
        .with_context(|| format!("opening model {}", dir.display()))?
        .text_config()
        .eos_token_id;
    let opts = kdtree_engine::OpenOptions { attn_mode: kdtree_engine::model::AttnMode::Absorbed, progress };
    let loaded = kdtree_engine::open_with(dir, device, opts).with_context(|| format!("loading model {}", dir.display()))?;
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
        loaded,
        tokenizer,
        chat,
        stop_token_ids,
        name,
    })
}
