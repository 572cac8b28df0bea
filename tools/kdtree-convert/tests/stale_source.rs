//! A changed source is never taken for the converted one (issue 16 item 4): after a source shard's bytes
//! change (same size), re-running repack does not say "already complete" but converts again, with a
//! notice naming the file, and ends byte-identical to a fresh conversion of the new source; after a
//! kill -9, a resumed run over a changed source rewrites every shard (no mix of old and new); and
//! `verify --source` tells that the source changed since the conversion.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn args(src: &Path, out: &Path) -> Vec<String> {
    [
        "repack",
        s(src),
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
}

/// Flip one byte in the data of the first source shard, keeping its size (and inode: written in place).
fn change_source(src: &Path) -> PathBuf {
    let p = src.join("model-00001-of-000003.safetensors");
    let mut b = std::fs::read(&p).unwrap();
    let at = b.len() - 10;
    b[at] ^= 0xFF;
    std::thread::sleep(Duration::from_millis(20)); // a visibly later mtime, even on coarse clocks
    std::fs::write(&p, &b).unwrap();
    p
}

/// Everything in OUT but the stamp (which names the source paths, different between two sources).
fn content(out: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    let mut m = snapshot(out);
    m.retain(|k, _| k != Path::new(kdtree_convert::stamp::STAMP_FILE));
    m
}

#[test]
fn changed_source_is_converted_again_not_already_complete() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(&src, &Tiny::default());
    let out = d.path().join("out");
    assert!(bin().args(args(&src, &out)).status().unwrap().success());
    let before = content(&out);
    assert_eq!(run(&["verify", s(&out), "--source", "--quiet"]).0, 0);
    let changed = change_source(&src);
    let (code, stdout, _) = run(&["verify", s(&out), "--source", "--quiet"]);
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("source changed since the conversion") && stdout.contains(s(&changed)),
        "{stdout}"
    );
    assert_eq!(
        run(&["verify", s(&out), "--quiet"]).0,
        0,
        "without --source the output itself is intact"
    );
    let o = bin().args(args(&src, &out)).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        !err.contains("already complete") && err.contains("SRC changed") && err.contains(s(&changed)),
        "{err}"
    );
    assert_ne!(content(&out), before, "stale output kept");
    // Same bytes as a fresh conversion of the changed source.
    let fresh = d.path().join("fresh");
    assert!(bin().args(args(&src, &fresh)).status().unwrap().success());
    assert_eq!(content(&out), content(&fresh));
    assert_eq!(run(&["verify", s(&out), "--source", "--quiet"]).0, 0);
}

#[test]
fn resume_after_kill_over_a_changed_source_rewrites_every_shard() {
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
    let out = d.path().join("out");
    let records = || std::fs::read_dir(out.join(".kdtree-convert")).map_or(0, |d| d.count());
    let mut child = bin().args(args(&src, &out)).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while records() < 3 && child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(500));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        records() >= 3 && !out.join("manifest.toml").exists(),
        "the kill did not land mid-run ({} records)",
        records()
    );
    let changed = change_source(&src);
    let o = bin().args(args(&src, &out)).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("SRC changed") && err.contains(s(&changed)), "{err}");
    let fresh = d.path().join("fresh");
    assert!(bin().args(args(&src, &fresh)).status().unwrap().success());
    assert_eq!(
        content(&out),
        content(&fresh),
        "resumed output mixes shards of the old source"
    );
}

/// Change one byte of `p` in place (same size, same inode) and put its mtime back, as `touch -r` would.
fn change_keeping_mtime(p: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;
    let before = std::fs::metadata(p).unwrap();
    let mtime = before.modified().unwrap();
    let mut b = std::fs::read(p).unwrap();
    let at = b.len() - 10;
    b[at] ^= 0xFF;
    let mut f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.write_all(&b[at..at + 1]).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    let after = std::fs::metadata(p).unwrap();
    assert_eq!(
        (after.len(), after.modified().unwrap(), after.ino()),
        (before.len(), mtime, before.ino()),
        "size, mtime and inode must look unchanged"
    );
}

/// What the fast check trusts (issue 29 item 7): a source byte changed in place with its mtime put back passes
/// `verify --source` (size, mtime and inode unchanged, as README says), while `--deep` re-hashes the source and
/// finds it: exit 1 naming the file.
#[test]
fn deep_finds_a_change_that_keeps_the_mtime() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(&src, &Tiny::default());
    let out = d.path().join("out");
    assert!(bin().args(args(&src, &out)).status().unwrap().success());
    let (code, stdout, err) = run(&["verify", s(&out), "--source", "--deep", "--quiet"]);
    assert_eq!(code, 0, "{stdout}{err}");
    let p = src.join("model-00001-of-000003.safetensors");
    change_keeping_mtime(&p);
    let (code, stdout, _) = run(&["verify", s(&out), "--source", "--quiet"]);
    assert_eq!(code, 0, "the fast check trusts size, mtime and inode: {stdout}");
    let (code, stdout, err) = run(&["verify", s(&out), "--source", "--deep", "--quiet"]);
    assert_eq!(code, 1, "{stdout}{err}");
    assert!(
        stdout.contains("source changed since the conversion")
            && stdout.contains(&format!("{}: content differs", s(&p))),
        "{stdout}"
    );
    let (code, _, err) = run(&["verify", s(&out), "--deep", "--quiet"]);
    assert_eq!(code, 2, "--deep without --source: {err}");
}

/// A stamp without content hashes (a conversion by an older kdtree-convert): `--deep` is an error saying it
/// needs a newer conversion (the fast check still runs); re-running the same repack records the hashes.
#[test]
fn deep_needs_a_stamp_with_content_hashes() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    write_checkpoint(&src, &Tiny::default());
    let out = d.path().join("out");
    assert!(bin().args(args(&src, &out)).status().unwrap().success());
    let stamp = out.join(kdtree_convert::stamp::STAMP_FILE);
    let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(&stamp).unwrap()).unwrap();
    for f in j["files"].as_array_mut().unwrap() {
        assert!(
            f.as_object_mut().unwrap().remove("xxh3").is_some(),
            "no content hash recorded"
        );
    }
    std::fs::write(&stamp, serde_json::to_vec_pretty(&j).unwrap()).unwrap();
    assert_eq!(run(&["verify", s(&out), "--source", "--quiet"]).0, 0);
    let (code, stdout, err) = run(&["verify", s(&out), "--source", "--deep", "--quiet"]);
    assert_eq!(code, 2, "{stdout}{err}");
    assert!(
        err.contains("records no content hashes") && err.contains("older kdtree-convert"),
        "{err}"
    );
    let o = bin().args(args(&src, &out)).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("recorded the content hashes"),
        "{err}"
    );
    let (code, stdout, err) = run(&["verify", s(&out), "--source", "--deep", "--quiet"]);
    assert_eq!(code, 0, "{stdout}{err}");
}
