//! Messages to people on stderr that never panic, and errors printed once (shared by the tools).
//!
//! `eprintln!` panics ("failed printing to stderr", exit 101) when stderr is a closed pipe
//! (`kdtree-run ... 2>&1 | head -1`); [`say`] drops a message that cannot be written instead, so
//! the data path alone decides the exit status. [`error_chain`] renders an error and its causes the
//! way `{:#}` does, but skips a cause whose text the message before it already ends with: a library
//! error that embeds its source in its own Display (thiserror's `#[error("{file}: {source}")]`) would
//! otherwise print its OS error twice. [`is_broken_pipe`] tells a closed stdout (end quietly, exit 0)
//! from a real error. Tests: bottom of this file; tools/kdtree-run/tests/run_cli.rs and
//! tools/kdtree-golden/tests/cli.rs run the binaries with closed pipes.

use std::fmt::Display;
use std::io::Write;

/// Write `msg` and a newline to stderr; a closed or broken stderr loses the message, nothing else.
pub fn say(msg: impl Display) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{msg}");
}

/// `e` and its causes joined by ": ", each distinct text once (see the module doc).
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

/// Whether a write to a closed pipe is anywhere in `e`'s chain (`kdtree-run ... --out - | head`).
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;
    use std::io::{Error, ErrorKind};

    /// A library error that embeds its source in its Display and also returns it as `source()`.
    #[derive(Debug, thiserror::Error)]
    #[error("{file}: {source}")]
    struct Embeds {
        file: String,
        source: Error,
    }

    #[test]
    fn an_embedded_source_is_printed_once() {
        let io = Error::new(ErrorKind::NotFound, "No such file or directory (os error 2)");
        let e = anyhow::Error::new(Embeds {
            file: "m/manifest.toml".into(),
            source: io,
        })
        .context("opening model m");
        // `{:#}` repeats the OS error; error_chain does not.
        assert_eq!(format!("{e:#}").matches("os error 2").count(), 2);
        assert_eq!(
            error_chain(&e),
            "opening model m: m/manifest.toml: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn distinct_causes_are_all_kept() {
        let e = Err::<(), _>(Error::new(ErrorKind::PermissionDenied, "denied"))
            .context("writing out.jsonl")
            .context("line 3")
            .unwrap_err();
        assert_eq!(error_chain(&e), "line 3: writing out.jsonl: denied");
        assert!(!is_broken_pipe(&e));
        let pipe = anyhow::Error::new(Error::from(ErrorKind::BrokenPipe)).context("writing the output");
        assert!(is_broken_pipe(&pipe));
    }
}
