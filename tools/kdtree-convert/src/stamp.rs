//! The source stamp (issue 16 item 4): size, mtime (ns) and inode of every input file repack reads
//! (config, index, shards, drafter, carried files), kept in `OUT/.kdtree-convert.source.json`. Written
//! before the first shard, so an interrupted run says which source state its shards came from; a re-run
//! whose SRC differs redoes everything (never mixes old and new shards, never says "already complete"
//! over stale output); a change during a run fails it before the manifest is written; `verify --source`
//! compares SRC with it. It lives beside the manifest, not in it: manifest.toml stays a function of the
//! source's content (golden bundles and `kdtree-run --verify` pin its sha256), while inodes and mtimes
//! differ between two copies of the same checkpoint. Test: tools/kdtree-convert/tests/stale_source.rs.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// File name of the stamp inside OUT.
pub const STAMP_FILE: &str = ".kdtree-convert.source.json";

/// One input file as found on disk (symlinks followed: a Hugging Face cache blob, not its link).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i128,
    pub inode: u64,
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

    /// How `now` differs from `self` (the recorded state), for a message: first difference and count.
    pub fn diff(&self, now: &Stamp) -> Option<String> {
        let mut diffs = Vec::new();
        for f in &self.files {
            match now.files.iter().find(|g| g.path == f.path) {
                None => diffs.push(format!("{}: no longer an input", f.path.display())),
                Some(g) if g != f => {
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
