//! kdtree-run: prompt file → JSONL of completions, with DDTree speculative decoding or plain AR.
//!
//! This file is the table of contents: parse flags, validate the prompt file, open (or resume) the
//! output, load the model, answer each line in order, summarise. Modules: `args` (flags), `load`
//! (model + tokenizer + template), `runner` (one line), `records` (output JSON), `resume` (output file
//! and --resume), `summary` (--summary), `verify` (--verify: re-run a golden bundle's recordings and
//! compare, per prompt right after its record). Exit: 0 ok, 1 an error record was written or --verify
//! found a mismatch, 2 error (printed once); a closed stdout/pipe ends quietly with 0. Tests: unit tests
//! per module, tests/run_cli.rs, tests/verify_cli.rs.

mod args;
mod load;
mod records;
mod resume;
mod runner;
mod summary;
mod verify;

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Parser;
use kdtree_engine::generate::{Mode, Sampling};
use kdtree_golden::bundle::{Bundle, PromptRecord};

use crate::args::{Args, DeviceArg, ModeArg};
use crate::runner::{Defaults, Runner};
use crate::summary::{RunInfo, Totals};

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kdtree-run: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A write to a closed pipe anywhere in the chain (`kdtree-run ... --out - | head`).
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
}

/// Answer every prompt line; Ok(true) when every record is a success.
fn run(args: Args) -> Result<bool> {
    let t0 = Instant::now();
    args.validate()?;
    let lines = kdtree_text::prompts::read_prompt_file(&args.prompts)?;
    // --verify: the bundle, its prompt ids and every prompt file's sha256 are checked before any work.
    let (bundle, golden) = match &args.verify {
        Some(dir) => {
            let b = Bundle::open(dir)?;
            verify::check_ids(&lines, &b, &args.prompts)?;
            let recs: HashMap<String, PromptRecord> = b.load_all()?.into_iter().collect();
            (Some(b), recs)
        }
        None => (None, HashMap::new()),
    };
    let ids: Vec<&str> = lines.iter().map(|l| l.id.as_str()).collect();
    let existing = resume::read_existing(&args.out, args.resume, &ids)?;
    let mut totals = Totals::default();
    existing.records.iter().for_each(|r| totals.add(r, true));
    let done = existing.records.len();
    let say = |msg: String| {
        if !args.quiet {
            eprintln!("kdtree-run: {msg}");
        }
    };
    if args.resume {
        let torn = if existing.torn { "; a torn last line was cut" } else { "" };
        say(format!("resuming: {done} of {} lines already done{torn}", lines.len()));
    }
    let mode = match args.mode {
        ModeArg::Ar => Mode::Ar,
        ModeArg::Ddtree => Mode::DDTree { budget: args.budget },
    };
    let mut backend = String::from("none (nothing left to run)");
    // Load before touching the output, so a model that fails to load leaves it as it was.
    let need_model = done < lines.len() || bundle.is_some();
    if bundle.is_some() && args.device == DeviceArg::Cuda {
        verify::tolerances("cuda")?; // refused before anything loads while unmeasured
    }
    let model = if need_model { Some(load::load(&args.model, args.device)?) } else { None };
    let mut checks = Vec::new();
    if matches!(mode, Mode::DDTree { .. }) && model.as_ref().is_some_and(|m| !m.loaded.has_drafter()) {
        bail!("{} has no drafter; DDTree needs one (use --mode ar)", args.model.display());
    }
    let mut sink = resume::open_output(&args.out, &existing)?;
    if let Some(mut model) = model {
        backend = model.loaded.backend.clone();
        say(format!("backend: {backend}"));
        let tol = match &bundle {
            Some(b) => {
                let tol = verify::tolerances(&backend)?;
                let sha = kdtree_golden::bundle::sha256_hex(&std::fs::read(args.model.join("manifest.toml"))?);
                if let Some(w) = verify::check_model(b, &model.loaded, &sha)? {
                    eprintln!("kdtree-run: verify: warning: {w}");
                }
                Some(tol)
            }
            None => None,
        };
        // Pass 1: answer the lines (one session for the whole run). Under --verify keep what pass 2 needs.
        let mut to_verify = Vec::new();
        {
            let mut runner = Runner {
                session: model.loaded.session(mode)?,
                tokenizer: model.tokenizer.as_ref(),
                chat: model.chat.as_ref(),
                stop_token_ids: model.stop_token_ids.clone(),
                defaults: Defaults {
                    max_tokens: args.max_tokens as usize,
                    sampling: Sampling { temperature: args.temperature, top_p: args.top_p, top_k: args.top_k, seed: args.seed },
                    mode,
                    thinking: args.thinking,
                },
            };
            for (i, line) in lines.iter().enumerate() {
                let outcome = if i >= done {
                    let outcome = runner.run_line(line);
                    let record = records::record(line, &outcome, &model.name);
                    sink.write_record(&record)?;
                    totals.add(&record, false);
                    say(progress(i + 1, lines.len(), &line.id, &outcome));
                    Some(outcome)
                } else {
                    None
                };
                if bundle.is_none() {
                    continue;
                }
                let prompt = match &line.request {
                    Err(e) => Err(format!("the line is invalid: {e}")),
                    Ok(req) => runner.prompt_ids(req).map(|(ids, _)| ids).map_err(|(code, msg)| format!("{code}: {msg}")),
                };
                let greedy = match &outcome {
                    Some(records::Outcome::Done(c)) if c.sampling.temperature <= 0.0 => Some(c.token_ids.clone()),
                    _ => None,
                };
                to_verify.push((line.id.clone(), prompt, greedy));
            }
        }
        // Pass 2 (--verify): re-run what the bundle recorded, on the same model, and compare.
        if let Some(tol) = tol {
            for (id, prompt, greedy) in to_verify {
                let run = match &greedy {
                    Some(t) => verify::RunTokens::Greedy(t),
                    None => verify::RunTokens::NotCompared,
                };
                checks.push(verify::check_prompt(&id, &mut model.loaded, prompt, run, &golden[&id], &tol)?);
            }
        }
    }
    let verified = match &bundle {
        None => true,
        Some(b) => {
            let good = checks.iter().filter(|c| c.ok()).count();
            eprint!("kdtree-run: verify against {} (backend {backend}):\n{}", b.dir.display(), verify::table(&checks));
            eprintln!("kdtree-run: verify: {good} of {} prompts match", checks.len());
            good == checks.len()
        }
    };
    if let Some(path) = &args.summary {
        let info = RunInfo {
            model: &args.model,
            backend: &backend,
            mode: match mode { Mode::Ar => "ar", Mode::DDTree { .. } => "ddtree" },
            budget: match mode { Mode::Ar => None, Mode::DDTree { budget } => Some(budget) },
            wall_s: t0.elapsed().as_secs_f64(),
        };
        summary::write_summary(path, &totals, &info)?;
    }
    say(format!("{} lines: {} ok, {} errors, {:.1}s", totals.lines, totals.ok, totals.errors, t0.elapsed().as_secs_f64()));
    Ok(totals.errors == 0 && verified)
}

/// One stderr progress line.
fn progress(n: usize, total: usize, id: &str, outcome: &records::Outcome) -> String {
    match outcome {
        records::Outcome::Done(c) => format!(
            "[{n}/{total}] {id}: {} tokens ({}), {:.1} tok/s",
            c.token_ids.len(),
            c.finish_reason,
            c.timing.decode_tok_s
        ),
        records::Outcome::Failed { code, message } => format!("[{n}/{total}] {id}: error {code}: {message}"),
    }
}
