//! Embedding gather over vocab-parallel shards: token v's row lives on rank `v / (V/R)` at row `v % (V/R)`
//! (k26-format §5.2: embed_tokens is split along the vocab axis). One path for the target's embed and the
//! drafter's (which borrows the target's table). Reference: the unsplit table's row (test below).
//!
//! Dimension letters: H hidden, V vocab, R shards (each `[V/R, H]` bf16), n tokens.

use super::bf16_to_f32;
use half::bf16;

/// Rows of `tokens` from `shards` (equal `[V/R, H]` bf16 slices in rank order): `[n, H]` f32. Tokens are
/// checked by the callers (a token >= V is a caller bug and panics with both numbers).
pub fn embedding_bf16(shards: &[&[bf16]], h: usize, tokens: &[u32]) -> Vec<f32> {
    assert!(!shards.is_empty() && h > 0, "embedding_bf16: no shards or H = 0");
    let per = shards[0].len() / h; // V/R rows per shard
    let vocab = per * shards.len();
    let mut out = Vec::with_capacity(tokens.len() * h); // [n, H] f32
    for &tok in tokens {
        let tok = tok as usize;
        assert!(tok < vocab, "embedding_bf16: token {tok} >= vocab {vocab}");
        let row = &shards[tok / per][(tok % per) * h..(tok % per + 1) * h];
        out.extend(row.iter().map(|&v| bf16_to_f32(v)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_from_the_owning_shard() {
        // V = 6, H = 2, R = 3: whole table row v = [v, -v].
        let whole: Vec<bf16> = (0..6)
            .flat_map(|v| [bf16::from_f32(v as f32), bf16::from_f32(-(v as f32))])
            .collect();
        let shards: Vec<&[bf16]> = whole.chunks(4).collect();
        assert_eq!(
            embedding_bf16(&shards, 2, &[5, 0, 2]),
            vec![5.0, -5.0, 0.0, 0.0, 2.0, -2.0]
        );
        assert_eq!(embedding_bf16(&shards, 2, &[3]), embedding_bf16(&[&whole], 2, &[3]));
    }
}
