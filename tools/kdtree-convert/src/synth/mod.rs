//! `kdtree-convert synth <PRESET> <OUT> [--seed N] [--drafter] [--layers N] [--config-only]`: write a synthetic
//! checkpoint in exactly the Kimi K2.6 Hugging Face layout (shared k26-format.md §1-§2, §6; drafter per §7 /
//! ddtree.md §1.1): config.json (+ generation_config.json), model.safetensors.index.json,
//! `model-000NN-of-0000MM.safetensors` shards (one decoder layer each, then embed/lm_head/norm, mm_projector,
//! vision_tower), tiktoken.model, tokenizer_config.json, chat_template.jinja; with --drafter also
//! OUT/drafter/{config.json, model.safetensors}.
//!
//! Deterministic for a seed (byte-identical across runs and thread counts). Streams: tensors are generated in
//! 4 MiB chunks in parallel (rayon) and written in order through formats' ShardWriter, two windows of
//! [`WINDOW_BYTES`] in flight (one being written while the next is generated), so memory stays bounded whatever the
//! preset. Tests: bottom of this file (plan/config round trips, determinism) and tools/kdtree-convert/tests/synth.rs.

pub mod configs;
pub mod preset;
pub mod tensors;
pub mod vocab;

use crate::progress::Progress;
use anyhow::{Context, Result};
use kdtree_formats::writer::{ShardWriter, TensorSpec};
use preset::Preset;
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::path::Path;
use tensors::Spec;

/// Bytes generated ahead of the writer at most.
pub const WINDOW_BYTES: usize = 64 << 20;

/// Arguments of `kdtree-convert synth`.
#[derive(Debug, Clone, clap::Args)]
pub struct SynthArgs {
    /// Preset name (tiny, small, k26-slice, k26) or path to a preset TOML file.
    pub preset: String,
    /// Output directory (created; existing files of the same names are overwritten).
    pub out: std::path::PathBuf,
    /// RNG seed for the weights (the tokenizer does not depend on it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write a DFlash drafter into OUT/drafter.
    #[arg(long)]
    pub drafter: bool,
    /// Override the number of target layers (first_k_dense_replace dense layers, the rest MoE).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Write only config.json and generation_config.json (and drafter/config.json with --drafter): no
    /// weights, no tokenizer. What `kdtree-run --load-format dummy` reads (any preset, k26 included).
    #[arg(long)]
    pub config_only: bool,
}

/// What a synth run wrote.
#[derive(Debug, Clone)]
pub struct Written {
    pub preset: Preset,
    pub shards: usize,
    /// Tensor bytes of the target checkpoint (= metadata.total_size).
    pub total_size: u64,
    pub drafter_bytes: u64,
}

/// CLI entry point.
pub fn run_synth(args: &SynthArgs, quiet: bool) -> Result<()> {
    if args.config_only {
        let p = write_configs(&args.preset, &args.out, args.drafter, args.layers)?;
        if !quiet {
            crate::elog!(
                "synth {}: configs only ({} layers{}) -> {}",
                p.name,
                p.text.num_hidden_layers,
                if args.drafter { ", drafter" } else { "" },
                args.out.display()
            );
        }
        return Ok(());
    }
    let w = write_opts(&args.preset, &args.out, args.seed, args.drafter, args.layers, quiet)?;
    if !quiet {
        crate::elog!(
            "synth {}: {} layers, {} shards, {:.2} GiB{} -> {}",
            w.preset.name,
            w.preset.text.num_hidden_layers,
            w.shards,
            w.total_size as f64 / (1u64 << 30) as f64,
            if args.drafter {
                format!(" + drafter {:.2} GiB", w.drafter_bytes as f64 / (1u64 << 30) as f64)
            } else {
                String::new()
            },
            args.out.display()
        );
    }
    Ok(())
}

/// Library entry point for tests of other crates: synth `preset` (name or TOML path) into `out`, quietly.
pub fn write(preset: &str, out: &Path, seed: u64, drafter: bool, layers: Option<usize>) -> Result<Written> {
    write_opts(preset, out, seed, drafter, layers, true)
}

/// The preset as synth would use it (after a `--layers` override).
pub fn resolve(preset: &str, layers: Option<usize>) -> Result<Preset> {
    let p = Preset::load(preset)?;
    match layers {
        Some(n) => p.with_layers(n),
        None => Ok(p),
    }
}

/// `--config-only`: config.json, generation_config.json and, with `drafter`, drafter/config.json.
pub fn write_configs(preset: &str, out: &Path, drafter: bool, layers: Option<usize>) -> Result<Preset> {
    let p = resolve(preset, layers)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_json(&out.join("config.json"), &configs::model_config(&p))?;
    write_json(&out.join("generation_config.json"), &configs::generation_config(&p))?;
    if drafter {
        let d = out.join("drafter");
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        write_json(&d.join("config.json"), &configs::drafter_config(&p))?;
    }
    Ok(p)
}

fn write_opts(
    preset: &str,
    out: &Path,
    seed: u64,
    drafter: bool,
    layers: Option<usize>,
    quiet: bool,
) -> Result<Written> {
    let p = resolve(preset, layers)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let shards = tensors::target_shards(&p);
    let drafter_specs = if drafter { tensors::drafter(&p) } else { Vec::new() };
    let sum = |v: &[Spec]| v.iter().map(|s| s.nbytes() as u64).sum::<u64>();
    let total_size: u64 = shards.iter().map(|s| sum(s)).sum();
    let drafter_bytes = sum(&drafter_specs);
    let progress = Progress::new("synth", total_size + drafter_bytes, quiet);

    write_json(&out.join("config.json"), &configs::model_config(&p))?;
    write_json(&out.join("generation_config.json"), &configs::generation_config(&p))?;
    write_bytes(
        &out.join("tiktoken.model"),
        vocab::tiktoken_model(p.tokenizer.mergeable).as_bytes(),
    )?;
    write_json(
        &out.join("tokenizer_config.json"),
        &vocab::tokenizer_config(p.tokenizer.mergeable, p.text.max_position_embeddings),
    )?;
    write_bytes(&out.join("chat_template.jinja"), vocab::CHAT_TEMPLATE.as_bytes())?;

    let n = shards.len();
    let mut names = std::collections::BTreeMap::new();
    for (i, specs) in shards.iter().enumerate() {
        let file = tensors::shard_name(i, n);
        write_shard(&out.join(&file), specs, seed, &progress)?;
        for s in specs {
            names.insert(s.name.clone(), file.clone());
        }
    }
    // weight_map sorted by tensor name, as HF writes it.
    let weight_map: Map<String, Value> = names.into_iter().map(|(k, f)| (k, Value::String(f))).collect();
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    write_json(&out.join("model.safetensors.index.json"), &index)?;

    if drafter {
        let d = out.join("drafter");
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        write_json(&d.join("config.json"), &configs::drafter_config(&p))?;
        write_shard(
            &d.join("model.safetensors"),
            &drafter_specs,
            seed ^ 0xD4AF_7E42,
            &progress,
        )?;
    }
    progress.finish();
    Ok(Written {
        preset: p,
        shards: n,
        total_size,
        drafter_bytes,
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    write_bytes(path, s.as_bytes())
}

/// Every write names its file (a full disk says which one).
fn write_bytes(path: &Path, b: &[u8]) -> Result<()> {
    std::fs::write(path, b).with_context(|| format!("writing {}", path.display()))
}

/// Write one safetensors file: chunks generated in parallel windows, written in the writer's (name) order.
fn write_shard(path: &Path, specs: &[Spec], seed: u64, progress: &Progress) -> Result<()> {
    let ts: Vec<TensorSpec> = specs
        .iter()
        .map(|s| TensorSpec {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
        })
        .collect();
    let mut w = ShardWriter::create(path, ts).with_context(|| format!("creating {}", path.display()))?;
    let by_name: std::collections::HashMap<&str, &Spec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    // Jobs (tensor, chunk) in the order the writer expects the bytes.
    let jobs: Vec<(&Spec, usize)> = w
        .layout()
        .iter()
        .flat_map(|t| {
            let s = by_name[t.name.as_str()];
            (0..s.chunks()).map(move |c| (s, c))
        })
        .collect();
    // Windows of consecutive jobs of at most WINDOW_BYTES; window k+1 is generated while window k is written.
    let mut windows = Vec::new();
    let mut i = 0;
    while i < jobs.len() {
        let (mut j, mut bytes) = (i, 0usize);
        while j < jobs.len() && (j == i || bytes + tensors::CHUNK_BYTES <= WINDOW_BYTES) {
            bytes += tensors::CHUNK_BYTES.min(jobs[j].0.nbytes() - jobs[j].1 * tensors::CHUNK_BYTES);
            j += 1;
        }
        windows.push(i..j);
        i = j;
    }
    let generate = |r: std::ops::Range<usize>| -> Vec<Vec<u8>> {
        jobs[r]
            .par_iter()
            .map(|(s, c)| {
                let mut b = Vec::new();
                tensors::gen_chunk(s, seed, *c, &mut b);
                b
            })
            .collect()
    };
    let mut ready = windows.first().map(|r| generate(r.clone())).unwrap_or_default();
    for k in 0..windows.len() {
        let next = windows.get(k + 1).cloned();
        let (written, upcoming) = rayon::join(
            || -> Result<()> {
                for b in &ready {
                    w.write(b)?;
                    progress.inc(b.len() as u64);
                }
                Ok(())
            },
            || next.map(&generate),
        );
        written?;
        ready = upcoming.unwrap_or_default();
    }
    w.finish().with_context(|| format!("finishing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kdtree_formats::config::{parse_drafter_config, parse_text_config};
    use kdtree_formats::plan::{plan_model, ExpertsMode, SourceQuant};

    #[test]
    fn every_preset_passes_the_8_rank_plan_in_tp_and_ep() {
        for (name, _) in preset::BUILTIN {
            let p = Preset::load(name).unwrap();
            let text = parse_text_config("config.json", &configs::model_config(&p).to_string()).unwrap();
            let dr = parse_drafter_config("drafter/config.json", &configs::drafter_config(&p).to_string()).unwrap();
            assert_eq!(text.vocab_size, p.vocab_size());
            assert_eq!(
                dr.dflash_config.mask_token_id as usize,
                p.tokenizer.mergeable + vocab::UNK
            );
            assert_eq!(dr.block_size(), Some(8));
            for mode in [ExpertsMode::Tp, ExpertsMode::Ep] {
                plan_model(&text, Some(&dr), "language_model.", SourceQuant::Int4, 8, mode)
                    .unwrap_or_else(|e| panic!("{name} {mode:?}: {e}"));
            }
        }
    }

    #[test]
    fn k26_preset_matches_the_real_checkpoint_layout() {
        let p = Preset::load("k26").unwrap();
        let shards = tensors::target_shards(&p);
        assert_eq!(shards.len(), 64);
        assert_eq!(tensors::shard_name(0, 64), "model-00001-of-000064.safetensors");
        assert_eq!(tensors::shard_name(63, 64), "model-00064-of-000064.safetensors");
        let bytes = |v: &[Spec]| v.iter().map(|s| s.nbytes() as u64).sum::<u64>();
        // Tensor bytes per shard from k26-format §2.1 (shard size minus header).
        assert_eq!(bytes(&shards[0]), 995_000_320);
        assert_eq!(bytes(&shards[1]), 9_808_554_496);
        assert_eq!(shards[1].len(), 3470);
        assert_eq!(bytes(&shards[61]), 4_697_634_816);
        assert_eq!(bytes(&shards[62]), 108_555_776);
        let total: u64 = shards.iter().map(|s| bytes(s)).sum();
        assert_eq!(total, 595_148_192_736);
        assert_eq!(shards.iter().map(Vec::len).sum::<usize>(), 208_550);
        let d = tensors::drafter(&p);
        assert_eq!(d.len(), 69);
        assert_eq!(d[0].shape, vec![7168, 43008]);
    }

    #[test]
    fn chunks_are_deterministic_and_seed_dependent() {
        let p = Preset::load("tiny").unwrap();
        let specs = tensors::layer(&p, 1);
        for s in specs.iter().take(12) {
            let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
            tensors::gen_chunk(s, 7, 0, &mut a);
            tensors::gen_chunk(s, 7, 0, &mut b);
            tensors::gen_chunk(s, 8, 0, &mut c);
            assert_eq!(a.len(), s.nbytes());
            assert_eq!(a, b);
            if !matches!(s.init, tensors::Init::Shape { .. }) {
                assert_ne!(a, c, "{}", s.name);
            }
        }
    }
}
