//! kdtree-run under attack, round two (issue 29): two runs on one --out (the second, a real process started
//! while the first holds the lock, exits 2 naming the holder's pid, `--resume` included), every size a flag or
//! a line can ask for bounded before anything is allocated, capped reads (`--prompts /dev/zero`, a cost file
//! that is a symlink to /dev/zero), chat content of the wrong type, and the messages a user reads (no Rust debug
//! values, the value as given, no "0.0 tok/s", progress counted in written lines, a BOM named as such). The
//! tiny synthetic model with its drafter, one rank.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value as Json;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

fn root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-limits")
}

fn model() -> &'static str {
    static M: OnceLock<PathBuf> = OnceLock::new();
    M.get_or_init(|| {
        let _ = std::fs::remove_dir_all(root().join("models"));
        common::convert_tiny(&root().join("models"), 0)
    })
    .to_str()
    .unwrap()
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

fn run(args: &[&str]) -> Output {
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

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const THREE: &str = concat!(
    r#"{"id":"a1","prompt_token_ids":[10,20,30],"max_tokens":3}"#,
    "\n",
    r#"{"id":"a2","prompt_token_ids":[11,21,31],"max_tokens":3}"#,
    "\n",
    r#"{"id":"a3","prompt_token_ids":[12,22,32],"max_tokens":3}"#,
    "\n",
);

/// A FIFO: a run reading its prompts from it holds its --out lock until the test writes the prompts.
fn fifo(path: &Path) {
    let c = std::ffi::CString::new(s(path)).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

#[test]
fn two_runs_on_one_out_the_second_exits_2_naming_the_holder() {
    let dir = scratch("lock");
    let plain = write(&dir, "p.jsonl", THREE);
    let out = dir.join("o.jsonl");
    // A finished run's output, which a second writer must leave alone.
    let o = run(&[
        model(),
        "--prompts",
        s(&plain),
        "--out",
        s(&out),
        "--mode",
        "ar",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let before = std::fs::read(&out).unwrap();
    assert!(!dir.join("o.jsonl.lock").exists(), "the lock file outlived the run");
    let pipe = dir.join("p.fifo");
    fifo(&pipe);
    let first = Command::new(BIN)
        .args([
            model(),
            "--prompts",
            s(&pipe),
            "--out",
            s(&out),
            "--mode",
            "ar",
            "--resume",
            "--quiet",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lock = dir.join("o.jsonl.lock");
    let t = Instant::now();
    while std::fs::read_to_string(&lock).map_or(true, |l| !l.ends_with('\n')) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the first run never took the lock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = format!("pid {}", first.id());
    assert_eq!(std::fs::read_to_string(&lock).unwrap().trim(), pid);
    std::os::unix::fs::symlink(&out, dir.join("link.jsonl")).unwrap();
    let link = dir.join("link.jsonl");
    for (o_path, extra) in [(&out, None), (&out, Some("--resume")), (&link, None)] {
        let mut args = vec![model(), "--prompts", s(&plain), "--out", s(o_path), "--mode", "ar"];
        args.extend(extra);
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(&pid) && err.contains("locked"), "{extra:?}: {err}");
        assert_eq!(err.matches("error").count(), 1, "{err}");
        assert_eq!(std::fs::read(&out).unwrap(), before, "the refused run touched --out");
    }
    // The first run goes on once its prompts arrive, and keeps every record.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pipe)
        .unwrap()
        .write_all(THREE.as_bytes())
        .unwrap();
    let o = first.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(std::fs::read(&out).unwrap(), before);
    assert!(!lock.exists(), "the lock file outlived the run");
    // A stale lock file (its holder killed: the kernel dropped the flock) does not block.
    std::fs::write(&lock, "pid 999999\n").unwrap();
    let o = run(&[
        model(),
        "--prompts",
        s(&plain),
        "--out",
        s(&out),
        "--mode",
        "ar",
        "--resume",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn every_size_a_flag_asks_for_is_bounded() {
    let dir = scratch("flags");
    let p = write(&dir, "p.jsonl", THREE);
    let out = dir.join("o.jsonl");
    let base = [model(), "--prompts", s(&p), "--out", s(&out)];
    for (flags, want) in [
        (vec!["--budget", "100000"], "1 to 2048"),
        (vec!["--budget", "18446744073709551615"], "1 to 2048"),
        (vec!["--budget", "0"], "1 to 2048"),
        (vec!["--budget", "99999999999999999999999"], "1 to 2048"),
        (vec!["--budget-max", "4096"], "1..=2048"),
        (vec!["--max-tokens", "1048577"], "1..=1048576"),
        (vec!["--top-k", "1048577"], "0..=1048576"),
        (vec!["--max-batch", "1025"], "1..=1024"),
        (vec!["--gpus", "65"], "1..=64"),
        (vec!["--load-format", "dummy", "--ranks", "100000"], "1..=1024"),
    ] {
        let t = Instant::now();
        let o = run(&[&base[..], &flags].concat());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(
            err.contains(flags[flags.len() - 2]) && err.contains(want),
            "{flags:?}: {err}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{flags:?} took {:?}",
            t.elapsed()
        );
        assert!(!out.exists(), "{flags:?} wrote --out");
    }
    for (flags, want) in [
        (vec!["--warmup", "1001"], "0 to 1000"),
        (vec!["--rounds", "1001"], "1..=1000"),
    ] {
        let o = run(&[&["calibrate", model()][..], &flags].concat());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
    // The largest budget still runs.
    let o = run(&[&base[..], &["--budget", "2048", "--max-tokens", "2", "--quiet"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn every_size_a_line_asks_for_is_bounded() {
    let dir = scratch("lines");
    let stops = (0..65).map(|i| format!("\"s{i}\"")).collect::<Vec<_>>().join(",");
    let text = [
        r#"{"id":"m","prompt_token_ids":[1,2],"max_tokens":1048577}"#.to_string(),
        r#"{"id":"k","prompt_token_ids":[1,2],"top_k":18446744073709551615}"#.to_string(),
        format!(r#"{{"id":"s","prompt_token_ids":[1,2],"stop":[{stops}]}}"#),
        concat!(
            r#"{"custom_id":"o","method":"POST","url":"/v1/chat/completions","#,
            r#""body":{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":1048577}}"#
        )
        .to_string(),
        r#"{"id":"ok","prompt_token_ids":[1,2],"max_tokens":2,"top_k":1048576,"temperature":1}"#.to_string(),
    ]
    .join("\n");
    let p = write(&dir, "p.jsonl", &text);
    let out = dir.join("o.jsonl");
    let o = run(&[model(), "--prompts", s(&p), "--out", s(&out), "--mode", "ar", "--quiet"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let recs = records(&out);
    let msg = |i: usize| recs[i]["error"]["message"].as_str().unwrap_or("").to_string();
    assert!(
        msg(0).contains("\"max_tokens\" is 1048577; at most 1048576"),
        "{}",
        msg(0)
    );
    assert!(
        msg(1).contains("\"top_k\" is 18446744073709551615; at most 1048576"),
        "{}",
        msg(1)
    );
    assert!(msg(2).contains("\"stop\" has 65 strings; at most 64"), "{}", msg(2));
    let body = &recs[3]["response"]["body"]["error"]["message"];
    assert!(
        body.as_str()
            .unwrap_or("")
            .contains("\"body.max_completion_tokens\" is 1048577"),
        "{}",
        recs[3]
    );
    // The largest accepted top_k runs.
    assert_eq!(recs[4]["status"], "ok", "{}", recs[4]);
}

#[test]
fn endless_inputs_fail_fast_naming_the_limit() {
    let dir = scratch("endless");
    let out = dir.join("o.jsonl");
    let t = Instant::now();
    let o = run(&[model(), "--prompts", "/dev/zero", "--out", s(&out)]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("/dev/zero") && err.contains("line 1 is longer than 16 MiB, the limit of a prompt line"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // A file with many short lines over the file limit is refused before reading.
    let big = dir.join("big.jsonl");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len((256 << 20) + 1).unwrap();
    let o = run(&[model(), "--prompts", s(&big), "--out", s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("at most 256 MiB"), "{}", stderr(&o));
    std::fs::remove_file(&big).unwrap();
    // --budget auto with a cost file that is a symlink to /dev/zero: an error, not a hang.
    let m = dir.join("model");
    std::fs::create_dir(&m).unwrap();
    for e in std::fs::read_dir(model()).unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(e.path(), m.join(e.file_name())).unwrap();
    }
    std::os::unix::fs::symlink("/dev/zero", m.join("kdtree-cost-cpu.json")).unwrap();
    let p = write(&dir, "p.jsonl", THREE);
    let t = Instant::now();
    let o = run(&[
        s(&m),
        "--prompts",
        s(&p),
        "--out",
        s(&out),
        "--budget",
        "auto",
        "--device",
        "cpu",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("kdtree-cost-cpu.json") && err.contains("the limit is 1 MiB"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

#[test]
fn chat_content_of_another_type_and_media_parts_are_line_errors() {
    let dir = scratch("chat");
    let text = [
        r#"{"id":"n","messages":[{"role":"user","content":5}]}"#,
        r#"{"id":"o","messages":[{"role":"user","content":{"text":"hi"}}]}"#,
        concat!(
            r#"{"id":"i","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},"#,
            r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#
        ),
        concat!(
            r#"{"custom_id":"b","method":"POST","url":"/v1/chat/completions","#,
            r#""body":{"messages":[{"role":"user","content":true}]}}"#
        ),
        r#"{"id":"ok","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":2}"#,
    ]
    .join("\n");
    let p = write(&dir, "p.jsonl", &text);
    let out = dir.join("o.jsonl");
    let o = run(&[model(), "--prompts", s(&p), "--out", s(&out), "--mode", "ar", "--quiet"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let recs = records(&out);
    let msg = |r: &Json| {
        r.pointer("/error/message")
            .or(r.pointer("/response/body/error/message"))
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_string()
    };
    assert_eq!(
        msg(&recs[0]),
        "line 1: messages[0].content must be a string or a list of text parts, found the number 5"
    );
    assert!(msg(&recs[1]).contains("found an object"), "{}", msg(&recs[1]));
    assert!(
        msg(&recs[2]).starts_with("line 3: messages[0].content[1] is an \"image_url\" part: only text parts"),
        "{}",
        msg(&recs[2])
    );
    assert!(
        msg(&recs[3]).contains("body.messages[0].content must be a string"),
        "{}",
        msg(&recs[3])
    );
    assert_eq!(recs[4]["status"], "ok", "{}", recs[4]);
}

#[test]
fn messages_show_values_as_given_and_no_debug_formatting() {
    let dir = scratch("messages");
    let p = write(&dir, "p.jsonl", THREE);
    let out = dir.join("o.jsonl");
    let base = [model(), "--prompts", s(&p), "--out", s(&out)];
    // The value as given, not the f32 it rounds to.
    for (flag, value) in [("--temperature", "1e308"), ("--top-p", "1e39")] {
        let o = run(&[&base[..], &[flag, value]].concat());
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("got {value}")) && err.contains("finite number") && !err.contains("got inf"),
            "{err}"
        );
    }
    let line = write(&dir, "t.jsonl", r#"{"id":"t","prompt":"x","temperature":1e308}"#);
    let o = run(&[model(), "--prompts", s(&line), "--out", s(&out), "--quiet"]);
    assert_eq!(o.status.code(), Some(1));
    let m = records(&out)[0]["error"]["message"].as_str().unwrap().to_string();
    assert!(m.contains("got 1e+308") && !m.contains("inf"), "{m}");
    // No drafter: the mode as typed.
    let nodraft = common::convert_tiny_with(&root().join("models"), 0, false);
    let o = run(&[s(&nodraft), "--prompts", s(&p), "--out", s(&out), "--budget", "64"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--mode ddtree needs one") && !err.contains("DDTree {"),
        "{err}"
    );
    // --resume over another file's output: ids quoted, no Some(..).
    let o = run(&[&base[..], &["--mode", "ar", "--quiet"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let other = write(&dir, "other.jsonl", &THREE.replace("a1", "b1"));
    let o = run(&[
        model(),
        "--prompts",
        s(&other),
        "--out",
        s(&out),
        "--mode",
        "ar",
        "--resume",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(r#"answers id "a1" but the prompt file's request 1 is id "b1""#),
        "{err}"
    );
    assert!(!err.contains("Some("), "{err}");
    // Rank groups on CPU threads, described in words.
    let o = run(&[
        &base[..],
        &["--mode", "ar", "--gpus", "1", "--share-gpu", "--device", "cpu"],
    ]
    .concat());
    let err = stderr(&o);
    assert!(!err.contains("Cpu") && !err.contains("SharedGpu"), "{err}");
    // A UTF-8 byte order mark on line 1 is named.
    let bom = write(&dir, "bom.jsonl", &format!("\u{feff}{THREE}"));
    let o = run(&[
        model(),
        "--prompts",
        s(&bom),
        "--out",
        s(&out),
        "--mode",
        "ar",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let r = &records(&out)[0];
    let m = r["error"]["message"].as_str().unwrap();
    assert!(m.starts_with("line 1: starts with a UTF-8 byte order mark (BOM"), "{m}");
}

#[test]
fn progress_counts_written_lines_and_a_one_token_line_has_no_rate() {
    let dir = scratch("progress");
    // Line 1 decodes longest: under --max-batch 3 lines 2 and 3 finish first but are written after it.
    let text = concat!(
        r#"{"id":"long","prompt_token_ids":[10,20,30],"max_tokens":12}"#,
        "\n",
        r#"{"id":"one","prompt_token_ids":[11,21,31],"max_tokens":1}"#,
        "\n",
        r#"{"id":"two","prompt_token_ids":[12,22,32],"max_tokens":2}"#,
        "\n",
    );
    let p = write(&dir, "p.jsonl", text);
    let out = dir.join("o.jsonl");
    let o = run(&[
        model(),
        "--prompts",
        s(&p),
        "--out",
        s(&out),
        "--mode",
        "ar",
        "--max-batch",
        "3",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let progress: Vec<&str> = err.lines().filter(|l| l.contains("] ")).collect();
    assert_eq!(progress.len(), 3, "{err}");
    for (i, id) in ["long", "one", "two"].iter().enumerate() {
        assert!(
            progress[i].starts_with(&format!("kdtree-run: [{}/3] {id}: ", i + 1)),
            "{err}"
        );
    }
    assert!(
        progress[1].contains(": 1 token (") && progress[1].ends_with("decode n/a (one token, from the prefill)"),
        "{err}"
    );
    assert!(!err.contains(" 0.0 tok/s"), "{err}");
}

#[test]
fn an_out_inside_the_model_directory_is_treated_alike_in_both_load_formats() {
    let dir = scratch("inside");
    let m = dir.join("model");
    std::fs::create_dir(&m).unwrap();
    for e in std::fs::read_dir(model()).unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(e.path(), m.join(e.file_name())).unwrap();
    }
    let cfg = dir.join("cfg");
    kdtree_convert::synth::write_configs("tiny", &cfg, true, None).unwrap();
    let p = write(&dir, "p.jsonl", THREE);
    let dummy = ["--load-format", "dummy", "--device", "cpu"];
    for (m, extra, input) in [(&m, &[][..], "manifest.toml"), (&cfg, &dummy[..], "config.json")] {
        let out = m.join("out.jsonl");
        // A first run, a second over its output, and a --resume of it (dummy weights refuse --resume).
        let resume = extra.is_empty().then_some("--resume");
        for again in [None, None, resume] {
            let mut args = vec![s(m), "--prompts", s(&p), "--out", s(&out), "--mode", "ar", "--quiet"];
            args.extend(extra);
            args.extend(again);
            let o = run(&args);
            assert_eq!(o.status.code(), Some(0), "{extra:?} {again:?}: {}", stderr(&o));
        }
        assert_eq!(records(&out).len(), 3);
        // A file of the model is still refused.
        let mut args = vec![s(m), "--prompts", s(&p), "--mode", "ar", "--out"];
        let input = m.join(input);
        args.push(s(&input));
        args.extend(extra);
        let o = run(&args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("refusing to write over an input"), "{}", stderr(&o));
    }
}
