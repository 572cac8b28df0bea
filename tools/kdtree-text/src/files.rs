//! File identity for the tools' "an output must not be an input" checks: two paths name the same file
//! when they have the same device and inode after following symlinks, so hard links, symlinks and
//! `./x` spellings are caught where comparing names would not be. Devices (`/dev/null`, a terminal)
//! are never taken for an input: several outputs may share them. Used by kdtree-run (src/paths.rs) and
//! kdtree-golden (src/main.rs). Also [`read_capped`]: a whole file read with a size limit, so a path that
//! names a device (`/dev/zero`, directly or through a symlink) or a runaway file fails fast with the limit
//! in the message instead of filling memory. Tests: bottom of this file.

use std::fs::Metadata;
use std::io::Read;
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

/// `n` bytes for people: "16 MiB", "1 KiB", "300 bytes".
pub fn show_size(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// Read all of `path` (`what` names it in errors, e.g. "cost file"), refusing more than `limit` bytes: a
/// regular file over the limit before a byte is read, anything else (a device, a pipe) once it has given
/// `limit + 1` bytes.
pub fn read_capped(path: &Path, limit: u64, what: &str) -> std::io::Result<Vec<u8>> {
    let too_big = |size: String| {
        std::io::Error::other(format!(
            "{what} {} is {size}; the limit is {} (is it the right file?)",
            path.display(),
            show_size(limit)
        ))
    };
    let f = std::fs::File::open(path)?;
    if let Ok(m) = f.metadata() {
        if m.is_file() && m.len() > limit {
            return Err(too_big(format!("{} bytes", m.len())));
        }
    }
    let mut bytes = Vec::new();
    f.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_big(format!("longer than {} bytes", limit)));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_reads_refuse_devices_and_large_files_naming_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cost.json");
        std::fs::write(&p, vec![b'x'; 2048]).unwrap();
        assert_eq!(read_capped(&p, 2048, "cost file").unwrap().len(), 2048);
        let e = read_capped(&p, 1024, "cost file").unwrap_err().to_string();
        assert!(
            e.contains("cost file") && e.contains("2048 bytes") && e.contains("limit is 1 KiB"),
            "{e}"
        );
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero")).unwrap();
        let t = std::time::Instant::now();
        let e = read_capped(&dir.path().join("zero"), 1 << 20, "cost file")
            .unwrap_err()
            .to_string();
        assert!(e.contains("limit is 1 MiB"), "{e}");
        assert!(t.elapsed().as_secs() < 5);
        assert_eq!(
            read_capped(&dir.path().join("missing"), 1, "x").unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
        assert_eq!(show_size(300), "300 bytes");
    }

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
