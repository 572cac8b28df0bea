//! DDTree: the draft tree built from DFlash marginals (build.rs), its ancestor bitmask (`backend::Visibility`,
//! also the target's tree-attention mask) and the walk that verifies it against the target (walk.rs).
//! Pure CPU bookkeeping, no model math; the loop that drives them is generate.rs. cost.rs chooses the budget
//! of `--budget auto` (CaDDTree, ddtree.md §4.3) from a measured round cost and the tree's own scores.
//!
//! Must match: `build_ddtree_tree` / `follow_verified_tree` of liranringel/ddtree `ddtree.py` (c96427a),
//! described in shared reference ddtree.md §2–3. Tests: unit tests in each file (including the worked
//! example of ddtree.md §2.5) and engine/tests/ddtree_tree.rs (a port of the reference builder).

mod build;
pub mod cost;
mod walk;

pub use crate::backend::Visibility;
pub use build::{build_tree, build_tree_from_top_k, top_k_log_probs, DraftTree, TopK};
pub use cost::{AutoBudget, CostModel};
pub use walk::{walk, walk_greedy, walk_sampled, Walk};

/// What the host reads back after a device round (in one copy on a GPU): the walk, and the builder's scores
/// of the popped nodes (`DraftTree::log_q[1..]`, pop order), which [`AutoBudget`] turns into the next budget.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeResult {
    pub walk: Walk,
    pub log_q: Vec<f64>,
}

/// Whether a tree of `budget` nodes from `rows` draft rows over `vocab` always has exactly `budget` drafted
/// nodes: the distinct prefixes, `sum over d = 1..rows of K^d` with `K = min(budget, vocab)`, are at least
/// `budget` (the builder pops each prefix at most once and never runs out before they are all popped).
/// The device round's shapes (`budget + 1` verify rows) rely on it.
pub fn tree_is_full(budget: usize, rows: usize, vocab: usize) -> bool {
    let k = budget.min(vocab) as u128;
    let (mut total, mut pow) = (0u128, 1u128);
    for _ in 0..rows {
        pow = pow.saturating_mul(k);
        total = total.saturating_add(pow);
        if total >= budget as u128 {
            return true;
        }
    }
    budget == 0
}
