//! A tiny random DFlash drafter held in memory (shared by ddtree_drafter.rs and cuda_drafter.rs), and the
//! checks both backends run on it.
#![allow(dead_code)]

use half::bf16;
use kdtree_engine::api::Drafter;
use kdtree_engine::backend::Backend;
use kdtree_engine::drafter::{DFlashDrafter, DenseTables, DrafterDims, DrafterWeights, STASH_ROWS};
use kdtree_formats::config::{parse_drafter_config, DrafterConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const H: usize = 32;
pub const V: usize = 40;
pub const N_TAPS: usize = 2;

pub fn config(block: usize) -> DrafterConfig {
    let json = format!(
        r#"{{"hidden_size": {H}, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 48, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {{"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
        "max_position_embeddings": 256, "vocab_size": {V}, "num_target_layers": 4,
        "dflash_config": {{"target_layer_ids": [0, 2], "mask_token_id": 39, "block_size": {block}}}}}"#
    );
    parse_drafter_config("test", &json).unwrap()
}

pub fn seeded(name: &str, n: usize, center: f32, spread: f32) -> Vec<bf16> {
    let seed = name.bytes().fold(1469598103934665603u64, |h, b| {
        (h ^ b as u64).wrapping_mul(1099511628211)
    });
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| bf16::from_f32(center + rng.random_range(-spread..spread)))
        .collect()
}

/// Random weights keyed by tensor name (independent of load order); norms near 1, linears ~ 1/sqrt(in).
pub fn weights(d: &DrafterDims) -> DrafterWeights {
    DrafterWeights::load_with(d, |name, shape| {
        let n = shape.iter().product();
        Ok(if shape.len() == 1 {
            seeded(name, n, 1.0, 0.2)
        } else {
            seeded(name, n, 0.0, 1.7 / (shape[1] as f32).sqrt())
        })
    })
    .unwrap()
}

pub fn tables() -> DenseTables {
    DenseTables {
        hidden: H,
        vocab: V,
        embed_tokens: seeded("embed", V * H, 0.0, 1.0),
        lm_head: seeded("lm_head", V * H, 0.0, 0.3),
    }
}

/// `rows` rows of random taps `[rows, N_TAPS·H]` from `seed`.
pub fn taps_seeded(rows: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..rows * N_TAPS * H).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

/// `DFlashDrafter::flush_batch` writes what each drafter's own `flush` writes, bit for bit: `n` sessions forked
/// from `base`, each with its own context (0 to 70 rows) and its own stash (0 to STASH_ROWS rows, put there as
/// feed steps put them: `stash_room`, `stash_rows`, `stash_follow`), flushed one by one in one copy and
/// together in the other (more than FLUSH_ROWS rows in all when n is large: several forwards); then every
/// session's context length and its next draft are compared. `b` makes the host taps where the ops run.
pub fn flush_batch_equals_each_flush<B: Backend>(base: &DFlashDrafter<B>, b: &B, n: usize, label: &str) {
    let w = base.dims().n_taps * base.dims().hidden;
    let prompt = |i: usize| [0usize, 1, 7, 70, 16, 33][i % 6];
    let stash = |i: usize| [3usize, 0, STASH_ROWS, 1, 17, STASH_ROWS - 1, 40][i % 7];
    let make = || -> Vec<DFlashDrafter<B>> {
        (0..n)
            .map(|i| {
                let mut d = base.fork();
                let p = prompt(i);
                if p > 0 {
                    d.extend_context_act(&b.act_from_host(taps_seeded(p, i as u64)), p)
                        .unwrap();
                }
                for r in 0..stash(i) {
                    d.stash_room().unwrap();
                    let row = taps_seeded(1, 1000 * i as u64 + r as u64);
                    assert_eq!(row.len(), w);
                    DFlashDrafter::stash_rows(&mut [&mut d], &b.act_from_host(row)).unwrap();
                    d.stash_follow();
                }
                assert_eq!(d.stashed(), stash(i));
                d
            })
            .collect()
    };
    let mut alone = make();
    for d in alone.iter_mut() {
        d.flush().unwrap();
    }
    let mut together = make();
    {
        let mut refs: Vec<&mut DFlashDrafter<B>> = together.iter_mut().collect();
        DFlashDrafter::flush_batch(&mut refs).unwrap();
    }
    let rows: usize = (0..n).map(stash).sum();
    for (i, (a, t)) in alone.iter_mut().zip(together.iter_mut()).enumerate() {
        assert_eq!(t.stashed(), 0, "{label}: session {i} still has stashed rows");
        let len = prompt(i) + stash(i);
        assert_eq!((a.context_len(), t.context_len()), (len, len), "{label}: session {i}");
        let bonus = (i % (V - 1)) as u32;
        let (x, y) = (a.draft(bonus, len).unwrap(), t.draft(bonus, len).unwrap());
        assert!(
            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()) && x.len() == y.len(),
            "{label}: session {i} (context {}, stash {}): its draft after a batch's flush differs from alone",
            prompt(i),
            stash(i)
        );
    }
    println!("PARITY {label}: flush_batch of {n} sessions ({rows} stashed rows) == each flush, exact");
}
