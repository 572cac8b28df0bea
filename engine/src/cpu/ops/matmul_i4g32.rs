//! `y = x · W^T` with W INT4 group-32 (the routed experts), and whole-matrix dequantisation.
//!
//! The nibble decode is the format's own, `kdtree_formats::int4::dequant_row_f32` (k26-format §3.2:
//! packed `[N, K/2]` u8, byte m = u[2m] | u[2m+1] << 4, offset-8; scales `[N, K/32]` bf16): formats owns
//! the layout, so there is one decoder in the workspace. Each weight `(u − 8) · scale` is exact in f32 and
//! then accumulated like matmul_bf16, so `matmul_i4g32(x, ..) == matmul_f32(x, dequant_i4g32_matrix(..))`
//! bit for bit. Reference: §3.3's worked example and an f64 decode from the I32 word view (test below).
//!
//! Dimension letters: T tokens, K input features, N output features.

use super::matmul::matmul_by_row;
use half::bf16;
use kdtree_formats::int4;

fn check_i4(packed: &[u8], scales: &[bf16], n: usize, k: usize, op: &str) {
    assert!(
        k.is_multiple_of(int4::GROUP),
        "{op}: K={k} is not a multiple of the group size 32"
    );
    assert_eq!(
        packed.len(),
        n * k / 2,
        "{op}: packed has {} bytes, expected N={n} x K/2={}",
        packed.len(),
        k / 2
    );
    assert_eq!(
        scales.len(),
        n * k / 32,
        "{op}: scales has {} elements, expected N={n} x K/32={}",
        scales.len(),
        k / 32
    );
}

/// Dequantise a whole `[N, K]` INT4 group-32 matrix to f32 (tests and the absorbed path use it).
pub fn dequant_i4g32_matrix(packed: &[u8], scales: &[bf16], n: usize, k: usize) -> Vec<f32> {
    check_i4(packed, scales, n, k, "dequant_i4g32_matrix");
    let mut w = vec![0f32; n * k]; // [N, K] f32
    for (r, row) in w.chunks_mut(k.max(1)).enumerate().take(n) {
        int4::dequant_row_f32(
            &packed[r * k / 2..(r + 1) * k / 2],
            &scales[r * k / 32..(r + 1) * k / 32],
            row,
        );
    }
    w
}

/// `y[T, N] = x[T, K] · W[N, K]^T` with W INT4 group-32: `packed` `[N, K/2]` u8, `scales` `[N, K/32]` bf16.
pub fn matmul_i4g32(x: &[f32], packed: &[u8], scales: &[bf16], t: usize, k: usize, n: usize) -> Vec<f32> {
    check_i4(packed, scales, n, k, "matmul_i4g32");
    matmul_by_row(x, t, k, n, |row, out| {
        int4::dequant_row_f32(
            &packed[row * k / 2..(row + 1) * k / 2],
            &scales[row * k / 32..(row + 1) * k / 32],
            out,
        );
    })
}

#[cfg(test)]
mod tests {
    use super::super::matmul::test_util::*;
    use super::super::matmul_f32;
    use super::*;
    use rand::Rng;

    #[test]
    fn int4_worked_example_and_matmul() {
        // k26-format §3.3: q = [-8,-1,0,1,7,3,-3,2] packs to LE bytes 70 98 BF A5.
        let mut packed = vec![0x70u8, 0x98, 0xBF, 0xA5];
        packed.extend(std::iter::repeat_n(0x88u8, 12)); // rest of the 32-group: q = 0
        let scales = vec![bf16::from_f32(0.5)];
        let want = [-8, -1, 0, 1, 7, 3, -3, 2];
        let w = dequant_i4g32_matrix(&packed, &scales, 1, 32);
        for (k, &q) in want.iter().enumerate() {
            assert_eq!(w[k], q as f32 * 0.5, "k={k}");
        }
        assert!(w[8..].iter().all(|&v| v == 0.0));
        let mut rng = rng(3);
        let (t, k, n) = (2, 64, 9);
        let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.random::<u8>()).collect();
        let scales = rand_bf16(&mut rng, n * k / 32);
        let x = rand_vec(&mut rng, t * k);
        // Independent f64 decode straight from §3.2 (word view of the bytes).
        let mut w64 = vec![0f64; n * k];
        for r in 0..n {
            for c in 0..k {
                let word = u32::from_le_bytes(packed[r * k / 2 + c / 8 * 4..][..4].try_into().unwrap());
                let u = (word >> (4 * (c % 8))) & 0xF;
                w64[r * k + c] = (u as f64 - 8.0) * scales[r * k / 32 + c / 32].to_f64();
            }
        }
        let y = matmul_i4g32(&x, &packed, &scales, t, k, n);
        let err = max_rel(&y, &naive_matmul(&x, &w64, t, k, n));
        assert!(err < 1e-4, "matmul_i4g32 rel err {err}");
        let wd = dequant_i4g32_matrix(&packed, &scales, n, k);
        assert_eq!(y, matmul_f32(&x, &wd, t, k, n));
    }
}
