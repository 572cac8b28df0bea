//! The device round and the device AR step, once (issue 25): a single sequence is a batch of one.
//!
//! [`rounds`] runs one DDTree round (or chain round) for every sequence of `parts`: the tree slot of each
//! sequence's shape, the room for its rows, its root where the ops read it, the key of the captured round,
//! then draft → tree → verify → walk → commit where the ops run as one captured graph, one read back, and
//! the host copies of the lengths. [`steps`] does the same for AR steps. `TargetModel::device_round` /
//! `device_chain` / `device_step` call them with one part, `BatchEngine::step` (batch.rs) with the batch.
//!
//! The verify forward depends on the batch's size: one sequence runs the single-sequence kernels
//! (`draft_from_root`, its tree's own token/mask buffers, the walk over its logits, its captured graph kept
//! in its tree slot), several share one forward (`draft_batch`, the trees' nodes gathered into one token
//! buffer, one decision pass when all are greedy, one staging buffer read once, graphs kept by the
//! [`Staging`] of the batch engine). Every other step is the same code for both.

use super::attention::Seg;
use super::target::{accept_walk, decoder_layers, round_key, RoundSlot, StepSlot, TargetModel};
use super::weights::Weights;
use crate::api::{DeviceRound, Drafter, StepRun};
use crate::backend::{Backend, PosOf, RopeSeg};
use crate::drafter::DFlashDrafter;
use crate::sampling::Sampling;
use anyhow::{ensure, Context, Result};
use std::hash::{Hash, Hasher};

/// Captured batched steps kept per engine (distinct batch compositions: the batch's tail shrinks one
/// sequence at a time, `--budget auto` moves between bucket shapes).
const GRAPHS: usize = 16;

/// One sequence of a round: its target and drafter, the tree shape (budget, top-K), the root token going
/// in (at position `committed`) and its sampling.
pub(crate) struct Part<'p, B: Backend> {
    pub t: &'p mut TargetModel<B>,
    pub d: &'p mut DFlashDrafter<B>,
    pub budget: usize,
    pub k: usize,
    pub root: u32,
    pub s: &'p Sampling,
}

/// One sequence of an AR step: its target, the token going in and its sampling; `feed`: a feed step, whose
/// drafter stashes the token's taps (its context rows are written before its next draft).
pub(crate) struct StepPart<'p, B: Backend> {
    pub t: &'p mut TargetModel<B>,
    pub root: u32,
    pub s: &'p Sampling,
    pub feed: Option<&'p mut DFlashDrafter<B>>,
}

/// The buffers of a batched step (several sequences), owned by the batch engine: the forward's token ids,
/// the AR decisions, every tree's result words, and the captured steps by key.
pub(crate) struct Staging<B: Backend> {
    /// The forward's token ids (AR: one per sequence; a round: every tree's nodes).
    tokens: B::Ids,
    /// AR decisions, one per sequence (read back in one copy).
    out: B::Ids,
    /// Every tree's result words (a round's one read).
    stage: B::Ids,
    /// The three buffers' lengths.
    caps: [usize; 3],
    /// Bumped whenever one of the buffers above is reallocated (part of every graph key).
    gen: u64,
    /// The mask of a one-node forward (the AR step's).
    mask1: B::Mask,
    graphs: Vec<(u64, Option<B::Graph>)>,
    /// Keys run once, eagerly ([`Staging::capture_now`]), the newest last.
    seen: Vec<u64>,
    /// How the last batched step or round ran.
    pub(crate) last: StepRun,
}

impl<B: Backend> Staging<B> {
    pub(crate) fn new(b: &B) -> Staging<B> {
        let one = crate::ddtree::Visibility::from_parents(&[-1]).expect("a one-node tree");
        Staging {
            tokens: b.ids_from_host(&[]),
            out: b.ids_from_host(&[]),
            stage: b.ids_from_host(&[]),
            caps: [0; 3],
            gen: 0,
            mask1: b.mask_upload(&one),
            graphs: Vec::new(),
            seen: Vec::new(),
            last: StepRun::default(),
        }
    }

    /// After the step of graph slot `gi` (None: a first sighting, run eagerly) that held a graph before
    /// (`had`) and whose drafters' flush took `flush_us` before it: [`Staging::last`]. Steady is a replay, or
    /// a run that captured nothing (a backend without graphs); a first sighting never is.
    fn ran(&mut self, gi: Option<usize>, had: bool, flush_us: f64) {
        let now = gi.is_some_and(|gi| self.graphs.get(gi).is_some_and(|g| g.1.is_some()));
        self.last = StepRun {
            steady: gi.is_some() && (had || !now),
            flush_us,
        };
    }

    /// Room for `n` ids in buffer `which` (0 tokens, 1 out, 2 stage): a new, larger buffer when it is too
    /// small, which starts a new generation (every captured step read the old one).
    fn room(&mut self, b: &B, which: usize, n: usize) {
        if self.caps[which] >= n {
            return;
        }
        let cap = n.next_power_of_two();
        let buf = b.ids_from_host(&vec![0; cap]);
        *[&mut self.tokens, &mut self.out, &mut self.stage][which] = buf;
        self.caps[which] = cap;
        self.gen += 1;
        self.graphs.clear();
    }

    /// Whether the step of `key` is captured (or replayed) now. A key met for the first time runs eagerly and
    /// is remembered; met again, it is captured. A batch's probe of a new shape (a drafted round between runs
    /// of feed rounds, whose drafters' caches have moved since the last) seldom comes back before its key
    /// changes, and its capture costs several times its eager run (on an H200, a drafted round of 64
    /// sequences of the trained pair: ~80 ms to capture, ~11 ms to replay); a steady shape pays one eager
    /// run before its capture.
    fn capture_now(&mut self, key: u64) -> bool {
        if self.graphs.iter().any(|(k, _)| *k == key) || self.seen.contains(&key) {
            return true;
        }
        if self.seen.len() >= 2 * GRAPHS {
            self.seen.remove(0);
        }
        self.seen.push(key);
        false
    }

    /// The graph slot of `key` (a new one when absent; the oldest goes when the cache is full).
    fn graph(&mut self, key: u64) -> usize {
        if let Some(i) = self.graphs.iter().position(|(k, _)| *k == key) {
            return i;
        }
        if self.graphs.len() >= GRAPHS {
            self.graphs.remove(0);
        }
        self.graphs.push((key, None));
        self.graphs.len() - 1
    }
}

/// The index of `t`'s tree slot of shape (budget, top-K) for draft blocks of `rows` rows, a new one (no
/// root yet: `dev_root` names its slot) when absent. An error when the backend's tree kernels cannot hold
/// the shape (the single-sequence round then leaves the round to the host).
pub(crate) fn slot_of<B: Backend>(t: &mut TargetModel<B>, budget: usize, k: usize, rows: usize) -> Result<usize> {
    if let Some(i) = t.rounds.iter().position(|r| (r.budget, r.k) == (budget, k)) {
        return Ok(i);
    }
    let b = &t.w.backend;
    let tree = b.tree_new(budget, rows, t.info.vocab_size, k)?;
    let decisions = b.ids_from_host(&vec![0; budget + 1]);
    t.rounds.push(RoundSlot {
        budget,
        k,
        tree,
        graph: None,
        decisions,
    });
    Ok(t.rounds.len() - 1)
}

/// One round for every sequence of `parts` (see the module doc); `staging` holds a batch's buffers (needed
/// for two or more parts). Returns each sequence's round, everything committed.
pub(crate) fn rounds<B: Backend>(
    w: &Weights<B>,
    parts: &mut [Part<'_, B>],
    staging: Option<&mut Staging<B>>,
) -> Result<Vec<DeviceRound>> {
    let b = &w.backend;
    ensure!(!parts.is_empty(), "a round of no sequences");
    if parts.iter().all(|p| p.budget == 0) {
        return feed_steps(w, parts, staging);
    }
    // Outside the captured round: each drafter's stash written into its context, each tree slot, room for
    // its rows (nothing grows inside), the root where the ops read it, and the key of everything the round
    // reads.
    let mut key = std::collections::hash_map::DefaultHasher::new();
    let mut slots = Vec::with_capacity(parts.len());
    // Every stash into its context first, the batch's in shared forwards (timed apart: feed rounds put it off).
    let flush_us = {
        let mut ds: Vec<&mut DFlashDrafter<B>> = parts.iter_mut().map(|p| &mut *p.d).collect();
        flush_timed(b, &mut ds, |d| d.stashed() > 0)?
    };
    for p in parts.iter_mut() {
        let rows = p.d.block_size() - 1;
        let start = b.kv_committed(&p.t.cache);
        ensure!(
            p.d.context_len() == start,
            "drafter context {} != target committed {start}",
            p.d.context_len()
        );
        let slot = slot_of(p.t, p.budget, p.k, rows)?;
        b.kv_reserve(&mut p.t.cache, start + p.budget + 1)?;
        p.d.reserve_context(rows + 1);
        if p.t.dev_root != Some((p.budget, p.k, p.root)) {
            b.tree_set_root(&mut p.t.rounds[slot].tree, p.root)?;
        }
        (p.t.dev_root, p.t.step_root) = (None, None);
        p.t.last_parents.clear();
        round_key(p.budget, p.k, p.s, b.kv_id(&p.t.cache), p.d.capture_key()).hash(&mut key);
        slots.push(slot);
    }
    let staged = match (&mut *parts, staging) {
        ([p], _) => one_round(w, p, slots[0], key.finish()).map(|i| {
            slots[0] = i;
            None
        }),
        (parts, Some(st)) => batch_round(w, parts, &slots, key, st, flush_us).map(Some),
        (_, None) => Err(anyhow::anyhow!("a batched round without a batch engine's buffers")),
    };
    // Each walk read back (one sequence: from its tree; a batch: from the staging words read at once), then
    // the host copies of the lengths follow it.
    let read = || -> Result<Vec<DeviceRound>> {
        let (mut outs, mut word) = (Vec::with_capacity(parts.len()), 0);
        let staged = staged?;
        for (i, (p, &slot)) in parts.iter_mut().zip(&slots).enumerate() {
            let TargetModel { cache, rounds, .. } = &mut *p.t;
            let tree = &mut rounds[slot].tree;
            let res = match &staged {
                None => b.tree_result(tree)?, // the round's one read back
                Some((all, words)) => {
                    let r = b.tree_result_from(tree, &all[word..word + words[i]])?;
                    word += words[i];
                    r
                }
            };
            let r = accept_walk(b, cache, tree, p.d, p.budget + 1, res)?;
            p.t.dev_root = r.walk.decisions.last().map(|&tok| (p.budget, p.k, tok));
            outs.push(DeviceRound {
                walk: r.walk,
                log_q: r.log_q,
                drafted: p.budget,
                // A feed round drafts no rows.
                draft_rows: if p.budget == 0 { 0 } else { p.d.block_size() - 1 },
            });
        }
        Ok(outs)
    };
    let r = read();
    if let (Err(_), [p]) = (&r, &mut *parts) {
        // A failed round of one sequence captures again next time.
        if let Some(slot) = p.t.rounds.iter_mut().find(|r| (r.budget, r.k) == (p.budget, p.k)) {
            slot.graph = None;
        }
        p.t.dev_root = None;
    }
    r
}

/// The stashes of the drafters of `ds` that `due` picks written into their contexts together
/// ([`DFlashDrafter::flush_batch`]); the wall time it took (µs, the device waited for), 0 when none was due.
fn flush_timed<B: Backend>(
    b: &B,
    ds: &mut [&mut DFlashDrafter<B>],
    due: impl Fn(&DFlashDrafter<B>) -> bool,
) -> Result<f64> {
    let mut due: Vec<&mut DFlashDrafter<B>> = ds.iter_mut().map(|d| &mut **d).filter(|d| due(d)).collect();
    if due.is_empty() {
        return Ok(0.0);
    }
    let t = std::time::Instant::now();
    DFlashDrafter::flush_batch(&mut due)?;
    b.sync()?;
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

/// Feed rounds (budget 0) of every sequence of `parts`: AR steps whose drafters stash the roots' taps
/// (`DFlashDrafter::stash_rows`; written into their contexts in one forward before their next draft), as
/// rounds of the root alone, with no draft and no scores.
fn feed_steps<B: Backend>(
    w: &Weights<B>,
    parts: &mut [Part<'_, B>],
    staging: Option<&mut Staging<B>>,
) -> Result<Vec<DeviceRound>> {
    if let [p] = parts {
        p.t.step_slot();
    }
    let mut steps_in: Vec<StepPart<'_, B>> = parts
        .iter_mut()
        .map(|p| StepPart {
            t: &mut *p.t,
            root: p.root,
            s: p.s,
            feed: Some(&mut *p.d),
        })
        .collect();
    let toks = steps(w, &mut steps_in, staging)?;
    Ok(toks
        .into_iter()
        .map(|tok| DeviceRound {
            walk: crate::ddtree::Walk {
                path: vec![0],
                decisions: vec![tok],
            },
            log_q: Vec::new(),
            drafted: 0,
            draft_rows: 0,
        })
        .collect())
}

/// A round of one sequence: the single-sequence kernels (the target's round stages: `forward_tree`,
/// `walk_tree`, `commit_walk`), captured in its tree slot's graph. The slot moves to the end of the target's
/// list: its new index is returned.
fn one_round<B: Backend>(w: &Weights<B>, p: &mut Part<'_, B>, slot: usize, key: u64) -> Result<usize> {
    let b = &w.backend;
    let (rows, t) = (p.d.block_size() - 1, p.budget + 1);
    let (tm, d, s) = (&mut *p.t, &mut *p.d, p.s);
    let mut slot = tm.rounds.swap_remove(slot);
    let RoundSlot {
        tree, graph, decisions, ..
    } = &mut slot;
    // Greedy on a GPU holding only some vocab shards: the decisions by the vocab-parallel argmax (`t x R`
    // pairs through the communicator instead of the `[t, V]` logits); otherwise the walk reads the logits.
    let pairs = s.is_greedy() && w.vocab_split();
    let r = b.graph_run(graph, key, &mut || {
        let draft = d.draft_from_root(b.tree_root(tree))?; // [rows, V]
        b.tree_build(tree, &draft, 0)?;
        let (xn, taps) = tm.forward_tree(tree, t, rows)?;
        if pairs {
            w.lm_head_argmax_into(&xn, t, decisions, 0)?;
            b.tree_walk_decided(tree, decisions, 0)?;
        } else {
            tm.walk_tree(tree, &w.lm_head(&xn, t), s)?;
        }
        tm.commit_walk(tree, d, &taps)
    });
    tm.rounds.push(slot);
    r.map(|()| tm.rounds.len() - 1)
}

/// A round of several sequences in one forward (see batch.rs), captured in `st`'s graph of the batch's key.
fn batch_round<B: Backend>(
    w: &Weights<B>,
    parts: &mut [Part<'_, B>],
    slots: &[usize],
    mut key: std::collections::hash_map::DefaultHasher,
    st: &mut Staging<B>,
    flush_us: f64,
) -> Result<(Vec<u32>, Vec<usize>)> {
    let (b, c) = (&w.backend, &w.cfg);
    let nodes: Vec<usize> = parts.iter().map(|p| p.budget + 1).collect();
    let total: usize = nodes.iter().sum();
    let block = parts[0].d.block_size();
    ensure!(
        parts.iter().all(|p| p.d.block_size() == block),
        "a batched round over drafters of different block sizes"
    );
    let words: Vec<usize> = parts
        .iter()
        .zip(slots)
        .map(|(p, &i)| b.tree_result_words(&p.t.rounds[i].tree))
        .collect();
    let stage_len: usize = words.iter().sum();
    // The token buffer holds the drafts' blocks first, then every tree's nodes.
    st.room(b, 0, total.max(parts.len() * block));
    st.room(b, 2, stage_len);
    (total, st.gen).hash(&mut key);
    let (tw, m) = (parts[0].t.info.tap_layers.len() * c.hidden, block);
    ensure!(tw > 0, "a batched round needs a target with tap layers");
    let (mode, tap_layers) = (parts[0].t.mode, parts[0].t.info.tap_layers.clone());
    let gkey = key.finish();
    let gi = st.capture_now(gkey).then(|| st.graph(gkey));
    let had = gi.is_some_and(|gi| st.graphs[gi].1.is_some());
    let (tokens, stage) = (&mut st.tokens, &mut st.stage);
    let graph = gi.map(|gi| &mut st.graphs[gi].1);
    let mut body = || {
        // Every block drafted in one forward, every tree built from its rows, then their nodes gathered. Feed
        // rounds (budget 0) beside drafted ones verify their root alone (a batch of feed rounds only is
        // `feed_steps`).
        let draft = match parts.iter().any(|p| p.budget > 0) {
            true => {
                let (mut roots, mut ds): (Vec<&B::Ids>, Vec<&mut DFlashDrafter<B>>) = (Vec::new(), Vec::new());
                for (p, &i) in parts.iter_mut().zip(slots) {
                    roots.push(b.tree_root(&p.t.rounds[i].tree));
                    ds.push(&mut *p.d);
                }
                Some(DFlashDrafter::draft_batch(&mut ds, &roots, tokens)?) // [N·(B−1), V]
            }
            false => None,
        };
        // Every tree built (together where the backend can: one shape when no sequence feeds), then the nodes
        // gathered.
        match &draft {
            Some(draft) if parts.iter().all(|p| p.budget > 0) => {
                let mut trees: Vec<&mut B::Tree> = parts
                    .iter_mut()
                    .zip(slots)
                    .map(|(p, &i)| &mut p.t.rounds[i].tree)
                    .collect();
                b.tree_build_batch(&mut trees, draft, block - 1)?;
            }
            _ => {
                for (s, (p, &i)) in parts.iter_mut().zip(slots).enumerate() {
                    let tree = &mut p.t.rounds[i].tree;
                    match (&draft, p.budget) {
                        (Some(draft), 1..) => b.tree_build(tree, draft, s * (block - 1))?,
                        _ => b.tree_root_only(tree)?,
                    }
                }
            }
        }
        let srcs: Vec<(&B::Ids, usize)> = parts
            .iter()
            .zip(slots)
            .zip(&nodes)
            .map(|((p, &i), &n)| (b.tree_tokens(&p.t.rounds[i].tree), n))
            .collect();
        b.ids_gather(tokens, &srcs);
        drop(srcs);
        // Every node's position (its tree's depth past its sequence's committed rows), one table for the batch.
        let at: Vec<RopeSeg<'_, B>> = parts
            .iter()
            .zip(slots)
            .zip(&nodes)
            .map(|((p, &i), &n)| (PosOf::Kv(&p.t.cache), Some(b.tree_depths(&p.t.rounds[i].tree)), n))
            .collect();
        let rope = b.rope_at_segs(&w.rope_inv, c.rope_attention_factor, &at);
        drop(at);
        let mut segs: Vec<Seg<'_, B>> = parts
            .iter_mut()
            .zip(slots)
            .zip(&nodes)
            .map(|((p, &i), &n)| {
                let TargetModel { cache, rounds, .. } = &mut *p.t;
                Seg {
                    kv: cache,
                    t: n,
                    mask: b.tree_mask(&rounds[i].tree),
                    rope: &rope,
                }
            })
            .collect();
        let (x, taps) = decoder_layers(
            w,
            &mut segs,
            w.embed_ids(tokens, total),
            &tap_layers,
            mode,
            None,
            Some(&rope),
        );
        drop(segs);
        let taps = taps.context("a batched round needs the target's taps")?;
        let logits = w.lm_head(&w.final_norm(&x), total);
        // Walks, then every accepted path's taps into the drafters' contexts in one forward, then commits.
        let row0: Vec<usize> = nodes
            .iter()
            .scan(0, |at, &n| Some(std::mem::replace(at, *at + n)))
            .collect();
        // Greedy decisions do not depend on positions: every tree's rows in one argmax when all are greedy
        // (into the token buffer: the verify has read it), then every walk at once.
        let all_greedy = parts.iter().all(|p| p.s.is_greedy());
        if all_greedy {
            let base = PosOf::Kv(&parts[0].t.cache);
            b.decide_rows(&logits, 0, total, c.vocab, &Sampling::greedy(), base, 1, tokens)?;
            let mut trees: Vec<&mut B::Tree> = parts
                .iter_mut()
                .zip(slots)
                .map(|(p, &i)| &mut p.t.rounds[i].tree)
                .collect();
            b.tree_walk_decided_batch(&mut trees, tokens, &row0)?;
        } else {
            for ((p, &i), &row) in parts.iter_mut().zip(slots).zip(&row0) {
                let TargetModel { cache, rounds, .. } = &mut *p.t;
                b.tree_walk(&mut rounds[i].tree, &logits, row, p.s, cache)?;
            }
        }
        let acc = {
            let trees: Vec<&B::Tree> = parts.iter().zip(slots).map(|(p, &i)| &p.t.rounds[i].tree).collect();
            b.tree_path_rows_batch(&trees, &taps, &row0, tw, m)
        };
        {
            let mut ds: Vec<&mut DFlashDrafter<B>> = parts.iter_mut().map(|p| &mut *p.d).collect();
            DFlashDrafter::write_context_batch(&mut ds, &acc, m)?;
        }
        let mut commits: Vec<(&mut B::Tree, &mut B::Kv, &mut B::Pos)> = parts
            .iter_mut()
            .zip(slots)
            .map(|(p, &i)| {
                let TargetModel { cache, rounds, .. } = &mut *p.t;
                (&mut rounds[i].tree, cache, p.d.context_pos_mut())
            })
            .collect();
        b.tree_commit_batch(&mut commits)?;
        drop(commits);
        let at: Vec<usize> = words
            .iter()
            .scan(0, |at, &n| Some(std::mem::replace(at, *at + n)))
            .collect();
        let trees: Vec<&B::Tree> = parts.iter().zip(slots).map(|(p, &i)| &p.t.rounds[i].tree).collect();
        b.tree_result_into_batch(&trees, stage, &at);
        b.check()
    };
    let r = match graph {
        Some(graph) => b.graph_run(graph, gkey, &mut body),
        None => body(),
    };
    if let (Err(_), Some(gi)) = (&r, gi) {
        st.graphs.remove(gi);
    }
    r?;
    st.ran(gi, had, flush_us);
    let all = b.ids_to_host(&st.stage)?; // the batch's one read back
    Ok((all, words))
}

/// One AR step for every sequence of `parts` (see the module doc): the forward of each root token at its
/// position `committed`, the decision (greedy, or sampled at `committed + 1`) and the commit, as one captured
/// graph, one read back. `staging` holds a batch's buffers (needed for two or more parts). One sequence
/// steps in its own step slot (`TargetModel::step`, which must exist).
pub(crate) fn steps<B: Backend>(
    w: &Weights<B>,
    parts: &mut [StepPart<'_, B>],
    staging: Option<&mut Staging<B>>,
) -> Result<Vec<u32>> {
    let (b, c) = (&w.backend, &w.cfg);
    ensure!(!parts.is_empty(), "a step of no sequences");
    let one = parts.len() == 1;
    // Full stashes into their contexts first, the batch's in shared forwards (each stash then has room).
    let flush_us = {
        let mut ds: Vec<&mut DFlashDrafter<B>> = parts.iter_mut().filter_map(|p| p.feed.as_deref_mut()).collect();
        flush_timed(b, &mut ds, |d| d.stashed() >= crate::drafter::STASH_ROWS)?
    };
    // Outside the captured step: room for the row, the root where the ops read it (one sequence: unless its
    // slot holds it from its last step), the key.
    let mut key = std::collections::hash_map::DefaultHasher::new();
    for p in parts.iter_mut() {
        let start = b.kv_committed(&p.t.cache);
        b.kv_reserve(&mut p.t.cache, start + 1)?;
        if let Some(d) = p.feed.as_deref_mut() {
            ensure!(
                d.context_len() == start,
                "drafter context {} != target committed {start}",
                d.context_len()
            );
            d.stash_room()?;
            ("feed", d.stash_key()).hash(&mut key);
        }
        if one && p.t.step_root != Some(p.root) {
            let slot = p.t.step.as_mut().context("a device step without its step slot")?;
            b.ids_write(&mut slot.token, 0, &[p.root])?;
        }
        (p.t.dev_root, p.t.step_root) = (None, None);
        p.t.last_parents.clear();
        let s = p.s;
        let tag = if one { "ar step" } else { "ar" };
        (
            tag,
            s.temperature.to_bits(),
            s.top_p.to_bits(),
            s.top_k,
            s.seed,
            b.kv_id(&p.t.cache),
        )
            .hash(&mut key);
    }
    let toks = match (&mut *parts, staging) {
        ([p], _) => {
            let r = one_step(w, p, key.finish());
            if r.is_err() {
                // A failed step captures again next time.
                if let Some(slot) = p.t.step.as_mut() {
                    slot.graph = None;
                }
            }
            r?
        }
        (parts, Some(st)) => batch_step(w, parts, key, st, flush_us)?,
        (_, None) => anyhow::bail!("a batched step without a batch engine's buffers"),
    };
    let mut out = Vec::with_capacity(parts.len());
    for (p, &tok) in parts.iter_mut().zip(&toks) {
        if let Some(d) = p.feed.as_deref_mut() {
            d.stash_follow();
        }
        ensure!(
            (tok as usize) < c.vocab,
            "{}: token {tok} >= vocab {}",
            if one { "device step" } else { "batched step" },
            c.vocab
        );
        b.kv_commit_rows_host(&mut p.t.cache, 1);
        out.push(tok);
    }
    if let [p] = parts {
        p.t.step_root = Some(out[0]);
    }
    Ok(out)
}

/// An AR step of one sequence in its step slot (its token buffer, one-node mask and captured graph).
fn one_step<B: Backend>(w: &Weights<B>, p: &mut StepPart<'_, B>, key: u64) -> Result<Vec<u32>> {
    let (b, c) = (&w.backend, &w.cfg);
    let (s, mut feed) = (p.s, p.feed.as_deref_mut());
    let TargetModel {
        cache,
        step,
        info,
        mode,
        ..
    } = &mut *p.t;
    let StepSlot { token, mask, graph } = step.as_mut().context("a device step without its step slot")?;
    let mask = &*mask;
    b.graph_run(graph, key, &mut || {
        let rope = b.rope_at(&w.rope_inv, c.rope_attention_factor, PosOf::Kv(cache), None, 1);
        let mut segs = [Seg {
            kv: &mut *cache,
            t: 1,
            mask,
            rope: &rope,
        }];
        let (x, taps) = decoder_layers(w, &mut segs, w.embed_ids(token, 1), &info.tap_layers, *mode, None, None);
        if let Some(d) = feed.as_deref_mut() {
            DFlashDrafter::stash_rows(&mut [d], &taps.context("a feed step needs the target's taps")?)?;
        }
        let xn = w.final_norm(&x);
        if s.is_greedy() && w.vocab_split() {
            // The vocab-parallel argmax: R pairs through the communicator instead of V logits.
            w.lm_head_argmax_into(&xn, 1, token, 0)?;
        } else {
            // The token goes to position committed + 1 (sampling.rs: draws keyed by position).
            b.decide_rows(&w.lm_head(&xn, 1), 0, 1, c.vocab, s, PosOf::Kv(cache), 1, token)?;
        }
        b.kv_commit_rows(cache, 1)?;
        b.check()
    })?;
    b.ids_to_host(token) // the step's one read back
}

/// An AR step of several sequences in one forward (see batch.rs), captured in `st`'s graph of the batch's
/// key: one row per sequence, a decision per sequence at its own position, one read.
fn batch_step<B: Backend>(
    w: &Weights<B>,
    parts: &mut [StepPart<'_, B>],
    mut key: std::collections::hash_map::DefaultHasher,
    st: &mut Staging<B>,
    flush_us: f64,
) -> Result<Vec<u32>> {
    let (b, c) = (&w.backend, &w.cfg);
    let n = parts.len();
    st.room(b, 0, n);
    st.room(b, 1, n);
    (n, st.gen).hash(&mut key);
    let roots: Vec<u32> = parts.iter().map(|p| p.root).collect();
    b.ids_write(&mut st.tokens, 0, &roots)?;
    let mode = parts[0].t.mode;
    // Feed steps keep their taps (each drafter stashes its row).
    let tap_layers = match parts.iter().any(|p| p.feed.is_some()) {
        true => parts[0].t.info.tap_layers.clone(),
        false => Vec::new(),
    };
    let gkey = key.finish();
    let gi = st.capture_now(gkey).then(|| st.graph(gkey));
    let had = gi.is_some_and(|gi| st.graphs[gi].1.is_some());
    let (tokens, out, mask1) = (&st.tokens, &mut st.out, &st.mask1);
    let graph = gi.map(|gi| &mut st.graphs[gi].1);
    let mut body = || {
        // Every sequence's position, one table for the batch.
        let at: Vec<RopeSeg<'_, B>> = parts.iter().map(|p| (PosOf::Kv(&p.t.cache), None, 1)).collect();
        let rope = b.rope_at_segs(&w.rope_inv, c.rope_attention_factor, &at);
        drop(at);
        let mut segs: Vec<Seg<'_, B>> = parts
            .iter_mut()
            .map(|p| Seg {
                kv: &mut p.t.cache,
                t: 1,
                mask: mask1,
                rope: &rope,
            })
            .collect();
        let (x, taps) = decoder_layers(
            w,
            &mut segs,
            w.embed_ids(tokens, n),
            &tap_layers,
            mode,
            None,
            Some(&rope),
        );
        drop(segs);
        if !tap_layers.is_empty() {
            // Every sequence's row into its drafter's stash in one launch (all feed: `feed_steps`).
            let taps = taps.context("a feed step needs the target's taps")?;
            let mut ds = Vec::with_capacity(n);
            for p in parts.iter_mut() {
                ds.push(p.feed.as_deref_mut().context("a batch of feed and plain AR steps")?);
            }
            DFlashDrafter::stash_rows(&mut ds, &taps)?;
        }
        let logits = w.lm_head(&w.final_norm(&x), n);
        // Greedy decisions do not depend on the position: one argmax over every row when all are greedy.
        let all_greedy = parts.iter().all(|p| p.s.is_greedy());
        if all_greedy {
            let base = PosOf::Kv(&parts[0].t.cache);
            b.decide_rows(&logits, 0, n, c.vocab, &Sampling::greedy(), base, 1, out)?;
        }
        if !all_greedy {
            for (i, p) in parts.iter().enumerate() {
                // The token goes to position committed + 1 (sampling.rs: draws keyed by position).
                b.decide_rows(&logits, i, 1, c.vocab, p.s, PosOf::Kv(&p.t.cache), 1, out)?;
            }
        }
        let mut kvs: Vec<&mut B::Kv> = parts.iter_mut().map(|p| &mut p.t.cache).collect();
        b.kv_commit_rows_segs(&mut kvs, 1)?;
        b.check()
    };
    let r = match graph {
        Some(graph) => b.graph_run(graph, gkey, &mut body),
        None => body(),
    };
    if let (Err(_), Some(gi)) = (&r, gi) {
        st.graphs.remove(gi);
    }
    r?;
    st.ran(gi, had, flush_us);
    b.ids_to_host(&st.out) // the batch's one read back
}
