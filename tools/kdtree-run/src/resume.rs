//! The output file: a sink that writes and flushes one JSONL record at a time, and `--resume`.
//!
//! Resume contract: output line i answers non-blank prompt line i, so a resumed run keeps the longest
//! prefix of complete (newline-terminated) records whose ids match the prompt file in order, cuts off
//! a torn last line left by a kill (no trailing newline), and appends the rest. A complete line that
//! is not JSON or answers another id means the file is not this prompt file's output: that is an
//! error, never silently overwritten. Tests: bottom of this file; kill-and-resume in tests/run_cli.rs.

use std::fs::OpenOptions;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value as Json;

use crate::records::record_id;

/// Where records go.
pub struct Sink {
    w: Box<dyn Write>,
}

impl Sink {
    /// Write one record as one line and flush it, so a kill loses at most the line being written.
    pub fn write_record(&mut self, r: &Json) -> Result<()> {
        let mut line = serde_json::to_vec(r).context("serialising a record")?;
        line.push(b'\n');
        self.w.write_all(&line).context("writing the output")?;
        self.w.flush().context("flushing the output")
    }
}

/// What an existing output file already holds.
#[derive(Debug, PartialEq)]
pub struct Existing {
    /// Parsed records of the kept prefix, in order.
    pub records: Vec<Json>,
    /// Bytes of the kept prefix.
    pub valid_len: usize,
    /// A torn (unterminated) last line was found and will be rewritten.
    pub torn: bool,
}

/// Check `bytes` (an earlier run's output) against the prompt ids in order.
pub fn scan_existing(bytes: &[u8], expected_ids: &[&str]) -> Result<Existing> {
    let mut records = Vec::new();
    let mut pos = 0;
    while let Some(nl) = bytes[pos..].iter().position(|&b| b == b'\n') {
        let line = &bytes[pos..pos + nl];
        let n = records.len() + 1;
        let r: Json = serde_json::from_slice(line)
            .with_context(|| format!("output line {n} is not a JSON record; not resuming over it"))?;
        let Some(want) = expected_ids.get(records.len()) else {
            bail!("output has more records ({n}+) than the prompt file has lines ({})", expected_ids.len());
        };
        match record_id(&r) {
            Some(id) if id == *want => {}
            other => bail!(
                "output line {n} answers id {other:?} but prompt line {n} is {want:?}; is this the output of another prompt file?"
            ),
        }
        records.push(r);
        pos += nl + 1;
    }
    Ok(Existing { records, valid_len: pos, torn: pos < bytes.len() })
}

/// What `path` already holds: with `resume` and an existing file, its checked valid prefix (nothing is
/// written yet, so a refusal leaves the file as it was); otherwise nothing.
pub fn read_existing(path: &Path, resume: bool, expected_ids: &[&str]) -> Result<Existing> {
    if path.as_os_str() == "-" {
        if resume {
            bail!("--resume needs --out to be a file, not stdout");
        }
    } else if resume && path.exists() {
        let bytes = std::fs::read(path).with_context(|| format!("reading {} to resume", path.display()))?;
        return scan_existing(&bytes, expected_ids).with_context(|| format!("resuming {}", path.display()));
    }
    Ok(Existing { records: Vec::new(), valid_len: 0, torn: false })
}

/// Open the output for writing: `-` is stdout; a file is cut to `existing.valid_len` and appended to
/// (so a fresh run, whose `existing` is empty, starts it over).
pub fn open_output(path: &Path, existing: &Existing) -> Result<Sink> {
    if path.as_os_str() == "-" {
        return Ok(Sink { w: Box::new(std::io::stdout().lock()) });
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.set_len(existing.valid_len as u64).with_context(|| format!("truncating {}", path.display()))?;
    Ok(Sink { w: Box::new(BufWriter::new(file)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "{\"id\":\"a\",\"status\":\"ok\"}\n";
    const B: &str = "{\"custom_id\":\"b\",\"response\":{}}\n";

    #[test]
    fn keeps_complete_prefix_and_detects_torn_line() {
        let ids = ["a", "b", "c"];
        let e = scan_existing(format!("{A}{B}{{\"id\":\"c\",\"sta").as_bytes(), &ids).unwrap();
        assert_eq!((e.records.len(), e.valid_len, e.torn), (2, A.len() + B.len(), true));
        let e = scan_existing(A.as_bytes(), &ids).unwrap();
        assert_eq!((e.records.len(), e.torn), (1, false));
        let e = scan_existing(b"", &ids).unwrap();
        assert_eq!((e.records.len(), e.valid_len, e.torn), (0, 0, false));
    }

    #[test]
    fn refuses_foreign_or_corrupt_files() {
        let err = format!("{:#}", scan_existing(B.as_bytes(), &["a", "b"]).unwrap_err());
        assert!(err.contains("line 1") && err.contains("\"b\""), "{err}");
        assert!(scan_existing(b"garbage\n", &["a"]).is_err());
        assert!(scan_existing(format!("{A}{A}").as_bytes(), &["a"]).is_err());
    }

    #[test]
    fn resume_truncates_torn_tail_then_appends() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        std::fs::write(&p, format!("{A}{{\"id\":\"b\"")).unwrap();
        let existing = read_existing(&p, true, &["a", "b"]).unwrap();
        assert!(existing.torn);
        let mut sink = open_output(&p, &existing).unwrap();
        sink.write_record(&serde_json::json!({"id": "b", "status": "ok"})).unwrap();
        drop(sink);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), format!("{A}{{\"id\":\"b\",\"status\":\"ok\"}}\n"));
        // A foreign file is refused before anything is written.
        let before = std::fs::read(&p).unwrap();
        assert!(read_existing(&p, true, &["x"]).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), before);
        // Without --resume the file starts over.
        let existing = read_existing(&p, false, &["a", "b"]).unwrap();
        assert!(existing.records.is_empty());
        drop(open_output(&p, &existing).unwrap());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "");
        assert!(read_existing(Path::new("-"), true, &[]).is_err());
    }
}
