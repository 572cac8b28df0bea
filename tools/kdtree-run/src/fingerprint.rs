//! Request fingerprints: each output record's `fingerprint` says what produced it, so `--resume` never
//! keeps a record whose input line or settings changed while its id stayed the same.
//!
//! A line's fingerprint is the sha256 (hex) of a canonical JSON of: the line's text as read, its
//! validation error (a `duplicate_id` error depends on other lines), the effective settings it runs
//! with ([`SamplingUsed::resolve`]: defaults merged with its overrides: temperature, top_p, top_k, seed,
//! max_tokens, stop, thinking), the decoding mode and DDTree budget (`auto` and its `--budget-max`; not
//! the cost file: a recalibration changes which budgets run, never the tokens), the hash of the model files that
//! shape a record ([`model_files`]) and, for OpenAI lines without `body.model`, the model name their
//! body echoes, and whether the load check verified the weights (and against which checksums: [`weights`]).
//! Not in it: the backend (cpu/cuda) and timings. Tests: bottom of this file; resume with
//! changed lines, flags and model in tests/run_cli.rs.

use std::path::Path;

use anyhow::{Context, Result};
use kdtree_text::prompts::PromptLine;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::records::{body_model, SamplingUsed};
use crate::runner::Defaults;

/// Files of a converted model directory that decide a record: `manifest.toml` (config, plan and the
/// checksums of every tensor) and the text side kdtree-run loads (load.rs).
pub const MODEL_FILES: [&str; 4] = [
    "manifest.toml",
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
];

/// sha256 (hex) over the sha256 of each of [`MODEL_FILES`] in `dir` ("absent" for a missing one other
/// than manifest.toml, which must exist).
pub fn model_files(dir: &Path) -> Result<String> {
    let mut all = Sha256::new();
    for name in MODEL_FILES {
        let p = dir.join(name);
        let digest = match std::fs::read(&p) {
            Ok(bytes) => hex::encode(Sha256::digest(&bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && name != "manifest.toml" => "absent".into(),
            Err(e) => {
                return Err(e).with_context(|| format!("opening model {}: reading {}", dir.display(), p.display()))
            }
        };
        all.update(format!("{name} {digest}\n"));
    }
    Ok(hex::encode(all.finalize()))
}

/// The load check's part of a record's fingerprint (issue 29 item 2): with the check on, "checked " and the
/// sha256 over `name rank xxh3` of every manifest tensor the run loads and verifies (the `drafter.*` ones only
/// when the drafter loads), in manifest order; with `--no-check-weights`, "unchecked". A record answered on
/// unchecked weights is then never kept by a checked `--resume` (a repaired model answers it again), and a
/// checked record names the very checksums its weights matched.
pub fn weights(dir: &Path, checked: bool, drafter: bool) -> Result<String> {
    if !checked {
        return Ok("unchecked".into());
    }
    let p = dir.join(kdtree_formats::manifest::MANIFEST);
    let text = std::fs::read_to_string(&p)
        .with_context(|| format!("opening model {}: reading {}", dir.display(), p.display()))?;
    let m = kdtree_formats::manifest::Manifest::parse(&p.display().to_string(), &text)
        .with_context(|| format!("opening model {}", dir.display()))?;
    let mut all = Sha256::new();
    for t in m.tensors.iter().filter(|t| drafter || !t.name.starts_with("drafter.")) {
        let sum = if t.xxh3.is_empty() { &t.sha256 } else { &t.xxh3 };
        all.update(format!("{} {} {sum}\n", t.name, t.rank));
    }
    Ok(format!("checked {}", hex::encode(all.finalize())))
}

/// The model part of a record's fingerprint: the [`model_files`] hash and the [`weights`] line together.
pub fn with_weights(model_files: &str, weights: &str) -> String {
    hex::encode(Sha256::digest(format!(
        "model files {model_files}\nweights {weights}\n"
    )))
}

/// [`model_files`] of a `--load-format dummy` model: sha256 over its config.json, drafter/config.json
/// ("absent" when missing) and the dummy plan (ranks, rank, seed), which decide every weight.
pub fn dummy_model(dir: &Path, ranks: u64, rank: u64, seed: u64) -> Result<String> {
    let mut all = Sha256::new();
    for name in ["config.json", "drafter/config.json"] {
        let p = dir.join(name);
        let digest = match std::fs::read(&p) {
            Ok(bytes) => hex::encode(Sha256::digest(&bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && name != "config.json" => "absent".into(),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("opening dummy model {}: reading {}", dir.display(), p.display()))
            }
        };
        all.update(format!("{name} {digest}\n"));
    }
    all.update(format!("dummy ranks {ranks} rank {rank} seed {seed}\n"));
    Ok(hex::encode(all.finalize()))
}

/// The fingerprint of `line` run with `defaults` on the model whose [`model_files`] hash is `model`
/// and whose directory name is `model_name`.
pub fn line(line: &PromptLine, defaults: &Defaults, model: &str, model_name: &str) -> String {
    let (mode, budget, budget_max) = crate::records::mode_fields(defaults.mode);
    let request = line.request.as_ref();
    let echoed = (line.openai && request.is_ok_and(|r| r.model.is_none())).then(|| body_model(line, model_name));
    let mut canonical = json!({
        "v": 1,
        "line": line.raw,
        "error": request.err().map(|e| format!("{}: {e}", e.code)),
        "settings": request.ok().map(|r| SamplingUsed::resolve(defaults, r).to_json()),
        "mode": mode,
        "budget": budget,
        "model": model,
        "model_name": echoed,
    });
    if let Some(m) = budget_max {
        canonical["budget_max"] = m.into(); // only under auto: the other modes' fingerprints stay as they were
    }
    hex::encode(Sha256::digest(canonical.to_string().as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kdtree_engine::generate::{Mode, Sampling};
    use kdtree_text::prompts::{parse_line, parse_prompts};

    fn defaults() -> Defaults {
        Defaults {
            max_tokens: 8,
            sampling: Sampling::greedy(),
            mode: Mode::DDTree { budget: 4 },
            thinking: true,
        }
    }

    fn fp(text: &str, d: &Defaults) -> String {
        line(&parse_line(1, text), d, "m", "tiny")
    }

    #[test]
    fn changes_with_the_input_each_effective_setting_and_the_model() {
        let d = defaults();
        let base = fp(r#"{"id":"a","prompt":"x"}"#, &d);
        assert_eq!(base.len(), 64);
        assert_eq!(base, fp(r#"{"id":"a","prompt":"x"}"#, &d), "deterministic");
        assert_ne!(base, fp(r#"{"id":"a","prompt":"y"}"#, &d));
        assert_ne!(base, fp(r#"{"id":"a","prompt":"x","seed":1}"#, &d));
        let changed = [
            Defaults {
                max_tokens: 9,
                ..defaults()
            },
            Defaults {
                sampling: Sampling {
                    temperature: 0.5,
                    ..Sampling::greedy()
                },
                ..defaults()
            },
            Defaults {
                sampling: Sampling {
                    top_p: 0.5,
                    ..Sampling::greedy()
                },
                ..defaults()
            },
            Defaults {
                sampling: Sampling {
                    top_k: 3,
                    ..Sampling::greedy()
                },
                ..defaults()
            },
            Defaults {
                sampling: Sampling {
                    seed: 3,
                    ..Sampling::greedy()
                },
                ..defaults()
            },
            Defaults {
                mode: Mode::DDTree { budget: 5 },
                ..defaults()
            },
            Defaults {
                mode: Mode::Ar,
                ..defaults()
            },
            Defaults {
                mode: Mode::DDTreeAuto { max: 4 },
                ..defaults()
            },
        ];
        for c in &changed {
            assert_ne!(base, fp(r#"{"id":"a","prompt":"x"}"#, c), "{c:?}");
        }
        let auto = |max| {
            fp(
                r#"{"id":"a","prompt":"x"}"#,
                &Defaults {
                    mode: Mode::DDTreeAuto { max },
                    ..defaults()
                },
            )
        };
        assert_ne!(auto(4), auto(8), "--budget-max counts under auto");
        // The canonical form of a fixed budget is the one records carried before auto existed.
        assert_eq!(
            base, "564e54507fee2041e9dc934d2a61a0416292e69ecd5ea06dd01cae968e5f2686",
            "pinned"
        );
        // A setting the line overrides does not matter; thinking matters only for chat lines.
        let own = r#"{"id":"a","prompt":"x","max_tokens":3}"#;
        assert_eq!(
            fp(own, &d),
            fp(
                own,
                &Defaults {
                    max_tokens: 99,
                    ..defaults()
                }
            )
        );
        assert_eq!(
            base,
            fp(
                r#"{"id":"a","prompt":"x"}"#,
                &Defaults {
                    thinking: false,
                    ..defaults()
                }
            )
        );
        let chat = r#"{"id":"a","messages":[{"role":"user","content":"x"}]}"#;
        assert_ne!(
            fp(chat, &d),
            fp(
                chat,
                &Defaults {
                    thinking: false,
                    ..defaults()
                }
            )
        );
        assert_ne!(
            base,
            line(&parse_line(1, r#"{"id":"a","prompt":"x"}"#), &d, "other model", "tiny")
        );
        // The echoed model name counts only where the body echoes it.
        let oa = concat!(
            r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","#,
            r#""content":"x"}]}}"#,
        );
        assert_ne!(
            line(&parse_line(1, oa), &d, "m", "tiny"),
            line(&parse_line(1, oa), &d, "m", "renamed")
        );
        assert_eq!(
            base,
            line(&parse_line(1, r#"{"id":"a","prompt":"x"}"#), &d, "m", "renamed")
        );
    }

    #[test]
    fn an_error_that_depends_on_other_lines_changes_it() {
        let d = defaults();
        let dup = parse_prompts("{\"id\":\"a\",\"prompt\":\"x\"}\n{\"id\":\"a\",\"prompt\":\"y\"}\n");
        let alone = parse_prompts("{\"id\":\"b\",\"prompt\":\"x\"}\n{\"id\":\"a\",\"prompt\":\"y\"}\n");
        assert_ne!(line(&dup[1], &d, "m", "t"), line(&alone[1], &d, "m", "t"));
    }

    /// A manifest.toml of one rank whose tensors are `(name, xxh3)`.
    fn manifest(tensors: &[(&str, &str)]) -> String {
        use kdtree_formats::manifest::*;
        let file = "rank-00-of-01.part-0000.safetensors".to_string();
        Manifest {
            format_version: FORMAT_VERSION,
            generator: "test".into(),
            skipped: vec![],
            source: Source {
                config_sha256: "00".into(),
                index_sha256: None,
                files: vec![],
                drafter: None,
            },
            model: Model {
                text_config_json: "{}".into(),
                drafter_config_json: None,
                text_config: json_to_toml(&json!({})).unwrap().as_table().unwrap().clone(),
                drafter_config: None,
            },
            plan: PlanInfo {
                ranks: 1,
                experts: kdtree_formats::plan::ExpertsMode::Tp,
                group_size: 32,
                max_file_size: 10,
                experts_source: "int4".into(),
                splits: vec![],
            },
            files: vec![FileEntry {
                name: file.clone(),
                rank: 0,
                part: 0,
                size: 1,
                sha256: "ab".into(),
            }],
            aux_files: vec![],
            tensors: tensors
                .iter()
                .map(|&(name, xxh3)| TensorEntry {
                    name: name.into(),
                    rank: 0,
                    dtype: kdtree_formats::Dtype::BF16,
                    shape: vec![2],
                    logical_shape: vec![2],
                    layout: kdtree_formats::plan::Layout::Plain,
                    split_axis: None,
                    split_offset: 0,
                    file: file.clone(),
                    offset: 64,
                    nbytes: 4,
                    sha256: String::new(),
                    xxh3: xxh3.into(),
                })
                .collect(),
        }
        .to_toml()
        .unwrap()
    }

    #[test]
    fn the_load_check_is_part_of_the_model_hash() {
        let dir = tempfile::tempdir().unwrap();
        assert!(weights(dir.path(), true, true).is_err(), "no manifest.toml");
        assert_eq!(weights(dir.path(), false, true).unwrap(), "unchecked");
        let m = manifest(&[("w", "00000000000000cd"), ("drafter.fc.weight", "00000000000000ef")]);
        std::fs::write(dir.path().join("manifest.toml"), &m).unwrap();
        let both = weights(dir.path(), true, true).unwrap();
        let target = weights(dir.path(), true, false).unwrap();
        assert!(both.starts_with("checked ") && target.starts_with("checked ") && both != target);
        // Another checksum of a verified tensor is another fingerprint; one of a tensor not loaded is not.
        std::fs::write(
            dir.path().join("manifest.toml"),
            m.replace("00000000000000cd", "00000000000000ce"),
        )
        .unwrap();
        assert_ne!(weights(dir.path(), true, false).unwrap(), target);
        std::fs::write(
            dir.path().join("manifest.toml"),
            m.replace("00000000000000ef", "00000000000000ee"),
        )
        .unwrap();
        assert_eq!(weights(dir.path(), true, false).unwrap(), target);
        assert_ne!(weights(dir.path(), true, true).unwrap(), both);
        // Checked and unchecked runs of one model never share a fingerprint.
        let files = "f".repeat(64);
        assert_ne!(with_weights(&files, &both), with_weights(&files, "unchecked"));
        assert_ne!(with_weights(&files, &both), with_weights(&"e".repeat(64), &both));
    }

    #[test]
    fn model_hash_covers_manifest_and_text_files() {
        let dir = tempfile::tempdir().unwrap();
        assert!(model_files(dir.path()).is_err(), "no manifest.toml");
        std::fs::write(dir.path().join("manifest.toml"), "a").unwrap();
        let a = model_files(dir.path()).unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "t").unwrap();
        let b = model_files(dir.path()).unwrap();
        std::fs::write(dir.path().join("manifest.toml"), "b").unwrap();
        let c = model_files(dir.path()).unwrap();
        assert!(a != b && b != c && a != c);
    }
}
