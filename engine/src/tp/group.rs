//! The run's `Target` / `Drafter` / `BatchOps` ([`TpTarget`], [`TpDrafter`], [`TpBatchOps`]): each call
//! forwarded to every group's session, the results compared across groups (bitwise), group 0's returned.

use super::pool::{GroupState, Pool, Prefilled};
use crate::api::{
    BatchItem, BatchOps, BatchOut, DeviceRound, Drafter, LogitRows, PrefillItem, StepKind, StepOut, Target, TargetInfo,
};
use crate::sampling::Sampling;
use anyhow::{bail, Context, Result};
use std::sync::Arc;

pub(super) fn eq<T: PartialEq>(a: &T, b: &T) -> bool {
    a == b
}
/// Bitwise equality of f32 rows (NaN == NaN).
pub(super) fn same_f32(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
pub(super) fn same_out(a: &StepOut, b: &StepOut) -> bool {
    same_f32(&a.logits, &b.logits) && same_f32(&a.taps, &b.taps)
}

/// The run's target: the same session on every group.
pub struct TpTarget {
    pub(super) pool: Arc<Pool>,
    pub(super) id: usize,
    pub(super) info: TargetInfo,
    pub(super) committed: usize,
    pub(super) row_bytes: usize,
}

impl TpTarget {
    pub(super) fn attach(pool: Arc<Pool>, id: usize) -> Result<TpTarget> {
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
    pub(super) fn call<T: Send + 'static>(
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
pub(super) fn flip<T>(r: Option<Result<T>>) -> Result<Option<T>> {
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
    fn device_prefill(
        &mut self,
        drafter: Option<&mut dyn Drafter>,
        tokens: &[u32],
        last: bool,
    ) -> Option<Result<Vec<f32>>> {
        let d = match drafter {
            Some(d) => Some(d.as_any_mut()?.downcast_mut::<TpDrafter>()?),
            None => None,
        };
        let (tid, did, tokens) = (self.id, d.as_ref().map(|d| d.id), tokens.to_vec());
        type Out = (Option<Vec<f32>>, usize, Option<usize>);
        let same = |a: &Out, b: &Out| {
            a.1 == b.1
                && a.2 == b.2
                && match (&a.0, &b.0) {
                    (Some(x), Some(y)) => same_f32(x, y),
                    (x, y) => x.is_none() && y.is_none(),
                }
        };
        // Every group's own prefill, its drafter's context from its own taps (the groups' taps agree, as their
        // rounds' do); the logits compared bitwise.
        let r = self.pool.agreed("prefill", same, move |st| match did {
            Some(did) => {
                let (t, d) = st.pair(tid, did)?;
                let v = t.device_prefill(Some(d), &tokens, last).transpose()?;
                Ok((v, t.committed(), Some(d.context_len())))
            }
            None => {
                let t = st.target(tid)?;
                let v = t.device_prefill(None, &tokens, last).transpose()?;
                Ok((v, t.committed(), None))
            }
        });
        match r {
            Ok((v, c, l)) => {
                self.committed = c;
                if let (Some(d), Some(l)) = (d, l) {
                    d.ctx_len = l;
                }
                v.map(Ok)
            }
            Err(e) => Some(Err(e)),
        }
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
    fn fork_pair(&self, drafts: bool) -> Option<crate::api::Sessions> {
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
    fn graph_stats(&self) -> Option<crate::api::GraphStats> {
        // Every group captures the same rounds: the first one's device says it.
        let id = self.id;
        let stats = self
            .pool
            .all("graph counters", move |st| Ok(st.target(id)?.graph_stats()))
            .ok()?;
        stats.into_iter().next().flatten()
    }
}

/// `f` over target `tid` and drafter `did` of every group, agreed; with both sessions' lengths.
pub(super) fn paired<T: PartialEq + Send + 'static>(
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
pub(super) fn settle<T>(
    t: &mut TpTarget,
    d: &mut TpDrafter,
    r: Result<(Option<T>, usize, usize)>,
) -> Option<Result<T>> {
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
    pub(super) pool: Arc<Pool>,
    pub(super) id: usize,
    pub(super) block: usize,
    pub(super) ctx_len: usize,
    pub(super) row_bytes: usize,
}

impl TpDrafter {
    pub(super) fn attach(pool: Arc<Pool>, id: usize) -> Result<TpDrafter> {
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
    pub(super) fn call<T: Send + 'static>(
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
pub(super) struct ItemSpec {
    pub(super) target: usize,
    pub(super) drafter: Option<usize>,
    pub(super) root: u32,
    pub(super) kind: StepKind,
    pub(super) sampling: Sampling,
}

pub(super) fn tp_target(t: &mut dyn Target) -> Result<&mut TpTarget> {
    t.as_any_mut()
        .and_then(|a| a.downcast_mut::<TpTarget>())
        .context("a batch item whose target is not of this tensor-parallel run")
}
pub(super) fn tp_drafter(d: &mut dyn Drafter) -> Result<&mut TpDrafter> {
    d.as_any_mut()
        .and_then(|a| a.downcast_mut::<TpDrafter>())
        .context("a batch item whose drafter is not of this tensor-parallel run")
}

pub(super) fn spec(it: &mut BatchItem<'_>) -> Result<ItemSpec> {
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
pub(super) fn with_items<T>(
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
    pub(super) pool: Arc<Pool>,
    pub(super) id: usize,
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
pub(super) fn refresh(items: &mut [BatchItem<'_>], lens: &[(usize, Option<usize>)]) -> Result<()> {
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
