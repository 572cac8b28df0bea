//! kdtree-convert: repack a Kimi K2.6 checkpoint (+ DFlash drafter) into checksummed INT4 group-32 rank
//! shards, verify them, inspect them, synthesize test checkpoints. This file is the table of contents: arguments, one
//! function per subcommand, exit codes (0 ok, 1 check failed, 2 error). The work lives in the library modules.

use clap::{Parser, Subcommand, ValueEnum};
use kdtree_convert::log::out;
use kdtree_convert::{elog, inspect, repack, synth, verify};
use std::path::PathBuf;
use std::process::ExitCode;

/// Repack, verify and inspect kdtree INT4 shards.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a Hugging Face checkpoint SRC into rank shards + manifest.toml + SHA256SUMS in OUT.
    /// Resumable: re-run the same command after an interruption.
    Repack {
        /// Checkpoint directory (config.json, model.safetensors.index.json, shards).
        src: PathBuf,
        /// Output directory (created; must be empty or hold an earlier run of the same command).
        out: PathBuf,
        /// Number of tensor-parallel ranks.
        #[arg(long, default_value_t = 8)]
        ranks: usize,
        /// Routed experts: split each expert over ranks (tp) or give each rank whole experts (ep).
        #[arg(long, value_enum, default_value_t = Experts::Tp)]
        experts: Experts,
        /// DFlash drafter directory (config.json + model.safetensors), converted alongside.
        #[arg(long)]
        drafter: Option<PathBuf>,
        /// Tensor bytes per output file before a new part starts (a bigger tensor gets its own file).
        #[arg(long, default_value_t = repack::DEFAULT_MAX_FILE_SIZE)]
        max_file_size: u64,
        /// No progress bar or summary.
        #[arg(long)]
        quiet: bool,
    },
    /// Re-hash every file and tensor of a converted model against its manifest and SHA256SUMS.
    Verify {
        /// Converted model directory.
        dir: PathBuf,
        /// Also check that the source files it was converted from are unchanged (size, mtime, inode, as
        /// recorded by repack in .kdtree-convert.source.json). This fast check trusts the mtime: an edit that
        /// keeps size, mtime and inode (`touch -r`) passes it; add --deep to compare the content.
        #[arg(long)]
        source: bool,
        /// With --source: also re-hash every source file against the content hash (xxh3-64) the conversion
        /// recorded (one full read of the source). Needs a conversion by this version.
        #[arg(long, requires = "source")]
        deep: bool,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Show the plan, bytes per rank and, with --tensor, one tensor's layout and first values.
    Inspect {
        /// Converted model directory.
        dir: PathBuf,
        /// Converted tensor name (e.g. language_model.model.layers.1.mlp.experts.gate_proj.weight_packed).
        #[arg(long)]
        tensor: Option<String>,
    },
    /// Write a synthetic checkpoint in the exact Kimi K2.6 Hugging Face layout (for tests and demos).
    Synth {
        #[command(flatten)]
        args: synth::SynthArgs,
        /// No progress bar or summary.
        #[arg(long)]
        quiet: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Experts {
    Tp,
    Ep,
}

/// Outcome of a subcommand that ran: passed, or a check failed (exit 1).
enum Outcome {
    Pass,
    CheckFailed,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(Outcome::Pass) => ExitCode::SUCCESS,
        Ok(Outcome::CheckFailed) => ExitCode::from(1),
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            elog!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> anyhow::Result<Outcome> {
    match args.cmd {
        Cmd::Repack {
            src,
            out,
            ranks,
            experts,
            drafter,
            max_file_size,
            quiet,
        } => {
            let experts = match experts {
                Experts::Tp => kdtree_formats::ExpertsMode::Tp,
                Experts::Ep => kdtree_formats::ExpertsMode::Ep,
            };
            repack::repack(&repack::RepackOptions {
                src,
                out,
                drafter,
                ranks,
                experts,
                max_file_size,
                quiet,
            })?;
            Ok(Outcome::Pass)
        }
        // The exit code is the verdict's: a closed stdout loses the line, never the answer.
        Cmd::Verify {
            dir,
            source,
            deep,
            quiet,
        } => match verify::verify_with_source(&dir, source, deep, quiet)? {
            verify::Verdict::Ok {
                files,
                tensors,
                bytes,
                runtime,
            } => {
                let also = match runtime.is_empty() {
                    true => String::new(),
                    false => format!(
                        " (run-time files, not part of the conversion, not checked: {})",
                        runtime.join(", ")
                    ),
                };
                let _ = out(&format!(
                    "OK: {files} files, {tensors} tensors, {bytes} bytes match {}{also}\n",
                    dir.join("manifest.toml").display()
                ));
                Ok(Outcome::Pass)
            }
            verify::Verdict::Failed(why) => {
                let _ = out(&format!("FAILED: {why}\n"));
                Ok(Outcome::CheckFailed)
            }
        },
        Cmd::Inspect { dir, tensor } => {
            let report = inspect::inspect(&dir, tensor.as_deref())?;
            out(&report)?;
            Ok(Outcome::Pass)
        }
        Cmd::Synth { args, quiet } => {
            synth::run_synth(&args, quiet)?;
            Ok(Outcome::Pass)
        }
    }
}

/// A closed stdout (`kdtree-convert inspect ... | head`) is not an error.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
