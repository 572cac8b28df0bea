//! Tests of the bundle format: round trips, determinism and refusals (bundle.rs, bundle/records.rs).

use super::records::Owned;
use super::*;
use std::collections::HashMap;

fn sample_record(seed: u32) -> PromptRecord {
    let v = 10;
    let f = |i: usize| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 100.0 - 5.0;
    let full: Vec<f32> = (0..2 * v).map(f).collect();
    PromptRecord {
        prompt_ids: vec![1, 5, 9],
        ar: ArRecord {
            tokens: vec![3, 4, 7],
            topk: 2,
            topk_ids: vec![3, 1, 4, 0, 7, 2],
            topk_logits: vec![1.5, 1.0, 2.0, -1.0, 0.25, 0.125],
            vocab: v,
            full_steps: 2,
            full_logits: full,
            router_margins: vec![0.5, 3.0e-5, f32::INFINITY],
        },
        trace: Some(TraceRecord {
            step: 1,
            position: 4,
            token: 3,
            layers: vec![
                LayerTrace {
                    attn_out: vec![0.5; 4],
                    router_ids: vec![],
                    router_weights: vec![],
                    mlp_out: vec![1.0; 4],
                    residual: vec![2.0; 4],
                },
                LayerTrace {
                    attn_out: vec![-0.5; 4],
                    router_ids: vec![2, 0],
                    router_weights: vec![1.25, 0.75],
                    mlp_out: vec![3.0; 4],
                    residual: vec![4.0; 4],
                },
            ],
        }),
        ddtree: Some(DdtreeRecord {
            start: 3,
            root: 3,
            budget: 2,
            vocab: v,
            draft_rows: 1,
            draft_logits: (0..v).map(f).collect(),
            tree_tokens: vec![3, 4, 5],
            tree_parents: vec![-1, 0, 0],
            tree_depths: vec![0, 1, 1],
            visibility_words: 1,
            visibility: vec![0b1, 0b11, 0b101],
            verify_logits: (0..3 * v).map(f).collect(),
            accepted: vec![0, 1],
            decisions: vec![4, 7],
            bonus: 7,
            router_margins: vec![0.25, 0.25, 1.0e-4],
        }),
    }
}

#[test]
fn record_roundtrips() {
    let r = sample_record(1);
    let bytes = r.to_bytes().unwrap();
    assert_eq!(PromptRecord::from_bytes(&bytes, "t").unwrap(), r);
    let bare = PromptRecord {
        trace: None,
        ddtree: None,
        ..sample_record(2)
    };
    assert_eq!(PromptRecord::from_bytes(&bare.to_bytes().unwrap(), "t").unwrap(), bare);
}

#[test]
fn bytes_are_deterministic_and_header_is_sorted() {
    let r = sample_record(3);
    let a = r.to_bytes().unwrap();
    for _ in 0..8 {
        // fresh HashMaps inside serialize get fresh random seeds; the bytes must not move
        assert_eq!(r.clone().to_bytes().unwrap(), a);
    }
    let n = u64::from_le_bytes(a[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&a[8..8 + n]).unwrap();
    assert!(
        header.starts_with("{\"__metadata__\":{\"format\":\"kdtree-golden/2\"}"),
        "{header}"
    );
    // within one dtype, names appear in sorted order
    let pos = |s: &str| header.find(&format!("\"{s}\"")).unwrap();
    assert!(pos("ar.full_logits") < pos("ar.topk_logits"));
    assert!(pos("ar.tokens") < pos("prompt_ids"));
}

#[test]
fn reader_rejects_corruption() {
    let r = sample_record(4);
    let mut bytes = r.to_bytes().unwrap();
    assert!(PromptRecord::from_bytes(&bytes[..bytes.len() - 4], "t").is_err());
    // wrong format tag
    let meta = HashMap::from([("format".to_string(), "other".to_string())]);
    let other = safetensors::serialize(Vec::<(&str, &Owned)>::new(), Some(meta)).unwrap();
    assert!(PromptRecord::from_bytes(&other, "t")
        .unwrap_err()
        .to_string()
        .contains("format"));
    let last = bytes.len() - 1;
    bytes[last] ^= 1; // still parses; the bundle's sha256 check catches it (below)
    assert!(PromptRecord::from_bytes(&bytes, "t").is_ok());
}

fn index() -> Index {
    Index {
        format: FORMAT.into(),
        tool: "kdtree-golden".into(),
        tool_version: "0".into(),
        engine_version: "0".into(),
        command: "kdtree-golden MODEL --prompts PROMPTS --out OUT".into(),
        model: ModelInfo {
            manifest_sha256: "00".into(),
            vocab_size: 10,
            hidden_size: 4,
            num_layers: 2,
            tap_layers: vec![1],
            block_size: 2,
        },
        settings: Settings {
            max_tokens: 3,
            budget: 2,
            full_logits_steps: 2,
            topk: 2,
            trace_step: 1,
        },
        prompts: vec![],
    }
}

#[test]
fn bundle_write_read_and_sha_check() {
    let dir = tempfile::tempdir().unwrap();
    let recs = vec![
        (
            "a".to_string(),
            sample_record(5),
            PromptEntryExtra {
                ddtree_tokens: 2,
                ddtree_matches_ar: true,
            },
        ),
        ("bad id/..".to_string(), sample_record(6), PromptEntryExtra::default()),
    ];
    let idx = write_bundle(dir.path(), index(), &recs).unwrap();
    assert_eq!(idx.prompts[0].file, "a.safetensors");
    assert_eq!(idx.prompts[1].file, "prompt-0001.safetensors");
    let b = Bundle::open(dir.path()).unwrap();
    assert_eq!(b.index, idx);
    let all = b.load_all().unwrap();
    assert_eq!(all[0].1, recs[0].1);
    assert_eq!(all[1].0, "bad id/..");
    // a flipped byte is caught by the hash
    let p = dir.path().join("a.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&p, bytes).unwrap();
    assert!(b.load("a").unwrap_err().to_string().contains("sha256"));
    // writing the same records again gives identical index.json bytes
    let dir2 = tempfile::tempdir().unwrap();
    write_bundle(dir2.path(), index(), &recs).unwrap();
    write_bundle(dir.path(), index(), &recs).unwrap();
    for f in ["index.json", "a.safetensors", "prompt-0001.safetensors"] {
        assert_eq!(
            std::fs::read(dir.path().join(f)).unwrap(),
            std::fs::read(dir2.path().join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn topk_orders_ties_by_id_and_skips_nan() {
    let (i, v) = topk_of(&[1.0, 3.0, f32::NAN, 3.0, -1.0], 3);
    assert_eq!(i, vec![1, 3, 0]);
    assert_eq!(v, vec![3.0, 3.0, 1.0]);
    assert_eq!(topk_of(&[0.5], 4).0, vec![0]);
}
