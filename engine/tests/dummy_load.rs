//! `--load-format dummy` on the CPU: [`DummySource`] lists exactly the tensors a real conversion writes for
//! a rank (the tiny preset, synthesized and repacked for 2 ranks), fills are deterministic and seeded and
//! stay in their stated ranges (cpu::ops::fill, model/dummy.rs), and a dummy model — whole, or the rank
//! slice 1 of 2 — runs: finite logits, and greedy DDTree equals greedy AR through the sliced drafter.
//! The CUDA twins are checked against these CPU fills in engine/tests/cuda_target.rs.

use kdtree_convert::repack::{repack, RepackOptions, DEFAULT_MAX_FILE_SIZE};
use kdtree_convert::synth::{configs, resolve};
use kdtree_engine::cpu::ops::{fill_bf16, fill_f32, fill_u8, Fill};
use kdtree_engine::generate::{generate_on, GenRequest, Mode, Sampling};
use kdtree_engine::model::dummy::tensor_seed;
use kdtree_engine::model::open::open_dummy;
use kdtree_engine::model::{DummySource, TensorSource};
use kdtree_engine::{Device, Loaded, OpenOptions};
use kdtree_formats::plan::ExpertsMode;
use kdtree_formats::ModelDir;

/// The tiny preset's config.json and drafter config.json bodies (what synth writes).
fn tiny_configs() -> (String, String) {
    let p = resolve("tiny", None).unwrap();
    (
        configs::model_config(&p).to_string(),
        configs::drafter_config(&p).to_string(),
    )
}

fn dummy(ranks: usize, rank: usize, seed: u64) -> DummySource {
    let (c, d) = tiny_configs();
    DummySource::from_json(
        "tiny/config.json",
        &c,
        Some(("tiny/drafter/config.json", &d)),
        ranks,
        rank,
        seed,
    )
    .unwrap()
}

fn open(ranks: usize, rank: usize, seed: u64) -> Loaded {
    let opts = OpenOptions {
        attn_mode: kdtree_engine::AttnMode::Absorbed,
        ..Default::default()
    };
    open_dummy(dummy(ranks, rank, seed), Device::Cpu, opts).unwrap()
}

#[test]
fn dummy_lists_exactly_the_converted_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("hf"), tmp.path().join("kd"));
    kdtree_convert::synth::write("tiny", &src, 3, true, None).unwrap();
    let opts = RepackOptions {
        src: src.clone(),
        out: out.clone(),
        drafter: Some(src.join("drafter")),
        ranks: 2,
        experts: ExpertsMode::Tp,
        max_file_size: DEFAULT_MAX_FILE_SIZE,
        quiet: true,
    };
    repack(&opts).unwrap();
    let md = ModelDir::open(&out).unwrap();
    // From the files synth wrote, as kdtree-run reads a config directory.
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap();
    let (c, d) = (read(&src.join("config.json")), read(&src.join("drafter/config.json")));
    let ds = DummySource::from_json("config.json", &c, Some(("drafter/config.json", &d)), 2, 1, 7).unwrap();
    let real: Vec<_> = md.manifest().tensors.iter().filter(|t| t.rank == 1).collect();
    assert_eq!(ds.listing().len(), real.len(), "tensor count of rank 1");
    for t in &real {
        let x = ds.tensor(&t.name, 1).unwrap_or_else(|e| panic!("{}: {e:#}", t.name));
        assert_eq!(
            (x.dtype, x.shape, x.logical_shape, x.layout),
            (t.dtype, &t.shape[..], &t.logical_shape[..], t.layout),
            "{}",
            t.name
        );
        assert_eq!(
            (x.split_axis, x.split_offset),
            (t.split_axis, t.split_offset),
            "{} split",
            t.name
        );
        assert!(
            x.data.is_empty() && ds.fill(&t.name, 1).is_some(),
            "{}: no bytes, a fill",
            t.name
        );
    }
    assert_eq!(ds.bytes(), real.iter().map(|t| t.nbytes).sum::<u64>());
    assert_eq!((ds.ranks(), ds.slice_rank()), (2, Some(1)));
    let Err(e) = ds.tensor(&real[0].name, 0) else {
        panic!("rank 0 is not held")
    };
    let e = e.to_string();
    assert!(e.contains(&real[0].name) && e.contains("rank 1 of 2"), "{e}");
    let Err(e) = ds.tensor("nope.weight", 1) else {
        panic!("not in the plan")
    };
    let e = e.to_string();
    assert!(e.contains("nope.weight"), "{e}");
}

#[test]
fn fills_are_deterministic_seeded_and_in_range() {
    let u = |seed| Fill::Uniform {
        seed,
        center: 0.0,
        half: 0.0625,
    };
    let a = fill_bf16(10_001, &u(1)).unwrap();
    assert_eq!(a, fill_bf16(10_001, &u(1)).unwrap(), "same seed, same values");
    assert_ne!(a, fill_bf16(10_001, &u(2)).unwrap(), "seed matters");
    assert!(a.iter().all(|x| x.to_f32().abs() <= 0.0625), "U(-a, a)");
    let mean = a.iter().map(|x| x.to_f32() as f64).sum::<f64>() / a.len() as f64;
    let ms = a.iter().map(|x| (x.to_f32() as f64).powi(2)).sum::<f64>() / a.len() as f64;
    assert!(
        mean.abs() < 2e-3 && (ms - 0.0625f64.powi(2) / 3.0).abs() < 1.5e-4,
        "mean {mean}, mean square {ms}"
    );
    let norms = fill_f32(
        4096,
        &Fill::Uniform {
            seed: 3,
            center: 1.0,
            half: 0.1,
        },
    )
    .unwrap();
    assert!(
        norms.iter().all(|&x| (0.9..=1.1).contains(&x))
            && norms.iter().any(|&x| x < 0.95)
            && norms.iter().any(|&x| x > 1.05)
    );
    let bytes = fill_u8(4099, &Fill::Bytes { seed: 9 }).unwrap();
    assert_eq!(bytes, fill_u8(4099, &Fill::Bytes { seed: 9 }).unwrap());
    let mut seen = [[0usize; 16]; 2];
    for b in &bytes {
        seen[0][(b & 15) as usize] += 1;
        seen[1][(b >> 4) as usize] += 1;
    }
    assert!(
        seen.iter().flatten().all(|&n| n > 4099 / 16 / 2),
        "both nibbles uniform over 0..15: {seen:?}"
    );
    assert!(
        fill_u8(4, &u(1)).is_err() && fill_bf16(4, &Fill::Bytes { seed: 1 }).is_err(),
        "kind mismatch is an error"
    );
    // Per-tensor seeds differ by name and by rank.
    let s = tensor_seed(0, 0, "a.weight");
    assert!(
        s != tensor_seed(0, 1, "a.weight") && s != tensor_seed(0, 0, "b.weight") && s != tensor_seed(1, 0, "a.weight")
    );
    // The source's fills follow (seed, rank, name).
    let (d0, d1) = (dummy(1, 0, 5), dummy(1, 0, 5));
    let name = "language_model.model.layers.1.mlp.experts.down_proj.weight_scale";
    assert_eq!(d0.fill(name, 0), d1.fill(name, 0));
    assert_ne!(d0.fill(name, 0), dummy(1, 0, 6).fill(name, 0));
    let Some(Fill::Uniform { center, half, .. }) = d0.fill(name, 0) else {
        panic!("scales are uniform")
    };
    // down_proj K = moe_intermediate 256: scales U(0.5, 1.5) / (8 sqrt 256).
    assert_eq!((center, half), (1.0 / 128.0, 0.5 / 128.0));
}

/// Greedy logits of `prompt` through `l`'s target.
fn last_logits(l: &mut Loaded, prompt: &[u32]) -> Vec<f32> {
    let n = prompt.len();
    let v = l.target.info().vocab_size;
    let o = l
        .target
        .forward(prompt, &(0..n as i32).map(|i| i - 1).collect::<Vec<_>>())
        .unwrap();
    l.target.reset();
    o.logits[(n - 1) * v..].to_vec()
}

#[test]
fn a_dummy_model_runs_whole_and_as_a_rank_slice() {
    let prompt = [1u32, 300, 5, 9, 511];
    let mut whole = open(1, 0, 11);
    assert_eq!(whole.target.info().vocab_size, 1024);
    let a = last_logits(&mut whole, &prompt);
    assert!(a.iter().all(|x| x.is_finite()), "finite logits");
    let spread = a.iter().cloned().fold(f32::MIN, f32::max) - a.iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 1e-3, "logits vary ({spread})");
    assert_eq!(a, last_logits(&mut open(1, 0, 11), &prompt), "same seed, same model");
    assert_ne!(
        a,
        last_logits(&mut open(1, 0, 12), &prompt),
        "another seed, another model"
    );

    // Rank 1 of 2: that rank's heads, expert slices and V/R = 512 vocabulary rows, run alone.
    let mut slice = open(2, 1, 11);
    assert_eq!(slice.target.info().vocab_size, 512);
    let b = last_logits(&mut slice, &prompt);
    assert!(b.len() == 512 && b.iter().all(|x| x.is_finite()));
    assert!(slice.target.forward(&[512], &[-1]).is_err(), "ids stay below V/R");
    let d = slice.drafter.as_mut().expect("the sliced drafter");
    assert_eq!(d.block_size(), 8, "the preset's block");
    let req = |mode| GenRequest {
        prompt: prompt.to_vec(),
        max_tokens: 10,
        stop_token_ids: vec![],
        sampling: Sampling::greedy(),
        mode,
    };
    let ar = generate_on(&mut *slice.target, None, &req(Mode::Ar), &mut |_| false).unwrap();
    assert_eq!(ar.tokens.len(), 10);
    assert!(ar.tokens.iter().all(|&t| t < 512));
    for budget in [4, 16] {
        let drafter = slice.drafter.as_deref_mut().unwrap();
        let dd = generate_on(
            &mut *slice.target,
            Some(drafter),
            &req(Mode::DDTree { budget }),
            &mut |_| false,
        )
        .unwrap();
        assert_eq!(
            dd.tokens, ar.tokens,
            "greedy DDTree == AR on the slice, budget {budget}"
        );
    }
}

/// The TP8 rank-0 slice of the full K2.6 (+ its DFlash drafter) is planned without allocating anything,
/// and its bytes fit one H200 (139 GiB) with room for caches and activations.
#[test]
fn k26_rank0_slice_fits_one_h200() {
    let p = resolve("k26", None).unwrap();
    let (c, d) = (
        configs::model_config(&p).to_string(),
        configs::drafter_config(&p).to_string(),
    );
    let ds = DummySource::from_json("k26/config.json", &c, Some(("k26/drafter/config.json", &d)), 8, 0, 0).unwrap();
    let (all, drafter): (u64, u64) = ds.listing().iter().fold((0, 0), |(a, dr), (n, dt, s)| {
        let b = kdtree_formats::dtype::byte_len(*dt, s).unwrap() as u64;
        (a + b, dr + if n.starts_with("drafter.") { b } else { 0 })
    });
    println!(
        "k26 rank 0 of 8: {:.2} GB ({:.2} GiB), drafter {:.2} GB",
        all as f64 / 1e9,
        all as f64 / (1u64 << 30) as f64,
        drafter as f64 / 1e9
    );
    assert_eq!(all, ds.bytes());
    assert!(all < 100 << 30, "{all} bytes do not leave room on a 139 GiB H200");
    // The slice's routed experts: 60 MoE layers x 3 projections x 384 experts of 256 x 7168 INT4 + scales
    // (k26-format §5.3: 66.45 GiB per rank under TP8).
    let routed: u64 = ds
        .listing()
        .iter()
        .filter(|(n, _, _)| n.contains(".mlp.experts."))
        .map(|(_, dt, s)| kdtree_formats::dtype::byte_len(*dt, s).unwrap() as u64)
        .sum();
    assert_eq!(routed, 60 * 3 * 384 * (256 * 7168 / 2 + 256 * 7168 / 32 * 2));
    assert!((routed as f64 / (1u64 << 30) as f64 - 66.45).abs() < 0.01, "{routed}");
}
