//! Reading a prompt file with limits: a line longer than [`MAX_LINE_BYTES`] or a file longer than
//! [`MAX_FILE_BYTES`] fails the whole file with the limit in the message, as soon as the bytes read show it
//! (`--prompts /dev/zero` fails after 16 MiB, not after filling memory). Tests: bottom of this file.

use std::path::Path;

use anyhow::{Context, Result};

use super::{parse_prompt_bytes, PromptLine, MAX_FILE_BYTES, MAX_LINE_BYTES};

/// Read and validate a prompt file: only I/O errors and the size limits ([`MAX_LINE_BYTES`] per line,
/// [`MAX_FILE_BYTES`] in all, checked as the bytes arrive, so `/dev/zero` fails at once) fail the whole file.
pub fn read_prompt_file(path: &Path) -> Result<Vec<PromptLine>> {
    let bytes = read_capped_lines(path, MAX_LINE_BYTES, MAX_FILE_BYTES)
        .with_context(|| format!("reading prompts {}", path.display()))?;
    Ok(parse_prompt_bytes(&bytes))
}

/// All bytes of `path`, refusing a line (bytes between `\n`s) longer than `max_line` or more than `max_file`
/// bytes in all, as soon as the reading shows it.
fn read_capped_lines(path: &Path, max_line: usize, max_file: usize) -> Result<Vec<u8>> {
    use std::io::BufRead;
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    if let Ok(m) = f.metadata() {
        anyhow::ensure!(
            !m.is_file() || m.len() <= max_file as u64,
            "{} bytes; a prompt file holds at most {} (split it)",
            m.len(),
            crate::files::show_size(max_file as u64)
        );
    }
    let mut r = std::io::BufReader::with_capacity(1 << 16, f.take(max_file as u64 + 1));
    let (mut bytes, mut line_start, mut line_no) = (Vec::new(), 0usize, 1usize);
    loop {
        let buf = match r.fill_buf() {
            Ok([]) => break,
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        let (n, base) = (buf.len(), bytes.len());
        let too_long = |line_no: usize| {
            anyhow::anyhow!(
                "line {line_no} is longer than {}, the limit of a prompt line (is it a JSONL prompt file?)",
                crate::files::show_size(max_line as u64)
            )
        };
        // Each line that ends in this chunk, then the one it leaves open.
        for (i, _) in buf.iter().enumerate().filter(|(_, b)| **b == b'\n') {
            if base + i - line_start > max_line {
                return Err(too_long(line_no));
            }
            line_no += 1;
            line_start = base + i + 1;
        }
        bytes.extend_from_slice(buf);
        r.consume(n);
        if bytes.len() - line_start > max_line {
            return Err(too_long(line_no));
        }
        anyhow::ensure!(
            bytes.len() <= max_file,
            "more than {}: a prompt file holds at most that (split it)",
            crate::files::show_size(max_file as u64)
        );
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_files_and_reports_io_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        std::fs::write(&p, "{\"id\":\"a\",\"prompt\":\"x\"}\n").unwrap();
        assert_eq!(read_prompt_file(&p).unwrap().len(), 1);
        let err = format!("{:#}", read_prompt_file(&dir.path().join("missing.jsonl")).unwrap_err());
        assert!(err.contains("missing.jsonl"), "{err}");
    }

    #[test]
    fn a_line_or_a_file_over_the_limit_fails_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        std::fs::write(&p, "ab\ncdef\n\nxy").unwrap();
        assert_eq!(read_capped_lines(&p, 4, 100).unwrap().len(), 11);
        let e = format!("{:#}", read_capped_lines(&p, 3, 100).unwrap_err());
        assert_eq!(
            e,
            "line 2 is longer than 3 bytes, the limit of a prompt line (is it a JSONL prompt file?)"
        );
        let e = format!("{:#}", read_capped_lines(&p, 4, 10).unwrap_err());
        assert!(e.contains("11 bytes; a prompt file holds at most 10 bytes"), "{e}");
        let t = std::time::Instant::now();
        let e = format!("{:#}", read_prompt_file(Path::new("/dev/zero")).unwrap_err());
        assert!(
            e.contains("/dev/zero") && e.contains("line 1 is longer than 16 MiB, the limit of a prompt line"),
            "{e}"
        );
        assert!(t.elapsed().as_secs() < 10, "{:?}", t.elapsed());
        // A device with lines: the file limit.
        let mut f = std::fs::File::create(dir.path().join("big")).unwrap();
        std::io::Write::write_all(&mut f, &b"{}\n".repeat(10)).unwrap();
        let e = format!("{:#}", read_capped_lines(&dir.path().join("big"), 4, 29).unwrap_err());
        assert!(e.contains("at most 29 bytes"), "{e}");
    }
}
