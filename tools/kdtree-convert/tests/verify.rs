//! `kdtree-convert verify`: passes on a fresh conversion; a flipped byte inside a tensor names that
//! tensor; truncation, a missing file and an extra file each fail with exit 1 naming the file; an
//! unparseable manifest exits 1 (tests/closed_pipes.rs has the other malformed-index cases).

mod common;
use common::*;
use std::path::{Path, PathBuf};

fn converted(d: &Path) -> PathBuf {
    write_checkpoint(&d.join("src"), &Tiny::default());
    let out = d.join("out");
    let (code, _, err) = run(&[
        "repack",
        s(&d.join("src")),
        s(&out),
        "--ranks",
        "2",
        "--max-file-size",
        "30000",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    out
}

fn verify(out: &Path) -> (i32, String) {
    let (code, stdout, stderr) = run(&["verify", s(out), "--quiet"]);
    (code, format!("{stdout}{stderr}"))
}

#[test]
fn verify_passes_then_names_tampered_tensor() {
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    let (code, msg) = verify(&out);
    assert_eq!(code, 0, "{msg}");
    assert!(msg.starts_with("OK:"), "{msg}");
    let m = kdtree_formats::ModelDir::open(&out).unwrap().manifest().clone();
    let t = m
        .tensors
        .iter()
        .find(|t| t.name == "language_model.model.layers.2.mlp.experts.up_proj.weight_packed" && t.rank == 1)
        .unwrap();
    let p = out.join(&t.file);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[(t.offset + t.nbytes / 2) as usize] ^= 0x10;
    std::fs::write(&p, &bytes).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.contains(&t.file)
            && msg.contains("tensor \"language_model.model.layers.2.mlp.experts.up_proj.weight_packed\" (rank 1)"),
        "{msg}"
    );
}

#[test]
fn verify_names_truncated_missing_and_extra_files() {
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    let m = kdtree_formats::ModelDir::open(&out).unwrap().manifest().clone();
    let f = &m.files[3];
    let p = out.join(&f.name);
    let orig = std::fs::read(&p).unwrap();
    std::fs::write(&p, &orig[..orig.len() - 100]).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.contains(&f.name) && msg.contains("truncated") && msg.contains("is cut off"),
        "{msg}"
    );
    std::fs::remove_file(&p).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains(&format!("{}: missing", f.name)), "{msg}");
    std::fs::write(&p, &orig).unwrap();
    assert_eq!(verify(&out).0, 0);
    std::fs::write(out.join("stray.bin"), b"x").unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains("stray.bin: extra file"), "{msg}");
    std::fs::remove_file(out.join("stray.bin")).unwrap();
    // A manifest edit is caught by SHA256SUMS; an unparseable manifest is a failed check (exit 1).
    let mp = out.join("manifest.toml");
    let text = std::fs::read_to_string(&mp).unwrap();
    std::fs::write(&mp, text.replacen("generator = \"", "generator = \"x", 1)).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains("manifest.toml: SHA256SUMS says"), "{msg}");
    std::fs::write(&mp, "not toml [").unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(msg.contains("manifest.toml"), "{msg}");
}

/// Rewrite a fresh (v2) conversion as format v1 did it: per-tensor sha256, no xxh3; SHA256SUMS updated.
fn as_v1(out: &Path) {
    use sha2::{Digest, Sha256};
    let mp = out.join("manifest.toml");
    let mut m = kdtree_formats::Manifest::parse("m", &std::fs::read_to_string(&mp).unwrap()).unwrap();
    m.format_version = 1;
    for t in &mut m.tensors {
        let b = std::fs::read(out.join(&t.file)).unwrap();
        t.sha256 = hex::encode(Sha256::digest(&b[t.offset as usize..(t.offset + t.nbytes) as usize]));
        t.xxh3.clear();
    }
    let text = m.to_toml().unwrap();
    assert!(text.starts_with("format_version = 1\n"));
    std::fs::write(&mp, &text).unwrap();
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    let fixed: String = sums
        .lines()
        .map(|l| {
            if l.ends_with("  manifest.toml") {
                format!("{}  manifest.toml\n", hex::encode(Sha256::digest(text.as_bytes())))
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(out.join("SHA256SUMS"), fixed).unwrap();
}

#[test]
fn verify_reads_format_v1_and_names_a_bad_tensor_by_its_sha256() {
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    let m = kdtree_formats::ModelDir::open(&out).unwrap().manifest().clone();
    assert_eq!(m.format_version, 2);
    assert!(m.tensors.iter().all(|t| t.xxh3.len() == 16 && t.sha256.is_empty()));
    as_v1(&out);
    let (code, msg) = verify(&out);
    assert_eq!(code, 0, "{msg}");
    assert!(kdtree_formats::ModelDir::open(&out).is_ok());
    let t = m
        .tensors
        .iter()
        .find(|t| t.name.ends_with("layers.1.mlp.experts.gate_proj.weight_scale") && t.rank == 0)
        .unwrap();
    let p = out.join(&t.file);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[t.offset as usize + 3] ^= 0x80;
    std::fs::write(&p, &bytes).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.contains(&format!("tensor \"{}\" (rank 0): sha256 ", t.name)),
        "{msg}"
    );
    // A re-run of repack rewrites a v1 conversion whole as v2 (never patches v1 entries into v2).
    let (code, _, err) = run(&[
        "repack",
        s(&d.path().join("src")),
        s(&out),
        "--ranks",
        "2",
        "--max-file-size",
        "30000",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(verify(&out).0, 0);
    assert_eq!(
        kdtree_formats::ModelDir::open(&out).unwrap().manifest().format_version,
        2
    );
}

#[test]
fn verify_fails_a_consistent_but_unplanned_manifest() {
    // split_offset edited and SHA256SUMS updated to match: the hashes pass, the reader would refuse it.
    use sha2::{Digest, Sha256};
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    let mp = out.join("manifest.toml");
    let mut m = kdtree_formats::Manifest::parse("m", &std::fs::read_to_string(&mp).unwrap()).unwrap();
    let t = m
        .tensors
        .iter_mut()
        .find(|t| t.name.ends_with("layers.1.self_attn.q_b_proj.weight") && t.rank == 1)
        .unwrap();
    t.split_offset += 1;
    let name = t.name.clone();
    let text = m.to_toml().unwrap();
    std::fs::write(&mp, &text).unwrap();
    let sums = std::fs::read_to_string(out.join("SHA256SUMS")).unwrap();
    let fixed: String = sums
        .lines()
        .map(|l| {
            if l.ends_with("  manifest.toml") {
                format!("{}  manifest.toml\n", hex::encode(Sha256::digest(text.as_bytes())))
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(out.join("SHA256SUMS"), fixed).unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.starts_with("FAILED: ") && msg.contains(&name) && msg.contains("split_offset"),
        "{msg}"
    );
}

/// Run-time files (issue 29 item 4): the cost file `kdtree-run calibrate` writes beside the model is named by
/// verify and accepted (before: "extra file not in the manifest"), any other extra file still fails, and a
/// re-run of the same repack leaves the cost file and says the conversion is complete.
#[test]
fn verify_names_and_accepts_runtime_files() {
    let d = tempfile::tempdir().unwrap();
    let out = converted(d.path());
    std::fs::write(out.join("kdtree-cost-cpu.json"), "{}").unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 0, "{msg}");
    assert!(
        msg.starts_with("OK:")
            && msg.contains("run-time files, not part of the conversion, not checked: kdtree-cost-cpu.json"),
        "{msg}"
    );
    std::fs::write(out.join("kdtree-cost-Bad.json"), "{}").unwrap();
    let (code, msg) = verify(&out);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.contains("kdtree-cost-Bad.json: extra file not in the manifest"),
        "{msg}"
    );
    std::fs::remove_file(out.join("kdtree-cost-Bad.json")).unwrap();
    let (code, _, err) = run(&[
        "repack",
        s(&d.path().join("src")),
        s(&out),
        "--ranks",
        "2",
        "--max-file-size",
        "30000",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("already complete"), "{err}");
    assert_eq!(std::fs::read(out.join("kdtree-cost-cpu.json")).unwrap(), b"{}");
}
