//! Output paths, checked before anything is opened for writing, and the summary's atomic write.
//!
//! An output (`--out`, `--summary`) must not be an input (the prompt file, a file of the model or
//! `--verify` directory) nor the other output. Sameness is file identity (kdtree_text::files: device +
//! inode after following symlinks), so hard links, symlinks and `./x` spellings are caught, and
//! `--out -` is judged by what stdout is (`>> prompts.jsonl` appending to the prompt file). Devices
//! (`/dev/null`, a terminal) may be shared. An output must not be a directory and must be writable
//! (its directory, when it does not exist yet; always its directory for the summary, which is renamed
//! into place). `--resume` needs a regular file. Tests: bottom of this file; tests/hardening.rs.
//!
//! [`lock_out`]: a file `--out` (not stdout, not a device) is locked for the whole run, `--resume` included,
//! through `FILE.lock` beside it (kdtree_text::lock: flock(2), the holder's pid inside, removed at the end): a
//! second run on the same file (by identity: the lock sits beside the resolved path) exits 2 naming the pid.

use std::ffi::CString;
use std::fs::Metadata;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kdtree_text::files::{same_file, Inputs};

use crate::args::Args;

/// What `path` is now (symlinks followed); `-` is stdout. None: it does not exist (yet).
fn stat_output(path: &Path) -> Result<Option<Metadata>> {
    if path.as_os_str() == "-" {
        use std::os::fd::AsFd;
        let fd = std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .context("inspecting stdout")?;
        return Ok(std::fs::File::from(fd).metadata().ok());
    }
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("inspecting {}", path.display())),
    }
}

/// `access(2)`: whether this process may do `mode` (libc::W_OK, ...) on `path`.
fn access(path: &Path, mode: libc::c_int) -> std::io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call; access only reads it.
    if unsafe { libc::access(c.as_ptr(), mode) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The directory a new file at `path` lands in.
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The file a write to `path` really replaces (symlinks resolved), so a rename lands on the target.
fn resolved(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The directory `path` (an output of `flag`) is created or renamed into must exist and be writable.
fn check_dir_writable(flag: &str, path: &Path) -> Result<()> {
    let dir = parent_of(path);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => bail!("{flag} {}: {} is not a directory", path.display(), dir.display()),
        Err(e) => return Err(e).with_context(|| format!("{flag} {}: directory {}", path.display(), dir.display())),
    }
    access(dir, libc::W_OK | libc::X_OK)
        .with_context(|| format!("{flag} {}: cannot create files in {}", path.display(), dir.display()))
}

/// The files of MODEL a run reads or that make up the model: with dummy weights its configs; a converted model,
/// what its manifest names (shards, carried files), the manifest, SHA256SUMS, the conversion's own files and the
/// cost files (every file of the directory, 2 levels deep, when the manifest cannot be read: the load then fails
/// with its own message). Other files in the directory (a previous run's `--out`) are not inputs, so an output
/// inside MODEL is accepted, and re-run or resumed, the same way in both load formats.
fn model_inputs(args: &Args, inputs: &mut Inputs) {
    let m = &args.model;
    if args.dummy() {
        inputs.file(&m.join("config.json"));
        inputs.file(&m.join("drafter/config.json"));
        return;
    }
    let manifest = m.join(kdtree_formats::manifest::MANIFEST);
    let parsed = std::fs::read_to_string(&manifest)
        .ok()
        .and_then(|t| kdtree_formats::manifest::Manifest::parse(&manifest.display().to_string(), &t).ok());
    let Some(parsed) = parsed else {
        inputs.dir(m, 2);
        return;
    };
    inputs.file(&manifest);
    let named = parsed
        .files
        .iter()
        .map(|f| &f.name)
        .chain(parsed.aux_files.iter().map(|f| &f.name));
    named.for_each(|n| inputs.file(&m.join(n)));
    for name in crate::fingerprint::MODEL_FILES.iter().chain(&["SHA256SUMS"]) {
        inputs.file(&m.join(name));
    }
    for e in std::fs::read_dir(m).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".kdtree-convert") || (name.starts_with("kdtree-cost-") && name.ends_with(".json")) {
            inputs.file(&e.path());
        }
    }
}

/// Every check of `--out` and `--summary` (see the module doc); nothing is opened for writing.
pub fn check(args: &Args) -> Result<()> {
    let mut inputs = Inputs::default();
    inputs.file(&args.prompts);
    model_inputs(args, &mut inputs);
    if let Some(v) = &args.verify {
        inputs.dir(v, 2);
    }
    let mut outputs: Vec<(&str, &Path, Metadata)> = Vec::new();
    let summary = args.summary.as_deref().map(|p| ("--summary", p));
    for (flag, path) in [("--out", args.out.as_path())].into_iter().chain(summary) {
        let Some(m) = stat_output(path)? else {
            check_dir_writable(flag, path)?;
            continue;
        };
        if m.is_dir() {
            bail!("{flag} {} is a directory", path.display());
        }
        if let Some(input) = inputs.find(&m) {
            let what = if input == args.prompts {
                "the prompt file"
            } else {
                "an input file"
            };
            bail!(
                "{flag} {} is {what} {} (the same file): refusing to write over an input",
                path.display(),
                input.display()
            );
        }
        if let Some((other, p, _)) = outputs.iter().find(|(_, _, o)| same_file(o, &m)) {
            bail!(
                "{flag} {} and {other} {} are the same file",
                path.display(),
                p.display()
            );
        }
        if path.as_os_str() == "-" {
            // stdout: open already.
        } else if flag == "--summary" && m.is_file() {
            check_dir_writable(flag, &resolved(path))?;
        } else {
            access(path, libc::W_OK).with_context(|| format!("{flag} {} is not writable", path.display()))?;
        }
        if flag == "--out" && args.resume && !m.is_file() {
            bail!(
                "--resume needs --out to be a regular file; {} is not (use a file, or drop --resume)",
                path.display()
            );
        }
        outputs.push((flag, path, m));
    }
    Ok(())
}

/// Lock `--out` for the whole run (see the module doc); None for stdout and devices, which are not
/// truncated nor resumed and may be shared. Called after [`check`], before the output is read or opened.
pub fn lock_out(out: &Path) -> Result<Option<kdtree_text::lock::Lock>> {
    use kdtree_text::lock::{try_lock, LockError};
    if out.as_os_str() == "-" || stat_output(out)?.is_some_and(|m| !m.is_file()) {
        return Ok(None);
    }
    // The file a write really lands on, so two spellings of one output (a symlink, `./x`) share one lock.
    let target = match std::fs::canonicalize(out) {
        Ok(t) => t,
        Err(_) => {
            let dir = std::fs::canonicalize(parent_of(out)).unwrap_or_else(|_| parent_of(out).to_path_buf());
            dir.join(out.file_name().unwrap_or(out.as_os_str()))
        }
    };
    let mut name = target.clone().into_os_string();
    name.push(".lock");
    let path = PathBuf::from(name);
    match try_lock(&path) {
        Ok(l) => Ok(Some(l)),
        Err(LockError::Busy(who)) => {
            let who = if who.is_empty() {
                "another process".to_string()
            } else {
                format!("another kdtree-run ({who})")
            };
            bail!(
                "--out {}: locked by {who} through {}; two runs cannot write one output at once (wait for it to \
                 finish, or stop it)",
                out.display(),
                path.display()
            )
        }
        Err(LockError::Io(e)) => Err(e).with_context(|| format!("--out {}: locking {}", out.display(), path.display())),
    }
}

/// Write `bytes` to `path`: a regular (or new) file through a temp file in its directory renamed over
/// it, so no partial file is ever left under its name; a device or pipe (`/dev/stdout`) directly; `-`
/// is stdout.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    if path.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        return out
            .write_all(bytes)
            .and_then(|_| out.flush())
            .context("writing to stdout");
    }
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        return f
            .write_all(bytes)
            .with_context(|| format!("writing {}", path.display()));
    }
    let target = resolved(path);
    let name = target
        .file_name()
        .map_or_else(|| "summary".into(), |n| n.to_string_lossy().into_owned());
    let tmp = parent_of(&target).join(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::write(&tmp, bytes)
        .with_context(|| format!("writing {}", tmp.display()))
        .and_then(|_| {
            std::fs::rename(&tmp, &target)
                .with_context(|| format!("renaming {} to {}", tmp.display(), target.display()))
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(dir: &Path, extra: &[&str]) -> Args {
        let (model, prompts) = (dir.join("model"), dir.join("p.jsonl"));
        let base = [
            "kdtree-run",
            model.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
        ];
        Args::parse_from(base.iter().copied().chain(extra.iter().copied()))
    }

    fn err(a: &Args) -> String {
        format!("{:#}", check(a).unwrap_err())
    }

    #[test]
    fn an_output_that_is_an_input_is_refused_by_identity() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("model")).unwrap();
        std::fs::write(d.join("model/manifest.toml"), "m").unwrap();
        std::fs::write(d.join("p.jsonl"), "{}\n").unwrap();
        std::fs::hard_link(d.join("p.jsonl"), d.join("hard.jsonl")).unwrap();
        std::os::unix::fs::symlink(d.join("p.jsonl"), d.join("soft.jsonl")).unwrap();
        let s = |p: &str| d.join(p).to_str().unwrap().to_string();
        let dotted = format!("{}/./p.jsonl", d.display());
        for out in [s("p.jsonl"), s("hard.jsonl"), s("soft.jsonl"), dotted] {
            let e = err(&args(d, &["--out", &out]));
            assert!(e.contains("the prompt file") && e.contains("refusing"), "{out}: {e}");
            let e = err(&args(d, &["--out", &s("o.jsonl"), "--summary", &out]));
            assert!(e.contains("--summary") && e.contains("the prompt file"), "{out}: {e}");
        }
        let e = err(&args(d, &["--out", &s("model/manifest.toml")]));
        assert!(e.contains("an input file"), "{e}");
        std::fs::write(d.join("o.jsonl"), "").unwrap();
        std::os::unix::fs::symlink(d.join("o.jsonl"), d.join("o-link.json")).unwrap();
        let e = err(&args(d, &["--out", &s("o.jsonl"), "--summary", &s("o-link.json")]));
        assert!(e.contains("are the same file"), "{e}");
        // Distinct files, and shared devices, pass.
        check(&args(d, &["--out", &s("o.jsonl"), "--summary", &s("s.json")])).unwrap();
        check(&args(d, &["--out", "/dev/null", "--summary", "/dev/null"])).unwrap();
    }

    #[test]
    fn directories_missing_parents_and_resume_on_devices_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let s = |p: &str| d.join(p).to_str().unwrap().to_string();
        assert!(err(&args(d, &["--out", &s("")])).contains("is a directory"));
        assert!(err(&args(d, &["--out", &s("o.jsonl"), "--summary", &s("no/dir/s.json")])).contains("no/dir"));
        assert!(err(&args(d, &["--out", &s("no/o.jsonl")])).contains("--out"));
        let e = err(&args(d, &["--out", "/dev/null", "--resume"]));
        assert!(e.contains("--resume needs --out to be a regular file"), "{e}");
        check(&args(d, &["--out", "/dev/null"])).unwrap();
        check(&args(d, &["--out", &s("new.jsonl"), "--resume"])).unwrap();
    }

    #[test]
    fn atomic_write_replaces_through_symlinks_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("real.json"), "old").unwrap();
        std::os::unix::fs::symlink(d.join("real.json"), d.join("link.json")).unwrap();
        write_atomic(&d.join("link.json"), b"new").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("real.json")).unwrap(), "new");
        assert!(std::fs::symlink_metadata(d.join("link.json"))
            .unwrap()
            .file_type()
            .is_symlink());
        write_atomic(Path::new("/dev/null"), b"x").unwrap();
        let names: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
