//! kill -9 at several moments during `repack`, re-run the same command each time: the final output
//! must be byte-identical to an uninterrupted run (carried tokenizer files included), and no interrupted
//! state may pass `verify`.

mod common;
use common::*;
use std::time::{Duration, Instant};

#[test]
fn kill9_then_resume_gives_identical_bytes() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny {
        hidden: 256,
        inter: 512,
        moe_inter: 128,
        layers: 4,
        experts: 16,
        vocab: 8192,
        ..Tiny::default()
    };
    let src = d.path().join("src");
    write_checkpoint(&src, &t);
    // Carried tokenizer files (copied first, resumable like the shards) are part of the comparison.
    let tk: String = (0..60_000u32)
        .map(|i| format!("{:08x} {i}\n", i.wrapping_mul(2_654_435_761)))
        .collect();
    std::fs::write(src.join("tiktoken.model"), tk).unwrap();
    std::fs::write(src.join("tokenizer_config.json"), r#"{"added_tokens_decoder": {}}"#).unwrap();
    std::fs::write(
        src.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let args = |out: &std::path::Path| -> Vec<String> {
        [
            "repack",
            s(&src),
            s(out),
            "--ranks",
            "2",
            "--max-file-size",
            "150000",
            "--quiet",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect()
    };
    let reference = d.path().join("ref");
    let t0 = Instant::now();
    assert!(bin().args(args(&reference)).status().unwrap().success());
    let full = t0.elapsed();
    let want = snapshot(&reference);
    let out = d.path().join("out");
    // First kill right after start; then kill each run once a given number of files is recorded done
    // (so the kill lands mid-write, with other files in flight). Resumed runs skip finished files.
    let n_files = want
        .keys()
        .filter(|k| k.to_str().unwrap().ends_with(".safetensors"))
        .count();
    let records = || std::fs::read_dir(out.join(".kdtree-convert")).map_or(0, |d| d.count());
    let mut child = bin().args(args(&out)).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(2));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let mut mid_write = 0;
    for target in [n_files / 4, n_files / 2, 3 * n_files / 4] {
        let mut child = bin().args(args(&out)).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let killed = loop {
            if child.try_wait().unwrap().is_some() {
                break false;
            }
            if records() >= target || Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                break true;
            }
            std::thread::sleep(Duration::from_micros(500));
        };
        if killed && records() > 0 && !out.join("manifest.toml").exists() {
            mid_write += 1;
            assert_ne!(
                run(&["verify", s(&out), "--quiet"]).0,
                0,
                "an interrupted output passed verify"
            );
        }
    }
    eprintln!("full run {full:?}, {n_files} files: {mid_write} kills mid-write");
    assert!(mid_write >= 2, "only {mid_write} kills landed mid-write");
    let st = bin().args(args(&out)).status().unwrap();
    assert!(st.success());
    assert_eq!(snapshot(&out), want, "resumed output differs from an uninterrupted run");
    assert_eq!(run(&["verify", s(&out), "--quiet"]).0, 0);
}
