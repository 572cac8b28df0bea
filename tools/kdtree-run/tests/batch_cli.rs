//! `kdtree-run --max-batch N` end to end on the CPU backend (tiny synthetic model with its drafter): every
//! record — tokens, text, finish reason, speculation counters — is the one `--max-batch 1` writes, in input
//! order, for AR, DDTree and the chain, with per-line overrides of every kind (max_tokens, temperature,
//! top_p, top_k, seed, stop strings — one taken from the middle of a line's own output, so the cut falls
//! inside a round), mixed prompt lengths and kinds, bad lines between good ones; `--resume` over a torn
//! file; and `--kv-memory`: a cap that holds one sequence gives the same file, one that holds none gives
//! every line an error record that names both sizes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value as Json;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

fn model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-batch");
        let _ = std::fs::remove_dir_all(&root);
        common::convert_tiny(&root, 3)
    })
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kdtree-run-batch-work")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn kdtree-run")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

use common::stable;

/// Runs the prompt file with `extra` flags into `out`; asserts the exit status.
fn answer(prompts: &Path, out: &Path, extra: &[&str], code: i32) -> Vec<Json> {
    let mut args = vec![
        s(model()),
        "--prompts",
        s(prompts),
        "--out",
        s(out),
        "--device",
        "cpu",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    assert_eq!(
        o.status.code(),
        Some(code),
        "{extra:?}: stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    stable(out)
}

/// Good lines of every kind and override, and bad ones between them.
fn prompt_file(dir: &Path, stop: &str) -> PathBuf {
    let stop = serde_json::to_string(stop).unwrap();
    let lines = [
        r#"{"id":"a","prompt":"The quick brown fox jumps","max_tokens":40}"#.to_string(),
        r#"{"id":"b","prompt_token_ids":[5],"max_tokens":25,"temperature":1.0,"seed":7}"#.into(),
        concat!(
            r#"{"id":"c","messages":[{"role":"user","content":"Hi there"}],"thinking":false,"max_tokens":30,"#,
            r#""temperature":0.7,"top_p":0.9,"top_k":40,"seed":3}"#,
        )
        .into(),
        "not json".into(),
        format!(r#"{{"id":"d","prompt":"The quick brown fox jumps","max_tokens":40,"stop":[{stop}]}}"#),
        r#"{"id":"e","prompt":"","max_tokens":5}"#.into(),
        r#"{"id":"f","prompt_token_ids":[9,8,7,6,5,4,3,2,1,9,8,7,6,5,4,3,2,1],"max_tokens":1}"#.into(),
        concat!(
            r#"{"custom_id":"g","method":"POST","url":"/v1/chat/completions","body":{"model":"tiny","#,
            r#""messages":[{"role":"user","content":"Yo"}],"max_tokens":12,"temperature":1.2,"seed":11}}"#,
        )
        .into(),
        r#"{"id":"h","prompt":"abc","max_tokens":33,"top_k":3,"temperature":0.9,"seed":1}"#.into(),
        r#"{"id":"i","prompt_token_ids":[100,200,300],"max_tokens":17}"#.into(),
    ];
    let p = dir.join("p.jsonl");
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

/// A stop string from the middle of line "a"'s greedy output (so its cut falls inside a step).
fn mid_text(dir: &Path) -> String {
    let p = prompt_file(dir, "\u{1}never");
    let recs = answer(&p, &dir.join("probe.jsonl"), &["--mode", "ddtree", "--budget", "8"], 1);
    let text: Vec<char> = recs[0]["text"].as_str().unwrap().chars().collect();
    assert!(text.len() >= 8, "line a's output is too short to cut: {text:?}");
    text[text.len() / 2..text.len() / 2 + 2].iter().collect()
}

#[test]
fn max_batch_gives_the_batch_1_file_in_every_mode() {
    let dir = scratch("modes");
    let stop = mid_text(&dir);
    let prompts = prompt_file(&dir, &stop);
    for mode in [
        &["--mode", "ar"][..],
        &["--mode", "ddtree", "--budget", "8"],
        &["--mode", "ddtree", "--budget", "32"],
        &["--mode", "chain"],
    ] {
        let want = answer(&prompts, &dir.join("b1.jsonl"), mode, 1);
        assert_eq!(want.len(), 10);
        assert_eq!(
            want[4]["finish_reason"], "stop",
            "{mode:?}: the stop string cuts line d: {}",
            want[4]
        );
        assert!(want[3]["error"].is_object() && want[5]["error"].is_object());
        for n in ["2", "4", "16"] {
            let got = answer(
                &prompts,
                &dir.join(format!("b{n}.jsonl")),
                &[mode, &["--max-batch", n]].concat(),
                1,
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{mode:?} --max-batch {n}: line {i} differs from --max-batch 1");
            }
            assert_eq!(got.len(), want.len());
        }
    }
}

#[test]
fn resume_and_kv_memory_under_a_batch() {
    let dir = scratch("resume");
    let prompts = prompt_file(&dir, "zz");
    let dd = ["--mode", "ddtree", "--budget", "8"];
    let want = answer(&prompts, &dir.join("full.jsonl"), &dd, 1);
    // A file cut after three records and half a line: --resume with a batch answers the rest the same.
    let full = std::fs::read_to_string(dir.join("full.jsonl")).unwrap();
    let keep: Vec<&str> = full.lines().take(3).collect();
    let torn = format!("{}\n{}", keep.join("\n"), &full.lines().nth(3).unwrap()[..10]);
    let out = dir.join("resumed.jsonl");
    std::fs::write(&out, torn).unwrap();
    let got = answer(
        &prompts,
        &out,
        &[&dd[..], &["--max-batch", "4", "--resume"]].concat(),
        1,
    );
    assert_eq!(got, want, "--resume under --max-batch 4");
    // No room for any sequence: every generating line gets an error record naming both sizes.
    let got = answer(
        &prompts,
        &dir.join("kv0.jsonl"),
        &[&dd[..], &["--max-batch", "4", "--kv-memory", "0.00001"]].concat(),
        1,
    );
    assert_eq!(got.len(), want.len());
    let mut need = 0;
    for (g, w) in got.iter().zip(&want) {
        if w["error"].is_object() {
            assert_eq!(g, w);
            continue;
        }
        let err = g
            .get("error")
            .filter(|e| e.is_object())
            .or_else(|| g.pointer("/response/body/error"))
            .unwrap_or_else(|| panic!("no error: {g}"));
        let msg = err["message"].as_str().unwrap();
        assert_eq!(err["code"], "kv_cache_exceeded", "{g}");
        assert!(msg.contains("of KV cache") && msg.contains("KV memory is"), "{msg}");
        // "... needs 1.23 MiB (1290240 bytes, 256 cache rows) of KV cache ...": the largest need.
        let bytes: usize = msg
            .split(" (")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        need = need.max(bytes);
    }
    // KV room for one sequence at a time (every line here needs 256 rows): the same file.
    let one = format!("{}", (need as f64 * 1.5) / (1u64 << 30) as f64);
    let got = answer(
        &prompts,
        &dir.join("kv1.jsonl"),
        &[&dd[..], &["--max-batch", "4", "--kv-memory", &one]].concat(),
        1,
    );
    assert_eq!(got, want, "--kv-memory {one} holding one sequence");
    let o = run(&[
        s(model()),
        "--prompts",
        s(&prompts),
        "--out",
        s(&dir.join("x.jsonl")),
        "--kv-memory",
        "-1",
    ]);
    assert_eq!(o.status.code(), Some(2));
}
