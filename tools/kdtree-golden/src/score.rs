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
//!
//! Route flips (`--route-flip MARGIN,GAP`): a bf16 forward's router logits differ from the CPU's by a small
//! error, so where the CPU's own router decision is that close (its `route_margin` below MARGIN: the last
//! chosen expert's selection score minus the best unchosen one's), the other engine may have routed the token
//! to another expert set, and its logits of that row then differ by far more than the bf16 error. A gap above
//! `--bound` is accepted only there, and only up to GAP; both numbers must come from measurement (the GPU's
//! measured flips, bench/GPU-RESULTS.md run 49). The margin is the token's own: exact for models whose last
//! layer is the only MoE layer (a flip changes only its own row); where MoE
//! layers follow, a flip also changes later rows, which this rule does not accept.
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
    /// Per position: the CPU router's smallest decision margin over the MoE layers (`route_margin`): where
    /// it is below the router's bf16 logit error, another engine may route that token to another expert set.
    pub router_margins: Vec<f32>,
    /// A sampled record (temperature > 0): per position, whether the CPU's own decision with the record's
    /// settings and the same position-keyed uniform (`sampling::sample`) is the record's token.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sampled_agree: Vec<bool>,
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
    /// Positions whose gap exceeds the bound (greedy records; a sampled token is not the argmax by design),
    /// those accepted as route flips not counted.
    pub over_bound: usize,
    /// The route-flip rule (margin, largest gap) when given.
    pub route_flip: Option<(f32, f32)>,
    /// (file, id, position, gap, router margin) of every gap above the bound accepted as a route flip.
    pub route_flips: Vec<(String, String, usize, f32, f32)>,
    /// (file, id, position, gap) of every gap above the bound after an accepted route flip in the same record:
    /// the run's own cache rows from the flip on hold another expert set's output, which the CPU's teacher-forced
    /// rows never see, so those positions are reported, not judged.
    pub after_flip: Vec<(String, String, usize, f32)>,
    /// Sampled records: positions scored, and those where the CPU would have sampled another token.
    pub sampled_positions: usize,
    pub sampled_disagree: usize,
    pub records: Vec<Scored>,
}

/// A run's tokens of one prompt, and, from a bundle, its own logits of every position it recorded.
struct Input {
    file: String,
    id: String,
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    /// The record's sampling settings when it sampled (temperature > 0).
    sampling: Option<kdtree_engine::sampling::Sampling>,
}

fn read_input(path: &Path) -> Result<Vec<Input>> {
    let file = path.display().to_string();
    if path.is_dir() {
        let b = Bundle::open(path)?;
        return Ok(b
            .load_all()?
            .into_iter()
            .map(|(id, r)| {
                let logits = (0..r.ar.full_steps)
                    .map(|s| r.ar.full_row(s).unwrap_or_default().to_vec())
                    .collect();
                Input {
                    file: file.clone(),
                    id,
                    tokens: r.ar.tokens,
                    logits,
                    sampling: None,
                }
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
        let id = v
            .get("id")
            .and_then(|x| x.as_str())
            .with_context(|| format!("{file}:{}: no \"id\"", i + 1))?
            .to_string();
        let Some(toks) = v.get("token_ids").and_then(|x| x.as_array()) else {
            bail!(
                "{file}:{}: record {id:?} has no token_ids (error record: {})",
                i + 1,
                v.get("error").map_or("none".into(), |e| e.to_string())
            );
        };
        let tokens = toks
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .with_context(|| format!("{file}:{}: token_ids holds {t}", i + 1))
            })
            .collect::<Result<Vec<u32>>>()?;
        let sampling = v.get("sampling").and_then(|x| {
            let t = x.get("temperature")?.as_f64()? as f32;
            (t > 0.0).then(|| kdtree_engine::sampling::Sampling {
                temperature: t,
                top_p: x.get("top_p").and_then(|v| v.as_f64()).unwrap_or(1.0) as f32,
                top_k: x.get("top_k").and_then(|v| v.as_u64()).unwrap_or(0) as usize,
                seed: x.get("seed").and_then(|v| v.as_u64()).unwrap_or(0),
            })
        });
        out.push(Input {
            file: file.clone(),
            id,
            tokens,
            logits: Vec::new(),
            sampling,
        });
    }
    Ok(out)
}

/// The router facts `route_margin` needs: the constants and each MoE layer's correction bias.
pub(crate) struct Routers {
    router: kdtree_engine::cpu::ops::Router,
    /// (layer, bias) of every MoE layer.
    layers: Vec<(usize, Option<Vec<f32>>)>,
}

impl Routers {
    pub(crate) fn of(model: &Path) -> Result<Routers> {
        let md = kdtree_formats::ModelDir::open(model).with_context(|| format!("opening model {}", model.display()))?;
        let cfg = kdtree_engine::model::ModelConfig::from_text(md.text_config(), 1)?;
        let mut layers = Vec::new();
        for (l, &moe) in cfg.moe_layers.iter().enumerate() {
            if !moe {
                continue;
            }
            let bias = ["language_model.", ""].iter().find_map(|p| {
                md.tensor(&format!("{p}model.layers.{l}.mlp.gate.e_score_correction_bias"), 0)
                    .ok()
            });
            layers.push((
                l,
                bias.map(|t| {
                    t.data
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect()
                }),
            ));
        }
        Ok(Routers {
            router: cfg.router(),
            layers,
        })
    }
}

/// One teacher-forced pass: the CPU's logit rows after `prompt + tokens[..j]` for every j < tokens.len(), and
/// the router's smallest decision margin of each of those rows' tokens.
pub(crate) struct Forced {
    pub(crate) rows: Vec<Vec<f32>>,
    pub(crate) margins: Vec<f32>,
}

/// A prefill of the prompt (its last row), then one chain forward of the run's tokens but the last (every
/// row), traced for the router logits.
pub(crate) fn teacher_forced(t: &mut dyn Target, routers: &Routers, prompt: &[u32], tokens: &[u32]) -> Result<Forced> {
    use kdtree_engine::model::TraceData;
    let v = t.info().vocab_size;
    t.reset();
    t.start_trace();
    let chain = |n: usize| -> Vec<i32> { (0..n as i32).map(|i| i - 1).collect() };
    let first = t.forward_rows(prompt, &chain(prompt.len()), kdtree_engine::api::LogitRows::Last)?;
    ensure!(
        first.logits.len() == v,
        "prefill returned {} logits, expected {v}",
        first.logits.len()
    );
    let mut rows = vec![first.logits];
    if tokens.len() > 1 {
        t.commit(&(0..prompt.len()).collect::<Vec<_>>())?;
        let rest = &tokens[..tokens.len() - 1];
        let out = t.forward(rest, &chain(rest.len()))?;
        ensure!(
            out.logits.len() == rest.len() * v,
            "forward returned {} logits, expected {}",
            out.logits.len(),
            rest.len() * v
        );
        rows.extend(out.logits.chunks(v).map(|r| r.to_vec()));
    }
    let trace = t.take_trace().unwrap_or_default();
    t.reset();
    // Router logits of every MoE layer, prefill rows then chain rows: position j is the prefill's last row
    // (j = 0) or the chain's row j - 1.
    let e = routers.router.n_experts;
    let mut margins = vec![f32::INFINITY; tokens.len()];
    for (l, bias) in &routers.layers {
        let name = format!("layers.{l}.router.logits");
        let mut seen: Vec<&[f32]> = Vec::new();
        for tt in trace.tensors.iter().filter(|x| x.name == name) {
            if let TraceData::F32(d) = &tt.data {
                seen.push(d);
            }
        }
        ensure!(
            seen.len() == 1 + (tokens.len() > 1) as usize,
            "the trace holds {} {name} tensors",
            seen.len()
        );
        let mut lrows: Vec<&[f32]> = vec![&seen[0][(prompt.len() - 1) * e..prompt.len() * e]];
        if let Some(c) = seen.get(1) {
            lrows.extend(c.chunks(e));
        }
        for (j, lg) in lrows.iter().enumerate().take(tokens.len()) {
            margins[j] = margins[j].min(kdtree_engine::cpu::ops::route_margin(
                &routers.router,
                lg,
                bias.as_deref(),
            ));
        }
    }
    Ok(Forced { rows, margins })
}

/// The CPU router's smallest decision margin (over the MoE layers) of every row of one forward of `tokens`
/// (parents as `Target::forward`'s: -1 = the committed prefix) after a prefill of `prompt`: the rows of a
/// DDTree round's tree, as its verify forward sees them (`verify_logits`: that forward's logits, which this one
/// must equal bit for bit). +inf for a model without MoE layers.
pub(crate) fn forward_margins(
    t: &mut dyn Target,
    routers: &Routers,
    prompt: &[u32],
    tokens: &[u32],
    parents: &[i32],
    verify_logits: Option<&[f32]>,
) -> Result<Vec<f32>> {
    use kdtree_engine::model::TraceData;
    let chain: Vec<i32> = (0..prompt.len() as i32).map(|i| i - 1).collect();
    t.reset();
    t.forward_rows(prompt, &chain, kdtree_engine::api::LogitRows::Last)?;
    t.commit(&(0..prompt.len()).collect::<Vec<_>>())?;
    t.start_trace();
    let out = t.forward(tokens, parents);
    let trace = t.take_trace().unwrap_or_default();
    t.reset();
    let out = out?;
    if let Some(want) = verify_logits {
        // The same forward as the round's verify: the same bits, or these are not that forward's rows.
        ensure!(
            out.logits.len() == want.len() && out.logits.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "the teacher-forced tree forward's logits differ from the round's verify logits"
        );
    }
    let e = routers.router.n_experts;
    let mut margins = vec![f32::INFINITY; tokens.len()];
    for (l, bias) in &routers.layers {
        let name = format!("layers.{l}.router.logits");
        let d = trace
            .tensors
            .iter()
            .filter(|x| x.name == name)
            .find_map(|x| match &x.data {
                TraceData::F32(d) => Some(d),
                _ => None,
            })
            .with_context(|| format!("the trace of the tree forward holds no {name}"))?;
        ensure!(
            d.len() == tokens.len() * e,
            "{name} holds {} values for {} rows",
            d.len(),
            tokens.len()
        );
        for (m, lg) in margins.iter_mut().zip(d.chunks(e)) {
            *m = m.min(kdtree_engine::cpu::ops::route_margin(
                &routers.router,
                lg,
                bias.as_deref(),
            ));
        }
    }
    Ok(margins)
}

/// Path minima: entry i = the smallest of `own` over i and its ancestors (`parents`: -1 = a root).
pub(crate) fn path_min(own: &[f32], parents: &[i32]) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(own.len());
    for (i, &m) in own.iter().enumerate() {
        let up = usize::try_from(parents[i]).ok().filter(|&p| p < i).map(|p| out[p]);
        out.push(up.map_or(m, |u| u.min(m)));
    }
    out
}

/// (argmax, gap of `chosen`, rank of `chosen`) of one CPU row.
fn gap_of(row: &[f32], chosen: u32) -> Result<(u32, f32, usize)> {
    let c = *row
        .get(chosen as usize)
        .with_context(|| format!("token {chosen} is outside the vocabulary of {}", row.len()))?;
    let am = kdtree_engine::sampling::argmax(row) as u32;
    let top = row[am as usize];
    ensure!(
        top.is_finite() && c.is_finite(),
        "the CPU logits are not finite (top {top}, chosen {c})"
    );
    let rank = row.iter().filter(|&&x| x > c).count();
    Ok((am, top - c, rank))
}

/// Score every record of `inputs` (kdtree-run JSONL files or bundle directories) against the CPU reference
/// of `model`, prompts from `prompts`. `progress`: one line per scored sequence on stderr.
pub fn score(
    model: &Path,
    prompts: &Path,
    inputs: &[PathBuf],
    bound: Option<f32>,
    route_flip: Option<(f32, f32)>,
    progress: bool,
) -> Result<Report> {
    let prompt_ids: HashMap<String, Vec<u32>> = crate::make::read_prompts(prompts, model)?.into_iter().collect();
    let mut all = Vec::new();
    for p in inputs {
        all.extend(read_input(p)?);
    }
    let mut m = open(model, Device::Cpu)?;
    let routers = Routers::of(model)?;
    let mut memo: HashMap<(String, Vec<u32>), Forced> = HashMap::new();
    let mut records = Vec::with_capacity(all.len());
    for inp in all {
        let prompt = prompt_ids.get(&inp.id).with_context(|| {
            format!(
                "{}: record {:?} is not a line of {}",
                inp.file,
                inp.id,
                prompts.display()
            )
        })?;
        if inp.tokens.is_empty() {
            continue;
        }
        let key = (inp.id.clone(), inp.tokens.clone());
        if !memo.contains_key(&key) {
            let f = teacher_forced(&mut *m.loaded.target, &routers, prompt, &inp.tokens)
                .with_context(|| format!("{}: {}", inp.file, inp.id))?;
            memo.insert(key.clone(), f);
        }
        let Forced { rows, margins } = &memo[&key];
        let (mut gaps, mut am, mut ranks, mut deltas, mut agree) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (j, &tok) in inp.tokens.iter().enumerate() {
            if let Some(sm) = &inp.sampling {
                agree.push(kdtree_engine::sampling::sample(&rows[j], sm, prompt.len() + j) == tok);
            }
            let (a, g, r) = gap_of(&rows[j], tok).with_context(|| format!("{}: {} position {j}", inp.file, inp.id))?;
            gaps.push(g);
            am.push(a);
            ranks.push(r);
            if let Some(own) = inp.logits.get(j) {
                ensure!(
                    own.len() == rows[j].len(),
                    "{}: {} position {j}: {} logits vs the CPU's {}",
                    inp.file,
                    inp.id,
                    own.len(),
                    rows[j].len()
                );
                deltas.push(
                    own.iter()
                        .zip(&rows[j])
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0f32, |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) }),
                );
            }
        }
        if inp.sampling.is_some() {
            // A sampled token is judged by the CPU's own sample (sampled_agree), not by its gap to the argmax.
            gaps.iter_mut().for_each(|g| *g = 0.0);
        }
        let max_gap = gaps.iter().copied().fold(0.0f32, f32::max);
        let max_abs_delta = deltas.iter().copied().reduce(f32::max);
        if progress {
            kdtree_text::console::say(format_args!(
                "kdtree-golden: score {} {}: {} tokens, max gap {max_gap:.4}{}{}",
                inp.file,
                inp.id,
                inp.tokens.len(),
                max_abs_delta.map(|d| format!(", max |Δ| {d:.4}")).unwrap_or_default(),
                if agree.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", sampled: CPU agrees at {} of {}",
                        agree.iter().filter(|&&a| a).count(),
                        agree.len()
                    )
                }
            ));
        }
        let router_margins = margins.clone();
        records.push(Scored {
            file: inp.file,
            id: inp.id,
            tokens: inp.tokens,
            gaps,
            cpu_argmax: am,
            ranks,
            max_gap,
            deltas,
            max_abs_delta,
            router_margins,
            sampled_agree: agree,
        });
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
    let (mut over_bound, mut route_flips, mut after_flip) = (0, Vec::new(), Vec::new());
    if let Some(b) = bound {
        for r in &records {
            let mut flipped = false;
            for (j, &g) in r.gaps.iter().enumerate() {
                let m = r.router_margins.get(j).copied().unwrap_or(f32::INFINITY);
                match route_flip {
                    _ if g <= b => {}
                    Some(_) if flipped => after_flip.push((r.file.clone(), r.id.clone(), j, g)),
                    Some((eps, max)) if m < eps && g <= max => {
                        flipped = true;
                        route_flips.push((r.file.clone(), r.id.clone(), j, g, m))
                    }
                    _ => over_bound += 1,
                }
            }
        }
    }
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
        route_flip,
        route_flips,
        after_flip,
        sampled_positions: records.iter().map(|r| r.sampled_agree.len()).sum(),
        sampled_disagree: records
            .iter()
            .map(|r| r.sampled_agree.iter().filter(|&&a| !a).count())
            .sum(),
        records,
    })
}

#[cfg(test)]
mod path_tests {
    use super::path_min;

    /// Each entry is the smallest of its own value and its ancestors' (a chain: a running minimum; a tree:
    /// per branch).
    #[test]
    fn path_min_follows_the_parents() {
        assert_eq!(path_min(&[3.0, 1.0, 2.0, 0.5], &[-1, 0, 1, 2]), [3.0, 1.0, 1.0, 0.5]);
        assert_eq!(
            path_min(&[3.0, 1.0, 2.0, 0.5, 4.0], &[-1, 0, 0, 2, 1]),
            [3.0, 1.0, 2.0, 0.5, 1.0]
        );
        assert_eq!(path_min(&[], &[]), Vec::<f32>::new());
    }
}
