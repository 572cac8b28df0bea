//! The DDTree tree work on the GPU (engine/src/cuda/tree.rs) against the CPU: per-depth top-K log-probs ==
//! `ddtree::top_k_log_probs` bit for bit, the device tree == `ddtree::build_tree_from_top_k` on the same
//! top-K (tokens, depths, parents, scores, child lists, ancestor bitmask), and the device walk ==
//! `ddtree::walk` on the same per-node decisions, for budgets 1…2048 and draft logits that give shallow,
//! deep and branching trees with exact score ties (the committed golden rounds are all one level deep).
//! Needs a GPU: skips without one unless KDTREE_REQUIRE_GPU=1. Run: scripts/gpu-test.sh.
#![cfg(feature = "cuda")]

mod cuda_common;

use cuda_common::*;
use kdtree_engine::cuda::tree::DeviceTree;
use kdtree_engine::cuda::Gpu;
use kdtree_engine::ddtree::{build_tree_from_top_k, top_k_log_probs, walk, DraftTree};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Draft logits `[rows, v]` of one shape family.
#[derive(Clone, Copy, Debug)]
enum Logits {
    /// i.i.d. N-ish(0, 2): shallow, wide trees.
    Random,
    /// One dominant token per row (+9): deep chains, branching near the root.
    Peaked,
    /// Two dominant tokens with exactly equal logits per row, the rest quantized to a few values: deep,
    /// branching trees whose sibling scores tie exactly.
    PeakedTies,
    /// Every row identical and quantized to 4 values: ties everywhere (within rows and across depths).
    Quantized,
    /// Every logit equal (all scores of a depth tie; ddtree build.rs `equal_scores_break_on_the_rank_tuple`).
    Flat,
    /// Three finite logits per row, the rest -inf: K exceeds the finite tokens (NaN scores count as -inf).
    FewFinite,
}

fn draft_logits(r: &mut ChaCha8Rng, kind: Logits, rows: usize, v: usize) -> Vec<f32> {
    let mut x = vec![0f32; rows * v];
    let row0: Vec<f32> = (0..v).map(|_| r.random_range(0..4) as f32 * 0.5).collect();
    for d in 0..rows {
        let row = &mut x[d * v..(d + 1) * v];
        match kind {
            Logits::Random => row.iter_mut().for_each(|l| *l = r.random_range(-4.0f32..4.0)),
            Logits::Peaked => {
                row.iter_mut().for_each(|l| *l = r.random_range(-2.0f32..2.0));
                row[r.random_range(0..v)] = 9.0;
            }
            Logits::PeakedTies => {
                row.iter_mut().for_each(|l| *l = r.random_range(0..3) as f32 - 2.0);
                let a = r.random_range(0..v);
                let b = (a + 1 + r.random_range(0..v - 1)) % v;
                row[a] = 14.0;
                row[b] = 14.0;
            }
            Logits::Quantized => row.copy_from_slice(&row0),
            Logits::Flat => row.iter_mut().for_each(|l| *l = 1.25),
            Logits::FewFinite => {
                row.iter_mut().for_each(|l| *l = f32::NEG_INFINITY);
                for j in 0..3.min(v) {
                    row[(j * 7 + d) % v] = j as f32 * -0.75;
                }
            }
        }
    }
    x
}

fn same_tree(case: &str, got: &DraftTree, want: &DraftTree) {
    assert_eq!(got.len(), want.len(), "{case}: node count");
    for (what, g, w) in [
        ("tokens", &got.tokens, &want.tokens),
        ("depths", &got.depths, &want.depths),
    ] {
        if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
            panic!(
                "{case}: {what} differ first at node {i}: gpu {} cpu {} (parents gpu {:?} cpu {:?})",
                g[i],
                w[i],
                &got.parents[..=i],
                &want.parents[..=i]
            );
        }
    }
    for (what, g, w) in [
        ("parents", &got.parents, &want.parents),
        ("first_child", &got.first_child, &want.first_child),
        ("next_sibling", &got.next_sibling, &want.next_sibling),
    ] {
        if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
            panic!("{case}: {what} differ first at node {i}: gpu {} cpu {}", g[i], w[i]);
        }
    }
    if let Some(i) = got
        .log_q
        .iter()
        .zip(&want.log_q)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{case}: log_q differ at node {i}: gpu {:e} cpu {:e}",
            got.log_q[i], want.log_q[i]
        );
    }
    assert_eq!(got.visibility, want.visibility, "{case}: ancestor bitmask");
}

/// Per-node decisions that follow a child with probability `p_follow` (else an off-tree token), so walks
/// go deep and stop at every depth.
fn decisions(r: &mut ChaCha8Rng, t: &DraftTree, v: usize, p_follow: f64) -> Vec<u32> {
    (0..t.len())
        .map(|n| {
            let kids: Vec<u32> = t.children(n).map(|c| c.0).collect();
            if !kids.is_empty() && (kids.len() == v || r.random_bool(p_follow)) {
                kids[r.random_range(0..kids.len())]
            } else {
                loop {
                    let x = r.random_range(0..v as u32);
                    if !kids.contains(&x) {
                        break x;
                    }
                }
            }
        })
        .collect()
}

struct Case {
    kind: Logits,
    rows: usize,
    v: usize,
    budget: usize,
}

fn run_case(g: &Gpu, seed: u64, c: &Case) -> (usize, u32) {
    let case = format!("ddtree({:?},rows={},V={},budget={})", c.kind, c.rows, c.v, c.budget);
    let mut r = rng(seed);
    let logits = draft_logits(&mut r, c.kind, c.rows, c.v);
    let bonus = r.random_range(0..c.v as u32);
    // CPU reference.
    let top = top_k_log_probs(&logits, c.rows, c.v, c.budget.min(c.v));
    let want = build_tree_from_top_k(bonus, &top, c.budget);
    // GPU: top-K, build and mask from the draft logits on the device.
    let mut dt = DeviceTree::new(g, c.budget, c.rows, c.v).unwrap();
    let dl = g.upload(&logits).unwrap();
    dt.set_bonus(g, bonus).unwrap();
    dt.build(g, &dl.as_view(), c.v).unwrap();
    let gtop = dt.top_k_to_host(g).unwrap();
    if let Some(i) = gtop.tokens.iter().zip(&top.tokens).position(|(a, b)| a != b) {
        panic!(
            "{case}: top-K tokens differ first at {i} (row {}, rank {}): gpu {} cpu {}",
            i / top.k,
            i % top.k,
            gtop.tokens[i],
            top.tokens[i]
        );
    }
    if let Some(i) = gtop
        .log_probs
        .iter()
        .zip(&top.log_probs)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{case}: top-K log-probs differ first at {i}: gpu {:e} cpu {:e}",
            gtop.log_probs[i], top.log_probs[i]
        );
    }
    let got = dt.to_host(g).unwrap();
    same_tree(&case, &got, &want);
    // The builder alone on the CPU's top-K (uploaded), into buffers the last build filled.
    dt.set_top_k(g, &top).unwrap();
    dt.build_from_top_k(g).unwrap();
    same_tree(&format!("{case} from the CPU top-K"), &dt.to_host(g).unwrap(), &want);
    // Walks over three decision sets.
    let mut deepest = 0;
    for p in [0.5, 0.9, 1.0] {
        let dec = decisions(&mut r, &want, c.v, p);
        let cpu = walk(&want, |n| dec[n]);
        let mut padded = dec.clone();
        padded.resize(c.budget + 1, u32::MAX);
        g.stream.memcpy_htod(&padded, &mut dt.decisions).unwrap();
        dt.walk(g).unwrap();
        let gpu = dt.walk_to_host(g).unwrap();
        assert_eq!(gpu, cpu, "{case}: walk with follow probability {p}");
        deepest = deepest.max(cpu.accepted());
    }
    let max_depth = *want.depths.iter().max().unwrap();
    let ties = (1..want.len())
        .filter(|&i| (1..want.len()).any(|j| j != i && want.log_q[j] == want.log_q[i]))
        .count();
    println!(
        "PARITY {case} exact (nodes {}, max depth {max_depth}, nodes with a tied score {ties}, deepest walk {deepest})",
        want.len()
    );
    (ties, max_depth)
}

#[test]
fn device_tree_equals_the_cpu_tree() {
    let Some(g) = gpu() else { return };
    let v = 163_840;
    let mut cases = Vec::new();
    for budget in [1, 8, 64, 256, 1024] {
        for kind in [Logits::Random, Logits::Peaked, Logits::PeakedTies] {
            cases.push(Case {
                kind,
                rows: 7,
                v,
                budget,
            });
        }
    }
    for budget in [8, 64, 256, 1024, 2048] {
        cases.push(Case {
            kind: Logits::Quantized,
            rows: 7,
            v: 64,
            budget,
        });
        cases.push(Case {
            kind: Logits::Flat,
            rows: 7,
            v: 64,
            budget,
        });
        cases.push(Case {
            kind: Logits::FewFinite,
            rows: 7,
            v: 3000,
            budget,
        });
    }
    cases.push(Case {
        kind: Logits::PeakedTies,
        rows: 15,
        v: 5,
        budget: 2048,
    });
    cases.push(Case {
        kind: Logits::Peaked,
        rows: 1,
        v: 1000,
        budget: 256,
    });
    cases.push(Case {
        kind: Logits::Peaked,
        rows: 255,
        v: 8,
        budget: 2048,
    });
    cases.push(Case {
        kind: Logits::PeakedTies,
        rows: 7,
        v,
        budget: 2048,
    });
    let (mut tied_cases, mut deep_cases) = (0, 0);
    for (i, c) in cases.iter().enumerate() {
        let (ties, depth) = run_case(&g, 9000 + i as u64, c);
        tied_cases += (ties > 0) as usize;
        deep_cases += (depth >= 4) as usize;
    }
    // The cases must exercise what they claim: exact ties and deep trees.
    assert!(
        tied_cases >= 10 && deep_cases >= 10,
        "tied cases {tied_cases}, deep cases {deep_cases}"
    );
}

#[test]
fn greedy_walk_from_verify_logits_equals_the_cpu_walk() {
    let Some(g) = gpu() else { return };
    let (v, rows) = (163_840, 7);
    for (i, budget) in [8usize, 64].into_iter().enumerate() {
        let mut r = rng(9100 + i as u64);
        let logits = draft_logits(&mut r, Logits::PeakedTies, rows, v);
        let top = top_k_log_probs(&logits, rows, v, budget);
        let tree = build_tree_from_top_k(7, &top, budget);
        let mut dt = DeviceTree::new(&g, budget, rows, v).unwrap();
        dt.set_top_k(&g, &top).unwrap();
        dt.set_bonus(&g, 7).unwrap();
        dt.build_from_top_k(&g).unwrap();
        // Verify logits peaked at a chosen decision, tied exactly with one other token (the lower id wins,
        // on both sides); rows past the tree stay random.
        let dec = decisions(&mut r, &tree, v, 0.8);
        let mut verify = rand_f32(&mut r, (budget + 1) * v, -3.0, 3.0);
        for (n, &d) in dec.iter().enumerate() {
            verify[n * v + d as usize] = 5.0;
            verify[n * v + (d as usize + 1 + r.random_range(0..v - 1)) % v] = 5.0;
        }
        let want = kdtree_engine::ddtree::walk_greedy(&tree, &verify[..tree.len() * v], v);
        let dv = g.upload(&verify).unwrap();
        dt.walk_greedy(&g, &dv.as_view(), v).unwrap();
        let got = dt.walk_to_host(&g).unwrap();
        assert_eq!(got, want, "greedy walk, budget {budget}");
        println!(
            "PARITY ddtree_walk_greedy(budget={budget},V={v}) exact (accepted {})",
            want.accepted()
        );
    }
}

/// The tree stages of a round captured once into a CUDA graph (5 kernels: top-K, build, mask, argmax, walk;
/// capture fails on any host sync or allocation) and replayed over new draft logits, root token and verify
/// logits written into the same device buffers: each replay equals the CPU tree and walk.
#[test]
fn captured_tree_stages_replay_over_new_inputs() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(g) = gpu() else { return };
    let (v, rows, budget) = (163_840usize, 7usize, 64usize);
    let mut dt = DeviceTree::new(&g, budget, rows, v).unwrap();
    let mut dl = g.zeros::<f32>(rows * v).unwrap();
    let mut dv = g.zeros::<f32>((budget + 1) * v).unwrap();
    g.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    dt.build(&g, &dl.as_view(), v).unwrap();
    dt.walk_greedy(&g, &dv.as_view(), v).unwrap();
    let graph = g
        .stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("captured graph");
    for round in 0..3u64 {
        let mut r = rng(9200 + round);
        let kind = [Logits::PeakedTies, Logits::Peaked, Logits::Random][round as usize];
        let logits = draft_logits(&mut r, kind, rows, v);
        let bonus = r.random_range(0..v as u32);
        let want = build_tree_from_top_k(bonus, &top_k_log_probs(&logits, rows, v, budget), budget);
        let dec = decisions(&mut r, &want, v, 0.9);
        let mut verify = rand_f32(&mut r, (budget + 1) * v, -3.0, 3.0);
        for (n, &d) in dec.iter().enumerate() {
            verify[n * v + d as usize] = 5.0;
        }
        let want_walk = kdtree_engine::ddtree::walk_greedy(&want, &verify[..want.len() * v], v);
        g.stream.memcpy_htod(&logits, &mut dl).unwrap();
        g.stream.memcpy_htod(&verify, &mut dv).unwrap();
        dt.set_bonus(&g, bonus).unwrap();
        graph.launch().unwrap();
        let case = format!("graph replay {round} ({kind:?})");
        same_tree(&case, &dt.to_host(&g).unwrap(), &want);
        assert_eq!(dt.walk_to_host(&g).unwrap(), want_walk, "{case}: walk");
        println!(
            "PARITY ddtree_graph_replay(round={round},{kind:?},budget={budget}) exact (accepted {}, 5 kernels, 0 \
             host syncs inside)",
            want_walk.accepted()
        );
    }
}

/// A batch's trees built together (`DeviceTree::build_batch`: one top-K over every draft row, every tree and its
/// mask in one launch per 32 trees) equal each tree built alone, bit for bit: tokens, depths, parents, scores,
/// child lists, sizes, ancestor bitmasks; 1, 5, 33 and 40 trees (more than one launch), each with its own root,
/// over random, peaked and tied draft rows, at budgets 16 and 64, the pair's vocabulary and K2.6's.
#[test]
fn batched_build_equals_each_tree_alone() {
    let Some(g) = gpu() else { return };
    let mut r = rng(2803);
    for (budget, rows, v) in [(16usize, 7usize, 4352usize), (64, 7, 163_840)] {
        for n in [1usize, 5, 33, 40] {
            let kinds = [Logits::Random, Logits::Peaked, Logits::PeakedTies, Logits::FewFinite];
            let mut logits = Vec::with_capacity(n * rows * v);
            for s in 0..n {
                logits.extend(draft_logits(&mut r, kinds[s % kinds.len()], rows, v));
            }
            let dl = g.upload(&logits).unwrap();
            let roots: Vec<u32> = (0..n).map(|_| r.random_range(0..v as u32)).collect();
            let mut alone: Vec<DeviceTree> = (0..n).map(|_| DeviceTree::new(&g, budget, rows, v).unwrap()).collect();
            let mut batch: Vec<DeviceTree> = (0..n).map(|_| DeviceTree::new(&g, budget, rows, v).unwrap()).collect();
            for (s, t) in alone.iter_mut().enumerate() {
                t.set_bonus(&g, roots[s]).unwrap();
                t.build(&g, &dl.slice(s * rows * v..(s + 1) * rows * v), v).unwrap();
            }
            for (s, t) in batch.iter_mut().enumerate() {
                t.set_bonus(&g, roots[s]).unwrap();
            }
            let mut refs: Vec<&mut DeviceTree> = batch.iter_mut().collect();
            DeviceTree::build_batch(&g, &mut refs, &dl.as_view(), v).unwrap();
            for s in 0..n {
                let case = format!(
                    "budget {budget}, V {v}, {n} trees: tree {s} ({:?})",
                    kinds[s % kinds.len()]
                );
                let (a, b) = (&alone[s], &batch[s]);
                same_tree(&case, &b.to_host(&g).unwrap(), &a.to_host(&g).unwrap());
                let (wa, wb) = (g.download(&a.walk_out).unwrap(), g.download(&b.walk_out).unwrap());
                assert_eq!(wa[a.log_q_at()..], wb[b.log_q_at()..], "{case}: scores");
                assert_eq!(
                    g.download(&a.n_nodes).unwrap(),
                    g.download(&b.n_nodes).unwrap(),
                    "{case}: size"
                );
                assert_eq!(
                    g.download(&a.mask.bits).unwrap(),
                    g.download(&b.mask.bits).unwrap(),
                    "{case}: mask"
                );
            }
        }
    }
    println!("PARITY batched tree builds == each tree alone (1, 5, 33, 40 trees; budgets 16, 64) exact");
}

/// The batched round's tree stages through the backend (`TreeOps`' batch forms, as `model::round` calls them for
/// a batch of greedy sequences) against each tree's own call on the same backend, bit for bit: the builds
/// (`tree_build_batch`), the nodes gathered into one token buffer (`ids_gather`), the walks over one decision
/// buffer (`tree_walk_decided_batch`), the walked paths' rows into one activation (`tree_path_rows_batch`) and
/// the result words into one stage (`tree_result_into_batch`); 3, 40 and 70 trees (more than one launch).
#[test]
fn batched_tree_stages_equal_each_tree_alone() {
    use kdtree_engine::backend::{Resources, TreeOps};
    use kdtree_engine::cuda::CudaBackend;
    let Some(g) = gpu() else { return };
    let b = CudaBackend::new(std::sync::Arc::new(g));
    let mut r = rng(2804);
    let (budget, rows, v, cols) = (16usize, 7usize, 4352usize, 24usize);
    let nodes = budget + 1;
    for n in [3usize, 40, 70] {
        let mut logits = Vec::with_capacity(n * rows * v);
        for s in 0..n {
            let kind = [Logits::Peaked, Logits::PeakedTies, Logits::Random][s % 3];
            logits.extend(draft_logits(&mut r, kind, rows, v));
        }
        let dl = b.act_from_host(logits);
        let mut alone: Vec<_> = (0..n).map(|_| b.tree_new(budget, rows, v, budget).unwrap()).collect();
        let mut batch: Vec<_> = (0..n).map(|_| b.tree_new(budget, rows, v, budget).unwrap()).collect();
        for s in 0..n {
            let root = r.random_range(0..v as u32);
            b.tree_set_root(&mut alone[s], root).unwrap();
            b.tree_set_root(&mut batch[s], root).unwrap();
            b.tree_build(&mut alone[s], &dl, s * rows).unwrap();
        }
        b.tree_build_batch(&mut batch.iter_mut().collect::<Vec<_>>(), &dl, rows)
            .unwrap();
        // The nodes gathered.
        let (mut t1, mut t2) = (
            b.ids_from_host(&vec![7; n * nodes]),
            b.ids_from_host(&vec![9; n * nodes]),
        );
        for (s, t) in alone.iter().enumerate() {
            b.ids_copy(&mut t1, s * nodes, b.tree_tokens(t), nodes);
        }
        let srcs: Vec<_> = batch.iter().map(|t| (b.tree_tokens(t), nodes)).collect();
        b.ids_gather(&mut t2, &srcs);
        let toks = b.ids_to_host(&t1).unwrap();
        assert_eq!(toks, b.ids_to_host(&t2).unwrap(), "{n} trees: nodes");
        // Decisions that follow a child with probability 0.8 (walks of every depth), one buffer for all.
        let mut dec = Vec::with_capacity(n * nodes);
        for t in &alone {
            let mut d = decisions(&mut r, &t.to_host(b.gpu()).unwrap(), v, 0.8);
            d.resize(nodes, 0);
            dec.extend(d);
        }
        let dec_dev = b.ids_from_host(&dec);
        let row0: Vec<usize> = (0..n).map(|s| s * nodes).collect();
        for (s, t) in alone.iter_mut().enumerate() {
            b.tree_walk_decided(t, &dec_dev, row0[s]).unwrap();
        }
        b.tree_walk_decided_batch(&mut batch.iter_mut().collect::<Vec<_>>(), &dec_dev, &row0)
            .unwrap();
        // Rows of the walked paths (rows_out = the walk's most rows), over one activation of every tree's nodes.
        let x = b.act_from_host(rand_f32(&mut r, n * nodes * cols, -1.0, 1.0));
        let m = rows + 1;
        let mut want = Vec::new();
        for (s, t) in alone.iter().enumerate() {
            want.extend(b.to_host(&b.tree_path_rows(t, &x, row0[s], cols, m)));
        }
        let got = b.to_host(&b.tree_path_rows_batch(&batch.iter().collect::<Vec<_>>(), &x, &row0, cols, m));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&got), bits(&want), "{n} trees: path rows");
        // Result words: the walk and the scores, into one stage each way.
        let words = b.tree_result_words(&alone[0]);
        let at: Vec<usize> = (0..n).map(|s| s * words).collect();
        let (mut s1, mut s2) = (
            b.ids_from_host(&vec![1; n * words]),
            b.ids_from_host(&vec![2; n * words]),
        );
        for (s, t) in alone.iter().enumerate() {
            b.tree_result_into(t, &mut s1, at[s]);
        }
        b.tree_result_into_batch(&batch.iter().collect::<Vec<_>>(), &mut s2, &at);
        let (w1, w2) = (b.ids_to_host(&s1).unwrap(), b.ids_to_host(&s2).unwrap());
        assert_eq!(w1, w2, "{n} trees: result words (walks and scores)");
        let deep = (0..n).filter(|&s| w1[s * words] > 1).count();
        println!(
            "PARITY batched tree stages, {n} trees: builds, nodes, walks ({deep} past the root), path rows, results \
             exact"
        );
    }
    b.check().unwrap();
}
