//! Parity of the CUDA MLA latent attention (kernels/cuda/mla_attention.cu) against the CPU twin
//! `cpu::ops::mla_attention` in its absorbed form, run with Dn = Dv = C and kv_b = [I; I] per head so that
//! the twin's absorption and W_UV are exact identities and it computes the latent core itself. Cases: a
//! decode step (T = 1), trees with ancestor masks up to 1024 nodes (16 mask words), causal prefill (no
//! mask), K2.6 widths (C 512 + P 64) with 8 (TP8) and 64 (TP1) heads, contexts up to 4K rows. Random seeded
//! inputs, NaN-poisoned output. Needs a GPU (skips without one unless KDTREE_REQUIRE_GPU=1).
#![cfg(feature = "cuda")]

mod cuda_common;

// CPU twin (one block so the paths are easy to follow if the CPU ops move).
use kdtree_engine::cpu::ops::{mla_attention, MlaDims, MlaKv};
use kdtree_engine::ddtree::Visibility;

use cuda_common::*;
use half::bf16;
use kdtree_engine::cuda::ops::mla_attention::{mla_attention as gpu_mla, MlaShape, MlaSplit};
use rand::Rng;

/// bf16 output rounding (half an ulp: 2^-9 of |out|, at most 2^-8 of max |out|) plus expf vs exp and another
/// summation order over up to 4K rows. Bound from the rounding alone: 3.9e-3; the measured floor is in
/// bench/GPU-RESULTS.md.
const MLA_TOL: f64 = 5.0e-3;

/// Random parents: node 0 a root, later nodes a root with probability 1/8, else a child of an earlier node.
fn parents(r: &mut rand_chacha::ChaCha8Rng, t: usize, chain: bool) -> Vec<i32> {
    (0..t as i32).map(|i| if chain { i - 1 } else if i == 0 || r.random_range(0..8) == 0 { -1 } else { r.random_range(0..i) }).collect()
}

/// `room`: None = the host's committed length and split; Some(rows) = the device round's form: a cache of
/// `rows` rows (random rows past the nodes' own), the committed length read from the device, the split
/// chosen for the room and the rows divided evenly in the kernel.
#[allow(clippy::too_many_arguments)]
fn case(g: &kdtree_engine::cuda::Gpu, t: usize, heads: usize, committed: usize, c: usize, p: usize, masked: bool, seed: u64, room: Option<usize>) {
    let name = format!(
        "mla_attention(T={t},Hr={heads},committed={committed},C={c},P={p},{}{})",
        if masked { "tree" } else { "causal" },
        room.map(|r| format!(",committed on the device,room {r}")).unwrap_or_default()
    );
    let mut r = rng(seed);
    let lw = c + p;
    let q = rand_bf16(&mut r, t * heads * lw, 0.01, 0.12);
    let lat = rand_bf16(&mut r, room.unwrap_or(committed + t) * lw, 0.05, 1.5);
    let par = parents(&mut r, t, !masked);
    let mask = Visibility::from_parents(&par).unwrap();
    // CPU twin: per head q = q_nope (= q_lat, Dn = C) | q_pe; kv_b rows [W_UK_h = I_C; W_UV_h = I_C].
    let mut kvb = vec![bf16::ZERO; heads * 2 * c * c];
    for h in 0..heads {
        for k in 0..c {
            kvb[(h * 2 * c + k) * c + k] = bf16::ONE;
            kvb[(h * 2 * c + c + k) * c + k] = bf16::ONE;
        }
    }
    let dims = MlaDims { heads, nope: c, rope: p, v: c, kv_lora: c, scale: 0.0723 };
    let want = mla_attention(&dims, &widen(&q), &widen(&lat[..(committed + t) * lw]), committed, &mask, MlaKv::Absorbed(&kvb));
    let s = MlaShape { t, heads, kv_lora: c, rope: p, committed };
    let split = match room {
        None => MlaSplit::choose(g, &s),
        Some(rows) => MlaSplit { splits: MlaSplit::choose(g, &MlaShape { committed: rows - t, ..s }).splits, rows_per_split: 0 },
    };
    let dc = g.upload(&[committed as i32]).unwrap();
    let dcv = dc.as_view();
    let (wo, wml) = split.workspace(&s);
    let dq = g.upload(&q).unwrap();
    let dl = g.upload(&lat).unwrap();
    let dm = g.upload(&mask.bits).unwrap();
    let mut po = g.upload(&nan_f32(wo)).unwrap();
    let mut pml = g.upload(&nan_f32(wml)).unwrap();
    let mut out = g.upload(&nan_bf16(t * heads * c)).unwrap();
    let m = masked.then(|| (dm.as_view(), mask.words));
    gpu_mla(g, &dq.as_view(), &dl.as_view(), m.as_ref().map(|(v, w)| (v, *w)), room.map(|_| &dcv), &s, &split, 0.0723, &mut po.as_view_mut(), &mut pml.as_view_mut(), &mut out.as_view_mut()).unwrap();
    let got = g.download(&out).unwrap();
    eprintln!("{name}: {} splits x {} rows", split.splits, split.rows_per_split);
    check_bf16(&name, &got, &want, MLA_TOL);
}

#[test]
fn mla_attention_parity() {
    let Some(g) = gpu() else { return };
    // (T, Hr, committed, C, P, tree mask)
    let cases = [
        (1, 8, 0, 512, 64, true),
        (1, 8, 4095, 512, 64, true),
        (1, 64, 1000, 512, 64, true),
        (16, 8, 777, 512, 64, true),
        (65, 8, 300, 512, 64, true),
        (257, 8, 2000, 512, 64, true),
        (1024, 8, 100, 512, 64, true),
        (96, 8, 50, 512, 64, false),
        (7, 3, 33, 64, 16, true),
    ];
    for (i, &(t, hr, committed, c, p, masked)) in cases.iter().enumerate() {
        case(&g, t, hr, committed, c, p, masked, 900 + i as u64, None);
    }
    // The device round's form: committed read on the device, split for a larger room.
    for (i, &(t, hr, committed, room)) in [(1, 64, 1000, 4096), (65, 8, 300, 1024), (257, 8, 3, 512), (9, 8, 0, 256)].iter().enumerate() {
        case(&g, t, hr, committed, 512, 64, true, 950 + i as u64, Some(room));
    }
}
