//! The full Kimi K2.6 plan (61 layers, 384 experts, 8 ranks, tp and ep) built from shapes alone, with
//! the DFlash drafter: the manifest must stay a few MB and parse well under a second, and the plan
//! must match the per-rank numbers of shared k26-format.md §5.2-§5.3 (fixtures in tests/data).

use kdtree_formats::assemble::{build_manifest, planned_record, ManifestInputs};
use kdtree_formats::config::{parse_drafter_config, parse_text_config};
use kdtree_formats::manifest::{json_to_toml, Model, Source};
use kdtree_formats::plan::{assign_files, plan_model, ExpertsMode, SourceQuant};
use kdtree_formats::{Dtype, Manifest};
use std::time::Instant;

const CONFIG: &str = include_str!("data/k26_config.json");
const DRAFTER: &str = include_str!("data/k26_drafter_config.json");

fn k26_manifest(experts: ExpertsMode) -> (Manifest, kdtree_formats::plan::Plan) {
    let text = parse_text_config("k26_config.json", CONFIG).unwrap();
    let drafter = parse_drafter_config("k26_drafter_config.json", DRAFTER).unwrap();
    let plan = plan_model(&text, Some(&drafter), "language_model.", SourceQuant::Int4, 8, experts).unwrap();
    let files = assign_files(&plan, 5 << 30);
    let mut records: Vec<_> = files.iter().map(|f| planned_record(&plan, f).unwrap()).collect();
    for r in &mut records {
        r.sha256 = "a".repeat(64);
        for t in &mut r.tensors {
            t.xxh3 = "b".repeat(16);
        }
    }
    let tc: serde_json::Value = serde_json::from_str::<serde_json::Value>(CONFIG).unwrap()["text_config"].clone();
    let inputs = ManifestInputs {
        generator: "test".into(),
        skipped: (0..335)
            .map(|i| format!("vision_tower.encoder.blocks.{i}.wqkv.weight"))
            .collect(),
        source: Source {
            config_sha256: "c".repeat(64),
            index_sha256: Some("d".repeat(64)),
            files: vec![],
            drafter: None,
        },
        model: Model {
            text_config_json: tc.to_string(),
            drafter_config_json: Some(DRAFTER.into()),
            text_config: json_to_toml(&tc).unwrap().as_table().unwrap().clone(),
            // The table mirrors the JSON, as repack writes it (a reader refuses a manifest where they differ).
            drafter_config: json_to_toml(&serde_json::from_str(DRAFTER).unwrap())
                .unwrap()
                .as_table()
                .cloned(),
        },
        max_file_size: 5 << 30,
        experts_source: "int4".into(),
    };
    (build_manifest(&plan, &files, &records, inputs), plan)
}

#[test]
fn k26_manifest_is_small_and_parses_fast() {
    for mode in [ExpertsMode::Tp, ExpertsMode::Ep] {
        let (m, _) = k26_manifest(mode);
        let s = m.to_toml().unwrap();
        let mb = s.len() as f64 / 1e6;
        assert!(s.len() < 8_000_000, "{mode:?}: manifest is {mb:.2} MB");
        let t0 = Instant::now();
        let back = Manifest::parse("manifest.toml", &s).unwrap();
        let dt = t0.elapsed();
        eprintln!(
            "{mode:?}: {} tensors, {} files, {mb:.2} MB, parse {dt:?}",
            back.tensors.len(),
            back.files.len()
        );
        assert!(dt.as_secs_f64() < 1.0, "parse took {dt:?}");
        assert_eq!(back, m);
    }
}

#[test]
fn k26_plan_matches_reference_per_rank_shapes() {
    let (m, plan) = k26_manifest(ExpertsMode::Tp);
    let get = |name: &str, rank: usize| {
        m.tensors
            .iter()
            .find(|t| t.name == name && t.rank == rank)
            .unwrap_or_else(|| panic!("{name} r{rank}"))
    };
    let l = "language_model.model.layers.5.";
    let q = get(&format!("{l}self_attn.q_b_proj.weight"), 3);
    assert_eq!(
        (q.shape.as_slice(), q.split_axis, q.split_offset),
        (&[1536, 1536][..], Some(0), 3 * 1536)
    );
    let o = get(&format!("{l}self_attn.o_proj.weight"), 7);
    assert_eq!(
        (o.shape.as_slice(), o.split_axis, o.split_offset),
        (&[7168, 1024][..], Some(1), 7 * 1024)
    );
    let g = get(&format!("{l}mlp.experts.gate_proj.weight_packed"), 2);
    assert_eq!(
        (g.dtype, g.shape.as_slice(), g.logical_shape.as_slice()),
        (Dtype::U8, &[384, 256, 3584][..], &[384, 2048, 7168][..])
    );
    let d = get(&format!("{l}mlp.experts.down_proj.weight_scale"), 1);
    assert_eq!(
        (d.shape.as_slice(), d.split_axis, d.split_offset),
        (&[384, 7168, 8][..], Some(2), 8)
    );
    let e = get("language_model.model.embed_tokens.weight", 4);
    assert_eq!((e.shape.as_slice(), e.split_offset), (&[20480, 7168][..], 4 * 20480));
    let k = get("drafter.layers.0.self_attn.k_proj.weight", 0);
    assert_eq!(k.shape, [128, 7168]);
    // Expert bytes per rank: 66.45 GiB of packed + scales (k26-format.md §2.4 / §5.3).
    let expert_bytes: u64 = plan
        .tensors
        .iter()
        .filter(|t| t.rank == 0 && t.name.contains(".experts."))
        .map(|t| t.nbytes())
        .sum();
    assert_eq!(expert_bytes, (507_343_011_840 + 63_417_876_480) / 8);
    let (ep, _) = k26_manifest(ExpertsMode::Ep);
    let d = ep
        .tensors
        .iter()
        .find(|t| t.name == format!("{l}mlp.experts.down_proj.weight_packed") && t.rank == 5)
        .unwrap();
    assert_eq!(
        (d.shape.as_slice(), d.split_axis, d.split_offset),
        (&[48, 7168, 1024][..], Some(0), 240)
    );
}
