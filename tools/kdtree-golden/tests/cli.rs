//! kdtree-golden's command line as a user meets it: an error is one readable line with exit 2 (each OS
//! error once, no Debug dump or backtrace), and a closed stderr does not turn a good run into a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kdtree-golden");

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kdtree-golden-cli")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const PROMPTS: &str = "{\"id\": \"p1\", \"prompt_token_ids\": [1, 17, 305, 42]}\n";

#[test]
fn an_error_is_one_line_with_exit_2() {
    let dir = scratch("error");
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, PROMPTS).unwrap();
    for model in [dir.join("no-model"), dir.clone()] {
        let o = Command::new(BIN)
            .arg(&model)
            .arg("--prompts")
            .arg(&prompts)
            .arg("--out")
            .arg(dir.join("g"))
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("kdtree-golden: error: "), "{err}");
        assert!(err.contains("manifest.toml"), "{err}");
        assert_eq!(err.matches("os error 2").count(), 1, "{err}");
    }
}

/// The tiny preset without a drafter, one rank, built once.
fn model() -> &'static Path {
    static M: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let dir = scratch("model");
        let hf = dir.join("hf");
        kdtree_convert::synth::write("tiny", &hf, 0, false, None).expect("synth tiny");
        let model = dir.join("model");
        kdtree_convert::repack::repack(&kdtree_convert::repack::RepackOptions {
            src: hf,
            out: model.clone(),
            drafter: None,
            ranks: 1,
            experts: kdtree_formats::ExpertsMode::Tp,
            max_file_size: 1 << 30,
            quiet: true,
        })
        .expect("repack");
        model
    })
}

fn golden(model: &Path, prompts: &Path, out: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.arg(model).arg("--prompts").arg(prompts).arg("--out").arg(out);
    c.args(["--max-tokens", "2", "--topk", "2", "--full-logits-steps", "1"]);
    c
}

#[test]
fn a_closed_stderr_does_not_panic() {
    let dir = scratch("stderr");
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, PROMPTS).unwrap();
    let out = dir.join("g");
    let mut child = golden(model(), &prompts, &out).stderr(Stdio::piped()).spawn().unwrap();
    drop(child.stderr.take()); // progress lines now hit a closed pipe
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(out.join("index.json").exists());
}

#[test]
fn an_output_that_would_overwrite_an_input_is_refused_before_any_work() {
    let dir = scratch("identity");
    // The prompt file is the bundle's index.json (by a hard link), or a prompt id names a model shard.
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, PROMPTS).unwrap();
    std::fs::create_dir(dir.join("g")).unwrap();
    std::fs::hard_link(&prompts, dir.join("g/index.json")).unwrap();
    let shard = std::fs::read_dir(model())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let stem = shard.file_stem().unwrap().to_str().unwrap().to_string();
    let shard_prompts = dir.join("shard.jsonl");
    std::fs::write(
        &shard_prompts,
        format!("{{\"id\": \"{stem}\", \"prompt_token_ids\": [1, 2]}}\n"),
    )
    .unwrap();
    let shard_before = std::fs::read(&shard).unwrap();
    let file_out = dir.join("a-file");
    std::fs::write(&file_out, "KEEP").unwrap();
    for (prompts, out, what) in [
        (&prompts, dir.join("g"), "refusing to write over an input"),
        (&shard_prompts, model().to_path_buf(), "refusing to write over an input"),
        (&prompts, file_out.clone(), "not a directory"),
    ] {
        let o = golden(model(), prompts, &out).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(what) && err.lines().count() == 1, "{err}");
    }
    assert_eq!(std::fs::read_to_string(&prompts).unwrap(), PROMPTS);
    assert_eq!(std::fs::read(&shard).unwrap(), shard_before);
    assert_eq!(std::fs::read_to_string(&file_out).unwrap(), "KEEP");
}
