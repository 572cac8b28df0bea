//! `ModelDir::open` on a small model built here from a plan (config → plan → writer → manifest):
//! tensors come back with the planned shapes, splits and bytes; a truncated shard, a manifest that
//! disagrees with a header, and unknown tensors/ranks are errors naming the file or tensor.

use kdtree_formats::assemble::{build_manifest, file_specs, FileRecord, ManifestInputs, TensorRecord};
use kdtree_formats::config::parse_text_config;
use kdtree_formats::manifest::{json_to_toml, Model, Source, MANIFEST};
use kdtree_formats::plan::{assign_files, plan_model, ExpertsMode, SourceQuant};
use kdtree_formats::writer::ShardWriter;
use kdtree_formats::{Layout, ModelDir};
use std::path::Path;

const TEXT: &str = r#"{"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2,
 "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
 "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
 "topk_method": "noaux_tc", "norm_topk_prob": true, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
 "rope_theta": 50000.0, "rope_scaling": null, "max_position_embeddings": 128, "vocab_size": 64, "q_unused": null}"#;

/// Byte `i` of every tensor is `(i + rank + len(name)) % 256`, so placements can be checked.
fn fill(name: &str, rank: usize, n: u64) -> Vec<u8> {
    (0..n).map(|i| ((i as usize + rank + name.len()) % 256) as u8).collect()
}

fn build(dir: &Path) {
    let text = parse_text_config("config.json", TEXT).unwrap();
    let plan = plan_model(&text, None, "language_model.", SourceQuant::Int4, 2, ExpertsMode::Tp).unwrap();
    let files = assign_files(&plan, 4096);
    let mut records = Vec::new();
    for f in &files {
        let mut w = ShardWriter::create(&dir.join(&f.name), file_specs(&plan, f)).unwrap();
        for &i in &f.tensors {
            let t = &plan.tensors[i];
            w.write(&fill(&t.name, t.rank, t.nbytes())).unwrap();
        }
        let d = w.finish().unwrap();
        let tensors = d.tensors.into_iter().map(|t| TensorRecord { name: t.name, offset: t.offset, nbytes: t.nbytes, sha256: t.sha256 }).collect();
        records.push(FileRecord { name: f.name.clone(), size: d.size, sha256: d.sha256, tensors });
    }
    let json: serde_json::Value = serde_json::from_str(TEXT).unwrap();
    let inputs = ManifestInputs {
        generator: "test".into(),
        skipped: vec![],
        source: Source { config_sha256: "0".repeat(64), index_sha256: None, files: vec![], drafter: None },
        model: Model { text_config_json: json.to_string(), drafter_config_json: None, text_config: json_to_toml(&json).unwrap().as_table().unwrap().clone(), drafter_config: None },
        max_file_size: 4096,
        experts_source: "int4".into(),
    };
    let m = build_manifest(&plan, &files, &records, inputs);
    std::fs::write(dir.join(MANIFEST), m.to_toml().unwrap()).unwrap();
}

#[test]
fn open_returns_planned_tensors() {
    let d = tempfile::tempdir().unwrap();
    build(d.path());
    let m = ModelDir::open(d.path()).unwrap();
    assert_eq!((m.ranks(), m.text_config().hidden_size, m.drafter_config().is_none()), (2, 64, true));
    let name = "language_model.model.layers.1.mlp.experts.down_proj.weight_packed";
    let t = m.tensor(name, 1).unwrap();
    assert_eq!((t.layout, t.shape, t.logical_shape, t.split_axis, t.split_offset), (Layout::Int4G32, &[4, 64, 16][..], &[4, 64, 64][..], Some(2), 32));
    assert_eq!(t.data, fill(name, 1, 4 * 64 * 16).as_slice());
    let n = m.tensor("language_model.model.norm.weight", 0).unwrap();
    assert_eq!((n.split_axis, n.data.len()), (None, 128));
    assert!(m.tensor(name, 2).unwrap_err().to_string().contains("rank 2"));
    assert!(m.tensor("nope", 0).unwrap_err().to_string().contains("\"nope\""));
}

#[test]
fn open_refuses_truncated_shard_and_manifest_header_mismatch() {
    let d = tempfile::tempdir().unwrap();
    build(d.path());
    let text = std::fs::read_to_string(d.path().join(MANIFEST)).unwrap();
    let m = kdtree_formats::Manifest::parse("m", &text).unwrap();
    let f = &m.files[1];
    let p = d.path().join(&f.name);
    let orig = std::fs::read(&p).unwrap();
    std::fs::write(&p, &orig[..orig.len() - 1]).unwrap();
    let e = ModelDir::open(d.path()).err().unwrap().to_string();
    assert!(e.contains(&f.name) && e.contains("manifest says"), "{e}");
    std::fs::write(&p, &orig).unwrap();
    let t = &m.tensors[3];
    let bad = text.replacen(&format!("offset = {}\n", t.offset), &format!("offset = {}\n", t.offset + 2), 1);
    assert_ne!(bad, text);
    std::fs::write(d.path().join(MANIFEST), bad).unwrap();
    let e = ModelDir::open(d.path()).err().unwrap().to_string();
    assert!(e.contains("manifest says") && e.contains("header says"), "{e}");
}
