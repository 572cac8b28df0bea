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
        let tensors = d
            .tensors
            .into_iter()
            .map(|t| TensorRecord {
                name: t.name,
                offset: t.offset,
                nbytes: t.nbytes,
                xxh3: t.xxh3,
            })
            .collect();
        records.push(FileRecord {
            name: f.name.clone(),
            size: d.size,
            sha256: d.sha256,
            tensors,
        });
    }
    let json: serde_json::Value = serde_json::from_str(TEXT).unwrap();
    let inputs = ManifestInputs {
        generator: "test".into(),
        skipped: vec![],
        source: Source {
            config_sha256: "0".repeat(64),
            index_sha256: None,
            files: vec![],
            drafter: None,
        },
        model: Model {
            text_config_json: json.to_string(),
            drafter_config_json: None,
            text_config: json_to_toml(&json).unwrap().as_table().unwrap().clone(),
            drafter_config: None,
        },
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
    assert_eq!(
        (m.ranks(), m.text_config().hidden_size, m.drafter_config().is_none()),
        (2, 64, true)
    );
    let name = "language_model.model.layers.1.mlp.experts.down_proj.weight_packed";
    let t = m.tensor(name, 1).unwrap();
    assert_eq!(
        (t.layout, t.shape, t.logical_shape, t.split_axis, t.split_offset),
        (Layout::Int4G32, &[4, 64, 16][..], &[4, 64, 64][..], Some(2), 32)
    );
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
    let bad = text.replacen(
        &format!("offset = {}\n", t.offset),
        &format!("offset = {}\n", t.offset + 2),
        1,
    );
    assert_ne!(bad, text);
    std::fs::write(d.path().join(MANIFEST), bad).unwrap();
    let e = ModelDir::open(d.path()).err().unwrap().to_string();
    assert!(e.contains("manifest says") && e.contains("header says"), "{e}");
}

/// Rewrite the manifest with `edit` applied to the first tensor entry named `name` (rank `rank`).
fn edit_entry(dir: &Path, name: &str, rank: usize, edit: impl Fn(&mut kdtree_formats::manifest::TensorEntry)) {
    let p = dir.join(MANIFEST);
    let mut m = kdtree_formats::Manifest::parse("m", &std::fs::read_to_string(&p).unwrap()).unwrap();
    let t = m.tensors.iter_mut().find(|t| t.name == name && t.rank == rank).unwrap();
    edit(t);
    std::fs::write(&p, m.to_toml().unwrap()).unwrap();
}

#[test]
fn open_refuses_entries_that_disagree_with_the_plan_naming_the_tensor() {
    let packed = "language_model.model.layers.1.mlp.experts.down_proj.weight_packed";
    let q = "language_model.model.layers.0.self_attn.q_b_proj.weight";
    type Edit = Box<dyn Fn(&mut kdtree_formats::manifest::TensorEntry)>;
    let cases: Vec<(&str, usize, Edit, &str)> = vec![
        (
            packed,
            1,
            Box::new(|t| t.split_offset = 999),
            "split_offset is 999 in the manifest, the plan says 32",
        ),
        (packed, 1, Box::new(|t| t.split_offset = 0), "split_offset is 0"),
        (
            packed,
            0,
            Box::new(|t| t.logical_shape = vec![4, 64, 640]),
            "logical_shape is [4, 64, 640]",
        ),
        (packed, 0, Box::new(|t| t.split_axis = Some(1)), "split_axis is Some(1)"),
        (packed, 0, Box::new(|t| t.layout = Layout::Plain), "layout is Plain"),
        (q, 1, Box::new(|t| t.split_offset = 4), "split_offset is 4"),
        (q, 1, Box::new(|t| t.logical_shape = vec![96, 31]), "logical_shape"),
        (q, 0, Box::new(|t| t.split_axis = None), "split_axis is None"),
        (
            q,
            0,
            Box::new(|t| t.name = "language_model.model.layers.0.self_attn.q_b_proj.weightx".into()),
            "not a tensor of the model",
        ),
    ];
    for (name, rank, edit, want) in cases {
        let d = tempfile::tempdir().unwrap();
        build(d.path());
        edit_entry(d.path(), name, rank, edit);
        let e = ModelDir::open(d.path()).err().unwrap().to_string();
        assert!(
            e.contains(&format!("rank {rank}: ")) && e.contains(want),
            "{name} (rank {rank}): {e}"
        );
        assert!(
            e.contains("q_b_proj") || e.contains("down_proj"),
            "tensor not named: {e}"
        );
    }
    // An entry removed: the planned tensor is named as missing.
    let d = tempfile::tempdir().unwrap();
    build(d.path());
    let p = d.path().join(MANIFEST);
    let mut m = kdtree_formats::Manifest::parse("m", &std::fs::read_to_string(&p).unwrap()).unwrap();
    m.tensors.retain(|t| !(t.name == q && t.rank == 1));
    std::fs::write(&p, m.to_toml().unwrap()).unwrap();
    let e = ModelDir::open(d.path()).err().unwrap().to_string();
    assert!(e.contains(q) && e.contains("planned but not listed"), "{e}");
}
