//! [`Model`]: one sequence of a loaded model — its target session and its drafter session on one backend —
//! and the engine's `api::Target` / `api::Drafter` over it.
//!
//! The device round needs the target and the drafter of one backend together (the draft, the tree, the
//! verify, the walk and the commit run where both their ops run), and a batched step needs every sequence's
//! pair. A `Model<B>` owns the pair, so [`Model::round`] and [`Model::step`] reach both with their concrete
//! types; the sessions the rest of the engine sees ([`Model::into_sessions`]: a [`ModelTarget`] and a
//! [`ModelDrafter`]) are two views of one shared `Model`, and every model forked from it for a batch is
//! listed in its family, where the batch engine (batch.rs) finds an item's model by the id its views carry.
//! No view reaches past the traits to a concrete type.

use super::batch::BatchEngine;
use super::round;
use super::target::TargetModel;
use crate::api::{BatchOps, DeviceRound, Drafter, LogitRows, StepOut, Target, TargetInfo};
use crate::backend::Backend;
use crate::ddtree::tree_is_full;
use crate::drafter::DFlashDrafter;
use crate::sampling::Sampling;
use anyhow::{bail, Result};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// One sequence: a target session and, when it drafts, a drafter session over the same backend.
pub struct Model<B: Backend> {
    pub target: TargetModel<B>,
    pub drafter: Option<DFlashDrafter<B>>,
}

/// A model shared by its two views (and listed in its family).
pub(crate) type Shared<B> = Arc<Mutex<Model<B>>>;

/// Every model forked from one loaded model (the batch engine steps models of its family).
pub(crate) type Family<B> = Arc<Mutex<Vec<Weak<Mutex<Model<B>>>>>>;

impl<B: Backend> Model<B> {
    pub fn new(target: TargetModel<B>, drafter: Option<DFlashDrafter<B>>) -> Model<B> {
        Model { target, drafter }
    }

    /// One device round from root token `root` (at position `committed`): a DDTree round of `budget` nodes,
    /// or the chain round (`budget` None: the top-1 of each draft row as one path). None when this model
    /// cannot run it where its ops run (no drafter, a recording trace, the position limit, a tree that might
    /// not fill its budget, a shape the backend's tree kernels cannot hold): the host round gives the same
    /// tokens.
    pub fn round(&mut self, root: u32, budget: Option<usize>, s: &Sampling) -> Option<Result<DeviceRound>> {
        let Model { target: t, drafter } = self;
        let d = drafter.as_mut()?;
        let (v, max) = (t.info.vocab_size, t.info.max_positions);
        let rows = d.block_size().checked_sub(1)?;
        let (budget, k) = match budget {
            // A feed round (budget 0): the root-only tree, no draft (k is unused).
            Some(0) => (0, 1),
            // The device round's verify shape is budget + 1 nodes: only trees sure to fill it.
            Some(b) if tree_is_full(b, rows, v) => (b, b.min(v)),
            Some(_) => return None,
            // The chain is the tree of the top-1 of every draft row: one path of `rows` nodes.
            None => (rows, 1),
        };
        let start = t.w.backend.kv_committed(&t.cache);
        if t.trace.is_some() || rows == 0 || start + rows >= max || t.info.tap_layers.is_empty() {
            return None;
        }
        // A backend whose tree kernels cannot hold this shape (e.g. a budget over the device builder's 2048)
        // leaves the round to the host.
        if budget > 0 {
            round::slot_of(t, budget, k, rows).ok()?;
        }
        let w = t.w.clone();
        let mut part = [round::Part {
            t,
            d,
            budget,
            k,
            root,
            s,
        }];
        Some(round::rounds(&w, &mut part, None).map(|mut r| r.remove(0)))
    }

    /// One AR step where the ops run (see [`Target::device_step`]).
    pub fn step(&mut self, root: u32, s: &Sampling) -> Option<Result<u32>> {
        self.target.device_step(root, s)
    }

    /// A new, empty sequence over the same weights (no copy), with a drafter when `drafts` (and this one has
    /// one).
    pub fn fork(&self, drafts: bool) -> Result<Model<B>> {
        let t = &self.target;
        let target = TargetModel::new(t.w.clone(), t.info.tap_layers.clone(), t.mode)?;
        let drafter = self.drafter.as_ref().filter(|_| drafts).map(DFlashDrafter::fork);
        Ok(Model { target, drafter })
    }

    /// The two sessions over this model (the drafter's when it has one), the root of a new family.
    pub fn into_sessions(self) -> crate::api::Sessions {
        let family: Family<B> = Arc::new(Mutex::new(Vec::new()));
        let (t, d) = views(self, family);
        (Box::new(t), d.map(|d| Box::new(d) as Box<dyn Drafter>))
    }
}

/// The views of `m`, listed in `family`.
fn views<B: Backend>(m: Model<B>, family: Family<B>) -> (ModelTarget<B>, Option<ModelDrafter<B>>) {
    let info = m.target.info.clone();
    let drafts = m.drafter.is_some();
    let shared = Arc::new(Mutex::new(m));
    lock_family(&family).push(Arc::downgrade(&shared));
    let d = drafts.then(|| ModelDrafter { m: shared.clone() });
    (
        ModelTarget {
            m: shared,
            info,
            family,
        },
        d,
    )
}

fn lock_family<B: Backend>(f: &Family<B>) -> MutexGuard<'_, Vec<Weak<Mutex<Model<B>>>>> {
    f.lock().unwrap_or_else(|p| p.into_inner())
}

/// The model behind a view (a view is never locked twice: no call of one reaches the other).
pub(crate) fn lock<B: Backend>(m: &Shared<B>) -> MutexGuard<'_, Model<B>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which model a view shows (the address of the shared model): equal for a target and its drafter.
fn id_of<B: Backend>(m: &Shared<B>) -> usize {
    Arc::as_ptr(m) as *const () as usize
}

/// The model of `family` with id `id` (None when it is not of this family or is gone).
pub(crate) fn find<B: Backend>(family: &Family<B>, id: usize) -> Option<Shared<B>> {
    let mut f = lock_family(family);
    f.retain(|w| w.strong_count() > 0);
    f.iter().find(|w| w.as_ptr() as *const () as usize == id)?.upgrade()
}

/// The target session of a [`Model`].
pub struct ModelTarget<B: Backend> {
    m: Shared<B>,
    /// The target's static facts (they never change; `info` hands out a reference).
    info: TargetInfo,
    family: Family<B>,
}

/// The drafter session of a [`Model`].
pub struct ModelDrafter<B: Backend> {
    m: Shared<B>,
}

impl<B: Backend> ModelTarget<B> {
    fn target(&self) -> MutexGuard<'_, Model<B>> {
        lock(&self.m)
    }
}

impl<B: Backend> Target for ModelTarget<B> {
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn committed(&self) -> usize {
        self.target().target.committed()
    }
    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        self.target().target.forward_rows(tokens, parents, rows)
    }
    fn commit(&mut self, path: &[usize]) -> Result<()> {
        self.target().target.commit(path)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.target().target.truncate(len)
    }
    fn reset(&mut self) {
        self.target().target.reset()
    }
    fn reserve(&mut self, rows: usize) -> Result<()> {
        self.target().target.reserve(rows)
    }
    fn start_trace(&mut self) {
        self.target().target.start_trace()
    }
    fn take_trace(&mut self) -> Option<super::Trace> {
        self.target().target.take_trace()
    }
    fn device_round(
        &mut self,
        drafter: &mut dyn Drafter,
        root: u32,
        budget: usize,
        s: &Sampling,
    ) -> Option<Result<DeviceRound>> {
        // Only with this model's own drafter (another drafter: the host round).
        (drafter.model_id()? == id_of(&self.m)).then_some(())?;
        self.target().round(root, Some(budget), s)
    }
    fn device_chain(&mut self, drafter: &mut dyn Drafter, root: u32, s: &Sampling) -> Option<Result<DeviceRound>> {
        (drafter.model_id()? == id_of(&self.m)).then_some(())?;
        self.target().round(root, None, s)
    }
    fn device_prefill(
        &mut self,
        drafter: Option<&mut dyn Drafter>,
        tokens: &[u32],
        last: bool,
    ) -> Option<Result<Vec<f32>>> {
        // Only with this model's own drafter (another drafter: the host prefill).
        let drafts = match drafter {
            Some(d) => (d.model_id()? == id_of(&self.m)).then_some(true)?,
            None => false,
        };
        let mut m = self.target();
        let Model { target, drafter } = &mut *m;
        let d = match drafts {
            true => Some(drafter.as_mut()?),
            false => None,
        };
        target.prefill_chunk(tokens, last, d)
    }
    fn device_step(&mut self, root: u32, s: &Sampling) -> Option<Result<u32>> {
        self.target().step(root, s)
    }
    fn fork(&self) -> Option<Box<dyn Target>> {
        let m = self.target().fork(false).ok()?;
        Some(Box::new(views(m, self.family.clone()).0))
    }
    fn fork_pair(&self, drafts: bool) -> Option<crate::api::Sessions> {
        let m = self.target().fork(drafts).ok()?;
        let (t, d) = views(m, self.family.clone());
        Some((Box::new(t), d.map(|d| Box::new(d) as Box<dyn Drafter>)))
    }
    fn batch_ops(&self) -> Option<Box<dyn BatchOps>> {
        let w = self.target().target.w.clone();
        Some(Box::new(BatchEngine::new(w, self.family.clone())))
    }
    fn model_id(&self) -> Option<usize> {
        Some(id_of(&self.m))
    }
    fn kv_row_bytes(&self) -> usize {
        self.target().target.kv_row_bytes()
    }
    fn release(&mut self) {
        self.target().target.release()
    }
    fn mem_free(&self) -> Option<usize> {
        self.target().target.mem_free()
    }
    fn graph_stats(&self) -> Option<crate::api::GraphStats> {
        self.target().target.graph_stats()
    }
}

impl<B: Backend> ModelDrafter<B> {
    /// Runs `f` on the drafter (a view is made only of a model with one).
    fn with<T>(&self, f: impl FnOnce(&mut DFlashDrafter<B>) -> T) -> T {
        let mut m = lock(&self.m);
        f(m.drafter.as_mut().expect("a drafter view of a model with a drafter"))
    }
}

impl<B: Backend> Drafter for ModelDrafter<B> {
    fn block_size(&self) -> usize {
        self.with(|d| d.block_size())
    }
    fn context_len(&self) -> usize {
        self.with(|d| d.context_len())
    }
    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()> {
        self.with(|d| d.extend_context(taps, n))
    }
    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>> {
        self.with(|d| d.draft(bonus, start))
    }
    fn truncate_context(&mut self, len: usize) -> Result<()> {
        self.with(|d| d.truncate_context(len))
    }
    fn reset(&mut self) {
        self.with(|d| d.reset())
    }
    fn reserve(&mut self, rows: usize) {
        self.with(|d| d.reserve(rows))
    }
    fn model_id(&self) -> Option<usize> {
        Some(id_of(&self.m))
    }
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        // A drafter alone (its model's target is not forked with it): a new model of one drafter would have
        // no target, so this forks the drafter session as a plain drafter.
        Some(Box::new(self.with(|d| DFlashDrafter::fork(d))))
    }
    fn ctx_row_bytes(&self) -> usize {
        self.with(|d| d.ctx_row_bytes())
    }
    fn release(&mut self) {
        self.with(|d| d.release())
    }
}

/// The models of `ids` in `family`, locked (an error for an id of another family, or one given twice).
pub(crate) fn lock_all<B: Backend>(family: &Family<B>, ids: &[Option<usize>]) -> Result<Vec<Shared<B>>> {
    let mut out: Vec<Shared<B>> = Vec::with_capacity(ids.len());
    for &id in ids {
        let Some(m) = id.and_then(|id| find(family, id)) else {
            bail!("a batched step over a session of another model or backend")
        };
        if out.iter().any(|o| Arc::ptr_eq(o, &m)) {
            bail!("one sequence twice in a batched step");
        }
        out.push(m);
    }
    Ok(out)
}
