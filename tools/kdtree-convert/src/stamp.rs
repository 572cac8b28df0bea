//! The source stamp (issue 16 item 4): size, mtime (ns) and inode of every input file repack reads
//! (config, index, shards, drafter, carried files), kept in `OUT/.kdtree-convert.source.json`. Written
//! before the first shard, so an interrupted run says which source state its shards came from; a re-run
//! whose SRC differs redoes everything (never mixes old and new shards, never says "already complete"
//! over stale output); a change during a run fails it before the manifest is written; `verify --source`
//! compares SRC with it. It lives beside the manifest, not in it: manifest.toml stays a function of the
//! source's content (golden bundles and `kdtree-run --verify` pin its sha256), while inodes and mtimes
//! differ between two copies of the same checkpoint.
//!
//! What the fast check trusts: a file whose size, mtime and inode are unchanged is taken as unchanged, so an
//! edit in place that restores the mtime (`touch -r`) passes it. The stamp therefore also records each file's
//! content hash (xxh3-64, `xxh3`: streamed once per conversion alongside the writers, [`Stamp::hash_contents`]),
//! which `verify --source --deep` re-hashes ([`Stamp::deep_diff`]); a stamp from an older kdtree-convert has no
//! hashes, and the deep check says so. Test: tools/kdtree-convert/tests/stale_source.rs.

use anyhow::{Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use xxhash_rust::xxh3::Xxh3;

/// File name of the stamp inside OUT.
pub const STAMP_FILE: &str = ".kdtree-convert.source.json";

/// One input file as found on disk (symlinks followed: a Hugging Face cache blob, not its link).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i128,
    pub inode: u64,
    /// xxh3-64 (hex) of the file's bytes at the conversion; None in a stamp of an older kdtree-convert or of a
    /// conversion still running. Not part of the fast comparison ([`Stamp::diff`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<String>,
}

impl FileStat {
    /// What the fast check compares: size, mtime, inode.
    fn stat(&self) -> (u64, i128, u64) {
        (self.size, self.mtime_ns, self.inode)
    }
}

/// xxh3-64 (hex) of `path`'s bytes, streamed; stops early (an error) once `stop` is set.
pub fn hash_file_xxh3(path: &Path, stop: &AtomicBool) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        anyhow::ensure!(!stop.load(Ordering::Relaxed), "hashing {}: stopped", path.display());
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(kdtree_formats::manifest::xxh3_hex(h.digest()))
}

/// Every input file of a conversion, in a fixed order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    pub files: Vec<FileStat>,
}

impl Stamp {
    /// Stat `paths` now.
    pub fn take(paths: &[PathBuf]) -> Result<Stamp> {
        let files = paths
            .iter()
            .map(|p| {
                let m = std::fs::metadata(p).with_context(|| format!("reading {}", p.display()))?;
                Ok(FileStat {
                    path: p.clone(),
                    size: m.len(),
                    mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
                    inode: m.ino(),
                    xxh3: None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Stamp { files })
    }

    /// The stamp in `out`, if there is a readable one.
    pub fn read(out: &Path) -> Option<Stamp> {
        serde_json::from_slice(&std::fs::read(out.join(STAMP_FILE)).ok()?).ok()
    }

    /// Write it into `out` (temp + rename).
    pub fn write(&self, out: &Path) -> Result<()> {
        kdtree_formats::writer::write_atomic(&out.join(STAMP_FILE), &serde_json::to_vec_pretty(self)?)?;
        Ok(())
    }

    /// Record the content hash of every file (one streaming read each, in parallel; stops early once `stop` is
    /// set, e.g. when the conversion it runs beside failed).
    pub fn hash_contents(&mut self, stop: &AtomicBool) -> Result<()> {
        let hashes: Vec<String> = self
            .files
            .par_iter()
            .map(|f| hash_file_xxh3(&f.path, stop))
            .collect::<Result<_>>()?;
        for (f, h) in self.files.iter_mut().zip(hashes) {
            f.xxh3 = Some(h);
        }
        Ok(())
    }

    /// Whether every file has a recorded content hash (a stamp of this kdtree-convert, conversion complete).
    pub fn has_contents(&self) -> bool {
        self.files.iter().all(|f| f.xxh3.is_some())
    }

    /// The deep check: every file re-hashed against its recorded content hash; the first that differs (and how
    /// many more), or None. An error when the stamp has no hashes (an older conversion) or a file cannot be read.
    pub fn deep_diff(&self) -> Result<Option<String>> {
        anyhow::ensure!(
            self.has_contents(),
            "{STAMP_FILE} records no content hashes of the source (written by an older kdtree-convert): --deep \
             needs a conversion by this version (re-run the same `kdtree-convert repack` command: a complete \
             conversion only records the hashes)"
        );
        let never = AtomicBool::new(false);
        let now: Vec<String> = self
            .files
            .par_iter()
            .map(|f| hash_file_xxh3(&f.path, &never))
            .collect::<Result<_>>()?;
        let diffs: Vec<String> = self
            .files
            .iter()
            .zip(&now)
            .filter(|(f, h)| f.xxh3.as_ref() != Some(*h))
            .map(|(f, h)| {
                format!(
                    "{}: content differs (xxh3 {h}, recorded {})",
                    f.path.display(),
                    f.xxh3.as_deref().unwrap_or("none")
                )
            })
            .collect();
        let Some(first) = diffs.first() else { return Ok(None) };
        Ok(Some(if diffs.len() == 1 {
            first.clone()
        } else {
            format!("{first} (and {} more files)", diffs.len() - 1)
        }))
    }

    /// How `now` differs from `self` (the recorded state), for a message: first difference and count.
    pub fn diff(&self, now: &Stamp) -> Option<String> {
        let mut diffs = Vec::new();
        for f in &self.files {
            match now.files.iter().find(|g| g.path == f.path) {
                None => diffs.push(format!("{}: no longer an input", f.path.display())),
                Some(g) if g.stat() != f.stat() => {
                    let mut what = Vec::new();
                    if g.size != f.size {
                        what.push(format!("size {} -> {}", f.size, g.size));
                    }
                    if g.mtime_ns != f.mtime_ns {
                        what.push("modified (mtime)".to_string());
                    }
                    if g.inode != f.inode {
                        what.push("replaced (inode)".to_string());
                    }
                    diffs.push(format!("{}: {}", f.path.display(), what.join(", ")));
                }
                Some(_) => {}
            }
        }
        diffs.extend(
            now.files
                .iter()
                .filter(|g| !self.files.iter().any(|f| f.path == g.path))
                .map(|g| format!("{}: new input", g.path.display())),
        );
        let first = diffs.first()?;
        Some(if diffs.len() == 1 {
            first.clone()
        } else {
            format!("{first} (and {} more files)", diffs.len() - 1)
        })
    }
}
