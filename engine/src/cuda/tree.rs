//! The DDTree round's tree work on the device (issue 9): per-depth top-K log-probs of the draft logits, the
//! best-first tree build, its ancestor bitmask (the target's tree-verify mask), and the walk over the
//! target's per-node decisions. Buffers are sized once for a (budget, draft rows, vocab) and reused every
//! round (no allocation per round); every step reads its sizes (tree size, bonus token) from device memory,
//! so the chain is graph-capturable and needs no host read until the round's result. That result (the walk
//! and the popped nodes' scores, which `--budget auto` reads: ddtree/cost.rs) is one buffer, read in one copy.
//!
//! Launches: `build` = topk_logprobs + ddtree_build + visibility (3 kernels); `walk_greedy` = argmax over the
//! tree's rows + ddtree_walk (2). CPU twins: `ddtree::{top_k_log_probs, build_tree_from_top_k, Visibility,
//! walk_greedy}`; equality is tested in engine/tests/cuda_ddtree.rs.

use cudarc::driver::CudaSlice;

use super::ops::{argmax, ddtree_build, ddtree_walk, sample_rows, topk_logprobs, visibility};
use super::{ensure, Gpu, Result};
use crate::ddtree::{DraftTree, TopK, TreeResult, Visibility, Walk};

/// An ancestor bitmask on the device: `bits` `[rows, words]` u64, bit j of row i = node j is i or an
/// ancestor of i (the CUDA backend's `Backend::Mask`).
pub struct DMask {
    pub bits: CudaSlice<u64>,
    pub rows: usize,
    pub words: usize,
    /// Known to be a chain (row i sees exactly rows 0..=i: a prefill), so attention may run it as causal.
    pub causal: bool,
}

/// Device buffers of one sequence's tree, for a fixed budget (root excluded), draft rows (depths) and vocab.
pub struct DeviceTree {
    pub budget: usize,
    pub rows: usize,
    pub vocab: usize,
    /// K = min(budget, vocab).
    pub k: usize,
    /// u64 words per mask row: ceil((budget + 1) / 64).
    pub words: usize,
    /// Per-depth top-K `[rows, k]`.
    pub lp: CudaSlice<f32>,
    pub tok: CudaSlice<u32>,
    /// The root token `[1]` (the last round's bonus).
    pub bonus: CudaSlice<u32>,
    /// Tree arrays `[budget + 1]` (node 0 = root, pop order) and the node count `[1]`.
    pub tokens: CudaSlice<u32>,
    pub depths: CudaSlice<u32>,
    pub parents: CudaSlice<i32>,
    pub first_child: CudaSlice<i32>,
    pub next_sibling: CudaSlice<i32>,
    pub n_nodes: CudaSlice<i32>,
    /// Ancestor bitmask `[budget + 1, words]` (the verify forward's tree-attention mask).
    pub mask: DMask,
    /// Per-node target decisions `[budget + 1]`, the accepted path and its decisions `[rows + 1]`, its
    /// length `[1]`.
    pub decisions: CudaSlice<u32>,
    /// The round's result in one buffer (so reading it back is one copy): `[len, path[rows + 1],
    /// decisions[rows + 1]]` i32 (the decisions are u32 token ids), then from i32 index
    /// [`DeviceTree::log_q_at`] (8-byte aligned) the tree's `log_q` `[budget + 1]` f64 as two i32 words
    /// each, written there by the builder.
    pub walk_out: CudaSlice<i32>,
    /// The top-K's workspace.
    pub topk: topk_logprobs::TopkWork,
}

impl DeviceTree {
    /// Allocates every buffer once (budget 0..=2048, draft rows 1..=255, K = min(budget, vocab) <= 2048; budget 0:
    /// a feed round's root-only tree, see [`DeviceTree::root_only`]).
    pub fn new(gpu: &Gpu, budget: usize, rows: usize, vocab: usize) -> Result<DeviceTree> {
        Self::with_k(gpu, budget, rows, vocab, budget.min(vocab))
    }

    /// [`DeviceTree::new`] with the top-`k` of each draft row given (1 for the chain), `k <= min(2048, vocab)`.
    pub fn with_k(gpu: &Gpu, budget: usize, rows: usize, vocab: usize, k: usize) -> Result<DeviceTree> {
        let op = "device_tree";
        ensure(op, budget <= ddtree_build::MAX_BUDGET, || {
            format!("budget {budget} must be in 0..={}", ddtree_build::MAX_BUDGET)
        })?;
        ensure(op, (1..=ddtree_build::MAX_DEPTH).contains(&rows), || {
            format!("{rows} draft rows must be in 1..={}", ddtree_build::MAX_DEPTH)
        })?;
        ensure(op, vocab > 0, || "empty vocabulary".into())?;
        ensure(op, (1..=vocab.min(topk_logprobs::MAX_K)).contains(&k), || {
            format!("top-{k} of a vocabulary of {vocab}")
        })?;
        let n = budget + 1;
        let words = n.div_ceil(64);
        // Budget 0: the root-only tree's fixed arrays, written once (no build ever rewrites them); the root's
        // token is copied in by each round (`root_only`).
        let one = |v: i32| if budget == 0 { gpu.upload(&[v]) } else { gpu.zeros(n) };
        Ok(DeviceTree {
            budget,
            rows,
            vocab,
            k,
            words,
            lp: gpu.zeros(rows * k)?,
            tok: gpu.zeros(rows * k)?,
            bonus: gpu.zeros(1)?,
            tokens: gpu.zeros(n)?,
            depths: gpu.zeros(n)?,
            parents: one(-1)?,
            first_child: one(-1)?,
            next_sibling: one(-1)?,
            n_nodes: if budget == 0 { gpu.upload(&[1])? } else { gpu.zeros(1)? },
            mask: DMask {
                bits: if budget == 0 {
                    gpu.upload(&[1u64])?
                } else {
                    gpu.zeros(n * words)?
                },
                rows: n,
                words,
                causal: false,
            },
            decisions: gpu.zeros(n)?,
            walk_out: gpu.zeros(Self::log_q_at_for(rows) + 2 * n)?,
            topk: topk_logprobs::TopkWork::new(gpu, rows, vocab, k)?,
        })
    }

    /// A feed round's tree (budget 0): the root alone, its token copied from [`DeviceTree::bonus`] where the
    /// round runs (the other arrays were written at allocation; `log_q` is the zeroed buffer's 0).
    pub fn root_only(&mut self, gpu: &Gpu) -> Result<()> {
        ensure("device_tree", self.budget == 0, || {
            format!("root_only on a tree of budget {}", self.budget)
        })?;
        gpu.stream
            .memcpy_dtod(&self.bonus, &mut self.tokens)
            .map_err(super::drv("device_tree root_only"))
    }

    /// Where the f64 `log_q` starts in [`DeviceTree::walk_out`] (i32 index): after the walk, rounded up to
    /// an even index so the f64 stores are aligned (the buffer itself is 256-byte aligned).
    pub fn log_q_at(&self) -> usize {
        Self::log_q_at_for(self.rows)
    }
    fn log_q_at_for(rows: usize) -> usize {
        (1 + 2 * (rows + 1)).next_multiple_of(2)
    }

    /// Top-K of `draft_logits` (`[rows, ld]` f32, first `vocab` used), then [`DeviceTree::build_from_top_k`].
    pub fn build(&mut self, gpu: &Gpu, draft_logits: &cudarc::driver::CudaView<'_, f32>, ld: usize) -> Result<()> {
        topk_logprobs::topk_logprobs(
            gpu,
            draft_logits,
            self.rows,
            self.vocab,
            ld,
            self.k,
            &mut self.lp.as_view_mut(),
            &mut self.tok.as_view_mut(),
            &mut self.topk,
        )?;
        self.build_from_top_k(gpu)
    }

    /// [`DeviceTree::build`] of several trees of one shape (budget, draft rows, vocab, K) at once: tree t from
    /// rows `[t·rows, (t+1)·rows)` of `draft_logits` (`[.., ld]`): one top-K over every row (each row split as
    /// its own tree's workspace splits it), then every tree built with its mask in one launch per
    /// [`ddtree_build::MAX_SEGS`] trees. Each tree ends as its own [`DeviceTree::build`] leaves it, except that
    /// the top-K is a per-call buffer of the batch's, not the tree's own `lp` / `tok`.
    pub fn build_batch(
        gpu: &Gpu,
        trees: &mut [&mut DeviceTree],
        draft_logits: &cudarc::driver::CudaView<'_, f32>,
        ld: usize,
    ) -> Result<()> {
        let Some(t0) = trees.first() else { return Ok(()) };
        let (budget, rows, vocab, k, words, splits) = (t0.budget, t0.rows, t0.vocab, t0.k, t0.words, t0.topk.splits);
        ensure(
            "device_tree",
            trees
                .iter()
                .all(|t| (t.budget, t.rows, t.vocab, t.k) == (budget, rows, vocab, k)),
            || "a batched build over trees of different shapes".into(),
        )?;
        let n = trees.len();
        let (mut lp, mut tok) = (gpu.out::<f32>(n * rows * k)?, gpu.out::<u32>(n * rows * k)?);
        let mut work = topk_logprobs::TopkWork::with_splits(gpu, n * rows, vocab, k, splits)?;
        topk_logprobs::topk_logprobs(
            gpu,
            draft_logits,
            n * rows,
            vocab,
            ld,
            k,
            &mut lp.as_view_mut(),
            &mut tok.as_view_mut(),
            &mut work,
        )?;
        let per = rows * k;
        for (c, chunk) in trees.chunks_mut(ddtree_build::MAX_SEGS).enumerate() {
            let at = c * ddtree_build::MAX_SEGS * per;
            let m = chunk.len();
            let mut segs: Vec<ddtree_build::BuildSeg<'_>> = Vec::with_capacity(m);
            for t in chunk.iter_mut() {
                let q = t.log_q_at();
                let DeviceTree {
                    bonus,
                    tokens,
                    depths,
                    parents,
                    first_child,
                    next_sibling,
                    n_nodes,
                    mask,
                    walk_out,
                    ..
                } = &mut **t;
                segs.push(ddtree_build::BuildSeg {
                    bonus: bonus.as_view(),
                    tokens: tokens.as_view_mut(),
                    depths: depths.as_view_mut(),
                    parents: parents.as_view_mut(),
                    walk_out: walk_out.as_view_mut(),
                    log_q_at: q,
                    first_child: first_child.as_view_mut(),
                    next_sibling: next_sibling.as_view_mut(),
                    n_nodes: n_nodes.as_view_mut(),
                    mask: mask.bits.as_view_mut(),
                });
            }
            ddtree_build::ddtree_build_segs(
                gpu,
                &lp.slice(at..at + m * per),
                &tok.slice(at..at + m * per),
                rows,
                k,
                budget,
                words,
                &mut segs,
            )?;
        }
        Ok(())
    }

    /// Tree of root `bonus` from the top-K in `lp` / `tok`, and its ancestor bitmask.
    pub fn build_from_top_k(&mut self, gpu: &Gpu) -> Result<()> {
        let (at, n) = (self.log_q_at(), self.budget + 1);
        let mut tail = self.walk_out.slice_mut(at..);
        // SAFETY: the tail holds 2n i32 words = n f64, starting 8-byte aligned (an even i32 index of a
        // 256-byte aligned allocation); every bit pattern is a valid f64.
        let mut log_q = unsafe { tail.transmute_mut::<f64>(n) }.expect("walk_out's tail holds budget + 1 f64");
        let out = ddtree_build::TreeOut {
            tokens: &mut self.tokens.as_view_mut(),
            depths: &mut self.depths.as_view_mut(),
            parents: &mut self.parents.as_view_mut(),
            log_q: &mut log_q,
            first_child: &mut self.first_child.as_view_mut(),
            next_sibling: &mut self.next_sibling.as_view_mut(),
            n_nodes: &mut self.n_nodes.as_view_mut(),
        };
        ddtree_build::ddtree_build(
            gpu,
            &self.lp.as_view(),
            &self.tok.as_view(),
            self.rows,
            self.k,
            self.budget,
            &self.bonus.as_view(),
            out,
        )?;
        visibility::visibility(
            gpu,
            &self.parents.as_view(),
            Some(&self.n_nodes.as_view()),
            self.budget + 1,
            self.words,
            &mut self.mask.bits.as_view_mut(),
        )
    }

    /// Greedy decisions (row argmax of `verify_logits` `[budget + 1, ld]`, node order; rows past the tree's
    /// size are ignored) and the walk over them.
    pub fn walk_greedy(
        &mut self,
        gpu: &Gpu,
        verify_logits: &cudarc::driver::CudaView<'_, f32>,
        ld: usize,
    ) -> Result<()> {
        argmax::argmax(
            gpu,
            verify_logits,
            self.budget + 1,
            self.vocab,
            ld,
            &mut self.decisions.as_view_mut(),
        )?;
        self.walk(gpu)
    }

    /// Sampled decisions (`sampling::sample` of every node's row of `verify_logits` `[budget + 1, ld]` with
    /// the uniform of position `start + depth + 1`, plus `start_dev[0]` when given: the committed length on
    /// the device; greedy when `s` is) and the walk over them.
    #[allow(clippy::too_many_arguments)]
    pub fn walk_sampled(
        &mut self,
        gpu: &Gpu,
        verify_logits: &cudarc::driver::CudaView<'_, f32>,
        ld: usize,
        s: &crate::sampling::Sampling,
        start: usize,
        start_dev: Option<&cudarc::driver::CudaView<'_, i32>>,
    ) -> Result<()> {
        if s.is_greedy() {
            return self.walk_greedy(gpu, verify_logits, ld);
        }
        let depths = self.depths.as_view();
        sample_rows::sample_rows(
            gpu,
            verify_logits,
            self.budget + 1,
            self.vocab,
            ld,
            s,
            start as u64,
            start_dev,
            Some(&depths),
            &mut self.decisions.as_view_mut(),
        )?;
        self.walk(gpu)
    }

    /// The walk over the decisions already in `decisions` (greedy or sampled per node).
    pub fn walk(&mut self, gpu: &Gpu) -> Result<()> {
        let m = self.rows + 1;
        let (mut len, mut rest) = self.walk_out.split_at_mut(1);
        let (mut path, mut dec) = rest.split_at_mut(m);
        // SAFETY: i32 and u32 have the same size and every bit pattern is valid for both.
        let mut dec = unsafe { dec.transmute_mut::<u32>(m) }.expect("the decisions slice holds m values");
        ddtree_walk::ddtree_walk(
            gpu,
            &self.decisions.as_view(),
            &self.tokens.as_view(),
            &self.first_child.as_view(),
            &self.next_sibling.as_view(),
            &self.n_nodes.as_view(),
            self.budget + 1,
            self.rows + 1,
            &mut path,
            &mut dec,
            &mut len,
        )
    }

    /// The top-K as the CPU type (tests).
    pub fn top_k_to_host(&self, gpu: &Gpu) -> Result<TopK> {
        Ok(TopK {
            rows: self.rows,
            k: self.k,
            log_probs: gpu.download(&self.lp)?,
            tokens: gpu.download(&self.tok)?,
        })
    }

    /// Uploads a host top-K into `lp` / `tok` (tests: the builder on the CPU's exact input).
    pub fn set_top_k(&mut self, gpu: &Gpu, top: &TopK) -> Result<()> {
        ensure("device_tree", top.rows == self.rows && top.k == self.k, || {
            format!("top-K {}x{} for a tree of {}x{}", top.rows, top.k, self.rows, self.k)
        })?;
        gpu.drain()?;
        gpu.stream
            .memcpy_htod(&top.log_probs, &mut self.lp)
            .map_err(super::drv("device_tree upload"))?;
        gpu.stream
            .memcpy_htod(&top.tokens, &mut self.tok)
            .map_err(super::drv("device_tree upload"))?;
        Ok(())
    }

    /// Sets the root token.
    pub fn set_bonus(&mut self, gpu: &Gpu, bonus: u32) -> Result<()> {
        super::GpuStats::bump(&gpu.stats.uploads);
        gpu.drain()?;
        gpu.stream
            .memcpy_htod(&[bonus], &mut self.bonus)
            .map_err(super::drv("device_tree upload"))
    }

    /// The tree as the CPU type, its bitmask narrowed to the CPU's `ceil(nodes / 64)` words (the extra
    /// capacity words must be zero: an error otherwise). Tests and probes only (synchronises).
    pub fn to_host(&self, gpu: &Gpu) -> Result<DraftTree> {
        let n = gpu.download(&self.n_nodes)?[0] as usize;
        ensure("device_tree", (1..=self.budget + 1).contains(&n), || {
            format!("the device tree has {n} nodes, capacity {}", self.budget + 1)
        })?;
        fn cut<T>(mut v: Vec<T>, n: usize) -> Vec<T> {
            v.truncate(n);
            v
        }
        let bits_all = gpu.download(&self.mask.bits)?;
        let words = n.div_ceil(64).max(1);
        let mut bits = Vec::with_capacity(n * words);
        for i in 0..n {
            let row = &bits_all[i * self.words..(i + 1) * self.words];
            ensure("device_tree", row[words..].iter().all(|&w| w == 0), || {
                format!("mask row {i} has bits past node {n}")
            })?;
            bits.extend_from_slice(&row[..words]);
        }
        Ok(DraftTree {
            tokens: cut(gpu.download(&self.tokens)?, n),
            depths: cut(gpu.download(&self.depths)?, n),
            parents: cut(gpu.download(&self.parents)?, n),
            log_q: cut(Self::f64s(&gpu.download(&self.walk_out)?[self.log_q_at()..]), n),
            first_child: cut(gpu.download(&self.first_child)?, n),
            next_sibling: cut(gpu.download(&self.next_sibling)?, n),
            visibility: Visibility { rows: n, words, bits },
        })
    }

    /// The f64 values stored as pairs of i32 words (low word first: little-endian, as the device writes them).
    fn f64s(words: &[i32]) -> Vec<f64> {
        words
            .chunks_exact(2)
            .map(|w| f64::from_bits((w[0] as u32 as u64) | ((w[1] as u32 as u64) << 32)))
            .collect()
    }

    /// The last walk and the last build's popped-node scores (`log_q[1..=budget]`) as the CPU types: one
    /// device-to-host copy (the round's one read back). The device round builds only full trees
    /// (`ddtree::tree_is_full`), so all `budget` scores are this build's.
    pub fn result_to_host(&self, gpu: &Gpu) -> Result<TreeResult> {
        self.result_from(&gpu.download(&self.walk_out)?)
    }

    /// [`DeviceTree::result_to_host`] of the result buffer's words already on the host (a batch's one read).
    pub fn result_from(&self, out: &[i32]) -> Result<TreeResult> {
        let m = self.rows + 1;
        ensure("device_tree", out.len() == self.walk_out.len(), || {
            format!("{} result words, expected {}", out.len(), self.walk_out.len())
        })?;
        let len = out[0] as usize;
        ensure("device_tree", (1..=m).contains(&len), || {
            format!("walk length {len} outside 1..={m}")
        })?;
        let path = out[1..1 + len].iter().map(|&p| p as usize).collect();
        let decisions = out[1 + m..1 + m + len].iter().map(|&d| d as u32).collect();
        let mut log_q = Self::f64s(&out[self.log_q_at()..]);
        log_q.remove(0); // the root's 0
        Ok(TreeResult {
            walk: Walk { path, decisions },
            log_q,
        })
    }

    /// The walk of [`DeviceTree::result_to_host`] (tests).
    pub fn walk_to_host(&self, gpu: &Gpu) -> Result<Walk> {
        Ok(self.result_to_host(gpu)?.walk)
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceTree;

    #[test]
    fn scores_sit_aligned_after_the_walk_as_word_pairs() {
        for rows in 1..40 {
            let at = DeviceTree::log_q_at_for(rows);
            let walk = 1 + 2 * (rows + 1); // [len, path, decisions]
            assert!(
                at.is_multiple_of(2) && (walk..=walk + 1).contains(&at),
                "rows {rows}: scores at {at}"
            );
        }
        // Little-endian pairs, as the device's f64 stores leave them in the i32 buffer.
        let x = [0.0, -1.5, f64::NEG_INFINITY, -1e-300, -0.0];
        let words: Vec<i32> = x
            .iter()
            .flat_map(|v| {
                v.to_bits()
                    .to_le_bytes()
                    .chunks(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let back: Vec<u64> = DeviceTree::f64s(&words).iter().map(|v| v.to_bits()).collect();
        assert_eq!(back, x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
}
