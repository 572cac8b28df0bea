//! Tensor parallelism with a thread per GPU (issue 11): a model converted for R ranks runs as G groups of R/G
//! ranks ("GPUs"), each group on its own thread with its own backend (stream, weights, caches and captured
//! graphs), loading only its own ranks' shards ([`Weights::load_group`]). Every group runs the same model
//! code as one GPU does; its all-reduces (after o_proj, after the MoE / MLP) and the vocab merges of
//! embed_tokens / lm_head go through its backend's communicator:
//! * CPU: [`crate::cpu::comm::HostGroup`] (rank-order sum on the host; what CI checks),
//! * one GPU, G groups side by side ([`Placement::SharedGpu`]): `cuda::comm::SharedGpu`, a device-side
//!   rendezvous inside every group's graphs,
//! * G GPUs ([`Placement::Gpus`]): NCCL (`cuda::comm::Nccl::group`), one communicator per GPU.
//!
//! Driving: [`TpTarget`] / [`TpDrafter`] / [`TpBatchOps`] are the engine's `Target` / `Drafter` / `BatchOps`
//! for the whole run. Each call goes to every group's thread, which makes the same call on its own session;
//! the groups then run it in lock-step with no host round trip between them (a DDTree round or AR step is one
//! graph launch per group with the collectives inside; the groups' threads only pace their launches at
//! `cuda::comm::LaunchGate`s, see docs/design/tensor-parallel.md). Every group computes the replicated parts itself (norms,
//! q_a / kv_a, the router, the tree, the walk) from the same summed values, so the host decisions agree; the
//! results of each call are compared across groups (a difference is an error naming the group), then group
//! 0's are returned. Sessions, batches and `generate` above are unchanged.
//!
//! Must match: one controller running all R ranks (model/attention.rs, ffn.rs): with one rank per group the
//! sums are the same chain of adds in the same order, so the tokens are the same bit for bit.
//! Tests: engine/tests/tp_ranks.rs (CPU), engine/tests/cuda_tp.rs (one GPU), scripts/gpu-test.sh.

use crate::api::{
    BatchItem, BatchOps, BatchOut, DeviceRound, Drafter, LogitRows, PrefillItem, StepKind, StepOut, Target, TargetInfo,
};
use crate::model::open::{Loaded, OpenOptions};
use crate::model::source::TensorSource;
use crate::sampling::Sampling;
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// Where the groups of a run go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Every group a CPU backend on its own thread (host communicator).
    Cpu,
    /// Every group on this one GPU, each its own stream (the one-GPU communicator).
    SharedGpu(usize),
    /// Group g on GPU `ordinals[g]` (NCCL; the ordinals distinct).
    Gpus(Vec<usize>),
}

/// One group's sessions, owned by its thread: targets, drafters and batch ops by id.
#[derive(Default)]
pub struct GroupState {
    targets: HashMap<usize, Box<dyn Target>>,
    drafters: HashMap<usize, Box<dyn Drafter>>,
    ops: HashMap<usize, Box<dyn BatchOps>>,
}

impl GroupState {
    fn target(&mut self, id: usize) -> Result<&mut Box<dyn Target>> {
        self.targets
            .get_mut(&id)
            .ok_or_else(|| anyhow!("no target session {id}"))
    }
    fn drafter(&mut self, id: usize) -> Result<&mut Box<dyn Drafter>> {
        self.drafters
            .get_mut(&id)
            .ok_or_else(|| anyhow!("no drafter session {id}"))
    }
    /// Target `t` and drafter `d` at once.
    fn pair(&mut self, t: usize, d: usize) -> Result<(&mut dyn Target, &mut dyn Drafter)> {
        let dr = self
            .drafters
            .get_mut(&d)
            .ok_or_else(|| anyhow!("no drafter session {d}"))?;
        let tg = self
            .targets
            .get_mut(&t)
            .ok_or_else(|| anyhow!("no target session {t}"))?;
        Ok((&mut **tg, &mut **dr))
    }
}

type Job = Box<dyn FnOnce(&mut GroupState) + Send>;
/// A group's root sessions.
pub type Sessions = (Box<dyn Target>, Option<Box<dyn Drafter>>);
/// Prefill logits and the items' lengths after it.
type Prefilled = (Vec<Vec<f32>>, Vec<(usize, Option<usize>)>);

/// The groups' threads.
struct Pool {
    senders: Vec<Mutex<mpsc::Sender<Job>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    next_id: AtomicUsize,
    /// Wakes the groups waiting inside a collective when one failed (the host group; a GPU's waiters trap on
    /// their timeout).
    abort: Box<dyn Fn(&str) + Send + Sync>,
    /// The first failure of a call that could not return it (reset, release): every later call fails with it.
    poisoned: Mutex<Option<String>>,
    /// Groups sharing one device (its free memory is theirs together).
    per_device: usize,
    /// Log each group's calls (`KDTREE_TP_TRACE=1`, read once).
    trace: bool,
}

impl Pool {
    fn groups(&self) -> usize {
        self.senders.len()
    }
    fn new_id(&self) -> usize {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// `f` on every group's thread at once; their results in group order (the first failure is the error).
    fn all<T: Send + 'static>(
        &self,
        what: &str,
        f: impl Fn(&mut GroupState) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        if let Some(p) = self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bail!("tensor-parallel run failed earlier: {p}");
        }
        let f = Arc::new(f);
        let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
        let trace = self.trace;
        for (g, s) in self.senders.iter().enumerate() {
            let (f, tx, what) = (f.clone(), tx.clone(), what.to_string());
            let job: Job = Box::new(move |st| {
                if trace {
                    eprintln!("kdtree tp: group {g}: {what} ...");
                }
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(st))).unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(anyhow!("panicked: {msg}"))
                });
                if trace {
                    eprintln!(
                        "kdtree tp: group {g}: {what} done ({})",
                        if r.is_ok() { "ok" } else { "error" }
                    );
                }
                let _ = tx.send((g, r));
            });
            s.lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(job)
                .map_err(|_| anyhow!("group {g}'s thread has ended"))?;
        }
        drop(tx);
        let mut out: Vec<Option<Result<T>>> = (0..self.groups()).map(|_| None).collect();
        for _ in 0..self.groups() {
            let (g, r) = rx
                .recv()
                .map_err(|_| anyhow!("{what}: a group's thread ended mid-call"))?;
            if let Err(e) = &r {
                (self.abort)(&format!("group {g}: {what}: {e:#}"));
            }
            out[g] = Some(r);
        }
        // Every group's error, not only the first: the group that failed first is the cause, the others may
        // only have waited for it.
        let errs: Vec<String> = out
            .iter()
            .enumerate()
            .filter_map(|(g, r)| match r {
                Some(Err(e)) => Some(format!("group {g}: {e:#}")),
                None => Some(format!("group {g}: no result")),
                _ => None,
            })
            .collect();
        if !errs.is_empty() {
            bail!(
                "{what} failed on {} of {} groups: {}",
                errs.len(),
                self.groups(),
                errs.join("; ")
            );
        }
        Ok(out
            .into_iter()
            .map(|r| r.and_then(|r| r.ok()).expect("checked above"))
            .collect())
    }

    /// [`Pool::all`] where every group must give the same result (compared with `same`): group 0's.
    fn agreed<T: Send + 'static>(
        &self,
        what: &str,
        same: impl Fn(&T, &T) -> bool,
        f: impl Fn(&mut GroupState) -> Result<T> + Send + Sync + 'static,
    ) -> Result<T> {
        let mut outs = self.all(what, f)?.into_iter();
        let first = outs.next().context("no groups")?;
        for (g, o) in outs.enumerate() {
            ensure!(
                same(&first, &o),
                "{what}: group {} computed a different result from group 0 (the groups are out of lock-step)",
                g + 1
            );
        }
        Ok(first)
    }

    /// A call whose failure cannot be returned (reset, release, drop): it poisons the run.
    fn all_or_poison(&self, what: &str, f: impl Fn(&mut GroupState) -> Result<()> + Send + Sync + 'static) {
        if let Err(e) = self.all(what, f) {
            self.poisoned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(format!("{e:#}"));
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.senders.clear();
        for t in self.threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = t.join();
        }
    }
}

fn eq<T: PartialEq>(a: &T, b: &T) -> bool {
    a == b
}
/// Bitwise equality of f32 rows (NaN == NaN).
fn same_f32(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
fn same_out(a: &StepOut, b: &StepOut) -> bool {
    same_f32(&a.logits, &b.logits) && same_f32(&a.taps, &b.taps)
}

/// What a group thread builds at start: its root target and drafter.
pub type GroupInit = Box<dyn FnOnce() -> Result<Sessions> + Send>;

/// Start one thread per group (each runs its `init`, then serves calls), then the run's target and drafter.
/// `per_device`: groups sharing one device. `abort`: wakes groups stuck in a collective when one fails.
pub fn start(
    inits: Vec<GroupInit>,
    per_device: usize,
    abort: Box<dyn Fn(&str) + Send + Sync>,
    backend: &str,
    device: String,
) -> Result<Loaded> {
    let groups = inits.len();
    ensure!(groups >= 1, "no groups");
    let mut senders = Vec::new();
    let mut threads = Vec::new();
    let (ready_tx, ready_rx) = mpsc::channel::<(usize, Result<bool>)>();
    for (g, init) in inits.into_iter().enumerate() {
        let (tx, rx) = mpsc::channel::<Job>();
        let ready = ready_tx.clone();
        let t = std::thread::Builder::new()
            .name(format!("kdtree-tp-{g}"))
            .stack_size(64 << 20)
            .spawn(move || {
                let mut st = GroupState::default();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(init))
                    .unwrap_or_else(|_| Err(anyhow!("panicked while loading")));
                match r {
                    Ok((t, d)) => {
                        let has = d.is_some();
                        st.targets.insert(0, t);
                        if let Some(d) = d {
                            st.drafters.insert(0, d);
                        }
                        let _ = ready.send((g, Ok(has)));
                    }
                    Err(e) => {
                        let _ = ready.send((g, Err(e)));
                        return;
                    }
                }
                while let Ok(job) = rx.recv() {
                    job(&mut st);
                }
            })
            .context("starting a tensor-parallel group thread")?;
        senders.push(Mutex::new(tx));
        threads.push(t);
    }
    drop(ready_tx);
    let mut has_drafter = vec![false; groups];
    let mut first_err = None;
    for _ in 0..groups {
        match ready_rx.recv() {
            Ok((g, Ok(h))) => has_drafter[g] = h,
            Ok((g, Err(e))) => {
                abort(&format!("group {g} failed to load"));
                first_err.get_or_insert(e.context(format!("loading group {g} of {groups}")));
            }
            Err(_) => {
                first_err.get_or_insert(anyhow!("a group's thread ended while loading"));
                break;
            }
        }
    }
    let pool = Arc::new(Pool {
        senders,
        threads: Mutex::new(threads),
        next_id: AtomicUsize::new(1),
        abort,
        poisoned: Mutex::new(None),
        per_device: per_device.max(1),
        trace: std::env::var("KDTREE_TP_TRACE").is_ok_and(|v| v == "1"),
    });
    if let Some(e) = first_err {
        return Err(e);
    }
    ensure!(
        has_drafter.iter().all(|&h| h == has_drafter[0]),
        "the groups disagree on whether the model has a drafter"
    );
    let target = TpTarget::attach(pool.clone(), 0)?;
    let drafter = if has_drafter[0] {
        Some(Box::new(TpDrafter::attach(pool, 0)?) as Box<dyn Drafter>)
    } else {
        None
    };
    Ok(Loaded {
        backend: backend.into(),
        device,
        target: Box::new(target),
        drafter,
    })
}

/// The run's target: the same session on every group.
pub struct TpTarget {
    pool: Arc<Pool>,
    id: usize,
    info: TargetInfo,
    committed: usize,
    row_bytes: usize,
}

impl TpTarget {
    fn attach(pool: Arc<Pool>, id: usize) -> Result<TpTarget> {
        let (info, committed, row_bytes) = pool.agreed(
            "target info",
            |a: &(TargetInfo, usize, usize), b| format!("{:?}", a) == format!("{:?}", b),
            move |st| {
                let t = st.target(id)?;
                Ok((t.info().clone(), t.committed(), t.kv_row_bytes()))
            },
        )?;
        Ok(TpTarget {
            pool,
            id,
            info,
            committed,
            row_bytes,
        })
    }
    /// Groups in this run.
    pub fn groups(&self) -> usize {
        self.pool.groups()
    }

    /// `f` on this session in every group; the results must agree; the committed length is refreshed.
    fn call<T: Send + 'static>(
        &mut self,
        what: &str,
        same: fn(&T, &T) -> bool,
        f: impl Fn(&mut dyn Target) -> Result<T> + Send + Sync + 'static,
    ) -> Result<T> {
        let id = self.id;
        let (v, c) = self.pool.agreed(
            what,
            |a: &(T, usize), b| a.1 == b.1 && same(&a.0, &b.0),
            move |st| {
                let t = st.target(id)?;
                let v = f(&mut **t)?;
                Ok((v, t.committed()))
            },
        )?;
        self.committed = c;
        Ok(v)
    }
}

impl Drop for TpTarget {
    fn drop(&mut self) {
        let id = self.id;
        if id != 0 {
            self.pool.all_or_poison("drop a target session", move |st| {
                st.targets.remove(&id);
                Ok(())
            });
        }
    }
}

/// A round's or step's `Option<Result<T>>` as a `Result<Option<T>>` (the error crosses threads as a value).
fn flip<T>(r: Option<Result<T>>) -> Result<Option<T>> {
    r.transpose()
}

impl Target for TpTarget {
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn committed(&self) -> usize {
        self.committed
    }
    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        let (tokens, parents) = (tokens.to_vec(), parents.to_vec());
        self.call("forward", same_out, move |t| t.forward_rows(&tokens, &parents, rows))
    }
    fn commit(&mut self, path: &[usize]) -> Result<()> {
        let path = path.to_vec();
        self.call("commit", eq, move |t| t.commit(&path))
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.call("truncate", eq, move |t| t.truncate(len))
    }
    fn reset(&mut self) {
        let id = self.id;
        self.pool.all_or_poison("reset", move |st| {
            st.target(id)?.reset();
            Ok(())
        });
        self.committed = 0;
    }
    fn reserve(&mut self, rows: usize) -> Result<()> {
        self.call("reserve", eq, move |t| t.reserve(rows))
    }
    fn start_trace(&mut self) {
        let id = self.id;
        self.pool.all_or_poison("start a trace", move |st| {
            st.target(id)?.start_trace();
            Ok(())
        });
    }
    /// Group 0's recording (every group records the same replicated values; rank-split tensors are its own).
    fn take_trace(&mut self) -> Option<crate::model::Trace> {
        let id = self.id;
        self.pool
            .all("take a trace", move |st| Ok(st.target(id)?.take_trace()))
            .ok()?
            .into_iter()
            .next()
            .flatten()
    }
    fn device_round(
        &mut self,
        drafter: &mut dyn Drafter,
        root: u32,
        budget: usize,
        s: &Sampling,
    ) -> Option<Result<DeviceRound>> {
        let d = drafter.as_any_mut()?.downcast_mut::<TpDrafter>()?;
        let (tid, did, s) = (self.id, d.id, s.clone());
        let r = paired(&self.pool, "DDTree round", tid, did, move |t, d| {
            flip(t.device_round(d, root, budget, &s))
        });
        settle(self, d, r)
    }
    fn device_chain(&mut self, drafter: &mut dyn Drafter, root: u32, s: &Sampling) -> Option<Result<DeviceRound>> {
        let d = drafter.as_any_mut()?.downcast_mut::<TpDrafter>()?;
        let (tid, did, s) = (self.id, d.id, s.clone());
        let r = paired(&self.pool, "chain round", tid, did, move |t, d| {
            flip(t.device_chain(d, root, &s))
        });
        settle(self, d, r)
    }
    fn device_step(&mut self, root: u32, s: &Sampling) -> Option<Result<u32>> {
        let s = s.clone();
        self.call("AR step", eq, move |t| flip(t.device_step(root, &s)))
            .transpose()
    }
    fn fork(&self) -> Option<Box<dyn Target>> {
        let (id, new) = (self.id, self.pool.new_id());
        let forked = self.pool.agreed("fork a target session", eq, move |st| {
            let f = st.target(id)?.fork();
            let ok = f.is_some();
            if let Some(f) = f {
                st.targets.insert(new, f);
            }
            Ok(ok)
        });
        match forked {
            Ok(true) => Some(Box::new(TpTarget {
                pool: self.pool.clone(),
                id: new,
                info: self.info.clone(),
                committed: 0,
                row_bytes: self.row_bytes,
            })),
            _ => None,
        }
    }
    fn fork_pair(&self, drafts: bool) -> Option<(Box<dyn Target>, Option<Box<dyn Drafter>>)> {
        // Every group forks its own model (target and drafter together, model/seq.rs).
        let (id, tid, did) = (self.id, self.pool.new_id(), self.pool.new_id());
        let forked = self.pool.agreed("fork a model", eq, move |st| {
            let Some((t, d)) = st.target(id)?.fork_pair(drafts) else {
                return Ok(None);
            };
            st.targets.insert(tid, t);
            let dims = d.map(|d| {
                let dims = (d.block_size(), d.ctx_row_bytes());
                st.drafters.insert(did, d);
                dims
            });
            Ok(Some(dims))
        });
        let dims = forked.ok()??;
        let t = TpTarget {
            pool: self.pool.clone(),
            id: tid,
            info: self.info.clone(),
            committed: 0,
            row_bytes: self.row_bytes,
        };
        let d = dims.map(|(block, row_bytes)| {
            Box::new(TpDrafter {
                pool: self.pool.clone(),
                id: did,
                block,
                ctx_len: 0,
                row_bytes,
            }) as Box<dyn Drafter>
        });
        Some((Box::new(t), d))
    }
    fn batch_ops(&self) -> Option<Box<dyn BatchOps>> {
        let (id, new) = (self.id, self.pool.new_id());
        let made = self.pool.agreed("batch ops", eq, move |st| {
            let o = st.target(id)?.batch_ops();
            let ok = o.is_some();
            if let Some(o) = o {
                st.ops.insert(new, o);
            }
            Ok(ok)
        });
        match made {
            Ok(true) => Some(Box::new(TpBatchOps {
                pool: self.pool.clone(),
                id: new,
            })),
            _ => None,
        }
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn kv_row_bytes(&self) -> usize {
        self.row_bytes
    }
    fn release(&mut self) {
        let id = self.id;
        self.pool.all_or_poison("release", move |st| {
            st.target(id)?.release();
            Ok(())
        });
        self.committed = 0;
    }
    fn mem_free(&self) -> Option<usize> {
        // Each group's free memory; groups sharing a device share what it has free.
        let id = self.id;
        let free = self
            .pool
            .all("free memory", move |st| Ok(st.target(id)?.mem_free()))
            .ok()?;
        free.into_iter()
            .collect::<Option<Vec<usize>>>()?
            .into_iter()
            .min()
            .map(|f| f / self.pool.per_device)
    }
}

/// `f` over target `tid` and drafter `did` of every group, agreed; with both sessions' lengths.
fn paired<T: PartialEq + Send + 'static>(
    pool: &Pool,
    what: &str,
    tid: usize,
    did: usize,
    f: impl Fn(&mut dyn Target, &mut dyn Drafter) -> Result<T> + Send + Sync + 'static,
) -> Result<(T, usize, usize)> {
    pool.agreed(what, eq, move |st| {
        let (t, d) = st.pair(tid, did)?;
        let v = f(t, d)?;
        Ok((v, t.committed(), d.context_len()))
    })
}

/// A paired call's result, the lengths refreshed.
fn settle<T>(t: &mut TpTarget, d: &mut TpDrafter, r: Result<(Option<T>, usize, usize)>) -> Option<Result<T>> {
    match r {
        Ok((v, c, l)) => {
            (t.committed, d.ctx_len) = (c, l);
            v.map(Ok)
        }
        Err(e) => Some(Err(e)),
    }
}

/// The run's drafter: the same session on every group.
pub struct TpDrafter {
    pool: Arc<Pool>,
    id: usize,
    block: usize,
    ctx_len: usize,
    row_bytes: usize,
}

impl TpDrafter {
    fn attach(pool: Arc<Pool>, id: usize) -> Result<TpDrafter> {
        let (block, ctx_len, row_bytes) = pool.agreed("drafter info", eq, move |st| {
            let d = st.drafter(id)?;
            Ok((d.block_size(), d.context_len(), d.ctx_row_bytes()))
        })?;
        Ok(TpDrafter {
            pool,
            id,
            block,
            ctx_len,
            row_bytes,
        })
    }
    fn call<T: Send + 'static>(
        &mut self,
        what: &str,
        same: fn(&T, &T) -> bool,
        f: impl Fn(&mut dyn Drafter) -> Result<T> + Send + Sync + 'static,
    ) -> Result<T> {
        let id = self.id;
        let (v, l) = self.pool.agreed(
            what,
            |a: &(T, usize), b| a.1 == b.1 && same(&a.0, &b.0),
            move |st| {
                let d = st.drafter(id)?;
                let v = f(&mut **d)?;
                Ok((v, d.context_len()))
            },
        )?;
        self.ctx_len = l;
        Ok(v)
    }
}

impl Drop for TpDrafter {
    fn drop(&mut self) {
        let id = self.id;
        if id != 0 {
            self.pool.all_or_poison("drop a drafter session", move |st| {
                st.drafters.remove(&id);
                Ok(())
            });
        }
    }
}

impl Drafter for TpDrafter {
    fn block_size(&self) -> usize {
        self.block
    }
    fn context_len(&self) -> usize {
        self.ctx_len
    }
    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()> {
        let taps = taps.to_vec();
        self.call("drafter context", eq, move |d| d.extend_context(&taps, n))
    }
    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>> {
        self.call(
            "draft",
            |a: &Vec<f32>, b| same_f32(a, b),
            move |d| d.draft(bonus, start),
        )
    }
    fn truncate_context(&mut self, len: usize) -> Result<()> {
        self.call("drafter truncate", eq, move |d| d.truncate_context(len))
    }
    fn reset(&mut self) {
        let id = self.id;
        self.pool.all_or_poison("drafter reset", move |st| {
            st.drafter(id)?.reset();
            Ok(())
        });
        self.ctx_len = 0;
    }
    fn reserve(&mut self, rows: usize) {
        let id = self.id;
        self.pool.all_or_poison("drafter reserve", move |st| {
            st.drafter(id)?.reserve(rows);
            Ok(())
        });
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        let (id, new) = (self.id, self.pool.new_id());
        let forked = self.pool.agreed("fork a drafter session", eq, move |st| {
            let f = st.drafter(id)?.fork();
            let ok = f.is_some();
            if let Some(f) = f {
                st.drafters.insert(new, f);
            }
            Ok(ok)
        });
        match forked {
            Ok(true) => Some(Box::new(TpDrafter {
                pool: self.pool.clone(),
                id: new,
                block: self.block,
                ctx_len: 0,
                row_bytes: self.row_bytes,
            })),
            _ => None,
        }
    }
    fn ctx_row_bytes(&self) -> usize {
        self.row_bytes
    }
    fn release(&mut self) {
        let id = self.id;
        self.pool.all_or_poison("drafter release", move |st| {
            st.drafter(id)?.release();
            Ok(())
        });
        self.ctx_len = 0;
    }
}

/// One batch item as plain data: the sessions' ids and the step.
#[derive(Clone)]
struct ItemSpec {
    target: usize,
    drafter: Option<usize>,
    root: u32,
    kind: StepKind,
    sampling: Sampling,
}

fn tp_target(t: &mut dyn Target) -> Result<&mut TpTarget> {
    t.as_any_mut()
        .and_then(|a| a.downcast_mut::<TpTarget>())
        .context("a batch item whose target is not of this tensor-parallel run")
}
fn tp_drafter(d: &mut dyn Drafter) -> Result<&mut TpDrafter> {
    d.as_any_mut()
        .and_then(|a| a.downcast_mut::<TpDrafter>())
        .context("a batch item whose drafter is not of this tensor-parallel run")
}

fn spec(it: &mut BatchItem<'_>) -> Result<ItemSpec> {
    let target = tp_target(it.target)?.id;
    let drafter = match it.drafter.as_mut() {
        Some(d) => Some(tp_drafter(&mut **d)?.id),
        None => None,
    };
    Ok(ItemSpec {
        target,
        drafter,
        root: it.root,
        kind: it.kind,
        sampling: it.sampling.clone(),
    })
}

/// Takes the items' sessions out of `st`, runs `f` over them as batch items, puts them back; with each item's
/// lengths after it.
#[allow(clippy::type_complexity)]
fn with_items<T>(
    st: &mut GroupState,
    specs: &[ItemSpec],
    f: impl FnOnce(&mut dyn BatchOps, &mut [BatchItem<'_>]) -> T,
    ops: usize,
) -> Result<(T, Vec<(usize, Option<usize>)>)> {
    let mut ts: Vec<Box<dyn Target>> = Vec::with_capacity(specs.len());
    let mut ds: Vec<Option<Box<dyn Drafter>>> = Vec::with_capacity(specs.len());
    let put_back =
        |st: &mut GroupState, ts: Vec<Box<dyn Target>>, ds: Vec<Option<Box<dyn Drafter>>>, specs: &[ItemSpec]| {
            for ((t, d), s) in ts.into_iter().zip(ds).zip(specs) {
                st.targets.insert(s.target, t);
                if let (Some(d), Some(id)) = (d, s.drafter) {
                    st.drafters.insert(id, d);
                }
            }
        };
    for s in specs {
        let t = st.targets.remove(&s.target);
        let d = s.drafter.map(|id| st.drafters.remove(&id));
        match (t, d) {
            (Some(t), None) => {
                ts.push(t);
                ds.push(None);
            }
            (Some(t), Some(Some(d))) => {
                ts.push(t);
                ds.push(Some(d));
            }
            (t, d) => {
                // Put back what was taken (a session named twice, or gone).
                if let Some(t) = t {
                    st.targets.insert(s.target, t);
                }
                if let (Some(Some(d)), Some(id)) = (d, s.drafter) {
                    st.drafters.insert(id, d);
                }
                let n = ts.len();
                put_back(st, ts, ds, &specs[..n]);
                bail!(
                    "batch item of target {} / drafter {:?}: no such session (or named twice)",
                    s.target,
                    s.drafter
                );
            }
        }
    }
    let mut o = match st.ops.remove(&ops) {
        Some(o) => o,
        None => {
            put_back(st, ts, ds, specs);
            bail!("no batch ops {ops}");
        }
    };
    let out = {
        let mut items: Vec<BatchItem<'_>> = ts
            .iter_mut()
            .zip(ds.iter_mut())
            .zip(specs)
            .map(|((t, d), s)| BatchItem {
                target: &mut **t,
                drafter: d.as_mut().map(|d| &mut **d as &mut dyn Drafter),
                root: s.root,
                kind: s.kind,
                sampling: &s.sampling,
            })
            .collect();
        f(&mut *o, &mut items)
    };
    let lens = ts
        .iter()
        .zip(&ds)
        .map(|(t, d)| (t.committed(), d.as_ref().map(|d| d.context_len())))
        .collect();
    st.ops.insert(ops, o);
    put_back(st, ts, ds, specs);
    Ok((out, lens))
}

/// The run's batched steps: every group's `BatchOps` over its own sessions of the items.
pub struct TpBatchOps {
    pool: Arc<Pool>,
    id: usize,
}

impl Drop for TpBatchOps {
    fn drop(&mut self) {
        let id = self.id;
        self.pool.all_or_poison("drop batch ops", move |st| {
            st.ops.remove(&id);
            Ok(())
        });
    }
}

/// Refresh the run-side sessions' lengths after a batched call.
fn refresh(items: &mut [BatchItem<'_>], lens: &[(usize, Option<usize>)]) -> Result<()> {
    for (it, (c, l)) in items.iter_mut().zip(lens) {
        tp_target(it.target)?.committed = *c;
        if let (Some(d), Some(l)) = (it.drafter.as_mut(), l) {
            tp_drafter(&mut **d)?.ctx_len = *l;
        }
    }
    Ok(())
}

impl BatchOps for TpBatchOps {
    fn can_batch(&mut self, item: &mut BatchItem<'_>) -> bool {
        let Ok(s) = spec(item) else { return false };
        let ops = self.id;
        let r = self.pool.agreed("can batch", eq, move |st| {
            let (ok, lens) = with_items(st, std::slice::from_ref(&s), |o, items| o.can_batch(&mut items[0]), ops)?;
            Ok((ok, lens))
        });
        match r {
            Ok((ok, lens)) => refresh(std::slice::from_mut(item), &lens).is_ok() && ok,
            Err(_) => false,
        }
    }
    fn step(&mut self, items: &mut [BatchItem<'_>]) -> Result<Vec<BatchOut>> {
        let specs = items.iter_mut().map(spec).collect::<Result<Vec<_>>>()?;
        let ops = self.id;
        let (out, lens) = self.pool.agreed("batched step", eq, move |st| {
            let (r, lens) = with_items(st, &specs, |o, items| o.step(items), ops)?;
            Ok((r?, lens))
        })?;
        refresh(items, &lens)?;
        Ok(out)
    }
    fn prefill(&mut self, items: &mut [PrefillItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let mut specs = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            let target = tp_target(it.target)?.id;
            let drafter = match it.drafter.as_mut() {
                Some(d) => Some(tp_drafter(&mut **d)?.id),
                None => None,
            };
            specs.push((target, drafter, it.prompt.to_vec()));
        }
        let ops = self.id;
        let same = |a: &Prefilled, b: &Prefilled| {
            a.1 == b.1 && a.0.len() == b.0.len() && a.0.iter().zip(&b.0).all(|(x, y)| same_f32(x, y))
        };
        let (out, lens) = self.pool.agreed("batched prefill", same, move |st| {
            // The prefill items as batch specs (their step fields unused), then back as prefill items.
            let bs: Vec<ItemSpec> = specs
                .iter()
                .map(|(t, d, _)| ItemSpec {
                    target: *t,
                    drafter: *d,
                    root: 0,
                    kind: StepKind::Ar,
                    sampling: Sampling::default(),
                })
                .collect();
            let (r, lens) = with_items(
                st,
                &bs,
                |o, items| {
                    let mut p: Vec<PrefillItem<'_>> = items
                        .iter_mut()
                        .zip(&specs)
                        .map(|(it, s)| PrefillItem {
                            target: &mut *it.target,
                            drafter: it.drafter.as_mut().map(|d| &mut **d as &mut dyn Drafter),
                            prompt: &s.2,
                        })
                        .collect();
                    o.prefill(&mut p)
                },
                ops,
            )?;
            Ok((r?, lens))
        })?;
        for (it, (c, l)) in items.iter_mut().zip(&lens) {
            tp_target(it.target)?.committed = *c;
            if let (Some(d), Some(l)) = (it.drafter.as_mut(), l) {
                tp_drafter(&mut **d)?.ctx_len = *l;
            }
        }
        Ok(out)
    }
}

/// Groups of a `ranks`-rank model over `groups`: group g holds ranks `g·R/G .. (g+1)·R/G`.
pub fn group_ranks(ranks: usize, groups: usize) -> Result<Vec<std::ops::Range<usize>>> {
    ensure!(groups >= 1, "--gpus must be at least 1");
    ensure!(
        ranks.is_multiple_of(groups),
        "the model was converted for {ranks} ranks, which do not divide over {groups} GPUs (use a divisor of {ranks}, or convert with --ranks {groups})"
    );
    let per = ranks / groups;
    Ok((0..groups).map(|g| g * per..(g + 1) * per).collect())
}

/// Open the converted model `dir` as `groups` groups placed by `place` (each loads only its ranks' shards and
/// the drafter; see the module doc). `opts.progress`: group 0's load progress on stderr; `opts.check_weights`: every group's load check.
pub fn open_tp(dir: &Path, groups: usize, place: Placement, opts: OpenOptions) -> Result<Loaded> {
    let (src, needed) = model_source(dir, groups, opts.no_drafter)?;
    open_tp_source(src, groups, place, Some(needed), opts)
        .with_context(|| format!("loading {} as {groups} tensor-parallel groups", dir.display()))
}

/// `dir`'s tensors and each of `groups` groups' upload bytes.
fn model_source(dir: &Path, groups: usize, no_drafter: bool) -> Result<(Arc<dyn TensorSource>, Vec<u64>)> {
    let md = kdtree_formats::ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    // The bytes each group uploads: its ranks' target tensors, and the whole drafter (every group runs it).
    let ranges = group_ranks(md.manifest().plan.ranks, groups)?;
    let drafter: u64 = if no_drafter {
        0
    } else {
        md.manifest()
            .tensors
            .iter()
            .filter(|t| t.name.starts_with("drafter.") && (t.split_axis.is_some() || t.rank == 0))
            .map(|t| t.nbytes)
            .sum()
    };
    let needed = ranges
        .iter()
        .map(|r| {
            drafter
                + md.manifest()
                    .tensors
                    .iter()
                    .filter(|t| !t.name.starts_with("drafter.") && r.contains(&t.rank))
                    .map(|t| t.nbytes)
                    .sum::<u64>()
        })
        .collect();
    Ok((Arc::new(md), needed))
}

/// [`open_tp`] on GPUs, with each group's [`crate::cuda::Gpu`] (tests and benches read their counters).
#[cfg(feature = "cuda")]
pub fn open_tp_gpus(
    dir: &Path,
    groups: usize,
    place: Placement,
    opts: OpenOptions,
) -> Result<(Loaded, Vec<Arc<crate::cuda::Gpu>>)> {
    let (src, needed) = model_source(dir, groups, opts.no_drafter)?;
    let ranges = group_ranks(src.ranks(), groups)?;
    let r = match place {
        Placement::SharedGpu(o) => cuda_groups(src, ranges, o, None, Some(needed), opts),
        Placement::Gpus(o) => cuda_groups(src, ranges, o[0], Some(o), Some(needed), opts),
        Placement::Cpu => bail!("open_tp_gpus: the CPU placement has no GPUs"),
    };
    r.with_context(|| format!("loading {} as {groups} tensor-parallel groups", dir.display()))
}

/// [`open_tp`] over any tensor source (tests: in-memory models); `needed`: each group's upload bytes where
/// known (checked against the GPU's free memory first).
pub fn open_tp_source(
    src: Arc<dyn TensorSource>,
    groups: usize,
    place: Placement,
    needed: Option<Vec<u64>>,
    opts: OpenOptions,
) -> Result<Loaded> {
    let ranges = group_ranks(src.ranks(), groups)?;
    match place {
        Placement::Cpu => {
            use crate::cpu::comm::{HostGroup, HostRank};
            let group = HostGroup::new(groups);
            let inits = ranges
                .into_iter()
                .enumerate()
                .map(|(g, range)| {
                    let (src, group) = (src.clone(), group.clone());
                    Box::new(move || {
                        let mut b = crate::cpu::CpuBackend::with_comm(HostRank { group, rank: g });
                        b.check_weights = opts.check_weights;
                        group_models(b, src, range, opts.no_drafter)
                    }) as GroupInit
                })
                .collect();
            let g2 = group.clone();
            start(inits, 1, Box::new(move |why| g2.abort(why)), "cpu", "cpu".into())
        }
        #[cfg(feature = "cuda")]
        Placement::SharedGpu(ordinal) => cuda_groups(src, ranges, ordinal, None, needed, opts).map(|r| r.0),
        #[cfg(feature = "cuda")]
        Placement::Gpus(ordinals) => cuda_groups(src, ranges, ordinals[0], Some(ordinals), needed, opts).map(|r| r.0),
        #[cfg(not(feature = "cuda"))]
        _ => {
            let _ = (opts, needed);
            Err(crate::backend::BackendError::NoCuda.into())
        }
    }
}

/// The target (and drafter, when the source has one) of ranks `range` on backend `b`.
fn group_models<B: crate::backend::Backend>(
    b: B,
    src: Arc<dyn TensorSource>,
    range: std::ops::Range<usize>,
    no_drafter: bool,
) -> Result<Sessions> {
    use crate::model::weights::Weights;
    let taps = match src.drafter_config() {
        Some(c) if !no_drafter => c.dflash_config.target_layer_ids.clone(),
        _ => Vec::new(),
    };
    let w = Arc::new(
        Weights::load_group(b.clone(), src.clone(), range.clone()).with_context(|| format!("ranks {range:?}"))?,
    );
    let target = crate::model::target::TargetModel::new(w.clone(), taps, crate::model::AttnMode::Absorbed)?;
    let drafter = match src.drafter_config() {
        Some(_) if !no_drafter => Some(crate::drafter::DFlashDrafter::load_on(b, &*src, w)?),
        _ => None,
    };
    // One model: the group's device rounds and batched steps reach its target and drafter together.
    Ok(crate::model::Model::new(target, drafter).into_sessions())
}

/// CUDA groups: all on GPU `ordinal` (the one-GPU communicator) or group g on `gpus[g]` (NCCL).
#[cfg(feature = "cuda")]
fn cuda_groups(
    src: Arc<dyn TensorSource>,
    ranges: Vec<std::ops::Range<usize>>,
    ordinal: usize,
    gpus: Option<Vec<usize>>,
    needed: Option<Vec<u64>>,
    opts: OpenOptions,
) -> Result<(Loaded, Vec<Arc<crate::cuda::Gpu>>)> {
    use crate::cuda::comm::{Communicator, Nccl, SharedGpu};
    use crate::cuda::{CudaBackend, Gpu};
    let groups = ranges.len();
    if let Some(o) = &gpus {
        ensure!(o.len() == groups, "{} GPUs for {groups} groups", o.len());
    }
    // Lazy module loading (CUDA's default) loads a kernel on its first launch and synchronises the device to do
    // so: a group waiting inside a sum for another group that is loading a kernel would never finish. The
    // variable is read when CUDA starts, so it must be set before (kdtree-run sets it for runs of several groups).
    ensure!(
        groups == 1 || std::env::var("CUDA_MODULE_LOADING").as_deref() == Ok("EAGER"),
        "{groups} rank groups need CUDA_MODULE_LOADING=EAGER set before the first CUDA call (lazy loading synchronises the device when a kernel first runs, which deadlocks groups that meet inside their kernels)"
    );
    // Each group's GPU and communicator first (NCCL is initialised over all of them at once), then the loads in
    // parallel on the groups' threads.
    let devs: Vec<Arc<Gpu>> = match &gpus {
        None => (0..groups)
            .map(|_| Gpu::new(ordinal).map(Arc::new))
            .collect::<std::result::Result<_, _>>()?,
        Some(o) => {
            let mut seen = o.clone();
            seen.sort_unstable();
            seen.dedup();
            ensure!(
                seen.len() == o.len(),
                "GPUs {o:?} are not distinct (several groups on one GPU: the shared-GPU communicator)"
            );
            o.iter()
                .map(|&i| Gpu::new(i).map(Arc::new))
                .collect::<std::result::Result<_, _>>()?
        }
    };
    let comms: Vec<Arc<dyn Communicator>> = match &gpus {
        None => SharedGpu::ranks(&devs[0], groups)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect(),
        Some(_) => Nccl::group(&devs.iter().map(|g| &**g).collect::<Vec<_>>())?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect(),
    };
    let aborts = comms.clone();
    for (g, c) in devs.iter().zip(comms) {
        g.set_comm(c);
        g.set_drain_copies(groups > 1);
    }
    if gpus.is_none() && groups > 1 {
        devs[0].pool_for_groups()?;
        // Up to GROUP_BLOCKS SMs per group partly held by a waiting sum: cuBLAS plans for the rest.
        for g in &devs {
            g.set_blas_sms(g.sms.saturating_sub(groups * crate::cuda::comm::GROUP_BLOCKS))?;
        }
    }
    let name = devs[0].name();
    let per_device = if gpus.is_none() { groups } else { 1 };
    let needed = needed.unwrap_or_else(|| vec![0; groups]);
    let (free, _) = devs[0].mem_info()?;
    let on_one: u64 = if per_device > 1 {
        needed.iter().sum()
    } else {
        needed.iter().copied().max().unwrap_or(0)
    };
    ensure!(
        on_one + (per_device as u64) * (1u64 << 30) <= free as u64,
        "the groups' weights need {:.2} GiB on {} (+1 GiB per group for caches and activations), but only {:.2} GiB are free",
        on_one as f64 / (1u64 << 30) as f64,
        devs[0].describe(),
        free as f64 / (1u64 << 30) as f64
    );
    let keep = devs.clone();
    let inits = ranges
        .into_iter()
        .zip(devs)
        .zip(needed)
        .enumerate()
        .map(|(g, ((range, gpu), needed))| {
            let src = src.clone();
            Box::new(move || {
                gpu.set_check_weights(opts.check_weights);
                gpu.begin_load(needed, opts.progress && g == 0)?;
                let r = group_models(CudaBackend::new(gpu.clone()), src, range, opts.no_drafter);
                let ended = gpu.end_load().map(|_| ());
                let r = r?;
                ended?;
                Ok(r)
            }) as GroupInit
        })
        .collect();
    // A failed group wakes the others waiting at a launch gate (those waiting inside a device-side sum trap on
    // its timeout).
    let abort = Box::new(move |why: &str| aborts.iter().for_each(|c| c.abort(why)));
    Ok((start(inits, per_device, abort, "cuda", name)?, keep))
}
