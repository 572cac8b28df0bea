//! No panic and honest exit codes when stdout or stderr is a closed pipe (issue 16 items 3 and 7):
//! `verify` of a damaged model exits 1 even when the FAILED line cannot be printed; repack, synth and a
//! failing command never die with "failed printing to stderr" (exit 101). Also: a missing manifest or
//! an unparseable manifest.toml / SHA256SUMS is a failed check (exit 1, `FAILED`), like `sha256sum -c`.

mod common;
use common::*;
use std::path::Path;
use std::process::Stdio;

/// Run the binary with stdout and/or stderr a pipe whose reader is already gone; return the exit code.
fn run_closed(args: &[&str], close_out: bool, close_err: bool) -> i32 {
    let pipe_or_null = |closed: bool| if closed { Stdio::piped() } else { Stdio::null() };
    let mut c = bin()
        .args(args)
        .stdout(pipe_or_null(close_out))
        .stderr(pipe_or_null(close_err))
        .spawn()
        .unwrap();
    drop(c.stdout.take());
    drop(c.stderr.take());
    c.wait().unwrap().code().unwrap_or(-1)
}

fn converted(d: &Path) -> std::path::PathBuf {
    write_checkpoint(&d.join("src"), &Tiny::default());
    let out = d.join("out");
    let (code, _, err) = run(&["repack", s(&d.join("src")), s(&out), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    out
}

#[test]
fn verify_exit_code_is_the_verdict_even_with_stdout_closed() {
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    assert_eq!(run_closed(&["verify", s(&out), "--quiet"], true, true), 0);
    let m = kdtree_formats::ModelDir::open(&out).unwrap().manifest().clone();
    let t = &m.tensors[m.tensors.len() / 2];
    let p = out.join(&t.file);
    let mut b = std::fs::read(&p).unwrap();
    b[t.offset as usize] ^= 1;
    std::fs::write(&p, &b).unwrap();
    assert_eq!(run(&["verify", s(&out), "--quiet"]).0, 1);
    assert_eq!(
        run_closed(&["verify", s(&out), "--quiet"], true, false),
        1,
        "closed stdout turned a failed check into success"
    );
    assert_eq!(run_closed(&["verify", s(&out)], true, true), 1);
}

#[test]
fn unparseable_manifest_or_sums_is_a_failed_check() {
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    std::fs::write(out.join("SHA256SUMS"), format!("{sums}not a checksum line\n")).unwrap();
    let (code, stdout, _) = run(&["verify", s(&out), "--quiet"]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAILED: SHA256SUMS: line "), "{stdout}");
    std::fs::write(out.join("SHA256SUMS"), sums).unwrap();
    let mp = out.join("manifest.toml");
    for (body, want) in [
        ("not toml [", "no format_version"),
        ("format_version = 1\nx = [", "invalid manifest"),
        ("format_version = 1\n[[files]]\n", "invalid manifest"),
        ("", "no format_version"),
    ] {
        std::fs::write(&mp, body).unwrap();
        let (code, stdout, stderr) = run(&["verify", s(&out), "--quiet"]);
        assert_eq!(code, 1, "{body:?}: {stdout}{stderr}");
        assert!(
            stdout.starts_with("FAILED: manifest.toml: ") && stdout.contains(want),
            "{body:?}: {stdout}"
        );
    }
    std::fs::remove_file(&mp).unwrap();
    let (code, stdout, _) = run(&["verify", s(&out), "--quiet"]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.starts_with("FAILED: manifest.toml: cannot read"), "{stdout}");
    // Not a directory at all: the check could not run (exit 2).
    let (code, _, stderr) = run(&["verify", s(&d.path().join("nope")), "--quiet"]);
    assert_eq!(code, 2, "{stderr}");
}

#[test]
fn closed_stderr_never_panics() {
    let d = tempfile::tempdir().unwrap();
    write_checkpoint(&d.path().join("src"), &Tiny::default());
    let out = d.path().join("out");
    // Not quiet: the summary line (and progress) go to the closed stderr.
    assert_eq!(
        run_closed(
            &["repack", s(&d.path().join("src")), s(&out), "--ranks", "2"],
            false,
            true
        ),
        0
    );
    assert_eq!(
        run_closed(
            &["repack", s(&d.path().join("src")), s(&out), "--ranks", "2"],
            true,
            true
        ),
        0,
        "already-complete notice"
    );
    assert_eq!(run_closed(&["verify", s(&out)], true, true), 0);
    assert_eq!(run_closed(&["inspect", s(&out)], true, true), 0);
    assert_eq!(run_closed(&["synth", "tiny", s(&d.path().join("syn"))], true, true), 0);
    // An error with nowhere to print it still exits 2, not 101.
    assert_eq!(
        run_closed(
            &["repack", s(&d.path().join("missing")), s(&d.path().join("o2"))],
            true,
            true
        ),
        2
    );
    assert_eq!(run_closed(&["inspect", s(&d.path().join("missing"))], true, true), 2);
}
