//! End-to-end repack: determinism, INT4 carried bit-exactly, BF16 experts quantized like
//! compressed-tensors, tp and ep splits, the drafter, SHA256SUMS accepted by `sha256sum -c --strict`,
//! kill -9 at several points then resume → identical bytes, inspect output.

mod common;
use common::*;
use half::bf16;
use kdtree_formats::{Layout, ModelDir};

fn source_tensor<'a>(all: &'a Tensors, name: &str) -> &'a [u8] {
    &all.get(name).unwrap_or_else(|| panic!("{name}")).2
}

#[test]
fn repack_is_deterministic_verifies_and_sha256sum_accepts() {
    let d = tempfile::tempdir().unwrap();
    let (src, drafter) = (d.path().join("src"), d.path().join("drafter"));
    write_checkpoint(&src, &Tiny::default());
    write_drafter(&drafter, 64);
    let mut snaps = Vec::new();
    for run_i in 0..2 {
        let out = d.path().join(format!("out{run_i}"));
        let (code, _, err) = run(&[
            "repack",
            s(&src),
            s(&out),
            "--ranks",
            "2",
            "--drafter",
            s(&drafter),
            "--max-file-size",
            "20000",
            "--quiet",
        ]);
        assert_eq!(code, 0, "{err}");
        snaps.push(snapshot(&out));
        let (code, stdout, _) = run(&["verify", s(&out), "--quiet"]);
        assert_eq!(code, 0, "{stdout}");
        let st = std::process::Command::new("sha256sum")
            .args(["-c", "--strict", "--quiet", "SHA256SUMS"])
            .current_dir(&out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    assert_eq!(snaps[0], snaps[1], "two runs differ");
    assert!(
        snaps[0]
            .keys()
            .any(|k| k.to_str().unwrap() == "rank-01-of-02.part-0003.safetensors"),
        "{:?}",
        snaps[0].keys()
    );
    // No temp files, state or lock left; the source stamp stays (it is how a re-run tells a changed SRC).
    let stamp = kdtree_convert::stamp::STAMP_FILE;
    assert!(!snaps[0].keys().any(|k| k.to_str().unwrap().contains("partial")
        || (k.to_str().unwrap().contains(".kdtree") && k.to_str().unwrap() != stamp)));
    assert!(snaps[0].keys().any(|k| k.to_str().unwrap() == stamp));
    // Re-running on a complete output changes nothing.
    let out = d.path().join("out0");
    let (code, _, err) = run(&[
        "repack",
        s(&src),
        s(&out),
        "--ranks",
        "2",
        "--drafter",
        s(&drafter),
        "--max-file-size",
        "20000",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(snapshot(&out), snaps[0]);
}

#[test]
fn int4_experts_are_carried_bit_exactly_tp() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny::default();
    write_checkpoint(&d.path().join("src"), &t);
    let all = tensors(&t);
    let out = d.path().join("out");
    let (code, _, err) = run(&["repack", s(&d.path().join("src")), s(&out), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let m = ModelDir::open(&out).unwrap();
    assert_eq!(m.ranks(), 2);
    assert_eq!(m.text_config().hidden_size, 64);
    let l = "language_model.model.layers.2.mlp.experts";
    for r in 0..2 {
        // gate: rows [32r, 32r+32) of every expert's [64, 64/2] bytes.
        let g = m.tensor(&format!("{l}.gate_proj.weight_packed"), r).unwrap();
        assert_eq!(
            (g.layout, g.shape, g.logical_shape, g.split_axis, g.split_offset),
            (Layout::Int4G32, &[8, 32, 32][..], &[8, 64, 64][..], Some(1), 32 * r)
        );
        for e in 0..8 {
            let src = source_tensor(
                &all,
                &format!("language_model.model.layers.2.mlp.experts.{e}.gate_proj.weight_packed"),
            );
            assert_eq!(
                &g.data[e * 1024..(e + 1) * 1024],
                &src[r * 1024..(r + 1) * 1024],
                "expert {e} rank {r}"
            );
        }
        // down: columns [32r, 32r+32) = bytes [16r, 16r+16) of each 32-byte row; scales 1 group of 2 per row.
        let dn = m.tensor(&format!("{l}.down_proj.weight_packed"), r).unwrap();
        let ds = m.tensor(&format!("{l}.down_proj.weight_scale"), r).unwrap();
        assert_eq!(
            (dn.shape, ds.shape, ds.split_axis, ds.split_offset),
            (&[8, 64, 16][..], &[8, 64, 1][..], Some(2), r)
        );
        let src = source_tensor(
            &all,
            "language_model.model.layers.2.mlp.experts.5.down_proj.weight_packed",
        );
        let ssc = source_tensor(
            &all,
            "language_model.model.layers.2.mlp.experts.5.down_proj.weight_scale",
        );
        for row in 0..64 {
            assert_eq!(&dn.data[(5 * 64 + row) * 16..][..16], &src[row * 32 + 16 * r..][..16]);
            assert_eq!(&ds.data[(5 * 64 + row) * 2..][..2], &ssc[row * 4 + 2 * r..][..2]);
        }
        // o_proj: columns by heads; embed: rows by vocab; bias replicated F32.
        let o = m
            .tensor("language_model.model.layers.1.self_attn.o_proj.weight", r)
            .unwrap();
        let so = source_tensor(&all, "language_model.model.layers.1.self_attn.o_proj.weight");
        assert_eq!(
            (o.shape, o.split_axis, o.split_offset),
            (&[64, 32][..], Some(1), 32 * r)
        );
        assert_eq!(&o.data[..64], &so[r * 64..r * 64 + 64]);
        let e = m.tensor("language_model.model.embed_tokens.weight", r).unwrap();
        assert_eq!(
            e.data,
            &source_tensor(&all, "language_model.model.embed_tokens.weight")[r * 128 * 128..(r + 1) * 128 * 128]
        );
        let b = m
            .tensor("language_model.model.layers.1.mlp.gate.e_score_correction_bias", r)
            .unwrap();
        assert_eq!(
            (b.dtype, b.split_axis, b.data),
            (
                kdtree_formats::Dtype::F32,
                None,
                source_tensor(&all, "language_model.model.layers.1.mlp.gate.e_score_correction_bias")
            )
        );
    }
    assert!(m
        .manifest()
        .skipped
        .contains(&"vision_tower.patch_embed.proj.weight".to_string()));
    assert!(m.tensor("vision_tower.patch_embed.proj.weight", 0).is_err());
}

#[test]
fn ep_gives_each_rank_whole_experts() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny::default();
    write_checkpoint(&d.path().join("src"), &t);
    let all = tensors(&t);
    let out = d.path().join("out");
    let (code, _, err) = run(&[
        "repack",
        s(&d.path().join("src")),
        s(&out),
        "--ranks",
        "4",
        "--experts",
        "ep",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let m = ModelDir::open(&out).unwrap();
    let dn = m
        .tensor("language_model.model.layers.1.mlp.experts.down_proj.weight_packed", 3)
        .unwrap();
    assert_eq!(
        (dn.shape, dn.split_axis, dn.split_offset),
        (&[2, 64, 32][..], Some(0), 6)
    );
    let e7 = source_tensor(
        &all,
        "language_model.model.layers.1.mlp.experts.7.down_proj.weight_packed",
    );
    assert_eq!(&dn.data[64 * 32..], e7);
}

#[test]
fn bf16_experts_are_quantized_like_compressed_tensors() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny {
        int4: false,
        ..Tiny::default()
    };
    write_checkpoint(&d.path().join("src"), &t);
    let all = tensors(&t);
    let out = d.path().join("out");
    let (code, _, err) = run(&["repack", s(&d.path().join("src")), s(&out), "--ranks", "2", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let m = ModelDir::open(&out).unwrap();
    assert!(m.manifest().plan.experts_source.starts_with("bf16"));
    let w: Vec<bf16> = source_tensor(&all, "language_model.model.layers.1.mlp.experts.3.down_proj.weight")
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect();
    let q = kdtree_formats::int4::quantize(&w, 64, 64);
    for r in 0..2 {
        let p = m
            .tensor("language_model.model.layers.1.mlp.experts.down_proj.weight_packed", r)
            .unwrap();
        let sc = m
            .tensor("language_model.model.layers.1.mlp.experts.down_proj.weight_scale", r)
            .unwrap();
        for row in 0..64 {
            assert_eq!(
                &p.data[(3 * 64 + row) * 16..][..16],
                &q.packed[row * 32 + 16 * r..][..16],
                "row {row} rank {r}"
            );
            assert_eq!(&sc.data[(3 * 64 + row) * 2..][..2], &q.scale[row * 2 + r].to_le_bytes());
        }
    }
}

#[test]
fn drafter_tensors_are_prefixed_and_split() {
    let d = tempfile::tempdir().unwrap();
    write_checkpoint(&d.path().join("src"), &Tiny::default());
    write_drafter(&d.path().join("dr"), 64);
    let out = d.path().join("out");
    let (code, _, err) = run(&[
        "repack",
        s(&d.path().join("src")),
        s(&out),
        "--ranks",
        "2",
        "--drafter",
        s(&d.path().join("dr")),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let m = ModelDir::open(&out).unwrap();
    assert_eq!(m.drafter_config().unwrap().dflash_config.target_layer_ids, [1, 2]);
    let k = m.tensor("drafter.layers.1.self_attn.k_proj.weight", 1).unwrap();
    assert_eq!((k.shape, k.split_offset), (&[16, 64][..], 16));
    assert_eq!(m.tensor("drafter.fc.weight", 1).unwrap().shape, [64, 128]);
    let (code, stdout, _) = run(&[
        "inspect",
        s(&out),
        "--tensor",
        "language_model.model.layers.1.mlp.experts.up_proj.weight_packed",
    ]);
    assert_eq!(code, 0);
    assert!(
        stdout.contains("rank 1") && stdout.contains("Int4G32") && stdout.contains("dequantized values"),
        "{stdout}"
    );
    assert!(stdout.contains("drafter    2 layers"), "{stdout}");
}

#[test]
fn inspect_reports_plan_and_dequantized_values() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny::default();
    write_checkpoint(&d.path().join("src"), &t);
    let all = tensors(&t);
    let out = d.path().join("out");
    assert_eq!(
        run(&["repack", s(&d.path().join("src")), s(&out), "--ranks", "1", "--quiet"]).0,
        0
    );
    let name = "language_model.model.layers.1.mlp.experts.gate_proj.weight_packed";
    let (code, stdout, _) = run(&["inspect", s(&out), "--tensor", name]);
    assert_eq!(code, 0);
    let packed = source_tensor(
        &all,
        "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed",
    );
    let scale = bf16::from_le_bytes([
        source_tensor(
            &all,
            "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_scale",
        )[0],
        source_tensor(
            &all,
            "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_scale",
        )[1],
    ]);
    let want: Vec<f32> = (0..8)
        .map(|k| kdtree_formats::int4::get(packed, k) as f32 * scale.to_f32())
        .collect();
    assert!(
        stdout.contains(&format!("first values {want:?}")),
        "{stdout}\nwant {want:?}"
    );
    assert!(stdout.contains("plan       ranks 1, experts Tp"), "{stdout}");
    let (code, _, err) = run(&["inspect", s(&out), "--tensor", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("\"nope\""), "{err}");
}

#[test]
fn synth_tiny_with_drafter_round_trips_through_the_cli() {
    let d = tempfile::tempdir().unwrap();
    let (src, out) = (d.path().join("src"), d.path().join("out"));
    let (code, _, err) = run(&["synth", "tiny", s(&src), "--drafter", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&[
        "repack",
        s(&src),
        s(&out),
        "--drafter",
        s(&src.join("drafter")),
        "--max-file-size",
        "1000000",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, stdout, _) = run(&["verify", s(&out), "--quiet"]);
    assert_eq!(code, 0, "{stdout}");
    let m = ModelDir::open(&out).unwrap();
    assert_eq!(m.ranks(), 8);
    assert!(
        m.manifest().skipped.iter().any(|n| n.starts_with("vision_tower."))
            && m.manifest().skipped.iter().any(|n| n.starts_with("mm_projector."))
    );
    let g = m
        .tensor("language_model.model.layers.1.mlp.experts.gate_proj.weight_packed", 7)
        .unwrap();
    assert_eq!((g.shape, g.logical_shape), (&[16, 32, 128][..], &[16, 256, 256][..]));
    assert!(m.drafter_config().is_some());
    // Source INT4 rows 224..256 of expert 3 are rank 7's rows 0..32 of expert 3, byte for byte.
    let sm = kdtree_formats::reader::SafeFile::open(&src.join(idx_file(
        &src,
        "language_model.model.layers.1.mlp.experts.3.gate_proj.weight_packed",
    )))
    .unwrap();
    let (_, sb) = sm
        .tensor("language_model.model.layers.1.mlp.experts.3.gate_proj.weight_packed")
        .unwrap();
    assert_eq!(&g.data[3 * 32 * 128..4 * 32 * 128], &sb[224 * 128..256 * 128]);
}

/// The shard file the index assigns `name` to.
fn idx_file(src: &std::path::Path, name: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("model.safetensors.index.json")).unwrap()).unwrap();
    v["weight_map"][name].as_str().unwrap().to_string()
}

#[test]
fn inspect_into_a_closed_pipe_exits_0() {
    let d = tempfile::tempdir().unwrap();
    write_checkpoint(&d.path().join("src"), &Tiny::default());
    let out = d.path().join("out");
    assert_eq!(
        run(&["repack", s(&d.path().join("src")), s(&out), "--ranks", "2", "--quiet"]).0,
        0
    );
    let mut child = bin()
        .args([
            "inspect",
            s(&out),
            "--tensor",
            "language_model.model.embed_tokens.weight",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // close the read end before the report is written
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
}
