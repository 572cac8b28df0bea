//! Configs the runner would refuse are refused by repack before OUT exists (issue 16 item 9): sizes
//! out of bounds (a 2^31 num_hidden_layers or n_routed_experts must fail at once, not allocate for a
//! minute), n_group not dividing the experts, topk_group > n_group, a drafter whose vocabulary or hidden
//! size differs from the target's, a mask_token_id outside the vocabulary, a tap layer past the target.
//! Each error names config.json (or the drafter's) and the key.

mod common;
use common::*;
use std::path::Path;
use std::time::{Duration, Instant};

fn expect_refused(d: &Path, src: &Path, drafter: Option<&Path>, needles: &[&str]) {
    let out = d.join("out");
    let mut args = vec!["repack", s(src), s(&out), "--ranks", "2", "--quiet"];
    if let Some(dr) = drafter {
        args.extend(["--drafter", s(dr)]);
    }
    let t = Instant::now();
    let (code, _, err) = run(&args);
    assert_eq!(code, 2, "{needles:?}: {err}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "{needles:?}: took {:?}",
        t.elapsed()
    );
    for n in needles {
        assert!(err.contains(n), "missing {n:?} in: {err}");
    }
    assert!(!out.exists(), "{needles:?}: OUT was created");
}

#[test]
fn target_config_bounds_and_rules() {
    let t = Tiny::default();
    let all = tensors(&t);
    for (key, v, want) in [
        (
            "num_hidden_layers",
            serde_json::json!(1u64 << 31),
            "num_hidden_layers = 2147483648 is out of range",
        ),
        (
            "n_routed_experts",
            serde_json::json!(1u64 << 31),
            "n_routed_experts = 2147483648 is out of range",
        ),
        ("vocab_size", serde_json::json!(1u64 << 40), "vocab_size"),
        (
            "n_group",
            serde_json::json!(3),
            "n_group = 3 does not divide n_routed_experts = 8",
        ),
        ("topk_group", serde_json::json!(2), "topk_group = 2 is out of range"),
        (
            "num_experts_per_tok",
            serde_json::json!(9),
            "num_experts_per_tok = 9 is out of range",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = config(&t);
        cfg["text_config"][key] = v;
        write_checkpoint_with(&d.path().join("src"), &t, &cfg, &all);
        expect_refused(d.path(), &d.path().join("src"), None, &["config.json", want]);
    }
}

#[test]
fn drafter_config_must_fit_the_target() {
    for (key, v, want) in [
        (
            "vocab_size",
            serde_json::json!(300),
            "vocab_size = 300 differs from the target's 256",
        ),
        (
            "dflash_config.mask_token_id",
            serde_json::json!(256),
            "mask_token_id = 256 is not below vocab_size = 256",
        ),
        (
            "dflash_config.target_layer_ids",
            serde_json::json!([1, 3]),
            "target_layer_ids holds 3",
        ),
    ] {
        let d = tempfile::tempdir().unwrap();
        let t = Tiny::default();
        write_checkpoint(&d.path().join("src"), &t);
        let dr = d.path().join("drafter");
        write_drafter(&dr, t.hidden);
        let cpath = dr.join("config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
        match key.split_once('.') {
            Some((a, b)) => cfg[a][b] = v,
            None => cfg[key] = v,
        }
        std::fs::write(&cpath, cfg.to_string()).unwrap();
        expect_refused(
            d.path(),
            &d.path().join("src"),
            Some(&dr),
            &["drafter/config.json", want],
        );
    }
}
