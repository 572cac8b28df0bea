//! `--verify`'s comparisons of a re-run with the bundle's records: logit rows and top-k within a tolerance
//! ([`Cmp`]), the AR tokens and rows, the per-layer probes of the traced step and the DDTree round, strict
//! (the CPU: tolerance 0, every check exact) or under the tie- and route-aware rules of rules.rs (CUDA).
//! Tests: bottom of this file; verify/e2e_tests.rs; tests/verify_cli.rs.

use kdtree_golden::bundle::{topk_of, ArRecord, DdtreeRecord, TraceRecord};

use super::rules;
use super::{PromptCheck, Tolerances};

/// Running |Δ| comparison of logit arrays.
pub(super) struct Cmp {
    pub(super) tol: f32,
    pub(super) max_delta: f32,
}

impl Cmp {
    /// Compare `got` with `want` (the bundle), rows of `cols` values (0: one flat array); the first value
    /// beyond the tolerance (or a length difference) is returned as a problem, located as `what[row, col]`.
    /// A NaN counts as an infinite difference.
    pub(super) fn rows(&mut self, what: &str, cols: usize, got: &[f32], want: &[f32]) -> Option<String> {
        if got.len() != want.len() {
            return Some(format!("{what}: {} values, bundle {}", got.len(), want.len()));
        }
        let mut first = None;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let d = (g - w).abs();
            let d = if d.is_nan() { f32::INFINITY } else { d };
            self.max_delta = self.max_delta.max(d);
            if d > self.tol && first.is_none() {
                let at = match (i.checked_div(cols), i.checked_rem(cols)) {
                    (Some(r), Some(c)) => format!("{r}, {c}"),
                    _ => format!("{i}"),
                };
                first = Some(format!(
                    "{what}[{at}]: {g} vs bundle {w} (|Δ| {d:e} > tolerance {})",
                    self.tol
                ));
            }
        }
        first
    }

    /// Step `s`'s top-k against the bundle's: the values at the recorded ids within the tolerance, no other
    /// id above the recorded k-th value by more than the tolerance, and (tolerance 0) the very same ids.
    pub(super) fn topk(&mut self, s: usize, row: &[f32], ids: &[u32], vals: &[f32]) -> Option<String> {
        let at: Vec<f32> = ids
            .iter()
            .map(|&id| row.get(id as usize).copied().unwrap_or(f32::NAN))
            .collect();
        if let Some(p) = self.rows(&format!("ar.topk_logits step {s} (ids {ids:?})"), 0, &at, vals) {
            return Some(p);
        }
        let (mine, _) = topk_of(row, ids.len());
        if self.tol == 0.0 {
            return (mine != ids).then(|| format!("ar.topk_ids step {s}: {mine:?} vs bundle {ids:?}"));
        }
        let kth = vals.last().copied().unwrap_or(f32::INFINITY);
        let outranks = |x: f32| x.is_nan() || x > kth + self.tol;
        let intruder = (0..row.len() as u32).find(|id| !ids.contains(id) && outranks(row[*id as usize]));
        intruder.map(|id| {
            format!(
                "ar.topk_ids step {s}: id {id} ({}) outranks the bundle's top-k {ids:?} (k-th {kth})",
                row[id as usize]
            )
        })
    }
}

pub(super) fn first_diff<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) -> Option<String> {
    if got == want {
        return None;
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => Some(format!("{what}[{i}]: {:?} vs bundle {:?}", got[i], want[i])),
        None => Some(format!("{what}: {} entries vs bundle {}", got.len(), want.len())),
    }
}

/// Compare a re-recorded AR run (`got`, with every step's full row `rows`) with the bundle's.
pub(super) fn compare_ar(c: &mut PromptCheck, cmp: &mut Cmp, got: &ArRecord, rows: &[Vec<f32>], want: &ArRecord) {
    c.tokens_total = want.tokens.len();
    c.tokens_equal = got.tokens.iter().zip(&want.tokens).take_while(|(a, b)| a == b).count();
    c.problems.extend(first_diff("ar.tokens", &got.tokens, &want.tokens));
    let got_full: Vec<f32> = rows.iter().take(want.full_steps).flatten().copied().collect();
    let full = cmp.rows("ar.full_logits", want.vocab, &got_full, &want.full_logits);
    let mut topk = None;
    for (s, row) in rows.iter().enumerate().take(want.tokens.len()) {
        let (ids, vals) = want.topk_row(s);
        let p = cmp.topk(s, row, ids, vals);
        topk = topk.or(p);
    }
    c.problems.extend(full.into_iter().chain(topk));
}

/// Compare a re-run DDTree round with the bundle's; returns whether it matched.
pub(super) fn compare_round(c: &mut PromptCheck, cmp: &mut Cmp, got: &DdtreeRecord, want: &DdtreeRecord) -> bool {
    let before = c.problems.len();
    let meta = |r: &DdtreeRecord| vec![r.start, r.root as usize, r.budget, r.draft_rows, r.visibility_words];
    c.problems.extend(first_diff(
        "ddtree (start, root, budget, draft rows, visibility words)",
        &meta(got),
        &meta(want),
    ));
    c.problems
        .extend(cmp.rows("ddtree.draft_logits", want.vocab, &got.draft_logits, &want.draft_logits));
    c.problems
        .extend(first_diff("ddtree.tree_tokens", &got.tree_tokens, &want.tree_tokens));
    c.problems
        .extend(first_diff("ddtree.tree_parents", &got.tree_parents, &want.tree_parents));
    c.problems
        .extend(first_diff("ddtree.tree_depths", &got.tree_depths, &want.tree_depths));
    c.problems
        .extend(first_diff("ddtree.visibility", &got.visibility, &want.visibility));
    c.problems.extend(cmp.rows(
        "ddtree.verify_logits",
        want.vocab,
        &got.verify_logits,
        &want.verify_logits,
    ));
    c.problems
        .extend(first_diff("ddtree.accepted", &got.accepted, &want.accepted));
    c.problems
        .extend(first_diff("ddtree.decisions", &got.decisions, &want.decisions));
    c.problems
        .extend(first_diff("ddtree bonus", &[got.bonus], &[want.bonus]));
    c.problems.len() == before
}

/// Compare the re-run's per-layer probes of the traced decode step with the bundle's: step, position
/// and token exactly, router ids exactly, every tensor within its class's tolerance.
pub(super) fn compare_trace(
    c: &mut PromptCheck,
    cmp: &mut Cmp,
    tol: &Tolerances,
    got: &TraceRecord,
    want: &TraceRecord,
) {
    let meta = |r: &TraceRecord| vec![r.step, r.position, r.token as usize, r.layers.len()];
    c.problems.extend(first_diff(
        "trace (step, position, token, layers)",
        &meta(got),
        &meta(want),
    ));
    let saved = cmp.tol;
    for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        c.problems.extend(first_diff(
            &format!("trace.layers.{l}.router_ids"),
            &g.router_ids,
            &w.router_ids,
        ));
        cmp.tol = tol.layers;
        c.problems
            .extend(cmp.rows(&format!("trace.layers.{l}.attn_out"), 0, &g.attn_out, &w.attn_out));
        c.problems
            .extend(cmp.rows(&format!("trace.layers.{l}.mlp_out"), 0, &g.mlp_out, &w.mlp_out));
        c.problems
            .extend(cmp.rows(&format!("trace.layers.{l}.residual"), 0, &g.residual, &w.residual));
        cmp.tol = tol.router_weights;
        c.problems.extend(cmp.rows(
            &format!("trace.layers.{l}.router_weights"),
            0,
            &g.router_weights,
            &w.router_weights,
        ));
    }
    cmp.tol = saved;
}

/// [`compare_ar`] under the tie-aware rules: returns the steps compared (a forgiven near-tie divergence
/// at k ends the comparison after row k: later rows follow another prefix).
pub(super) fn compare_ar_tolerant(
    c: &mut PromptCheck,
    cmp: &mut Cmp,
    t: &Tolerances,
    got: &ArRecord,
    rows: &[Vec<f32>],
    want: &ArRecord,
) -> usize {
    c.tokens_total = want.tokens.len();
    c.tokens_equal = got.tokens.iter().zip(&want.tokens).take_while(|(a, b)| a == b).count();
    let margin = |s: usize| rules::margin_sorted(want.topk_row(s).1);
    let last = match rules::greedy("ar.tokens", &got.tokens, &want.tokens, true, margin, t.logits) {
        Ok(None) => want.tokens.len(),
        Ok(Some((k, m))) => {
            c.notes.push(format!(
                "ar.tokens[{k}]: {} vs bundle {}: a near-tie (the bundle's top-2 margin {m:.3e} <= {}); steps after \
                 {k} (tokens, logits, the run's token_ids) and anything fed by them not compared",
                got.tokens[k], want.tokens[k], t.logits
            ));
            k + 1
        }
        Err(p) => {
            c.problems.push(p);
            (c.tokens_equal + 1).min(want.tokens.len())
        }
    };
    let (mut full, mut topk) = (None, None);
    for (s, row) in rows.iter().enumerate().take(last) {
        if let Some(w) = want.full_row(s) {
            let r = want.router_margins.get(s).copied();
            full = full.or(rules::row(cmp, t, &format!("ar.full_logits step {s}"), row, w, r, &mut c.notes).err());
        }
        let (ids, vals) = want.topk_row(s);
        let at: Vec<f32> = ids
            .iter()
            .map(|&id| row.get(id as usize).copied().unwrap_or(f32::NAN))
            .collect();
        let before = c.notes.len();
        match rules::row(
            cmp,
            t,
            &format!("ar.topk_logits step {s} (ids {ids:?})"),
            &at,
            vals,
            want.router_margins.get(s).copied(),
            &mut c.notes,
        ) {
            Err(p) => topk = topk.or(Some(p)),
            Ok(()) => {
                cmp.tol = if c.notes.len() > before { t.route_flip } else { t.logits };
                topk = topk.or(cmp.topk(s, row, ids, vals));
            }
        }
    }
    c.problems.extend(full.into_iter().chain(topk));
    last
}

/// [`compare_trace`] under the route-aware rules: router ids as sets (weights per id); one swapped expert
/// with a clean router input ends the comparison (rules::layer_route).
pub(super) fn compare_trace_tolerant(
    c: &mut PromptCheck,
    cmp: &mut Cmp,
    t: &Tolerances,
    got: &TraceRecord,
    want: &TraceRecord,
) {
    let meta = |r: &TraceRecord| vec![r.step, r.position, r.token as usize, r.layers.len()];
    c.problems.extend(first_diff(
        "trace (step, position, token, layers)",
        &meta(got),
        &meta(want),
    ));
    let start = c.problems.len();
    for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        cmp.tol = t.layers;
        c.problems
            .extend(cmp.rows(&format!("trace.layers.{l}.attn_out"), 0, &g.attn_out, &w.attn_out));
        match rules::layer_route(l, g, w, c.problems.len() == start) {
            Ok(Some(note)) => {
                c.notes.push(note);
                break;
            }
            Ok(None) => {
                cmp.tol = t.router_weights;
                let (gw, ww) = (rules::weights_by_id(g), rules::weights_by_id(w));
                c.problems
                    .extend(cmp.rows(&format!("trace.layers.{l}.router_weights (by expert id)"), 0, &gw, &ww));
            }
            Err(p) => c.problems.push(p),
        }
        cmp.tol = t.layers;
        c.problems
            .extend(cmp.rows(&format!("trace.layers.{l}.mlp_out"), 0, &g.mlp_out, &w.mlp_out));
        c.problems
            .extend(cmp.rows(&format!("trace.layers.{l}.residual"), 0, &g.residual, &w.residual));
    }
}

/// [`compare_round`] under the tie-aware rules (rules::tree_explained, rules::walk); verify rows compare
/// by node path, each within the logits tolerance or as a route flip.
pub(super) fn compare_round_tolerant(
    c: &mut PromptCheck,
    cmp: &mut Cmp,
    t: &Tolerances,
    got: &DdtreeRecord,
    want: &DdtreeRecord,
) -> bool {
    let before = c.problems.len();
    let meta = |r: &DdtreeRecord| vec![r.start, r.root as usize, r.budget, r.draft_rows];
    c.problems.extend(first_diff(
        "ddtree (start, root, budget, draft rows)",
        &meta(got),
        &meta(want),
    ));
    cmp.tol = t.logits;
    c.problems
        .extend(cmp.rows("ddtree.draft_logits", want.vocab, &got.draft_logits, &want.draft_logits));
    let shape = |r: &DdtreeRecord| {
        (
            r.tree_tokens.clone(),
            r.tree_parents.clone(),
            r.tree_depths.clone(),
            r.visibility_words,
            r.visibility.clone(),
        )
    };
    let same_tree = shape(got) == shape(want);
    if !same_tree {
        match rules::tree_explained(got, want, t.logits) {
            Ok(note) => c.notes.push(note),
            Err(p) => c.problems.push(p),
        }
    }
    let (gp, wp, v) = (rules::paths(got), rules::paths(want), want.vocab);
    let mut verify = None;
    for (n, p) in wp.iter().enumerate() {
        let (Some(m), Some(w)) = (
            gp.iter().position(|q| q == p),
            want.verify_logits.get(n * v..(n + 1) * v),
        ) else {
            continue;
        };
        let g = got.verify_logits.get(m * v..(m + 1) * v).unwrap_or(&[]);
        verify = verify.or(rules::row(
            cmp,
            t,
            &format!("ddtree.verify_logits node {n} (path {p:?})"),
            g,
            w,
            want.router_margins.get(n).copied(),
            &mut c.notes,
        )
        .err());
    }
    c.problems.extend(verify);
    match rules::walk(got, want, same_tree, t.logits) {
        Ok(note) => c.notes.extend(note),
        Err(p) => c.problems.push(p),
    }
    c.problems.len() == before
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_comparison_tracks_max_delta_and_reports_the_first_excess() {
        let mut cmp = Cmp {
            tol: 0.0,
            max_delta: 0.0,
        };
        assert_eq!(cmp.rows("x", 0, &[1.0, 2.0], &[1.0, 2.0]), None);
        assert_eq!(cmp.max_delta, 0.0);
        let p = cmp.rows("x", 0, &[1.0, 2.5, 3.0], &[1.0, 2.0, 4.0]).unwrap();
        assert!(p.starts_with("x[1]: 2.5 vs bundle 2 (|Δ| 5e-1 > tolerance 0)"), "{p}");
        assert_eq!(cmp.max_delta, 1.0);
        let p = cmp.rows("y", 2, &[0.0, 0.0, 0.0, 1.0], &[0.0, 0.0, 0.0, 0.0]).unwrap();
        assert!(p.starts_with("y[1, 1]: 1 vs bundle 0"), "{p}");
        assert!(cmp.rows("x", 0, &[f32::NAN], &[0.0]).is_some());
        assert_eq!(cmp.max_delta, f32::INFINITY);
        assert!(cmp
            .rows("x", 0, &[1.0], &[1.0, 2.0])
            .unwrap()
            .contains("1 values, bundle 2"));
        let mut loose = Cmp {
            tol: 0.1,
            max_delta: 0.0,
        };
        assert_eq!(loose.rows("x", 0, &[1.05], &[1.0]), None);
        assert!(loose.rows("x", 0, &[1.2], &[1.0]).is_some());
    }

    #[test]
    fn topk_comparison_exact_and_with_tolerance() {
        let row = [0.0, 3.0, 1.0, 2.0];
        let mut exact = Cmp {
            tol: 0.0,
            max_delta: 0.0,
        };
        assert_eq!(exact.topk(0, &row, &[1, 3], &[3.0, 2.0]), None);
        // right values, wrong ids (a tie-break or order difference) fails at tolerance 0
        let row_tie = [0.0, 3.0, 2.0, 2.0];
        assert!(exact
            .topk(0, &row_tie, &[1, 3], &[3.0, 2.0])
            .unwrap()
            .contains("topk_ids"));
        assert!(exact
            .topk(0, &row, &[1, 3], &[3.0, 2.5])
            .unwrap()
            .contains("topk_logits"));
        let mut loose = Cmp {
            tol: 0.01,
            max_delta: 0.0,
        };
        assert_eq!(loose.topk(0, &row_tie, &[1, 3], &[3.0, 2.0]), None);
        let row_up = [0.0, 3.0, 2.5, 2.0];
        assert!(loose.topk(0, &row_up, &[1, 3], &[3.0, 2.0]).unwrap().contains("id 2"));
    }

    #[test]
    fn round_comparison_names_what_differs() {
        let want = DdtreeRecord {
            start: 4,
            root: 7,
            budget: 2,
            vocab: 2,
            draft_rows: 1,
            draft_logits: vec![0.5, 1.5],
            tree_tokens: vec![7, 1, 0],
            tree_parents: vec![-1, 0, 0],
            tree_depths: vec![0, 1, 1],
            visibility_words: 1,
            visibility: vec![1, 3, 5],
            verify_logits: vec![0.0; 6],
            accepted: vec![0],
            decisions: vec![1],
            bonus: 1,
            router_margins: Vec::new(),
        };
        let mut c = PromptCheck::default();
        let mut cmp = Cmp {
            tol: 0.0,
            max_delta: 0.0,
        };
        assert!(compare_round(&mut c, &mut cmp, &want.clone(), &want));
        let mut got = want.clone();
        got.tree_parents[2] = 1;
        got.verify_logits[5] = 0.25;
        got.bonus = 0;
        assert!(!compare_round(&mut c, &mut cmp, &got, &want));
        let all = c.problems.join("\n");
        assert!(all.contains("ddtree.tree_parents[2]: 1 vs bundle 0"), "{all}");
        assert!(all.contains("ddtree.verify_logits[2, 1]: 0.25 vs bundle 0"), "{all}");
        assert!(all.contains("ddtree bonus"), "{all}");
        assert_eq!(cmp.max_delta, 0.25);
    }
}
