//! `--budget auto` and `kdtree-run calibrate` end to end on the tiny synthetic model (CPU): without a cost
//! file auto refuses (exit 2, naming the file and the calibrate command) before writing anything; calibrate
//! writes the file (atomically, nothing else left behind); auto then runs and emits the AR tokens, with the
//! mean budget in the summary; a bad cost file is refused naming it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value as Json;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

/// The converted tiny model of this test binary (calibrate writes into it).
fn model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-auto");
        let _ = std::fs::remove_dir_all(&root);
        common::convert_tiny(&root, 5)
    })
}

fn kdtree_run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn kdtree-run")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tokens(path: &Path) -> Vec<Json> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Json>(l).unwrap()["token_ids"].clone())
        .collect()
}

/// An empty folder `name` under the tests' temporary folder (what an earlier run left there removed).
fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn auto_needs_calibrate_then_runs_losslessly() {
    let dir = fresh_dir("kdtree-run-auto-work");
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\":\"a\",\"prompt\":\"Hello \
         world\",\"max_tokens\":24}\n{\"id\":\"b\",\"prompt_token_ids\":[5,6,7,8,9],\"max_tokens\":24}\n",
    )
    .unwrap();
    let cost = model().join("kdtree-cost-cpu.json");
    let (out, summary) = (dir.join("auto.jsonl"), dir.join("s.json"));
    let auto = [
        s(model()),
        "--prompts",
        s(&prompts),
        "--out",
        s(&out),
        "--summary",
        s(&summary),
        "--device",
        "cpu",
        "--budget",
        "auto",
        "--budget-max",
        "16",
        "--quiet",
    ];

    // No cost file: a clear error, nothing written.
    let o = kdtree_run(&auto);
    assert_eq!(o.status.code(), Some(2), "stderr: {}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(s(&cost)) && e.contains("kdtree-run calibrate") && e.contains("--device cpu"),
        "{e}"
    );
    assert!(
        !out.exists() && !summary.exists(),
        "an output was written before the error"
    );

    // Calibrate writes the cost file of this device, and only it.
    let before: Vec<_> = std::fs::read_dir(model())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let o = kdtree_run(&[
        "calibrate",
        s(model()),
        "--device",
        "cpu",
        "--budget-max",
        "16",
        "--warmup",
        "1",
        "--rounds",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    assert!(stderr(&o).contains("budget   16:"), "{}", stderr(&o));
    assert!(stderr(&o).contains("feed round:"), "{}", stderr(&o));
    let after: Vec<_> = std::fs::read_dir(model())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(after.len(), before.len() + 1, "calibrate left {after:?}");
    let file: Json = serde_json::from_str(&std::fs::read_to_string(&cost).unwrap()).unwrap();
    assert_eq!((&file["schema"], &file["device"]), (&Json::from(1), &Json::from("cpu")));
    let nodes: Vec<u64> = file["verify"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(
        nodes,
        [5, 9, 17],
        "one point per bucket 4, 8, 16 (nodes = budget + root)"
    );
    // The feed round (budget 0) measured too: a time > 0.
    assert!(file["feed_us"].as_f64().is_some_and(|f| f > 0.0), "{file}");
    // And the tokens each bucket's rounds committed (auto's expectation before a sequence drafts): at least the
    // bonus, at most the bucket's nodes and the bonus.
    let per_bucket: Vec<(u64, f64)> = file["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    assert_eq!(per_bucket.iter().map(|t| t.0).collect::<Vec<_>>(), [4, 8, 16], "{file}");
    assert!(
        per_bucket.iter().all(|&(b, t)| (1.0..=b as f64 + 1.0).contains(&t)),
        "{file}"
    );
    // The cost file is a run-time file beside the model: `kdtree-convert verify` names it and passes (issue 29
    // item 4; before, "extra file not in the manifest").
    match kdtree_convert::verify::verify(model(), true).unwrap() {
        kdtree_convert::verify::Verdict::Ok { runtime, .. } => assert_eq!(runtime, ["kdtree-cost-cpu.json"]),
        v => panic!("verify after calibrate: {v:?}"),
    }
    // One bucket cannot separate the draft's cost from the verify's: --budget-max 3 is refused before loading,
    // and the full calibration stays (before, it was replaced by one with draft_us 0).
    let measured = std::fs::read(&cost).unwrap();
    let o = kdtree_run(&[
        "calibrate",
        s(model()),
        "--device",
        "cpu",
        "--budget-max",
        "3",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(2), "stderr: {}", stderr(&o));
    assert!(
        stderr(&o).contains("--budget-max 3") && stderr(&o).contains("--budget-max 5 or more"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read(&cost).unwrap(),
        measured,
        "the measured cost file was replaced"
    );

    // Auto runs now: the AR tokens, the budgets it chose in the summary.
    let o = kdtree_run(&auto);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    let ar = dir.join("ar.jsonl");
    let o = kdtree_run(&[
        s(model()),
        "--prompts",
        s(&prompts),
        "--out",
        s(&ar),
        "--device",
        "cpu",
        "--mode",
        "ar",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    assert_eq!(
        tokens(&out),
        tokens(&ar),
        "greedy --budget auto must emit the AR tokens"
    );
    let sum: Json = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    assert_eq!(
        (&sum["budget"], &sum["budget_max"]),
        (&Json::from("auto"), &Json::from(16))
    );
    // Feed rounds count as budget 0 (the synthetic drafter is random, so auto feeds wherever its measured
    // feed round beats a drafted round): the mean is at most the cap.
    let mean = sum["mean_budget"].as_f64().unwrap();
    assert!((0.0..=16.0).contains(&mean), "mean budget {mean}");
    // Feed rounds are counted, at most every round.
    let (feeds, rounds) = (
        sum["feed_rounds"].as_u64().unwrap(),
        sum["verify_steps"].as_u64().unwrap(),
    );
    assert!(feeds <= rounds && rounds > 0, "{feeds} feed rounds of {rounds}");

    // A bad cost file is refused, naming it.
    std::fs::write(&cost, "{").unwrap();
    let o = kdtree_run(&auto);
    assert_eq!(o.status.code(), Some(2), "stderr: {}", stderr(&o));
    assert!(
        stderr(&o).contains(s(&cost)) && stderr(&o).contains("bad cost file"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_file(&cost).unwrap();
}

#[test]
fn budget_flag_takes_a_count_or_auto() {
    let o = kdtree_run(&[s(model()), "--prompts", "x", "--out", "y", "--budget", "many"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("neither a node count nor `auto`"), "{}", stderr(&o));
    let o = kdtree_run(&["calibrate", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("kdtree-run calibrate"));
}

/// `calibrate --load-format dummy` measures a model of configs only (dummy weights filled from the seed) and
/// writes its cost file there, feed round included; the dummy flags are checked as `kdtree-run`'s are.
#[test]
fn calibrate_takes_dummy_weights() {
    let dir = fresh_dir("kdtree-run-auto-dummy");
    std::fs::create_dir_all(dir.join("drafter")).unwrap();
    // The synthetic model's source configs (the converted folder keeps them in its manifest).
    let hf = model().parent().unwrap().join("hf-5");
    for f in ["config.json", "drafter/config.json"] {
        std::fs::copy(hf.join(f), dir.join(f)).unwrap();
    }
    let run = |extra: &[&str]| {
        let mut a = vec![
            "calibrate",
            s(&dir),
            "--device",
            "cpu",
            "--load-format",
            "dummy",
            "--quiet",
        ];
        a.extend_from_slice(extra);
        kdtree_run(&a)
    };
    let o = run(&[
        "--budget-max",
        "8",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--dummy-seed",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let cost: Json = serde_json::from_str(&std::fs::read_to_string(dir.join("kdtree-cost-cpu.json")).unwrap()).unwrap();
    assert!(cost["feed_us"].as_f64().is_some_and(|f| f > 0.0), "{cost}");
    assert_eq!(cost["verify"].as_array().map(|v| v.len()), Some(2), "{cost}");
    let o = run(&["--rank", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("ranks count from 0"), "{}", stderr(&o));
    let o = kdtree_run(&["calibrate", s(&dir), "--device", "cpu", "--ranks", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("choose dummy weights"), "{}", stderr(&o));
}

/// `calibrate --prompts FILE` drafts from the file's prompts (text and token-id lines, the same rendering as a
/// run), says so in the cost file's note and measures every bucket over all of them; a file with no prompt, an
/// unreadable one and a line the model cannot take are errors that name the file.
#[test]
fn calibrate_from_a_prompt_file() {
    let dir = fresh_dir("kdtree-run-auto-prompts");
    // A copy of the converted model: calibrate writes its cost file into it (the other tests read theirs).
    let m = dir.join("m");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(model()).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() && !e.file_name().to_string_lossy().starts_with("kdtree-cost") {
            std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
        } else if e.file_type().unwrap().is_dir() {
            let sub = m.join(e.file_name());
            std::fs::create_dir_all(&sub).unwrap();
            for f in std::fs::read_dir(e.path()).unwrap() {
                let f = f.unwrap();
                std::fs::copy(f.path(), sub.join(f.file_name())).unwrap();
            }
        }
    }
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\":\"a\",\"prompt\":\"Hello world, once more\"}\n\n{\"id\":\"b\",\"prompt_token_ids\":[5,6,7,8,9,10]}\n",
    )
    .unwrap();
    let calibrate = |file: &Path| {
        kdtree_run(&[
            "calibrate",
            s(&m),
            "--device",
            "cpu",
            "--budget-max",
            "8",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--prompts",
            s(file),
        ])
    };
    let o = calibrate(&prompts);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("2 prompt(s)"), "{}", stderr(&o));
    let cost: Json = serde_json::from_str(&std::fs::read_to_string(m.join("kdtree-cost-cpu.json")).unwrap()).unwrap();
    let note = cost["note"].as_str().unwrap();
    assert!(
        note.contains("median of 4 greedy rounds") && note.contains(s(&prompts)),
        "{note}"
    );
    assert_eq!(cost["tokens"].as_array().map(|v| v.len()), Some(2), "{cost}");
    // Errors name the file.
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "\n\n").unwrap();
    let o = calibrate(&empty);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no line holds a prompt") && stderr(&o).contains(s(&empty)),
        "{}",
        stderr(&o)
    );
    let o = calibrate(&dir.join("missing.jsonl"));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("missing.jsonl"), "{}", stderr(&o));
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"id\":\"x\",\"prompt_token_ids\":[999999999]}\n").unwrap();
    let o = calibrate(&bad);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(s(&bad)), "{}", stderr(&o));
}
