//! `kdtree-convert verify`: re-hash every file (SHA-256) and every tensor (xxh3-64; sha256 in a format v1
//! manifest) in parallel, one streaming pass per file, against manifest.toml, check SHA256SUMS against the manifest,
//! and look for missing and extra files (run-time files beside the model, `manifest::is_runtime_file`, are named in
//! the verdict and not checked). The first bad file (in manifest order: shards, then `[[aux_files]]`) is named, with
//! the first bad tensor in it. Carried files (tokenizer, chat template) are hashed whole like the shards.
//! Exit: 0 ok, 1 a check failed (a missing or unparseable manifest.toml or SHA256SUMS included), 2 could
//! not run (DIR is not a directory, a file cannot be read). Tests: tests/verify.rs, tests/aux_files.rs.

use crate::progress::Progress;
use crate::stamp::{Stamp, STAMP_FILE};
use anyhow::{Context, Result};
use kdtree_formats::manifest::{
    is_runtime_file, parse_sha256sums, xxh3_hex, AuxFile, FileEntry, Manifest, TensorEntry, MANIFEST, SHA256SUMS,
};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::Path;
use xxhash_rust::xxh3::Xxh3;

/// Outcome of a verify run that could read the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Ok {
        files: usize,
        tensors: usize,
        bytes: u64,
        /// Run-time files found beside the model (`manifest::is_runtime_file`): named, not checked.
        runtime: Vec<String>,
    },
    /// What failed, naming the file (and tensor when one is to blame).
    Failed(String),
}

/// The per-tensor checksum of the manifest's version: v2 xxh3-64, v1 sha256.
enum TensorHash {
    Xxh3(Box<Xxh3>),
    Sha256(Sha256),
}

impl TensorHash {
    fn new(v1: bool) -> TensorHash {
        if v1 {
            TensorHash::Sha256(Sha256::new())
        } else {
            TensorHash::Xxh3(Box::new(Xxh3::new()))
        }
    }
    fn update(&mut self, b: &[u8]) {
        match self {
            TensorHash::Xxh3(h) => h.update(b),
            TensorHash::Sha256(h) => h.update(b),
        }
    }
    /// (name of the checksum, hex value); the hasher starts over.
    fn take(&mut self) -> (&'static str, String) {
        match self {
            TensorHash::Xxh3(h) => {
                let v = xxh3_hex(h.digest());
                h.reset();
                ("xxh3", v)
            }
            TensorHash::Sha256(h) => ("sha256", hex::encode(std::mem::take(h).finalize())),
        }
    }
}

/// Hash one file in a single pass; return the first problem found. `v1`: tensors carry sha256, not xxh3.
fn check_file(
    dir: &Path,
    f: &FileEntry,
    tensors: &[&TensorEntry],
    v1: bool,
    prog: &Progress,
) -> Result<Option<String>> {
    let p = dir.join(&f.name);
    let mut file = std::fs::File::open(&p).with_context(|| format!("opening {}", p.display()))?;
    let len = file.metadata()?.len();
    if len != f.size {
        let cut = tensors.iter().find(|t| t.offset + t.nbytes > len);
        let who = cut.map_or(String::new(), |t| {
            format!(
                ": tensor \"{}\" (bytes {}..{}) is cut off",
                t.name,
                t.offset,
                t.offset + t.nbytes
            )
        });
        return Ok(Some(format!(
            "{}: size {len}, manifest says {} (truncated or extended){who}",
            f.name, f.size
        )));
    }
    let mut fh = Sha256::new();
    let mut bad_tensor: Option<String> = None;
    let mut ti = 0usize;
    let mut th = TensorHash::new(v1);
    let mut pos = 0u64;
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        fh.update(chunk);
        let (cs, ce) = (pos, pos + n as u64);
        while ti < tensors.len() {
            let t = tensors[ti];
            let (ts, te) = (t.offset, t.offset + t.nbytes);
            let (a, b) = (ts.max(cs), te.min(ce));
            if a < b {
                th.update(&chunk[(a - cs) as usize..(b - cs) as usize]);
            }
            if te <= ce {
                let (what, got) = th.take();
                let want = if v1 { &t.sha256 } else { &t.xxh3 };
                if &got != want && bad_tensor.is_none() {
                    bad_tensor = Some(format!(
                        "tensor \"{}\" (rank {}): {what} {got}, manifest says {want}",
                        t.name, t.rank
                    ));
                }
                ti += 1;
            } else {
                break;
            }
        }
        pos = ce;
        prog.inc(n as u64);
    }
    let got = hex::encode(fh.finalize());
    if got == f.sha256 {
        return Ok(None);
    }
    Ok(Some(match bad_tensor {
        Some(t) => format!("{}: {t}", f.name),
        None => format!(
            "{}: sha256 {got}, manifest says {} (header bytes differ; every tensor matches)",
            f.name, f.sha256
        ),
    }))
}

/// Hash one carried (aux) file whole; return the problem found, if any.
fn check_aux(dir: &Path, a: &AuxFile, prog: &Progress) -> Result<Option<String>> {
    let p = dir.join(&a.name);
    let mut file = std::fs::File::open(&p).with_context(|| format!("opening {}", p.display()))?;
    let len = file.metadata()?.len();
    if len != a.size {
        return Ok(Some(format!(
            "{}: size {len}, manifest says {} (truncated or replaced)",
            a.name, a.size
        )));
    }
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        prog.inc(n as u64);
    }
    let got = hex::encode(h.finalize());
    Ok((got != a.sha256).then(|| {
        format!(
            "{}: sha256 {got}, manifest says {} (carried file modified)",
            a.name, a.sha256
        )
    }))
}

/// With `verify --source`: the source files recorded at conversion (`stamp.rs`) must be unchanged: by size,
/// mtime and inode (what the fast check trusts), and with `deep` by content too (every file re-hashed against
/// the xxh3-64 the conversion recorded). `deep` over a stamp without hashes (an older conversion) is an error.
pub fn check_source(dir: &Path, deep: bool) -> Result<Verdict> {
    let Some(old) = Stamp::read(dir) else {
        return Ok(Verdict::Failed(format!(
            "{STAMP_FILE}: missing or unreadable, so the source state of this conversion is unknown"
        )));
    };
    let paths: Vec<_> = old.files.iter().map(|f| f.path.clone()).collect();
    let now = match Stamp::take(&paths) {
        Ok(n) => n,
        Err(e) => {
            return Ok(Verdict::Failed(format!(
                "source: {e:#} (moved or deleted since the conversion?)"
            )))
        }
    };
    let changed = match old.diff(&now) {
        Some(why) => Some(why),
        None if deep => old
            .deep_diff()
            .with_context(|| format!("verify --deep of {}", dir.display()))?,
        None => None,
    };
    Ok(match changed {
        Some(why) => Verdict::Failed(format!("source changed since the conversion: {why}")),
        None => Verdict::Ok {
            files: old.files.len(),
            tensors: 0,
            bytes: old.files.iter().map(|f| f.size).sum(),
            runtime: Vec::new(),
        },
    })
}

/// `verify`, then (with `source`) `check_source` (by content too with `deep`); the first failure is the verdict.
pub fn verify_with_source(dir: &Path, source: bool, deep: bool, quiet: bool) -> Result<Verdict> {
    let v = verify(dir, quiet)?;
    if !source || matches!(v, Verdict::Failed(_)) {
        return Ok(v);
    }
    Ok(match check_source(dir, deep)? {
        Verdict::Ok { .. } => v,
        failed => failed,
    })
}

/// Verify the converted model in `dir`.
pub fn verify(dir: &Path, quiet: bool) -> Result<Verdict> {
    if !dir.is_dir() {
        anyhow::bail!("{}: not a directory", dir.display());
    }
    // A manifest or SHA256SUMS that is missing or does not parse is a failed check, as `sha256sum -c`
    // treats a malformed list: the directory is not a complete conversion.
    let mpath = dir.join(MANIFEST);
    let text = match std::fs::read(&mpath) {
        Ok(t) => t,
        Err(e) => return Ok(Verdict::Failed(format!("{MANIFEST}: cannot read: {e}"))),
    };
    let Ok(utf8) = std::str::from_utf8(&text) else {
        return Ok(Verdict::Failed(format!("{MANIFEST}: not UTF-8")));
    };
    let m = match Manifest::parse(MANIFEST, utf8) {
        Ok(m) => m,
        Err(e) => return Ok(Verdict::Failed(e.to_string())),
    };
    // SHA256SUMS: present, parseable, and in agreement with the manifest (it also covers manifest.toml).
    let spath = dir.join(SHA256SUMS);
    let Ok(sums_text) = std::fs::read_to_string(&spath) else {
        return Ok(Verdict::Failed(format!("{SHA256SUMS}: missing or unreadable")));
    };
    let sums: HashMap<String, String> = match parse_sha256sums(SHA256SUMS, &sums_text) {
        Ok(v) => v.into_iter().collect(),
        Err(e) => return Ok(Verdict::Failed(e.to_string())),
    };
    let mut want: HashMap<String, String> = m.files.iter().map(|f| (f.name.clone(), f.sha256.clone())).collect();
    want.extend(m.aux_files.iter().map(|a| (a.name.clone(), a.sha256.clone())));
    want.insert(MANIFEST.into(), hex::encode(Sha256::digest(&text)));
    for (n, h) in &want {
        match sums.get(n) {
            Some(s) if s == h => {}
            Some(s) => return Ok(Verdict::Failed(format!("{n}: {SHA256SUMS} says {s}, expected {h}"))),
            None => return Ok(Verdict::Failed(format!("{n}: not listed in {SHA256SUMS}"))),
        }
    }
    if let Some(n) = sums.keys().find(|n| !want.contains_key(*n)) {
        return Ok(Verdict::Failed(format!(
            "{n}: listed in {SHA256SUMS} but not in the manifest"
        )));
    }
    // Missing and extra files.
    let mut present = BTreeSet::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        present.insert(e?.file_name().to_string_lossy().into_owned());
    }
    if let Some(n) = m
        .files
        .iter()
        .map(|f| &f.name)
        .chain(m.aux_files.iter().map(|a| &a.name))
        .find(|n| !present.contains(*n))
    {
        return Ok(Verdict::Failed(format!("{n}: missing")));
    }
    let extra = |n: &&String| !want.contains_key(*n) && n.as_str() != SHA256SUMS && n.as_str() != STAMP_FILE;
    let runtime: Vec<String> = present
        .iter()
        .filter(extra)
        .filter(|n| is_runtime_file(n))
        .cloned()
        .collect();
    if let Some(x) = present.iter().filter(extra).find(|n| !is_runtime_file(n)) {
        return Ok(Verdict::Failed(format!("{x}: extra file not in the manifest")));
    }
    let mut by_file: HashMap<&str, Vec<&TensorEntry>> = HashMap::new();
    for t in &m.tensors {
        by_file.entry(t.file.as_str()).or_default().push(t);
    }
    for v in by_file.values_mut() {
        v.sort_by_key(|t| t.offset);
    }
    let total: u64 = m
        .files
        .iter()
        .map(|f| f.size)
        .chain(m.aux_files.iter().map(|a| a.size))
        .sum();
    let prog = Progress::new("verify", total, quiet);
    let results: Vec<Option<String>> = m
        .files
        .par_iter()
        .map(|f| {
            check_file(
                dir,
                f,
                by_file.get(f.name.as_str()).map_or(&[][..], |v| v.as_slice()),
                m.format_version == 1,
                &prog,
            )
        })
        .collect::<Result<_>>()?;
    let aux_results: Vec<Option<String>> = m
        .aux_files
        .par_iter()
        .map(|a| check_aux(dir, a, &prog))
        .collect::<Result<_>>()?;
    prog.finish();
    if let Some(bad) = results.into_iter().chain(aux_results).flatten().next() {
        return Ok(Verdict::Failed(bad));
    }
    // Every byte is as listed; the listing itself must also be what a reader accepts (configs in bounds,
    // every entry the planned one), or a manifest edited together with SHA256SUMS would pass here and fail
    // in the runner.
    if let Err(e) = kdtree_formats::ModelDir::open(dir) {
        return Ok(Verdict::Failed(e.to_string()));
    }
    Ok(Verdict::Ok {
        files: m.files.len() + m.aux_files.len(),
        tensors: m.tensors.len(),
        bytes: total,
        runtime,
    })
}
