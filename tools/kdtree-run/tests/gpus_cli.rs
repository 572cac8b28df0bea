//! `kdtree-run --gpus N` end to end on the CPU backend (N threads stand in for the GPUs; engine/src/tp): the
//! tiny synthetic model converted for 2 ranks, run as 2 rank groups, writes the records one controller writes
//! (AR and DDTree, `--max-batch` 1 and 3); clear refusals (exit 2) for a count that does not divide the ranks
//! and for `--share-gpu` without a GPU's worth of ranks to share.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

mod common;
use common::stable;

fn model(root: &Path) -> PathBuf {
    common::convert_tiny_ranks(root, 5, true, 2)
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn kdtree-run")
}

#[test]
fn two_rank_groups_write_one_controllers_records() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let prompts = tmp.path().join("p.jsonl");
    let lines = [
        r#"{"id":"a","prompt":"The quick brown fox jumps","max_tokens":30}"#,
        r#"{"id":"b","prompt_token_ids":[5, 9, 300],"max_tokens":20,"temperature":1.0,"seed":7}"#,
        r#"{"id":"c","prompt":"abc","max_tokens":25,"top_k":3,"temperature":0.9,"seed":1}"#,
    ];
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let (m, p) = (m.to_str().unwrap(), prompts.to_str().unwrap());
    for mode in [["--mode", "ar"], ["--mode", "ddtree"]] {
        for batch in ["1", "3"] {
            let mut outs = Vec::new();
            for gpus in ["1", "2"] {
                let out = tmp.path().join(format!("out-{}-{batch}-{gpus}.jsonl", mode[1]));
                let o = run(&[
                    m,
                    "--prompts",
                    p,
                    "--out",
                    out.to_str().unwrap(),
                    "--device",
                    "cpu",
                    "--gpus",
                    gpus,
                    "--max-batch",
                    batch,
                    mode[0],
                    mode[1],
                ]);
                assert_eq!(
                    o.status.code(),
                    Some(0),
                    "--gpus {gpus}: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                let err = String::from_utf8_lossy(&o.stderr);
                assert_eq!(err.contains("tensor parallel: 2 rank groups"), gpus == "2", "{err}");
                outs.push(stable(&out));
            }
            assert_eq!(outs[0].len(), 3);
            assert!(outs[0].iter().all(|r| r["status"] == "ok"), "{:?}", outs[0]);
            assert_eq!(
                outs[0], outs[1],
                "{mode:?} --max-batch {batch}: --gpus 2 differs from --gpus 1"
            );
        }
    }
}

#[test]
fn counts_that_do_not_divide_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path());
    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"id\":\"a\",\"prompt\":\"hi\",\"max_tokens\":3}\n").unwrap();
    let out = tmp.path().join("o.jsonl");
    let o = run(&[
        m.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--device",
        "cpu",
        "--gpus",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("2 ranks") && err.contains("3 GPUs"), "{err}");
    let o = run(&[
        m.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--share-gpu",
    ]);
    assert_eq!(o.status.code(), Some(2), "--share-gpu needs --gpus");
}
