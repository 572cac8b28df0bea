//! End-to-end tests of the kdtree-run binary on a tiny model: `kdtree_convert::synth` ("tiny" preset
//! with its drafter) converted by `kdtree_convert::repack` into a 1-rank directory, built once per run
//! under CARGO_TARGET_TMPDIR. Covers every prompt kind, the OpenAI envelope, per-line errors and exit
//! codes, greedy DDTree == AR, --summary, resume after SIGKILL, and a closed stdout.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value as Json;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

/// The converted tiny model (with tokenizer files and chat template beside the shards).
fn model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-cli");
        let _ = std::fs::remove_dir_all(&root);
        common::convert_tiny(&root, 0)
    })
}

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kdtree-run-cli-work")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn kdtree_run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn kdtree-run")
}

fn records(path: &Path) -> Vec<Json> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Records with their run-dependent `timing` removed (what `jq -c 'del(.timing)'` leaves).
fn without_timing(path: &Path) -> Vec<Json> {
    records(path)
        .into_iter()
        .map(|mut r| {
            r.as_object_mut().unwrap().remove("timing");
            r
        })
        .collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn every_prompt_kind_openai_envelope_summary_and_ddtree_equals_ar() {
    let dir = scratch("kinds");
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        concat!(
            r#"{"id":"plain","prompt":"Hello world","max_tokens":6}"#,
            "\n",
            r#"{"id":"chat","messages":[{"role":"user","content":"Hi"}],"thinking":false,"max_tokens":6}"#,
            "\n",
            r#"{"id":"ids","prompt_token_ids":[1,2,3,4],"max_tokens":6}"#,
            "\n",
            r#"{"custom_id":"oa","method":"POST","url":"/v1/chat/completions","#,
            r#""body":{"model":"tiny-test","messages":[{"role":"user","content":"Yo"}],"max_tokens":6}}"#,
            "\n",
        ),
    )
    .unwrap();
    let (dd, ar, summary) = (dir.join("dd.jsonl"), dir.join("ar.jsonl"), dir.join("summary.json"));
    let o = kdtree_run(&[
        s(model()),
        "--prompts",
        s(&prompts),
        "--out",
        s(&dd),
        "--summary",
        s(&summary),
        "--device",
        "cpu",
        "--budget",
        "8",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("backend: cpu"));
    let recs = records(&dd);
    assert_eq!(recs.len(), 4);
    for (r, id) in recs.iter().zip(["plain", "chat", "ids"]) {
        assert_eq!((r["id"].as_str(), r["status"].as_str()), (Some(id), Some("ok")), "{r}");
        let n = r["token_ids"].as_array().unwrap().len();
        assert!((1..=6).contains(&n), "{r}");
        assert_eq!(r["usage"]["completion_tokens"], n);
        assert!(r["text"].is_string() && r["timing"]["e2e_ms"].is_number());
        assert_eq!(r["spec"]["mode"], "ddtree");
        assert!(r["spec"]["verify_steps"].as_u64().unwrap() >= 1, "{r}");
        assert!(["stop", "length"].contains(&r["finish_reason"].as_str().unwrap()));
    }
    assert_eq!(recs[1]["sampling"]["thinking"], false);
    assert_eq!(recs[2]["usage"]["prompt_tokens"], 4);
    let oa = &recs[3];
    assert_eq!(
        (oa["id"].as_str(), oa["custom_id"].as_str()),
        (Some("batch_req_oa"), Some("oa"))
    );
    assert_eq!(oa["error"], Json::Null);
    assert_eq!(oa["response"]["status_code"], 200);
    let body = &oa["response"]["body"];
    assert_eq!(
        (body["object"].as_str(), body["model"].as_str()),
        (Some("chat.completion"), Some("tiny-test"))
    );
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert!(body["choices"][0]["message"]["content"].is_string());
    let sum: Json = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(
        (sum["lines"].as_u64(), sum["ok"].as_u64(), sum["backend"].as_str()),
        (Some(4), Some(4), Some("cpu"))
    );
    assert_eq!(sum["manifest_sha256"].as_str().unwrap().len(), 64);
    assert!(sum["acceptance_length"].as_f64().unwrap() >= 1.0);

    let o = kdtree_run(&[
        s(model()),
        "--prompts",
        s(&prompts),
        "--out",
        s(&ar),
        "--mode",
        "ar",
        "--quiet",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.stderr.is_empty(),
        "--quiet printed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let ar_recs = records(&ar);
    for (a, d) in ar_recs.iter().zip(&recs) {
        let tokens = |r: &Json| r.pointer("/response/body/token_ids").unwrap_or(&r["token_ids"]).clone();
        assert_eq!(tokens(a), tokens(d), "greedy AR and DDTree differ");
    }
    assert_eq!(ar_recs[0]["spec"], serde_json::json!({"mode": "ar"}));
}

#[test]
fn bad_lines_get_error_records_the_rest_runs_and_exit_is_1() {
    let dir = scratch("bad");
    let prompts = dir.join("p.jsonl");
    let long: Vec<String> = (0..5000).map(|i| (i % 500).to_string()).collect();
    let text = format!(
        "{}\nnot json\n{}\n{{\"id\":\"long\",\"prompt_token_ids\":[{}]}}\n{}\n",
        r#"{"id":"good","prompt_token_ids":[5,6,7],"max_tokens":3}"#,
        r#"{"id":"empty","prompt":""}"#,
        long.join(","),
        r#"{"id":"good","prompt":"again"}"#,
    );
    std::fs::write(&prompts, text).unwrap();
    let out = dir.join("out.jsonl");
    let o = kdtree_run(&[
        s(model()),
        "--prompts",
        s(&prompts),
        "--out",
        s(&out),
        "--mode",
        "ar",
        "--quiet",
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let recs = records(&out);
    let got: Vec<(&str, &str)> = recs
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap(),
                r.pointer("/error/code").and_then(Json::as_str).unwrap_or("ok"),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("good", "ok"),
            ("line-2", "invalid_json"),
            ("empty", "empty_prompt"),
            ("long", "context_length_exceeded"),
            ("good", "duplicate_id"),
        ]
    );
    assert_eq!(recs[0]["token_ids"].as_array().unwrap().len(), 3);
}

#[test]
fn resume_after_sigkill_gives_the_same_file() {
    let dir = scratch("resume");
    let prompts = dir.join("p.jsonl");
    let mut text = String::new();
    // Enough lines that the run is still going when its first record appears (asserted below).
    const LINES: usize = 120;
    for i in 0..LINES {
        text += &format!(
            "{{\"id\":\"q{i}\",\"prompt_token_ids\":[{},{},{}],\"max_tokens\":4}}\n",
            10 + i % 50,
            20 + i % 70,
            30 + i % 90
        );
    }
    std::fs::write(&prompts, text).unwrap();
    let (full, killed) = (dir.join("full.jsonl"), dir.join("killed.jsonl"));
    let base = [s(model()), "--prompts", s(&prompts), "--budget", "4", "--quiet"];
    let o = kdtree_run(&[&base[..], &["--out", s(&full)]].concat());
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );

    let mut child = Command::new(BIN)
        .args(base)
        .args(["--out", s(&killed)])
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read(&killed).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count()) < 1 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no output line within 120 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run finished before the kill: the test proves nothing"
    );
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(9),
        "the run must have died of the SIGKILL, not finished: {status:?}"
    );
    let mut bytes = std::fs::read(&killed).unwrap();
    let complete = bytes.iter().filter(|&&c| c == b'\n').count();
    assert!(
        (1..LINES).contains(&complete),
        "the kill must land mid-run: {complete} of {LINES} lines written"
    );
    // A kill between records leaves no torn line; add one so that path is exercised too.
    bytes.extend_from_slice(b"{\"id\":\"q");
    std::fs::write(&killed, &bytes).unwrap();

    let o = kdtree_run(&[&base[..], &["--out", s(&killed), "--resume"]].concat());
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(without_timing(&killed), without_timing(&full));
    // Resuming a finished file answers nothing new and changes nothing.
    let before = std::fs::read(&killed).unwrap();
    let o = kdtree_run(&[&base[..], &["--out", s(&killed), "--resume"]].concat());
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(std::fs::read(&killed).unwrap(), before);
}

#[test]
fn closed_stdout_ends_quietly_with_0() {
    let dir = scratch("pipe");
    let prompts = dir.join("p.jsonl");
    let mut f = std::fs::File::create(&prompts).unwrap();
    for i in 0..5 {
        writeln!(f, "{{\"id\":\"q{i}\",\"prompt_token_ids\":[1,2],\"max_tokens\":2}}").unwrap();
    }
    let mut child = Command::new(BIN)
        .args([
            s(model()),
            "--prompts",
            s(&prompts),
            "--out",
            "-",
            "--mode",
            "ar",
            "--quiet",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before the first record is written
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.stderr.is_empty(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn missing_model_is_an_error_with_exit_2() {
    let dir = scratch("missing");
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, "{\"id\":\"a\",\"prompt\":\"x\"}\n").unwrap();
    let out = dir.join("o.jsonl");
    let o = kdtree_run(&[s(&dir.join("no-model")), "--prompts", s(&prompts), "--out", s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("error:").count(), 1, "{err}");
    assert!(err.contains("no-model"), "{err}");
    assert!(!out.exists(), "a failed load must not create or truncate the output");
}
