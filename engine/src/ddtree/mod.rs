//! DDTree: the draft tree built from DFlash marginals (build.rs), its ancestor bitmask (visibility.rs,
//! also the target's tree-attention mask) and the walk that verifies it against the target (walk.rs).
//! Pure CPU bookkeeping, no model math; the loop that drives them is generate.rs.
//!
//! Must match: `build_ddtree_tree` / `follow_verified_tree` of liranringel/ddtree `ddtree.py` (c96427a),
//! described in shared reference ddtree.md §2–3. Tests: unit tests in each file (including the worked
//! example of ddtree.md §2.5) and engine/tests/ddtree_tree.rs (a port of the reference builder).

mod build;
mod visibility;
mod walk;

pub use build::{build_tree, build_tree_from_top_k, top_k_log_probs, DraftTree, TopK};
pub use visibility::Visibility;
pub use walk::{walk, walk_greedy, walk_sampled, Walk};
