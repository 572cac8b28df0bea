//! File identity for the tools' "an output must not be an input" checks: two paths name the same file
//! when they have the same device and inode after following symlinks, so hard links, symlinks and
//! `./x` spellings are caught where comparing names would not be. Devices (`/dev/null`, a terminal)
//! are never taken for an input: several outputs may share them. Used by kdtree-run (src/paths.rs) and
//! kdtree-golden (src/main.rs). Tests: bottom of this file.

use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Whether `a` and `b` are one file that two writers (or a reader and a writer) cannot share: the same
/// device and inode, and not a character or block device.
pub fn same_file(a: &Metadata, b: &Metadata) -> bool {
    let device = |m: &Metadata| m.file_type().is_char_device() || m.file_type().is_block_device();
    a.dev() == b.dev() && a.ino() == b.ino() && !device(a)
}

/// The inputs of a run: regular files an output must not be.
#[derive(Debug, Default)]
pub struct Inputs {
    files: Vec<(Metadata, PathBuf)>,
}

impl Inputs {
    /// Add `path` (when it exists).
    pub fn file(&mut self, path: &Path) {
        if let Ok(m) = std::fs::metadata(path) {
            self.files.push((m, path.to_path_buf()));
        }
    }

    /// Add every regular file under `dir`, `depth` levels of subdirectories deep (a missing or
    /// unreadable directory adds nothing: reading it fails later with its own message).
    pub fn dir(&mut self, dir: &Path, depth: usize) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            match std::fs::metadata(&p) {
                Ok(m) if m.is_file() => self.files.push((m, p)),
                Ok(m) if m.is_dir() && depth > 0 => self.dir(&p, depth - 1),
                _ => {}
            }
        }
    }

    /// The input an output whose metadata is `m` would overwrite, if any.
    pub fn find(&self, m: &Metadata) -> Option<&Path> {
        self.files
            .iter()
            .find(|(i, _)| same_file(i, m))
            .map(|(_, p)| p.as_path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_not_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("model/drafter")).unwrap();
        std::fs::write(d.join("p.jsonl"), "x").unwrap();
        std::fs::write(d.join("model/drafter/config.json"), "{}").unwrap();
        std::fs::hard_link(d.join("p.jsonl"), d.join("hard")).unwrap();
        std::os::unix::fs::symlink(d.join("model/drafter/config.json"), d.join("soft")).unwrap();
        std::fs::write(d.join("other"), "x").unwrap();
        let mut inputs = Inputs::default();
        inputs.file(&d.join("p.jsonl"));
        inputs.dir(&d.join("model"), 1);
        inputs.file(&d.join("missing"));
        let m = |p: &str| std::fs::metadata(d.join(p)).unwrap();
        assert_eq!(inputs.find(&m("hard")), Some(d.join("p.jsonl").as_path()));
        assert_eq!(
            inputs.find(&m("soft")),
            Some(d.join("model/drafter/config.json").as_path())
        );
        assert_eq!(inputs.find(&m("./p.jsonl")), Some(d.join("p.jsonl").as_path()));
        assert_eq!(inputs.find(&m("other")), None);
        let null = std::fs::metadata("/dev/null").unwrap();
        assert!(!same_file(&null, &null), "devices may be shared");
        assert!(same_file(&m("p.jsonl"), &m("hard")));
    }
}
