//! `kdtree-run --load-format dummy` end to end on the CPU: a directory holding only the tiny preset's
//! configs (`kdtree-convert synth --config-only`), the rank slice 1 of 2 and the whole model: records say
//! `"load_format": "dummy"`, tokens stay below the slice's V/R, every line decodes max_tokens, a seed gives
//! the same tokens twice, and what dummy weights cannot do is refused with exit 2 before any output.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as Json;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

fn dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kdtree-run-dummy")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// tiny's config.json (+ drafter/config.json) and a prompt file in `d`.
fn setup(d: &Path, drafter: bool) -> (PathBuf, PathBuf) {
    let cfg = d.join("cfg");
    kdtree_convert::synth::write_configs("tiny", &cfg, drafter, None).unwrap();
    let prompts = d.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\":\"a\",\"prompt_token_ids\":[1,2,3]}\n{\"id\":\"b\",\"prompt_token_ids\":[500,7]}\n",
    )
    .unwrap();
    (cfg, prompts)
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn kdtree-run")
}

fn records(p: &Path) -> Vec<Json> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn dummy_slice_runs_and_says_so() {
    let d = dir("slice");
    let (cfg, prompts) = setup(&d, true);
    let (c, p) = (cfg.to_str().unwrap(), prompts.to_str().unwrap());
    let mut runs = Vec::new();
    for (mode, out) in [("ddtree", "dd.jsonl"), ("ar", "ar.jsonl"), ("ar", "ar2.jsonl")] {
        let out = d.join(out);
        let o = run(&[
            c,
            "--load-format",
            "dummy",
            "--ranks",
            "2",
            "--rank",
            "1",
            "--dummy-seed",
            "4",
            "--device",
            "cpu",
            "--mode",
            mode,
            "--budget",
            "8",
            "--max-tokens",
            "6",
            "--prompts",
            p,
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{err}");
        assert!(
            err.contains("dummy weights (rank 1 of 2, seed 4)"),
            "bytes filled are printed: {err}"
        );
        let recs = records(&out);
        assert_eq!(recs.len(), 2);
        for r in &recs {
            assert_eq!(
                (r["status"].as_str(), r["load_format"].as_str()),
                (Some("ok"), Some("dummy")),
                "{r}"
            );
            assert_eq!(r["dummy"], serde_json::json!({"seed": 4, "rank": 1, "ranks": 2}));
            let toks: Vec<u64> = r["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect();
            assert!(
                toks.len() == 6 && toks.iter().all(|&t| t < 512),
                "max_tokens, ids below V/R = 512: {toks:?}"
            );
            assert!(r["text"].is_null());
        }
        runs.push(recs);
    }
    // Greedy DDTree equals greedy AR; the same seed gives the same tokens.
    let ids = |run: &[Json]| run.iter().map(|r| r["token_ids"].clone()).collect::<Vec<_>>();
    assert_eq!(ids(&runs[0]), ids(&runs[1]), "ddtree vs ar");
    assert_eq!(ids(&runs[1]), ids(&runs[2]), "same seed");
    // --quiet: no progress lines.
    let o = run(&[
        c,
        "--load-format",
        "dummy",
        "--mode",
        "ar",
        "--device",
        "cpu",
        "--max-tokens",
        "2",
        "--quiet",
        "--prompts",
        p,
        "--out",
        d.join("q.jsonl").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0));
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn dummy_refuses_what_it_cannot_do() {
    let d = dir("refuse");
    let (cfg, prompts) = setup(&d, false);
    let (c, p) = (cfg.to_str().unwrap(), prompts.to_str().unwrap());
    let out = d.join("o.jsonl");
    let o_ = out.to_str().unwrap();
    let cases: [(&[&str], &str); 7] = [
        (&["--load-format", "dummy", "--verify", c], "--verify"),
        (&["--load-format", "dummy", "--resume"], "--resume"),
        (
            &["--load-format", "dummy", "--ranks", "2", "--rank", "2"],
            "--rank 2 of --ranks 2",
        ),
        (&["--ranks", "8"], "--load-format dummy"),
        (&["--load-format", "dummy", "--mode", "ddtree"], "drafter/config.json"),
        (
            &["--load-format", "dummy", "--check-weights"],
            "dummy weights have neither",
        ),
        (
            &["--load-format", "dummy", "--check-weights=host"],
            "dummy weights have neither",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec![c, "--device", "cpu", "--prompts", p, "--out", o_];
        args.extend_from_slice(extra);
        let o = run(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!out.exists(), "{extra:?}: nothing written");
    }
    // A prompt id outside the slice's vocabulary is a per-line error.
    std::fs::write(&prompts, "{\"id\":\"x\",\"prompt_token_ids\":[600]}\n").unwrap();
    let o = run(&[
        c,
        "--load-format",
        "dummy",
        "--ranks",
        "2",
        "--device",
        "cpu",
        "--mode",
        "ar",
        "--prompts",
        p,
        "--out",
        o_,
    ]);
    assert_eq!(o.status.code(), Some(1));
    let r = &records(&out)[0];
    assert!(
        r["error"]["message"].as_str().unwrap().contains("vocabulary of 512"),
        "{r}"
    );
}

/// A dummy rank slice bigger than the host's memory is refused on the CPU with exit 2, naming the sizes,
/// before anything is filled or written (the k26 rank-0 slice: 72 GiB). Skipped where the host has room
/// for it (the run would then fill 72 GiB).
#[test]
fn dummy_too_big_for_the_host_is_refused() {
    let avail_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kib| kib as f64 / (1u64 << 20) as f64);
    let Some(avail) = avail_gib.filter(|&a| a < 70.0) else {
        eprintln!("SKIP: this host has room for the k26 rank-0 slice (or no /proc/meminfo)");
        return;
    };
    let d = dir("too-big");
    let cfg = d.join("k26");
    kdtree_convert::synth::write_configs("k26", &cfg, true, None).unwrap();
    let prompts = d.join("p.jsonl");
    std::fs::write(&prompts, "{\"id\":\"a\",\"prompt_token_ids\":[1,2,3]}\n").unwrap();
    let out = d.join("o.jsonl");
    let o = run(&[
        cfg.to_str().unwrap(),
        "--load-format",
        "dummy",
        "--ranks",
        "8",
        "--rank",
        "0",
        "--device",
        "cpu",
        "--mode",
        "ar",
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("do not fit") && err.contains("GiB"),
        "the error names the sizes ({avail:.1} GiB available): {err}"
    );
    assert!(!out.exists(), "nothing written");
}
