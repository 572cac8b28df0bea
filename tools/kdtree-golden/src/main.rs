//! kdtree-golden: write CPU reference bundles for a converted model (+ drafter).
//!
//! For each prompt: the greedy AR continuation with top-k logits of every step and full logits of the
//! first steps; the per-layer tensors of one single-token decode forward (CpuTarget's trace hook); and
//! one DDTree round right after the prompt (draft logits, tree, visibility, verify logits, accepted path,
//! bonus). Output: one safetensors file per prompt + index.json (see src/bundle.rs for the layout).
//! Output bytes depend only on the model and the options, not on paths or thread counts
//! (tests/determinism.rs runs it with RAYON_NUM_THREADS=1 and =2 and compares bytes).

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use kdtree_engine::api::{Drafter, Target};
use kdtree_engine::drafter::{DFlashDrafter, DrafterWeights, DrafterDims, TargetTables};
use kdtree_engine::generate::{ddtree_round, prefill, Sampling};
use kdtree_engine::model::source::{gather_bf16, TensorSource};
use kdtree_engine::model::{AttnMode, CpuTarget, Trace, TraceData, Weights};
use kdtree_engine::sampling::argmax;
use kdtree_formats::ModelDir;
use kdtree_golden::bundle::{
    sha256_hex, topk_of, write_bundle, ArRecord, DdtreeRecord, Index, LayerTrace, ModelInfo, PromptEntryExtra, PromptRecord, Settings,
    TraceRecord, FORMAT,
};
use std::path::PathBuf;
use std::sync::Arc;

/// Write CPU reference bundles (tokens, logits, per-layer tensors, one DDTree round) for checking other engines.
#[derive(Parser, Debug)]
#[command(name = "kdtree-golden", version)]
struct Args {
    /// Converted model directory (kdtree-convert repack output, with its drafter for the DDTree round).
    model: PathBuf,
    /// Prompt JSONL: {"id", "prompt_token_ids": [...]}, {"id", "prompt": "..."} or {"id", "messages": [...]}.
    #[arg(long)]
    prompts: PathBuf,
    /// Output directory (created; existing bundle files are overwritten).
    #[arg(long)]
    out: PathBuf,
    /// Greedy tokens generated per prompt.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// DDTree node budget (root excluded) of the recorded round.
    #[arg(long, default_value_t = 8)]
    budget: usize,
    /// Steps whose full logits are stored (the rest keep only top-k).
    #[arg(long, default_value_t = 4)]
    full_logits_steps: usize,
    /// Top-k stored for every step.
    #[arg(long, default_value_t = 8)]
    topk: usize,
    /// AR step whose single-token forward is traced per layer (1 = the forward that feeds the first
    /// generated token); 0 disables the trace.
    #[arg(long, default_value_t = 1)]
    trace_step: usize,
    /// Skip the DDTree round even when the model has a drafter.
    #[arg(long)]
    no_ddtree: bool,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
}

/// The target's embedding and LM head handed to the drafter.
struct Tables(Arc<Weights>);

impl TargetTables for Tables {
    fn hidden_size(&self) -> usize {
        self.0.cfg.hidden
    }
    fn vocab_size(&self) -> usize {
        self.0.cfg.vocab
    }
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        self.0.embed(tokens)
    }
    fn lm_head(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.0.lm_head(x, n)
    }
}

struct Loaded {
    target: CpuTarget,
    drafter: Option<DFlashDrafter>,
    manifest_sha256: String,
}

fn load(dir: &std::path::Path) -> Result<Loaded> {
    let manifest_path = dir.join("manifest.toml");
    let manifest = std::fs::read(&manifest_path).with_context(|| format!("reading {}", manifest_path.display()))?;
    let md = ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    let drafter_cfg = md.drafter_config().cloned();
    let src: Arc<dyn TensorSource> = Arc::new(md);
    let w = Arc::new(Weights::load(src.clone())?);
    let taps = drafter_cfg.as_ref().map(|c| c.dflash_config.target_layer_ids.clone()).unwrap_or_default();
    let target = CpuTarget::new(w.clone(), taps, AttnMode::default())?;
    let drafter = match &drafter_cfg {
        None => None,
        Some(cfg) => {
            let dims = DrafterDims::from_config(cfg)?;
            let dw = DrafterWeights::load_with(&dims, |name, shape| {
                let (v, s) = gather_bf16(&*src, name)?;
                ensure!(s == shape, "{name}: logical shape {s:?}, drafter expects {shape:?}");
                Ok(v)
            })?;
            Some(DFlashDrafter::new(cfg, dw, Arc::new(Tables(w.clone())))?)
        }
    };
    Ok(Loaded { target, drafter, manifest_sha256: sha256_hex(&manifest) })
}

/// Prompt ids of every line, in file order; any bad line is an error (a golden run must be complete).
fn read_prompts(path: &std::path::Path, model: &std::path::Path) -> Result<Vec<(String, Vec<u32>)>> {
    use kdtree_text::prompts::{read_prompt_file, Input};
    let lines = read_prompt_file(path)?;
    ensure!(!lines.is_empty(), "{}: no prompts", path.display());
    let mut tok: Option<kdtree_text::Tokenizer> = None;
    let mut encode = |text: &str| -> Result<Vec<u32>> {
        if tok.is_none() {
            // same rule as kdtree-run: the tokenizer lives in the model dir (tiktoken.model)
            ensure!(model.join("tiktoken.model").exists(), "{} has no tokenizer (tiktoken.model); use prompt_token_ids", model.display());
            tok = Some(kdtree_text::Tokenizer::from_dir(model).with_context(|| format!("loading the tokenizer of {}", model.display()))?);
        }
        tok.as_ref().unwrap().try_encode(text)
    };
    let mut out = Vec::new();
    for l in lines {
        let req = match l.request {
            Ok(r) => r,
            Err(e) => bail!("{}:{}: {} ({})", path.display(), e.line_no, e.message, e.code),
        };
        let ids = match req.input {
            Input::TokenIds(ids) => ids,
            Input::Text(text) => encode(&text)?,
            Input::Chat { messages, tools, thinking, preserve_thinking } => {
                let tmpl = kdtree_text::ChatTemplate::from_dir(model)?;
                let d = kdtree_text::chat::ChatOptions::default();
                let opts = kdtree_text::chat::ChatOptions {
                    tools,
                    thinking: thinking.unwrap_or(d.thinking),
                    preserve_thinking: preserve_thinking.unwrap_or(d.preserve_thinking),
                    ..d
                };
                encode(&tmpl.render(&messages, &opts)?)?
            }
        };
        ensure!(!ids.is_empty(), "{}:{}: prompt {:?} has no tokens", path.display(), l.line_no, l.id);
        out.push((l.id, ids));
    }
    Ok(out)
}

/// Greedy AR with per-step top-k, full logits of the first steps and the trace of one decode forward.
fn run_ar(t: &mut CpuTarget, prompt: &[u32], a: &Args) -> Result<(ArRecord, Option<TraceRecord>)> {
    let v = t.info().vocab_size;
    t.reset();
    let mut row = prefill(t, None, prompt)?;
    let mut rec = ArRecord { topk: a.topk.min(v), vocab: v, ..Default::default() };
    let mut trace = None;
    for step in 0..a.max_tokens {
        if step > 0 {
            let fed = rec.tokens[step - 1];
            let traced = step == a.trace_step;
            if traced {
                t.start_trace();
            }
            let out = t.forward(&[fed], &[-1])?;
            if traced {
                let tr = t.take_trace().context("trace hook returned nothing")?;
                trace = Some(trace_record(&tr, step, t.committed(), fed, t.info().num_layers)?);
            }
            t.commit(&[0])?;
            ensure!(out.logits.len() == v, "decode step returned {} logits, vocab {v}", out.logits.len());
            row = out.logits;
        }
        ensure!(row.iter().all(|x| x.is_finite()), "step {step}: non-finite logits");
        let tok = argmax(&row);
        let (ids, vals) = topk_of(&row, rec.topk);
        rec.topk_ids.extend(ids);
        rec.topk_logits.extend(vals);
        if step < a.full_logits_steps {
            rec.full_logits.extend_from_slice(&row);
            rec.full_steps += 1;
        }
        rec.tokens.push(tok);
    }
    Ok((rec, trace))
}

fn f32_of(tr: &Trace, name: &str, want: &[usize]) -> Result<Vec<f32>> {
    let t = tr.get(name).with_context(|| format!("trace has no {name}"))?;
    ensure!(t.shape == want, "trace {name}: shape {:?}, expected {want:?}", t.shape);
    match &t.data {
        TraceData::F32(v) => Ok(v.clone()),
        TraceData::I32(_) => bail!("trace {name}: i32, expected f32"),
    }
}

/// Convert the engine's trace of a 1-token forward (names in engine/src/model/trace.rs) to the bundle's.
fn trace_record(tr: &Trace, step: usize, position: usize, token: u32, layers: usize) -> Result<TraceRecord> {
    let h = |name: &str| tr.get(name).map(|t| t.shape.clone());
    let hidden = h("layers.0.attn_out").context("trace has no layers.0.attn_out")?;
    ensure!(hidden.len() == 2 && hidden[0] == 1, "trace of a decode step must have T = 1, got {hidden:?}");
    let hs = [1, hidden[1]];
    let mut out = TraceRecord { step, position, token, layers: Vec::with_capacity(layers) };
    for l in 0..layers {
        let p = format!("layers.{l}");
        let mut lt = LayerTrace {
            attn_out: f32_of(tr, &format!("{p}.attn_out"), &hs)?,
            mlp_out: f32_of(tr, &format!("{p}.mlp_out"), &hs)?,
            residual: f32_of(tr, &format!("{p}.residual"), &hs)?,
            ..Default::default()
        };
        if let Some(ids) = tr.get(&format!("{p}.router.topk_ids")) {
            let k = *ids.shape.last().unwrap_or(&0);
            ensure!(ids.shape == [1, k], "trace {p}.router.topk_ids: shape {:?}", ids.shape);
            lt.router_ids = match &ids.data {
                TraceData::I32(v) => v.iter().map(|&x| u32::try_from(x).context("negative expert id")).collect::<Result<_>>()?,
                TraceData::F32(_) => bail!("trace {p}.router.topk_ids: f32, expected i32"),
            };
            lt.router_weights = f32_of(tr, &format!("{p}.router.topk_weights"), &[1, k])?;
        }
        out.layers.push(lt);
    }
    Ok(out)
}

/// One greedy DDTree round right after the prompt.
fn run_round(t: &mut CpuTarget, d: &mut DFlashDrafter, prompt: &[u32], budget: usize) -> Result<DdtreeRecord> {
    let v = t.info().vocab_size;
    t.reset();
    d.reset();
    let row = prefill(t, Some(d as &mut dyn Drafter), prompt)?;
    let root = argmax(&row);
    let sampling = Sampling::greedy();
    let mut rng = sampling.rng();
    let rec = ddtree_round(t, d, root, budget, &sampling, &mut rng)?;
    let tree = &rec.tree;
    Ok(DdtreeRecord {
        start: rec.start,
        root,
        budget,
        vocab: v,
        draft_rows: rec.draft_rows,
        draft_logits: rec.draft_logits.clone(),
        tree_tokens: tree.tokens.clone(),
        tree_parents: tree.parents.clone(),
        tree_depths: tree.depths.clone(),
        visibility_words: tree.visibility.words,
        visibility: tree.visibility.bits.clone(),
        verify_logits: rec.verify.logits.clone(),
        accepted: rec.walk.path.clone(),
        decisions: rec.walk.decisions.clone(),
        bonus: rec.walk.bonus(),
    })
}

fn main() -> Result<()> {
    let a = Args::parse();
    ensure!(a.max_tokens >= 1, "--max-tokens must be at least 1");
    ensure!(a.topk >= 1, "--topk must be at least 1");
    let mut m = load(&a.model)?;
    let prompts = read_prompts(&a.prompts, &a.model)?;
    let info = m.target.info().clone();
    let do_round = m.drafter.is_some() && !a.no_ddtree;
    let block = m.drafter.as_ref().map(|d| d.block_size()).unwrap_or(0);
    let mut records = Vec::with_capacity(prompts.len());
    for (i, (id, ids)) in prompts.iter().enumerate() {
        ensure!(
            ids.len() + a.max_tokens <= info.max_positions,
            "prompt {id:?}: {} + {} tokens exceed max_positions {}",
            ids.len(),
            a.max_tokens,
            info.max_positions
        );
        let (ar, trace) = run_ar(&mut m.target, ids, &a)?;
        let (ddtree, extra) = match (&mut m.drafter, do_round) {
            (Some(d), true) => {
                let r = run_round(&mut m.target, d, ids, a.budget)?;
                let emitted: Vec<u32> = r.accepted[1..].iter().map(|&n| r.tree_tokens[n]).chain([r.bonus]).collect();
                // greedy DDTree emits the root (= ar.tokens[0]) then these; they must continue the AR run
                let n = emitted.len().min(ar.tokens.len().saturating_sub(1));
                let matches = r.root == ar.tokens[0] && emitted[..n] == ar.tokens[1..1 + n];
                if !matches {
                    eprintln!("kdtree-golden: warning: prompt {id:?}: DDTree round tokens {emitted:?} differ from greedy AR {:?}", &ar.tokens[1..]);
                }
                (Some(r), PromptEntryExtra { ddtree_tokens: emitted.len(), ddtree_matches_ar: matches })
            }
            _ => (None, PromptEntryExtra::default()),
        };
        if !a.quiet {
            eprintln!(
                "kdtree-golden: [{}/{}] {id}: {} prompt tokens -> {:?}{}",
                i + 1,
                prompts.len(),
                ids.len(),
                ar.tokens,
                ddtree.as_ref().map(|r| format!(", DDTree round accepted {} of {} nodes", r.accepted.len() - 1, r.tree_tokens.len() - 1)).unwrap_or_default()
            );
        }
        records.push((id.clone(), PromptRecord { prompt_ids: ids.clone(), ar, trace, ddtree }, extra));
    }
    let index = Index {
        format: FORMAT.into(),
        tool: "kdtree-golden".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        engine_version: kdtree_engine_version(),
        command: format!(
            "kdtree-golden MODEL --prompts PROMPTS --out OUT --max-tokens {} --budget {} --full-logits-steps {} --topk {} --trace-step {}{}",
            a.max_tokens,
            a.budget,
            a.full_logits_steps,
            a.topk,
            a.trace_step,
            if a.no_ddtree { " --no-ddtree" } else { "" }
        ),
        model: ModelInfo {
            manifest_sha256: m.manifest_sha256.clone(),
            vocab_size: info.vocab_size,
            hidden_size: info.hidden_size,
            num_layers: info.num_layers,
            tap_layers: info.tap_layers.clone(),
            block_size: block,
        },
        settings: Settings {
            max_tokens: a.max_tokens,
            budget: if do_round { a.budget } else { 0 },
            full_logits_steps: a.full_logits_steps.min(a.max_tokens),
            topk: a.topk.min(info.vocab_size),
            trace_step: if a.trace_step < a.max_tokens { a.trace_step } else { 0 },
        },
        prompts: Vec::new(),
    };
    let index = write_bundle(&a.out, index, &records)?;
    if !a.quiet {
        eprintln!("kdtree-golden: wrote {} prompt files + index.json to {}", index.prompts.len(), a.out.display());
    }
    Ok(())
}

/// The engine crate's version, as recorded in the index (the workspace shares one version).
fn kdtree_engine_version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}
