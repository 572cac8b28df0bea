//! INT4 group-32 symmetric helpers for compressed-tensors `pack-quantized` weights (Kimi K2.6 routed experts).
//!
//! Must match compressed-tensors bit-exactly (shared k26-format.md §3):
//! * layout: element `k` of a row sits in I32 word `k/8`, bits `4*(k%8)..+3` (element `8w+j` in bits `4j..4j+3`),
//!   stored as offset-8 `u = q + 8`; read as little-endian bytes, byte `m` holds element `2m` in its low nibble
//!   and `2m+1` in its high nibble. Decode: `q = ((byte >> 4*(k&1)) & 0xF) - 8`.
//! * dequantize (`forward_helpers._dequantize`): `w = q.to(scale.dtype) * scale`, i.e. with BF16 scales the
//!   library's result is `bf16(q * scale)`; the exact product `q * scale` is what [`dequant_row_f32`] returns.
//! * quantize (compressor fed with `calculate_qparams` scales, as the min-max observer does):
//!   per group of 32 along K, in the weight dtype BF16:
//!   `amax = max(|min(group, 0)|, max(group, 0))`; `scale = bf16(f32(amax) / 7.5)`; a zero scale becomes
//!   `finfo(bf16).eps` = 2^-7; `q = round_half_even(clamp(bf16(f32(x) / f32(scale)), -8, 7))`.
//!   The division result is rounded to BF16 *before* rounding to an integer (torch computes bf16/bf16 in f32
//!   and rounds the quotient to bf16), which matters near .5 boundaries.
//!
//! Tested here (worked example of §3.3, round trips, edge cases) and bit-exactly against the real library in
//! tools/kdtree-convert/tests/ct_fixture.rs (fixture made by tools/kdtree-convert/fixtures/make_ct_fixture.py).

use half::bf16;

/// Elements per quantization group (one BF16 scale per group, along K).
pub const GROUP: usize = 32;
/// Elements per packed I32 word.
pub const PER_WORD: usize = 8;
/// Offset of the stored unsigned nibble: `u = q + 8`.
pub const OFFSET: i8 = 8;
/// Signed range of a quantized value.
pub const Q_MIN: i8 = -8;
pub const Q_MAX: i8 = 7;
/// compressed-tensors replaces a zero scale by `torch.finfo(bfloat16).eps` (2^-7).
pub const ZERO_SCALE_EPS: f32 = 0.0078125;

/// Signed value of element `k` from the byte that holds it (`packed_row[k / 2]`).
#[inline]
pub fn nibble(byte: u8, k: usize) -> i8 {
    ((byte >> (4 * (k & 1))) & 0xF) as i8 - OFFSET
}

/// Signed value of element `k` of a packed row (bytes of the row's I32 words, little-endian).
#[inline]
pub fn get(packed_row: &[u8], k: usize) -> i8 {
    nibble(packed_row[k / 2], k)
}

/// Signed value of element `j` (0..8) of one packed I32 word (bits treated as u32).
#[inline]
pub fn word_lane(word: u32, j: usize) -> i8 {
    ((word >> (4 * j)) & 0xF) as i8 - OFFSET
}

/// Unpack a whole row of `q.len()` elements (must be even) into signed values.
pub fn unpack_row(packed_row: &[u8], q: &mut [i8]) {
    assert!(
        q.len().is_multiple_of(2) && packed_row.len() * 2 >= q.len(),
        "unpack_row: length mismatch"
    );
    for (m, pair) in q.chunks_exact_mut(2).enumerate() {
        let b = packed_row[m];
        pair[0] = (b & 0xF) as i8 - OFFSET;
        pair[1] = (b >> 4) as i8 - OFFSET;
    }
}

/// Exact dequantization of one row into f32: `out[k] = q[k] * scale[k / 32]` (exact: 4-bit × 8-bit mantissa).
/// `scales` are BF16 bit patterns or values; `out.len()` = K, a multiple of 32.
pub fn dequant_row_f32(packed_row: &[u8], scales: &[bf16], out: &mut [f32]) {
    let k = out.len();
    assert!(k.is_multiple_of(GROUP), "K={k} not a multiple of {GROUP}");
    assert!(
        packed_row.len() * 2 == k && scales.len() == k / GROUP,
        "dequant_row_f32: shape mismatch"
    );
    for (g, (dst, src)) in out
        .chunks_exact_mut(GROUP)
        .zip(packed_row.chunks_exact(GROUP / 2))
        .enumerate()
    {
        let s = scales[g].to_f32();
        for (pair, &b) in dst.chunks_exact_mut(2).zip(src) {
            pair[0] = ((b & 0xF) as i8 - OFFSET) as f32 * s;
            pair[1] = ((b >> 4) as i8 - OFFSET) as f32 * s;
        }
    }
}

/// Dequantization exactly as compressed-tensors returns it for BF16 scales: `bf16(q * scale)`.
pub fn dequant_row_bf16(packed_row: &[u8], scales: &[bf16], out: &mut [bf16]) {
    let mut tmp = vec![0f32; out.len()];
    dequant_row_f32(packed_row, scales, &mut tmp);
    for (o, v) in out.iter_mut().zip(tmp) {
        *o = bf16::from_f32(v);
    }
}

/// Pack 8 signed values (each in [-8, 7]) into one word: element `j` in bits `4j..4j+3`, offset 8.
#[inline]
pub fn pack_word(q: &[i8]) -> u32 {
    debug_assert!(q.len() == PER_WORD);
    let mut w = 0u32;
    for (j, &v) in q.iter().enumerate() {
        debug_assert!((Q_MIN..=Q_MAX).contains(&v), "q={v} out of int4 range");
        w |= (((v + OFFSET) as u32) & 0xF) << (4 * j);
    }
    w
}

/// Pack a row of signed values (length a multiple of 8) into I32 words, as compressed-tensors `pack_to_int32`.
pub fn pack_row_words(q: &[i8]) -> Vec<i32> {
    assert!(
        q.len().is_multiple_of(PER_WORD),
        "row length {} not a multiple of 8",
        q.len()
    );
    q.chunks_exact(PER_WORD).map(|c| pack_word(c) as i32).collect()
}

/// Pack a row into its on-disk bytes (little-endian words; byte `m` = `u[2m] | u[2m+1] << 4`).
pub fn pack_row_bytes(q: &[i8], out: &mut [u8]) {
    assert!(
        q.len().is_multiple_of(2) && out.len() * 2 == q.len(),
        "pack_row_bytes: length mismatch"
    );
    for (o, pair) in out.iter_mut().zip(q.chunks_exact(2)) {
        debug_assert!(pair.iter().all(|v| (Q_MIN..=Q_MAX).contains(v)));
        *o = ((pair[0] + OFFSET) as u8 & 0xF) | (((pair[1] + OFFSET) as u8 & 0xF) << 4);
    }
}

/// Symmetric scale of one group, as `calculate_qparams` computes it in BF16.
pub fn group_scale(group: &[bf16]) -> bf16 {
    // min(x, 0) and max(x, 0), then max(|min|, |max|): all exact in bf16.
    let mut amax = 0f32;
    for &x in group {
        let a = x.to_f32().abs();
        if a > amax {
            amax = a;
        }
    }
    let s = bf16::from_f32(amax / 7.5);
    if s.to_f32() == 0.0 {
        bf16::from_f32(ZERO_SCALE_EPS)
    } else {
        s
    }
}

/// Quantize one value with its group scale: `round_half_even(clamp(bf16(x / s), -8, 7))`.
#[inline]
pub fn quantize_value(x: bf16, s: bf16) -> i8 {
    let scaled = bf16::from_f32(x.to_f32() / s.to_f32()).to_f32();
    scaled.clamp(Q_MIN as f32, Q_MAX as f32).round_ties_even() as i8
}

/// Quantize one row of K BF16 values: writes K/32 scales and K/2 packed bytes.
pub fn quantize_row(row: &[bf16], scales: &mut [bf16], packed: &mut [u8]) {
    let k = row.len();
    assert!(k.is_multiple_of(GROUP), "K={k} not a multiple of {GROUP}");
    assert!(
        scales.len() == k / GROUP && packed.len() == k / 2,
        "quantize_row: shape mismatch"
    );
    let mut q = [0i8; GROUP];
    for ((grp, s_out), p_out) in row
        .chunks_exact(GROUP)
        .zip(scales.iter_mut())
        .zip(packed.chunks_exact_mut(GROUP / 2))
    {
        let s = group_scale(grp);
        *s_out = s;
        for (qv, &x) in q.iter_mut().zip(grp) {
            *qv = quantize_value(x, s);
        }
        pack_row_bytes(&q, p_out);
    }
}

/// A weight `[N, K]` in compressed-tensors pack-quantized form.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub n: usize,
    pub k: usize,
    /// `weight_packed` I32 `[N, K/8]` as little-endian bytes (`N * K / 2` bytes).
    pub packed: Vec<u8>,
    /// `weight_scale` BF16 `[N, K/32]`.
    pub scale: Vec<bf16>,
}

/// Quantize a BF16 weight `[N, K]` (row-major) exactly as compressed-tensors' int4 group-32 symmetric compressor.
pub fn quantize(weight: &[bf16], n: usize, k: usize) -> Quantized {
    assert_eq!(
        weight.len(),
        n * k,
        "quantize: weight has {} values, expected {n}x{k}",
        weight.len()
    );
    let mut packed = vec![0u8; n * k / 2];
    let mut scale = vec![bf16::ZERO; n * k / GROUP];
    if k > 0 {
        for ((row, s), p) in weight
            .chunks_exact(k)
            .zip(scale.chunks_exact_mut(k / GROUP))
            .zip(packed.chunks_exact_mut(k / 2))
        {
            quantize_row(row, s, p);
        }
    }
    Quantized { n, k, packed, scale }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE_Q: [i8; 8] = [-8, -1, 0, 1, 7, 3, -3, 2];

    #[test]
    fn worked_example_packs_to_0xa5bf9870() {
        let w = pack_word(&EXAMPLE_Q);
        assert_eq!(w, 0xA5BF9870);
        assert_eq!(w as i32, -1_514_170_256);
        assert_eq!(pack_row_words(&EXAMPLE_Q), vec![-1_514_170_256]);
        let mut bytes = [0u8; 4];
        pack_row_bytes(&EXAMPLE_Q, &mut bytes);
        assert_eq!(bytes, [0x70, 0x98, 0xBF, 0xA5]);
        assert_eq!(bytes, w.to_le_bytes());
        // XOR 0x88 gives two's-complement nibbles (§3.4).
        assert_eq!(bytes.map(|b| b ^ 0x88), [0xF8, 0x10, 0x37, 0x2D]);
    }

    #[test]
    fn worked_example_decodes() {
        let bytes = 0xA5BF9870u32.to_le_bytes();
        for (k, &q) in EXAMPLE_Q.iter().enumerate() {
            assert_eq!(get(&bytes, k), q, "k={k}");
            assert_eq!(word_lane(0xA5BF9870, k), q, "lane {k}");
        }
        let mut q = [0i8; 8];
        unpack_row(&bytes, &mut q);
        assert_eq!(q, EXAMPLE_Q);
        // Scale 0.01 (as BF16) for the first group: w = q * scale.
        let mut row = [0u8; 16];
        row[..4].copy_from_slice(&bytes);
        row[4..].fill(0x88); // q = 0
        let s = bf16::from_f32(0.01);
        let mut out = [0f32; 32];
        dequant_row_f32(&row, &[s], &mut out);
        let expect: Vec<f32> = EXAMPLE_Q.iter().map(|&q| q as f32 * s.to_f32()).collect();
        assert_eq!(&out[..8], &expect[..]);
        assert!((out[4] - 0.07).abs() < 2e-4 && (out[0] + 0.08).abs() < 2e-4);
        assert!(out[8..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn pack_unpack_round_trip_all_values() {
        let q: Vec<i8> = (0..64).map(|i| (i % 16) as i8 - 8).rev().collect();
        let mut bytes = vec![0u8; 32];
        pack_row_bytes(&q, &mut bytes);
        let words = pack_row_words(&q);
        let word_bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(bytes, word_bytes);
        let mut back = vec![0i8; 64];
        unpack_row(&bytes, &mut back);
        assert_eq!(back, q);
    }

    #[test]
    fn scale_is_amax_over_7_5_in_bf16() {
        let mut g = [bf16::ZERO; 32];
        g[3] = bf16::from_f32(-1.5);
        g[7] = bf16::from_f32(0.75);
        assert_eq!(group_scale(&g), bf16::from_f32(0.2));
        // The most negative value is the one that maps to -7.5 -> rounds to -8 (half to even).
        assert_eq!(quantize_value(g[3], group_scale(&g)), -8);
        // All-positive group: amax = max, and the max maps to 7.5 -> clamped to 7.
        let g2: Vec<bf16> = (0..32).map(|i| bf16::from_f32(i as f32 / 31.0)).collect();
        let s2 = group_scale(&g2);
        assert_eq!(s2, bf16::from_f32(1.0 / 7.5));
        assert_eq!(quantize_value(g2[31], s2), 7);
    }

    #[test]
    fn zero_group_gets_eps_scale_and_zero_codes() {
        let w = vec![bf16::ZERO; 64];
        let qz = quantize(&w, 1, 64);
        assert_eq!(qz.scale, vec![bf16::from_f32(ZERO_SCALE_EPS); 2]);
        assert!(qz.packed.iter().all(|&b| b == 0x88));
    }

    #[test]
    fn ties_round_half_to_even_after_bf16_division() {
        let s = bf16::from_f32(1.0);
        assert_eq!(quantize_value(bf16::from_f32(2.5), s), 2);
        assert_eq!(quantize_value(bf16::from_f32(3.5), s), 4);
        assert_eq!(quantize_value(bf16::from_f32(-0.5), s), 0);
        assert_eq!(quantize_value(bf16::from_f32(-2.5), s), -2);
        // 2.484375 / 0.9921875 (both exact bf16): f32 quotient 2.5039..., bf16 rounds it to 2.5 -> 2, not 3.
        let x = bf16::from_f32(2.484375);
        let s = bf16::from_f32(0.9921875);
        assert_eq!((x.to_f32(), s.to_f32()), (2.484375, 0.9921875));
        assert!((x.to_f32() / s.to_f32()) > 2.5);
        assert_eq!(quantize_value(x, s), 2);
    }

    #[test]
    fn quantize_dequantize_error_is_bounded_by_half_a_step() {
        let (n, k) = (4, 96);
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 7919) % 263) as f32 / 131.0 - 1.0))
            .collect();
        let qz = quantize(&w, n, k);
        assert_eq!(qz.packed.len(), n * k / 2);
        let mut out = vec![0f32; k];
        for r in 0..n {
            dequant_row_f32(
                &qz.packed[r * k / 2..(r + 1) * k / 2],
                &qz.scale[r * 3..(r + 1) * 3],
                &mut out,
            );
            for c in 0..k {
                let s = qz.scale[r * 3 + c / 32].to_f32();
                let err = (out[c] - w[r * k + c].to_f32()).abs();
                // half a step, plus the bf16 rounding of the scale and of x / scale
                assert!(err <= 0.53 * s, "r{r} c{c}: err {err} scale {s}");
            }
        }
        let mut bf = vec![bf16::ZERO; k];
        dequant_row_bf16(&qz.packed[..k / 2], &qz.scale[..3], &mut bf);
        dequant_row_f32(&qz.packed[..k / 2], &qz.scale[..3], &mut out);
        assert!(bf.iter().zip(&out).all(|(a, b)| *a == bf16::from_f32(*b)));
    }
}
