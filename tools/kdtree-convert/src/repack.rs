//! `kdtree-convert repack`: checkpoint (+ drafter) → rank shards + manifest.toml + SHA256SUMS.
//! Order of work: open and validate every source header and the whole plan before OUT is touched; then
//! write each planned file as `*.partial` (SHA-256 of the file and xxh3-64 of each tensor while writing), rename it,
//! and record them in `OUT/.kdtree-convert/<file>.json` (keyed by a job id, so a re-run skips it); manifest.toml and
//! SHA256SUMS come last (temp + rename), then the records are removed. Killed at any moment, the same
//! command resumes and ends with the same bytes as an uninterrupted run. The tokenizer / chat-template
//! files of SRC (`manifest::AUX_FILES`, each optional) are copied first, the same way (stream, hash,
//! `*.partial` + rename, record keyed by the source's sha256), and listed in `[[aux_files]]` and SHA256SUMS.
//! Before the first byte: OUT is locked (lock.rs), SRC's state is compared with the stamp of any
//! earlier run (stamp.rs: a changed source is converted again, never mixed) and the free space is
//! checked (statvfs). Tests: tools/kdtree-convert/tests/repack.rs (determinism, kill -9 resume),
//! tests/bad_input.rs, tests/bad_config.rs, tests/aux_files.rs (carried files), tests/lock.rs,
//! tests/stale_source.rs, tests/messages.rs (notices, free space).

use crate::emit::emit;
use crate::lock::{lock_out, LOCK_FILE};
use crate::progress::Progress;
use crate::source::{self, AuxSource, Checkpoint};
use crate::stamp::{Stamp, STAMP_FILE};
use anyhow::{bail, Context, Result};
use kdtree_formats::assemble::{build_manifest, file_specs, planned_record, FileRecord, ManifestInputs, TensorRecord};
use kdtree_formats::manifest::{
    json_to_toml, sha256sums, AuxFile, Manifest, Model, FORMAT_VERSION, MANIFEST, SHA256SUMS,
};
use kdtree_formats::plan::{assign_files, plan_model, ExpertsMode, Plan, PlannedFile, SourceQuant};
use kdtree_formats::writer::{partial_path, write_atomic, ShardWriter};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Directory (inside OUT) of per-file completion records; removed when the conversion completes.
pub const STATE_DIR: &str = ".kdtree-convert";
/// Default `--max-file-size`: 5 GiB of tensor data per file.
pub const DEFAULT_MAX_FILE_SIZE: u64 = 5 << 30;
/// Writer threads at most: bounds memory (each holds one 4 MiB write buffer and ≤ 12 MiB of mapped source pages).
pub const MAX_THREADS: usize = 8;

/// What to convert and how.
#[derive(Debug, Clone)]
pub struct RepackOptions {
    pub src: PathBuf,
    pub out: PathBuf,
    pub drafter: Option<PathBuf>,
    pub ranks: usize,
    pub experts: ExpertsMode,
    pub max_file_size: u64,
    pub quiet: bool,
}

/// Per-file completion record on disk.
#[derive(serde::Serialize, serde::Deserialize)]
struct Done {
    job: String,
    record: FileRecord,
}

/// Everything decided before a byte is written.
struct Job {
    ck: Checkpoint,
    plan: Plan,
    files: Vec<PlannedFile>,
    planned: Vec<FileRecord>,
    inputs: ManifestInputs,
    /// Files carried from SRC as they are (tokenizer, chat template), hashed when the job was prepared.
    aux: Vec<AuxSource>,
}

fn prepare(o: &RepackOptions) -> Result<Job> {
    if o.max_file_size == 0 {
        bail!("--max-file-size must be positive");
    }
    let ck = source::open(&o.src, o.drafter.as_deref())?;
    let plan = plan_model(&ck.text, ck.drafter.as_ref(), &ck.prefix, ck.quant, o.ranks, o.experts)?;
    ck.check_against(&plan)?;
    let files = assign_files(&plan, o.max_file_size);
    let planned = files
        .iter()
        .map(|f| planned_record(&plan, f))
        .collect::<Result<Vec<_>, _>>()?;
    let aux = source::aux_files(&o.src)?;
    let text_config = json_to_toml(&ck.text_json)
        .and_then(|v| v.as_table().cloned())
        .unwrap_or_default();
    let inputs = ManifestInputs {
        generator: format!("kdtree-convert {}", env!("CARGO_PKG_VERSION")),
        skipped: ck.skipped.clone(),
        source: ck.fingerprint.clone(),
        model: Model {
            text_config_json: ck.text_json.to_string(),
            drafter_config_json: ck.drafter_json.as_ref().map(|j| j.to_string()),
            text_config,
            drafter_config: ck
                .drafter_json
                .as_ref()
                .and_then(json_to_toml)
                .and_then(|v| v.as_table().cloned()),
        },
        max_file_size: o.max_file_size,
        experts_source: match ck.quant {
            SourceQuant::Int4 => "int4 (carried bit-exactly)".into(),
            SourceQuant::Bf16 => "bf16 (quantized by kdtree-convert)".into(),
        },
    };
    Ok(Job {
        ck,
        plan,
        files,
        planned,
        inputs,
        aux,
    })
}

/// Identity of one output file's content: source fingerprint, options and the file's tensor plan.
fn job_id(job: &Job, f: &PlannedFile) -> String {
    let mut h = Sha256::new();
    h.update(
        format!(
            "{:?}|{}|{:?}|{:?}|",
            job.inputs.source, job.inputs.experts_source, f.name, job.plan.experts
        )
        .as_bytes(),
    );
    for &i in &f.tensors {
        h.update(format!("{:?}\n", job.plan.tensors[i]).as_bytes());
    }
    hex::encode(h.finalize())
}

/// OUT may only hold what this conversion writes (and run-time files, `manifest::is_runtime_file`).
fn check_out_dir(out: &Path, files: &[PlannedFile], aux: &[AuxSource]) -> Result<()> {
    let mut ours: std::collections::HashSet<String> = [MANIFEST, SHA256SUMS, STATE_DIR, LOCK_FILE, STAMP_FILE]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for n in files
        .iter()
        .map(|f| f.name.as_str())
        .chain(aux.iter().map(|a| a.name.as_str()))
        .chain([MANIFEST, SHA256SUMS])
    {
        ours.insert(n.to_string());
        ours.insert(format!("{n}.partial"));
    }
    ours.insert(format!("{STAMP_FILE}.partial"));
    for e in std::fs::read_dir(out).with_context(|| format!("listing {}", out.display()))? {
        let name = e?.file_name().to_string_lossy().into_owned();
        // A run-time file (a calibrated cost model) lives beside the model: left as it is.
        if !ours.contains(&name) && !kdtree_formats::manifest::is_runtime_file(&name) {
            bail!(
                "{}: holds {name:?}, which this conversion would not write; use an empty or new OUT directory",
                out.display()
            );
        }
    }
    Ok(())
}

/// Write one planned file (or reuse it when its record matches) and return its record.
fn write_file(job: &Job, o: &RepackOptions, i: usize, prog: &Progress) -> Result<FileRecord> {
    let f = &job.files[i];
    let id = job_id(job, f);
    let path = o.out.join(&f.name);
    let rec_path = o.out.join(STATE_DIR).join(format!("{}.json", f.name));
    if let Ok(body) = std::fs::read(&rec_path) {
        if let Ok(done) = serde_json::from_slice::<Done>(&body) {
            let on_disk = std::fs::metadata(&path).map(|m| m.len()).ok();
            if done.job == id && on_disk == Some(done.record.size) && done.record.size == job.planned[i].size {
                prog.inc(f.data_bytes);
                return Ok(done.record);
            }
        }
    }
    let mut w = ShardWriter::create(&path, file_specs(&job.plan, f))?;
    for &ti in &f.tensors {
        let t = &job.plan.tensors[ti];
        emit(&job.ck, t, &mut w, prog)
            .with_context(|| format!("writing \"{}\" (rank {}) into {}", t.name, t.rank, f.name))?;
    }
    let done = w.finish()?;
    let record = FileRecord {
        name: f.name.clone(),
        size: done.size,
        sha256: done.sha256,
        tensors: done
            .tensors
            .into_iter()
            .map(|t| TensorRecord {
                name: t.name,
                offset: t.offset,
                nbytes: t.nbytes,
                xxh3: t.xxh3,
            })
            .collect(),
    };
    if record.size != job.planned[i].size {
        bail!(
            "internal: {} is {} bytes, planned {}",
            f.name,
            record.size,
            job.planned[i].size
        );
    }
    let body = serde_json::to_vec(&Done {
        job: id,
        record: record.clone(),
    })?;
    write_atomic(&rec_path, &body)?;
    Ok(record)
}

/// The manifest entry a carried file gets.
fn aux_entry(a: &AuxSource) -> AuxFile {
    AuxFile {
        name: a.name.clone(),
        size: a.size,
        sha256: a.sha256.clone(),
    }
}

/// Copy one carried file byte-exactly: stream `SRC/name` (symlinks followed) into `OUT/name.partial`,
/// hashing as it goes, fsync, check size and sha256 against what `prepare` found (so a source changed
/// meanwhile is refused, not half-carried), rename, record. Reused when its record names the same source
/// content and the file in OUT has that size.
fn copy_aux(o: &RepackOptions, a: &AuxSource) -> Result<AuxFile> {
    let id = format!("aux|{}|{}|{}", a.name, a.size, a.sha256);
    let path = o.out.join(&a.name);
    let rec_path = o.out.join(STATE_DIR).join(format!("{}.json", a.name));
    if let Ok(body) = std::fs::read(&rec_path) {
        if let Ok(done) = serde_json::from_slice::<Done>(&body) {
            if done.job == id && std::fs::metadata(&path).map(|m| m.len()).ok() == Some(a.size) {
                return Ok(aux_entry(a));
            }
        }
    }
    let partial = partial_path(&path);
    let mut src = std::fs::File::open(&a.path).with_context(|| format!("opening {}", a.path.display()))?;
    let mut dst = std::fs::File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut h = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = src
            .read(&mut buf)
            .with_context(|| format!("reading {}", a.path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        dst.write_all(&buf[..n])
            .with_context(|| format!("writing {}", partial.display()))?;
        size += n as u64;
    }
    dst.sync_all()
        .with_context(|| format!("writing {}", partial.display()))?;
    drop(dst);
    let sha256 = hex::encode(h.finalize());
    if size != a.size || sha256 != a.sha256 {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "{}: changed during the conversion ({} bytes, sha256 {sha256}; was {} bytes, {}); re-run",
            a.path.display(),
            size,
            a.size,
            a.sha256
        );
    }
    std::fs::rename(&partial, &path)
        .with_context(|| format!("renaming {} to {}", partial.display(), path.display()))?;
    let record = FileRecord {
        name: a.name.clone(),
        size,
        sha256,
        tensors: Vec::new(),
    };
    write_atomic(&rec_path, &serde_json::to_vec(&Done { job: id, record })?)?;
    Ok(aux_entry(a))
}

/// Writer threads per core: a thread stalls on the page faults of cold source pages (a disk read each),
/// so more threads than cores keep the cores hashing while others wait. Measured on 2 cores (10 GiB
/// k26-bench, 2 layers, page cache dropped, 3 rounds): 1 per core 17.7–18.7 s, 2 per core 15.0–15.1 s,
/// 4 per core 14.0–14.3 s, `cp -r` 11.5–12.2 s; bench/RESULTS.md.
pub const THREADS_PER_CORE: usize = 4;

/// Threads writing `files` output files: [`THREADS_PER_CORE`] per core, at most MAX_THREADS, at most one
/// per file.
pub fn writer_threads(files: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores * THREADS_PER_CORE).min(MAX_THREADS).min(files.max(1))
}

/// Write every planned file on up to MAX_THREADS threads. Files are taken in (part, rank) order, so the
/// threads work on the same layers of different ranks at once and share the source pages in the page
/// cache (a K-split down_proj slice reads every page of its source tensor). Stops at the first error.
fn write_all(job: &Job, o: &RepackOptions, prog: &Progress) -> Result<Vec<FileRecord>> {
    let mut order: Vec<usize> = (0..job.files.len()).collect();
    order.sort_by_key(|&i| (job.files[i].part, job.files[i].rank));
    let threads = writer_threads(order.len());
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let slots: Mutex<Vec<Option<Result<FileRecord>>>> = Mutex::new((0..order.len()).map(|_| None).collect());
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= order.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let r = write_file(job, o, order[k], prog);
                if r.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                slots.lock().expect("no panics while holding the lock")[order[k]] = Some(r);
            });
        }
    });
    let slots = slots.into_inner().expect("threads joined");
    if let Some(e) = slots.iter().position(|r| matches!(r, Some(Err(_)))) {
        return Err(slots
            .into_iter()
            .nth(e)
            .flatten()
            .expect("present")
            .expect_err("is an error"));
    }
    slots
        .into_iter()
        .map(|r| r.ok_or_else(|| anyhow::anyhow!("internal: a file was not written"))?)
        .collect()
}

/// The manifest of a complete earlier run (manifest + sums, no state left) whose shards are exactly this
/// conversion's (same source, config, plan, file names and sizes on disk); its carried files may differ.
fn complete_shards(job: &Job, out: &Path) -> Option<Manifest> {
    if out.join(STATE_DIR).exists() || !out.join(SHA256SUMS).is_file() {
        return None;
    }
    let text = std::fs::read_to_string(out.join(MANIFEST)).ok()?;
    let m = Manifest::parse(MANIFEST, &text).ok()?;
    // An older format's manifest (per-tensor sha256) is rewritten whole, never patched into this one.
    let same = m.format_version == FORMAT_VERSION
        && m.source == job.inputs.source
        && m.model == job.inputs.model
        && m.plan.ranks == job.plan.ranks
        && m.plan.experts == job.plan.experts
        && m.plan.max_file_size == job.inputs.max_file_size
        && m.files.len() == job.files.len()
        && m.files.iter().zip(&job.planned).all(|(a, b)| {
            a.name == b.name
                && a.size == b.size
                && std::fs::metadata(out.join(&a.name)).map(|x| x.len()).ok() == Some(a.size)
        });
    same.then_some(m)
}

/// Whether the carried files of a complete manifest are this conversion's, present with their sizes.
fn aux_complete(job: &Job, m: &Manifest, out: &Path) -> bool {
    m.aux_files == job.aux.iter().map(aux_entry).collect::<Vec<_>>()
        && m.aux_files
            .iter()
            .all(|a| std::fs::metadata(out.join(&a.name)).map(|x| x.len()).ok() == Some(a.size))
}

/// Turn the shard entries of a complete earlier manifest back into completion records, so only the
/// carried files are redone (e.g. tokenizer files added to SRC after a conversion, or a manifest that
/// predates `[[aux_files]]`). A file whose tensor entries do not match the plan gets no record (rewritten).
fn seed_records(job: &Job, o: &RepackOptions, m: &Manifest) -> Result<()> {
    for (i, (f, fe)) in job.files.iter().zip(&m.files).enumerate() {
        let tensors: Vec<TensorRecord> = m
            .tensors
            .iter()
            .filter(|t| t.file == fe.name)
            .map(|t| TensorRecord {
                name: t.name.clone(),
                offset: t.offset,
                nbytes: t.nbytes,
                xxh3: t.xxh3.clone(),
            })
            .collect();
        let planned = &job.planned[i].tensors;
        let fits = tensors.len() == planned.len()
            && tensors
                .iter()
                .zip(planned)
                .all(|(a, b)| a.name == b.name && a.offset == b.offset && a.nbytes == b.nbytes);
        if !fits {
            continue;
        }
        let record = FileRecord {
            name: fe.name.clone(),
            size: fe.size,
            sha256: fe.sha256.clone(),
            tensors,
        };
        let body = serde_json::to_vec(&Done {
            job: job_id(job, f),
            record,
        })?;
        write_atomic(&o.out.join(STATE_DIR).join(format!("{}.json", f.name)), &body)?;
    }
    Ok(())
}

/// Run a conversion. Returns the manifest written.
pub fn repack(o: &RepackOptions) -> Result<Manifest> {
    let job = prepare(o)?;
    let inner = o.src.join("drafter");
    if o.drafter.is_none() && inner.join("config.json").is_file() {
        crate::elog!(
            "notice: {} holds a drafter, which is not converted without --drafter (add `--drafter {}` to include it)",
            inner.display(),
            inner.display()
        );
    }
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    let lock = lock_out(&o.out)?;
    let m = write_locked(o, job)?;
    lock.release();
    Ok(m)
}

/// Every file the conversion reads, in a fixed order (for the source stamp). Carried files are not in
/// it: each is checked by content (sha256) when copied, so one added or changed in SRC is recopied alone.
fn input_paths(o: &RepackOptions, job: &Job) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for dir in std::iter::once(&o.src).chain(o.drafter.as_ref()) {
        v.extend(
            ["config.json", "model.safetensors.index.json"]
                .iter()
                .map(|n| dir.join(n))
                .filter(|p| p.exists()),
        );
    }
    v.extend(job.ck.files.iter().map(|f| f.path.clone()));
    v
}

/// Drop every trace of an earlier conversion's progress (records, manifest, sums), so each file is
/// rewritten; the shards themselves are replaced as they are rewritten (`*.partial` + rename).
fn forget_previous(out: &Path) -> Result<()> {
    for n in [MANIFEST, SHA256SUMS] {
        let p = out.join(n);
        if p.exists() {
            std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
    }
    let st = out.join(STATE_DIR);
    if st.exists() {
        std::fs::remove_dir_all(&st).with_context(|| format!("removing {}", st.display()))?;
    }
    Ok(())
}

/// Bytes this run still has to write into `out`: every planned and carried file, less those already
/// there at their final size (a resumed run may reuse them; a stale `*.partial` is about to be replaced).
fn bytes_to_write(job: &Job, out: &Path) -> u64 {
    let sizes = job
        .planned
        .iter()
        .map(|r| (&r.name, r.size))
        .chain(job.aux.iter().map(|a| (&a.name, a.size)));
    let have = |n: &str, size: u64| std::fs::metadata(out.join(n)).is_ok_and(|m| m.len() == size);
    let partial = |n: &str| std::fs::metadata(partial_path(&out.join(n))).map_or(0, |m| m.len());
    sizes
        .map(|(n, size)| {
            if have(n, size) {
                0
            } else {
                size.saturating_sub(partial(n))
            }
        })
        .sum()
}

/// Refuse to start when the filesystem of `out` has less than `needed` bytes free for us (statvfs
/// f_bavail: what an unprivileged writer may use), so a conversion does not die hours in.
pub fn check_free_space(out: &Path, needed: u64) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(out.as_os_str().as_bytes())
        .with_context(|| format!("{}: path holds a NUL byte", out.display()))?;
    // SAFETY: statvfs writes into the zeroed struct we pass; the path is a valid NUL-terminated string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("statvfs {}", out.display()));
    }
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    if needed > free {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        bail!(
            "{}: not enough free space: this conversion needs {needed} bytes ({:.2} GiB) more, the filesystem has \
             {free} ({:.2} GiB) free",
            out.display(),
            gib(needed),
            gib(free)
        );
    }
    Ok(())
}

/// The conversion proper, with OUT locked.
fn write_locked(o: &RepackOptions, job: Job) -> Result<Manifest> {
    check_out_dir(&o.out, &job.files, &job.aux)?;
    let inputs = input_paths(o, &job);
    let stamp = Stamp::take(&inputs)?;
    let old = Stamp::read(&o.out);
    match &old {
        Some(old) => {
            if let Some(why) = old.diff(&stamp) {
                // Shards in OUT (finished or not) came from another source state: none may be kept.
                crate::elog!(
                    "notice: SRC changed since the conversion in {} was made ({why}); converting everything again",
                    o.out.display()
                );
                forget_previous(&o.out)?;
            }
        }
        None if o.out.join(MANIFEST).exists() || o.out.join(STATE_DIR).exists() => {
            crate::elog!(
                "notice: {} has no source stamp ({STAMP_FILE}: written by an older kdtree-convert); converting \
                 everything again",
                o.out.display()
            );
            forget_previous(&o.out)?;
        }
        None => {}
    }
    let prev = complete_shards(&job, &o.out);
    if let Some(m) = prev.as_ref().filter(|m| aux_complete(&job, m, &o.out)) {
        if old.as_ref().is_some_and(|s| !s.has_contents()) {
            // A conversion by an older kdtree-convert: record the source's content hashes now (one read of SRC,
            // which the fast check just found unchanged) so `verify --source --deep` can run.
            let mut hashed = stamp.clone();
            hashed.hash_contents(&AtomicBool::new(false))?;
            hashed.write(&o.out)?;
            crate::elog!(
                "notice: recorded the content hashes of SRC's files in {STAMP_FILE} \
                 (for `kdtree-convert verify --source --deep`)"
            );
        }
        if !o.quiet {
            crate::elog!(
                "{}: already complete (run `kdtree-convert verify` to re-hash)",
                o.out.display()
            );
        }
        return Ok(m.clone());
    }
    check_free_space(&o.out, bytes_to_write(&job, &o.out))?;
    // Before the first shard: what any shard in OUT from here on was made from.
    stamp.write(&o.out)?;
    std::fs::create_dir_all(o.out.join(STATE_DIR))?;
    if let Some(m) = &prev {
        // Shards complete, carried files differ: keep the shards (records first, so a kill from here on
        // still resumes without rewriting them).
        seed_records(&job, o, m)?;
    }
    // From here on, nothing verify would accept exists until the end.
    for n in [MANIFEST, SHA256SUMS] {
        let p = o.out.join(n);
        if p.exists() {
            std::fs::remove_file(&p).with_context(|| format!("removing stale {}", p.display()))?;
        }
    }
    let aux = job.aux.iter().map(|a| copy_aux(o, a)).collect::<Result<Vec<_>>>()?;
    let total: u64 = job.files.iter().map(|f| f.data_bytes).sum();
    let prog = Progress::new("repack", total, o.quiet);
    // The source's content hashes for `verify --source --deep`, streamed beside the writers (which read the
    // same files, so mostly from the page cache); stopped when the writers fail.
    let stop = AtomicBool::new(false);
    let (records, hashed) = std::thread::scope(|sc| {
        let hasher = sc.spawn(|| {
            let mut st = stamp.clone();
            st.hash_contents(&stop).map(|_| st)
        });
        let records = write_all(&job, o, &prog);
        if records.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        (records, hasher.join())
    });
    let records = records?;
    let hashed = hashed.map_err(|_| anyhow::anyhow!("hashing the source files: the thread panicked"))??;
    prog.finish();
    // A source changed under the run (its bytes may be in some shards and not others): no manifest.
    if let Some(why) = stamp.diff(&Stamp::take(&inputs)?) {
        bail!("SRC changed during the conversion ({why}); re-run to convert the new source");
    }
    hashed.write(&o.out)?;
    let mut manifest = build_manifest(&job.plan, &job.files, &records, job.inputs);
    manifest.aux_files = aux;
    let text = manifest.to_toml()?;
    write_atomic(&o.out.join(MANIFEST), text.as_bytes())?;
    let mut sums: Vec<(String, String)> = records.iter().map(|r| (r.name.clone(), r.sha256.clone())).collect();
    sums.extend(manifest.aux_files.iter().map(|a| (a.name.clone(), a.sha256.clone())));
    sums.push((MANIFEST.to_string(), hex::encode(Sha256::digest(text.as_bytes()))));
    write_atomic(&o.out.join(SHA256SUMS), sha256sums(&sums).as_bytes())?;
    std::fs::remove_dir_all(o.out.join(STATE_DIR))?;
    for n in job.files.iter().map(|f| &f.name).chain(job.aux.iter().map(|a| &a.name)) {
        let _ = std::fs::remove_file(partial_path(&o.out.join(n)));
    }
    if !o.quiet {
        let carried: Vec<&str> = manifest.aux_files.iter().map(|a| a.name.as_str()).collect();
        crate::elog!(
            "{}: {} files, {} tensors, {} bytes; carried {}",
            o.out.display(),
            manifest.files.len(),
            manifest.tensors.len(),
            manifest.files.iter().map(|f| f.size).sum::<u64>(),
            if carried.is_empty() {
                "no tokenizer files".to_string()
            } else {
                carried.join(", ")
            }
        );
    }
    Ok(manifest)
}
