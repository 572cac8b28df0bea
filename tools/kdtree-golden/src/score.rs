//! Teacher-forced scoring of another engine's tokens against the CPU reference (`kdtree-golden --score`):
//! for each generated token of a run, the CPU reference's logits after exactly the prefix that run saw
//! (prompt + the run's own earlier tokens), and the *gap* of the token it chose: the CPU's largest logit
//! minus the CPU's logit of that token (0 when the run chose the CPU's argmax). A correct bf16 engine picks
//! a token whose gap is at most the logit error of its forward: if it picked `a` over the CPU's `b`, then
//! `gpu[a] >= gpu[b]`, so `cpu[b] - cpu[a] <= |Δa| + |Δb|`. A wrong forward picks tokens far below the top.
//!
//! Inputs: kdtree-run records (JSONL: `id`, `token_ids`), or a kdtree-golden bundle recorded on another
//! device (its `ar.tokens`; where it holds full logits, `ar.full_logits`, also the max |Δ| between its logits
//! and the CPU's at the same prefix: the measured logit error). Identical (prompt, tokens) sequences are
//! scored once. The report (JSON) has every position's gap; `--bound` turns it into a check (exit 1 above it).
//! Tests: tools/kdtree-golden/tests/score_cli.rs.

use crate::bundle::Bundle;
use crate::reference::open;
use anyhow::{bail, ensure, Context, Result};
use kdtree_engine::api::Target;
use kdtree_engine::Device;
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One scored token sequence.
#[derive(Debug, Clone, Serialize)]
pub struct Scored {
    /// The input it came from and the record's id there.
    pub file: String,
    pub id: String,
    pub tokens: Vec<u32>,
    /// Per generated position: the CPU's largest logit minus its logit of the chosen token (>= 0).
    pub gaps: Vec<f32>,
    /// Per position: the CPU's argmax (lowest id among equal maxima).
    pub cpu_argmax: Vec<u32>,
    /// Per position: the chosen token's rank among the CPU's logits (0 = the CPU's top).
    pub ranks: Vec<usize>,
    pub max_gap: f32,
    /// Per position with the input's own logits (a bundle with full logits): max over the vocab of
    /// |input logit − CPU logit|.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deltas: Vec<f32>,
    pub max_abs_delta: Option<f32>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub format: &'static str,
    pub model: String,
    pub bound: Option<f32>,
    pub sequences: usize,
    pub tokens: usize,
    pub max_gap: f32,
    /// (file, id, position) of the largest gap.
    pub max_gap_at: Option<(String, String, usize)>,
    pub max_abs_delta: Option<f32>,
    /// Positions whose gap exceeds the bound.
    pub over_bound: usize,
    pub records: Vec<Scored>,
}

/// A run's tokens of one prompt, and, from a bundle, its own logits of every position it recorded.
struct Input {
    file: String,
    id: String,
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn read_input(path: &Path) -> Result<Vec<Input>> {
    let file = path.display().to_string();
    if path.is_dir() {
        let b = Bundle::open(path)?;
        return Ok(b
            .load_all()?
            .into_iter()
            .map(|(id, r)| {
                let logits = (0..r.ar.full_steps).map(|s| r.ar.full_row(s).unwrap_or_default().to_vec()).collect();
                Input { file: file.clone(), id, tokens: r.ar.tokens, logits }
            })
            .collect());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {file}"))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{file}:{}: not JSON", i + 1))?;
        let id = v.get("id").and_then(|x| x.as_str()).with_context(|| format!("{file}:{}: no \"id\"", i + 1))?.to_string();
        let Some(toks) = v.get("token_ids").and_then(|x| x.as_array()) else {
            bail!("{file}:{}: record {id:?} has no token_ids (error record: {})", i + 1, v.get("error").map_or("none".into(), |e| e.to_string()));
        };
        let tokens = toks
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).with_context(|| format!("{file}:{}: token_ids holds {t}", i + 1)))
            .collect::<Result<Vec<u32>>>()?;
        out.push(Input { file: file.clone(), id, tokens, logits: Vec::new() });
    }
    Ok(out)
}

/// The CPU's logit rows after `prompt + tokens[..j]` for every j < tokens.len(): a prefill of the prompt
/// (its last row), then one chain forward of the run's tokens but the last (every row).
fn teacher_forced(t: &mut dyn Target, prompt: &[u32], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    let v = t.info().vocab_size;
    t.reset();
    let chain = |n: usize| -> Vec<i32> { (0..n as i32).map(|i| i - 1).collect() };
    let first = t.forward_rows(prompt, &chain(prompt.len()), kdtree_engine::api::LogitRows::Last)?;
    ensure!(first.logits.len() == v, "prefill returned {} logits, expected {v}", first.logits.len());
    let mut rows = vec![first.logits];
    if tokens.len() > 1 {
        t.commit(&(0..prompt.len()).collect::<Vec<_>>())?;
        let rest = &tokens[..tokens.len() - 1];
        let out = t.forward(rest, &chain(rest.len()))?;
        ensure!(out.logits.len() == rest.len() * v, "forward returned {} logits, expected {}", out.logits.len(), rest.len() * v);
        rows.extend(out.logits.chunks(v).map(|r| r.to_vec()));
    }
    t.reset();
    Ok(rows)
}

/// (argmax, gap of `chosen`, rank of `chosen`) of one CPU row.
fn gap_of(row: &[f32], chosen: u32) -> Result<(u32, f32, usize)> {
    let c = *row.get(chosen as usize).with_context(|| format!("token {chosen} is outside the vocabulary of {}", row.len()))?;
    let am = kdtree_engine::sampling::argmax(row) as u32;
    let top = row[am as usize];
    ensure!(top.is_finite() && c.is_finite(), "the CPU logits are not finite (top {top}, chosen {c})");
    let rank = row.iter().filter(|&&x| x > c).count();
    Ok((am, top - c, rank))
}

/// Score every record of `inputs` (kdtree-run JSONL files or bundle directories) against the CPU reference
/// of `model`, prompts from `prompts`. `progress`: one line per scored sequence on stderr.
pub fn score(model: &Path, prompts: &Path, inputs: &[PathBuf], bound: Option<f32>, progress: bool) -> Result<Report> {
    let prompt_ids: HashMap<String, Vec<u32>> = crate::make::read_prompts(prompts, model)?.into_iter().collect();
    let mut all = Vec::new();
    for p in inputs {
        all.extend(read_input(p)?);
    }
    let mut m = open(model, Device::Cpu)?;
    let mut memo: HashMap<(String, Vec<u32>), Vec<Vec<f32>>> = HashMap::new();
    let mut records = Vec::with_capacity(all.len());
    for inp in all {
        let prompt = prompt_ids.get(&inp.id).with_context(|| format!("{}: record {:?} is not a line of {}", inp.file, inp.id, prompts.display()))?;
        if inp.tokens.is_empty() {
            continue;
        }
        let key = (inp.id.clone(), inp.tokens.clone());
        if !memo.contains_key(&key) {
            let rows = teacher_forced(&mut *m.loaded.target, prompt, &inp.tokens).with_context(|| format!("{}: {}", inp.file, inp.id))?;
            memo.insert(key.clone(), rows);
        }
        let rows = &memo[&key];
        let (mut gaps, mut am, mut ranks, mut deltas) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (j, &tok) in inp.tokens.iter().enumerate() {
            let (a, g, r) = gap_of(&rows[j], tok).with_context(|| format!("{}: {} position {j}", inp.file, inp.id))?;
            gaps.push(g);
            am.push(a);
            ranks.push(r);
            if let Some(own) = inp.logits.get(j) {
                ensure!(own.len() == rows[j].len(), "{}: {} position {j}: {} logits vs the CPU's {}", inp.file, inp.id, own.len(), rows[j].len());
                deltas.push(own.iter().zip(&rows[j]).map(|(x, y)| (x - y).abs()).fold(0.0f32, |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) }));
            }
        }
        let max_gap = gaps.iter().copied().fold(0.0f32, f32::max);
        let max_abs_delta = deltas.iter().copied().reduce(f32::max);
        if progress {
            kdtree_text::console::say(format_args!(
                "kdtree-golden: score {} {}: {} tokens, max gap {max_gap:.4}{}",
                inp.file,
                inp.id,
                inp.tokens.len(),
                max_abs_delta.map(|d| format!(", max |Δ| {d:.4}")).unwrap_or_default()
            ));
        }
        records.push(Scored { file: inp.file, id: inp.id, tokens: inp.tokens, gaps, cpu_argmax: am, ranks, max_gap, deltas, max_abs_delta });
    }
    let mut max_gap_at = None;
    let mut max_gap = 0.0f32;
    for r in &records {
        for (j, &g) in r.gaps.iter().enumerate() {
            if max_gap_at.is_none() || g > max_gap {
                max_gap = g;
                max_gap_at = Some((r.file.clone(), r.id.clone(), j));
            }
        }
    }
    let over_bound = bound.map_or(0, |b| records.iter().flat_map(|r| &r.gaps).filter(|&&g| g > b).count());
    Ok(Report {
        format: "kdtree-golden-score/1",
        model: model.display().to_string(),
        bound,
        sequences: memo.len(),
        tokens: records.iter().map(|r| r.tokens.len()).sum(),
        max_gap,
        max_gap_at,
        max_abs_delta: records.iter().filter_map(|r| r.max_abs_delta).reduce(f32::max),
        over_bound,
        records,
    })
}
