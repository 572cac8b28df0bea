//! The tokenizer / chat-template files repack carries from SRC (`manifest::AUX_FILES`): byte-identical in
//! OUT, listed in manifest.toml `[[aux_files]]` and SHA256SUMS (`sha256sum -c --strict` passes), loadable by
//! kdtree-text from OUT alone; verify names a tampered, truncated or missing one (exit 1) and does not call
//! them extra; absent optional files are not carried, symlinks (HF cache) are followed, dangling ones refused;
//! an interrupted or stale carried file is recopied, and a changed SRC file is picked up on re-run.

mod common;
use common::*;
use kdtree_convert::synth;
use kdtree_formats::manifest::{parse_sha256sums, Manifest, AUX_FILES};
use sha2::{Digest, Sha256};
use std::path::Path;

fn repack(src: &Path, out: &Path) -> (i32, String) {
    let (code, stdout, stderr) = run(&["repack", s(src), s(out), "--ranks", "2", "--quiet"]);
    (code, format!("{stdout}{stderr}"))
}

fn verify(out: &Path) -> (i32, String) {
    let (code, stdout, stderr) = run(&["verify", s(out), "--quiet"]);
    (code, format!("{stdout}{stderr}"))
}

fn manifest(out: &Path) -> Manifest {
    Manifest::parse(
        "manifest.toml",
        &std::fs::read_to_string(out.join("manifest.toml")).unwrap(),
    )
    .unwrap()
}

fn sha256sum_strict(out: &Path) -> bool {
    use std::process::{Command, Stdio};
    let st = Command::new("sha256sum")
        .args(["-c", "--strict", "--status", "SHA256SUMS"])
        .current_dir(out)
        .stdout(Stdio::null())
        .status();
    st.unwrap().success()
}

fn shard_inodes(dir: &Path) -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut v: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_str().unwrap().ends_with(".safetensors"))
        .map(|e| (e.file_name().to_str().unwrap().to_string(), e.metadata().unwrap().ino()))
        .collect();
    v.sort();
    v
}

/// OUT holds exactly `names` among the carried files, each byte-identical to SRC, listed (in AUX_FILES
/// order, with size and sha256) in the manifest and in SHA256SUMS.
fn assert_carried(src: &Path, out: &Path, names: &[&str]) {
    let m = manifest(out);
    let listed: Vec<&str> = m.aux_files.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(listed, names);
    let sums: std::collections::HashMap<String, String> =
        parse_sha256sums("SHA256SUMS", &std::fs::read_to_string(out.join("SHA256SUMS")).unwrap())
            .unwrap()
            .into_iter()
            .collect();
    for a in &m.aux_files {
        let want = std::fs::read(src.join(&a.name)).unwrap();
        let p = out.join(&a.name);
        assert!(
            std::fs::symlink_metadata(&p).unwrap().file_type().is_file(),
            "{} is not a regular file in OUT",
            a.name
        );
        assert!(std::fs::read(&p).unwrap() == want, "{} differs from SRC", a.name);
        assert_eq!(
            (a.size, a.sha256.as_str()),
            (want.len() as u64, hex::encode(Sha256::digest(&want)).as_str()),
            "{}",
            a.name
        );
        assert_eq!(sums.get(&a.name), Some(&a.sha256), "{} not in SHA256SUMS", a.name);
    }
    for n in AUX_FILES.iter().filter(|n| !names.contains(n)) {
        assert!(!out.join(n).exists(), "{n} carried but not expected");
        assert!(!sums.contains_key(*n));
    }
    assert!(sha256sum_strict(out), "sha256sum -c --strict failed");
    let (code, msg) = verify(out);
    assert_eq!(code, 0, "{msg}");
}

#[test]
fn synth_tiny_repack_carries_tokenizer_files_and_verify_guards_them() {
    let d = tempfile::tempdir().unwrap();
    let (src, out) = (d.path().join("hf"), d.path().join("out"));
    synth::write("tiny", &src, 0, false, None).unwrap();
    let (code, msg) = repack(&src, &out);
    assert_eq!(code, 0, "{msg}");
    // synth writes all four, like the real K2.6 snapshot.
    assert_carried(&src, &out, &AUX_FILES);
    let (_, msg) = verify(&out);
    assert!(msg.starts_with("OK:"), "{msg}");
    // The converted dir alone is enough for the text side.
    let tok = kdtree_text::Tokenizer::from_dir(&out).unwrap();
    let src_tok = kdtree_text::Tokenizer::from_dir(&src).unwrap();
    assert_eq!(tok.encode("hello kdtree"), src_tok.encode("hello kdtree"));
    kdtree_text::ChatTemplate::from_dir(&out).unwrap();
    // The model itself still opens, and a re-run on the complete OUT changes nothing.
    kdtree_formats::ModelDir::open(&out).unwrap();
    let before = snapshot(&out);
    assert_eq!(repack(&src, &out).0, 0);
    assert_eq!(snapshot(&out), before);

    // Tampering with tiktoken.model (same size) is named; exit 1.
    let tk = out.join("tiktoken.model");
    let orig = std::fs::read(&tk).unwrap();
    let mut bad = orig.clone();
    bad[orig.len() / 2] ^= 0x01;
    std::fs::write(&tk, &bad).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.contains("tiktoken.model: sha256") && msg.contains("manifest says"),
        "{msg}"
    );
    assert!(!sha256sum_strict(&out));
    // Truncated: named with its size.
    std::fs::write(&tk, &orig[..orig.len() - 1]).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains("tiktoken.model: size"), "{msg}");
    std::fs::write(&tk, &orig).unwrap();
    assert_eq!(verify(&out).0, 0);
    // Missing: named; exit 1.
    let tc = out.join("tokenizer_config.json");
    let tc_bytes = std::fs::read(&tc).unwrap();
    std::fs::remove_file(&tc).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains("tokenizer_config.json: missing"), "{msg}");
    std::fs::write(&tc, &tc_bytes).unwrap();
    assert_eq!(verify(&out).0, 0);
    // A tokenizer file the manifest does not list is an extra file like any other.
    let gc = out.join("generation_config.json");
    let mp = out.join("manifest.toml");
    let mut m = manifest(&out);
    m.aux_files.retain(|a| a.name != "generation_config.json");
    let text = m.to_toml().unwrap();
    std::fs::write(&mp, &text).unwrap();
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    let sums: String = sums
        .lines()
        .filter(|l| !l.ends_with("  generation_config.json"))
        .map(|l| {
            if l.ends_with("  manifest.toml") {
                format!("{}  manifest.toml\n", hex::encode(Sha256::digest(text.as_bytes())))
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(out.join("SHA256SUMS"), sums).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains("generation_config.json: extra file"), "{msg}");
    std::fs::remove_file(&gc).unwrap();
    assert_eq!(verify(&out).0, 0, "a manifest without generation_config.json verifies");
}

#[test]
fn missing_optional_files_are_skipped_and_symlinks_followed() {
    let d = tempfile::tempdir().unwrap();
    let (src, out) = (d.path().join("hf"), d.path().join("out"));
    synth::write("tiny", &src, 0, false, None).unwrap();
    // No tiktoken.model (token-id prompts still work) and no generation_config.json.
    std::fs::remove_file(src.join("tiktoken.model")).unwrap();
    std::fs::remove_file(src.join("generation_config.json")).unwrap();
    // chat_template.jinja as in a Hugging Face cache snapshot: a symlink into a blobs dir outside SRC.
    let blobs = d.path().join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::rename(src.join("chat_template.jinja"), blobs.join("3f2a")).unwrap();
    std::os::unix::fs::symlink(blobs.join("3f2a"), src.join("chat_template.jinja")).unwrap();
    let (code, msg) = repack(&src, &out);
    assert_eq!(code, 0, "{msg}");
    assert_carried(&src, &out, &["tokenizer_config.json", "chat_template.jinja"]);

    // A dangling symlink is refused (exit 2, named), before OUT is created.
    std::os::unix::fs::symlink(d.path().join("nowhere"), src.join("tiktoken.model")).unwrap();
    let out2 = d.path().join("out2");
    let (code, msg) = repack(&src, &out2);
    assert_eq!(code, 2, "{msg}");
    assert!(msg.contains("tiktoken.model"), "{msg}");
    assert!(!out2.exists());
    std::fs::remove_file(src.join("tiktoken.model")).unwrap();

    // A checkpoint without any of them converts as before: no [[aux_files]] section.
    let keep = d.path().join("keep");
    std::fs::create_dir_all(&keep).unwrap();
    for n in ["tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(src.join(n), keep.join(n)).unwrap();
        std::fs::remove_file(src.join(n)).unwrap();
    }
    let out3 = d.path().join("out3");
    let (code, msg) = repack(&src, &out3);
    assert_eq!(code, 0, "{msg}");
    assert!(!std::fs::read_to_string(out3.join("manifest.toml"))
        .unwrap()
        .contains("aux_files"));
    assert_carried(&src, &out3, &[]);
    // Tokenizer files added to SRC later (or an OUT converted before they were carried): re-running the
    // same command carries them and keeps the complete shards as they are (same inodes).
    let before = shard_inodes(&out3);
    for n in ["tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(keep.join(n), src.join(n)).unwrap();
    }
    let (code, msg) = repack(&src, &out3);
    assert_eq!(code, 0, "{msg}");
    assert_carried(&src, &out3, &["tokenizer_config.json", "chat_template.jinja"]);
    assert_eq!(shard_inodes(&out3), before, "shards were rewritten");
}

#[test]
fn interrupted_or_changed_carried_files_are_recopied() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("hf");
    synth::write("tiny", &src, 0, false, None).unwrap();
    let reference = d.path().join("ref");
    assert_eq!(repack(&src, &reference).0, 0);
    let want = snapshot(&reference);

    // An interrupted state: shards done, manifest and sums not yet written, a stale partial copy, a carried
    // file with wrong bytes of the right size and no completion record, another one not copied yet.
    let out = d.path().join("out");
    std::fs::create_dir_all(out.join(".kdtree-convert")).unwrap();
    for (k, v) in &want {
        std::fs::write(out.join(k), v).unwrap();
    }
    std::fs::remove_file(out.join("manifest.toml")).unwrap();
    std::fs::remove_file(out.join("SHA256SUMS")).unwrap();
    std::fs::write(out.join("tiktoken.model.partial"), b"half a file").unwrap();
    let ct = &want[Path::new("chat_template.jinja")];
    std::fs::write(out.join("chat_template.jinja"), vec![b'x'; ct.len()]).unwrap();
    std::fs::remove_file(out.join("generation_config.json")).unwrap();
    assert_ne!(verify(&out).0, 0);
    let (code, msg) = repack(&src, &out);
    assert_eq!(code, 0, "{msg}");
    assert_eq!(snapshot(&out), want, "resumed output differs from an uninterrupted run");

    // SRC's tiktoken.model changes after a complete conversion: the re-run carries the new bytes and keeps
    // the shards as they are (same inodes: not rewritten).
    let before = shard_inodes(&out);
    let mut tk = std::fs::read(src.join("tiktoken.model")).unwrap();
    tk.extend_from_slice(b"\n");
    std::fs::write(src.join("tiktoken.model"), &tk).unwrap();
    let (code, msg) = repack(&src, &out);
    assert_eq!(code, 0, "{msg}");
    assert_eq!(std::fs::read(out.join("tiktoken.model")).unwrap(), tk);
    assert_carried(&src, &out, &AUX_FILES);
    assert_eq!(
        shard_inodes(&out),
        before,
        "shards were rewritten for a tokenizer change"
    );
    for (k, v) in &want {
        if k.to_str().unwrap().ends_with(".safetensors") {
            assert!(&std::fs::read(out.join(k)).unwrap() == v, "{k:?} changed");
        }
    }
}
