//! kdtree-golden: write CPU reference bundles for a converted model (+ drafter).
//!
//! For each prompt: the greedy AR continuation with top-k logits of every step and full logits of the
//! first steps; the per-layer tensors of one single-token decode forward (CpuTarget's trace hook); and
//! one DDTree round right after the prompt (draft logits, tree, visibility, verify logits, accepted path,
//! bonus). Output: one safetensors file per prompt + index.json (see src/bundle.rs for the layout).
//! Output bytes depend only on the model and the options, not on paths or thread counts
//! (tests/determinism.rs runs it with RAYON_NUM_THREADS=1 and =2 and compares bytes).
//! The work is `kdtree_golden::make::make_bundle` (src/make.rs); this file is its command line.
//! Exit: 0 written, 2 error (printed once, each cause once; never a panic on a closed stderr). The
//! output directory is checked before any work (`check_out`): it must not be a file, and no bundle file
//! may overwrite an input.
//! Tests: tests/determinism.rs, tests/cli.rs (exit codes, messages, closed stderr).

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use kdtree_golden::bundle::{file_name_for, INDEX_FILE};
use kdtree_golden::make::{make_bundle_on, Options};
use kdtree_text::console;
use kdtree_text::files::Inputs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Write CPU reference bundles (tokens, logits, per-layer tensors, one DDTree round) for checking other engines.
#[derive(Parser, Debug)]
#[command(name = "kdtree-golden", version)]
struct Args {
    /// Converted model directory (kdtree-convert repack output, with its drafter for the DDTree round).
    model: PathBuf,
    /// Prompt JSONL: {"id", "prompt_token_ids": [...]}, {"id", "prompt": "..."} or {"id", "messages": [...]}.
    #[arg(long)]
    prompts: PathBuf,
    /// Output directory (created; existing bundle files are overwritten). With --score: the report file
    /// (JSON, written through a temp file renamed into place; "-" = stdout).
    #[arg(long)]
    out: PathBuf,
    /// Score other engines' tokens instead of writing a bundle: kdtree-run records (JSONL) or bundles recorded
    /// on another device, teacher-forced through the CPU reference (each generated token's gap: the CPU's
    /// largest logit minus its logit of that token; with a bundle's full logits also their max |Δ|).
    #[arg(long, value_name = "RUN", num_args = 1..)]
    score: Vec<PathBuf>,
    /// With --score: exit 1 when any gap exceeds this many logits.
    #[arg(long, value_name = "LOGITS", requires = "score")]
    bound: Option<f32>,
    /// With --bound: accept a larger gap, up to GAP, only where the CPU router's decision margin at that token
    /// is below MARGIN (a route flip at a router near-tie); both measured (see the README). Later positions of a
    /// record with an accepted flip are reported, not judged (the run's cache holds the flipped rows).
    #[arg(long, value_name = "MARGIN,GAP", requires = "bound", value_parser = parse_flip)]
    route_flip: Option<(f32, f32)>,
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
    /// Backend that records: the CPU reference (the default, what golden/ holds), or a CUDA build's GPU
    /// (a bundle to compare with the CPU's: `kdtree-run --verify` on the CPU then reports their |Δ|).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

fn main() -> ExitCode {
    let a = Args::parse();
    if !a.score.is_empty() {
        return match score(&a) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) if console::is_broken_pipe(&e) => ExitCode::SUCCESS,
            Err(e) => {
                console::say(format_args!("kdtree-golden: error: {}", console::error_chain(&e)));
                ExitCode::from(2)
            }
        };
    }
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            console::say(format_args!("kdtree-golden: error: {}", console::error_chain(&e)));
            ExitCode::from(2)
        }
    }
}

/// Write the bundle the flags describe.
fn run(a: Args) -> Result<()> {
    check_out(&a)?;
    let opts = Options {
        max_tokens: a.max_tokens,
        budget: a.budget,
        full_logits_steps: a.full_logits_steps,
        topk: a.topk,
        trace_step: a.trace_step,
        no_ddtree: a.no_ddtree,
        quiet: a.quiet,
    };
    let device = match a.device {
        DeviceArg::Cpu => kdtree_engine::Device::Cpu,
        DeviceArg::Cuda => kdtree_engine::Device::Cuda,
    };
    make_bundle_on(&a.model, &a.prompts, &a.out, &opts, device)?;
    Ok(())
}

/// `--score`: the report, written whole (temp file, then rename) or to stdout; Ok(false) when a gap exceeds
/// `--bound`.
fn score(a: &Args) -> Result<bool> {
    ensure!(
        a.device == DeviceArg::Cpu,
        "--score runs the CPU reference (leave out --device)"
    );
    ensure!(
        a.bound.is_none_or(|b| b.is_finite() && b >= 0.0),
        "--bound must be a finite number >= 0"
    );
    let r = kdtree_golden::score::score(&a.model, &a.prompts, &a.score, a.bound, a.route_flip, !a.quiet)?;
    let mut text = serde_json::to_string_pretty(&r)?;
    text.push('\n');
    if a.out.as_os_str() == "-" {
        use std::io::Write;
        std::io::stdout()
            .lock()
            .write_all(text.as_bytes())
            .context("writing the report to stdout")?;
    } else {
        let tmp = a.out.with_extension("json.partial");
        std::fs::write(&tmp, &text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &a.out).with_context(|| format!("renaming {} to {}", tmp.display(), a.out.display()))?;
    }
    let at = r
        .max_gap_at
        .as_ref()
        .map(|(f, id, j)| format!(" at {f} {id} position {j}"))
        .unwrap_or_default();
    console::say(format_args!(
        "kdtree-golden: scored {} sequences ({} tokens): max gap {:.4}{at}{}{}{}{}",
        r.sequences,
        r.tokens,
        r.max_gap,
        r.max_abs_delta.map(|d| format!(", max |Δ| {d:.4}")).unwrap_or_default(),
        a.bound
            .map(|b| format!(", {} positions over the bound {b}", r.over_bound))
            .unwrap_or_default(),
        if r.route_flips.is_empty() {
            String::new()
        } else {
            format!(
                " (+{} accepted as route flips: {:?}{})",
                r.route_flips.len(),
                r.route_flips,
                if r.after_flip.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; {} over the bound after a flip, not judged: {:?}",
                        r.after_flip.len(),
                        r.after_flip
                    )
                }
            )
        },
        if r.sampled_positions > 0 {
            format!(
                "; sampled positions: the CPU samples another token at {} of {}",
                r.sampled_disagree, r.sampled_positions
            )
        } else {
            String::new()
        }
    ));
    Ok(r.over_bound == 0)
}

/// `--route-flip MARGIN,GAP`: two finite numbers >= 0.
fn parse_flip(s: &str) -> std::result::Result<(f32, f32), String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?}: expected MARGIN,GAP (e.g. 2e-4,4.0)"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<f32>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("{x:?} is not a finite number >= 0"))
    };
    Ok((num(a)?, num(b)?))
}

/// Before any work: `--out` must be (or be creatable as) a directory, and none of the files the bundle
/// will write there (index.json, one file per prompt) may be an input: the prompt file or a file of the
/// model directory, judged by file identity (kdtree_text::files), not by spelling.
fn check_out(a: &Args) -> Result<()> {
    match std::fs::metadata(&a.out) {
        Ok(m) if !m.is_dir() => bail!("--out {} exists and is not a directory", a.out.display()),
        Ok(_) => {}
        Err(_) => {
            let parent = a
                .out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            if !parent.is_dir() {
                bail!(
                    "--out {}: directory {} does not exist",
                    a.out.display(),
                    parent.display()
                );
            }
            return Ok(());
        }
    }
    let mut inputs = Inputs::default();
    inputs.file(&a.prompts);
    inputs.dir(&a.model, 2);
    // The prompt file is read again (and checked line by line) by make_bundle; here only its ids matter.
    let lines = kdtree_text::prompts::read_prompt_file(&a.prompts)?;
    let names = lines
        .iter()
        .enumerate()
        .map(|(i, l)| file_name_for(&l.id, i))
        .chain([INDEX_FILE.to_string()]);
    for name in names {
        let path = a.out.join(&name);
        if let Some(input) = std::fs::metadata(&path).ok().as_ref().and_then(|m| inputs.find(m)) {
            bail!(
                "--out {}: the bundle would overwrite {} with {name}: refusing to write over an input",
                a.out.display(),
                input.display()
            );
        }
    }
    Ok(())
}
