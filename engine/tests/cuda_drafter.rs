//! The DFlash drafter on the GPU against the CPU reference:
//! * `gqa_attention_parity`: the block attention kernel (kernels/cuda/gqa_attention.cu) against its CPU
//!   twin `cpu::ops::gqa_attention` on seeded random inputs, contexts of 0 to 20,000 rows, head_dim 8 to
//!   256, the real K2.x drafter shape (B 8, Hq 64, Hk 8, D 128); NaN-poisoned workspace and output.
//! * `gqa_attention_rejects_bad_shapes`: the wrapper's errors name the op and the numbers.
//! * `cuda_drafter_matches_the_cpu_drafter`: `DFlashDrafter<CudaBackend>` as `open_with(.., Device::Cuda)`
//!   loads it (over the CUDA target's embed_tokens / lm_head) against the CPU drafter of `open_cpu`, on the
//!   synthetic `tiny` preset and on the trained pair models/kdtree-tiny (both converted for one rank here):
//!   the same taps (the CPU target's prefill of a prompt, then of three more tokens, then 3,000 random rows)
//!   go into both; the [B−1, V] draft logits are compared, and the per-row argmax (tie-aware).
//!
//! * `flush_batch_equals_each_flush_on_the_gpu`: a batch's flush of its drafters' stashes in shared forwards
//!   (`DFlashDrafter::flush_batch`) against each session's own flush, bit for bit with the batch-invariant sums.
//!
//! Needs a GPU (skips without one unless KDTREE_REQUIRE_GPU=1).
#![cfg(feature = "cuda")]

mod cuda_common;
mod drafter_common;
mod round_common;

use std::path::Path;

use cuda_common::*;
use kdtree_engine::api::{Drafter, LogitRows, Target};
use kdtree_engine::cpu::ops::gqa_attention as cpu_gqa;
use kdtree_engine::cuda::ops::gqa_attention::{gqa_attention as gpu_gqa, GqaShape, GqaSplit};
use kdtree_engine::cuda::Gpu;
use kdtree_engine::sampling::argmax;
use kdtree_engine::{open_cpu, open_with, AttnMode, Device, OpenOptions};
use rand::Rng;
use round_common::{convert, pair_dir, synth_tiny_one_rank};

/// GPU kernel vs CPU twin, both f32 end to end (no bf16 anywhere), relative to max |out|. The two differ
/// only in summation order (the twin: one sequential f32 pass over the C + B rows for the softmax sum and
/// for the output; the kernel: chunks of 16 rows per split, rescaled online, merged over the splits) and
/// fmaf vs mul + add in the dots, ~2^-24 relative per step. CPU twin vs an f64 loop on exactly these cases
/// and seeds, measured on the build machine (2026-12-01): 2e-7 to 8e-7 for C <= 300, 3.5e-6 at C = 4096,
/// 5.7e-6 at C = 20,000 (the sequential 20k-term sums; max |out| also shrinks as C grows). The kernel's
/// sequential chains are one split long (<= ~2,300 rows in these cases, the softmax sum in chunks of 16),
/// so its own error is below the twin's and GPU vs twin is about the twin's floor: 2e-5 is 3.5x over the
/// largest; an indexing or softmax bug gives >= 1e-2.
const GQA_TOL: f64 = 2.0e-5;

/// Draft logits of the bf16 GPU path against the f32 CPU drafter, relative to max |logit| of the block:
/// every GEMM input is rounded to bf16 on the GPU (2^-9 relative), about ten on the longest path (fc, the
/// context k/v, q/k/v, o, gate/up, down per layer, the target's lm_head), the attention itself is f32 (above).
/// The target's comparable path measured 1.3e-2 on the H200 (cuda_target); the drafter's own floor is
/// printed by this test on its first H200 run: until it is recorded, the target's 4e-2.
const DRAFT_LOGITS_TOL: f64 = 4.0e-2;

fn rand_pm(r: &mut rand_chacha::ChaCha8Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-a..a)).collect()
}

/// One kernel case: (B, Hq, Hk, D, C). `room`: None = C on the host, its own split; Some(rows) = the device
/// round's form: context caches of `rows` rows (random rows past C), C read from the device, the split
/// chosen for the room and the rows divided evenly in the kernel.
fn gqa_case(g: &Gpu, (b, hq, hk, d, c): (usize, usize, usize, usize, usize), seed: u64, room: Option<usize>) {
    let name = format!(
        "gqa_attention(B={b},Hq={hq},Hk={hk},D={d},C={c},f32{})",
        room.map(|r| format!(",C on the device,room {r}")).unwrap_or_default()
    );
    let mut r = rng(seed);
    let (qw, kw) = (hq * d, hk * d);
    let rows = room.unwrap_or(c);
    // ±2: after the drafter's q/k RMSNorm, entries are O(1); scores q·k·D^-0.5 then spread ~±1 (peaked, not
    // one-hot).
    let q = rand_pm(&mut r, b * qw, 2.0);
    let (kc, vc) = (rand_pm(&mut r, rows * kw, 2.0), rand_pm(&mut r, rows * kw, 1.0));
    let (kb, vb) = (rand_pm(&mut r, b * kw, 2.0), rand_pm(&mut r, b * kw, 1.0));
    let want = cpu_gqa(&q, b, (&kc[..c * kw], &vc[..c * kw]), (&kb, &vb), hq, hk, d);
    let s = GqaShape {
        b,
        ctx: c,
        heads: hq,
        kv_heads: hk,
        head_dim: d,
    };
    let split = match room {
        None => GqaSplit::choose(g, &s),
        Some(rows) => GqaSplit {
            splits: GqaSplit::choose(g, &GqaShape { ctx: rows, ..s }).splits,
            rows_per_split: 0,
        },
    };
    let dc = g.upload(&[c as i32]).unwrap();
    let dcv = dc.as_view();
    let (wo, wml) = split.workspace(&s);
    let up = |v: &[f32]| {
        if v.is_empty() {
            g.zeros::<f32>(0).unwrap()
        } else {
            g.upload(v).unwrap()
        }
    };
    let (dq, dkc, dvc, dkb, dvb) = (up(&q), up(&kc), up(&vc), up(&kb), up(&vb));
    let (mut po, mut pml, mut out) = (up(&nan_f32(wo)), up(&nan_f32(wml)), up(&nan_f32(b * qw)));
    gpu_gqa(
        g,
        &dq.as_view(),
        (&dkc.as_view(), &dvc.as_view()),
        room.map(|_| &dcv),
        (&dkb.as_view(), &dvb.as_view()),
        &s,
        &split,
        &mut po.as_view_mut(),
        &mut pml.as_view_mut(),
        &mut out.as_view_mut(),
    )
    .unwrap();
    let got = g.download(&out).unwrap();
    eprintln!("{name}: {} splits x {} rows", split.splits, split.rows_per_split);
    check(&name, &got, &want, GQA_TOL);
}

#[test]
fn gqa_attention_parity() {
    let Some(g) = gpu() else { return };
    // (B, Hq, Hk, D, C): the real K2.x drafter block (C 0, 1, 4096, 20,000), the synthetic tiny preset
    // (16/8 heads, D 16) at C 5000, the trained pair (D 32), the unit tests' drafter (D 8), a query tile
    // that is not full (B·G = 10), MQA at D 256 (the largest), D not a power of two, one query.
    let cases = [
        (8, 64, 8, 128, 0),
        (8, 64, 8, 128, 1),
        (8, 64, 8, 128, 4096),
        (8, 64, 8, 128, 20_000),
        (8, 16, 8, 16, 5000),
        (8, 16, 8, 32, 300),
        (4, 4, 2, 8, 33),
        (5, 6, 3, 64, 17),
        (3, 4, 1, 256, 1000),
        (2, 2, 2, 10, 7),
        (1, 1, 1, 128, 5000),
    ];
    for (i, &cs) in cases.iter().enumerate() {
        gqa_case(&g, cs, 1300 + i as u64, None);
    }
    // The device round's form (C on the device, split for the room).
    for (i, &(cs, room)) in [
        ((8, 64, 8, 128, 0), 256),
        ((8, 64, 8, 128, 300), 4096),
        ((8, 16, 8, 32, 257), 512),
    ]
    .iter()
    .enumerate()
    {
        gqa_case(&g, cs, 1350 + i as u64, Some(room));
    }
}

#[test]
fn gqa_attention_rejects_bad_shapes() {
    let Some(g) = gpu() else { return };
    let buf = g.upload(&vec![0f32; 4096]).unwrap();
    let mut w = g.upload(&vec![0f32; 4096]).unwrap();
    let (mut w2, mut w3) = (
        g.upload(&vec![0f32; 4096]).unwrap(),
        g.upload(&vec![0f32; 4096]).unwrap(),
    );
    let v = buf.as_view();
    let mut err = |s: GqaShape| {
        let split = GqaSplit::choose(&g, &s);
        let e = gpu_gqa(
            &g,
            &v,
            (&v, &v),
            None,
            (&v, &v),
            &s,
            &split,
            &mut w.as_view_mut(),
            &mut w2.as_view_mut(),
            &mut w3.as_view_mut(),
        )
        .unwrap_err()
        .to_string();
        eprintln!("{s:?}: {e}");
        e
    };
    let e = err(GqaShape {
        b: 1,
        ctx: 0,
        heads: 2,
        kv_heads: 1,
        head_dim: 258,
    });
    assert!(e.contains("gqa_attention") && e.contains("head_dim=258"), "{e}");
    let e = err(GqaShape {
        b: 1,
        ctx: 0,
        heads: 6,
        kv_heads: 4,
        head_dim: 8,
    });
    assert!(
        e.contains("gqa_attention") && e.contains("heads=6") && e.contains("kv_heads=4"),
        "{e}"
    );
    let e = err(GqaShape {
        b: 2,
        ctx: 100,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
    }); // kc needs 6400 > 4096
    assert!(
        e.contains("gqa_attention") && e.contains("kc has 4096 elements, needs at least 6400"),
        "{e}"
    );
    println!("PARITY gqa_attention shape errors exact (head_dim 258, heads 6 / kv 4, short kc)");
}

/// One draft compared: logits within the tolerance, argmax equal per row except where the CPU's own
/// margin between the two tokens is within the tolerance (a near-tie bf16 may flip).
fn compare_draft(case: &str, got: &[f32], want: &[f32], vocab: usize) {
    check(&format!("{case} logits"), got, want, DRAFT_LOGITS_TOL);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let rows = want.len() / vocab;
    let mut same = 0;
    for i in 0..rows {
        let (a, b) = (&want[i * vocab..(i + 1) * vocab], &got[i * vocab..(i + 1) * vocab]);
        let (ta, tb) = (argmax(a) as usize, argmax(b) as usize);
        if ta == tb {
            same += 1;
            continue;
        }
        let margin = (a[ta] - a[tb]) as f64;
        println!(
            "PARITY {case} row {i}: argmax cpu {ta} cuda {tb}, CPU margin {margin:.3e} (near-tie bound {:.3e})",
            DRAFT_LOGITS_TOL * scale
        );
        assert!(
            margin <= DRAFT_LOGITS_TOL * scale,
            "{case} row {i}: argmax cpu {ta} cuda {tb} where the CPU's margin {margin} is no near-tie"
        );
    }
    println!("PARITY {case} argmax: {same} of {rows} rows identical, the rest near-ties");
}

/// The CUDA drafter (as `open_with(Device::Cuda)` loads it) against the CPU drafter of `open_cpu` on the
/// converted model `dir`, fed the same taps; `prompt` and `more` are token ids of that model's vocab.
fn drafter_case(label: &str, dir: &Path, prompt: &[u32], more: &[u32]) {
    let opts = OpenOptions {
        attn_mode: AttnMode::Absorbed,
        gpu: cuda_common::gpu_options(),
        ..OpenOptions::default()
    };
    let mut cpu = open_cpu(dir, opts).unwrap();
    let gpu = open_with(dir, Device::Cuda, opts).unwrap();
    assert_eq!(gpu.backend, "cuda");
    let (mut dc, mut dg) = (
        cpu.drafter.take().expect("model has a drafter"),
        gpu.drafter.expect("cuda drafter loaded"),
    );
    let v = cpu.target.info().vocab_size;
    let bl = dc.block_size();
    assert_eq!(dg.block_size(), bl);
    // Round 1: taps of the CPU target's prefill of the prompt.
    let chain = |n: usize| (0..n as i32).map(|i| i - 1).collect::<Vec<i32>>();
    let out = cpu
        .target
        .forward_rows(prompt, &chain(prompt.len()), LogitRows::Last)
        .unwrap();
    let n = prompt.len();
    dc.extend_context(&out.taps, n).unwrap();
    dg.extend_context(&out.taps, n).unwrap();
    let bonus = argmax(&out.logits);
    let (a, b) = (dc.draft(bonus, n).unwrap(), dg.draft(bonus, n).unwrap());
    assert_eq!((a.len(), b.len()), ((bl - 1) * v, (bl - 1) * v));
    compare_draft(
        &format!("{label} draft after a {n}-token prefill (B={bl}, V={v})"),
        &b,
        &a,
        v,
    );
    // Round 2: three more committed tokens (a chain after the prompt), drafted from the new end.
    cpu.target.commit(&(0..n).collect::<Vec<_>>()).unwrap();
    let out = cpu
        .target
        .forward_rows(more, &chain(more.len()), LogitRows::Last)
        .unwrap();
    dc.extend_context(&out.taps, more.len()).unwrap();
    dg.extend_context(&out.taps, more.len()).unwrap();
    let at = n + more.len();
    assert_eq!((dc.context_len(), dg.context_len()), (at, at));
    let bonus = argmax(&out.logits);
    let (a, b) = (dc.draft(bonus, at).unwrap(), dg.draft(bonus, at).unwrap());
    compare_draft(
        &format!("{label} draft after {} more tokens (C={at})", more.len()),
        &b,
        &a,
        v,
    );
    // A long context: 3,000 random tap rows (appended in two chunks) after a reset; the attention splits.
    dc.reset();
    dg.reset();
    let w = out.taps.len() / more.len();
    let mut r = rng(77);
    let taps = rand_pm(&mut r, 3000 * w, 3.0);
    for (lo, hi) in [(0, 1000), (1000, 3000)] {
        dc.extend_context(&taps[lo * w..hi * w], hi - lo).unwrap();
        dg.extend_context(&taps[lo * w..hi * w], hi - lo).unwrap();
    }
    let (a, b) = (dc.draft(prompt[0], 3000).unwrap(), dg.draft(prompt[0], 3000).unwrap());
    compare_draft(&format!("{label} draft over 3000 random context rows"), &b, &a, v);
}

#[test]
fn cuda_drafter_matches_the_cpu_drafter() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The synthetic tiny preset with its drafter (random weights; drafter 16/8 heads, head_dim 16).
    drafter_case(
        "drafter(tiny synth)",
        &synth_tiny_one_rank(tmp.path()),
        &[1, 17, 305, 42, 7, 900, 12, 3, 64, 5],
        &[8, 99, 21],
    );
    // The trained pair (drafter 16/8 heads, head_dim 32, vocab 4352): peaked logits, real acceptance.
    convert(&pair_dir(), &tmp.path().join("pair1"), 1);
    drafter_case(
        "drafter(kdtree-tiny pair)",
        &tmp.path().join("pair1"),
        &[1, 17, 305, 42, 7, 900, 12, 3, 64, 5, 2000, 11],
        &[8, 99, 21],
    );
}

/// The batch form of the block attention (`Compute::gqa_attention_segs`: every sequence of a batch in one launch)
/// against each sequence's own `gqa_attention` on the same backend, bit for bit: contexts of different lengths
/// and caches of different rooms (so the sequences' split counts differ, 1 to many), an empty context, the
/// trained pair's shape (B 8, Hq 16, Hk 8, D 32) and the real K2.x drafter's (B 8, Hq 64, Hk 8, D 128); 1, 5,
/// 64 and 67 sequences (more than one launch takes).
#[test]
fn gqa_attention_segs_equal_each_sequence_alone() {
    use kdtree_engine::backend::{Compute, Resources};
    use kdtree_engine::cuda::CudaBackend;
    let Some(g) = gpu() else { return };
    let b = CudaBackend::new(std::sync::Arc::new(g));
    let mut r = rng(2802);
    for (bl, hq, hk, d) in [(8usize, 16usize, 8usize, 32usize), (8, 64, 8, 128)] {
        let (qw, kw) = (hq * d, hk * d);
        for n in [1usize, 5, 64, 67] {
            let ctx: Vec<usize> = (0..n)
                .map(|s| match s % 4 {
                    0 => 0,
                    1 => r.random_range(1..64),
                    2 => r.random_range(64..2000),
                    _ => r.random_range(2000..9000),
                })
                .collect();
            let room: Vec<usize> = ctx.iter().map(|&c| (c + 1).next_power_of_two().max(256)).collect();
            let kc: Vec<_> = room
                .iter()
                .map(|&m| b.act_from_host(rand_pm(&mut r, m * kw, 2.0)))
                .collect();
            let vc: Vec<_> = room
                .iter()
                .map(|&m| b.act_from_host(rand_pm(&mut r, m * kw, 1.0)))
                .collect();
            let pos: Vec<_> = ctx.iter().map(|&c| b.pos_new(c)).collect();
            let q = b.act_from_host(rand_pm(&mut r, n * bl * qw, 2.0));
            let kb = b.act_from_host(rand_pm(&mut r, n * bl * kw, 2.0));
            let vb = b.act_from_host(rand_pm(&mut r, n * bl * kw, 1.0));
            let segs: Vec<_> = (0..n).map(|s| (&kc[s], &vc[s], &pos[s])).collect();
            let all = b.to_host(&b.gqa_attention_segs(&q, bl, &segs, (&kb, &vb), hq, hk, d));
            for s in 0..n {
                let (r0, r1) = (s * bl, (s + 1) * bl);
                let one = b.gqa_attention(
                    &b.rows(&q, qw, r0, r1),
                    bl,
                    (&kc[s], &vc[s]),
                    &pos[s],
                    (&b.rows(&kb, kw, r0, r1), &b.rows(&vb, kw, r0, r1)),
                    hq,
                    hk,
                    d,
                );
                let (x, y) = (b.to_host(&one), &all[r0 * qw..r1 * qw]);
                let same = x.iter().zip(y).all(|(a, c)| a.to_bits() == c.to_bits());
                assert!(
                    same,
                    "Hq {hq} D {d}, {n} sequences: sequence {s} (C {}, room {})",
                    ctx[s], room[s]
                );
            }
        }
    }
    b.check().unwrap();
    println!("PARITY gqa_attention_segs == gqa_attention per sequence (1, 5, 64, 67 sequences) exact");
}

/// The tiny test drafter's tables on the GPU: embed on the host then uploaded, lm_head one linear.
struct DevTables {
    host: kdtree_engine::drafter::DenseTables,
    b: kdtree_engine::cuda::CudaBackend,
    lm: <kdtree_engine::cuda::CudaBackend as kdtree_engine::backend::Resources>::Mat,
}

impl kdtree_engine::drafter::TargetTables<kdtree_engine::cuda::CudaBackend> for DevTables {
    fn hidden_size(&self) -> usize {
        self.host.hidden
    }
    fn vocab_size(&self) -> usize {
        self.host.vocab
    }
    fn embed(&self, tokens: &[u32]) -> cudarc::driver::CudaSlice<f32> {
        use kdtree_engine::backend::Resources;
        use kdtree_engine::drafter::TargetTables;
        self.b.act_from_host(TargetTables::embed(&self.host, tokens))
    }
    fn embed_ids(
        &self,
        ids: &<kdtree_engine::cuda::CudaBackend as kdtree_engine::backend::Resources>::Ids,
        n: usize,
    ) -> cudarc::driver::CudaSlice<f32> {
        use kdtree_engine::backend::Resources;
        let host = self.b.ids_to_host(ids).expect("ids to the host");
        self.embed(&host[..n])
    }
    fn lm_head(&self, x: &cudarc::driver::CudaSlice<f32>, n: usize) -> cudarc::driver::CudaSlice<f32> {
        use kdtree_engine::backend::Compute;
        self.b.linear(x, n, &self.lm)
    }
}

/// A batch's flush (`DFlashDrafter::flush_batch`: every stash in forwards of up to FLUSH_ROWS rows) writes what
/// each session's own flush writes on the GPU, bit for bit with the batch-invariant sums: the tiny test drafter
/// (block 4 and 16), 5 and 90 sessions (2,404 stashed rows: two forwards), contexts of 0 to 70 rows.
#[test]
fn flush_batch_equals_each_flush_on_the_gpu() {
    use kdtree_engine::backend::{Mat, Resources, Slab};
    use kdtree_engine::cuda::CudaBackend;
    use kdtree_engine::drafter::{DFlashDrafter, DrafterDims};
    let Some(g) = gpu() else { return };
    let g = std::sync::Arc::new(g);
    g.set_batch_invariant(true);
    let b = CudaBackend::new(g.clone());
    let host = drafter_common::tables();
    let lm = b
        .upload_bf16(Mat {
            w: Slab::Owned(host.lm_head.clone()),
            rows: drafter_common::V,
            cols: drafter_common::H,
        })
        .unwrap();
    let tables = std::sync::Arc::new(DevTables { host, b: b.clone(), lm });
    for block in [4, 16] {
        let cfg = drafter_common::config(block);
        let dims = DrafterDims::from_config(&cfg).unwrap();
        let base = DFlashDrafter::new_on(b.clone(), &cfg, drafter_common::weights(&dims), tables.clone()).unwrap();
        for n in [5, 90] {
            drafter_common::flush_batch_equals_each_flush(&base, &b, n, &format!("cuda drafter, block {block}"));
        }
    }
    g.set_batch_invariant(false);
}
