//! kdtree-golden end to end on the tiny synthetic preset (+ drafter): the output bytes do not depend on
//! the thread count, and the bundle read back through the library is self-consistent (greedy tokens =
//! argmax of the stored logits, DDTree round = a valid tree whose walk follows the verify logits and
//! continues the AR tokens).

use kdtree_formats::ExpertsMode;
use kdtree_golden::bundle::{Bundle, PromptRecord};
use std::path::Path;
use std::process::Command;

fn model(dir: &Path) -> std::path::PathBuf {
    let hf = dir.join("hf");
    kdtree_convert::synth::write("tiny", &hf, 0, true, None).expect("synth tiny");
    let out = dir.join("model");
    kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
        src: hf.clone(),
        out: out.clone(),
        drafter: Some(hf.join("drafter")),
        ranks: 8,
        experts: ExpertsMode::Tp,
        max_file_size: 5 << 30,
        quiet: true,
    })
    .expect("repack");
    out
}

const PROMPTS: &str = r#"{"id": "p1", "prompt_token_ids": [1, 17, 305, 42]}
{"id": "p2", "prompt_token_ids": [900, 3, 3, 3, 64, 128, 256, 512]}
"#;

fn golden(model: &Path, prompts: &Path, out: &Path, threads: &str, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kdtree-golden"))
        .arg(model)
        .args([
            "--prompts".as_ref(),
            prompts.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ])
        .args([
            "--max-tokens",
            "6",
            "--full-logits-steps",
            "2",
            "--topk",
            "4",
            "--budget",
            "6",
            "--quiet",
        ])
        .args(extra)
        .env("RAYON_NUM_THREADS", threads)
        .output()
        .expect("run kdtree-golden")
}

fn argmax(row: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[b] {
            b = i;
        }
    }
    b as u32
}

fn check_record(r: &PromptRecord, layers: usize) {
    let ar = &r.ar;
    assert_eq!(ar.tokens.len(), 6);
    assert_eq!(ar.full_steps, 2);
    for s in 0..ar.tokens.len() {
        let (ids, vals) = ar.topk_row(s);
        assert_eq!(ids[0], ar.tokens[s], "step {s}: top-1 is the greedy token");
        assert!(vals.windows(2).all(|w| w[0] >= w[1]), "step {s}: top-k sorted");
        if let Some(row) = ar.full_row(s) {
            assert_eq!(argmax(row), ar.tokens[s]);
            assert_eq!(row[ids[1] as usize], vals[1]);
        }
    }
    let tr = r.trace.as_ref().expect("trace recorded");
    assert_eq!((tr.step, tr.position, tr.token), (1, r.prompt_ids.len(), ar.tokens[0]));
    assert_eq!(tr.layers.len(), layers);
    assert!(tr.layers[0].router_ids.is_empty(), "layer 0 is dense");
    for l in &tr.layers[1..] {
        assert_eq!(l.router_ids.len(), 4, "tiny routes top-4");
        assert!(l.router_weights.iter().all(|w| w.is_finite() && *w > 0.0));
    }
    for (l, lt) in tr.layers.iter().enumerate().skip(1) {
        // residual after layer l = residual after l-1 + attn_out + mlp_out
        let prev = &tr.layers[l - 1].residual;
        for (i, &p) in prev.iter().enumerate() {
            let want = p + lt.attn_out[i] + lt.mlp_out[i];
            assert!(
                (lt.residual[i] - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "layer {l} dim {i}: residual chain"
            );
        }
    }
    let d = r.ddtree.as_ref().expect("ddtree round recorded");
    let n = d.tree_tokens.len();
    assert!((2..=7).contains(&n), "budget 6: {n} nodes with the root");
    assert_eq!(d.root, ar.tokens[0]);
    assert_eq!(d.tree_tokens[0], d.root);
    assert_eq!(d.start, r.prompt_ids.len());
    assert_eq!(d.tree_parents[0], -1);
    for i in 1..n {
        let p = d.tree_parents[i];
        assert!(p >= 0 && (p as usize) < i);
        assert_eq!(d.tree_depths[i], d.tree_depths[p as usize] + 1);
        for j in 0..n {
            let mut anc = i;
            let is_anc = loop {
                if anc == j {
                    break true;
                }
                if d.tree_parents[anc] < 0 {
                    break false;
                }
                anc = d.tree_parents[anc] as usize;
            };
            let bit = (d.visibility[i * d.visibility_words + j / 64] >> (j % 64)) & 1 == 1;
            assert_eq!(bit, is_anc, "visibility[{i}][{j}]");
        }
    }
    assert_eq!(d.accepted[0], 0);
    for (k, &node) in d.accepted.iter().enumerate() {
        let row = &d.verify_logits[node * d.vocab..(node + 1) * d.vocab];
        assert_eq!(d.decisions[k], argmax(row), "greedy decision at node {node}");
        if k + 1 < d.accepted.len() {
            let next = d.accepted[k + 1];
            assert_eq!(d.tree_parents[next] as usize, node);
            assert_eq!(d.tree_tokens[next], d.decisions[k]);
        }
    }
    assert_eq!(d.bonus, *d.decisions.last().unwrap());
    // the round's emitted tokens continue the AR run (greedy DDTree == greedy AR)
    let emitted: Vec<u32> = d.accepted[1..]
        .iter()
        .map(|&i| d.tree_tokens[i])
        .chain([d.bonus])
        .collect();
    let m = emitted.len().min(ar.tokens.len() - 1);
    assert_eq!(emitted[..m], ar.tokens[1..1 + m]);
    // the verify row of the root equals the AR step-1 row bit for bit: same prefix, same token, and every
    // output element of the CPU reference is one fixed-order loop whatever the other rows of the forward are
    let root_row = &d.verify_logits[..d.vocab];
    let ar1 = ar.full_row(1).unwrap();
    assert!(
        root_row.iter().zip(ar1).all(|(x, y)| x.to_bits() == y.to_bits()),
        "root verify row vs AR step 1 differ"
    );
}

#[test]
fn bytes_identical_across_thread_counts_and_bundle_consistent() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model(tmp.path());
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(&prompts, PROMPTS).unwrap();
    let (o1, o2) = (tmp.path().join("g1"), tmp.path().join("g2"));
    for (o, t) in [(&o1, "1"), (&o2, "2")] {
        let r = golden(&model, &prompts, o, t, &[]);
        assert!(
            r.status.success(),
            "kdtree-golden failed: {}",
            String::from_utf8_lossy(&r.stderr)
        );
    }
    let mut names: Vec<String> = std::fs::read_dir(&o1)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["index.json", "p1.safetensors", "p2.safetensors"]);
    for n in &names {
        let (a, b) = (std::fs::read(o1.join(n)).unwrap(), std::fs::read(o2.join(n)).unwrap());
        assert!(a == b, "{n} differs between RAYON_NUM_THREADS=1 and 2");
    }
    let b = Bundle::open(&o1).unwrap();
    assert_eq!(b.index.model.num_layers, 4);
    assert!(b.index.model.block_size >= 2);
    assert_eq!(b.index.model.manifest_sha256.len(), 64);
    assert!(
        !b.index.command.contains(tmp.path().to_str().unwrap()),
        "index must not record paths"
    );
    for (id, rec) in b.load_all().unwrap() {
        check_record(&rec, 4);
        assert!(b.entry(&id).unwrap().ddtree_matches_ar);
    }
    // a bad prompt line fails the run with its line number
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"id\": \"x\", \"prompt_token_ids\": [1]}\n{\"id\": \"y\"\n").unwrap();
    let r = golden(&model, &bad, &tmp.path().join("g3"), "1", &[]);
    assert!(!r.status.success());
    assert!(
        String::from_utf8_lossy(&r.stderr).contains(":2:"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
}
