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

/// Greedy token of each row of `lm_head(x)`: per-shard argmax (lowest id on ties, NaN never wins), merged
/// across shards in global vocab order. Returns `[n]` token ids.
pub fn lm_head_argmax_bf16(x: &[f32], n: usize, h: usize, shards: &[&[bf16]]) -> Vec<u32> {
    let mut best: Vec<Option<(f32, u32)>> = vec![None; n];
    let mut off = 0u32;
    for w in shards {
        let vr = w.len() / h;
        let part = matmul_bf16(x, w, n, h, vr); // [n, V_r]
        for (i, b) in best.iter_mut().enumerate() {
            let row = &part[i * vr..(i + 1) * vr];
            let j = argmax(row) as usize;
            let v = row.get(j).copied().unwrap_or(f32::NAN);
            // Strictly greater replaces: ties keep the earlier shard (lower global id).
            let better = match *b {
                None => true,
                Some((bv, _)) => v > bv || (bv.is_nan() && !v.is_nan()),
            };
            if better {
                *b = Some((v, off + j as u32));
            }
        }
        off += vr as u32;
    }
    best.into_iter().map(|b| b.map_or(0, |(_, id)| id)).collect()
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

    /// A query aligned with a weight row (so that row very likely wins).
    fn bf16_row_as_query(row: &[bf16]) -> Vec<f32> {
        row.iter().map(|v| v.to_f32() * 10.0).collect()
    }
}
