//! Shared by the kdtree-run integration tests: the tiny synthetic preset (with its drafter, tokenizer and
//! chat template) written by `kdtree_convert::synth` and converted to one rank by `kdtree_convert::repack`.

use std::path::{Path, PathBuf};

/// synth tiny (+ drafter) with `seed` into `root/hf-{seed}`, repacked to one rank into `root/tiny-{seed}`.
#[allow(dead_code)]
pub fn convert_tiny(root: &Path, seed: u64) -> PathBuf {
    convert_tiny_with(root, seed, true)
}

/// [`convert_tiny`], with or without the drafter (without: `root/tiny-{seed}-nodrafter`).
#[allow(dead_code)]
pub fn convert_tiny_with(root: &Path, seed: u64, drafter: bool) -> PathBuf {
    convert_tiny_ranks(root, seed, drafter, 1)
}

/// [`convert_tiny_with`] for `ranks` tensor-parallel ranks (`root/tiny-{seed}[-nodrafter][-r{ranks}]`).
#[allow(dead_code)]
pub fn convert_tiny_ranks(root: &Path, seed: u64, drafter: bool, ranks: usize) -> PathBuf {
    let tag = if drafter { String::new() } else { "-nodrafter".into() };
    let hf = root.join(format!("hf-{seed}{tag}"));
    let out = root.join(format!(
        "tiny-{seed}{tag}{}",
        if ranks == 1 {
            String::new()
        } else {
            format!("-r{ranks}")
        }
    ));
    kdtree_convert::synth::write("tiny", &hf, seed, drafter, None).expect("synth tiny");
    kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
        src: hf.clone(),
        out: out.clone(),
        drafter: drafter.then(|| hf.join("drafter")),
        ranks,
        experts: kdtree_formats::plan::ExpertsMode::Tp,
        max_file_size: 1 << 30,
        quiet: true,
    })
    .expect("repack tiny");
    out
}

/// The records of a JSONL output with their run-dependent parts removed (`timing`; OpenAI bodies' `created`).
#[allow(dead_code)]
pub fn stable(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let mut r: serde_json::Value = serde_json::from_str(l).unwrap();
            r.as_object_mut().unwrap().remove("timing");
            if let Some(b) = r
                .pointer_mut("/response/body")
                .and_then(serde_json::Value::as_object_mut)
            {
                b.remove("created");
            }
            r
        })
        .collect()
}
