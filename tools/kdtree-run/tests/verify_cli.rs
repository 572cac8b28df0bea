//! `kdtree-run --verify` end to end: the tiny synthetic preset with its drafter (seed 0), converted by
//! `kdtree_convert::repack`, a bundle written by `kdtree_golden::make::make_bundle` (the code the
//! kdtree-golden binary runs) into a temp dir, then kdtree-run on the same model must match it (exit 0),
//! and must exit 1 naming the prompt when one recorded logit is changed (AR full logits of one prompt,
//! a DDTree verify logit of the other, the index's sha256 re-written as the reader requires), and at once,
//! before generating, when the model is another seed (same architecture, its first step not the bundle's).
//! Also: a changed file without its new sha256, a prompt file that is not the bundle's, and (in a build
//! without the CUDA backend) --device cuda are refused with exit 2 before any work. The CUDA rules
//! themselves: src/verify/e2e_tests.rs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

mod common;

use kdtree_golden::bundle::{sha256_hex, Bundle, Index, PromptRecord, INDEX_FILE};

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

const PROMPTS: &str = concat!(
    r#"{"id": "p1", "prompt_token_ids": [1, 17, 305, 42]}"#,
    "\n",
    r#"{"id": "p2", "prompt_token_ids": [900, 3, 3, 64, 128, 512]}"#,
    "\n"
);

fn root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-verify")
}

/// synth tiny (+ drafter) with `seed`, repacked to one rank.
fn convert(seed: u64) -> PathBuf {
    common::convert_tiny(&root(), seed)
}

/// (model of seed 0, its prompts file, its bundle), built once.
fn fixture() -> &'static (PathBuf, PathBuf, PathBuf) {
    static F: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    F.get_or_init(|| {
        let _ = std::fs::remove_dir_all(root());
        std::fs::create_dir_all(root()).unwrap();
        let model = convert(0);
        let prompts = root().join("prompts.jsonl");
        std::fs::write(&prompts, PROMPTS).unwrap();
        let golden = root().join("golden");
        let opts = kdtree_golden::make::Options {
            max_tokens: 6,
            budget: 6,
            full_logits_steps: 2,
            topk: 4,
            trace_step: 1,
            no_ddtree: false,
            quiet: true,
        };
        kdtree_golden::make::make_bundle(&model, &prompts, &golden, &opts).expect("make bundle");
        (model, prompts, golden)
    })
}

fn scratch(name: &str) -> PathBuf {
    let d = root().join("work").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn verify(model: &Path, prompts: &Path, golden: &Path, out: &Path, extra: &[&str]) -> (Output, String) {
    let o = Command::new(BIN)
        .arg(model)
        .args([
            "--prompts",
            s(prompts),
            "--out",
            s(out),
            "--verify",
            s(golden),
            "--max-tokens",
            "6",
            "--budget",
            "8",
            "--quiet",
        ])
        .args(extra)
        .output()
        .expect("spawn kdtree-run");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    (o, err)
}

/// The table row of prompt `id` (`id | tokens | max |Δlogit| | ddtree round | verdict`), split in cells.
fn row(stderr: &str, id: &str) -> Vec<String> {
    let line = stderr
        .lines()
        .find(|l| l.split(" | ").next().map(str::trim) == Some(id))
        .unwrap_or_else(|| panic!("no table row for {id} in:\n{stderr}"));
    line.split(" | ").map(|c| c.trim().to_string()).collect()
}

fn copy_bundle(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Rewrite prompt `id` of the bundle in `dir` through `edit`; `fix_sha`: also update index.json.
fn edit_record(dir: &Path, id: &str, fix_sha: bool, edit: impl FnOnce(&mut PromptRecord)) {
    let index_path = dir.join(INDEX_FILE);
    let mut index: Index = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let entry = index.prompts.iter_mut().find(|p| p.id == id).unwrap();
    let path = dir.join(&entry.file);
    let mut rec = PromptRecord::from_bytes(&std::fs::read(&path).unwrap(), "test").unwrap();
    edit(&mut rec);
    let bytes = rec.to_bytes().unwrap();
    std::fs::write(&path, &bytes).unwrap();
    if fix_sha {
        entry.sha256 = sha256_hex(&bytes);
        std::fs::write(&index_path, serde_json::to_string_pretty(&index).unwrap() + "\n").unwrap();
    }
}

#[test]
fn the_same_model_matches_its_bundle_and_records_are_written() {
    let (model, prompts, golden) = fixture();
    let dir = scratch("pass");
    let out = dir.join("out.jsonl");
    let (o, err) = verify(model, prompts, golden, &out, &[]);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("prompt id | tokens | max |Δlogit| | ddtree round | verdict"),
        "{err}"
    );
    for id in ["p1", "p2"] {
        assert_eq!(row(&err, id), [id, "6/6", "0", "match", "match"], "{err}");
    }
    assert!(err.contains("verify: 2 of 2 prompts match"), "{err}");
    assert!(!err.contains("warning"), "{err}");
    // the JSONL records are written as usual, and greedy ones continue the bundle's tokens
    let recs: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 2);
    let bundle = Bundle::open(golden).unwrap();
    for (r, id) in recs.iter().zip(["p1", "p2"]) {
        assert_eq!((r["id"].as_str(), r["status"].as_str()), (Some(id), Some("ok")));
        let toks: Vec<u32> = r["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let want = bundle.load(id).unwrap().ar.tokens;
        assert_eq!(toks[..], want[..toks.len()], "{id}");
    }
}

#[test]
fn a_changed_logit_fails_and_names_the_prompt() {
    let (model, prompts, golden) = fixture();
    let dir = scratch("flipped");
    let bad = dir.join("golden");
    copy_bundle(golden, &bad);
    // p2: one AR full logit (step 1, not the argmax, so the tokens still agree)
    edit_record(&bad, "p2", true, |r| {
        let v = r.ar.vocab;
        let i = (0..v).find(|&i| i as u32 != r.ar.tokens[1]).unwrap();
        r.ar.full_logits[v + i] += 0.5;
    });
    // p1: one DDTree verify logit
    edit_record(&bad, "p1", true, |r| {
        let d = r.ddtree.as_mut().unwrap();
        d.verify_logits[3] = -d.verify_logits[3] - 1.0;
    });
    let (o, err) = verify(model, prompts, &bad, &dir.join("out.jsonl"), &[]);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let p2 = row(&err, "p2");
    assert_eq!(
        (p2[1].as_str(), p2[3].as_str(), p2[4].as_str()),
        ("6/6", "match", "MISMATCH"),
        "{err}"
    );
    assert_eq!(p2[2], "5.000e-1", "{err}");
    assert!(err.contains("  p2: ar.full_logits[1, "), "{err}");
    let p1 = row(&err, "p1");
    assert_eq!(
        (p1[1].as_str(), p1[3].as_str(), p1[4].as_str()),
        ("6/6", "MISMATCH", "MISMATCH"),
        "{err}"
    );
    assert!(err.contains("  p1: ddtree.verify_logits[0, 3]: "), "{err}");
    assert!(err.contains("verify: 0 of 2 prompts match"), "{err}");
    // the records were still written
    assert_eq!(
        std::fs::read_to_string(dir.join("out.jsonl")).unwrap().lines().count(),
        2
    );

    // the same change without re-writing index.json: the reader refuses the file (exit 2, before any work)
    let unsigned = dir.join("unsigned");
    copy_bundle(golden, &unsigned);
    edit_record(&unsigned, "p2", false, |r| r.ar.topk_logits[0] += 1.0);
    let out = dir.join("out2.jsonl");
    let (o, err) = verify(model, prompts, &unsigned, &out, &[]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("sha256") && err.contains("p2.safetensors"), "{err}");
    assert!(!out.exists(), "nothing runs when the bundle is corrupt");
}

#[test]
fn a_changed_layer_probe_fails_and_names_the_tensor() {
    let (model, prompts, golden) = fixture();
    let dir = scratch("probe");
    let bad = dir.join("golden");
    copy_bundle(golden, &bad);
    // p1: one residual value of layer 1 of the traced decode step; p2: the router's first expert id
    edit_record(&bad, "p1", true, |r| {
        r.trace.as_mut().expect("bundle has a trace").layers[1].residual[2] += 0.25
    });
    edit_record(&bad, "p2", true, |r| {
        let t = r.trace.as_mut().unwrap();
        let l = t
            .layers
            .iter_mut()
            .find(|l| !l.router_ids.is_empty())
            .expect("a MoE layer");
        l.router_ids[0] = (l.router_ids[0] + 1) % 8;
    });
    let (o, err) = verify(model, prompts, &bad, &dir.join("out.jsonl"), &[]);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(row(&err, "p1")[4], "MISMATCH", "{err}");
    assert!(err.contains("  p1: trace.layers.1.residual[2]: "), "{err}");
    assert_eq!(row(&err, "p2")[4], "MISMATCH", "{err}");
    assert!(
        err.contains("  p2: trace.layers.") && err.contains(".router_ids[0]: "),
        "{err}"
    );
}

#[test]
fn another_model_seed_fails_at_once_before_generating() {
    let (_, prompts, golden) = fixture();
    let other = convert(1);
    let dir = scratch("seed1");
    let out = dir.join("out.jsonl");
    let (o, err) = verify(&other, prompts, golden, &out, &[]);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("kdtree-run: verify: the model is not the bundle's: its manifest.toml sha256")
            && err.contains("the first step of prompt p1 differs (ar.")
            && err.contains("stopped before generating"),
        "{err}"
    );
    // Nothing was generated: no table, no output, no lock left.
    assert!(!err.contains("prompts match") && !err.contains(" | "), "{err}");
    assert!(!out.exists(), "records were written");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

#[test]
fn another_manifest_with_the_bundles_numbers_warns_and_is_compared() {
    let (model, prompts, golden) = fixture();
    let dir = scratch("manifest");
    // The same weights under a manifest that differs in a byte the numbers do not depend on.
    let m = dir.join("model");
    std::fs::create_dir(&m).unwrap();
    for e in std::fs::read_dir(model).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "manifest.toml" {
            std::os::unix::fs::symlink(e.path(), m.join(e.file_name())).unwrap();
        }
    }
    let manifest = std::fs::read_to_string(model.join("manifest.toml")).unwrap();
    std::fs::write(m.join("manifest.toml"), manifest.clone() + "\n").unwrap();
    let (o, err) = verify(&m, prompts, golden, &dir.join("out.jsonl"), &[]);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("warning: the model's manifest.toml sha256") && err.contains("its first step matches"),
        "{err}"
    );
    assert!(err.contains("verify: 2 of 2 prompts match"), "{err}");
}

#[test]
fn wrong_prompt_files_and_cuda_are_refused_before_any_work() {
    let (model, prompts, golden) = fixture();
    let dir = scratch("refused");
    let out = dir.join("out.jsonl");
    let other = dir.join("other.jsonl");
    std::fs::write(&other, PROMPTS.replace("\"p2\"", "\"p3\"")).unwrap();
    let (o, err) = verify(model, &other, golden, &out, &[]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("is not the prompt file of the bundle"), "{err}");
    assert!(
        err.contains(r#"only in the prompt file ["p3"]"#) && err.contains(r#"only in the bundle's index.json ["p2"]"#),
        "{err}"
    );
    let (o, err) = verify(model, prompts, golden, &out, &["--device", "cuda"]);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains("not yet measured") && err.contains("cuda"), "{err}");
    assert!(!out.exists());
}

#[test]
fn same_ids_with_other_tokens_fail_on_prompt_ids() {
    let (model, _, golden) = fixture();
    let dir = scratch("tokens");
    let changed = dir.join("p.jsonl");
    std::fs::write(&changed, PROMPTS.replace("[1, 17, 305, 42]", "[1, 17, 306, 42]")).unwrap();
    let (o, err) = verify(model, &changed, golden, &dir.join("out.jsonl"), &["--mode", "ar"]);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(row(&err, "p1")[4], "MISMATCH", "{err}");
    assert_eq!(row(&err, "p2")[4], "match", "{err}");
    assert!(err.contains("  p1: prompt ids[2]: 306 vs bundle 305"), "{err}");
}
