//! The tie-aware and route-aware comparisons of `--verify` on a backend that cannot equal the CPU
//! bundles bit for bit (CUDA: bf16 GEMM inputs, another reduction order). Used only when
//! `Tolerances::near_ties` is set (never on the CPU, whose comparison stays strict: verify.rs). Every
//! acceptance is returned as a note, which the table prints, so a user sees what was forgiven.
//!
//! The rules (a "near-tie" is always judged on the bundle's own values, against the logits tolerance t):
//! * greedy tokens ([`greedy`]): equal, except the first divergence at step k when the bundle's top-2
//!   logits at k are within t of each other; the prompt's later steps are then not compared;
//! * a logit row beyond t ([`row`]) is accepted as a route flip (one token's routed experts changed by a
//!   selection near-tie: the forwards after it see its changed KV entry too) when its |Δ| is within the
//!   route-flip tolerance and its argmax is the bundle's (or the bundle's top-2 are a near-tie);
//! * the traced layers ([`layer_route`]): router ids compare as sets (the MoE sums over the set; weights
//!   compare per id); a set that differs is accepted only as one swapped expert with everything upstream
//!   of the router (earlier layers, this layer's attention) within tolerance, and ends the trace's comparison;
//! * the DDTree round ([`tree_explained`], [`walk`]): a tree that differs is accepted when the run's tree is
//!   the engine's own build from the run's draft logits and the bundle's draft rows hold a near-tie (two
//!   of a row's top budget+1 logits within 2t); the walk's decisions may differ only at a near-tie.
//!
//! Tests: bottom of this file; tests/verify_cli.rs (the cuda rules end to end on perturbed bundles).

use super::{Cmp, Tolerances};
use kdtree_engine::sampling::argmax;
use kdtree_golden::bundle::{topk_of, DdtreeRecord, LayerTrace};

/// Largest minus second largest value of a row sorted descending (None with fewer than two).
pub fn margin_sorted(vals: &[f32]) -> Option<f32> {
    (vals.len() >= 2).then(|| vals[0] - vals[1])
}

/// Top-2 margin of an unsorted row.
pub fn margin(row: &[f32]) -> Option<f32> {
    margin_sorted(&topk_of(row, 2).1)
}

/// Greedy tokens `got` vs the bundle's `want` over their common length. `margin(s)`: the bundle's top-2
/// margin at step s. Ok(None): equal; Ok(Some((k, m))): first divergence at k, a near-tie (m <= tol);
/// Err: another divergence (or, when `whole`, a length difference).
pub fn greedy(
    what: &str,
    got: &[u32],
    want: &[u32],
    whole: bool,
    margin: impl Fn(usize) -> Option<f32>,
    tol: f32,
) -> Result<Option<(usize, f32)>, String> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None if whole && got.len() != want.len() => {
            Err(format!("{what}: {} entries vs bundle {}", got.len(), want.len()))
        }
        None => Ok(None),
        Some(k) => match margin(k) {
            Some(m) if m <= tol => Ok(Some((k, m))),
            m => Err(format!(
                "{what}[{k}]: {} vs bundle {} (the bundle's top-2 margin there {} > tolerance {tol}: not a near-tie)",
                got[k],
                want[k],
                m.map_or("unknown".into(), |m| format!("{m:e}"))
            )),
        },
    }
}

/// One logit row (`got` vs the bundle's `want`, same length, the ids they are at: top-1 first for a top-k
/// row) within `t.logits`, or accepted as a route flip (a note) within `t.route_flip` when its argmax is
/// the bundle's or the bundle's top-2 are within `t.logits`, and only with the bundle's evidence: `router`,
/// the smallest CPU router decision margin over the rows this one depends on (`ar.router_margins`,
/// `ddtree.router_margins`), below `t.route_flip_margin` (a bundle without margins gives none: strict).
/// Err: the problem.
pub fn row(
    cmp: &mut Cmp,
    t: &Tolerances,
    what: &str,
    got: &[f32],
    want: &[f32],
    router: Option<f32>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    cmp.tol = t.logits;
    let Some(p) = cmp.rows(what, 0, got, want) else {
        return Ok(());
    };
    let d = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0f32, |a, x| {
        if x.is_nan() {
            f32::INFINITY
        } else {
            a.max(x)
        }
    });
    let same_top = argmax(got) == argmax(want) || margin(want).is_some_and(|m| m <= t.logits);
    let evidence = router.filter(|&m| m < t.route_flip_margin);
    if let (true, true, Some(m)) = (d <= t.route_flip, same_top, evidence) {
        notes.push(format!(
            "{what}: max |Δ| {d:.3e} > {} but within the route-flip tolerance {} with the bundle's argmax, and the \
             CPU router's decision margin on its rows is {m:.2e} < {}: taken as a route flip",
            t.logits, t.route_flip, t.route_flip_margin
        ));
        return Ok(());
    }
    let why = match (router, d <= t.route_flip && same_top) {
        (_, false) => String::new(),
        (None, true) => "; not a route flip: the bundle records no router margins (regenerate it)".to_string(),
        (Some(m), true) => format!(
            "; not a route flip: the CPU router's smallest decision margin on its rows is {m:.2e} >= {}",
            t.route_flip_margin
        ),
    };
    Err(if same_top {
        format!("{p}{why}")
    } else {
        format!("{p}; argmax {} vs bundle {}", argmax(got), argmax(want))
    })
}

/// One traced MoE layer's route (`got` vs the bundle's `want`). Ok(None): the same expert set (weights
/// then compare per id: returned sorted by id); Ok(Some(note)): one expert swapped while `upstream_ok`
/// (the comparison of the trace stops here); Err: the problem.
pub fn layer_route(l: usize, got: &LayerTrace, want: &LayerTrace, upstream_ok: bool) -> Result<Option<String>, String> {
    let set = |r: &LayerTrace| {
        let mut v = r.router_ids.clone();
        v.sort_unstable();
        v
    };
    let (g, w) = (set(got), set(want));
    if g == w {
        return Ok(None);
    }
    let out = w.iter().filter(|e| !g.contains(e)).count();
    let into = g.iter().filter(|e| !w.contains(e)).count();
    let what = format!(
        "trace.layers.{l}.router_ids: {:?} vs bundle {:?}",
        got.router_ids, want.router_ids
    );
    if g.len() == w.len() && out == 1 && into == 1 && upstream_ok {
        Ok(Some(format!(
            "{what}: one expert swapped with the router's input within tolerance (a selection near-tie): layer {l}'s \
             MoE output, residual and router weights and the later layers are not compared"
        )))
    } else if !upstream_ok {
        Err(format!("{what} (the router's input already differs beyond tolerance)"))
    } else {
        Err(format!("{what} ({out} experts swapped; a near-tie swaps one)"))
    }
}

/// Router weights ordered by expert id (routes with the same set then compare weight by weight).
pub fn weights_by_id(r: &LayerTrace) -> Vec<f32> {
    let mut p: Vec<(u32, f32)> = r
        .router_ids
        .iter()
        .copied()
        .zip(r.router_weights.iter().copied())
        .collect();
    p.sort_by_key(|x| x.0);
    p.into_iter().map(|x| x.1).collect()
}

/// A tree that differs from the bundle's: Ok(note) when the run's tree is the engine's build from its own
/// draft logits and the bundle's draft rows hold a near-tie (two of a row's top budget+1 logits within
/// 2 × tol: each run value is within tol of the bundle's, so such a pair can swap); Err otherwise.
pub fn tree_explained(got: &DdtreeRecord, want: &DdtreeRecord, tol: f32) -> Result<String, String> {
    let own = kdtree_engine::ddtree::build_tree(got.root, &got.draft_logits, got.draft_rows, got.vocab, got.budget);
    if own.tokens != got.tree_tokens || own.parents != got.tree_parents || own.depths != got.tree_depths {
        return Err(format!(
            "ddtree tree: the run's tree {:?} / {:?} is not the one the engine builds from its own draft logits \
             {:?} / {:?}",
            got.tree_tokens, got.tree_parents, own.tokens, own.parents
        ));
    }
    let tie = want
        .draft_logits
        .chunks(want.vocab.max(1))
        .enumerate()
        .find_map(|(r, row)| {
            let (ids, vals) = topk_of(row, want.budget + 1);
            vals.windows(2)
                .position(|w| w[0] - w[1] <= 2.0 * tol)
                .map(|i| (r, ids[i], ids[i + 1], vals[i] - vals[i + 1]))
        });
    match tie {
        Some((r, a, b, gap)) => Ok(format!(
            "ddtree tree {:?} / {:?} vs bundle {:?} / {:?}: the bundle's draft row {r} has a near-tie (tokens {a} \
             and {b}, gap {gap:.3e} <= 2 × {tol}); the run's tree is its own draft logits' build; tree structure \
             not compared, verify rows compared by node path",
            got.tree_tokens, got.tree_parents, want.tree_tokens, want.tree_parents
        )),
        None => Err(format!(
            "ddtree tree {:?} / {:?} vs bundle {:?} / {:?}: differs with no near-tie in the bundle's draft rows",
            got.tree_tokens, got.tree_parents, want.tree_tokens, want.tree_parents
        )),
    }
}

/// The root-to-node token path of every node.
pub fn paths(r: &DdtreeRecord) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(r.tree_tokens.len());
    for (i, &t) in r.tree_tokens.iter().enumerate() {
        let mut p = match usize::try_from(r.tree_parents.get(i).copied().unwrap_or(-1)) {
            Ok(q) if q < i => out[q].clone(),
            _ => Vec::new(),
        };
        p.push(t);
        out.push(p);
    }
    out
}

/// The walk's decisions (the target's token at each accepted node) over their common length; a first
/// difference at i is accepted (note, later ones not compared) when the bundle's verify row at its
/// accepted node i is a near-tie. `whole`: also the accepted node indices and lengths (same tree).
pub fn walk(got: &DdtreeRecord, want: &DdtreeRecord, whole: bool, tol: f32) -> Result<Option<String>, String> {
    let v = want.vocab.max(1);
    let margin_at = |i: usize| {
        want.accepted
            .get(i)
            .and_then(|&n| want.verify_logits.get(n * v..(n + 1) * v))
            .and_then(margin)
    };
    match greedy(
        "ddtree.decisions",
        &got.decisions,
        &want.decisions,
        false,
        margin_at,
        tol,
    )? {
        Some((i, m)) => Ok(Some(format!(
            "ddtree.decisions[{i}]: {} vs bundle {}: a near-tie in the bundle's verify row of node {} (top-2 margin \
             {m:.3e} <= {tol}); the rest of the walk not compared",
            got.decisions[i], want.decisions[i], want.accepted[i]
        ))),
        None if whole && (got.accepted != want.accepted || got.decisions.len() != want.decisions.len()) => {
            Err(format!(
                "ddtree.accepted: {:?} vs bundle {:?} with the same decisions",
                got.accepted, want.accepted
            ))
        }
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Tolerances = Tolerances {
        logits: 0.1,
        layers: 0.1,
        router_weights: 0.1,
        route_flip: 2.0,
        route_flip_margin: 2e-4,
        near_ties: true,
    };

    #[test]
    fn greedy_accepts_only_a_near_tie_and_says_where() {
        let m = |_: usize| Some(0.05);
        assert_eq!(greedy("t", &[1, 2, 3], &[1, 2, 3], true, m, 0.1), Ok(None));
        assert_eq!(greedy("t", &[1, 9, 3], &[1, 2, 3], true, m, 0.1), Ok(Some((1, 0.05))));
        // the boundary: a margin equal to the tolerance is a near-tie, above it is not
        assert_eq!(
            greedy("t", &[1, 9], &[1, 2], true, |_| Some(0.1), 0.1),
            Ok(Some((1, 0.1)))
        );
        let e = greedy("t", &[1, 9], &[1, 2], true, |_| Some(0.1001), 0.1).unwrap_err();
        assert!(e.contains("t[1]: 9 vs bundle 2") && e.contains("not a near-tie"), "{e}");
        assert!(greedy("t", &[1, 9], &[1, 2], true, |_| None, 0.1).is_err());
        assert!(greedy("t", &[1], &[1, 2], true, m, 0.1)
            .unwrap_err()
            .contains("1 entries vs bundle 2"));
        assert_eq!(greedy("t", &[1], &[1, 2], false, m, 0.1), Ok(None));
    }

    #[test]
    fn rows_within_tolerance_route_flips_and_real_differences() {
        let mut cmp = Cmp {
            tol: 0.0,
            max_delta: 0.0,
        };
        let mut notes = Vec::new();
        let want = [5.0, 1.0, 0.0];
        let flip = Some(5e-5); // the bundle's CPU router margin on the row's rows: a route may flip there
        assert_eq!(
            row(&mut cmp, &T, "r", &[5.1, 1.0, 0.0], &want, None, &mut notes),
            Ok(())
        );
        assert!(notes.is_empty());
        // beyond the logits tolerance, within the route-flip one, same argmax, with router evidence: accepted
        assert_eq!(
            row(&mut cmp, &T, "r", &[6.5, 1.0, 0.5], &want, flip, &mut notes),
            Ok(())
        );
        assert!(
            notes[0].contains("route flip") && notes[0].contains("5.00e-5"),
            "{notes:?}"
        );
        // the same row without evidence: a bundle with no margins, or a router margin at or above 2e-4
        let e = row(&mut cmp, &T, "r", &[6.5, 1.0, 0.5], &want, None, &mut notes).unwrap_err();
        assert!(e.contains("records no router margins"), "{e}");
        let e = row(&mut cmp, &T, "r", &[6.5, 1.0, 0.5], &want, Some(2e-4), &mut notes).unwrap_err();
        assert!(e.contains("2.00e-4 >= 0.0002"), "{e}");
        assert_eq!(notes.len(), 1);
        // beyond the route-flip tolerance: fails
        assert!(row(&mut cmp, &T, "r", &[7.5, 1.0, 0.0], &want, flip, &mut notes).is_err());
        // within it but another argmax (no near-tie in the bundle): fails and says so
        let e = row(&mut cmp, &T, "r", &[5.0, 6.0, 0.0], &want, flip, &mut notes).unwrap_err();
        assert!(e.contains("argmax 1 vs bundle 0"), "{e}");
        // the same with a near-tie in the bundle's row: accepted
        assert_eq!(
            row(&mut cmp, &T, "r", &[5.0, 6.0, 0.0], &[5.0, 4.95, 0.0], flip, &mut notes),
            Ok(())
        );
        assert_eq!(cmp.max_delta, 5.0);
    }

    fn layer(ids: &[u32], w: &[f32]) -> LayerTrace {
        LayerTrace {
            router_ids: ids.to_vec(),
            router_weights: w.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn routes_compare_as_sets_and_forgive_one_swap_with_a_clean_input_only() {
        let want = layer(&[5, 7, 11, 2], &[0.7, 0.6, 0.5, 0.4]);
        // order only (the measured g-mid case): the same set, weights then equal per id
        let got = layer(&[5, 11, 7, 2], &[0.7, 0.5, 0.6, 0.4]);
        assert_eq!(layer_route(2, &got, &want, true), Ok(None));
        assert_eq!(weights_by_id(&got), weights_by_id(&want));
        let one = layer(&[5, 7, 11, 3], &[0.7, 0.6, 0.5, 0.4]);
        assert!(layer_route(2, &one, &want, true)
            .unwrap()
            .unwrap()
            .contains("one expert swapped"));
        assert!(layer_route(2, &one, &want, false)
            .unwrap_err()
            .contains("already differs"));
        let two = layer(&[5, 7, 12, 3], &[0.7, 0.6, 0.5, 0.4]);
        assert!(layer_route(2, &two, &want, true)
            .unwrap_err()
            .contains("2 experts swapped"));
    }

    fn round() -> DdtreeRecord {
        // vocab 4, budget 2: draft row 0 ranks token 1 then 2 (gap 0.5), so the tree is root 3 -> 1, 2
        let mut r = DdtreeRecord {
            start: 4,
            root: 3,
            budget: 2,
            vocab: 4,
            draft_rows: 1,
            draft_logits: vec![0.0, 2.0, 1.5, 0.0],
            visibility_words: 1,
            bonus: 0,
            ..Default::default()
        };
        let t = kdtree_engine::ddtree::build_tree(3, &r.draft_logits, 1, 4, 2);
        (r.tree_tokens, r.tree_parents, r.tree_depths) = (t.tokens, t.parents, t.depths);
        // verify rows: node 0 picks token 1 (accepted, node 1), node 1 picks 0 (bonus)
        r.verify_logits = vec![0.0, 3.0, 1.0, 0.0, 2.0, 0.0, 1.95, 0.0, 0.0, 0.0, 0.0, 0.0];
        r.accepted = vec![0, 1];
        r.decisions = vec![1, 0];
        r
    }

    #[test]
    fn a_reordered_tree_needs_a_draft_near_tie_and_the_runs_own_build() {
        let want = round();
        assert_eq!(want.tree_tokens, [3, 1, 2]);
        // the run's draft logits swap the two candidates (each within 0.3 of the bundle's)
        let mut got = want.clone();
        got.draft_logits = vec![0.0, 1.75, 1.8, 0.0];
        let t = kdtree_engine::ddtree::build_tree(3, &got.draft_logits, 1, 4, 2);
        (got.tree_tokens, got.tree_parents) = (t.tokens, t.parents);
        assert_eq!(got.tree_tokens, [3, 2, 1]);
        // gap 0.5 in the bundle: a near-tie at tolerance 0.25 (2 × 0.25 >= 0.5), not at 0.2
        assert!(tree_explained(&got, &want, 0.25)
            .unwrap()
            .contains("near-tie (tokens 1 and 2"));
        assert!(tree_explained(&got, &want, 0.2).unwrap_err().contains("no near-tie"));
        // a tree its own draft logits do not build is never explained
        let mut bad = got.clone();
        bad.tree_tokens = vec![3, 2, 0];
        assert!(tree_explained(&bad, &want, 0.25)
            .unwrap_err()
            .contains("not the one the engine builds"));
        assert_eq!(paths(&want), [vec![3], vec![3, 1], vec![3, 2]]);
    }

    #[test]
    fn walk_decisions_differ_only_at_a_near_tie() {
        let want = round();
        assert_eq!(walk(&want.clone(), &want, true, 0.1), Ok(None));
        // node 1's row: 2.0 vs 1.95, a near-tie: the bonus may be 2
        let mut got = want.clone();
        got.decisions = vec![1, 2];
        assert!(walk(&got, &want, true, 0.1)
            .unwrap()
            .unwrap()
            .contains("near-tie in the bundle's verify row of node 1"));
        assert!(walk(&got, &want, true, 0.01).is_err());
        // node 0's row: 3.0 vs 1.0, not a near-tie
        got.decisions = vec![2, 0];
        assert!(walk(&got, &want, true, 0.1)
            .unwrap_err()
            .contains("ddtree.decisions[0]"));
        // the same decisions through other node indices: only a difference when the tree is the same
        got.decisions = want.decisions.clone();
        got.accepted = vec![0, 2];
        assert!(walk(&got, &want, true, 0.1).unwrap_err().contains("ddtree.accepted"));
        assert_eq!(walk(&got, &want, false, 0.1), Ok(None));
    }
}
