//! Error and notice wording (issue 16 item 13): an OS error is printed once, not once per layer of the
//! chain; synth on a full disk names the file it could not write; repack without --drafter says that
//! SRC's drafter/ folder is not converted and how to include it.

mod common;
use common::*;
use std::process::Command;

#[test]
fn os_errors_are_printed_once() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("missing");
    std::fs::create_dir_all(d.path().join("empty")).unwrap();
    for args in [
        vec!["inspect", s(&d.path().join("empty"))],
        vec!["repack", s(&missing), s(&d.path().join("o"))],
        vec!["repack", s(&d.path().join("empty")), s(&d.path().join("o"))],
    ] {
        let (code, _, err) = run(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.matches("os error 2").count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn synth_on_a_full_disk_names_the_file() {
    // RLIMIT_FSIZE stands in for a full disk: each write past it fails (EFBIG; SIGXFSZ ignored).
    let d = tempfile::tempdir().unwrap();
    for kib in [1, 4, 64, 512] {
        let out = d.path().join(format!("syn{kib}"));
        let o = Command::new("bash")
            .args([
                "-c",
                &format!("trap '' XFSZ; ulimit -f {kib}; exec \"$0\" synth tiny \"$1\" --quiet"),
                env!("CARGO_BIN_EXE_kdtree-convert"),
                s(&out),
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "limit {kib} KiB: {err}");
        assert!(
            err.contains(s(&out)) && err.contains("File too large"),
            "limit {kib} KiB: the error names no file: {err}"
        );
    }
}

#[test]
fn repack_says_an_inner_drafter_is_ignored() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    let (code, _, err) = run(&["synth", "tiny", s(&src), "--drafter", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["repack", s(&src), s(&d.path().join("out")), "--ranks", "1", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let want = format!("--drafter {}", src.join("drafter").display());
    assert!(
        err.contains("not converted without --drafter") && err.contains(&want),
        "{err}"
    );
    let (code, _, err) = run(&[
        "repack",
        s(&src),
        s(&d.path().join("out2")),
        "--ranks",
        "1",
        "--drafter",
        s(&src.join("drafter")),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("notice"), "{err}");
}

#[test]
fn progress_goes_to_a_non_terminal_stderr_as_plain_lines() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(&src, &Tiny::default());
    // stderr is a pipe here, not a terminal: without plain lines a long run would print nothing.
    let (code, _, err) = run(&["repack", s(&src), s(&d.path().join("out")), "--ranks", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("repack: ") && l.contains(" in ") && l.ends_with("/s")),
        "{err}"
    );
    let (code, _, err) = run(&["repack", s(&src), s(&d.path().join("out2")), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err, "", "--quiet prints nothing");
}

#[test]
fn free_space_is_checked_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    kdtree_convert::repack::check_free_space(d.path(), 1).unwrap();
    let e = kdtree_convert::repack::check_free_space(d.path(), u64::MAX / 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not enough free space") && e.contains(&(u64::MAX / 2).to_string()) && e.contains("free"),
        "{e}"
    );
}
