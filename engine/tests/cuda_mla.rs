//! Parity of the CUDA MLA latent attention (kernels/cuda/mla_attention.cu) against the CPU twin
//! `cpu::ops::mla_attention` in its absorbed form, run with Dn = Dv = C and kv_b = [I; I] per head so that
//! the twin's absorption and W_UV are exact identities and it computes the latent core itself. Cases: a
//! decode step (T = 1), trees with ancestor masks up to 1024 nodes (16 mask words), causal prefill (no
//! mask), K2.6 widths (C 512 + P 64) with 8 (TP8) and 64 (TP1) heads, contexts up to 4K rows. Random seeded
//! inputs, NaN-poisoned output. Needs a GPU (skips without one unless KDTREE_REQUIRE_GPU=1).
#![cfg(feature = "cuda")]

mod cuda_common;

/// The GPU with the decode kernel off (`KDTREE_MLA_DECODE=0`), so that `mla_attention` takes the split kernel at
/// T = 1 too: this file tests that kernel; `mla_decode_parity` calls the decode kernel itself and compares.
fn split_gpu() -> Option<kdtree_engine::cuda::Gpu> {
    gpu_with(kdtree_engine::GpuOptions {
        mla_decode: false,
        ..gpu_options()
    })
}

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

/// The softmax scale of every case.
const SCALE: f32 = 0.0723;

/// The op on NaN-poisoned partials and output (every element it must write starts as NaN): `out` `[T, Hr, C]`.
#[allow(clippy::too_many_arguments)]
fn run_mla(
    g: &kdtree_engine::cuda::Gpu,
    q: &cudarc::driver::CudaView<'_, bf16>,
    lat: &cudarc::driver::CudaView<'_, bf16>,
    mask: Option<(&cudarc::driver::CudaView<'_, u64>, usize)>,
    committed_dev: Option<&cudarc::driver::CudaView<'_, i32>>,
    s: &MlaShape,
    split: &MlaSplit,
) -> Vec<bf16> {
    let (wo, wml) = split.workspace(s);
    let mut po = g.upload(&nan_f32(wo)).unwrap();
    let mut pml = g.upload(&nan_f32(wml)).unwrap();
    let mut out = g.upload(&nan_bf16(s.t * s.heads * s.kv_lora)).unwrap();
    gpu_mla(
        g,
        q,
        lat,
        mask,
        committed_dev,
        s,
        split,
        SCALE,
        &mut po.as_view_mut(),
        &mut pml.as_view_mut(),
        &mut out.as_view_mut(),
    )
    .unwrap();
    g.download(&out).unwrap()
}

/// The CPU twin's setup that makes it compute the latent core itself: Dn = Dv = C and kv_b = [I; I] per head
/// (the absorption and W_UV exact identities).
fn identity_twin(heads: usize, c: usize, p: usize) -> (Vec<bf16>, MlaDims) {
    let mut kvb = vec![bf16::ZERO; heads * 2 * c * c];
    for h in 0..heads {
        for k in 0..c {
            kvb[(h * 2 * c + k) * c + k] = bf16::ONE;
            kvb[(h * 2 * c + c + k) * c + k] = bf16::ONE;
        }
    }
    let dims = MlaDims {
        heads,
        nope: c,
        rope: p,
        v: c,
        kv_lora: c,
        scale: SCALE,
    };
    (kvb, dims)
}

/// Random parents: node 0 a root, later nodes a root with probability 1/8, else a child of an earlier node.
fn parents(r: &mut rand_chacha::ChaCha8Rng, t: usize, chain: bool) -> Vec<i32> {
    (0..t as i32)
        .map(|i| {
            if chain {
                i - 1
            } else if i == 0 || r.random_range(0..8) == 0 {
                -1
            } else {
                r.random_range(0..i)
            }
        })
        .collect()
}

/// `room`: None = the host's committed length and split; Some(rows) = the device round's form: a cache of
/// `rows` rows (random rows past the nodes' own), the committed length read from the device, the split
/// chosen for the room and the rows divided evenly in the kernel.
#[allow(clippy::too_many_arguments)]
fn case(
    g: &kdtree_engine::cuda::Gpu,
    t: usize,
    heads: usize,
    committed: usize,
    c: usize,
    p: usize,
    masked: bool,
    seed: u64,
    room: Option<usize>,
) {
    let name = format!(
        "mla_attention(T={t},Hr={heads},committed={committed},C={c},P={p},{}{})",
        if masked { "tree" } else { "causal" },
        room.map(|r| format!(",committed on the device,room {r}"))
            .unwrap_or_default()
    );
    let mut r = rng(seed);
    let lw = c + p;
    // Seeds >= 980: queries 20x larger, so that the scores spread over several units and the softmax is peaked
    // (with the small queries it is near uniform, and a permutation of scores among visible rows would hide).
    let qhi = if seed >= 980 { 2.4 } else { 0.12 };
    let q = rand_bf16(&mut r, t * heads * lw, qhi / 12.0, qhi);
    let lat = rand_bf16(&mut r, room.unwrap_or(committed + t) * lw, 0.05, 1.5);
    let par = parents(&mut r, t, !masked);
    let mask = Visibility::from_parents(&par).unwrap();
    // CPU twin: per head q = q_nope (= q_lat, Dn = C) | q_pe; kv_b rows [W_UK_h = I_C; W_UV_h = I_C].
    let (kvb, dims) = identity_twin(heads, c, p);
    let want = mla_attention(
        &dims,
        &widen(&q),
        &widen(&lat[..(committed + t) * lw]),
        committed,
        &mask,
        MlaKv::Absorbed(&kvb),
    );
    let s = MlaShape {
        t,
        heads,
        kv_lora: c,
        rope: p,
        committed,
    };
    let split = match room {
        None => MlaSplit::choose(g, &s),
        Some(rows) => MlaSplit {
            splits: MlaSplit::choose(
                g,
                &MlaShape {
                    committed: rows - t,
                    ..s
                },
            )
            .splits,
            rows_per_split: 0,
        },
    };
    let dc = g.upload(&[committed as i32]).unwrap();
    let dcv = dc.as_view();
    let dq = g.upload(&q).unwrap();
    let dl = g.upload(&lat).unwrap();
    let dm = g.upload(&mask.bits).unwrap();
    let m = masked.then(|| (dm.as_view(), mask.words));
    let got = run_mla(
        g,
        &dq.as_view(),
        &dl.as_view(),
        m.as_ref().map(|(v, w)| (v, *w)),
        room.map(|_| &dcv),
        &s,
        &split,
    );
    eprintln!("{name}: {} splits x {} rows", split.splits, split.rows_per_split);
    check_bf16(&name, &got, &want, MLA_TOL);
}

#[test]
fn mla_attention_parity() {
    let Some(g) = split_gpu() else { return };
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
        // Query tiles: nodes across tile edges (8 nodes of 8 heads a tile), 64 heads over several nodes, an odd
        // head count, C with a half n-tile (C % 16 = 8), C + P not a multiple of 16 (zero pad), tiny widths.
        (9, 8, 31, 512, 64, true),
        (17, 8, 64, 512, 64, false),
        (5, 64, 200, 512, 64, true),
        (3, 64, 33, 512, 64, false),
        (40, 5, 97, 24, 8, true),
        (13, 2, 0, 64, 8, false),
        (2, 1, 1, 8, 8, true),
        (23, 8, 0, 32, 8, true),
        (23, 8, 0, 32, 8, false),
    ];
    for (i, &(t, hr, committed, c, p, masked)) in cases.iter().enumerate() {
        case(&g, t, hr, committed, c, p, masked, 900 + i as u64, None);
    }
    // The device round's form: committed read on the device, split for a larger room.
    for (i, &(t, hr, committed, room)) in [
        (1, 64, 1000, 4096),
        (65, 8, 300, 1024),
        (257, 8, 3, 512),
        (9, 8, 0, 256),
    ]
    .iter()
    .enumerate()
    {
        case(&g, t, hr, committed, 512, 64, true, 950 + i as u64, Some(room));
    }
    // Narrow latents with a zero pad (C + P = 40), as the small test models have them; then peaked softmaxes.
    case(&g, 23, 8, 0, 32, 8, true, 990, Some(256));
    case(&g, 12, 8, 23, 32, 8, true, 991, Some(256));
    for (i, &(t, hr, committed, c, p, masked)) in [
        (1, 8, 4095, 512, 64, true),
        (23, 8, 0, 32, 8, true),
        (65, 8, 300, 512, 64, true),
        (96, 8, 50, 512, 64, false),
        (5, 64, 200, 512, 64, true),
    ]
    .iter()
    .enumerate()
    {
        case(&g, t, hr, committed, c, p, masked, 980 + i as u64, None);
    }
}

/// The decode kernel (`ops::mla_decode`: one node, K2.6's widths, latent rows as the mma's rows) against the CPU
/// twin and the split kernel on the same inputs, NaN-poisoned partials and output, twice the same bits; committed
/// lengths around its 16-row tiles, its four warps' 64 rows and the splits' 32-row rounding, up to 32K rows; 8, 5
/// and 1 heads; the host's and the device's committed length (a captured step: rows divided in the kernel, a
/// split count chosen for a larger room); small and peaked softmaxes.
#[test]
fn mla_decode_parity() {
    use kdtree_engine::cuda::ops::mla_decode::{mla_decode, supported};
    let Some(g) = split_gpu() else { return };
    let (c, p) = (512usize, 64usize);
    let lw = c + p;
    // (heads, committed, room: None = the host's length and split, Some(rows) = the device's)
    let cases: [(usize, usize, Option<usize>); 16] = [
        (8, 0, None),
        (8, 1, None),
        (8, 14, None),
        (8, 15, None),
        (8, 16, None),
        (8, 63, None),
        (8, 64, None),
        (8, 100, None),
        (5, 777, None),
        (1, 2000, None),
        (8, 4095, None),
        (8, 32767, None),
        (8, 0, Some(4096)),
        (8, 1000, Some(4096)),
        (3, 5000, Some(32768)),
        (8, 32767, Some(32768)),
    ];
    let mut ran = 0;
    for (i, &(heads, committed, room)) in cases.iter().enumerate() {
        let s = MlaShape {
            t: 1,
            heads,
            kv_lora: c,
            rope: p,
            committed,
        };
        if !supported(&g, &s) {
            println!("SKIP mla_decode(Hr={heads}): the kernel's shared memory exceeds this device's block");
            continue;
        }
        for peaked in [false, true] {
            let seed = 1200 + 2 * i as u64 + peaked as u64;
            let name = format!(
                "mla_decode(Hr={heads},committed={committed}{}{})",
                room.map(|r| format!(",committed on the device,room {r}"))
                    .unwrap_or_default(),
                if peaked { ",peaked" } else { "" }
            );
            let mut r = rng(seed);
            let qhi = if peaked { 2.4 } else { 0.12 };
            let q = rand_bf16(&mut r, heads * lw, qhi / 12.0, qhi);
            let lat = rand_bf16(&mut r, room.unwrap_or(committed + 1) * lw, 0.05, 1.5);
            let (kvb, dims) = identity_twin(heads, c, p);
            let want = mla_attention(
                &dims,
                &widen(&q),
                &widen(&lat[..(committed + 1) * lw]),
                committed,
                &Visibility::from_parents(&[-1]).unwrap(),
                MlaKv::Absorbed(&kvb),
            );
            let split = match room {
                None => MlaSplit::choose(&g, &s),
                Some(rows) => MlaSplit {
                    splits: MlaSplit::choose(
                        &g,
                        &MlaShape {
                            committed: rows - 1,
                            ..s
                        },
                    )
                    .splits,
                    rows_per_split: 0,
                },
            };
            let (dq, dl) = (g.upload(&q).unwrap(), g.upload(&lat).unwrap());
            let dc = g.upload(&[committed as i32]).unwrap();
            let dcv = dc.as_view();
            let run = || {
                let (wo, wml) = split.workspace(&s);
                let mut po = g.upload(&nan_f32(wo)).unwrap();
                let mut pml = g.upload(&nan_f32(wml)).unwrap();
                let mut out = g.upload(&nan_bf16(heads * c)).unwrap();
                mla_decode(
                    &g,
                    &dq.as_view(),
                    &dl.as_view(),
                    room.map(|_| &dcv),
                    &s,
                    &split,
                    SCALE,
                    &mut po.as_view_mut(),
                    &mut pml.as_view_mut(),
                    &mut out.as_view_mut(),
                )
                .unwrap();
                g.download(&out).unwrap()
            };
            let (got, again) = (run(), run());
            assert!(
                got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: two runs differ"
            );
            eprintln!("{name}: {} splits x {} rows", split.splits, split.rows_per_split);
            check_bf16(&format!("{name} [two runs identical]"), &got, &want, MLA_TOL);
            // The split kernel on the same inputs (split_gpu: mla_attention takes it).
            let split_form = run_mla(&g, &dq.as_view(), &dl.as_view(), None, room.map(|_| &dcv), &s, &split);
            check_bf16(
                &format!("{name} vs the split kernel"),
                &got,
                &widen(&split_form),
                MLA_TOL,
            );
            ran += 1;
        }
    }
    println!("mla_decode: {ran} cases");
}

/// A batch's MLA in one launch (`mla_attention_seg`: each sequence its own cache, mask, committed length on
/// the device and split) gives every node the bits its own sequence's launch gives; and the batch's latent
/// store (`store_rows_seg` into bf16) writes each sequence's rows where `store_rows` into bf16 does.
#[test]
fn mla_attention_segments_equal_their_own_launches() {
    use kdtree_engine::cuda::ops::mla_attention::{mla_attention_seg, MlaSeg};
    use kdtree_engine::cuda::ops::round_state::{store_rows, store_rows_seg, StoreSeg};
    let Some(g) = split_gpu() else { return };
    let (heads, c, p) = (8usize, 512usize, 64usize);
    let lw = c + p;
    // (T, committed, room)
    let segs = [
        (1usize, 1000usize, 4096usize),
        (17, 300, 1024),
        (1, 0, 256),
        (65, 40, 512),
        (3, 7, 256),
    ];
    let mut r = rng(4242);
    let (mut qs, mut want, mut bufs) = (Vec::new(), Vec::new(), Vec::new());
    for &(t, committed, room) in &segs {
        let q = rand_bf16(&mut r, t * heads * lw, 0.01, 0.12);
        let lat = rand_bf16(&mut r, room * lw, 0.05, 1.5);
        let mask = Visibility::from_parents(&parents(&mut r, t, false)).unwrap();
        let s = MlaShape {
            t,
            heads,
            kv_lora: c,
            rope: p,
            committed,
        };
        let split = MlaSplit {
            splits: MlaSplit::choose(
                &g,
                &MlaShape {
                    committed: room - t,
                    ..s
                },
            )
            .splits,
            rows_per_split: 0,
        };
        let (dq, dl, dm, dc) = (
            g.upload(&q).unwrap(),
            g.upload(&lat).unwrap(),
            g.upload(&mask.bits).unwrap(),
            g.upload(&[committed as i32]).unwrap(),
        );
        let (mv, cv) = (dm.as_view(), dc.as_view());
        want.extend(run_mla(
            &g,
            &dq.as_view(),
            &dl.as_view(),
            Some((&mv, mask.words)),
            Some(&cv),
            &s,
            &split,
        ));
        qs.extend(q);
        bufs.push((dl, dm, dc, mask.words, split.splits));
    }
    let t: usize = segs.iter().map(|s| s.0).sum();
    let sp = bufs.iter().map(|b| b.4).max().unwrap();
    let dq = g.upload(&qs).unwrap();
    let parts: Vec<MlaSeg<'_>> = segs
        .iter()
        .zip(&bufs)
        .map(|(&(t, committed, _), (dl, dm, dc, words, splits))| MlaSeg {
            lat: dl.as_view(),
            mask: dm.as_view(),
            words: *words,
            pos: dc.as_view(),
            committed,
            t,
            splits: *splits,
        })
        .collect();
    let (mut po, mut pml, mut out) = (
        g.upload(&nan_f32(t * sp * heads * c)).unwrap(),
        g.upload(&nan_f32(t * sp * heads * 2)).unwrap(),
        g.upload(&nan_bf16(t * heads * c)).unwrap(),
    );
    mla_attention_seg(
        &g,
        &dq.as_view(),
        &parts,
        heads,
        c,
        p,
        SCALE,
        &mut po.as_view_mut(),
        &mut pml.as_view_mut(),
        &mut out.as_view_mut(),
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    let diff = got
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    println!(
        "PARITY mla_attention_seg({} sequences, T={t}, splits up to {sp}) vs each sequence's own launch: {}",
        segs.len(),
        if diff == 0 {
            "bit-identical".to_string()
        } else {
            format!("mismatches {diff} of {}", got.len())
        }
    );
    assert_eq!(diff, 0, "the batched MLA launch differs from the per-sequence launches");

    // The store: three caches, rows at their committed lengths.
    let w = 576;
    let rows = [(5usize, 3usize), (0, 1), (100, 17)]; // (committed, n)
    let n: usize = rows.iter().map(|r| r.1).sum();
    let src: Vec<f32> = (0..n * w).map(|i| (i as f32 * 0.37).sin()).collect();
    let dsrc = g.upload(&src).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut at = 0;
    for &(committed, k) in &rows {
        let (mut d1, d2) = (
            g.upload(&nan_bf16(256 * w)).unwrap(),
            g.upload(&nan_bf16(256 * w)).unwrap(),
        );
        let pos = g.upload(&[committed as i32]).unwrap();
        store_rows(
            &g,
            &mut d1.as_view_mut(),
            w,
            &pos.as_view(),
            committed,
            &dsrc.slice(at * w..(at + k) * w),
            k,
        )
        .unwrap();
        a.push(d1);
        b.push((d2, pos));
        at += k;
    }
    {
        let mut parts: Vec<StoreSeg<'_>> = b
            .iter_mut()
            .zip(&rows)
            .map(|((d, pos), &(committed, k))| StoreSeg {
                dst: d.as_view_mut(),
                pos: pos.as_view(),
                committed,
                n: k,
            })
            .collect();
        store_rows_seg(&g, &mut parts, w, &dsrc.as_view()).unwrap();
    }
    for (i, (x, (y, _))) in a.iter().zip(&b).enumerate() {
        let (x, y) = (g.download(x).unwrap(), g.download(y).unwrap());
        assert!(
            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "cache {i}: the batched store differs"
        );
    }
    println!("PARITY store_rows_seg into bf16 (3 caches) vs store_rows each: bit-identical");
}

/// Node tiles go in the split kernel's grid y, at most 65535: with 64 heads a node tile is one node (on either
/// form of the kernel; the small one splits its heads over two tiles in grid z), so one node more is refused with an
/// error that names the limit (the launch would otherwise fail with an opaque driver error), and the limit
/// itself runs: a causal prefill of 65535 nodes, every row of it visible in its triangle.
#[test]
fn mla_attention_refuses_more_nodes_than_the_grid_holds() {
    let Some(g) = split_gpu() else { return };
    for (t, ok) in [(65535usize, true), (65536, false)] {
        let heads = 64;
        let s = MlaShape {
            t,
            heads,
            kv_lora: 8,
            rope: 8,
            committed: 0,
        };
        let split = MlaSplit {
            splits: 1,
            rows_per_split: t.next_multiple_of(32),
        };
        let (wo, wml) = split.workspace(&s);
        let dq = g.upload(&vec![bf16::from_f32(0.25); t * heads * 16]).unwrap();
        let dl = g.upload(&vec![bf16::from_f32(0.5); t * 16]).unwrap();
        let mut po = g.upload(&nan_f32(wo)).unwrap();
        let mut pml = g.upload(&nan_f32(wml)).unwrap();
        let mut out = g.upload(&nan_bf16(t * heads * 8)).unwrap();
        let r = gpu_mla(
            &g,
            &dq.as_view(),
            &dl.as_view(),
            None,
            None,
            &s,
            &split,
            0.25,
            &mut po.as_view_mut(),
            &mut pml.as_view_mut(),
            &mut out.as_view_mut(),
        );
        match (ok, r) {
            (true, Ok(())) => {
                // causal, every value 0.5: every output is 0.5
                let got = g.download(&out).unwrap();
                assert!(got.iter().all(|v| v.to_f32() == 0.5), "T={t}: outputs other than 0.5");
            }
            (false, Err(e)) => assert!(e.to_string().contains("grid limit 65535"), "T={t}: {e}"),
            (ok, r) => panic!("T={t}: expected ok={ok}, got {r:?}"),
        }
    }
    eprintln!("PARITY mla_attention grid limit: 65535 nodes run, 65536 refused exact");
}

/// A query row's bits depend on its own query, visible rows and the split, not on the rows that share its tile
/// or on the tile's extent: node k of a chain of T = 5 and of T = 16 (same cache rows, same queries, the same
/// split) are bit-identical, with the committed length (27) putting the nodes across a chunk edge, so that the
/// longer chain's tile reads a chunk the shorter one's never does (all of it masked for the first 5 nodes).
/// With 8 heads a tile is 8 nodes; with 3 heads 21.
#[test]
fn mla_attention_rows_do_not_depend_on_their_tile() {
    let Some(g) = split_gpu() else { return };
    let (c, p, committed) = (512usize, 64usize, 27usize);
    let lw = c + p;
    for heads in [8usize, 3] {
        let mut r = rng(4242 + heads as u64);
        let long = 16usize;
        let q = rand_bf16(&mut r, long * heads * lw, 0.01, 0.12);
        let lat = rand_bf16(&mut r, (committed + long) * lw, 0.05, 1.5);
        let (dq, dl) = (g.upload(&q).unwrap(), g.upload(&lat).unwrap());
        let mut outs = Vec::new();
        for t in [5usize, long] {
            let par: Vec<i32> = (0..t as i32).map(|i| i - 1).collect();
            let mask = Visibility::from_parents(&par).unwrap();
            let dm = g.upload(&mask.bits).unwrap();
            let s = MlaShape {
                t,
                heads,
                kv_lora: c,
                rope: p,
                committed,
            };
            let split = MlaSplit {
                splits: 1,
                rows_per_split: 64,
            };
            outs.push(run_mla(
                &g,
                &dq.slice(..t * heads * lw),
                &dl.slice(..(committed + t) * lw),
                Some((&dm.as_view(), mask.words)),
                None,
                &s,
                &split,
            ));
        }
        let n = 5 * heads * c;
        let diff = outs[0][..n]
            .iter()
            .zip(&outs[1][..n])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(diff, 0, "{heads} heads: nodes 0..5 differ between T = 5 and T = 16");
        println!("PARITY mla_attention rows independent of their tile ({heads} heads, T 5 vs 16): bit-identical");
    }
}

/// The expanded (multi-head) form (`mla_attention_heads`, the prefill's MHA form of MLA): each head its own rows
/// `v_h | k_h`, queries against the keys, against an f64 reference written here (softmax over the visible rows of
/// `scale · q · k`, the weighted values), NaN-poisoned partials and output. K2.6's per-head widths (values 128, keys
/// 128 + 64) with 8 heads, causal and tree masks, a committed prefix, a peaked softmax, and narrow widths.
#[test]
fn mla_attention_heads_parity() {
    use kdtree_engine::cuda::ops::mla_attention::mla_attention_heads;
    let Some(g) = split_gpu() else { return };
    // (T, heads, committed, value width C, key width P, tree mask, query magnitude)
    for (i, &(t, heads, committed, c, p, masked, qhi)) in [
        (100usize, 8usize, 0usize, 128usize, 192usize, false, 0.12f32),
        (37, 3, 50, 128, 192, true, 0.12),
        (130, 8, 70, 128, 192, false, 1.2),
        (64, 2, 33, 32, 16, false, 0.5),
        (9, 1, 0, 16, 16, true, 0.5),
    ]
    .iter()
    .enumerate()
    {
        let mut r = rng(1200 + i as u64);
        let (lw, rows) = (c + p, committed + t);
        let q = rand_bf16(&mut r, t * heads * p, qhi / 12.0, qhi);
        let lat = rand_bf16(&mut r, heads * rows * lw, 0.05, 1.5);
        let mask = Visibility::from_parents(&parents(&mut r, t, !masked)).unwrap();
        let (qf, lf) = (widen(&q), widen(&lat));
        let mut want = vec![0f32; t * heads * c];
        for n in 0..t {
            for h in 0..heads {
                let qv = &qf[(n * heads + h) * p..][..p];
                let seen: Vec<usize> = (0..rows)
                    .filter(|&s| s < committed || mask.visible(n, s - committed))
                    .collect();
                let sc: Vec<f64> = seen
                    .iter()
                    .map(|&s| {
                        let k = &lf[(h * rows + s) * lw + c..][..p];
                        SCALE as f64 * qv.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                    })
                    .collect();
                let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let l: f64 = e.iter().sum();
                for d in 0..c {
                    let o: f64 = seen
                        .iter()
                        .zip(&e)
                        .map(|(&s, w)| w * lf[(h * rows + s) * lw + d] as f64)
                        .sum();
                    want[(n * heads + h) * c + d] = (o / l) as f32;
                }
            }
        }
        let s = MlaShape {
            t,
            heads,
            kv_lora: c,
            rope: p,
            committed,
        };
        let split = MlaSplit::choose_heads(&g, &s);
        let (wo, wml) = split.workspace(&s);
        let (dq, dl, dm) = (
            g.upload(&q).unwrap(),
            g.upload(&lat).unwrap(),
            g.upload(&mask.bits).unwrap(),
        );
        let (mut po, mut pml, mut out) = (
            g.upload(&nan_f32(wo)).unwrap(),
            g.upload(&nan_f32(wml)).unwrap(),
            g.upload(&nan_bf16(t * heads * c)).unwrap(),
        );
        let mv = dm.as_view();
        mla_attention_heads(
            &g,
            &dq.as_view(),
            &dl.as_view(),
            rows * lw,
            masked.then_some((&mv, mask.words)),
            &s,
            &split,
            SCALE,
            &mut po.as_view_mut(),
            &mut pml.as_view_mut(),
            &mut out.as_view_mut(),
        )
        .unwrap();
        let name = format!(
            "mla_attention_heads(T={t},H={heads},committed={committed},C={c},P={p},{},q<={qhi}) {} splits",
            if masked { "tree" } else { "causal" },
            split.splits
        );
        check_bf16(&name, &g.download(&out).unwrap(), &want, MLA_TOL);
    }
}

/// The batch-invariant MLA (`ops::mla_invariant`, `KDTREE_BATCH_INVARIANT`) of `t` nodes over a cache of `cap`
/// rows, the committed length on the device: `o_lat` `[T, Hr, C]`, on NaN-poisoned partials and output.
#[allow(clippy::too_many_arguments)]
fn run_inv(
    g: &kdtree_engine::cuda::Gpu,
    q: &[bf16],
    lat: &[bf16],
    cap: usize,
    mask: Option<&Visibility>,
    s: &MlaShape,
) -> Vec<bf16> {
    use kdtree_engine::cuda::ops::mla_invariant as inv;
    let (wo, wml) = inv::inv_workspace(s, cap);
    let (mut po, mut pml) = (g.upload(&nan_f32(wo)).unwrap(), g.upload(&nan_f32(wml)).unwrap());
    let mut out = g.upload(&nan_bf16(s.t * s.heads * s.kv_lora)).unwrap();
    let (dq, dl, dc) = (
        g.upload(q).unwrap(),
        g.upload(lat).unwrap(),
        g.upload(&[s.committed as i32]).unwrap(),
    );
    let dm = mask.map(|m| (g.upload(&m.bits).unwrap(), m.words));
    let mv = dm.as_ref().map(|(d, w)| (d.as_view(), *w));
    inv::mla_attention_inv(
        g,
        &dq.as_view(),
        &dl.as_view(),
        cap,
        mv.as_ref().map(|(v, w)| (v, *w)),
        Some(&dc.as_view()),
        s,
        SCALE,
        &mut po.as_view_mut(),
        &mut pml.as_view_mut(),
        &mut out.as_view_mut(),
    )
    .unwrap();
    g.download(&out).unwrap()
}

/// The batch-invariant MLA against the CPU twin (as `case`: Dn = Dv = C, kv_b = [I; I]): a decode step, trees,
/// causal prefill, K2.6 widths at 8 and 64 heads, prefixes across the 256-position chunk cuts.
#[test]
fn mla_invariant_parity() {
    let Some(g) = split_gpu() else { return };
    // (T, heads, committed, C, P, tree, seed)
    for &(t, heads, committed, c, p, tree, seed) in &[
        (1usize, 8usize, 1000usize, 512usize, 64usize, true, 1001u64),
        (65, 8, 255, 512, 64, true, 1002),
        (65, 8, 256, 512, 64, true, 1003),
        (257, 3, 40, 64, 16, true, 1004),
        (100, 8, 0, 512, 64, false, 1005),
        (17, 64, 4095, 512, 64, true, 1006),
        (1025, 2, 3, 32, 16, true, 1007),
    ] {
        let name = format!(
            "mla_invariant(T={t},Hr={heads},committed={committed},C={c},P={p},{})",
            if tree { "tree" } else { "causal" }
        );
        let mut r = rng(seed);
        let lw = c + p;
        let cap = committed + t + 7;
        let q = rand_bf16(&mut r, t * heads * lw, 0.1, 2.4);
        let lat = rand_bf16(&mut r, cap * lw, 0.05, 1.5);
        let mask = Visibility::from_parents(&parents(&mut r, t, !tree)).unwrap();
        let (kvb, dims) = identity_twin(heads, c, p);
        let want = mla_attention(
            &dims,
            &widen(&q),
            &widen(&lat[..(committed + t) * lw]),
            committed,
            &mask,
            MlaKv::Absorbed(&kvb),
        );
        let s = MlaShape {
            t,
            heads,
            kv_lora: c,
            rope: p,
            committed,
        };
        let got = run_inv(&g, &q, &lat, cap, tree.then_some(&mask), &s);
        assert_eq!(
            got,
            run_inv(&g, &q, &lat, cap, tree.then_some(&mask), &s),
            "{name}: two runs differ"
        );
        check_bf16(&name, &got, &want, MLA_TOL);
    }
}

/// The point of the invariant form: every node of a verify gets the bits of the AR step that would have computed
/// it (its ancestors committed in depth order before it, the step's one node seeing itself), on trees across the
/// chunk cuts, at K2.6 widths; and a node's bits do not depend on the other nodes of its call.
#[test]
fn mla_invariant_rows_equal_ar_and_verify() {
    let Some(g) = split_gpu() else { return };
    let (c, p, heads) = (512usize, 64usize, 8usize);
    let lw = c + p;
    for &(t, committed, seed) in &[(65usize, 250usize, 1101u64), (257, 500, 1102), (33, 0, 1103)] {
        let mut r = rng(seed);
        let par = parents(&mut r, t, false);
        let mask = Visibility::from_parents(&par).unwrap();
        let cap = committed + t;
        let q = rand_bf16(&mut r, t * heads * lw, 0.1, 2.4);
        let lat = rand_bf16(&mut r, cap * lw, 0.05, 1.5);
        let s = MlaShape {
            t,
            heads,
            kv_lora: c,
            rope: p,
            committed,
        };
        let verify = run_inv(&g, &q, &lat, cap, Some(&mask), &s);
        let one = Visibility::from_parents(&[-1]).unwrap();
        for i in (0..t).step_by(7).chain([t - 1]) {
            // Node i's ancestors (and itself) in ascending index: the AR cache holds them after the prefix.
            let mut anc = vec![i];
            while let Some(&a) = anc.last() {
                match par[a] {
                    -1 => break,
                    pa => anc.push(pa as usize),
                }
            }
            anc.reverse();
            let mut ar_lat = lat[..committed * lw].to_vec();
            for &a in &anc {
                ar_lat.extend_from_slice(&lat[(committed + a) * lw..(committed + a + 1) * lw]);
            }
            let qi = &q[i * heads * lw..(i + 1) * heads * lw];
            let ar_s = MlaShape {
                t: 1,
                committed: committed + anc.len() - 1,
                ..s
            };
            let ar = run_inv(&g, qi, &ar_lat, ar_lat.len() / lw, Some(&one), &ar_s);
            assert_eq!(
                &verify[i * heads * c..(i + 1) * heads * c],
                &ar[..],
                "T={t} committed={committed}: node {i} (depth {}) differs from its AR step",
                anc.len() - 1
            );
        }
        println!("PARITY mla_invariant T={t} committed={committed}: sampled nodes == their AR steps, bit for bit");
    }
}
