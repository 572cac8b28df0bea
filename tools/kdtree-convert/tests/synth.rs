//! End-to-end checks of `synth` on the tiny preset: the files of a K2.6 checkpoint are all there, the index
//! matches the shards, every source tensor the 8-rank plan expects is present with its dtype and shape, output is
//! byte-identical for a seed, the tokenizer loads in kdtree-text with Kimi's special ids, expert bytes decode to
//! both weight_shape dtypes, and the weights give finite, spread logits. Fast (tiny synthesizes in < 1 s).

use half::bf16;
use kdtree_convert::synth;
use kdtree_formats::config::{parse_drafter_config, parse_text_config};
use kdtree_formats::plan::{plan_model, ExpertsMode, SourceQuant};
use kdtree_formats::reader::SafeFile;
use kdtree_formats::{int4, Dtype};
use std::collections::BTreeMap;
use std::path::Path;

mod common;

/// Every file under `dir`, keyed by its relative path as a string.
fn all_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    common::snapshot(dir)
        .into_iter()
        .map(|(p, v)| (p.display().to_string(), v))
        .collect()
}

fn bf16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect()
}

#[test]
fn tiny_synth_is_a_complete_k26_layout_and_deterministic() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t0 = std::time::Instant::now();
    let w = synth::write("tiny", a.path(), 3, true, None).unwrap();
    eprintln!("tiny synth with drafter: {:?}", t0.elapsed());
    synth::write("tiny", b.path(), 3, true, None).unwrap();
    let (fa, fb) = (all_files(a.path()), all_files(b.path()));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (k, v) in &fa {
        assert!(v == &fb[k], "{k} differs between two runs with the same seed");
    }
    let n = w.shards;
    assert_eq!(n, 4 + 3);
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tiktoken.model",
        "tokenizer_config.json",
        "chat_template.jinja",
        "drafter/config.json",
        "drafter/model.safetensors",
    ] {
        assert!(fa.contains_key(f), "missing {f}");
    }
    for i in 0..n {
        assert!(fa.contains_key(&format!("model-{:05}-of-{:06}.safetensors", i + 1, n)));
    }
    // A different seed changes the weights but not the tokenizer.
    let c = tempfile::tempdir().unwrap();
    synth::write("tiny", c.path(), 4, false, None).unwrap();
    let fc = all_files(c.path());
    assert_ne!(
        fc["model-00002-of-000007.safetensors"],
        fa["model-00002-of-000007.safetensors"]
    );
    assert_eq!(fc["tiktoken.model"], fa["tiktoken.model"]);
}

#[test]
fn tiny_index_shards_and_plan_agree() {
    let d = tempfile::tempdir().unwrap();
    synth::write("tiny", d.path(), 0, true, None).unwrap();
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    let root: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    assert_eq!(root["model_type"], "kimi_k25");
    assert_eq!(root["text_config"]["model_type"], "kimi_k2");
    assert_eq!(root["text_config"]["quantization_config"]["format"], "pack-quantized");
    assert!(
        root.get("quantization_config").is_none(),
        "quantization_config is nested, as in K2.6"
    );
    let text = parse_text_config("config.json", &cfg).unwrap();
    let dcfg = std::fs::read_to_string(d.path().join("drafter/config.json")).unwrap();
    let drafter = parse_drafter_config("drafter/config.json", &dcfg).unwrap();

    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let mut tensors = BTreeMap::new();
    let mut total = 0u64;
    let mut files: Vec<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    files.sort_unstable();
    files.dedup();
    for f in &files {
        let sf = SafeFile::open(&d.path().join(f)).unwrap();
        let bytes = sf.bytes().to_vec();
        let hdr_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let hdr: serde_json::Value = serde_json::from_slice(&bytes[8..8 + hdr_len]).unwrap();
        for (name, info) in hdr.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            assert_eq!(
                map[name].as_str().unwrap(),
                *f,
                "{name} is in {f} but the index says otherwise"
            );
            let (ti, _) = sf.tensor(name).unwrap();
            total += ti.nbytes() as u64;
            tensors.insert(
                name.clone(),
                (ti.dtype, ti.shape.clone(), info["dtype"].as_str().unwrap().to_string()),
            );
        }
    }
    assert_eq!(tensors.len(), map.len());
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    // Layer 0 (dense) is the first shard, embed/head/norm after the layers, vision last.
    assert_eq!(
        map["language_model.model.layers.0.mlp.down_proj.weight"],
        "model-00001-of-000007.safetensors"
    );
    assert_eq!(
        map["language_model.lm_head.weight"],
        "model-00005-of-000007.safetensors"
    );
    assert_eq!(map["mm_projector.proj.2.weight"], "model-00006-of-000007.safetensors");
    assert_eq!(
        map["vision_tower.encoder.final_layernorm.bias"],
        "model-00007-of-000007.safetensors"
    );
    assert_eq!(
        tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].0,
        Dtype::F32
    );
    // Both weight_shape dtypes occur (tiny uses "mixed").
    assert_eq!(
        tensors["language_model.model.layers.1.mlp.experts.0.up_proj.weight_shape"].0,
        Dtype::I32
    );
    assert_eq!(
        tensors["language_model.model.layers.1.mlp.experts.1.up_proj.weight_shape"].0,
        Dtype::I64
    );
    // Every source tensor the 8-rank plan reads exists with an accepted dtype and the expected shape.
    for mode in [ExpertsMode::Tp, ExpertsMode::Ep] {
        let plan = plan_model(&text, Some(&drafter), "language_model.", SourceQuant::Int4, 8, mode).unwrap();
        for src in plan.sources.iter().filter(|s| !s.name.starts_with("drafter.")) {
            let (dt, shape, _) = tensors
                .get(&src.name)
                .unwrap_or_else(|| panic!("plan needs {} ({mode:?})", src.name));
            assert!(src.dtypes.contains(dt), "{}: {dt:?} not in {:?}", src.name, src.dtypes);
            assert_eq!(shape, &src.shape, "{}", src.name);
        }
    }
    // The drafter file holds exactly the drafter sources of the plan (names without the drafter. prefix).
    let dsf = SafeFile::open(&d.path().join("drafter/model.safetensors")).unwrap();
    let plan = plan_model(
        &text,
        Some(&drafter),
        "language_model.",
        SourceQuant::Int4,
        8,
        ExpertsMode::Tp,
    )
    .unwrap();
    let dsrc: Vec<_> = plan.sources.iter().filter(|s| s.name.starts_with("drafter.")).collect();
    assert!(!dsrc.is_empty());
    for src in dsrc {
        let (ti, _) = dsf.tensor(src.name.trim_start_matches("drafter.")).unwrap();
        assert_eq!(ti.shape, src.shape, "{}", src.name);
    }
}

#[test]
fn tiny_tokenizer_loads_with_kimi_special_ids() {
    let d = tempfile::tempdir().unwrap();
    synth::write("tiny", d.path(), 0, false, None).unwrap();
    let tok = kdtree_text::Tokenizer::from_dir(d.path()).unwrap();
    assert_eq!(tok.vocab_size(), 1024);
    let base = tok.n_mergeable();
    assert_eq!(base, 768);
    for (off, name) in [
        (0, "[BOS]"),
        (2, "<|im_end|>"),
        (17, "<|im_middle|>"),
        (22, "<think>"),
        (254, "[UNK]"),
        (255, "[PAD]"),
    ] {
        assert_eq!(tok.special_id(name), Some(base + off), "{name}");
    }
    let english = "The model reads the prompt, writes an answer";
    let ids = tok.encode(english);
    assert!(
        ids.len() <= 16,
        "BPE should learn English words: {} ids for {english:?}",
        ids.len()
    );
    let text = "The model reads the prompt. 人工智能 fn main() { 42 } <|im_end|>";
    let ids = tok.encode(text);
    assert_eq!(*ids.last().unwrap(), base + 2);
    assert!(
        ids.len() * 3 < text.len() * 2,
        "BPE should compress mixed text: {} ids for {} bytes",
        ids.len(),
        text.len()
    );
    assert_eq!(tok.decode_lossy(&ids).unwrap(), text);
    let root: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(root["eos_token_id"].as_u64().unwrap(), (base + 2) as u64);
    assert_eq!(root["media_placeholder_token_id"].as_u64().unwrap(), (base + 21) as u64);
    let chat = kdtree_text::ChatTemplate::from_dir(d.path()).unwrap();
    let msgs = serde_json::json!([{"role": "user", "content": "Hello"}]);
    let prompt = chat.render(&msgs, &Default::default()).unwrap();
    assert!(
        prompt.contains("<|im_user|>") && prompt.ends_with("<think>"),
        "{prompt}"
    );
}

#[test]
fn tiny_weights_are_well_scaled() {
    let d = tempfile::tempdir().unwrap();
    synth::write("tiny", d.path(), 1, false, None).unwrap();
    let shard = SafeFile::open(&d.path().join("model-00002-of-000007.safetensors")).unwrap();
    // Expert codes use the whole int4 range and scales give q*s std ~ 1/sqrt(K).
    let (pi, packed) = shard
        .tensor("language_model.model.layers.1.mlp.experts.3.gate_proj.weight_packed")
        .unwrap();
    let (_, scale) = shard
        .tensor("language_model.model.layers.1.mlp.experts.3.gate_proj.weight_scale")
        .unwrap();
    assert_eq!(pi.dtype, Dtype::I32);
    let (n, k) = (pi.shape[0], pi.shape[1] * 8);
    let scales: Vec<bf16> = scale
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect();
    let mut row = vec![0f32; k];
    let (mut sum2, mut seen) = (0f64, [false; 16]);
    for r in 0..n {
        int4::dequant_row_f32(
            &packed[r * k / 2..(r + 1) * k / 2],
            &scales[r * k / 32..(r + 1) * k / 32],
            &mut row,
        );
        sum2 += row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
        for i in 0..k {
            seen[(int4::get(&packed[r * k / 2..], i) + 8) as usize] = true;
        }
    }
    let std = (sum2 / (n * k) as f64).sqrt();
    let want = 1.0 / (k as f64).sqrt();
    assert!((std / want - 1.0).abs() < 0.1, "expert weight std {std}, want ~{want}");
    assert!(seen.iter().all(|&s| s), "all 16 codes occur");

    // Embedding rows -> final norm -> lm_head: logits finite, std ~3, and a clear winner (no near-ties).
    let head = SafeFile::open(&d.path().join("model-00005-of-000007.safetensors")).unwrap();
    let emb = bf16s(head.tensor("language_model.model.embed_tokens.weight").unwrap().1);
    let lm = bf16s(head.tensor("language_model.lm_head.weight").unwrap().1);
    let normw = bf16s(head.tensor("language_model.model.norm.weight").unwrap().1);
    let (h, vocab) = (normw.len(), emb.len() / normw.len());
    let mut gaps_ok = 0;
    for tok in (0..vocab).step_by(vocab / 32) {
        let x = &emb[tok * h..(tok + 1) * h];
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / h as f32 + 1e-5).sqrt();
        assert!((rms - 1.0).abs() < 0.2, "embedding rms {rms}");
        let xn: Vec<f32> = x.iter().zip(&normw).map(|(v, g)| v / rms * g).collect();
        let mut logits: Vec<f32> = (0..vocab)
            .map(|v| lm[v * h..(v + 1) * h].iter().zip(&xn).map(|(a, b)| a * b).sum())
            .collect();
        let mean = logits.iter().sum::<f32>() / vocab as f32;
        let sd = (logits.iter().map(|l| (l - mean).powi(2)).sum::<f32>() / vocab as f32).sqrt();
        assert!(
            logits.iter().all(|l| l.is_finite()) && (2.0..4.0).contains(&sd),
            "logit std {sd}"
        );
        logits.sort_by(|a, b| b.total_cmp(a));
        if logits[0] - logits[1] > 0.05 {
            gaps_ok += 1;
        }
    }
    assert!(
        gaps_ok >= 28,
        "top-1/top-2 logit gap > 0.05 for only {gaps_ok}/32 probes"
    );
}

#[test]
fn tiny_synth_repacks_and_verifies_in_tp_and_ep() {
    use kdtree_convert::repack::{repack, RepackOptions};
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("hf");
    synth::write("tiny", &src, 0, true, None).unwrap();
    for (mode, tag) in [(ExpertsMode::Tp, "tp"), (ExpertsMode::Ep, "ep")] {
        let out = d.path().join(tag);
        let o = RepackOptions {
            src: src.clone(),
            out: out.clone(),
            drafter: Some(src.join("drafter")),
            ranks: 8,
            experts: mode,
            max_file_size: kdtree_convert::repack::DEFAULT_MAX_FILE_SIZE,
            quiet: true,
        };
        repack(&o).unwrap_or_else(|e| panic!("repack {tag}: {e:#}"));
        match kdtree_convert::verify::verify(&out, true).unwrap() {
            kdtree_convert::verify::Verdict::Ok { tensors, .. } => assert!(tensors > 0),
            kdtree_convert::verify::Verdict::Failed(why) => panic!("verify {tag}: {why}"),
        }
        let dir = kdtree_formats::ModelDir::open(&out).unwrap();
        assert_eq!(dir.ranks(), 8);
        assert!(dir.drafter_config().is_some());
    }
}
