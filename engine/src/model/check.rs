//! The load check (issue 29 item 2): every weight a run loads against the manifest's xxh3-64 of its shard bytes.
//! Three forms ([`WeightCheck`]): the host form hashes the shard bytes, either on a pool of its own beside the
//! upload ([`HostChecks`]; the CPU backend, where those are the bytes the ops read) or in the upload's own copy
//! (a GPU: `Resources::hashes_uploads`, the staging buffers of cuda/load.rs, no second read of the shard); the
//! device form hashes each upload where the ops read it ([`check_upload`]). Used by the target's loader
//! (weights.rs `Ld`) and the drafter's (drafter/mod.rs). Tests: tools/kdtree-run/tests/load_check.rs (a damaged
//! shard refused in every form), engine/tests/cuda_ops.rs (the staged hash at every chunk boundary).

use crate::backend::{Backend, WeightCheck, WeightRef};
use anyhow::{ensure, Context, Result};
use kdtree_formats::TensorRef;
use std::sync::Arc;

use super::source::TensorSource;
use super::weights::tensor_at;

/// The host form's verdict on `what` (a tensor's shard bytes that hash to `got`): a difference from the
/// manifest's `want` (none recorded: a source without checksums) names the tensor, its file and both values.
pub(crate) fn host_verdict(what: &str, got: u64, want: Option<u64>) -> Result<()> {
    if let Some(want) = want {
        ensure!(
            got == want,
            "{what}: the shard's bytes hash to {got:016x} where the manifest's xxh3 is {want:016x}: the shard file \
             is not what was converted"
        );
    }
    Ok(())
}

/// `t`'s shard bytes against the manifest's xxh3-64 (`what` names the tensor; a source without checksums has
/// nothing to check).
pub(crate) fn check_host_bytes(what: &str, t: &TensorRef<'_>) -> Result<()> {
    match t.xxh3 {
        Some(want) => host_verdict(what, crate::xxh3::xxh3_64_par(t.data), Some(want)),
        None => Ok(()),
    }
}

/// The threads of the host load check: a pool of their own (half the cores), so that the hashes never hold the
/// global pool's threads that the GPU loader's staging copies run on (cuda/load.rs).
fn hash_pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(2, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads((n / 2).max(1))
            .thread_name(|i| format!("kdtree-hash-{i}"))
            .build()
            .expect("the load check's thread pool")
    })
}

/// The host form of the load check ([`WeightCheck::Host`]): each tensor's shard bytes hashed on a pool of their
/// own ([`hash_pool`]; a large tensor's 1 KiB blocks on several threads, [`crate::xxh3::xxh3_64_par`]) while the
/// loader goes on uploading; [`HostChecks::finish`] waits for every hash and reports the first
/// difference in the order the tensors were loaded.
pub(crate) struct HostChecks {
    tx: std::sync::mpsc::Sender<(usize, Result<()>)>,
    rx: std::sync::mpsc::Receiver<(usize, Result<()>)>,
    spawned: std::cell::Cell<usize>,
}

impl HostChecks {
    pub(crate) fn new() -> HostChecks {
        let (tx, rx) = std::sync::mpsc::channel();
        HostChecks {
            tx,
            rx,
            spawned: std::cell::Cell::new(0),
        }
    }
    /// Hash tensor `name` of `rank` (as `src` gives it) against the manifest's xxh3-64 on a rayon thread; a
    /// source without checksums has nothing to check.
    pub(crate) fn spawn(&self, src: &Arc<dyn TensorSource>, name: &str, rank: usize) {
        let (src, name, tx, i) = (src.clone(), name.to_string(), self.tx.clone(), self.spawned.get());
        self.spawned.set(i + 1);
        hash_pool().spawn(move || {
            let r = src
                .tensor(&name, rank)
                .and_then(|t| check_host_bytes(&tensor_at(&name, rank, &t), &t));
            let _ = tx.send((i, r)); // the receiver lives until every spawned hash has answered
        });
    }
    /// Wait for every hash spawned; the first difference (in spawn order) is the error.
    pub(crate) fn finish(self) -> Result<()> {
        let mut first: Option<(usize, anyhow::Error)> = None;
        for _ in 0..self.spawned.get() {
            let (i, r) = self
                .rx
                .recv()
                .context("a load-check hash thread ended without answering")?;
            if let Err(e) = r {
                if first.as_ref().is_none_or(|(j, _)| i < *j) {
                    first = Some((i, e));
                }
            }
        }
        first.map_or(Ok(()), |(_, e)| Err(e))
    }
}

/// What an upload of `t` must hash to: the manifest's xxh3-64, or (a source without checksums) the host bytes'
/// own, with the name of which it is.
pub(crate) fn expected_xxh3(t: &TensorRef<'_>) -> (u64, &'static str) {
    match t.xxh3 {
        Some(h) => (h, "the manifest's xxh3"),
        None => (kdtree_formats::manifest::xxh3_64(t.data), "the xxh3 of the host bytes"),
    }
}

/// The device form of the load check ([`WeightCheck::Device`]; otherwise nothing): part `part` of the uploaded
/// `w`'s bytes, hashed where the ops read them, against `want` (`of` says what it is). A difference names `what`
/// and both values.
/// The one check of every loader (the target's `Ld`, the drafter's shards and gathered tensors).
pub(crate) fn check_upload<B: Backend>(
    b: &B,
    what: &str,
    want: (u64, &str),
    w: WeightRef<'_, B>,
    part: usize,
) -> Result<()> {
    check_upload_parts(b, w, &[(part, what, want)])
}

/// [`check_upload`] of several parts of one upload (an INT4 stack's packed bytes and scales), hashed once:
/// `(part, what, (want, of))` each.
pub(crate) fn check_upload_parts<B: Backend>(
    b: &B,
    w: WeightRef<'_, B>,
    parts: &[(usize, &str, (u64, &str))],
) -> Result<()> {
    if b.weight_check() != WeightCheck::Device || parts.is_empty() {
        return Ok(());
    }
    let got = b
        .weight_xxh3(w)
        .with_context(|| format!("hashing {} where it was uploaded", parts[0].1))?;
    for &(part, what, (want, of)) in parts {
        ensure!(
            got.get(part) == Some(&want),
            "{what}: the uploaded bytes hash to {} where {of} is {want:016x}: the weights on the {} backend are not \
             the file's",
            got.get(part).map_or("nothing".into(), |h| format!("{h:016x}")),
            b.name()
        );
    }
    Ok(())
}
