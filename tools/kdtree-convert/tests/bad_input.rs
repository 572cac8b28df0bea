//! Bad input → exit 2 with an error naming the file and tensor, and nothing `verify` would accept left
//! in OUT. One test per class: truncated shard, header length overflow, overlapping / out-of-range
//! offsets, dtype×shape ≠ bytes, duplicate names, weight_map naming a missing file or a path outside
//! SRC, a layer missing a tensor, wrong packed/scale shapes, unknown quantization config, ranks that
//! do not divide, group-32 alignment.

mod common;
use common::*;
use std::path::Path;

/// Run repack on `src` into a fresh OUT; expect exit 2 with all of `needles` in stderr; verify must fail.
fn expect_error(d: &Path, src: &Path, extra: &[&str], needles: &[&str]) {
    let out = d.join("out");
    let mut args = vec!["repack", s(src), s(&out), "--quiet"];
    if !extra.contains(&"--ranks") {
        args.extend_from_slice(&["--ranks", "2"]);
    }
    args.extend_from_slice(extra);
    let (code, _, err) = run(&args);
    assert_eq!(code, 2, "expected exit 2, got {code}: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
    assert_eq!(err.matches("error:").count(), 1, "{err}");
    assert_ne!(
        run(&["verify", s(&out), "--quiet"]).0,
        0,
        "verify accepted the output of a failed repack"
    );
}

fn shard(src: &Path, i: usize) -> std::path::PathBuf {
    src.join(format!("model-{:05}-of-{:06}.safetensors", i, 3))
}

/// Replace the JSON header of shard 1 with `f(header)`, keeping the data.
fn edit_header(src: &Path, f: impl Fn(String) -> String) {
    let p = shard(src, 1);
    let b = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h = f(String::from_utf8(b[8..8 + n].to_vec()).unwrap());
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&p, out).unwrap();
}

fn fresh(d: &Path) -> std::path::PathBuf {
    let src = d.join("src");
    write_checkpoint(&src, &Tiny::default());
    src
}

#[test]
fn truncated_shard() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    let p = shard(&src, 2);
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 10]).unwrap();
    expect_error(
        d.path(),
        &src,
        &[],
        &["model-00002-of-000003.safetensors", "tensor \"", "truncated"],
    );
}

#[test]
fn header_length_overflow() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    let p = shard(&src, 1);
    let mut b = std::fs::read(&p).unwrap();
    b[..8].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    std::fs::write(&p, b).unwrap();
    expect_error(
        d.path(),
        &src,
        &[],
        &["model-00001-of-000003.safetensors", "header length"],
    );
}

/// Edit the parsed header of shard 1 (tensors as JSON values, key order kept).
fn edit_json(src: &Path, f: impl Fn(&mut serde_json::Map<String, serde_json::Value>)) {
    edit_header(src, |h| {
        let mut v: serde_json::Value = serde_json::from_str(&h).unwrap();
        f(v.as_object_mut().unwrap());
        v.to_string()
    });
}

/// Name of the tensor of shard 1 with the `i`-th smallest offset.
fn by_offset(m: &serde_json::Map<String, serde_json::Value>, i: usize) -> String {
    let mut v: Vec<(u64, &String)> = m
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, t)| (t["data_offsets"][0].as_u64().unwrap(), k))
        .collect();
    v.sort();
    v[i].1.clone()
}

#[test]
fn overlapping_offsets() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    edit_json(&src, |m| {
        let n = by_offset(m, 1);
        let o = &mut m.get_mut(&n).unwrap()["data_offsets"];
        let (b, e) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
        *o = serde_json::json!([b - 2, e - 2]);
    });
    let f = kdtree_formats::reader::read_header(&shard(&src, 1))
        .err()
        .unwrap()
        .to_string();
    assert!(f.contains("overlaps"), "{f}");
    let victim = f.split('"').nth(1).unwrap();
    expect_error(
        d.path(),
        &src,
        &[],
        &[
            "model-00001-of-000003.safetensors",
            &format!("tensor \"{victim}\""),
            "overlaps the previous tensor",
        ],
    );
}

#[test]
fn out_of_range_offsets() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    edit_json(&src, |m| {
        let last = m
            .values()
            .filter_map(|t| t.get("data_offsets"))
            .map(|o| o[1].as_u64().unwrap())
            .max()
            .unwrap();
        m.insert(
            "zz.beyond".into(),
            serde_json::json!({"dtype": "U8", "shape": [1000], "data_offsets": [last, last + 1000]}),
        );
    });
    expect_error(
        d.path(),
        &src,
        &[],
        &["model-00001-of-000003.safetensors", "tensor \"zz.beyond\"", "truncated"],
    );
}

#[test]
fn dtype_times_shape_differs_from_bytes() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    edit_header(&src, |h| h.replacen("\"dtype\":\"BF16\"", "\"dtype\":\"F32\"", 1));
    expect_error(
        d.path(),
        &src,
        &[],
        &["model-00001-of-000003.safetensors", "tensor \"", "needs"],
    );
}

#[test]
fn duplicate_tensor_names() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    edit_header(&src, |h| {
        let v: serde_json::Value = serde_json::from_str(&h).unwrap();
        let (name, t) = v
            .as_object()
            .unwrap()
            .iter()
            .find(|(k, _)| *k != "__metadata__")
            .unwrap();
        let dup = format!("{}:{}", serde_json::to_string(name).unwrap(), t);
        let trimmed = h.trim_end();
        format!("{},{dup}}}", &trimmed[..trimmed.len() - 1])
    });
    expect_error(
        d.path(),
        &src,
        &[],
        &["model-00001-of-000003.safetensors", "duplicate tensor name"],
    );
}

#[test]
fn weight_map_names_missing_file_or_path_outside_src() {
    for (bad, needle) in [
        ("model-00009-of-000003.safetensors", "does not exist"),
        ("../escape.safetensors", "not a plain file name"),
        ("/etc/passwd", "not a plain file name"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let src = fresh(d.path());
        let ip = src.join("model.safetensors.index.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
        v["weight_map"]["language_model.model.norm.weight"] = serde_json::json!(bad);
        std::fs::write(&ip, v.to_string()).unwrap();
        expect_error(
            d.path(),
            &src,
            &[],
            &[
                "model.safetensors.index.json",
                "language_model.model.norm.weight",
                bad,
                needle,
            ],
        );
    }
}

#[test]
fn layer_missing_a_tensor() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny::default();
    let mut all = tensors(&t);
    all.remove("language_model.model.layers.2.self_attn.kv_b_proj.weight");
    write_checkpoint_with(&d.path().join("src"), &t, &config(&t), &all);
    expect_error(
        d.path(),
        &d.path().join("src"),
        &[],
        &["layer 2 is missing tensor \"language_model.model.layers.2.self_attn.kv_b_proj.weight\""],
    );
}

#[test]
fn wrong_packed_and_scale_shapes() {
    for (suffix, shape, needle) in [
        (
            "weight_packed",
            vec![64usize, 7],
            "expected I32 [64, 8], found I32 [64, 7]",
        ),
        ("weight_scale", vec![64, 1], "expected BF16 [64, 2], found BF16 [64, 1]"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let t = Tiny::default();
        let mut all = tensors(&t);
        let name = format!("language_model.model.layers.1.mlp.experts.4.up_proj.{suffix}");
        let e = all.get_mut(&name).unwrap();
        let es = if suffix == "weight_packed" { 4 } else { 2 };
        e.1 = shape.clone();
        e.2.truncate(shape.iter().product::<usize>() * es);
        write_checkpoint_with(&d.path().join("src"), &t, &config(&t), &all);
        expect_error(
            d.path(),
            &d.path().join("src"),
            &[],
            &[&format!("tensor \"{name}\""), needle],
        );
    }
}

#[test]
fn unknown_quantization_config() {
    let d = tempfile::tempdir().unwrap();
    let t = Tiny::default();
    let mut cfg = config(&t);
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] =
        serde_json::json!(128);
    write_checkpoint_with(&d.path().join("src"), &t, &cfg, &tensors(&t));
    expect_error(
        d.path(),
        &d.path().join("src"),
        &[],
        &["config.json", "unknown quantization config", "group_size\":128"],
    );
    cfg["text_config"]["quantization_config"] = serde_json::json!({"quant_method": "awq"});
    write_checkpoint_with(&d.path().join("src"), &t, &cfg, &tensors(&t));
    expect_error(
        d.path(),
        &d.path().join("src"),
        &[],
        &["unknown quantization config", "awq"],
    );
}

#[test]
fn rank_count_that_does_not_divide_or_breaks_groups() {
    let d = tempfile::tempdir().unwrap();
    let src = fresh(d.path());
    expect_error(
        d.path(),
        &src,
        &["--ranks", "3"],
        &["plan: tensor \"language_model.model", "do not divide over 3 ranks"],
    );
    // moe_intermediate 64 over 4 ranks = 16 columns of down_proj per rank: cuts a 32-group.
    expect_error(
        d.path(),
        &src,
        &["--ranks", "4"],
        &["down_proj.weight_packed", "group-32 alignment", "16 columns per rank"],
    );
    expect_error(
        d.path(),
        &src,
        &["--ranks", "16", "--experts", "ep"],
        &["do not divide over 16 ranks"],
    );
}
