//! kdtree-run under attack (issue 16): outputs naming inputs by any spelling, checks that must all pass
//! before an existing --out is touched, closed stderr/stdout, non-regular outputs, bytes that are not
//! UTF-8, colliding synthetic ids, non-finite numbers, --resume after the input or settings changed,
//! and OS errors printed once. The tiny synthetic model (with and without its drafter), one rank.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use serde_json::Value as Json;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

fn root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-hardening")
}

/// (tiny with drafter, tiny without), built once.
fn models() -> &'static (PathBuf, PathBuf) {
    static M: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    M.get_or_init(|| {
        let _ = std::fs::remove_dir_all(root().join("models"));
        (
            common::convert_tiny(&root().join("models"), 0),
            common::convert_tiny_with(&root().join("models"), 0, false),
        )
    })
}

fn model() -> &'static str {
    models().0.to_str().unwrap()
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

fn kdtree_run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn kdtree-run")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn records(path: &Path) -> Vec<Json> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn without_timing(path: &Path) -> Vec<Json> {
    let mut recs = records(path);
    recs.iter_mut()
        .for_each(|r| drop(r.as_object_mut().unwrap().remove("timing")));
    recs
}

/// Three short token-id lines.
fn prompts(dir: &Path) -> PathBuf {
    let p = dir.join("p.jsonl");
    let mut text = String::new();
    for i in 0..3 {
        text += &format!(
            "{{\"id\":\"q{i}\",\"prompt_token_ids\":[{},{},{}],\"max_tokens\":2}}\n",
            10 + i,
            20 + i,
            30 + i
        );
    }
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn an_output_naming_an_input_is_refused_by_identity_not_spelling() {
    let dir = scratch("identity");
    let p = prompts(&dir);
    let before = std::fs::read(&p).unwrap();
    std::fs::hard_link(&p, dir.join("hard.jsonl")).unwrap();
    std::os::unix::fs::symlink(&p, dir.join("soft.jsonl")).unwrap();
    let dotted = format!("{}/./p.jsonl", dir.display());
    let manifest = format!("{}/manifest.toml", model());
    for out in [
        s(&p),
        s(&dir.join("hard.jsonl")),
        s(&dir.join("soft.jsonl")),
        &dotted,
        &manifest,
    ] {
        for flags in [
            vec!["--out", out],
            vec!["--out", s(&dir.join("o.jsonl")), "--summary", out],
        ] {
            let o = kdtree_run(&[&[model(), "--prompts", s(&p), "--mode", "ar"][..], &flags].concat());
            assert_eq!(o.status.code(), Some(2), "{flags:?}: {}", stderr(&o));
            assert!(
                stderr(&o).contains("refusing to write over an input"),
                "{flags:?}: {}",
                stderr(&o)
            );
            assert_eq!(std::fs::read(&p).unwrap(), before, "{flags:?} changed the prompt file");
        }
    }
    // A relative spelling from another working directory.
    let o = Command::new(BIN)
        .current_dir(&dir)
        .args([model(), "--prompts", "p.jsonl", "--out", "./p.jsonl"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // --out - whose stdout appends to the prompt file.
    let append = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
    let o = Command::new(BIN)
        .args([model(), "--prompts", s(&p), "--out", "-", "--mode", "ar"])
        .stdout(append)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(std::fs::read(&p).unwrap(), before);
    // --summary and --out the same file.
    let out = dir.join("o.jsonl");
    std::fs::write(&out, "KEEP\n").unwrap();
    let o = kdtree_run(&[
        model(),
        "--prompts",
        s(&p),
        "--out",
        s(&out),
        "--summary",
        &format!("{}/./o.jsonl", dir.display()),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("are the same file"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "KEEP\n");
}

#[test]
fn nothing_is_written_before_every_early_check_passed() {
    let dir = scratch("early");
    let p = prompts(&dir);
    let out = dir.join("o.jsonl");
    let summary_dir = dir.join("a-dir");
    std::fs::create_dir(&summary_dir).unwrap();
    let no_drafter = s(&models().1);
    let missing = dir.join("missing");
    let bad_prompts = [s(&missing), "--out", s(&out)];
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "no drafter for ddtree",
            vec![no_drafter, "--prompts", s(&p), "--out", s(&out)],
        ),
        (
            "summary dir missing",
            vec![
                model(),
                "--prompts",
                s(&p),
                "--out",
                s(&out),
                "--summary",
                "/nonexistent-dir/s.json",
            ],
        ),
        (
            "summary is a directory",
            vec![
                model(),
                "--prompts",
                s(&p),
                "--out",
                s(&out),
                "--summary",
                s(&summary_dir),
            ],
        ),
        (
            "temperature inf",
            vec![model(), "--prompts", s(&p), "--out", s(&out), "--temperature", "inf"],
        ),
        (
            "temperature nan",
            vec![model(), "--prompts", s(&p), "--out", s(&out), "--temperature", "NaN"],
        ),
        (
            "top-p inf",
            vec![model(), "--prompts", s(&p), "--out", s(&out), "--top-p", "inf"],
        ),
        ("prompts missing", [&[model(), "--prompts"][..], &bad_prompts].concat()),
        (
            "verify dir missing",
            vec![model(), "--prompts", s(&p), "--out", s(&out), "--verify", s(&missing)],
        ),
        ("model missing", vec![s(&missing), "--prompts", s(&p), "--out", s(&out)]),
        (
            "out in a missing dir",
            vec![model(), "--prompts", s(&p), "--out", "/nonexistent-dir/o.jsonl"],
        ),
    ];
    for (what, args) in cases {
        std::fs::write(&out, "KEEP\n").unwrap();
        let o = kdtree_run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{what}: {err}");
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "KEEP\n",
            "{what}: the output was touched"
        );
        assert_eq!(
            err.lines().count(),
            1,
            "{what}: work was done or the error printed twice: {err}"
        );
        assert!(err.starts_with("kdtree-run: error: "), "{what}: {err}");
    }
}

#[test]
fn os_errors_are_printed_once() {
    let dir = scratch("os-error");
    let p = prompts(&dir);
    let missing = dir.join("missing");
    for args in [
        vec![s(&missing), "--prompts", s(&p), "--out", s(&dir.join("o.jsonl"))],
        vec![model(), "--prompts", s(&missing), "--out", s(&dir.join("o.jsonl"))],
    ] {
        let o = kdtree_run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.matches("os error 2").count(), 1, "{err}");
        assert!(err.contains("missing"), "{err}");
    }
}

#[test]
fn a_closed_stderr_loses_messages_not_the_run() {
    let dir = scratch("stderr");
    let p = prompts(&dir);
    let out = dir.join("o.jsonl");
    // stderr is a pipe whose reader is gone before the first progress line.
    let mut child = Command::new(BIN)
        .args([
            model(),
            "--prompts",
            s(&p),
            "--out",
            s(&out),
            "--budget",
            "4",
            "--summary",
            s(&dir.join("s.json")),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert_eq!(records(&out).len(), 3);
    assert!(dir.join("s.json").exists());
    // `2>&1 | head -1` with the records on stdout, and `2>&-` (a closed descriptor).
    for script in [
        format!(
            "set -o pipefail; '{BIN}' '{}' --prompts '{}' --out - --mode ar 2>&1 | head -1 >/dev/null",
            model(),
            s(&p)
        ),
        format!(
            "set -o pipefail; '{BIN}' '{}' --prompts '{}' --out '{}' --mode ar 2>&1 | head -1 >/dev/null",
            model(),
            s(&p),
            s(&out)
        ),
        format!(
            "'{BIN}' '{}' --prompts '{}' --out '{}' --mode ar 2>&-",
            model(),
            s(&p),
            s(&out)
        ),
        format!("'{BIN}' '{}' --prompts '{}' --out - --mode ar >&- 2>&-", model(), s(&p)),
    ] {
        let o = Command::new("bash").args(["-c", &script]).output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{script}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{script}: {}", stderr(&o));
    }
    assert_eq!(records(&out).len(), 3, "the file run to a closed stderr is complete");
}

#[test]
fn non_regular_outputs_work_without_resume() {
    let dir = scratch("devices");
    let p = prompts(&dir);
    let o = kdtree_run(&[
        model(),
        "--prompts",
        s(&p),
        "--out",
        "/dev/null",
        "--mode",
        "ar",
        "--quiet",
        "--summary",
        "/dev/null",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = kdtree_run(&[
        model(),
        "--prompts",
        s(&p),
        "--out",
        "/dev/stdout",
        "--mode",
        "ar",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines: Vec<Json> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines.iter().map(|r| r["id"].as_str().unwrap()).collect::<Vec<_>>(),
        ["q0", "q1", "q2"]
    );
    // --summary - is stdout; --out - and --summary - on one pipe would mix the two.
    let o = kdtree_run(&[
        model(),
        "--prompts",
        s(&p),
        "--out",
        s(&dir.join("o.jsonl")),
        "--mode",
        "ar",
        "--quiet",
        "--summary",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let sum: Json = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(sum["lines"], 3);
    let o = kdtree_run(&[model(), "--prompts", s(&p), "--out", "-", "--summary", "/dev/stdout"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("are the same file"), "{}", stderr(&o));
    for out in ["/dev/null", "/dev/stdout", "-"] {
        let o = kdtree_run(&[model(), "--prompts", s(&p), "--out", out, "--resume"]);
        assert_eq!(o.status.code(), Some(2), "{out}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("--resume needs --out to be a"),
            "{out}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn bad_bytes_colliding_ids_and_non_finite_numbers_are_line_errors() {
    let dir = scratch("lines");
    let p = dir.join("p.jsonl");
    let mut bytes = b"{\"id\":\"a\",\"prompt_token_ids\":[5,6],\"max_tokens\":2}\n".to_vec();
    bytes.extend_from_slice(b"{\"id\":\"b\",\"prompt\":\"caf\xe9\"}\n");
    bytes.extend_from_slice(b"{\"id\":\"line-2\",\"prompt_token_ids\":[7],\"max_tokens\":2}\n");
    bytes.extend_from_slice(b"{\"id\":\"hot\",\"prompt_token_ids\":[7],\"temperature\":1e39}\n");
    std::fs::write(&p, bytes).unwrap();
    let out = dir.join("o.jsonl");
    let o = kdtree_run(&[model(), "--prompts", s(&p), "--out", s(&out), "--mode", "ar", "--quiet"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
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
            ("a", "ok"),
            ("line-2~2", "invalid_utf8"),
            ("line-2", "ok"),
            ("hot", "invalid_request")
        ]
    );
    let msg = recs[1]["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("line 2: not valid UTF-8"), "{msg}");
    assert!(
        recs[3]["error"]["message"].as_str().unwrap().contains("finite"),
        "{}",
        recs[3]
    );
}

#[test]
fn resume_redoes_records_whose_line_or_settings_changed() {
    let dir = scratch("resume");
    let p = dir.join("p.jsonl");
    let line = |i: usize, ids: &str| format!("{{\"id\":\"q{i}\",\"prompt_token_ids\":[{ids}],\"max_tokens\":3}}\n");
    let original: String = (0..4).map(|i| line(i, &format!("{},{}", 10 + i, 20 + i))).collect();
    std::fs::write(&p, &original).unwrap();
    let out = dir.join("o.jsonl");
    let base = [model(), "--prompts", s(&p), "--budget", "4", "--quiet"];
    let o = kdtree_run(&[&base[..], &["--out", s(&out)]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let first = std::fs::read_to_string(&out).unwrap();

    // Line q1 gets another prompt (same id): only it is answered again; the others are copied byte for byte.
    let edited = original.replace(&line(1, "11,21"), &line(1, "11,21,31,41"));
    std::fs::write(&p, &edited).unwrap();
    let o = Command::new(BIN)
        .args(base)
        .args(["--out", s(&out), "--resume"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let resumed = std::fs::read_to_string(&out).unwrap();
    let (a, b): (Vec<&str>, Vec<&str>) = (first.lines().collect(), resumed.lines().collect());
    assert_eq!((a[0], a[2], a[3]), (b[0], b[2], b[3]));
    assert_ne!(a[1], b[1]);
    let fresh = dir.join("fresh.jsonl");
    let o = kdtree_run(&[&base[..], &["--out", s(&fresh)]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(without_timing(&out), without_timing(&fresh));
    assert_eq!(records(&out)[1]["usage"]["prompt_tokens"], 4);

    // A changed run-wide setting: every record is answered again; the file equals a fresh run's.
    for flags in [
        vec!["--mode", "ar"],
        vec!["--temperature", "0.7", "--seed", "3"],
        vec!["--budget", "2"],
    ] {
        let with = |out: &Path, resume: bool| {
            let mut a: Vec<&str> = [model(), "--prompts", s(&p), "--quiet", "--out"].to_vec();
            a.push(s(out));
            a.extend(&flags);
            if resume {
                a.push("--resume");
            }
            kdtree_run(&a)
        };
        let o = with(&out, true);
        assert_eq!(o.status.code(), Some(0), "{flags:?}: {}", stderr(&o));
        let o = with(&fresh, false);
        assert_eq!(o.status.code(), Some(0), "{flags:?}: {}", stderr(&o));
        assert_eq!(without_timing(&out), without_timing(&fresh), "{flags:?}");
    }
    // The message names the first changed line.
    std::fs::write(&p, &original).unwrap();
    let o = kdtree_run(&[
        model(),
        "--prompts",
        s(&p),
        "--out",
        s(&out),
        "--resume",
        "--budget",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("answering them again") && err.contains("(first: line 2, id \"q1\")"),
        "{err}"
    );
}

/// `--check-weights` (issue 24): one byte of a converted model's tensor flipped in place (the shard's size and
/// header untouched, so the load itself succeeds) is found at load: exit 2, the tensor named, no records; the
/// intact copy passes the same check, and with `--no-check-weights` the damaged copy still runs (the check is what
/// finds it; it is on by default since issue 29: tests/load_check.rs).
#[test]
fn check_weights_names_a_damaged_tensor() {
    let dir = scratch("check-weights");
    let src = &models().1;
    let damaged = dir.join("model");
    std::fs::create_dir_all(&damaged).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), damaged.join(e.file_name())).unwrap();
        }
    }
    let md = kdtree_formats::ModelDir::open(&damaged).unwrap();
    let t = md
        .manifest()
        .tensors
        .iter()
        .find(|t| {
            t.name.ends_with("mlp.experts.3.down_proj.weight_packed") || t.name.contains("down_proj.weight_packed")
        })
        .expect("an expert stack")
        .clone();
    drop(md);
    let path = damaged.join(&t.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = (t.offset + t.nbytes / 2) as usize;
    bytes[at] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\":\"a\",\"prompt_token_ids\":[1,2,3],\"max_tokens\":2}\n",
    )
    .unwrap();
    let out = dir.join("o.jsonl");
    let run = |m: &Path, check: bool| {
        let mut a = vec![
            s(m),
            "--prompts",
            s(&prompts),
            "--out",
            s(&out),
            "--device",
            "cpu",
            "--mode",
            "ar",
            "--quiet",
        ];
        a.push(if check { "--check-weights" } else { "--no-check-weights" });
        kdtree_run(&a)
    };
    let o = run(&damaged, true);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&t.name) && stderr(&o).contains("manifest's xxh3"),
        "{}",
        stderr(&o)
    );
    assert!(
        !out.exists() || std::fs::read_to_string(&out).unwrap().is_empty(),
        "no records after a failed check"
    );
    let o = run(src, true);
    assert_eq!(
        o.status.code(),
        Some(0),
        "the intact model passes the check: {}",
        stderr(&o)
    );
    let o = run(&damaged, false);
    assert_eq!(
        o.status.code(),
        Some(0),
        "without the check the damaged bytes load: {}",
        stderr(&o)
    );
}
