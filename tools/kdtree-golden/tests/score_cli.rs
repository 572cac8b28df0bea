//! `kdtree-golden --score` end to end on the tiny synthetic preset: the CPU reference's own greedy tokens score
//! gap 0 at every position (from a bundle, with max |Δ| 0 against its own full logits; and as kdtree-run-style
//! JSONL records); one changed token is a gap above the bound (exit 1, the position named in the report); a
//! record that is not a line of the prompt file, an error record and a token outside the vocabulary are errors
//! (exit 2, one line); the route-flip rule accepts a gap only where the CPU router's margin is below its MARGIN.

use kdtree_formats::ExpertsMode;
use kdtree_golden::bundle::Bundle;
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-golden");

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kdtree-golden-score")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn model(dir: &Path) -> PathBuf {
    let hf = dir.join("hf");
    kdtree_convert::synth::write("tiny", &hf, 3, false, None).expect("synth tiny");
    let out = dir.join("model");
    kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
        src: hf.clone(),
        out: out.clone(),
        drafter: None,
        ranks: 1,
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

fn run(args: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let o = Command::new(BIN).args(args).output().expect("run kdtree-golden");
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// `kdtree-golden MODEL --prompts PROMPTS --score INPUTS... [extra] --out OUT`.
fn score(m: &Path, prompts: &Path, inputs: &[&Path], extra: &[&str], out: &Path) -> (Option<i32>, String) {
    let mut a: Vec<&std::ffi::OsStr> = vec![
        m.as_os_str(),
        "--prompts".as_ref(),
        prompts.as_os_str(),
        "--score".as_ref(),
    ];
    a.extend(inputs.iter().map(|p| p.as_os_str()));
    a.extend(extra.iter().map(|x| std::ffi::OsStr::new(*x)));
    a.extend(["--out".as_ref(), out.as_os_str()]);
    run(&a)
}

fn report(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn the_cpu_scores_its_own_tokens_zero_and_a_changed_token_fails() {
    let dir = scratch("score");
    let m = model(&dir);
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, PROMPTS).unwrap();
    let gold = dir.join("gold");
    let (code, err) = run(&[
        m.as_os_str(),
        "--prompts".as_ref(),
        prompts.as_os_str(),
        "--out".as_ref(),
        gold.as_os_str(),
        "--max-tokens".as_ref(),
        "6".as_ref(),
        "--full-logits-steps".as_ref(),
        "6".as_ref(),
        "--trace-step".as_ref(),
        "0".as_ref(),
        "--quiet".as_ref(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    let b = Bundle::open(&gold).unwrap();
    let recs = b.load_all().unwrap();
    // The bundle itself (its own full logits), and the same tokens as kdtree-run records.
    let jsonl = dir.join("run.jsonl");
    let lines: String = recs
        .iter()
        .map(|(id, r)| format!("{{\"id\":{id:?},\"token_ids\":{:?}}}\n", r.ar.tokens))
        .collect();
    std::fs::write(&jsonl, &lines).unwrap();
    let out = dir.join("r.json");
    let (code, err) = score(&m, &prompts, &[&gold, &jsonl], &["--bound", "0"], &out);
    assert_eq!(code, Some(0), "{err}");
    let r = report(&out);
    assert_eq!(r["max_gap"].as_f64(), Some(0.0), "{r}");
    assert_eq!(
        r["sequences"].as_u64(),
        Some(2),
        "identical sequences are scored once: {r}"
    );
    assert_eq!(r["tokens"].as_u64(), Some(24));
    assert_eq!(
        r["max_abs_delta"].as_f64(),
        Some(0.0),
        "a CPU bundle against the CPU: {r}"
    );
    for x in r["records"].as_array().unwrap() {
        assert!(
            x["ranks"].as_array().unwrap().iter().all(|v| v.as_u64() == Some(0)),
            "{x}"
        );
        assert_eq!(x["router_margins"].as_array().unwrap().len(), 6, "{x}");
    }
    // One token changed to the CPU's least likely one at position 2 of p1: a gap there (and later positions see
    // another prefix); exit 1, with the position in the report.
    let (_, r1) = &recs[0];
    let mut bad = r1.ar.tokens.clone();
    bad[2] = (bad[2] + 1) % 64;
    let tampered = dir.join("bad.jsonl");
    std::fs::write(&tampered, format!("{{\"id\":{:?},\"token_ids\":{bad:?}}}\n", recs[0].0)).unwrap();
    let out2 = dir.join("r2.json");
    let (code, err) = score(&m, &prompts, &[&tampered], &["--bound", "0.01"], &out2);
    assert_eq!(code, Some(1), "{err}");
    let r = report(&out2);
    let gaps = r["records"][0]["gaps"].as_array().unwrap();
    assert_eq!(gaps[0].as_f64(), Some(0.0));
    assert_eq!(gaps[1].as_f64(), Some(0.0));
    assert!(gaps[2].as_f64().unwrap() > 0.01, "{r}");
    assert!(r["over_bound"].as_u64().unwrap() >= 1);
    // The route-flip rule: with a margin of 0 nothing is a flip (exit 1 still); a huge margin and gap accept it.
    for (flip, want) in [("0,100", 1), ("1e9,1e9", 0)] {
        let (code, err) = score(
            &m,
            &prompts,
            &[&tampered],
            &["--bound", "0.01", "--route-flip", flip],
            &out2,
        );
        assert_eq!(code, Some(want), "--route-flip {flip}: {err}");
    }
    // The accepted flip is the record's first gap over the bound; every later one is reported after it, not
    // judged (the run's own cache holds the flipped row from there on).
    let r = report(&out2);
    let over: Vec<usize> = gaps
        .iter()
        .enumerate()
        .filter(|(_, g)| g.as_f64().unwrap() > 0.01)
        .map(|(j, _)| j)
        .collect();
    let flips = r["route_flips"].as_array().unwrap();
    assert_eq!(flips.len(), 1, "{r}");
    assert_eq!(flips[0][2].as_u64(), Some(2), "{r}");
    let after: Vec<u64> = r["after_flip"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x[2].as_u64().unwrap())
        .collect();
    assert_eq!(after, over[1..].iter().map(|&j| j as u64).collect::<Vec<_>>(), "{r}");
    assert_eq!(r["over_bound"].as_u64(), Some(0), "{r}");
}

#[test]
fn bad_inputs_are_one_line_errors_with_exit_2() {
    let dir = scratch("bad");
    let m = model(&dir);
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, PROMPTS).unwrap();
    for (name, body, want) in [
        (
            "unknown-id.jsonl",
            "{\"id\":\"nope\",\"token_ids\":[1,2]}\n",
            "not a line of",
        ),
        (
            "error-record.jsonl",
            "{\"id\":\"p1\",\"status\":\"error\",\"error\":{\"code\":\"x\"}}\n",
            "no token_ids",
        ),
        (
            "outside.jsonl",
            "{\"id\":\"p1\",\"token_ids\":[99999999]}\n",
            "outside the vocabulary",
        ),
        ("not-json.jsonl", "{\"id\":\n", "not JSON"),
    ] {
        let f = dir.join(name);
        std::fs::write(&f, body).unwrap();
        let (code, err) = score(&m, &prompts, &[&f], &[], &dir.join("r.json"));
        assert_eq!(code, Some(2), "{name}: {err}");
        assert_eq!(err.lines().count(), 1, "{name}: {err}");
        assert!(err.contains(want), "{name}: {err}");
    }
    assert!(!dir.join("r.json").exists(), "no report is written when scoring fails");
}
