//! Measure how far one golden bundle is from another, per tensor class: the numbers the CUDA `--verify`
//! tolerances (tools/kdtree-run/src/verify_rules.rs) are set from. Usage:
//! `cargo run -p kdtree-run --example bundle_delta -- OTHER_DIR REFERENCE_DIR` (e.g. a bundle recorded by
//! `kdtree-golden --device cuda` against the committed CPU one). Per prompt it prints the first greedy
//! divergence and the reference's top-2 margin there, max |Δ| of the logit rows up to it (full rows and
//! top-k values at the shared ids), per traced layer the route and max |Δ| of each probe, and the DDTree
//! round's structure and max |Δ| of its draft and verify rows.

use anyhow::{Context, Result};
use kdtree_golden::bundle::{Bundle, PromptRecord};

fn max_delta(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Per row of `cols`: max |Δ|.
fn row_deltas(a: &[f32], b: &[f32], cols: usize) -> Vec<f32> {
    a.chunks(cols)
        .zip(b.chunks(cols))
        .map(|(x, y)| max_delta(x, y))
        .collect()
}

fn fmt(v: &[f32]) -> String {
    v.iter().map(|x| format!("{x:.2e}")).collect::<Vec<_>>().join(" ")
}

fn prompt(id: &str, g: &PromptRecord, c: &PromptRecord) {
    let (ga, ca) = (&g.ar, &c.ar);
    let t = ca.tokens.len();
    let k = ga.tokens.iter().zip(&ca.tokens).take_while(|(a, b)| a == b).count();
    let margin = |r: &kdtree_golden::bundle::ArRecord, s: usize| {
        let (_, v) = r.topk_row(s);
        v[0] - v[1]
    };
    println!("== {id}: prompt ids equal {}", g.prompt_ids == c.prompt_ids);
    if k < t {
        println!(
            "  ar.tokens: diverge at step {k} (gpu {} cpu {}), cpu top-2 margin {:.4e}, gpu top-2 margin {:.4e}",
            ga.tokens[k],
            ca.tokens[k],
            margin(ca, k),
            margin(ga, k)
        );
    } else {
        println!("  ar.tokens: all {t} equal");
    }
    // Rows 0..=k come from the same prefix: comparable.
    let last = k.min(t - 1);
    let full_steps = ca.full_steps.min(last + 1);
    let v = ca.vocab;
    let full = row_deltas(&ga.full_logits[..full_steps * v], &ca.full_logits[..full_steps * v], v);
    println!(
        "  ar.full_logits steps 0..{full_steps}: max |Δ| per row {} (max |logit| {:.2})",
        fmt(&full),
        max_abs(&ca.full_logits)
    );
    let (mut topk_d, mut id_diffs) = (0.0f32, Vec::new());
    for s in 0..=last {
        let ((gi, gv), (ci, cv)) = (ga.topk_row(s), ca.topk_row(s));
        for (j, id) in ci.iter().enumerate() {
            if let Some(p) = gi.iter().position(|x| x == id) {
                topk_d = topk_d.max((gv[p] - cv[j]).abs());
            }
        }
        if gi != ci {
            let first = gi.iter().zip(ci).position(|(a, b)| a != b).unwrap_or(0);
            // the reference's gap between the first differing rank and its neighbour below
            let gap = cv.get(first + 1).map(|n| cv[first] - n);
            id_diffs.push(format!(
                "step {s} rank {first}: gpu {gi:?} cpu {ci:?} (cpu gap to next {gap:?})"
            ));
        }
    }
    println!(
        "  ar.topk_logits steps 0..={last}: max |Δ| at shared ids {topk_d:.3e}; id lists differ at {} steps",
        id_diffs.len()
    );
    for d in &id_diffs {
        println!("    {d}");
    }
    if let (Some(gt), Some(ct)) = (&g.trace, &c.trace) {
        println!(
            "  trace step {} token {} vs {} (position {} vs {})",
            ct.step, gt.token, ct.token, gt.position, ct.position
        );
        for (l, (a, b)) in gt.layers.iter().zip(&ct.layers).enumerate() {
            println!(
                "    layer {l}: router ids {} (gpu {:?} cpu {:?}), |Δ| attn_out {:.2e} mlp_out {:.2e} residual \
                 {:.2e} router_w {:.2e}; max |ref| attn {:.2} mlp {:.2} residual {:.2}",
                if a.router_ids == b.router_ids {
                    "equal"
                } else {
                    "DIFFER"
                },
                a.router_ids,
                b.router_ids,
                max_delta(&a.attn_out, &b.attn_out),
                max_delta(&a.mlp_out, &b.mlp_out),
                max_delta(&a.residual, &b.residual),
                max_delta(&a.router_weights, &b.router_weights),
                max_abs(&b.attn_out),
                max_abs(&b.mlp_out),
                max_abs(&b.residual),
            );
            if a.router_ids != b.router_ids {
                println!(
                    "      router weights gpu {:?} cpu {:?}",
                    a.router_weights, b.router_weights
                );
            }
        }
    }
    if let (Some(a), Some(b)) = (&g.ddtree, &c.ddtree) {
        println!(
            "  ddtree: root {} vs {}, tokens equal {}, parents equal {}, depths equal {}, accepted {:?} vs {:?}, \
             decisions {:?} vs {:?}, bonus {} vs {}",
            a.root,
            b.root,
            a.tree_tokens == b.tree_tokens,
            a.tree_parents == b.tree_parents,
            a.tree_depths == b.tree_depths,
            a.accepted,
            b.accepted,
            a.decisions,
            b.decisions,
            a.bonus,
            b.bonus
        );
        println!(
            "    tree gpu {:?} / {:?}\n    tree cpu {:?} / {:?}",
            a.tree_tokens, a.tree_parents, b.tree_tokens, b.tree_parents
        );
        for (who, r) in [("gpu", a), ("cpu", b)] {
            let t = kdtree_engine::ddtree::build_tree(r.root, &r.draft_logits, r.draft_rows, r.vocab, r.budget);
            let w = kdtree_engine::ddtree::walk_greedy(&t, &r.verify_logits, r.vocab);
            println!(
                "    {who}: tree == build_tree(own draft logits) {}, walk == walk_greedy(own verify logits) {}",
                t.tokens == r.tree_tokens && t.parents == r.tree_parents,
                w.path == r.accepted && w.decisions == r.decisions
            );
        }
        println!(
            "    draft_logits max |Δ| per row {}",
            fmt(&row_deltas(&a.draft_logits, &b.draft_logits, b.vocab))
        );
        if a.tree_tokens == b.tree_tokens && a.tree_parents == b.tree_parents {
            println!(
                "    verify_logits max |Δ| per node {}",
                fmt(&row_deltas(&a.verify_logits, &b.verify_logits, b.vocab))
            );
        }
        for (n, row) in b.verify_logits.chunks(b.vocab).enumerate() {
            let (_, v) = kdtree_golden::bundle::topk_of(row, 2);
            let ga = a
                .verify_logits
                .chunks(a.vocab)
                .nth(n)
                .map(|r| kdtree_golden::bundle::topk_of(r, 2));
            println!(
                "    verify node {n}: cpu top-2 {:?} margin {:.3e}; gpu top-2 {:?}",
                kdtree_golden::bundle::topk_of(row, 2),
                v[0] - v[1],
                ga
            );
        }
        for (r, row) in b.draft_logits.chunks(b.vocab).enumerate() {
            let (ids, v) = kdtree_golden::bundle::topk_of(row, 9);
            let gaps: Vec<f32> = v.windows(2).map(|w| w[0] - w[1]).collect();
            println!("    draft row {r}: cpu top-9 {ids:?} gaps {}", fmt(&gaps));
        }
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [other, reference] = &args[..] else {
        anyhow::bail!("usage: bundle_delta OTHER_DIR REFERENCE_DIR")
    };
    let (g, c) = (Bundle::open(other)?, Bundle::open(reference)?);
    for p in &c.index.prompts {
        let gr = g.load(&p.id).with_context(|| format!("prompt {} in {other}", p.id))?;
        prompt(&p.id, &gr, &c.load(&p.id)?);
    }
    Ok(())
}
