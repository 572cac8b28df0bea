//! Unit tests of the CPU backend (cpu/backend.rs).

use super::*;
use crate::backend::Compute;
use rand::{Rng, SeedableRng};

fn rand_vec(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

#[test]
fn rope_rows_follow_positions_as_per_row_ops_do() {
    // The backend's batched forms (one RopeTable per forward) equal the per-row op calls the model
    // made before the seam: row i rotated by position positions[i], bit for bit.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(31);
    let (t, heads, nope, p, c) = (3, 2, 4, 4, 8);
    let inv = ops::yarn_inv_freq(p, 10000.0, None);
    let positions = [7usize, 3, 12];
    let rope = RopeTable::new(&inv, positions, 1.0);
    let cs: Vec<(Vec<f32>, Vec<f32>)> = positions.iter().map(|&q| ops::rope_cos_sin(&inv, q, 1.0)).collect();
    let b = CpuBackend::default();

    let q0 = rand_vec(&mut rng, t * heads * (nope + p));
    let mut q = q0.clone();
    b.rope_q(&mut q, heads, nope, &rope);
    let mut want = q0;
    for (i, (cos, sin)) in cs.iter().enumerate() {
        for h in 0..heads {
            let base = (i * heads + h) * (nope + p) + nope;
            ops::rope_interleaved(&mut want[base..base + p], cos, sin);
        }
    }
    assert_eq!(q, want);

    let norm = Slab::Owned((0..c).map(|k| bf16::from_f32(1.0 + k as f32 / 16.0)).collect());
    let ckv = rand_vec(&mut rng, t * (c + p));
    let mut kv = b.kv_new(1, c + p);
    b.kv_append_latent(&mut kv, 0, &ckv, &norm, 1e-6, &rope);
    for i in 0..t {
        let mut row = ops::rms_norm(&ckv[i * (c + p)..i * (c + p) + c], &norm, 1e-6);
        let mut pe = ckv[i * (c + p) + c..(i + 1) * (c + p)].to_vec();
        ops::rope_interleaved(&mut pe, &cs[i].0, &cs[i].1);
        row.extend(pe);
        assert_eq!(&kv.rows[0][i * (c + p)..(i + 1) * (c + p)], &row[..], "latent row {i}");
    }

    let dh = 4;
    let rope_h = RopeTable::new(&ops::yarn_inv_freq(dh, 10000.0, None), positions, 1.0);
    let w = Slab::Owned(vec![bf16::from_f32(0.5); dh]);
    let x = rand_vec(&mut rng, t * heads * dh);
    let got = b.head_norm_rope_neox(&x, &w, 1e-6, heads, &rope_h);
    let mut want = ops::rms_norm(&x, &w, 1e-6);
    for (i, row) in want.chunks_mut(heads * dh).enumerate() {
        let (cos, sin) = ops::rope_cos_sin(&ops::yarn_inv_freq(dh, 10000.0, None), positions[i], 1.0);
        row.chunks_mut(dh).for_each(|hv| ops::rope_neox(hv, &cos, &sin));
    }
    assert_eq!(got, want);
}
