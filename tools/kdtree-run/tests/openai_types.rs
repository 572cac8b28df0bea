//! The OpenAI batch envelope checked with the official `openai` Python package's own types: kdtree-run
//! answers OpenAI batch lines (successes with and without `body.model`, a context-length failure, an
//! invalid request) on the tiny model, and tests/python/check_openai_batch.py validates every 200 body
//! with `openai.types.chat.ChatCompletion.model_validate` and every line's batch output shape.
//!
//! The package is pip-installed (wheels only: openai and its small pure-Python dependencies, pydantic)
//! into a venv under CARGO_TARGET_TMPDIR, reused while it imports. The test is skipped, with a message,
//! only when pip cannot reach the package index; with `CI` set (CI reaches PyPI) that is a failure too.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");
const CHECKER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/check_openai_batch.py");

/// pip output that means "no network", not "broken install".
const OFFLINE: &[&str] = &[
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
];

fn run(cmd: &mut Command) -> (bool, String) {
    match cmd.output() {
        Ok(o) => (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        ),
        Err(e) => (false, format!("cannot run {cmd:?}: {e}")),
    }
}

/// The venv's python with `openai` importable; None = skip (pip has no network, outside CI).
fn python_with_openai() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    if run(Command::new(&python).args(["-c", "import openai.types.chat"])).0 {
        return Some(python);
    }
    let _ = std::fs::remove_dir_all(&venv);
    let (ok, out) = run(Command::new("python3").args(["-m", "venv"]).arg(&venv));
    assert!(
        ok,
        "python3 -m venv {} failed (python3 with venv is needed for this test):\n{out}",
        venv.display()
    );
    let (ok, out) = run(Command::new(&python).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--retries",
        "1",
        "--timeout",
        "30",
        "openai",
    ]));
    if !ok {
        let offline = OFFLINE.iter().any(|s| out.contains(s));
        if offline && std::env::var_os("CI").is_none() {
            eprintln!("SKIPPED openai_types: pip cannot reach the package index (no network):\n{out}");
            return None;
        }
        panic!("pip install openai failed:\n{out}");
    }
    Some(python)
}

#[test]
fn the_batch_envelope_passes_the_openai_packages_own_types() {
    let Some(python) = python_with_openai() else { return };
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-openai");
    let _ = std::fs::remove_dir_all(&root);
    let model = common::convert_tiny(&root, 0);
    let long: Vec<String> = (0..5000).map(|i| (i % 500).to_string()).collect();
    let line = |id: &str, body: &str| {
        format!("{{\"custom_id\":\"{id}\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{body}}}\n")
    };
    let text = [
        line(
            "named",
            r#"{"model":"kimi-k2.6","messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#,
        ),
        line(
            "unnamed",
            concat!(
                r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Yo"}],"#,
                r#""max_completion_tokens":3,"chat_template_kwargs":{"thinking":false},"temperature":0.8,"seed":5}"#,
            ),
        ),
        line(
            "stop",
            r#"{"messages":[{"role":"user","content":"Count"}],"max_tokens":6,"stop":["1"]}"#,
        ),
        line(
            "long",
            &format!(r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#, long.join(" ")),
        ),
        line("bad", r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#),
    ]
    .concat();
    let prompts = root.join("batch.jsonl");
    std::fs::write(&prompts, text).unwrap();
    let out = root.join("out.jsonl");
    let o = Command::new(BIN)
        .arg(&model)
        .args([
            "--prompts",
            prompts.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--budget",
            "4",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "two lines fail: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (ok, report) = run(Command::new(&python).arg(CHECKER).arg(&out).args(["3", "2"]));
    assert!(ok, "{report}");
    eprintln!("{}", report.trim_end());
}
