//! lm_head over vocab-parallel shards, logits merged in global vocab order (ddtree.md §5.6 item 10): shard
//! r (`[V_r, H]` bf16) computes `x · W_r^T` and its columns go to vocab offset `V_0 + ... + V_{r-1}`.
//! Each logit is one matmul_bf16 dot, so the result equals the unsplit table's bit for bit (test below).
//!
//! Dimension letters: n rows, H hidden, V vocab.

use super::matmul_bf16;
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
}
