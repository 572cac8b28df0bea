//! Command-line arguments (clap derive; the doc comments are the `--help` text).

use std::path::PathBuf;

use clap::{ArgAction, Parser, ValueEnum};
use kdtree_engine::generate::{Mode, Sampling};
use kdtree_engine::WeightCheck;
use kdtree_text::prompts::{MAX_TOKENS_LIMIT, MAX_TOP_K};

use crate::runner::Defaults;

/// Prompts in, one JSON record per prompt out, with DDTree speculative decoding (Kimi K2.6 target +
/// DFlash drafter) or plain autoregressive decoding.
///
/// Prompt lines (JSONL, kind detected per line): {"id","prompt"}, {"id","messages":[...]},
/// {"id","prompt_token_ids":[...]}, or OpenAI batch lines {"custom_id","method":"POST",
/// "url":"/v1/chat/completions","body":{...}}. Per-line max_tokens, temperature, top_p, top_k, seed
/// and stop override the flags below. Output lines come in input order; every run-dependent value is
/// in each record's `timing` (and OpenAI bodies' `created`), so `jq -c 'del(.timing, .response.body.created)'`
/// compares runs.
///
/// `--budget auto` chooses each round's budget from a cost model measured on this device by
/// `kdtree-run calibrate MODEL` (see `kdtree-run calibrate --help`).
///
/// Exit status: 0 all lines ok; 1 some line got an error record or --verify found a mismatch; 2 error.
#[derive(Parser, Debug, Clone)]
#[command(name = "kdtree-run", version)]
pub struct Args {
    /// Converted model directory (output of `kdtree-convert repack`); with `--load-format dummy`, a
    /// directory holding config.json (and drafter/config.json for DDTree), e.g. from
    /// `kdtree-convert synth k26 DIR --drafter --config-only`.
    #[arg(value_name = "MODEL")]
    pub model: PathBuf,

    #[command(flatten)]
    pub weights: WeightsArgs,

    /// Prompt file (JSONL); the whole file is validated before any work starts.
    #[arg(long, value_name = "FILE")]
    pub prompts: PathBuf,

    /// Output JSONL, written and flushed line by line ("-" = stdout; devices such as /dev/null work).
    /// Must not be the prompt file or any other input (same file by identity, not by spelling).
    #[arg(long, value_name = "FILE.jsonl")]
    pub out: PathBuf,

    /// Decoding loop: DDTree speculative decoding (needs the drafter) or autoregressive.
    #[arg(long, value_enum, default_value_t = ModeArg::Ddtree)]
    pub mode: ModeArg,

    /// DDTree tree budget (1 to 2048): drafted nodes verified per step, root excluded; or `auto`: per round the bucket
    /// (4, 8, ..., 256, at most --budget-max) that maximizes expected tokens per second (CaDDTree), from
    /// the model's cost file for this device, `MODEL/kdtree-cost-<device>.json` (`kdtree-run calibrate`).
    #[arg(long, value_name = "N|auto", default_value = "64", value_parser = parse_budget)]
    pub budget: Budget,

    /// Largest budget `--budget auto` may choose.
    #[arg(
        long, value_name = "N", default_value_t = 256,
        value_parser = clap::value_parser!(u64).range(1..=MAX_BUDGET as u64)
    )]
    pub budget_max: u64,

    /// Sequences in flight at once (continuous batching: a finished line's slot is refilled from the file at
    /// once; every step runs all of them in one batched forward). Output stays in input order and each line's
    /// tokens do not depend on the batch (on the CPU bit for bit; on a GPU up to near-ties, see README).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub max_batch: u64,

    /// Cap on the KV cache memory of the sequences in flight, in GiB (default: the GPU's free memory after
    /// the weights, less room for a step's activations; not limited on the CPU). A line whose cache cannot
    /// fit gets an error record; lines that fit wait for room.
    #[arg(long, value_name = "GIB")]
    pub kv_memory: Option<f64>,

    /// GPUs to spread the model's tensor-parallel ranks over (R ranks as N groups of R/N, each GPU loading only
    /// its own ranks' shards; NCCL between them). Default: the largest divisor of R that the visible GPUs
    /// hold; 1 runs every rank on one GPU. On the CPU backend, N threads stand in for the GPUs.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=64))]
    pub gpus: Option<u64>,

    /// Run the --gpus N groups side by side on GPU 0, each with its own stream, weights and graphs, meeting
    /// through the one-GPU communicator (what N GPUs would run, on one; for checks and measurement).
    #[arg(long, requires = "gpus")]
    pub share_gpu: bool,

    /// Default maximum completion tokens per line (at most 1048576; a line stops at the model's context anyway).
    #[arg(
        long, value_name = "N", default_value_t = 256,
        value_parser = clap::value_parser!(u64).range(1..=MAX_TOKENS_LIMIT)
    )]
    pub max_tokens: u64,

    /// Default sampling temperature in [0, 100]; 0 = greedy.
    #[arg(long, value_name = "T", default_value = "0", value_parser = parse_number)]
    pub temperature: Number,

    /// Default nucleus mass in (0, 1]; 1 = off.
    #[arg(long, value_name = "P", default_value = "1", value_parser = parse_number)]
    pub top_p: Number,

    /// Default top-k (at most 1048576); 0 = off.
    #[arg(long, value_name = "K", default_value_t = 0, value_parser = clap::value_parser!(u64).range(..=MAX_TOP_K))]
    pub top_k: u64,

    /// Default seed of the per-line sampling RNG.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,

    /// Chat lines without their own `thinking`: open a `<think>` block (true) or emit `<think></think>`.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = ArgAction::Set)]
    pub thinking: bool,

    /// Backend: CUDA when built with it and a GPU is usable (auto), or forced.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,

    /// Re-run a kdtree-golden bundle (--prompts must be its prompt file) and compare: greedy AR tokens
    /// exactly, logits within the backend's tolerance (CPU: 0), the DDTree round; per-prompt table on
    /// stderr, exit 1 on any mismatch.
    #[arg(long, value_name = "GOLDEN_DIR")]
    pub verify: Option<PathBuf>,

    /// Write run totals (tokens/s, acceptance, wall time, manifest hash, backend) as JSON, at the end
    /// (through a temp file renamed into place; "-" = stdout). Checked for writability before any work.
    #[arg(long, value_name = "FILE.json")]
    pub summary: Option<PathBuf>,

    /// Keep the records already in --out (cutting a torn last line) and answer only the rest; a record
    /// whose line or effective settings (or the model) changed since it was written is answered again.
    #[arg(long)]
    pub resume: bool,

    /// The load check, on by default: every tensor the run loads (target and drafter) against the manifest's
    /// xxh3-64 checksum; a difference stops the run (exit 2) naming the tensor and its shard file. `host` (the
    /// default): the shard bytes, hashed on CPU threads while they upload (a damaged or changed file).
    /// `device` (bare `--check-weights`): the bytes where the model runs, hashed on the GPU after each upload
    /// (also an upload gone wrong; ~1 s more per 15 GB on an H200).
    #[arg(long, value_name = "WHERE", num_args = 0..=1, require_equals = true, default_missing_value = "device",
          conflicts_with = "no_check_weights")]
    pub check_weights: Option<CheckWhere>,

    /// Skip the load check (a damaged shard then runs silently). Records written so carry a fingerprint that
    /// says the weights were not checked, so a later checked `--resume` answers them again.
    #[arg(long)]
    pub no_check_weights: bool,

    /// No progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// `--budget`: a fixed node budget or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Fixed(usize),
    Auto,
}

/// Largest `--budget N` (and `--budget-max`): the tree a step verifies is N + 1 rows of every layer.
pub const MAX_BUDGET: usize = 2048;

fn parse_budget(s: &str) -> Result<Budget, String> {
    match s {
        "auto" => Ok(Budget::Auto),
        n => match n.parse::<u64>() {
            Ok(b) if (1..=MAX_BUDGET as u64).contains(&b) => Ok(Budget::Fixed(b as usize)),
            Ok(_) => Err(format!("a node budget is 1 to {MAX_BUDGET} (or `auto`)")),
            Err(_) => Err("neither a node count nor `auto` (a count is 1 to 2048)".into()),
        },
    }
}

/// `calibrate --warmup`: 0 to 1000 rounds.
fn parse_warmup(s: &str) -> Result<usize, String> {
    match s.parse::<u64>() {
        Ok(n) if n <= 1000 => Ok(n as usize),
        _ => Err("a number of rounds, 0 to 1000".into()),
    }
}

/// A number flag as given (`--temperature 1e308` is inf as an f32: messages show what the user typed);
/// its range is checked by [`Args::validate`], with the other checks, as prompt lines are held to.
#[derive(Debug, Clone)]
pub struct Number {
    pub value: f32,
    pub text: String,
}

fn parse_number(s: &str) -> Result<Number, String> {
    let value = s.parse().map_err(|_| "not a number".to_string())?;
    Ok(Number {
        value,
        text: s.to_string(),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    Ddtree,
    Ar,
    /// The plain DFlash chain (the drafter's argmax path, no tree): the baseline DDTree is measured against.
    Chain,
}

impl ModeArg {
    /// The flag's value as typed (`ddtree`, `ar`, `chain`).
    pub fn name(self) -> &'static str {
        match self {
            ModeArg::Ddtree => "ddtree",
            ModeArg::Ar => "ar",
            ModeArg::Chain => "chain",
        }
    }
}

/// Where the weights come from (`kdtree-run` and `kdtree-run calibrate`).
#[derive(clap::Args, Debug, Clone)]
pub struct WeightsArgs {
    /// Weights: the converted shards (auto), or dummy: every tensor of the plan of MODEL's config filled
    /// from --dummy-seed where the model runs (vLLM's `--load-format dummy`; timing only, the tokens are
    /// noise and records say `"load_format": "dummy"`). kdtree-run's dummy runs take prompt_token_ids lines
    /// only, stop at no token (each line decodes max_tokens) and refuse --verify and --resume.
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    pub load_format: LoadFormat,

    /// Dummy weights: the tensor-parallel plan's rank count R (at most 1024).
    #[arg(long, value_name = "R", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub ranks: u64,

    /// Dummy weights: the rank r (0-based) whose slice runs alone: its heads, expert and MLP slices and
    /// V/R vocabulary rows (token ids then stay below V/R), without the all-reduces.
    #[arg(long, value_name = "r", default_value_t = 0)]
    pub rank: u64,

    /// Dummy weights: the seed of the fills.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub dummy_seed: u64,
}

impl WeightsArgs {
    /// `--load-format dummy`.
    pub fn dummy(&self) -> bool {
        self.load_format == LoadFormat::Dummy
    }
    /// The dummy plan: (ranks, rank, seed).
    pub fn plan(&self) -> (usize, usize, u64) {
        (self.ranks as usize, self.rank as usize, self.dummy_seed)
    }
    /// The rank counts from 0 below the ranks; the dummy flags only with dummy weights.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.dummy() {
            anyhow::ensure!(
                self.rank < self.ranks,
                "--rank {} of --ranks {}: ranks count from 0",
                self.rank,
                self.ranks
            );
        } else {
            anyhow::ensure!(
                (self.ranks, self.rank, self.dummy_seed) == (1, 0, 0),
                "--ranks, --rank and --dummy-seed choose dummy weights; add --load-format dummy (converted shards \
                 fix their own plan)"
            );
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    /// The converted shards of MODEL.
    Auto,
    /// Seeded fills of MODEL's config's plan (no weight files).
    Dummy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Auto,
    Cuda,
    Cpu,
}

impl Args {
    /// `--load-format dummy`.
    pub fn dummy(&self) -> bool {
        self.weights.dummy()
    }
    /// The load check of this run (on unless `--no-check-weights`; dummy weights have no checksums).
    pub fn weight_check(&self) -> WeightCheck {
        match self.dummy() {
            true => WeightCheck::Off,
            false => weight_check(self.check_weights, self.no_check_weights),
        }
    }
    /// Whether the drafter loads: a mode that drafts, or `--verify` (its bundle's DDTree round).
    pub fn loads_drafter(&self) -> bool {
        self.defaults().mode.drafts() || self.verify.is_some()
    }

    /// The run-wide settings a prompt line may override.
    pub fn defaults(&self) -> Defaults {
        Defaults {
            max_tokens: self.max_tokens as usize,
            sampling: Sampling {
                temperature: self.temperature.value,
                top_p: self.top_p.value,
                top_k: self.top_k as usize,
                seed: self.seed,
            },
            mode: match self.mode {
                ModeArg::Ar => Mode::Ar,
                ModeArg::Ddtree => match self.budget {
                    Budget::Fixed(budget) => Mode::DDTree { budget },
                    Budget::Auto => Mode::DDTreeAuto {
                        max: self.budget_max as usize,
                    },
                },
                ModeArg::Chain => Mode::Chain,
            },
            thinking: self.thinking,
        }
    }

    /// Checks clap cannot express; the numeric ranges are the ones prompt lines are held to.
    pub fn validate(&self) -> anyhow::Result<()> {
        use kdtree_text::prompts::{check_temperature, check_top_p};
        let (t, p) = (&self.temperature, &self.top_p);
        check_temperature(t.value).map_err(|e| anyhow::anyhow!("--temperature {e}, got {}", t.text))?;
        check_top_p(p.value).map_err(|e| anyhow::anyhow!("--top-p {e}, got {}", p.text))?;
        anyhow::ensure!(
            !(self.resume && self.out.as_os_str() == "-"),
            "--resume needs --out to be a file"
        );
        if let Some(g) = self.kv_memory {
            anyhow::ensure!(g.is_finite() && g > 0.0, "--kv-memory {g}: a size in GiB above 0");
        }
        self.weights.validate()?;
        if self.dummy() {
            anyhow::ensure!(
                self.verify.is_none(),
                "--verify compares tokens with a golden bundle; dummy weights give noise tokens (use --load-format \
                 auto)"
            );
            anyhow::ensure!(
                !self.resume,
                "--resume is not supported with --load-format dummy (rerun the whole prompt file)"
            );
            anyhow::ensure!(
                self.check_weights.is_none(),
                "--check-weights checks shard files against their manifest; dummy weights have neither (drop it, or \
                 use --load-format auto)"
            );
        }
        Ok(())
    }
}

/// `kdtree-run calibrate MODEL`: times real DDTree rounds at each `--budget auto` bucket on this device
/// and writes the model's cost file for it, `MODEL/kdtree-cost-<device>.json` (through a temp file renamed
/// into place). Each bucket: a built-in prompt (through the model's chat template when it has one), warm-up
/// rounds (a GPU captures the round's graph there), then the median of the timed rounds.
#[derive(Parser, Debug, Clone)]
#[command(name = "kdtree-run calibrate", version)]
pub struct CalibrateArgs {
    /// Converted model directory with a drafter.
    #[arg(value_name = "MODEL")]
    pub model: PathBuf,

    /// Backend to measure (the cost file is per device).
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,

    /// The weights (with dummy weights the cost file is written into MODEL).
    #[command(flatten)]
    pub weights: WeightsArgs,

    /// Largest bucket measured (the buckets are 4, 8, ..., 256 below it, then it).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=2048))]
    pub budget_max: u64,

    /// Untimed rounds per bucket first (at most 1000).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = parse_warmup)]
    pub warmup: usize,

    /// Timed rounds per bucket (their median is the bucket's cost; at most 1000).
    #[arg(long, value_name = "N", default_value_t = 9, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub rounds: u64,

    /// Draft from the prompts of this JSONL file (as `kdtree-run --prompts` reads it; its first 8 lines that
    /// hold a prompt, each for --rounds timed rounds a bucket), so the tokens a round that `--budget auto`
    /// expects are this workload's; without it, one built-in request.
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,

    /// Where the load check hashes the weights: `host` (the default) or `device` (bare `--check-weights`); see
    /// `kdtree-run --help`.
    #[arg(long, value_name = "WHERE", num_args = 0..=1, require_equals = true, default_missing_value = "device",
          conflicts_with = "no_check_weights")]
    pub check_weights: Option<CheckWhere>,

    /// Load without checking the weights against the manifest's checksums.
    #[arg(long)]
    pub no_check_weights: bool,

    /// No progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Where `--check-weights` hashes the weights ([`WeightCheck::Host`] or [`WeightCheck::Device`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckWhere {
    Host,
    Device,
}

/// The load check of `--check-weights[=WHERE]` / `--no-check-weights` (neither: the host check).
pub fn weight_check(at: Option<CheckWhere>, off: bool) -> WeightCheck {
    match (off, at) {
        (true, _) => WeightCheck::Off,
        (false, Some(CheckWhere::Device)) => WeightCheck::Device,
        (false, _) => WeightCheck::Host,
    }
}
