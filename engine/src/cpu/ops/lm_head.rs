//! lm_head over vocab-parallel shards, logits merged in global vocab order (ddtree.md §5.6 item 10): shard
//! r (`[V_r, H]` bf16) computes `x · W_r^T` and its columns go to vocab offset `V_0 + ... + V_{r-1}`.
//! Each logit is one matmul_bf16 dot, so the result equals the unsplit table's bit for bit (test below).
//! [`lm_head_argmax_bf16`] is the vocab-parallel greedy pick: each shard's argmax, merged in global
//! vocab order (larger value wins; on a tie the lower global id, i.e. the earlier shard), equal to
//! `argmax(lm_head_bf16(..))` without forming the `[n, V]` row (test below).
//!
//! Dimension letters: n rows, H hidden, V vocab.

use super::{argmax, matmul_bf16};
use half::bf16;

/// `lm_head(x)` for `x` `[n, H]` f32 (already normed): `[n, V]` f32, V = the shards' rows together.
pub fn lm_head_bf16(x: &[f32], n: usize, h: usize, shards: &[&[bf16]]) -> Vec<f32> {
    let v: usize = shards.iter().map(|s| s.len() / h).sum();
    let mut out = vec![0f32; n * v]; // [n, V] f32
    let mut off = 0;
    for w in shards {
        let vr = w.len() / h;
        let part = matmul_bf16(x, w, n, h, vr); // [n, V_r]
        for i in 0..n {
            out[i * v + off..i * v + off + vr].copy_from_slice(&part[i * vr..(i + 1) * vr]);
        }
        off += vr;
    }
    out
}

/// Greedy token of each row of `lm_head(x)`: per-shard argmax (lowest id on ties, NaN never wins) as a
/// (value, global id) pair, merged across shards in global vocab order ([`merge_argmax_pairs`]). Returns `[n]`
/// token ids.
pub fn lm_head_argmax_bf16(x: &[f32], n: usize, h: usize, shards: &[&[bf16]]) -> Vec<u32> {
    let mut pairs = vec![0f32; n * shards.len() * 2]; // [n, shards, 2]
    let mut off = 0usize;
    for (j, w) in shards.iter().enumerate() {
        let vr = w.len() / h;
        argmax_pairs(&matmul_bf16(x, w, n, h, vr), n, off, &mut pairs, j, shards.len());
        off += vr;
    }
    (0..n)
        .map(|i| merge_argmax_pairs(&pairs[i * shards.len() * 2..(i + 1) * shards.len() * 2]))
        .collect()
}

/// One vocab shard's argmax pairs: for each of the `n` rows of `part` (`[n, V_r]` logits, global ids
/// `id0..id0 + V_r`), its best (value, global id as f32) into slot `slot` of `pairs` (`[n, slots, 2]`), or
/// (NaN, 0) for an all-NaN row. CUDA twin: kernels/cuda/argmax.cu `kdtree_argmax_pair_f32`.
pub fn argmax_pairs(part: &[f32], n: usize, id0: usize, pairs: &mut [f32], slot: usize, slots: usize) {
    let vr = part.len() / n.max(1);
    for i in 0..n {
        let row = &part[i * vr..(i + 1) * vr];
        let k = argmax(row) as usize;
        let p = &mut pairs[(i * slots + slot) * 2..][..2];
        (p[0], p[1]) = match row.get(k) {
            Some(&b) if !b.is_nan() => (b, (id0 + k) as f32),
            _ => (f32::NAN, 0.0),
        };
    }
}

/// The merge of a row's per-shard argmax pairs `[(value, global id as f32); shards]` in shard (global vocab)
/// order: the larger value wins, NaN never, the earlier shard on ties (so the lower global id: each shard's own
/// argmax is its lowest); 0 when every value is NaN. Ids must be below 2^24 (exact as f32).
/// CUDA twin: kernels/cuda/argmax.cu `kdtree_argmax_merge_pairs`.
pub fn merge_argmax_pairs(pairs: &[f32]) -> u32 {
    let mut best: Option<(f32, u32)> = None;
    for p in pairs.chunks_exact(2) {
        if p[0].is_nan() {
            continue;
        }
        if best.is_none_or(|(b, _)| p[0] > b) {
            best = Some((p[0], p[1] as u32));
        }
    }
    best.map_or(0, |(_, id)| id)
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::*;

    #[test]
    fn sharded_equals_unsplit_bit_for_bit() {
        let mut rng = rng(11);
        let (n, h, v) = (3, 40, 24);
        let x = rand_vec(&mut rng, n * h);
        let w = rand_bf16(&mut rng, v * h);
        let whole = lm_head_bf16(&x, n, h, &[&w]);
        assert_eq!(whole, matmul_bf16(&x, &w, n, h, v));
        for r in [2, 3, 8] {
            let shards: Vec<&[bf16]> = w.chunks(v / r * h).collect();
            assert_eq!(lm_head_bf16(&x, n, h, &shards), whole, "R = {r}");
        }
    }

    #[test]
    fn sharded_argmax_equals_argmax_of_the_merged_row() {
        let mut rng = rng(12);
        let (n, h, v) = (4, 16, 24);
        let x = rand_vec(&mut rng, n * h);
        let mut w = rand_bf16(&mut rng, v * h);
        // Rows 5 and 17 (different shards for R >= 2) get identical weights: a cross-shard tie.
        let row5: Vec<bf16> = w[5 * h..6 * h].to_vec();
        w[17 * h..18 * h].copy_from_slice(&row5);
        let full = lm_head_bf16(&x, n, h, &[&w]);
        let want: Vec<u32> = full.chunks(v).map(argmax).collect();
        for r in [1, 2, 3, 4, 8] {
            let shards: Vec<&[bf16]> = w.chunks(v / r * h).collect();
            assert_eq!(lm_head_argmax_bf16(&x, n, h, &shards), want, "R = {r}");
        }
        // The tie resolves to the lower id whenever row 5 / 17 is the best.
        let xt: Vec<f32> = bf16_row_as_query(&row5);
        let ids = lm_head_argmax_bf16(&xt, 1, h, &w.chunks(v / 4 * h).collect::<Vec<_>>());
        assert_eq!(ids, vec![argmax(&lm_head_bf16(&xt, 1, h, &[&w]))]);
    }

    #[test]
    fn the_merge_skips_nan_and_keeps_the_earlier_shard_on_ties() {
        let nan = f32::NAN;
        assert_eq!(
            merge_argmax_pairs(&[1.0, 3.0, 2.0, 9.0, 2.0, 12.0]),
            9,
            "larger value; tie keeps the earlier"
        );
        assert_eq!(
            merge_argmax_pairs(&[nan, 0.0, -5.0, 7.0, nan, 0.0]),
            7,
            "NaN never wins"
        );
        assert_eq!(merge_argmax_pairs(&[nan, 0.0, nan, 0.0]), 0, "all NaN gives 0");
        assert_eq!(merge_argmax_pairs(&[f32::NEG_INFINITY, 4.0, f32::NEG_INFINITY, 8.0]), 4);
        assert_eq!(merge_argmax_pairs(&[-0.0, 1.0, 0.0, 2.0]), 1, "+0 and -0 are a tie");
    }

    /// A query aligned with a weight row (so that row very likely wins).
    fn bf16_row_as_query(row: &[bf16]) -> Vec<f32> {
        row.iter().map(|v| v.to_f32() * 10.0).collect()
    }
}
