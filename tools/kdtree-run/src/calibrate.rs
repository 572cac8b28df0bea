//! `--budget auto`'s cost file: where it lives (`MODEL/kdtree-cost-<device>.json`, one per device: a run-time
//! file beside the model that `kdtree-convert verify` names and accepts, `manifest::is_runtime_file`), loading
//! it with errors that name the file and the command that makes it, and `kdtree-run calibrate`, which makes
//! it by timing real DDTree rounds at every bucket on this device (the engine's `ddtree::cost` turns the
//! medians into the model: a round's whole cost, draft + tree + verify + walk, so on K2.6 the expert bytes a
//! larger tree touches are in it). Tests: below; the CLI in tests/run_cli.rs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use kdtree_engine::ddtree::cost::{buckets, CostModel};
use kdtree_engine::generate::{Mode, Sampling};
use kdtree_engine::Loaded;

use crate::args::CalibrateArgs;

/// The text calibration generates from (when the model has a tokenizer): an ordinary request, so the rounds
/// see the drafter's usual acceptance.
const PROMPT: &str = "Explain step by step how binary search finds a number in a sorted list, then write a short \
                      Python function that implements it, and test it on the list [1, 3, 5, 7, 9, 11, 13] for the \
                      numbers 7 and 8.";

/// The smallest `--budget-max` calibrate accepts: the first that measures two buckets (the smallest bucket and
/// itself), the least that separates the draft's cost from the verify's.
pub const MIN_BUDGET_MAX: u64 = 5;

/// The device part of the cost file's name: "cpu", or the backend and GPU name as a slug
/// ("cuda-nvidia-h200").
pub fn device_slug(backend: &str, device: &str) -> String {
    if backend == "cpu" {
        return "cpu".into();
    }
    let raw = format!("{backend}-{device}").to_lowercase();
    let mut slug = String::new();
    for c in raw.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c);
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    slug.trim_matches('-').to_string()
}

/// `MODEL/kdtree-cost-<slug>.json`.
pub fn cost_path(model: &Path, slug: &str) -> PathBuf {
    model.join(format!("kdtree-cost-{slug}.json"))
}

/// The `--device` flag that picks `backend` again.
fn device_flag(backend: &str) -> &'static str {
    if backend == "cpu" {
        "cpu"
    } else {
        "cuda"
    }
}

/// Largest cost file read (a real one is under 4 KiB).
const COST_FILE_LIMIT: u64 = 1 << 20;

/// The cost model of `loaded`'s device for the model in `model`; an error naming the file (and, when it is
/// missing, the calibrate command) otherwise.
pub fn load_cost(model: &Path, loaded: &Loaded) -> Result<CostModel> {
    let slug = device_slug(&loaded.backend, &loaded.device);
    let path = cost_path(model, &slug);
    // Capped: a cost file is a few KiB; a symlink to /dev/zero must fail, not hang.
    let text = match kdtree_text::files::read_capped(&path, COST_FILE_LIMIT, "cost file")
        .and_then(|b| String::from_utf8(b).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
    {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "--budget auto: {} not found: no cost model of this model on this device ({slug}); make it with \
             `kdtree-run calibrate {} --device {}`, or give a fixed --budget N",
            path.display(),
            model.display(),
            device_flag(&loaded.backend)
        ),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let cost = CostModel::from_json(&text).with_context(|| {
        format!(
            "{}: a bad cost file (recalibrate: `kdtree-run calibrate {}`)",
            path.display(),
            model.display()
        )
    })?;
    ensure!(
        cost.device == slug,
        "{}: measured on {:?}, but this run is on {slug:?}",
        path.display(),
        cost.device
    );
    Ok(cost)
}

/// One bucket's measurement: the round times (µs) and the tokens the timed rounds emitted.
struct Bucket {
    budget: usize,
    times_us: Vec<f64>,
    tokens: usize,
}

impl Bucket {
    fn median(&self) -> f64 {
        let mut t = self.times_us.clone();
        t.sort_by(f64::total_cmp);
        let n = t.len();
        if n % 2 == 1 {
            t[n / 2]
        } else {
            (t[n / 2 - 1] + t[n / 2]) / 2.0
        }
    }
}

/// `warmup` untimed then `rounds` timed DDTree rounds at `budget` from `prompt` (prefilling again, untimed,
/// whenever the context is about to run out).
fn measure(loaded: &mut Loaded, prompt: &[u32], budget: usize, warmup: usize, rounds: usize) -> Result<Bucket> {
    let mut s = loaded.session(Mode::DDTree { budget })?;
    let (block, max) = (s.block_size(), s.info().max_positions);
    ensure!(
        prompt.len() + 2 * block < max,
        "the calibration prompt ({} tokens) leaves no room for a round under max_positions {max}",
        prompt.len()
    );
    let greedy = Sampling::greedy();
    // Room for every round at once (a cache that grows midway would re-capture a GPU round inside the timing).
    s.reserve(prompt.len() + (warmup + rounds + 1) * block)?;
    s.prefill(prompt, &greedy)?;
    let mut b = Bucket {
        budget,
        times_us: Vec::with_capacity(rounds),
        tokens: 0,
    };
    for i in 0..warmup + rounds {
        if !s.can_step() || s.committed() + 2 * block >= max {
            s.prefill(prompt, &greedy)?;
        }
        let t = Instant::now();
        let e = s.step()?; // a round ends with its one read back: its wall time is the round's
        let us = t.elapsed().as_secs_f64() * 1e6;
        if i >= warmup {
            b.times_us.push(us);
            b.tokens += e.tokens.len();
        }
    }
    Ok(b)
}

/// The prompts `--prompts` lines calibrate from: at most this many (each for `--rounds` rounds a bucket).
pub const CALIBRATE_PROMPTS: usize = 8;

/// The token ids of the first [`CALIBRATE_PROMPTS`] lines of `file` that hold a prompt (as a run renders them:
/// text, chat with the template, or token ids); an error names the file (and the line) when none does.
fn file_prompts(file: &Path, model: &crate::load::Model) -> Result<Vec<Vec<u32>>> {
    let bytes = std::fs::read(file).with_context(|| format!("reading the prompts {}", file.display()))?;
    let runner = crate::runner::Runner {
        info: model.loaded.info().clone(),
        tokenizer: model.tokenizer.as_ref(),
        chat: model.chat.as_ref(),
        stop_token_ids: Vec::new(),
        defaults: crate::runner::Defaults {
            max_tokens: 1,
            sampling: Sampling::greedy(),
            mode: Mode::Ar,
            thinking: true,
        },
    };
    let mut out = Vec::new();
    for line in kdtree_text::prompts::parse_prompt_bytes(&bytes) {
        let Ok(req) = &line.request else { continue };
        let (ids, _) = runner
            .prompt_ids(req)
            .map_err(|(code, msg)| anyhow::anyhow!("{}:{}: {code}: {msg}", file.display(), line.line_no))?;
        let vocab = model.loaded.info().vocab_size;
        if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
            bail!(
                "{}:{}: token id {t} is outside the vocabulary of {vocab}",
                file.display(),
                line.line_no
            );
        }
        if !ids.is_empty() {
            out.push(ids);
        }
        if out.len() == CALIBRATE_PROMPTS {
            break;
        }
    }
    ensure!(
        !out.is_empty(),
        "{}: no line holds a prompt to calibrate from",
        file.display()
    );
    Ok(out)
}

/// [`measure`] on each prompt in turn (the warm-up on the first only), the rounds of all together.
fn measure_all(
    loaded: &mut Loaded,
    prompts: &[Vec<u32>],
    budget: usize,
    warmup: usize,
    rounds: usize,
) -> Result<Bucket> {
    let mut all = Bucket {
        budget,
        times_us: Vec::new(),
        tokens: 0,
    };
    for (i, p) in prompts.iter().enumerate() {
        let b = measure(loaded, p, budget, if i == 0 { warmup } else { 0 }, rounds)?;
        all.times_us.extend(b.times_us);
        all.tokens += b.tokens;
    }
    Ok(all)
}

/// `kdtree-run calibrate`: measure every bucket up to `--budget-max`, write the cost file, say what it holds.
pub fn run(a: &CalibrateArgs) -> Result<()> {
    let log = |m: std::fmt::Arguments| {
        if !a.quiet {
            kdtree_text::console::say(format_args!("kdtree-run calibrate: {m}"));
        }
    };
    // One bucket cannot tell the draft's share of a round from the verify's (`CostModel::from_rounds` would
    // guess 5 % of it over whatever an earlier calibration measured): refuse before loading anything.
    let measured_buckets = buckets(a.budget_max as usize);
    ensure!(
        measured_buckets.len() >= 2,
        "--budget-max {}: measures only the bucket {measured_buckets:?}, and one bucket cannot separate the \
         draft's cost from the verify's; give --budget-max {} or more (a run may still use a smaller \
         --budget-max with this cost file)",
        a.budget_max,
        MIN_BUDGET_MAX
    );
    a.weights.validate()?;
    let mut model = match a.weights.dummy() {
        true => crate::load::load_dummy(&a.model, a.device, !a.quiet, a.weights.plan())?,
        false => crate::load::load(
            &a.model,
            a.device,
            (
                !a.quiet,
                crate::args::weight_check(a.check_weights, a.no_check_weights),
                true,
            ),
            None,
        )?,
    };
    ensure!(
        model.loaded.has_drafter(),
        "{} has no drafter: --budget auto is for DDTree",
        a.model.display()
    );
    let slug = device_slug(&model.loaded.backend, &model.loaded.device);
    let path = cost_path(&a.model, &slug);
    let (prompts, source) = match &a.prompts {
        Some(file) => (
            file_prompts(file, &model)?,
            format!("the first prompts of {}", file.display()),
        ),
        None => (
            vec![match &model.tokenizer {
                Some(t) => t
                    .try_encode(PROMPT)
                    .with_context(|| "encoding the calibration prompt")?,
                None => (0..48u32)
                    .map(|i| (i * 7919 + 13) % model.loaded.info().vocab_size as u32)
                    .collect(),
            }],
            "the built-in prompt".to_string(),
        ),
    };
    let rounds = a.rounds as usize;
    log(format_args!(
        "{} on {slug}: buckets {:?}, {} warm-up + {rounds} timed rounds each, {} prompt(s) of {} tokens",
        a.model.display(),
        buckets(a.budget_max as usize),
        a.warmup,
        prompts.len(),
        prompts.iter().map(Vec::len).sum::<usize>()
    ));
    let (mut measured, mut tokens) = (Vec::new(), Vec::new());
    for budget in buckets(a.budget_max as usize) {
        let b = measure_all(&mut model.loaded, &prompts, budget, a.warmup, rounds)?;
        let (med, tpr) = (b.median(), b.tokens as f64 / b.times_us.len() as f64);
        log(format_args!(
            "budget {:>4}: {med:>10.1} µs a round (median of {rounds}), {tpr:.2} tokens a round, {:.1} tokens/s",
            b.budget,
            tpr * 1e6 / med
        ));
        measured.push((b.budget, med));
        tokens.push((b.budget, (tpr * 1e3).round() / 1e3));
    }
    // The feed round (budget 0: the AR step plus the root's taps into the drafter's context), which auto runs
    // where drafting does not pay.
    let feed = measure_all(&mut model.loaded, &prompts, 0, a.warmup, rounds)?;
    log(format_args!(
        "feed round: {:>10.1} µs a round (median of {rounds}; budget 0: no draft, one token)",
        feed.median()
    ));
    let note = format!(
        "kdtree-run calibrate: median of {} greedy rounds after {} warm-up, per bucket and for the feed round, \
         on {source} ({} prompt(s), {} tokens) of {}",
        rounds * prompts.len(),
        a.warmup,
        prompts.len(),
        prompts.iter().map(Vec::len).sum::<usize>(),
        a.model.display()
    );
    let cost = CostModel::from_rounds(&slug, &measured, note)?
        .with_feed(feed.median())?
        .with_tokens(tokens)?;
    crate::paths::write_atomic(&path, cost.to_json().as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    log(format_args!(
        "wrote {} (draft {:.1} µs, verify at {} points, feed round {:.1} µs)",
        path.display(),
        cost.draft_us,
        cost.verify.len(),
        cost.feed_us.unwrap_or(f64::NAN)
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_name_the_device() {
        assert_eq!(device_slug("cpu", "cpu"), "cpu");
        assert_eq!(device_slug("cuda", "NVIDIA H200"), "cuda-nvidia-h200");
        assert_eq!(
            device_slug("cuda", "NVIDIA GeForce RTX 5090 (D)"),
            "cuda-nvidia-geforce-rtx-5090-d"
        );
        assert_eq!(cost_path(Path::new("m"), "cpu"), Path::new("m/kdtree-cost-cpu.json"));
        // Every cost file is a run-time file `kdtree-convert verify` accepts beside the model.
        for slug in ["cpu", &device_slug("cuda", "NVIDIA GeForce RTX 5090 (D)")] {
            let p = cost_path(Path::new("m"), slug);
            let name = p.file_name().unwrap().to_str().unwrap();
            assert!(kdtree_formats::manifest::is_runtime_file(name), "{name}");
        }
    }

    #[test]
    fn min_budget_max_is_the_first_with_two_buckets() {
        assert_eq!(buckets(MIN_BUDGET_MAX as usize).len(), 2);
        assert_eq!(buckets(MIN_BUDGET_MAX as usize - 1).len(), 1);
    }

    #[test]
    fn medians() {
        let b = |t: &[f64]| {
            Bucket {
                budget: 1,
                times_us: t.to_vec(),
                tokens: 0,
            }
            .median()
        };
        assert_eq!(b(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(b(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
