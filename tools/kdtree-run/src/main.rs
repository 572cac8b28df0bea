//! kdtree-run: prompt file → JSONL of completions, with DDTree speculative decoding or plain AR.
//!
//! This file is the table of contents. [`prepare`] runs every check that can fail early and writes
//! nothing: flags, output paths against the inputs (paths.rs), the prompt file, the --verify bundle,
//! --resume's records and their fingerprints, the model and its drafter. Only then is the output opened,
//! [`answer`] answers the lines in order, [`report_verify`] prints --verify's table and the summary is
//! written. `kdtree-run calibrate MODEL` ([`calibrate::run`]) instead measures the cost file `--budget
//! auto` reads. Modules: `args` (flags), `calibrate` (the cost file), `paths` (output checks), `load`
//! (model, tokenizer, template), `runner` (one line), `records` (output JSON), `fingerprint` (what made a record),
//! `resume` (output file and --resume), `summary` (--summary), `verify` (--verify). Exit: 0 ok, 1 an error record was
//! written or --verify found a mismatch, 2 error (printed once, each cause once); a closed stdout ends
//! quietly with 0; a closed stderr loses messages, never the run. Tests: unit tests per module,
//! tests/run_cli.rs, tests/hardening.rs, tests/verify_cli.rs, tests/openai_types.rs, tests/auto_cli.rs.

mod args;
mod calibrate;
mod fingerprint;
mod load;
mod paths;
mod records;
mod resume;
mod runner;
mod summary;
mod verify;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use kdtree_engine::generate::{Job as GenJob, Mode};
use kdtree_engine::WeightCheck;
use kdtree_golden::bundle::{Bundle, PromptRecord};
use kdtree_text::console;
use kdtree_text::prompts::PromptLine;

use crate::args::{Args, CalibrateArgs};
use crate::load::Model;
use crate::resume::{Existing, Expected, Sink};
use crate::runner::{Defaults, Runner};
use crate::summary::{RunInfo, Totals};

fn main() -> ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let result = if argv.get(1).is_some_and(|a| a == "calibrate") {
        let rest = argv[2..].iter().cloned();
        calibrate::run(&CalibrateArgs::parse_from(
            std::iter::once("kdtree-run calibrate".into()).chain(rest),
        ))
        .map(|()| true)
    } else {
        run(Args::parse_from(argv))
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) if console::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<verify::CheckFailed>().is_some() => {
            console::say(format_args!("kdtree-run: verify: {e}"));
            ExitCode::from(1)
        }
        Err(e) => {
            console::say(format_args!("kdtree-run: error: {}", console::error_chain(&e)));
            ExitCode::from(2)
        }
    }
}

/// Answer every prompt line; Ok(true) when every record is a success and --verify matched.
fn run(args: Args) -> Result<bool> {
    let t0 = Instant::now();
    if load::may_run_groups(&args.model, args.device, args.gpus, args.share_gpu) {
        // Rank groups on their own streams meet inside their kernels: more hardware queues than streams (no
        // group's kernel queued behind another's), and every kernel loaded up front (a lazy load synchronises
        // the device). Both are read when CUDA starts, so they are set before anything touches it.
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
        }
        std::env::set_var("CUDA_MODULE_LOADING", "EAGER");
    }
    let mut job = prepare(&args)?;
    let mut sink = resume::open_output(&args.out, &job.existing)?;
    let Answered { checks, gen_s, split } = answer(&args, &mut job, &mut sink)?;
    drop(sink);
    let verified = report_verify(&job, &checks);
    if let Some(path) = &args.summary {
        let info = RunInfo {
            model: &args.model,
            backend: &job.backend,
            mode: job.defaults.mode,
            wall_s: t0.elapsed().as_secs_f64(),
            gen_s,
            max_batch: args.max_batch as usize,
            dummy: job.dummy.as_ref(),
            time_split: split.as_ref(),
        };
        summary::write_summary(path, &job.totals, &info)?;
    }
    let t = &job.totals;
    log(
        &args,
        format_args!(
            "{} lines: {} ok, {} errors, {:.1}s",
            t.lines,
            t.ok,
            t.errors,
            t0.elapsed().as_secs_f64()
        ),
    );
    Ok(t.errors == 0 && verified)
}

/// The numbers of a list for people: "4, 8, 16".
fn join(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// A progress line on stderr (none with --quiet).
fn log(args: &Args, msg: std::fmt::Arguments) {
    if !args.quiet {
        console::say(format_args!("kdtree-run: {msg}"));
    }
}

/// What [`prepare`] established.
struct Job {
    lines: Vec<PromptLine>,
    /// This run's fingerprint of each line (records carry it; --resume compares it).
    fingerprints: Vec<String>,
    existing: Existing,
    defaults: Defaults,
    /// None when every line is already answered (nothing to load).
    model: Option<Model>,
    backend: String,
    golden: Option<Golden>,
    /// Over the kept records so far; [`answer`] adds the new ones.
    totals: Totals,
    /// `--budget auto`: the cost model of this model on this device (calibrate.rs).
    cost: Option<kdtree_engine::ddtree::CostModel>,
    /// `--load-format dummy`: `{"seed", "rank", "ranks"}`, put in every record and the summary.
    dummy: Option<serde_json::Value>,
    /// The lock on `--out`, held until the run ends (paths::lock_out).
    _lock: Option<kdtree_text::lock::Lock>,
}

/// --verify's bundle, its records by prompt id, and the backend's logit tolerance.
struct Golden {
    bundle: Bundle,
    records: HashMap<String, PromptRecord>,
    tol: verify::Tolerances,
}

/// Every check that can fail before a byte is written, cheapest first: flags; outputs are not inputs and
/// can be written; the lock on --out (held until the run ends); the prompt file; the --verify bundle;
/// --resume's records (ids in order, fingerprints); the model, its drafter for DDTree, `--budget auto`'s cost
/// file for its device, and (--verify) its fit to the bundle.
fn prepare(args: &Args) -> Result<Job> {
    args.validate()?;
    paths::check(args)?;
    let lock = paths::lock_out(&args.out)?;
    let lines = kdtree_text::prompts::read_prompt_file(&args.prompts)?;
    let bundle = open_bundle(args, &lines)?;
    let defaults = args.defaults();
    let model_hash = match args.dummy() {
        true => fingerprint::dummy_model(
            &args.model,
            args.weights.ranks,
            args.weights.rank,
            args.weights.dummy_seed,
        )?,
        false => fingerprint::with_weights(
            &fingerprint::model_files(&args.model)?,
            &fingerprint::weights(
                &args.model,
                args.weight_check() != WeightCheck::Off,
                args.loads_drafter(),
            )?,
        ),
    };
    let name = records::model_name(&args.model);
    let fingerprints: Vec<String> = lines
        .iter()
        .map(|l| fingerprint::line(l, &defaults, &model_hash, &name))
        .collect();
    let existing = read_existing(args, &lines, &fingerprints)?;
    let mut totals = Totals::default();
    let kept: Vec<&serde_json::Value> = (0..lines.len())
        .filter_map(|i| existing.kept(i).map(|(r, _)| r))
        .collect();
    kept.iter().for_each(|r| totals.add(r, true));
    let need_model = kept.len() < lines.len() || bundle.is_some();
    let model = if need_model {
        Some(open_model(args, &defaults, bundle.as_ref())?)
    } else {
        None
    };
    let backend = model
        .as_ref()
        .map_or("none (nothing left to run)".into(), |m| m.loaded.backend.clone());
    let cost = match (&model, defaults.mode) {
        (Some(m), Mode::DDTreeAuto { max }) => {
            let cost = calibrate::load_cost(&args.model, &m.loaded)?;
            let buckets = kdtree_engine::ddtree::cost::buckets(max);
            log(
                args,
                format_args!(
                    "--budget auto: buckets {}, cost model of {} ({})",
                    join(&buckets),
                    cost.device,
                    cost.note
                ),
            );
            Some(cost)
        }
        _ => None,
    };
    let golden = match bundle {
        Some((bundle, records)) => Some(Golden {
            tol: verify::tolerances(&backend)?,
            bundle,
            records,
        }),
        None => None,
    };
    let dummy = args.dummy().then(
        || serde_json::json!({"seed": args.weights.dummy_seed, "rank": args.weights.rank, "ranks": args.weights.ranks}),
    );
    Ok(Job {
        lines,
        fingerprints,
        existing,
        defaults,
        model,
        backend,
        golden,
        totals,
        cost,
        dummy,
        _lock: lock,
    })
}

/// --resume: the records already in --out, checked against the prompt file's ids and this run's
/// fingerprints (resume.rs); says what is kept and what is answered again.
fn read_existing(args: &Args, lines: &[PromptLine], fingerprints: &[String]) -> Result<Existing> {
    let expected: Vec<Expected> = lines
        .iter()
        .zip(fingerprints)
        .map(|(l, f)| Expected {
            id: &l.id,
            fingerprint: f,
        })
        .collect();
    let existing = resume::read_existing(&args.out, args.resume, &expected)?;
    if args.resume {
        let stale = existing.stale();
        if let Some(l) = stale.first().map(|&i| &lines[i]) {
            log(
                args,
                format_args!(
                    "resuming: {} records answer a line whose text or settings (or the model) changed since they \
                     were written (first: line {}, id \"{}\"); answering them again",
                    stale.len(),
                    l.line_no,
                    l.id
                ),
            );
        }
        let kept = (0..lines.len()).filter(|&i| existing.kept(i).is_some()).count();
        let torn = if existing.torn {
            "; a torn last line was cut"
        } else {
            ""
        };
        log(
            args,
            format_args!("resuming: {kept} of {} lines already done{torn}", lines.len()),
        );
    }
    Ok(existing)
}

/// --verify: the bundle, its prompt ids (and every prompt file's sha256) checked against the prompt
/// file, its records loaded.
fn open_bundle(args: &Args, lines: &[PromptLine]) -> Result<Option<(Bundle, HashMap<String, PromptRecord>)>> {
    let Some(dir) = &args.verify else { return Ok(None) };
    let b = Bundle::open(dir)?;
    verify::check_ids(lines, &b, &args.prompts)?;
    let recs = b.load_all()?.into_iter().collect();
    Ok(Some((b, recs)))
}

/// Load the model; refuse DDTree without a drafter (asked of the manifest before the weights load,
/// and of the loaded model) and (--verify) a model that is not the bundle's: another architecture (exit 2) or,
/// when the manifest differs, a first step that is not the bundle's (verify::first_step: exit 1 at once).
fn open_model(args: &Args, d: &Defaults, bundle: Option<&(Bundle, HashMap<String, PromptRecord>)>) -> Result<Model> {
    let no_drafter = || {
        anyhow::anyhow!(
            "{} has no drafter; --mode {} needs one (use --mode ar)",
            args.model.display(),
            args.mode.name()
        )
    };
    let ddtree = d.mode.drafts();
    let mut model = if args.dummy() {
        if ddtree && !args.model.join("drafter/config.json").exists() {
            return Err(anyhow::anyhow!(
                "{} has no drafter/config.json; --mode {} needs one (use --mode ar)",
                args.model.display(),
                args.mode.name()
            ));
        }
        anyhow::ensure!(
            args.gpus.is_none_or(|n| n == 1) && !args.share_gpu,
            "--gpus / --share-gpu: dummy weights load one rank slice (--rank); use a converted model"
        );
        load::load_dummy(&args.model, args.device, !args.quiet, args.weights.plan())?
    } else {
        let dir = kdtree_formats::ModelDir::open(&args.model)
            .with_context(|| format!("opening model {}", args.model.display()))?;
        if ddtree && dir.drafter_config().is_none() {
            return Err(no_drafter());
        }
        drop(dir);
        let place = load::placement(&args.model, args.device, args.gpus, args.share_gpu)?;
        if let Some((n, p)) = &place {
            log(
                args,
                format_args!("tensor parallel: {n} rank groups, {}", load::describe_placement(p)),
            );
        }
        load::load(
            &args.model,
            args.device,
            (!args.quiet, args.weight_check(), args.loads_drafter()),
            place,
        )?
    };
    if ddtree && !model.loaded.has_drafter() {
        return Err(no_drafter());
    }
    log(args, format_args!("backend: {}", model.loaded.backend));
    if let Some((b, recs)) = bundle {
        let sha = kdtree_formats::manifest::manifest_sha256(&args.model)?;
        if let Some(w) = verify::check_model(b, &model.loaded, &sha)? {
            // Another model or another conversion: its first step decides now, before the generation.
            let tol = verify::tolerances(&model.loaded.backend)?;
            if let Some(rec) = b.index.prompts.first().and_then(|e| recs.get_key_value(&e.id)) {
                let rec = (rec.0.as_str(), rec.1);
                verify::first_step(b, rec, &mut model.loaded, &tol, &sha)?;
            }
            console::say(format_args!("kdtree-run: verify: warning: {w}"));
        }
    }
    Ok(model)
}

/// Answer the lines into `sink` in input order, up to `--max-batch` sequences in flight on one batch
/// (engine::generate::generate_batch: a finished sequence's slot is refilled from the file at once): records
/// kept by --resume stay or are copied, lines that fail before generation get their error record, the rest
/// generate. A finished record waits until every line before it is written (at most --max-batch are held).
/// Then, under --verify, each line is re-checked against its bundle record on the same model
/// (kdtree_golden::reference's sessions: the recording code itself).
/// What [`answer`] gives: the lines to re-check (`--verify`), the generation's wall seconds, and where they went
/// (summary::time_split; None without a model).
struct Answered {
    checks: Vec<verify::PromptCheck>,
    gen_s: f64,
    split: Option<serde_json::Value>,
}

fn answer(args: &Args, job: &mut Job, sink: &mut Sink) -> Result<Answered> {
    let t_gen = Instant::now();
    let Some(model) = job.model.as_mut() else {
        return Ok(Answered {
            checks: Vec::new(),
            gen_s: 0.0,
            split: None,
        });
    };
    let graphs0 = model.loaded.target.graph_stats();
    let runner = Runner {
        info: model.loaded.info().clone(),
        tokenizer: model.tokenizer.as_ref(),
        chat: model.chat.as_ref(),
        stop_token_ids: model.stop_token_ids.clone(),
        defaults: job.defaults.clone(),
    };
    // No more slots than lines left to generate (each slot is a forked session).
    let to_run = (0..job.lines.len()).filter(|&i| job.existing.kept(i).is_none()).count();
    let slots = (args.max_batch as usize).min(to_run.max(1));
    let kv_cap = args.kv_memory.map(|g| (g * (1u64 << 30) as f64) as usize);
    let mut batch = model.loaded.batch(job.defaults.mode, slots, kv_cap)?;
    if let Some(cost) = &job.cost {
        for i in 0..batch.len() {
            batch.session(i).set_cost_model(cost.clone())?;
        }
    }
    if args.max_batch > 1 {
        let kv = batch.kv_budget().bytes.map_or("not limited".into(), |b| {
            format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
        });
        log(
            args,
            format_args!("batch: up to {slots} sequences in flight; KV memory {kv}"),
        );
    }
    let state = RefCell::new(Answering {
        next_line: 0,
        ready: BTreeMap::new(),
        next_write: 0,
        prepared: HashMap::new(),
        to_verify: Vec::new(),
        sink,
        quiet: args.quiet,
        error: None,
    });
    let (lines, existing, fingerprints) = (&job.lines, &job.existing, &job.fingerprints);
    let (golden, dummy, name) = (job.golden.is_some(), &job.dummy, &model.name);
    let totals = RefCell::new(&mut job.totals);
    // A line's record, ready to write in order.
    let finish = |st: &mut Answering<'_>, i: usize, outcome: records::Outcome| -> Result<()> {
        let line = &lines[i];
        let mut record = records::record(line, &outcome, name, &fingerprints[i]);
        if let Some(w) = dummy {
            // Before `timing` (kept last): the tokens of dummy weights are noise.
            let timing = record.as_object_mut().and_then(|o| o.remove("timing"));
            record["load_format"] = "dummy".into();
            record["dummy"] = w.clone();
            if let Some(t) = timing {
                record["timing"] = t;
            }
        }
        totals.borrow_mut().add(&record, false);
        st.ready
            .insert(i, Ready::Record(Box::new(record), Some(Box::new(outcome))));
        st.flush(lines, &runner, golden)
    };
    // The next line to generate, in order; kept and failing lines are settled on the way.
    let mut next = || -> Option<(usize, GenJob<'_>)> {
        let mut st = state.borrow_mut();
        while st.next_line < lines.len() {
            let i = st.next_line;
            st.next_line += 1;
            let settled = match existing.kept(i) {
                Some(_) if i < existing.prefix => Ok(Ready::Kept),
                Some((_, bytes)) => Ok(Ready::Copy(bytes.to_vec())),
                None => match runner.prepare_line(&lines[i]) {
                    Err(outcome) => Err(outcome),
                    Ok(p) => {
                        let on_tokens = Box::new(runner.on_tokens(&p));
                        let req = p.req.clone();
                        st.prepared.insert(i, p);
                        return Some((i, GenJob { req, on_tokens }));
                    }
                },
            };
            let r = match settled {
                Ok(ready) => {
                    st.ready.insert(i, ready);
                    st.flush(lines, &runner, golden)
                }
                Err(outcome) => finish(&mut st, i, *outcome),
            };
            if let Err(e) = r {
                st.error = Some(e);
                return None;
            }
        }
        None
    };
    let mut done = |i: usize, out: anyhow::Result<kdtree_engine::generate::GenOutput>| -> Result<()> {
        let mut st = state.borrow_mut();
        let p = st
            .prepared
            .remove(&i)
            .context("a finished line that was never started")?;
        let outcome = runner.finish(p, out);
        finish(&mut st, i, outcome)
    };
    kdtree_engine::generate::generate_batch(&mut batch, &mut next, &mut done)?;
    let mut st = state.into_inner();
    if let Some(e) = st.error.take() {
        return Err(e);
    }
    anyhow::ensure!(
        st.next_write == lines.len(),
        "{} of {} lines written",
        st.next_write,
        lines.len()
    );
    let to_verify = std::mem::take(&mut st.to_verify);
    drop(st);
    let times = batch.times;
    drop(batch);
    let gen_s = t_gen.elapsed().as_secs_f64();
    let graphs = match (graphs0, model.loaded.target.graph_stats()) {
        (Some(a), Some(b)) => Some(kdtree_engine::api::GraphStats {
            captures: b.captures.saturating_sub(a.captures),
            capture_s: (b.capture_s - a.capture_s).max(0.0),
            launches: b.launches.saturating_sub(a.launches),
        }),
        _ => None,
    };
    let split = summary::time_split(&times, graphs, gen_s);
    log(args, format_args!("{}", summary::time_split_line(&split)));
    let Some(g) = &job.golden else {
        return Ok(Answered {
            checks: Vec::new(),
            gen_s,
            split: Some(split),
        });
    };
    let mut checks = Vec::new();
    for (id, prompt, greedy) in to_verify {
        let run = match &greedy {
            Some(t) => verify::RunTokens::Greedy(t),
            None => verify::RunTokens::NotCompared,
        };
        checks.push(verify::check_prompt(
            &id,
            &mut model.loaded,
            prompt,
            run,
            &g.records[&id],
            &g.tol,
        )?);
    }
    Ok(Answered {
        checks,
        gen_s,
        split: Some(split),
    })
}

/// A line's settled output, waiting for its turn.
enum Ready {
    /// Kept by --resume inside the file's intact prefix: nothing to write.
    Kept,
    /// Kept by --resume after a line answered again: its bytes are copied.
    Copy(Vec<u8>),
    /// A new record (and its outcome, for --verify).
    Record(Box<serde_json::Value>, Option<Box<records::Outcome>>),
}

/// A line to re-check under --verify: its id, its prompt ids (or why it has none), its greedy tokens.
type VerifyLine = (String, std::result::Result<Vec<u32>, String>, Option<Vec<u32>>);

/// The in-order writer's state of [`answer`].
struct Answering<'s> {
    next_line: usize,
    ready: BTreeMap<usize, Ready>,
    next_write: usize,
    prepared: HashMap<usize, runner::Prepared>,
    to_verify: Vec<VerifyLine>,
    sink: &'s mut Sink,
    /// No progress lines (`--quiet`).
    quiet: bool,
    /// A write that failed while settling lines (the run stops with it).
    error: Option<anyhow::Error>,
}

impl Answering<'_> {
    /// Write every ready line whose predecessors are written, in order; a new record's progress line says how
    /// many lines of the file are written with it (`[n/total]`: the n-th line, kept ones included).
    fn flush(&mut self, lines: &[PromptLine], runner: &Runner<'_>, golden: bool) -> Result<()> {
        while let Some(r) = self.ready.remove(&self.next_write) {
            let i = self.next_write;
            let outcome = match r {
                Ready::Kept => None,
                Ready::Copy(bytes) => {
                    self.sink.write_line(&bytes)?;
                    None
                }
                Ready::Record(record, outcome) => {
                    self.sink.write_record(&record)?;
                    if let (false, Some(o)) = (self.quiet, &outcome) {
                        let n = self.next_write + 1;
                        let p = progress(n, lines.len(), &lines[i].id, o);
                        console::say(format_args!("kdtree-run: {p}"));
                    }
                    outcome
                }
            };
            self.next_write += 1;
            if !golden {
                continue;
            }
            let line = &lines[i];
            let prompt = match &line.request {
                Err(e) => Err(format!("the line is invalid: {e}")),
                Ok(req) => runner
                    .prompt_ids(req)
                    .map(|(ids, _)| ids)
                    .map_err(|(code, msg)| format!("{code}: {msg}")),
            };
            let greedy = match outcome.as_deref() {
                Some(records::Outcome::Done(c)) if c.sampling.temperature <= 0.0 => Some(c.token_ids.clone()),
                _ => None,
            };
            self.to_verify.push((line.id.clone(), prompt, greedy));
        }
        Ok(())
    }
}

/// --verify's per-prompt table and verdict on stderr (printed with --quiet too); true when all match.
fn report_verify(job: &Job, checks: &[verify::PromptCheck]) -> bool {
    let Some(g) = &job.golden else { return true };
    let good = checks.iter().filter(|c| c.ok()).count();
    let table = verify::table(checks);
    console::say(format_args!(
        "kdtree-run: verify against {} (backend {}):\n{}",
        g.bundle.dir.display(),
        job.backend,
        table.trim_end()
    ));
    console::say(format_args!(
        "kdtree-run: verify: {good} of {} prompts match",
        checks.len()
    ));
    good == checks.len()
}

/// One stderr progress line: the line just written. A decode rate needs two tokens (the first comes from
/// the prefill): a one-token line says `n/a` rather than 0.0 tok/s.
fn progress(n: usize, total: usize, id: &str, outcome: &records::Outcome) -> String {
    match outcome {
        records::Outcome::Done(c) => {
            let k = c.token_ids.len();
            let rate = match k {
                0 | 1 => "decode n/a (one token, from the prefill)".to_string(),
                _ => format!("{:.1} tok/s", c.timing.decode_tok_s),
            };
            let s = if k == 1 { "" } else { "s" };
            format!("[{n}/{total}] {id}: {k} token{s} ({}), {rate}", c.finish_reason)
        }
        records::Outcome::Failed { code, message } => format!("[{n}/{total}] {id}: error {code}: {message}"),
    }
}
