//! Writing a bundle: for each prompt the greedy AR run with top-k logits of every step and full logits
//! of the first steps, the per-layer tensors of one single-token decode forward (the session's layer
//! probe), and one DDTree round right after the prompt. The `kdtree-golden` binary is a thin clap front
//! end over [`make_bundle`]; tests of other crates (kdtree-run --verify) call it directly, so they get
//! exactly the binary's bundle. Output bytes depend only on the model and the options.

use crate::bundle::{
    write_bundle, Index, LayerTrace, ModelInfo, PromptEntryExtra, PromptRecord, Settings, TraceRecord, FORMAT,
};
use crate::reference::{ddtree_round_record, greedy_ar, open, ArOptions};
use anyhow::{bail, ensure, Context, Result};
use kdtree_engine::model::{Trace, TraceData};
use kdtree_engine::{Device, Mode};
use std::path::Path;

/// The settings of one bundle (the binary's flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Greedy tokens generated per prompt.
    pub max_tokens: usize,
    /// DDTree node budget (root excluded) of the recorded round.
    pub budget: usize,
    /// Steps whose full logits are stored.
    pub full_logits_steps: usize,
    /// Top-k stored for every step.
    pub topk: usize,
    /// AR step whose single-token forward is traced (0 = none).
    pub trace_step: usize,
    /// Skip the DDTree round even when the model has a drafter.
    pub no_ddtree: bool,
    /// No progress lines on stderr.
    pub quiet: bool,
}

/// Write the bundle of `model` (a converted directory) for the prompts of `prompts` into `out`, recorded by
/// the CPU reference.
pub fn make_bundle(model: &Path, prompts: &Path, out: &Path, a: &Options) -> Result<Index> {
    make_bundle_on(model, prompts, out, a, Device::Cpu)
}

/// [`make_bundle`] recorded on `device`.
pub fn make_bundle_on(model: &Path, prompts: &Path, out: &Path, a: &Options, device: Device) -> Result<Index> {
    ensure!(a.max_tokens >= 1, "--max-tokens must be at least 1");
    ensure!(a.topk >= 1, "--topk must be at least 1");
    let mut m = open(model, device)?;
    let prompts = read_prompts(prompts, model)?;
    let info = m.loaded.info().clone();
    let do_round = m.loaded.has_drafter() && !a.no_ddtree;
    let block = m.loaded.block_size();
    let ar_opts = ArOptions {
        max_tokens: a.max_tokens,
        topk: a.topk,
        full_logits_steps: a.full_logits_steps,
        trace_step: a.trace_step,
    };
    // The CPU router's decision margins along every recorded row (the route-flip evidence of `--verify`);
    // a bundle recorded on another device holds none.
    let routers = match device {
        Device::Cpu => Some(crate::score::Routers::of(model)?),
        _ => None,
    };
    let mut records = Vec::with_capacity(prompts.len());
    // Every prompt must fit before any work (a late prompt failing after earlier ones ran wastes the run).
    for (id, ids) in &prompts {
        ensure!(
            ids.len() + a.max_tokens <= info.max_positions,
            "prompt {id:?}: {} + {} tokens exceed max_positions {}",
            ids.len(),
            a.max_tokens,
            info.max_positions
        );
    }
    for (i, (id, ids)) in prompts.iter().enumerate() {
        let (mut ar, _, traced) = greedy_ar(&mut m.loaded.session(Mode::Ar)?, ids, &ar_opts)?;
        if let Some(routers) = &routers {
            let f = crate::score::teacher_forced(&mut *m.loaded.target, routers, ids, &ar.tokens)?;
            let chain: Vec<i32> = (0..f.margins.len() as i32).map(|i| i - 1).collect();
            ar.router_margins = crate::score::path_min(&f.margins, &chain);
        }
        let trace = match traced {
            Some((step, position, token, tr)) => Some(trace_record(&tr, step, position, token, info.num_layers)?),
            None => None,
        };
        let (ddtree, extra) = match do_round {
            true => {
                let mut r =
                    ddtree_round_record(&mut m.loaded.session(Mode::DDTree { budget: a.budget })?, ids, a.budget)?;
                if let Some(routers) = &routers {
                    let own = crate::score::forward_margins(
                        &mut *m.loaded.target,
                        routers,
                        ids,
                        &r.tree_tokens,
                        &r.tree_parents,
                        Some(&r.verify_logits),
                    )?;
                    r.router_margins = crate::score::path_min(&own, &r.tree_parents);
                }
                let emitted: Vec<u32> = r.accepted[1..]
                    .iter()
                    .map(|&n| r.tree_tokens[n])
                    .chain([r.bonus])
                    .collect();
                // greedy DDTree emits the root (= ar.tokens[0]) then these; they must continue the AR run
                let n = emitted.len().min(ar.tokens.len().saturating_sub(1));
                let matches = r.root == ar.tokens[0] && emitted[..n] == ar.tokens[1..1 + n];
                if !matches {
                    kdtree_text::console::say(format_args!(
                        "kdtree-golden: warning: prompt {id:?}: DDTree round tokens {emitted:?} differ from greedy \
                         AR {:?}",
                        &ar.tokens[1..]
                    ));
                }
                (
                    Some(r),
                    PromptEntryExtra {
                        ddtree_tokens: emitted.len(),
                        ddtree_matches_ar: matches,
                    },
                )
            }
            false => (None, PromptEntryExtra::default()),
        };
        if !a.quiet {
            kdtree_text::console::say(format_args!(
                "kdtree-golden: [{}/{}] {id}: {} prompt tokens -> {:?}{}",
                i + 1,
                prompts.len(),
                ids.len(),
                ar.tokens,
                ddtree
                    .as_ref()
                    .map(|r| format!(
                        ", DDTree round accepted {} of {} nodes",
                        r.accepted.len() - 1,
                        r.tree_tokens.len() - 1
                    ))
                    .unwrap_or_default()
            ));
        }
        records.push((
            id.clone(),
            PromptRecord {
                prompt_ids: ids.clone(),
                ar,
                trace,
                ddtree,
            },
            extra,
        ));
    }
    let index = Index {
        format: FORMAT.into(),
        tool: "kdtree-golden".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        engine_version: kdtree_engine_version(),
        command: format!(
            "kdtree-golden MODEL --prompts PROMPTS --out OUT --max-tokens {} --budget {} --full-logits-steps {} \
             --topk {} --trace-step {}{}",
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
    let index = write_bundle(out, index, &records)?;
    if !a.quiet {
        kdtree_text::console::say(format_args!(
            "kdtree-golden: wrote {} prompt files + index.json to {}",
            index.prompts.len(),
            out.display()
        ));
    }
    Ok(index)
}

/// The engine crate's version, as recorded in the index (the workspace shares one version).
fn kdtree_engine_version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

/// Prompt ids of every line, in file order; any bad line is an error (a golden run must be complete).
pub fn read_prompts(path: &std::path::Path, model: &std::path::Path) -> Result<Vec<(String, Vec<u32>)>> {
    use kdtree_text::prompts::{read_prompt_file, Input};
    let lines = read_prompt_file(path)?;
    ensure!(!lines.is_empty(), "{}: no prompts", path.display());
    let mut tok: Option<kdtree_text::Tokenizer> = None;
    let mut encode = |text: &str| -> Result<Vec<u32>> {
        if tok.is_none() {
            // same rule as kdtree-run: the tokenizer lives in the model dir (tiktoken.model)
            ensure!(
                model.join("tiktoken.model").exists(),
                "{} has no tokenizer (tiktoken.model); use prompt_token_ids",
                model.display()
            );
            tok = Some(
                kdtree_text::Tokenizer::from_dir(model)
                    .with_context(|| format!("loading the tokenizer of {}", model.display()))?,
            );
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
            Input::Chat {
                messages,
                tools,
                thinking,
                preserve_thinking,
            } => {
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
        ensure!(
            !ids.is_empty(),
            "{}:{}: prompt {:?} has no tokens",
            path.display(),
            l.line_no,
            l.id
        );
        out.push((l.id, ids));
    }
    Ok(out)
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
pub fn trace_record(tr: &Trace, step: usize, position: usize, token: u32, layers: usize) -> Result<TraceRecord> {
    let h = |name: &str| tr.get(name).map(|t| t.shape.clone());
    let hidden = h("layers.0.attn_out").context("trace has no layers.0.attn_out")?;
    ensure!(
        hidden.len() == 2 && hidden[0] == 1,
        "trace of a decode step must have T = 1, got {hidden:?}"
    );
    let hs = [1, hidden[1]];
    let mut out = TraceRecord {
        step,
        position,
        token,
        layers: Vec::with_capacity(layers),
    };
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
                TraceData::I32(v) => v
                    .iter()
                    .map(|&x| u32::try_from(x).context("negative expert id"))
                    .collect::<Result<_>>()?,
                TraceData::F32(_) => bail!("trace {p}.router.topk_ids: f32, expected i32"),
            };
            lt.router_weights = f32_of(tr, &format!("{p}.router.topk_weights"), &[1, k])?;
        }
        out.layers.push(lt);
    }
    Ok(out)
}
