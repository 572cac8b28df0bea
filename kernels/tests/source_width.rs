//! House rule: no line of a Rust source in the workspace is over 120 bytes (rustfmt.toml's width; rustfmt
//! leaves long string literals and comments alone, so they are wrapped by hand). Walks every `*.rs` under
//! the workspace root (engine/, formats/, kernels/, tools/, fuzz/, ...), skipping `target/` directories,
//! hidden directories and `shared/`; a failure names file:line. Lives here because this crate has no
//! dependencies, so `make test` runs it cheaply.

use std::path::{Path, PathBuf};

const MAX_BYTES: usize = 120;

/// Every `*.rs` file under `dir`, symlinks not followed.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
        let (path, name) = (entry.path(), entry.file_name());
        let name = name.to_string_lossy();
        let ty = entry.file_type().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if ty.is_dir() {
            if name != "target" && name != "shared" && !name.starts_with('.') {
                rust_files(&path, out);
            }
        } else if ty.is_file() && name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// (1-based line number, length in bytes) of every line of `text` over [`MAX_BYTES`].
fn long_lines(text: &[u8]) -> Vec<(usize, usize)> {
    text.split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l).len())
        .enumerate()
        .filter(|&(_, len)| len > MAX_BYTES)
        .map(|(i, len)| (i + 1, len))
        .collect()
}

#[test]
fn long_lines_finds_only_lines_over_the_limit() {
    let text = format!("ok\n{}\n{}\r\n{}", "x".repeat(121), "y".repeat(120), "é".repeat(61));
    assert_eq!(long_lines(text.as_bytes()), vec![(2, 121), (4, 122)]);
    assert!(long_lines(b"").is_empty());
}

#[test]
fn no_rust_source_line_over_120_bytes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("kernels/ has a parent");
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files.sort();
    // The walk must have found the workspace, not an empty or wrong directory.
    assert!(
        files.iter().any(|f| f.ends_with("engine/src/lib.rs")) && files.len() > 50,
        "found {} Rust files under {}",
        files.len(),
        root.display()
    );
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read(f).unwrap_or_else(|e| panic!("reading {}: {e}", f.display()));
        let rel = f.strip_prefix(root).unwrap_or(f);
        for (line, len) in long_lines(&text) {
            bad.push(format!("{}:{line}: {len} bytes", rel.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "{} lines over {MAX_BYTES} bytes (rustfmt.toml width; wrap long comments and strings by hand):\n{}",
        bad.len(),
        bad.join("\n")
    );
}
