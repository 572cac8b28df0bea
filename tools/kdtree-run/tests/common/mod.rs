//! Shared by the kdtree-run integration tests: the tiny synthetic preset (with its drafter, tokenizer and
//! chat template) written by `kdtree_convert::synth` and converted to one rank by `kdtree_convert::repack`.

use std::path::{Path, PathBuf};

/// synth tiny (+ drafter) with `seed` into `root/hf-{seed}`, repacked to one rank into `root/tiny-{seed}`.
pub fn convert_tiny(root: &Path, seed: u64) -> PathBuf {
    convert_tiny_with(root, seed, true)
}

/// [`convert_tiny`], with or without the drafter (without: `root/tiny-{seed}-nodrafter`).
#[allow(dead_code)]
pub fn convert_tiny_with(root: &Path, seed: u64, drafter: bool) -> PathBuf {
    let tag = if drafter { String::new() } else { "-nodrafter".into() };
    let hf = root.join(format!("hf-{seed}{tag}"));
    let out = root.join(format!("tiny-{seed}{tag}"));
    kdtree_convert::synth::write("tiny", &hf, seed, drafter, None).expect("synth tiny");
    kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
        src: hf.clone(),
        out: out.clone(),
        drafter: drafter.then(|| hf.join("drafter")),
        ranks: 1,
        experts: kdtree_formats::plan::ExpertsMode::Tp,
        max_file_size: 1 << 30,
        quiet: true,
    })
    .expect("repack tiny");
    out
}
