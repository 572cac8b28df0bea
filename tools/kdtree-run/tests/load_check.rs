//! The load check is on by default (issue 29 item 2; the host form by default, `--check-weights=device` too): one
//! byte flipped inside a tensor's data of a 2-rank conversion (the shard's size and header untouched, so the model
//! opens) stops a run with default flags, exit 2, naming the tensor and its shard file, with no records: a rank-0
//! tensor, rank 1's copy of a replicated one, and a drafter tensor. `--no-check-weights` runs the damaged model
//! (exit 0) and its records carry a fingerprint that says so, so a checked `--resume` after the repair answers them
//! again rather than keeping them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-run");

fn root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("kdtree-run-load-check")
}

/// The tiny synthetic model with its drafter, converted for 2 ranks, built once.
fn model() -> &'static Path {
    static M: OnceLock<PathBuf> = OnceLock::new();
    M.get_or_init(|| {
        let _ = std::fs::remove_dir_all(root().join("models"));
        common::convert_tiny_ranks(&root().join("models"), 0, true, 2)
    })
}

fn scratch(name: &str) -> PathBuf {
    let d = root().join("work").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A copy of the model in `dir/model` (a flip must not touch the shared one).
fn copy_model(dir: &Path) -> PathBuf {
    let to = dir.join("model");
    copy_dir(model(), &to);
    to
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Flip one exponent bit of the element in the middle of the bf16 `name` of `rank` in `dir`'s shard (its high
/// byte: the value scaled by 2^±8, enough to change greedy tokens); returns the shard's file name.
fn flip(dir: &Path, name: &str, rank: usize) -> String {
    let md = kdtree_formats::ModelDir::open(dir).unwrap();
    let t = md
        .manifest()
        .tensors
        .iter()
        .find(|t| t.name == name && t.rank == rank)
        .unwrap_or_else(|| panic!("no tensor {name} of rank {rank}"))
        .clone();
    drop(md);
    let path = dir.join(&t.file);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[((t.offset + t.nbytes / 2) | 1) as usize] ^= 0x04;
    std::fs::write(&path, &bytes).unwrap();
    t.file
}

/// kdtree-run on `m` over one token-id prompt into `out` (CPU), with `extra` flags.
fn run(dir: &Path, m: &Path, out: &Path, extra: &[&str]) -> Output {
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        concat!(
            "{\"id\":\"a\",\"prompt_token_ids\":[1,2,3],\"max_tokens\":3}\n",
            "{\"id\":\"b\",\"prompt_token_ids\":[4,5],\"max_tokens\":3}\n"
        ),
    )
    .unwrap();
    let mut a = vec![
        s(m),
        "--prompts",
        s(&prompts),
        "--out",
        s(out),
        "--device",
        "cpu",
        "--quiet",
    ];
    a.extend(extra);
    Command::new(BIN).args(&a).output().expect("spawn kdtree-run")
}

/// Default flags (the host check) and `--check-weights=device` on a model with `name` of `rank` damaged: exit 2
/// naming the tensor, its rank and its file, no records; `--no-check-weights` still runs it.
fn refused_by_default(tag: &str, name: &str, rank: usize, mode: &[&str]) {
    let dir = scratch(tag);
    let m = copy_model(&dir);
    let file = flip(&m, name, rank);
    let out = dir.join("o.jsonl");
    for (check, says) in [
        (None, "the shard's bytes"),
        (Some("--check-weights=device"), "bytes hash"),
    ] {
        let mut flags = mode.to_vec();
        flags.extend(check);
        let o = run(&dir, &m, &out, &flags);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{tag} {check:?}: {err}");
        assert!(
            err.contains(&format!("{name} (rank {rank}, {file})")) && err.contains("manifest's xxh3"),
            "{tag} {check:?}: the message names the tensor and its file: {err}"
        );
        assert!(err.contains(says), "{tag} {check:?}: {err}");
        assert!(
            !out.exists() || std::fs::read_to_string(&out).unwrap().is_empty(),
            "{tag} {check:?}: no records after a failed check"
        );
    }
    let mut unchecked = mode.to_vec();
    unchecked.push("--no-check-weights");
    let o = run(&dir, &m, &out, &unchecked);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{tag}: opting out loads the damaged bytes: {}",
        stderr(&o)
    );
}

#[test]
fn a_damaged_rank_0_tensor_is_refused_by_default() {
    refused_by_default("rank0", "language_model.model.norm.weight", 0, &["--mode", "ar"]);
}

#[test]
fn a_damaged_replicated_copy_of_rank_1_is_refused_by_default() {
    // norm.weight is replicated: rank 1 holds its own copy, which its rank loads.
    refused_by_default("rank1", "language_model.model.norm.weight", 1, &["--mode", "ar"]);
}

#[test]
fn damaged_int4_scales_of_rank_1_are_refused_by_default() {
    // The scales of an INT4 expert stack, checked from the same hash of the stack as its packed bytes.
    refused_by_default(
        "scales",
        "language_model.model.layers.1.mlp.experts.down_proj.weight_scale",
        1,
        &["--mode", "ar"],
    );
}

#[test]
fn a_damaged_drafter_tensor_is_refused_by_default() {
    refused_by_default("drafter", "drafter.fc.weight", 0, &["--budget", "4"]);
}

#[test]
fn the_intact_model_passes_and_check_weights_is_still_accepted() {
    let dir = scratch("intact");
    let out = dir.join("o.jsonl");
    let mut records = Vec::new();
    for flags in [
        &[][..],
        &["--check-weights"],
        &["--check-weights=host"],
        &["--check-weights=device"],
    ] {
        let _ = std::fs::remove_file(&out);
        let o = run(&dir, model(), &out, flags);
        assert_eq!(o.status.code(), Some(0), "{flags:?}: {}", stderr(&o));
        // Both checks verify the same checksums: one fingerprint, so a --resume across them keeps its records.
        records.push(common::stable(&out));
    }
    assert!(
        records.windows(2).all(|w| w[0] == w[1]),
        "the same records whatever the check: {records:?}"
    );
    let o = run(&dir, model(), &out, &["--check-weights", "--no-check-weights"]);
    assert_eq!(o.status.code(), Some(2), "contradicting flags: {}", stderr(&o));
    let o = run(&dir, model(), &out, &["--check-weights=gpu"]);
    assert_eq!(o.status.code(), Some(2), "an unknown place: {}", stderr(&o));
    assert!(
        stderr(&o).contains("host") && stderr(&o).contains("device"),
        "{}",
        stderr(&o)
    );
}

/// Records answered on unchecked (here damaged) weights are not kept by a checked --resume after the repair:
/// the output ends equal to a fresh run on the repaired model. An unchecked --resume keeps them (asked for).
#[test]
fn resume_after_a_repair_answers_unchecked_records_again() {
    let dir = scratch("resume");
    let m = copy_model(&dir);
    let name = "language_model.model.norm.weight";
    let file = flip(&m, name, 0);
    let out = dir.join("o.jsonl");
    let o = run(&dir, &m, &out, &["--mode", "ar", "--no-check-weights"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let damaged = common::stable(&out);
    assert_eq!(damaged.len(), 2);
    let o = run(&dir, &m, &out, &["--mode", "ar", "--no-check-weights", "--resume"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        common::stable(&out),
        damaged,
        "an unchecked resume keeps the unchecked records"
    );
    // The repair: the shard copied back from the intact model.
    std::fs::copy(model().join(&file), m.join(&file)).unwrap();
    let o = run(&dir, &m, &out, &["--mode", "ar", "--resume"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let fresh = dir.join("fresh.jsonl");
    let o = run(&dir, &m, &fresh, &["--mode", "ar"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        common::stable(&out),
        common::stable(&fresh),
        "records of the damaged run kept: {err}"
    );
    assert_ne!(
        damaged,
        common::stable(&fresh),
        "the flip changed no token: the test shows nothing"
    );
    // And a checked run's records are kept by a checked resume.
    let o = run(&dir, &m, &out, &["--mode", "ar", "--resume"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("answering them again"), "{}", stderr(&o));
    assert_eq!(common::stable(&out), common::stable(&fresh));
}

/// One source of truth in the manifest (issue 29 item 6): `[model.text_config]` mirrors `text_config_json`, which
/// is what runs; an edit to the table alone (here `hidden_size`, then `kv_lora_rank`) is refused at load, exit 2,
/// naming the key and both values (before, the run ignored it and exited 0).
#[test]
fn an_edited_config_table_is_refused() {
    let dir = scratch("config-table");
    let out = dir.join("o.jsonl");
    for key in ["hidden_size", "kv_lora_rank"] {
        let m = dir.join(format!("model-{key}"));
        copy_dir(model(), &m);
        let path = m.join("manifest.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let table = text.find("[model.text_config]").expect("the table");
        let at = table + text[table..].find(&format!("\n{key} = ")).expect("the key") + 1;
        let end = at + text[at..].find('\n').unwrap();
        let value: u64 = text[at..end].rsplit(" = ").next().unwrap().parse().unwrap();
        let edited = format!("{}{key} = {}{}", &text[..at], value * 2, &text[end..]);
        std::fs::write(&path, edited).unwrap();
        let o = run(&dir, &m, &out, &["--mode", "ar"]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{key}: {err}");
        assert!(
            err.contains(&format!(
                "[model.text_config] {key} = {}, but text_config_json says {key} = {value}",
                value * 2
            )) && err.contains("manifest.toml"),
            "{key}: {err}"
        );
    }
}
