//! Shared by the kdtree-run integration tests: the tiny synthetic preset (with its drafter, tokenizer and
//! chat template) written by `kdtree_convert::synth` and converted to one rank by `kdtree_convert::repack`.

use std::path::{Path, PathBuf};

/// synth tiny (+ drafter) with `seed` into `root/hf-{seed}`, repacked to one rank into `root/tiny-{seed}`.
pub fn convert_tiny(root: &Path, seed: u64) -> PathBuf {
    let hf = root.join(format!("hf-{seed}"));
    let out = root.join(format!("tiny-{seed}"));
    kdtree_convert::synth::write("tiny", &hf, seed, true, None).expect("synth tiny");
    kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
        src: hf.clone(),
        out: out.clone(),
        drafter: Some(hf.join("drafter")),
        ranks: 1,
        experts: kdtree_formats::plan::ExpertsMode::Tp,
        max_file_size: 1 << 30,
        quiet: true,
    })
    .expect("repack tiny");
    out
}
