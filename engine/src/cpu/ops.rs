//! Plain CPU kernels: the spec every faster kernel (CUDA) is checked against.
//!
//! What it computes: bf16 and INT4-group-32 matmuls, RMSNorm, RoPE (interleaved GPT-J and NeoX
//! rotate_half), YaRN inverse frequencies, softmax, silu, sigmoid, argmax and top-k.
//! Reference it must match: shared k26-format.md §3.2 (INT4 nibble layout), §4.2 (RMSNorm), §4.4 (RoPE /
//! YaRN, transformers `_compute_yarn_parameters`); each op is tested against an obviously-correct f64 loop
//! in the `tests` module at the bottom of this file.
//!
//! Determinism: every output element is produced by exactly one sequential loop with a fixed order of
//! additions (`dot_f32` below); rayon only decides *which thread* runs that loop, so results are bit-identical
//! for any thread count.
//!
//! Dimension letters: T tokens (rows of x), K input features, N output features, D rope dims.

use half::bf16;
use rayon::prelude::*;

/// Output rows per rayon task in the matmuls (a scheduling knob only; results do not depend on it).
const ROWS_PER_TASK: usize = 16;

/// Exact bf16 → f32 widening (bf16 is the top half of an f32).
#[inline]
pub fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Widen a bf16 slice to f32.
pub fn bf16_slice_to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|&v| bf16_to_f32(v)).collect()
}

/// The one dot product every matmul here uses: 4 interleaved f32 partial sums over k (lane = k % 4),
/// combined as `(s0 + s1) + (s2 + s3)`. Fixed order, so the result never depends on threading.
#[inline]
fn dot_f32(x: &[f32], w: impl Fn(usize) -> f32, k: usize) -> f32 {
    let mut s = [0f32; 4];
    let full = k / 4 * 4;
    let mut i = 0;
    while i < full {
        s[0] += x[i] * w(i);
        s[1] += x[i + 1] * w(i + 1);
        s[2] += x[i + 2] * w(i + 2);
        s[3] += x[i + 3] * w(i + 3);
        i += 4;
    }
    while i < k {
        s[i % 4] += x[i] * w(i);
        i += 1;
    }
    (s[0] + s[1]) + (s[2] + s[3])
}

/// Shared driver: `y[t, n] = f(x[t, :], n)` for all t < T, n < N, parallel over n.
fn matmul_by_row(x: &[f32], t: usize, k: usize, n: usize, fill_row: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    assert_eq!(x.len(), t * k, "matmul: x has {} elements, expected T={t} x K={k}", x.len());
    // [N, T] f32: computed column-of-y-at-a-time so decode (T = 1) still spreads over threads. Each weight
    // row is widened to f32 once per task and reused for all T inputs; the widening is exact, so the sums
    // are the same whatever T is.
    let mut yt = vec![0f32; n * t];
    yt.par_chunks_mut(t.max(1) * ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
        let mut wrow = vec![0f32; k]; // [K] f32, one weight row
        for (j, col) in chunk.chunks_mut(t.max(1)).enumerate() {
            let row = c * ROWS_PER_TASK + j;
            fill_row(row, &mut wrow);
            for (ti, out) in col.iter_mut().enumerate() {
                *out = dot_f32(&x[ti * k..(ti + 1) * k], |i| wrow[i], k);
            }
        }
    });
    // [T, N] f32
    let mut y = vec![0f32; t * n];
    for row in 0..n {
        for ti in 0..t {
            y[ti * n + row] = yt[row * t + ti];
        }
    }
    y
}

/// `y[T, N] = x[T, K] · W[N, K]^T` with W in bf16 (row-major `[N, K]`, as torch `nn.Linear.weight`),
/// f32 accumulation. Returns `[T, N]` f32.
pub fn matmul_bf16(x: &[f32], w: &[bf16], t: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k, "matmul_bf16: W has {} elements, expected N={n} x K={k}", w.len());
    matmul_by_row(x, t, k, n, |row, out| {
        let wr = &w[row * k..(row + 1) * k];
        out.iter_mut().zip(wr).for_each(|(o, &v)| *o = bf16_to_f32(v));
    })
}

/// `y[T, N] = x[T, K] · W[N, K]^T` with W in f32 (used for weights the engine derives itself, e.g. the
/// absorbed MLA projections). Same summation order as [`matmul_bf16`].
pub fn matmul_f32(x: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k, "matmul_f32: W has {} elements, expected N={n} x K={k}", w.len());
    matmul_by_row(x, t, k, n, |row, out| out.copy_from_slice(&w[row * k..(row + 1) * k]))
}

/// Dequantise one INT4 group-32 weight: `packed` is row `[K/2]` u8 (byte m = u[2m] | u[2m+1] << 4,
/// offset-8 nibbles), `scales` row `[K/32]` bf16. Returns `w[k] = (u − 8) · scale[k / 32]` as f32
/// (the product of a small integer and a bf16 is exact in f32).
#[inline]
pub fn dequant_i4g32(packed: &[u8], scales: &[bf16], k: usize) -> f32 {
    let byte = packed[k / 2];
    let u = if k % 2 == 0 { byte & 0xF } else { byte >> 4 };
    (u as i32 - 8) as f32 * bf16_to_f32(scales[k / 32])
}

/// Dequantise a whole `[N, K]` INT4 group-32 matrix to f32 (tests and the absorbed path use it).
pub fn dequant_i4g32_matrix(packed: &[u8], scales: &[bf16], n: usize, k: usize) -> Vec<f32> {
    check_i4(packed, scales, n, k, "dequant_i4g32_matrix");
    let mut w = vec![0f32; n * k]; // [N, K] f32
    for r in 0..n {
        let (p, s) = (&packed[r * k / 2..(r + 1) * k / 2], &scales[r * k / 32..(r + 1) * k / 32]);
        for c in 0..k {
            w[r * k + c] = dequant_i4g32(p, s, c);
        }
    }
    w
}

fn check_i4(packed: &[u8], scales: &[bf16], n: usize, k: usize, op: &str) {
    assert!(k % 32 == 0, "{op}: K={k} is not a multiple of the group size 32");
    assert_eq!(packed.len(), n * k / 2, "{op}: packed has {} bytes, expected N={n} x K/2={}", packed.len(), k / 2);
    assert_eq!(scales.len(), n * k / 32, "{op}: scales has {} elements, expected N={n} x K/32={}", scales.len(), k / 32);
}

/// `y[T, N] = x[T, K] · W[N, K]^T` with W INT4 group-32: `packed` `[N, K/2]` u8 (low nibble = even k,
/// offset-8), `scales` `[N, K/32]` bf16 (k26-format §3.2/§3.4). Each weight is dequantised exactly to f32
/// and then accumulated like [`matmul_bf16`], so it equals `matmul_f32(x, dequant_i4g32_matrix(..))` bit for bit.
pub fn matmul_i4g32(x: &[f32], packed: &[u8], scales: &[bf16], t: usize, k: usize, n: usize) -> Vec<f32> {
    check_i4(packed, scales, n, k, "matmul_i4g32");
    matmul_by_row(x, t, k, n, |row, out| {
        let (p, s) = (&packed[row * k / 2..(row + 1) * k / 2], &scales[row * k / 32..(row + 1) * k / 32]);
        out.iter_mut().enumerate().for_each(|(i, o)| *o = dequant_i4g32(p, s, i));
    })
}

/// RMSNorm over rows of `x` `[T, H]` with a bf16 weight `[H]`, as HF `DeepseekV3RMSNorm`:
/// `y = weight * (x * rsqrt(mean(x²) + eps))`, all in f32. HF casts the normalised value back to the
/// input dtype before the weight multiply; activations here are f32, so that cast is the identity
/// (no bf16 rounding is emulated). The mean of squares is accumulated in f32, sequentially.
pub fn rms_norm(x: &[f32], weight: &[bf16], eps: f32) -> Vec<f32> {
    let h = weight.len();
    assert!(h > 0 && x.len() % h == 0, "rms_norm: x has {} elements, not a multiple of H={h}", x.len());
    let mut y = vec![0f32; x.len()]; // [T, H] f32
    for (xr, yr) in x.chunks(h).zip(y.chunks_mut(h)) {
        let ms = xr.iter().fold(0f32, |a, &v| a + v * v) / h as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for i in 0..h {
            yr[i] = bf16_to_f32(weight[i]) * (xr[i] * r);
        }
    }
    y
}

/// Interleaved (GPT-J) RoPE on one vector `x[D]` in place: pairs `(2i, 2i+1)` rotate by angle i, with
/// `cos[i], sin[i]` for i < D/2. This is the DeepSeek/Kimi rope on the *stored* layout (k26-format §4.4).
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    assert!(
        cos.len() == half && sin.len() == half,
        "rope_interleaved: D={} needs {half} cos/sin, got {}/{}",
        x.len(),
        cos.len(),
        sin.len()
    );
    for i in 0..half {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * cos[i] - b * sin[i];
        x[2 * i + 1] = b * cos[i] + a * sin[i];
    }
}

/// NeoX `rotate_half` RoPE on one vector `x[D]` in place: pairs `(i, i + D/2)` rotate by angle i,
/// `cos[i], sin[i]` for i < D/2 (HF `apply_rotary_pos_emb` with `cos = cat(freqs, freqs)`).
pub fn rope_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    assert!(cos.len() == half && sin.len() == half, "rope_neox: D={} needs {half} cos/sin, got {}/{}", x.len(), cos.len(), sin.len());
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/// YaRN `get_mscale(scale, mscale)`: `0.1 · mscale · ln(scale) + 1` when scale > 1, else 1.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Rotary inverse frequencies `[D/2]` for rope dim `dim` and base `theta`; with YaRN scaling
/// (k26-format §4.4, transformers `_compute_yarn_parameters` with truncate = true):
/// blend of extrapolated `theta^(-2i/D)` and interpolated `/factor` frequencies by a linear ramp between
/// `floor(corr(beta_fast))` and `ceil(corr(beta_slow))`, `corr(r) = D ln(orig / 2πr) / (2 ln theta)`.
/// `beta_fast`, `beta_slow`, `factor` and `original_max_position_embeddings` are read from `scaling`,
/// never assumed (they differ between K2.6 and K2-Thinking). Computed in f64, rounded to f32 once.
pub fn yarn_inv_freq(dim: usize, theta: f64, scaling: Option<&kdtree_formats::config::RopeScaling>) -> Vec<f32> {
    assert!(dim % 2 == 0 && dim > 0, "yarn_inv_freq: rope dim {dim} must be even and > 0");
    let half = dim / 2;
    let extra: Vec<f64> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64)).collect();
    let Some(s) = scaling.filter(|s| s.kind == "yarn" || s.kind == "deepseek_yarn") else {
        return extra.iter().map(|&f| f as f32).collect();
    };
    let orig = s.original_max_position_embeddings as f64;
    let corr = |r: f64| dim as f64 * (orig / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let low = corr(s.beta_fast).floor().max(0.0);
    let mut high = corr(s.beta_slow).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    (0..half)
        .map(|i| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let mask = 1.0 - ramp; // extrapolation weight
            let inter = extra[i] / s.factor;
            (inter * (1.0 - mask) + extra[i] * mask) as f32
        })
        .collect()
}

/// YaRN cos/sin amplitude ("attention_factor" in transformers):
/// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`, 1.0 without YaRN (1.0 on K2.6).
pub fn yarn_attention_factor(scaling: Option<&kdtree_formats::config::RopeScaling>) -> f64 {
    match scaling.filter(|s| s.kind == "yarn" || s.kind == "deepseek_yarn") {
        Some(s) => yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim),
        None => 1.0,
    }
}

/// cos/sin `[D/2]` for one absolute position: angle `pos · inv_freq[i]` formed in f32 (as transformers
/// does: f32 `inv_freq @ position_ids`), cos/sin evaluated in f64 and rounded, times `attention_factor`.
pub fn rope_cos_sin(inv_freq: &[f32], pos: usize, attention_factor: f64) -> (Vec<f32>, Vec<f32>) {
    let ang = |f: f32| (pos as f32 * f) as f64;
    let cos = inv_freq.iter().map(|&f| (ang(f).cos() * attention_factor) as f32).collect();
    let sin = inv_freq.iter().map(|&f| (ang(f).sin() * attention_factor) as f32).collect();
    (cos, sin)
}

/// Numerically stable softmax of `x` in place: `exp(x − max) / Σ`, f32, sum accumulated sequentially.
/// `-inf` entries get probability 0; an all-`-inf` row is left as all zeros.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if m == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Logistic sigmoid `1 / (1 + e^-x)` in f32.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU `x · sigmoid(x)` in f32.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// SwiGLU combine: `silu(gate) ⊙ up`, elementwise over equal-length slices.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate has {} elements, up {}", gate.len(), up.len());
    gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
}

/// Index of the largest element. Tie rule: the **lowest index** wins. NaN never wins (comparisons with
/// NaN are false); an empty or all-NaN slice returns 0.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for i in 1..x.len() {
        if x[i] > x[best] || (x[best].is_nan() && !x[i].is_nan()) {
            best = i;
        }
    }
    best
}

/// Indices of the `k` largest elements, largest first. Tie rule: among equal values the **lowest index**
/// comes first (a stable sort by descending value). NaN sorts last. Panics if `k > x.len()`.
pub fn topk(x: &[f32], k: usize) -> Vec<usize> {
    assert!(k <= x.len(), "topk: k={k} exceeds length {}", x.len());
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| {
        let (va, vb) = (x[a], x[b]);
        match (va.is_nan(), vb.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => vb.partial_cmp(&va).unwrap(),
        }
    });
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use kdtree_formats::config::RopeScaling;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }
    fn rand_bf16(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0))).collect()
    }
    /// Max |a − b| / (|b| + 1e-3) over all elements.
    fn max_rel(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).abs() / (y.abs() + 1e-3)).fold(0.0, f64::max)
    }
    fn naive_matmul(x: &[f32], w: &[f64], t: usize, k: usize, n: usize) -> Vec<f64> {
        let mut y = vec![0f64; t * n];
        for ti in 0..t {
            for r in 0..n {
                for c in 0..k {
                    y[ti * n + r] += x[ti * k + c] as f64 * w[r * k + c];
                }
            }
        }
        y
    }

    #[test]
    fn matmul_bf16_matches_f64_loop() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for &(t, k, n) in &[(1, 7, 3), (3, 64, 37), (5, 130, 20)] {
            let x = rand_vec(&mut rng, t * k);
            let w = rand_bf16(&mut rng, n * k);
            let y = matmul_bf16(&x, &w, t, k, n);
            let w64: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
            let err = max_rel(&y, &naive_matmul(&x, &w64, t, k, n));
            assert!(err < 1e-4, "matmul_bf16(t={t},k={k},n={n}): rel err {err}");
            let wf = bf16_slice_to_f32(&w);
            assert_eq!(y, matmul_f32(&x, &wf, t, k, n), "matmul_f32 must equal matmul_bf16 on widened weights");
        }
    }

    #[test]
    fn matmul_identical_across_thread_counts() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let (t, k, n) = (3, 96, 77);
        let x = rand_vec(&mut rng, t * k);
        let w = rand_bf16(&mut rng, n * k);
        let p1 = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let p2 = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let a = p1.install(|| matmul_bf16(&x, &w, t, k, n));
        let b = p2.install(|| matmul_bf16(&x, &w, t, k, n));
        assert_eq!(a, b);
    }

    #[test]
    fn int4_worked_example_and_matmul() {
        // k26-format §3.3: q = [-8,-1,0,1,7,3,-3,2] packs to LE bytes 70 98 BF A5.
        let mut packed = vec![0x70u8, 0x98, 0xBF, 0xA5];
        packed.extend(std::iter::repeat_n(0x88u8, 12)); // rest of the 32-group: q = 0
        let scales = vec![bf16::from_f32(0.5)];
        let want = [-8, -1, 0, 1, 7, 3, -3, 2];
        for (k, &q) in want.iter().enumerate() {
            assert_eq!(dequant_i4g32(&packed, &scales, k), q as f32 * 0.5, "k={k}");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(3);
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

    #[test]
    fn rms_norm_matches_f64() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let (t, h) = (3, 50);
        let x = rand_vec(&mut rng, t * h);
        let w = rand_bf16(&mut rng, h);
        let y = rms_norm(&x, &w, 1e-5);
        let mut want = vec![0f64; t * h];
        for ti in 0..t {
            let ms: f64 = (0..h).map(|i| (x[ti * h + i] as f64).powi(2)).sum::<f64>() / h as f64;
            for i in 0..h {
                want[ti * h + i] = w[i].to_f64() * x[ti * h + i] as f64 / (ms + 1e-5).sqrt();
            }
        }
        let err = max_rel(&y, &want);
        assert!(err < 1e-5, "rms_norm rel err {err}");
    }

    #[test]
    fn rope_variants_are_permutations_of_each_other() {
        // GPT-J on x equals NeoX on the permuted x' = [x0,x2,..,x1,x3,..] (k26-format §4.4), permuted back.
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let d = 16;
        let x = rand_vec(&mut rng, d);
        let inv = yarn_inv_freq(d, 10000.0, None);
        let (c, s) = rope_cos_sin(&inv, 7, 1.0);
        let mut a = x.clone();
        rope_interleaved(&mut a, &c, &s);
        let mut p: Vec<f32> = (0..d / 2).map(|i| x[2 * i]).chain((0..d / 2).map(|i| x[2 * i + 1])).collect();
        rope_neox(&mut p, &c, &s);
        for i in 0..d / 2 {
            assert_eq!(a[2 * i], p[i]);
            assert_eq!(a[2 * i + 1], p[i + d / 2]);
        }
        // f64 rotation check.
        for i in 0..d / 2 {
            let th = 7.0 * inv[i] as f64;
            let (x0, x1) = (x[2 * i] as f64, x[2 * i + 1] as f64);
            assert!((a[2 * i] as f64 - (x0 * th.cos() - x1 * th.sin())).abs() < 1e-5);
            assert!((a[2 * i + 1] as f64 - (x1 * th.cos() + x0 * th.sin())).abs() < 1e-5);
        }
    }

    fn k26_yarn(beta_fast: f64) -> RopeScaling {
        RopeScaling {
            kind: "yarn".into(),
            factor: 64.0,
            original_max_position_embeddings: 4096,
            beta_fast,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }
    }

    #[test]
    fn yarn_inv_freq_matches_k26_ramp() {
        // k26-format §4.4: K2.6 low = 8, high = 20; K2-Thinking (beta_fast 1) low = 19, high = 20.
        for (bf, low, high) in [(32.0, 8.0, 20.0), (1.0, 19.0, 20.0)] {
            let s = k26_yarn(bf);
            let inv = yarn_inv_freq(64, 50000.0, Some(&s));
            for i in 0..32 {
                let extra = 50000f64.powf(-(2.0 * i as f64) / 64.0);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let want = extra / 64.0 * ramp + extra * (1.0 - ramp);
                assert!(((inv[i] as f64) - want).abs() <= want * 1e-6, "beta_fast={bf} i={i}: {} vs {want}", inv[i]);
            }
            assert_eq!(inv[8] as f64, (50000f64.powf(-16.0 / 64.0)) as f32 as f64, "i=8 is pure extrapolation");
        }
        assert_eq!(yarn_attention_factor(Some(&k26_yarn(32.0))), 1.0);
        assert!((yarn_get_mscale(64.0, 1.0) - 1.4158883).abs() < 1e-6);
    }

    #[test]
    fn softmax_silu_match_f64() {
        let mut x = vec![1.0f32, -2.0, 3.5, f32::NEG_INFINITY, 0.25];
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        softmax(&mut x);
        let z: f64 = x64.iter().map(|v| v.exp()).sum();
        for i in 0..x.len() {
            assert!((x[i] as f64 - x64[i].exp() / z).abs() < 1e-6, "softmax[{i}]");
        }
        for v in [-5.0f32, -0.5, 0.0, 2.0, 30.0] {
            let want = v as f64 / (1.0 + (-(v as f64)).exp());
            assert!((silu(v) as f64 - want).abs() < 1e-6 * (1.0 + want.abs()), "silu({v})");
        }
    }

    #[test]
    fn argmax_and_topk_tie_rules() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
        assert_eq!(topk(&[0.5, 0.9, 0.5, 0.9, 0.1], 3), vec![1, 3, 0]);
        assert_eq!(topk(&[f32::NAN, 0.2, 0.3], 2), vec![2, 1]);
    }
}
