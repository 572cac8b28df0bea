//! Two repacks into one OUT (issue 16 item 6): the second fails at once (exit 2), before writing
//! anything, naming the holder's pid; the lock file does not outlive a run, and a stale lock file
//! (its holder died, so the kernel released it) does not block the next run.

mod common;
use common::*;
use kdtree_convert::lock::{lock_out, LOCK_FILE};

#[test]
fn second_repack_into_a_locked_out_names_the_holder() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(&src, &Tiny::default());
    let out = d.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let held = lock_out(&out).unwrap();
    let (code, _, err) = run(&["repack", s(&src), s(&out), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("pid {}", std::process::id())) && err.contains("locked"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, [LOCK_FILE], "the locked-out run wrote into OUT");
    // A second lock from this process is refused too (flock locks are per open file).
    assert!(lock_out(&out).is_err());
    held.release();
    let (code, _, err) = run(&["repack", s(&src), s(&out), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.join(LOCK_FILE).exists(), "lock file left behind");
    assert_eq!(run(&["verify", s(&out), "--quiet"]).0, 0);
}

#[test]
fn stale_lock_file_does_not_block() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(&src, &Tiny::default());
    let out = d.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join(LOCK_FILE), "pid 999999\n").unwrap();
    let (code, _, err) = run(&["repack", s(&src), s(&out), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.join(LOCK_FILE).exists());
}

#[test]
fn concurrent_repacks_one_wins_the_other_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(
        &src,
        &Tiny {
            layers: 6,
            experts: 16,
            hidden: 128,
            ..Tiny::default()
        },
    );
    let out = d.path().join("out");
    let go = |_| {
        bin()
            .args(["repack", s(&src), s(&out), "--ranks", "2", "--quiet"])
            .output()
            .unwrap()
    };
    let outs: Vec<_> = std::thread::scope(|sc| {
        (0..4)
            .map(|i| sc.spawn(move || go(i)))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect()
    });
    for o in &outs {
        let err = String::from_utf8_lossy(&o.stderr);
        match o.status.code() {
            Some(0) => {}
            Some(2) => assert!(err.contains("locked by another kdtree-convert (pid "), "{err}"),
            c => panic!("exit {c:?}: {err}"),
        }
    }
    assert!(outs.iter().any(|o| o.status.success()));
    assert_eq!(run(&["verify", s(&out), "--quiet"]).0, 0);
}
