//! The groups' threads: one per group, each owning its sessions ([`GroupState`]); [`start`] loads every
//! group and returns the run's target and drafter; a call runs on every group at once, results in group order.

use super::group::{TpDrafter, TpTarget};
use crate::api::{BatchOps, Drafter, Target};
use crate::model::open::Loaded;
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// One group's sessions, owned by its thread: targets, drafters and batch ops by id.
#[derive(Default)]
pub struct GroupState {
    pub(super) targets: HashMap<usize, Box<dyn Target>>,
    pub(super) drafters: HashMap<usize, Box<dyn Drafter>>,
    pub(super) ops: HashMap<usize, Box<dyn BatchOps>>,
}

impl GroupState {
    pub(super) fn target(&mut self, id: usize) -> Result<&mut Box<dyn Target>> {
        self.targets
            .get_mut(&id)
            .ok_or_else(|| anyhow!("no target session {id}"))
    }
    pub(super) fn drafter(&mut self, id: usize) -> Result<&mut Box<dyn Drafter>> {
        self.drafters
            .get_mut(&id)
            .ok_or_else(|| anyhow!("no drafter session {id}"))
    }
    /// Target `t` and drafter `d` at once.
    pub(super) fn pair(&mut self, t: usize, d: usize) -> Result<(&mut dyn Target, &mut dyn Drafter)> {
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

pub(super) type Job = Box<dyn FnOnce(&mut GroupState) + Send>;
/// A group's root sessions.
pub type Sessions = (Box<dyn Target>, Option<Box<dyn Drafter>>);
/// Prefill logits and the items' lengths after it.
pub(super) type Prefilled = (Vec<Vec<f32>>, Vec<(usize, Option<usize>)>);

/// The groups' threads.
pub(super) struct Pool {
    pub(super) senders: Vec<Mutex<mpsc::Sender<Job>>>,
    pub(super) threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub(super) next_id: AtomicUsize,
    /// Wakes the groups waiting inside a collective when one failed (the host group; a GPU's waiters trap on
    /// their timeout).
    pub(super) abort: Box<dyn Fn(&str) + Send + Sync>,
    /// The first failure of a call that could not return it (reset, release): every later call fails with it.
    pub(super) poisoned: Mutex<Option<String>>,
    /// Groups sharing one device (its free memory is theirs together).
    pub(super) per_device: usize,
    /// Log each group's calls (`GpuOptions::tp_trace`).
    pub(super) trace: bool,
}

impl Pool {
    pub(super) fn groups(&self) -> usize {
        self.senders.len()
    }
    pub(super) fn new_id(&self) -> usize {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// `f` on every group's thread at once; their results in group order (the first failure is the error).
    pub(super) fn all<T: Send + 'static>(
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
    pub(super) fn agreed<T: Send + 'static>(
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
    pub(super) fn all_or_poison(&self, what: &str, f: impl Fn(&mut GroupState) -> Result<()> + Send + Sync + 'static) {
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

/// What a group thread builds at start: its root target and drafter.
pub type GroupInit = Box<dyn FnOnce() -> Result<Sessions> + Send>;

/// Start one thread per group (each runs its `init`, then serves calls), then the run's target and drafter.
/// `per_device`: groups sharing one device. `abort`: wakes groups stuck in a collective when one fails. `trace`:
/// log each group's calls on stderr (`GpuOptions::tp_trace`).
pub fn start(
    inits: Vec<GroupInit>,
    per_device: usize,
    abort: Box<dyn Fn(&str) + Send + Sync>,
    backend: &str,
    device: String,
    trace: bool,
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
        trace,
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
