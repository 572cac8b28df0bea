//! The output file: a sink that writes and flushes one JSONL record at a time, and `--resume`.
//!
//! Resume contract: output line i answers non-blank prompt line i. A resumed run reads the complete
//! (newline-terminated) records, cuts off a torn last line left by a kill (no trailing newline), and
//! answers the rest. Every record must answer the id of its prompt line, in order: a complete line that
//! is not JSON or answers another id means the file is not this prompt file's output, an error, never
//! silently overwritten. A record whose `fingerprint` (fingerprint.rs) differs from this run's for its
//! line (the line's text, its effective settings or the model changed; or a record from before
//! fingerprints) is **redone**: the file is cut after the leading run of current records, then every
//! later line is written again in order, current records copied byte for byte and stale ones answered
//! anew, so the file stays in input order and consistent at every moment. (A kill during that rewrite
//! loses only work: the copies not yet rewritten are answered again by the next --resume.)
//! Non-regular outputs (`/dev/stdout`, `/dev/null`, a pipe) are written without truncation; --resume on
//! them is refused by paths.rs. Tests: bottom of this file; kill-and-resume in tests/run_cli.rs.

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
        self.write_line(&line)
    }

    /// Write one already serialised record (newline included) and flush it.
    pub fn write_line(&mut self, line: &[u8]) -> Result<()> {
        self.w.write_all(line).context("writing the output")?;
        self.w.flush().context("flushing the output")
    }
}

/// What the prompt file expects of output line i: its id and this run's fingerprint of it.
pub struct Expected<'a> {
    pub id: &'a str,
    pub fingerprint: &'a str,
}

/// What an existing output file already holds.
#[derive(Debug, Default, PartialEq)]
pub struct Existing {
    /// Every complete record, parsed, in order (record i answers prompt line i).
    pub records: Vec<Json>,
    /// Each record's bytes, newline included (what is copied when a later part is rewritten).
    pub lines: Vec<Vec<u8>>,
    /// Whether record i was made from the request this run would send for line i.
    pub current: Vec<bool>,
    /// Leading current records: they stay in the file, which is cut after them.
    pub prefix: usize,
    /// Bytes of those leading records.
    pub valid_len: usize,
    /// A torn (unterminated) last line was found and will be rewritten.
    pub torn: bool,
}

impl Existing {
    /// Record i, when it can be kept (current).
    pub fn kept(&self, i: usize) -> Option<(&Json, &[u8])> {
        self.current
            .get(i)
            .copied()
            .unwrap_or(false)
            .then(|| (&self.records[i], self.lines[i].as_slice()))
    }

    /// Indices of records that will be redone.
    pub fn stale(&self) -> Vec<usize> {
        (0..self.records.len()).filter(|&i| !self.current[i]).collect()
    }
}

/// Check `bytes` (an earlier run's output) against the prompt file's expectations, line by line.
pub fn scan_existing(bytes: &[u8], expected: &[Expected]) -> Result<Existing> {
    let mut e = Existing::default();
    let mut pos = 0;
    while let Some(nl) = bytes[pos..].iter().position(|&b| b == b'\n') {
        let line = &bytes[pos..pos + nl];
        let n = e.records.len() + 1;
        let r: Json = serde_json::from_slice(line)
            .with_context(|| format!("output line {n} is not a JSON record; not resuming over it"))?;
        let Some(want) = expected.get(e.records.len()) else {
            bail!(
                "output has more records ({n}+) than the prompt file has lines ({}); not resuming over it \
                 (rerun without --resume to start the file over)",
                expected.len()
            );
        };
        match record_id(&r) {
            Some(id) if id == want.id => {}
            other => bail!(
                "output line {n} answers {} but the prompt file's request {n} is id \"{}\": lines were added, \
                 removed or reordered since, or this is another prompt file's output; not resuming over it \
                 (rerun without --resume to start the file over)",
                other.map_or("no id".to_string(), |id| format!("id \"{id}\"")),
                want.id
            ),
        }
        let current = r.get("fingerprint").and_then(Json::as_str) == Some(want.fingerprint);
        if current && e.prefix == e.records.len() {
            e.prefix += 1;
            e.valid_len = pos + nl + 1;
        }
        e.current.push(current);
        e.records.push(r);
        e.lines.push(bytes[pos..pos + nl + 1].to_vec());
        pos += nl + 1;
    }
    e.torn = pos < bytes.len();
    Ok(e)
}

/// What `path` already holds: with `resume` and an existing file, its checked records (nothing is
/// written yet, so a refusal leaves the file as it was); otherwise nothing.
pub fn read_existing(path: &Path, resume: bool, expected: &[Expected]) -> Result<Existing> {
    if path.as_os_str() == "-" {
        if resume {
            bail!("--resume needs --out to be a file, not stdout");
        }
    } else if resume && path.exists() {
        let bytes = std::fs::read(path).with_context(|| format!("reading {} to resume", path.display()))?;
        return scan_existing(&bytes, expected).with_context(|| format!("resuming {}", path.display()));
    }
    Ok(Existing::default())
}

/// Open the output for writing: `-` is stdout; a regular file is cut to `existing.valid_len` and
/// appended to (so a fresh run, whose `existing` is empty, starts it over); anything else (a device,
/// a pipe) is written as it is.
pub fn open_output(path: &Path, existing: &Existing) -> Result<Sink> {
    if path.as_os_str() == "-" {
        return Ok(Sink {
            w: Box::new(std::io::stdout().lock()),
        });
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    if file
        .metadata()
        .with_context(|| format!("inspecting {}", path.display()))?
        .is_file()
    {
        file.set_len(existing.valid_len as u64)
            .with_context(|| format!("truncating {}", path.display()))?;
    }
    Ok(Sink {
        w: Box::new(BufWriter::new(file)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "{\"id\":\"a\",\"status\":\"ok\",\"fingerprint\":\"fa\"}\n";
    const B: &str = "{\"custom_id\":\"b\",\"response\":{},\"fingerprint\":\"fb\"}\n";

    fn exp<'a>(pairs: &[(&'a str, &'a str)]) -> Vec<Expected<'a>> {
        pairs
            .iter()
            .map(|&(id, fingerprint)| Expected { id, fingerprint })
            .collect()
    }

    #[test]
    fn keeps_complete_prefix_and_detects_torn_line() {
        let ids = exp(&[("a", "fa"), ("b", "fb"), ("c", "fc")]);
        let e = scan_existing(format!("{A}{B}{{\"id\":\"c\",\"sta").as_bytes(), &ids).unwrap();
        assert_eq!(
            (e.records.len(), e.prefix, e.valid_len, e.torn),
            (2, 2, A.len() + B.len(), true)
        );
        let e = scan_existing(A.as_bytes(), &ids).unwrap();
        assert_eq!((e.records.len(), e.torn), (1, false));
        let e = scan_existing(b"", &ids).unwrap();
        assert_eq!((e.records.len(), e.valid_len, e.torn), (0, 0, false));
    }

    #[test]
    fn a_changed_fingerprint_is_redone_and_later_current_records_are_copied() {
        let ids = exp(&[("a", "new"), ("b", "fb")]);
        let e = scan_existing(format!("{A}{B}").as_bytes(), &ids).unwrap();
        assert_eq!((e.prefix, e.valid_len), (0, 0));
        assert_eq!(e.stale(), [0]);
        assert!(e.kept(0).is_none());
        assert_eq!(e.kept(1).unwrap().1, B.as_bytes());
        // A record without a fingerprint (older kdtree-run) is stale too.
        let e = scan_existing(b"{\"id\":\"a\"}\n", &exp(&[("a", "fa")])).unwrap();
        assert_eq!(e.stale(), [0]);
    }

    #[test]
    fn refuses_foreign_or_corrupt_files() {
        let err = format!(
            "{:#}",
            scan_existing(B.as_bytes(), &exp(&[("a", "fa"), ("b", "fb")])).unwrap_err()
        );
        assert!(err.contains("line 1") && err.contains("\"b\""), "{err}");
        assert!(scan_existing(b"garbage\n", &exp(&[("a", "fa")])).is_err());
        assert!(scan_existing(format!("{A}{A}").as_bytes(), &exp(&[("a", "fa")])).is_err());
    }

    #[test]
    fn resume_truncates_torn_tail_then_appends() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        std::fs::write(&p, format!("{A}{{\"id\":\"b\"")).unwrap();
        let ids = exp(&[("a", "fa"), ("b", "fb")]);
        let existing = read_existing(&p, true, &ids).unwrap();
        assert!(existing.torn);
        let mut sink = open_output(&p, &existing).unwrap();
        sink.write_record(&serde_json::json!({"id": "b", "status": "ok"}))
            .unwrap();
        drop(sink);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("{A}{{\"id\":\"b\",\"status\":\"ok\"}}\n")
        );
        // A foreign file is refused before anything is written.
        let before = std::fs::read(&p).unwrap();
        assert!(read_existing(&p, true, &exp(&[("x", "")])).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), before);
        // Without --resume the file starts over.
        let existing = read_existing(&p, false, &ids).unwrap();
        assert!(existing.records.is_empty());
        drop(open_output(&p, &existing).unwrap());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "");
        assert!(read_existing(Path::new("-"), true, &[]).is_err());
        // Devices are written without truncation (which they refuse).
        let mut sink = open_output(Path::new("/dev/null"), &Existing::default()).unwrap();
        sink.write_record(&serde_json::json!({"id": "a"})).unwrap();
    }
}
