//! Parity of the CUDA per-row token decision (kernels/cuda/sample_rows.cu) with its CPU twin
//! `sampling::sample`: the GPU token of every row must equal the CPU token at the row's position, for
//! greedy and for temperature × top-k × top-p grids at vocab 3, 1000 (strided rows) and 163,840, on rows
//! built to hit the edge cases (exact ties at the top and at the k-th value, ±0, ±inf, NaN, all-NaN,
//! all −inf, bf16-rounded and quantized rows with big tie groups), positions crossing 2^32 (the Philox
//! counter's high word), depth-keyed and consecutive positions, seeds with high bits set. Seeded inputs
//! (seed printed), outputs poisoned before launch. A mismatch fails unless the row's u·Z or P lies within
//! BOUNDARY_TOL of a boundary (recomputed here in f64; each such row is printed). Needs a GPU: skips
//! without one unless KDTREE_REQUIRE_GPU=1. Run: scripts/gpu-test.sh.
#![cfg(feature = "cuda")]

mod cuda_common;

// CPU twin.
use kdtree_engine::sampling::{adjusted_distribution, rank_cmp, sample, top_k, uniform, Sampling};

use cuda_common::*;
use kdtree_engine::cuda::{ops, Gpu};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The spec lets a backend that sums in another order differ only when u·Z, or P against the top-p
/// cumulative, lies within f64 rounding of a boundary (sampling.rs header). The kernel's sums differ from
/// the CPU's by at most ~V·2^-63 (fixed point) plus a few ulps of f64 per term, far below 1e-12 of the
/// unit mass; a mismatch farther than this from every boundary is a bug.
const BOUNDARY_TOL: f64 = 1e-12;

/// Magnitude in [lo, hi), random sign: never zero.
fn signed(r: &mut ChaCha8Rng, lo: f32, hi: f32) -> f32 {
    let v = r.random_range(lo..hi);
    if r.random::<bool>() {
        v
    } else {
        -v
    }
}

/// Row kinds, each named by what it exercises.
const KINDS: [&str; 13] = [
    "random",
    "peaked",
    "tied-max",
    "tied-kth",
    "neg-inf",
    "nan",
    "all-nan",
    "all-neg-inf",
    "pos-inf",
    "quantized-signed-zeros",
    "bf16-rounded",
    "one-finite",
    "random-narrow",
];

fn make_row(kind: &str, v: usize, r: &mut ChaCha8Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..v).map(|_| signed(r, 0.01, 20.0)).collect();
    let pick = |r: &mut ChaCha8Rng| r.random_range(0..v);
    match kind {
        "random" => {}
        "random-narrow" => x.iter_mut().for_each(|l| *l = signed(r, 0.01, 1.0)),
        "peaked" => {
            x.iter_mut().for_each(|l| *l = signed(r, 0.01, 4.0));
            let (a, b, c) = (pick(r), pick(r), pick(r));
            (x[a], x[b], x[c]) = (15.0, 13.5, 13.0);
        }
        "tied-max" => {
            let m = top_k(&x, 1)[0] as usize;
            for _ in 0..3 {
                let j = pick(r);
                x[j] = x[m];
            }
        }
        "tied-kth" => {
            // Copies of the 2nd and the 50th value in rank order at ids ranked below them.
            for k in [2usize, 50] {
                if k < v {
                    let ranked = top_k(&x, v);
                    let val = x[ranked[k - 1] as usize];
                    for &j in ranked[k..].iter().rev().take(3) {
                        x[j as usize] = val;
                    }
                }
            }
        }
        "neg-inf" => x
            .iter_mut()
            .filter(|_| r.random_range(0..4) == 0)
            .for_each(|l| *l = f32::NEG_INFINITY),
        "nan" => x
            .iter_mut()
            .filter(|_| r.random_range(0..8) == 0)
            .for_each(|l| *l = f32::NAN),
        "all-nan" => x.iter_mut().for_each(|l| *l = f32::NAN),
        "all-neg-inf" => x.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
        "pos-inf" => {
            let (a, b) = (pick(r), pick(r));
            (x[a], x[b]) = (f32::INFINITY, f32::INFINITY);
        }
        "quantized-signed-zeros" => x
            .iter_mut()
            .for_each(|l| *l = (*l * 0.2).round() * 0.5 * if r.random::<bool>() { 1.0 } else { -1.0 }),
        "bf16-rounded" => x.iter_mut().for_each(|l| *l = half::bf16::from_f32(*l * 0.25).to_f32()),
        "one-finite" => {
            x.iter_mut()
                .enumerate()
                .for_each(|(j, l)| *l = if j % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY });
            let j = pick(r);
            x[j] = 1.5;
        }
        _ => unreachable!("row kind {kind}"),
    }
    x
}

/// Distance, in units of the row's unit mass, from the nearest boundary of the decision: the top-p
/// cumulative (rank order, step-2 survivors) against P and the draw's CDF (id order) against u. Recomputed
/// from the spec in f64; a cumulative is monotone, so values near P or u only occur at the crossing.
fn boundary_distance(row: &[f32], s: &Sampling, u: f64) -> f64 {
    let t = s.temperature as f64;
    let mut kept: Vec<u32> = (0..row.len() as u32).filter(|&j| !row[j as usize].is_nan()).collect();
    if kept.is_empty() {
        return f64::INFINITY;
    }
    if s.top_k > 0 && s.top_k < kept.len() {
        let vk = row[*top_k(row, s.top_k).last().unwrap() as usize];
        kept.retain(|&j| row[j as usize] >= vk);
    }
    let m = kept
        .iter()
        .map(|&j| row[j as usize] as f64 / t)
        .fold(f64::NEG_INFINITY, f64::max);
    let w = |j: u32| {
        let x = row[j as usize] as f64 / t;
        if x == m {
            1.0
        } else {
            (x - m).exp()
        }
    };
    let mut d = f64::INFINITY;
    if s.top_p < 1.0 {
        let z: f64 = kept.iter().map(|&j| w(j)).sum();
        kept.sort_by(|&a, &b| rank_cmp(row, a, b));
        let mut cum = 0.0;
        for &j in &kept {
            cum += w(j) / z;
            d = d.min((cum - s.top_p as f64).abs());
        }
    }
    let mut cum = 0.0;
    for (_, p) in adjusted_distribution(row, s) {
        cum += p;
        d = d.min((cum - u).abs());
    }
    d
}

/// Where row r's token sits: start + depth[r] + 1, or start + r without depths.
fn position(start: u64, depth: Option<&[u32]>, r: usize) -> u64 {
    match depth {
        Some(d) => start.wrapping_add(d[r] as u64 + 1),
        None => start.wrapping_add(r as u64),
    }
}

/// Rows of one vocabulary on the device, with their host copy.
struct Rows {
    v: usize,
    ld: usize,
    host: Vec<f32>,
    names: Vec<String>,
    dev: cudarc::driver::CudaSlice<f32>,
}

impl Rows {
    fn new(g: &Gpu, v: usize, ld: usize, extra_random: usize, seed: u64) -> Rows {
        let mut r = rng(seed);
        let mut names: Vec<String> = KINDS.iter().map(|k| k.to_string()).collect();
        names.extend((0..extra_random).map(|i| format!("random#{i}")));
        let mut host = vec![f32::NAN; names.len() * ld]; // the ld - v padding stays NaN: never read
        for (i, n) in names.iter().enumerate() {
            let kind = n.split('#').next().unwrap();
            host[i * ld..i * ld + v].copy_from_slice(&make_row(kind, v, &mut r));
        }
        let dev = g.upload(&host).unwrap();
        Rows {
            v,
            ld,
            host,
            names,
            dev,
        }
    }
    fn rows(&self) -> usize {
        self.names.len()
    }
    fn row(&self, r: usize) -> &[f32] {
        &self.host[r * self.ld..r * self.ld + self.v]
    }
}

/// Position layouts cycled over the settings: consecutive from 0; depth-keyed across 2^32; depth-keyed
/// high in the counter's high word. With seeds whose high bits are set.
fn layouts(rows: usize, r: &mut ChaCha8Rng) -> Vec<(u64, Option<Vec<u32>>, u64)> {
    let depths = |r: &mut ChaCha8Rng| Some((0..rows).map(|_| r.random_range(0..8u32)).collect());
    vec![
        (0, None, 0x9E37_79B9_7F4A_7C15),
        ((1u64 << 32) - 5, depths(r), u64::MAX - 12_345),
        ((0xABCDu64 << 32) | 0xFFFF_FFF0, depths(r), 0x8000_0000_0000_0001),
        ((1u64 << 32) - 3, None, 0xDEAD_BEEF_0BAD_F00D),
    ]
}

/// Runs every setting over `rows`, compares each row's token with the CPU's, prints one PARITY line for
/// the group and fails on any mismatch that is not a boundary case.
fn check_group(g: &Gpu, group: &str, rows: &Rows, settings: &[Sampling], seed: u64) {
    let n = rows.rows();
    let mut r = rng(seed);
    let lay = layouts(n, &mut r);
    let (mut total, mut bad, mut boundary) = (0usize, Vec::new(), 0usize);
    for (si, s) in settings.iter().enumerate() {
        let (start, depth, seed) = &lay[si % lay.len()];
        let s = Sampling {
            seed: *seed,
            ..s.clone()
        };
        let ddev = depth.as_ref().map(|d| g.upload(d).unwrap());
        let mut dout = g.upload(&vec![u32::MAX; n]).unwrap();
        let dview = ddev.as_ref().map(|d| d.as_view());
        ops::sample_rows::sample_rows(
            g,
            &rows.dev.as_view(),
            n,
            rows.v,
            rows.ld,
            &s,
            *start,
            None,
            dview.as_ref(),
            &mut dout.as_view_mut(),
        )
        .unwrap();
        let got = g.download(&dout).unwrap();
        for (ri, &tok) in got.iter().enumerate() {
            let pos = position(*start, depth.as_deref(), ri);
            let want = sample(rows.row(ri), &s, pos as usize);
            total += 1;
            if tok == want {
                continue;
            }
            let what = format!(
                "row {ri} ({}) position {pos} {s:?}: gpu {tok} cpu {want}",
                rows.names[ri]
            );
            let d = if s.is_greedy() {
                f64::INFINITY
            } else {
                boundary_distance(rows.row(ri), &s, uniform(s.seed, pos as usize))
            };
            if d <= BOUNDARY_TOL {
                boundary += 1;
                println!("BOUNDARY sample_rows({group}) {what}: u·Z or P within {d:.2e} of a boundary (allowed)");
            } else {
                bad.push(format!("{what} (nearest boundary {d:.2e})"));
            }
        }
    }
    println!(
        "PARITY sample_rows({group}) mismatches {} of {total} (tol 0){}",
        bad.len(),
        if boundary > 0 {
            format!(", {boundary} boundary cases allowed")
        } else {
            String::new()
        }
    );
    assert!(
        bad.is_empty(),
        "sample_rows({group}): {} mismatches of {total}:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

fn grid(v: usize, t: f32) -> Vec<Sampling> {
    let mut out = Vec::new();
    for k in [0, 1, 2, 50, v - 1] {
        for p in [1.0f32, 0.9, 0.5, 1e-6] {
            out.push(Sampling {
                temperature: t,
                top_p: p,
                top_k: k,
                seed: 0,
            });
        }
    }
    out
}

#[test]
fn sample_rows_parity() {
    let Some(g) = gpu() else { return };
    // (V, ld, extra random rows): tiny, strided (ld > V, NaN padding), K2.6 vocab.
    for (i, &(v, ld, extra)) in [(3usize, 3usize, 19usize), (1000, 1003, 19), (163_840, 163_840, 3)]
        .iter()
        .enumerate()
    {
        let rows = Rows::new(&g, v, ld, extra, 3000 + i as u64);
        let greedy = [
            Sampling::greedy(),
            Sampling {
                temperature: 0.0,
                top_p: 0.5,
                top_k: 2,
                seed: 9,
            },
            Sampling {
                temperature: f32::NAN,
                ..Sampling::greedy()
            },
        ];
        check_group(&g, &format!("V={v},ld={ld},greedy"), &rows, &greedy, 3100 + i as u64);
        for (j, t) in [0.5f32, 1.0, 2.0].into_iter().enumerate() {
            check_group(
                &g,
                &format!("V={v},ld={ld},T={t},top_k={{0,1,2,50,V-1}},top_p={{1,0.9,0.5,1e-6}}"),
                &rows,
                &grid(v, t),
                3200 + 10 * i as u64 + j as u64,
            );
        }
        // Out-of-range settings: top_k >= V (disabled), top_p > 1 / NaN (disabled), top_p <= 0 (the first
        // in rank order only), tiny and huge temperatures.
        let odd = [
            Sampling {
                temperature: 1.0,
                top_p: 1.5,
                top_k: v + 7,
                seed: 0,
            },
            Sampling {
                temperature: 1.0,
                top_p: f32::NAN,
                top_k: v,
                seed: 0,
            },
            Sampling {
                temperature: 1.0,
                top_p: 0.0,
                top_k: 0,
                seed: 0,
            },
            Sampling {
                temperature: 1.0,
                top_p: -0.5,
                top_k: 3,
                seed: 0,
            },
            Sampling {
                temperature: 1e-3,
                top_p: 0.95,
                top_k: 0,
                seed: 0,
            },
            Sampling {
                temperature: 1e4,
                top_p: 0.7,
                top_k: 0,
                seed: 0,
            },
            Sampling {
                temperature: 0.7,
                top_p: 0.999_999,
                top_k: 0,
                seed: 0,
            },
        ];
        check_group(
            &g,
            &format!("V={v},ld={ld},edge-settings"),
            &rows,
            &odd,
            3300 + i as u64,
        );
    }
}

#[test]
fn sample_rows_replay_is_deterministic_and_matches_positions() {
    let Some(g) = gpu() else { return };
    let (v, n) = (163_840usize, 65usize);
    let mut r = rng(3400);
    let host: Vec<f32> = (0..n * v).map(|_| signed(&mut r, 0.01, 20.0) * 0.25).collect();
    let dx = g.upload(&host).unwrap();
    let s = Sampling {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 0,
        seed: 0xF00D_0000_0000_0007,
    };
    let depth: Vec<u32> = (0..n as u32).map(|i| i % 9).collect();
    let dd = g.upload(&depth).unwrap();
    let start = (1u64 << 32) - 4;
    // The second launch reads part of the start position from the device (the captured round's form).
    let dstart = g.upload(&[1000i32]).unwrap();
    let run = |dev: bool| {
        let mut o = g.upload(&vec![u32::MAX; n]).unwrap();
        let (host_start, sv) = if dev {
            (start - 1000, Some(dstart.as_view()))
        } else {
            (start, None)
        };
        ops::sample_rows::sample_rows(
            &g,
            &dx.as_view(),
            n,
            v,
            v,
            &s,
            host_start,
            sv.as_ref(),
            Some(&dd.as_view()),
            &mut o.as_view_mut(),
        )
        .unwrap();
        g.download(&o).unwrap()
    };
    let a = run(false);
    let b = run(true);
    assert_eq!(
        a, b,
        "two launches on the same logits differ (start on the host, start partly on the device)"
    );
    let want: Vec<u32> = (0..n)
        .map(|i| sample(&host[i * v..(i + 1) * v], &s, (start + depth[i] as u64 + 1) as usize))
        .collect();
    let bad = a.iter().zip(&want).filter(|(x, y)| x != y).count();
    println!("PARITY sample_rows(replay,rows={n},V={v},T=1,top_p=0.9) mismatches {bad} of {n} (tol 0)");
    assert_eq!(a, want, "sample_rows(replay): GPU tokens differ from the CPU's");
}

#[test]
fn sample_rows_rejects_bad_shapes() {
    let Some(g) = gpu() else { return };
    let x = g.upload(&[0.5f32; 10]).unwrap();
    let d = g.upload(&[0u32; 1]).unwrap();
    let mut o = g.upload(&[0u32; 2]).unwrap();
    let s = Sampling {
        temperature: 1.0,
        ..Sampling::greedy()
    };
    let err = |e: kdtree_engine::cuda::CudaError| e.to_string();
    let e = ops::sample_rows::sample_rows(&g, &x.as_view(), 2, 6, 6, &s, 0, None, None, &mut o.as_view_mut())
        .map_err(err)
        .unwrap_err();
    assert!(
        e.contains("sample_rows") && e.contains("logits has 10 elements, needs at least 12"),
        "{e}"
    );
    let e = ops::sample_rows::sample_rows(&g, &x.as_view(), 2, 5, 4, &s, 0, None, None, &mut o.as_view_mut())
        .map_err(err)
        .unwrap_err();
    assert!(e.contains("v=5") && e.contains("ld=4"), "{e}");
    let e = ops::sample_rows::sample_rows(
        &g,
        &x.as_view(),
        2,
        5,
        5,
        &s,
        0,
        None,
        Some(&d.as_view()),
        &mut o.as_view_mut(),
    )
    .map_err(err)
    .unwrap_err();
    assert!(e.contains("depth has 1 elements, needs at least 2"), "{e}");
    let e = ops::sample_rows::sample_rows(&g, &x.as_view(), 3, 3, 3, &s, 0, None, None, &mut o.as_view_mut())
        .map_err(err)
        .unwrap_err();
    assert!(e.contains("out has 2 elements, needs at least 3"), "{e}");
    println!("PARITY sample_rows(shape checks) exact");
}
