//! The CPU backend's DDTree round (`backend::TreeOps`): the tree, walk and commit of ddtree/ on the host;
//! the captured round is just the body, run.

use super::backend::{CpuBackend, CpuTree};
use super::cache::LatentCache;
use crate::backend::{TreeOps, Visibility};
use crate::ddtree::{build_tree_from_top_k, top_k_log_probs, walk_sampled, DraftTree};
use anyhow::Result;

impl TreeOps for CpuBackend {
    fn tree_new(&self, budget: usize, rows: usize, vocab: usize, k: usize) -> Result<CpuTree> {
        let tree = DraftTree::root_only(0);
        anyhow::ensure!((1..=vocab).contains(&k), "tree_new: top-{k} of a vocabulary of {vocab}");
        Ok(CpuTree {
            budget,
            k,
            rows,
            vocab,
            depths: vec![0],
            mask: tree.visibility.clone(),
            tree,
            walk: None,
            root: vec![0],
        })
    }
    fn tree_build(&self, t: &mut CpuTree, draft: &Vec<f32>, row0: usize) -> Result<()> {
        // build_tree is this with k = min(budget, vocab); the chain takes k = 1.
        let tree = if t.budget == 0 || t.rows == 0 {
            DraftTree::root_only(t.root[0])
        } else {
            let (from, to) = (row0 * t.vocab, (row0 + t.rows) * t.vocab);
            anyhow::ensure!(
                draft.len() >= to,
                "tree_build: {} draft logits for rows {row0}..{} of {}",
                draft.len(),
                row0 + t.rows,
                t.vocab
            );
            build_tree_from_top_k(
                t.root[0],
                &top_k_log_probs(&draft[from..to], t.rows, t.vocab, t.k),
                t.budget,
            )
        };
        t.set(tree);
        Ok(())
    }
    fn tree_root_only(&self, t: &mut CpuTree) -> Result<()> {
        anyhow::ensure!(t.budget == 0, "tree_root_only on a tree of budget {}", t.budget);
        t.set(DraftTree::root_only(t.root[0]));
        Ok(())
    }
    fn tree_set_root(&self, t: &mut CpuTree, root: u32) -> Result<()> {
        t.root[0] = root;
        Ok(())
    }
    fn tree_root<'t>(&self, t: &'t CpuTree) -> &'t Vec<u32> {
        &t.root
    }
    fn tree_tokens<'t>(&self, t: &'t CpuTree) -> &'t Vec<u32> {
        &t.tree.tokens
    }
    fn tree_depths<'t>(&self, t: &'t CpuTree) -> &'t Vec<u32> {
        &t.depths
    }
    fn tree_mask<'t>(&self, t: &'t CpuTree) -> &'t Visibility {
        &t.mask
    }
    fn tree_walk(
        &self,
        t: &mut CpuTree,
        logits: &Vec<f32>,
        row0: usize,
        s: &crate::sampling::Sampling,
        kv: &LatentCache,
    ) -> Result<()> {
        let (n, v) = (t.tree.len(), t.vocab);
        anyhow::ensure!(
            logits.len() >= (row0 + n) * v,
            "tree_walk: {} logits for {n} nodes from row {row0} x {v}",
            logits.len()
        );
        t.walk = Some(walk_sampled(
            &t.tree,
            &logits[row0 * v..(row0 + n) * v],
            v,
            s,
            kv.committed,
        ));
        Ok(())
    }
    fn tree_walk_decided(&self, t: &mut CpuTree, decisions: &Vec<u32>, row0: usize) -> Result<()> {
        let n = t.tree.len();
        anyhow::ensure!(
            decisions.len() >= row0 + n,
            "tree_walk_decided: {} decisions for {n} nodes from row {row0}",
            decisions.len()
        );
        t.walk = Some(crate::ddtree::walk(&t.tree, |i| decisions[row0 + i]));
        Ok(())
    }
    fn tree_path_rows(&self, t: &CpuTree, x: &Vec<f32>, row0: usize, cols: usize, rows_out: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows_out * cols];
        if let Some(w) = &t.walk {
            for (i, &p) in w.path.iter().enumerate().take(rows_out) {
                let r = row0 + p;
                out[i * cols..(i + 1) * cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
            }
        }
        out
    }
    fn tree_commit(&self, t: &mut CpuTree, kv: &mut LatentCache, ctx: &mut usize) -> Result<()> {
        let w = t
            .walk
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("tree_commit: no walk since the last build"))?;
        kv.commit(&w.path)?;
        *ctx += w.path.len();
        t.root[0] = *w
            .decisions
            .last()
            .ok_or_else(|| anyhow::anyhow!("tree_commit: an empty walk"))?;
        Ok(())
    }
    fn tree_commit_host(&self, _t: &CpuTree, _kv: &mut LatentCache, _ctx: &mut usize, _n: usize) {
        // tree_commit already moved the host state: the CPU has no other copy.
    }
    fn tree_result(&self, t: &CpuTree) -> Result<crate::ddtree::TreeResult> {
        let walk = t
            .walk
            .clone()
            .ok_or_else(|| anyhow::anyhow!("tree_result: no walk since the last build"))?;
        Ok(crate::ddtree::TreeResult {
            walk,
            log_q: t.tree.log_q[1..].to_vec(),
        })
    }
    fn tree_result_words(&self, _t: &CpuTree) -> usize {
        0 // the walk is on the host already: nothing to stage
    }
    fn tree_result_into(&self, _t: &CpuTree, _stage: &mut Vec<u32>, _at: usize) {}
    fn tree_result_from(&self, t: &CpuTree, _words: &[u32]) -> Result<crate::ddtree::TreeResult> {
        self.tree_result(t)
    }
    fn graph_run(&self, _graph: &mut Option<()>, _key: u64, body: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        body()
    }
}
