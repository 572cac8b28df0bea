//! `manifest.toml`: the index of a converted model (format version, source fingerprint, model config,
//! plan, every file with its sha256 and every tensor with its checksum, skipped source tensors).
//! Version 2 (written) checksums each tensor with xxh3-64 (`xxh3`), so the converter runs SHA-256 over
//! each byte once (for the file hash); version 1 (still read) had a per-tensor `sha256`. FORMAT.md documents each
//! field. TOML has no null, so the config is stored twice: verbatim JSON (authoritative, re-parsed by
//! config.rs) and a TOML table of the same keys with nulls dropped (for humans and grep); parsing refuses a
//! table that disagrees with its JSON, naming the key and both values (an edit to one copy only).
//! `[[aux_files]]` (optional, default empty, so it did not change format_version) lists the tokenizer and
//! chat-template files carried byte-exactly from the source, so a converted dir is self-contained.
//! Tests: bottom of this file and formats/tests/manifest_k26.rs (size and parse time of the full plan).

use crate::error::{FormatError, Result};
use crate::plan::{ExpertsMode, Layout};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Component, Path};

/// Version written by this crate.
pub const FORMAT_VERSION: u32 = 2;
/// Versions this crate reads: 1 (per-tensor sha256) and 2 (per-tensor xxh3-64).
pub const READ_VERSIONS: [u32; 2] = [1, 2];
/// File name of the manifest inside a model directory.
pub const MANIFEST: &str = "manifest.toml";
/// File name of the checksum list (`sha256sum -c --strict` format).
pub const SHA256SUMS: &str = "SHA256SUMS";
/// Source files `kdtree-convert repack` carries into OUT byte-exactly when SRC has them (each optional),
/// in manifest / SHA256SUMS order: what the runtime needs for text (tokenizer, chat template, defaults).
pub const AUX_FILES: [&str; 4] = [
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// Whether `name` is a run-time file of a converted model directory (issue 29 item 4): written beside the model
/// after the conversion, not part of it, so not in the manifest or SHA256SUMS. `kdtree-convert verify` names
/// such files and accepts them; repack leaves them. Today one kind: `kdtree-cost-<device>.json`, the cost model
/// `kdtree-run calibrate` measures per device (`<device>`: lowercase letters, digits and `-`).
pub fn is_runtime_file(name: &str) -> bool {
    name.strip_prefix("kdtree-cost-")
        .and_then(|r| r.strip_suffix(".json"))
        .is_some_and(|slug| {
            !slug.is_empty()
                && slug
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    /// Tool and version that wrote it (no timestamp: same input, same bytes).
    pub generator: String,
    /// Source tensors deliberately not converted (vision_tower.*, mm_projector.*).
    pub skipped: Vec<String>,
    pub source: Source,
    pub model: Model,
    pub plan: PlanInfo,
    pub files: Vec<FileEntry>,
    /// Non-tensor files copied from the source (tokenizer, chat template); absent = none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aux_files: Vec<AuxFile>,
    pub tensors: Vec<TensorEntry>,
}

/// Fingerprint of the input checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    pub config_sha256: String,
    /// sha256 of model.safetensors.index.json; absent for a single-file checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_sha256: Option<String>,
    pub files: Vec<SourceFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter: Option<DrafterSource>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterSource {
    pub config_sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_sha256: Option<String>,
    pub files: Vec<SourceFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceFile {
    pub name: String,
    pub size: u64,
}

/// Model configuration. `*_json` are authoritative; the tables mirror them without nulls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// The source `text_config` object (with `quantization_config`), compact JSON, key order kept.
    pub text_config_json: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_config_json: Option<String>,
    pub text_config: toml::Table,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_config: Option<toml::Table>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanInfo {
    pub ranks: usize,
    pub experts: ExpertsMode,
    pub group_size: usize,
    /// The `--max-file-size` used (data bytes per file, soft: a bigger tensor gets a file of its own).
    pub max_file_size: u64,
    /// Whether routed experts came as INT4 (carried bit-exactly) or BF16 (quantized by the converter).
    pub experts_source: String,
    pub splits: Vec<SplitRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitRule {
    pub class: String,
    pub split: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub rank: usize,
    pub part: usize,
    pub size: u64,
    pub sha256: String,
}

/// A file carried from the source byte-exactly (see `AUX_FILES`): name in the model dir, size, sha256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuxFile {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub name: String,
    pub rank: usize,
    pub dtype: crate::Dtype,
    pub shape: Vec<usize>,
    pub logical_shape: Vec<usize>,
    pub layout: Layout,
    /// Absent when replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_axis: Option<usize>,
    pub split_offset: usize,
    pub file: String,
    /// Absolute byte offset of the data in `file`, and its length.
    pub offset: u64,
    pub nbytes: u64,
    /// Format v1: sha256 of the data (64 hex digits); empty (absent) in v2.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// Format v2: xxh3-64 of the data (16 hex digits, `xxh3_hex`); empty (absent) in v1.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub xxh3: String,
}

/// The manifest spelling of an xxh3-64 value: 16 lowercase hex digits.
pub fn xxh3_hex(h: u64) -> String {
    format!("{h:016x}")
}

/// The manifest's per-tensor checksum of `bytes`: XXH3-64, seed 0 (what the writer computes as bytes go out,
/// and what a loader compares the uploaded bytes with).
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// [`xxh3_hex`] read back (None: empty, a format-1 entry, or not 16 hex digits).
pub fn parse_xxh3_hex(s: &str) -> Option<u64> {
    if is_hex(s, 16) {
        u64::from_str_radix(s, 16).ok()
    } else {
        None
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// JSON → TOML with nulls dropped (TOML has no null); integers stay integers.
pub fn json_to_toml(v: &serde_json::Value) -> Option<toml::Value> {
    use serde_json::Value as J;
    Some(match v {
        J::Null => return None,
        J::Bool(b) => toml::Value::Boolean(*b),
        J::Number(n) => match n.as_i64() {
            Some(i) => toml::Value::Integer(i),
            None => toml::Value::Float(n.as_f64()?),
        },
        J::String(s) => toml::Value::String(s.clone()),
        J::Array(a) => toml::Value::Array(a.iter().filter_map(json_to_toml).collect()),
        J::Object(o) => toml::Value::Table(
            o.iter()
                .filter_map(|(k, v)| Some((k.clone(), json_to_toml(v)?)))
                .collect(),
        ),
    })
}

/// Whether `name` is a plain file name inside the model dir: one normal component, no separators.
pub fn is_plain_file_name(name: &str) -> bool {
    let mut c = Path::new(name).components();
    matches!((c.next(), c.next()), (Some(Component::Normal(_)), None)) && !name.contains(['/', '\\', '\0'])
}

impl Model {
    /// `[model.text_config]` / `[model.drafter_config]` must be the TOML form of the JSON they mirror (issue 29
    /// item 6): the JSON is what every reader runs, so an edit to the table alone would change nothing and
    /// say nothing. A disagreement names the key and both values; a JSON that does not parse is left to the
    /// config parser, which names it.
    fn check_mirrors(&self, file: &str) -> Result<()> {
        check_mirror(
            file,
            "text_config",
            Some(&self.text_config_json),
            Some(&self.text_config),
        )?;
        check_mirror(
            file,
            "drafter_config",
            self.drafter_config_json.as_deref(),
            self.drafter_config.as_ref(),
        )
    }
}

/// [`Model::check_mirrors`] for one `[model.{what}]` table and its `{what}_json`.
fn check_mirror(file: &str, what: &str, json: Option<&str>, table: Option<&toml::Table>) -> Result<()> {
    let mirrored = match json.map(serde_json::from_str::<serde_json::Value>) {
        None => None,
        Some(Err(_)) => return Ok(()),
        Some(Ok(v)) => Some(json_to_toml(&v).and_then(|v| v.as_table().cloned()).unwrap_or_default()),
    };
    let diff = match (&mirrored, table) {
        (None, None) => None,
        (Some(_), None) => Some(format!("[model.{what}] is missing but {what}_json is present")),
        (None, Some(_)) => Some(format!("[model.{what}] is present but {what}_json is missing")),
        (Some(want), Some(have)) => first_difference("", want, have)
            .map(|(key, have, want)| format!("[model.{what}] {key} = {have}, but {what}_json says {key} = {want}")),
    };
    match diff {
        None => Ok(()),
        Some(d) => Err(FormatError::file(
            file,
            format!(
                "{d}: the two copies of the config disagree (the JSON is the one that runs; edit both or reconvert)"
            ),
        )),
    }
}

/// The first key (dotted path, JSON order first, then keys only in `have`) whose value differs between the
/// table `want` (the JSON's) and `have` (the manifest's TOML table): (key, have's value, want's value), a value
/// shown as TOML or "absent".
fn first_difference(prefix: &str, want: &toml::Table, have: &toml::Table) -> Option<(String, String, String)> {
    let show = |v: Option<&toml::Value>| v.map_or("absent".to_string(), |v| v.to_string());
    let keys = want.keys().chain(have.keys().filter(|k| !want.contains_key(*k)));
    for k in keys {
        let key = format!("{prefix}{k}");
        match (want.get(k), have.get(k)) {
            (Some(toml::Value::Table(w)), Some(toml::Value::Table(h))) => {
                if let Some(d) = first_difference(&format!("{key}."), w, h) {
                    return Some(d);
                }
            }
            (w, h) if w != h => return Some((key, show(h), show(w))),
            _ => {}
        }
    }
    None
}

impl Manifest {
    /// Parse and check: format version first, then the structure, file names and cross references.
    pub fn parse(file: &str, text: &str) -> Result<Manifest> {
        let version = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("format_version"))
            .and_then(|r| r.trim().strip_prefix('='))
            .and_then(|v| v.trim().parse::<u32>().ok());
        let unsupported = |v: u32| {
            FormatError::file(
                file,
                format!("format_version {v} is not supported (this build reads {READ_VERSIONS:?})"),
            )
        };
        match version {
            Some(v) if READ_VERSIONS.contains(&v) => {}
            Some(v) => return Err(unsupported(v)),
            None => return Err(FormatError::file(file, "no format_version line: not a kdtree manifest")),
        }
        let m: Manifest =
            toml::from_str(text).map_err(|e| FormatError::file(file, format!("invalid manifest: {e}")))?;
        // The scan above is a quick look (a clear error before the structure of another version fails to
        // parse); the parsed value decides (the scan can be fooled, e.g. by a multi-line string).
        if !READ_VERSIONS.contains(&m.format_version) {
            return Err(unsupported(m.format_version));
        }
        m.check(file)?;
        Ok(m)
    }

    /// Cross-checks a reader relies on: safe unique file names (shards and aux files together), tensors in
    /// listed shard files, ranks in range.
    pub fn check(&self, file: &str) -> Result<()> {
        let mut names = HashSet::new();
        for f in &self.files {
            if !is_plain_file_name(&f.name) || f.name == MANIFEST || f.name == SHA256SUMS {
                return Err(FormatError::file(
                    file,
                    format!("file name {:?} is not a plain shard name", f.name),
                ));
            }
            if !names.insert(f.name.as_str()) || f.rank >= self.plan.ranks {
                return Err(FormatError::file(
                    file,
                    format!("file {:?} listed twice or rank {} out of range", f.name, f.rank),
                ));
            }
        }
        let mut all = names.clone();
        for a in &self.aux_files {
            if !is_plain_file_name(&a.name) || a.name == MANIFEST || a.name == SHA256SUMS {
                return Err(FormatError::file(
                    file,
                    format!("aux file name {:?} is not a plain file name", a.name),
                ));
            }
            if !all.insert(a.name.as_str()) {
                return Err(FormatError::file(file, format!("aux file {:?} listed twice", a.name)));
            }
        }
        self.model.check_mirrors(file)?;
        let mut seen = HashSet::new();
        for t in &self.tensors {
            if !names.contains(t.file.as_str()) {
                return Err(FormatError::tensor(
                    file,
                    &t.name,
                    format!("in unlisted file {:?}", t.file),
                ));
            }
            if t.rank >= self.plan.ranks || !seen.insert((t.name.as_str(), t.rank)) {
                return Err(FormatError::tensor(
                    file,
                    &t.name,
                    format!("rank {} out of range or listed twice", t.rank),
                ));
            }
            // One checksum per tensor, the one of this version.
            let ok = match self.format_version {
                1 => is_hex(&t.sha256, 64) && t.xxh3.is_empty(),
                _ => is_hex(&t.xxh3, 16) && t.sha256.is_empty(),
            };
            if !ok {
                let want = if self.format_version == 1 {
                    "sha256 (64 hex digits)"
                } else {
                    "xxh3 (16 hex digits)"
                };
                return Err(FormatError::tensor(
                    file,
                    &t.name,
                    format!(
                        "rank {}: format_version {} needs {want} and no other checksum",
                        t.rank, self.format_version
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| FormatError::file(MANIFEST, format!("cannot serialize: {e}")))
    }
}

/// The `SHA256SUMS` body for `(name, sha256)` pairs, in the given order (`<hex>  <name>\n`).
/// sha256 (hex) of `dir/manifest.toml`: the one fingerprint of a converted model that bundles, summaries
/// and `--verify` record and compare.
pub fn manifest_sha256(dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let p = dir.join("manifest.toml");
    let bytes = std::fs::read(&p).map_err(|e| FormatError::io(&p, e))?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

pub fn sha256sums(entries: &[(String, String)]) -> String {
    entries.iter().map(|(n, h)| format!("{h}  {n}\n")).collect()
}

/// Parse a `SHA256SUMS` body into `(name, sha256)` pairs.
pub fn parse_sha256sums(file: &str, text: &str) -> Result<Vec<(String, String)>> {
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let (h, n) = l
                .split_once("  ")
                .ok_or_else(|| FormatError::file(file, format!("line {}: expected '<sha256>  <name>'", i + 1)))?;
            if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(FormatError::file(file, format!("line {}: bad sha256 {h:?}", i + 1)));
            }
            Ok((n.to_string(), h.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny() -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            generator: "test".into(),
            skipped: vec!["vision_tower.x".into()],
            source: Source {
                config_sha256: "00".into(),
                index_sha256: None,
                files: vec![SourceFile {
                    name: "model.safetensors".into(),
                    size: 9,
                }],
                drafter: None,
            },
            model: Model {
                text_config_json: r#"{"a":null,"b":1}"#.into(),
                drafter_config_json: None,
                text_config: json_to_toml(&serde_json::json!({"a": null, "b": 1}))
                    .unwrap()
                    .as_table()
                    .unwrap()
                    .clone(),
                drafter_config: None,
            },
            plan: PlanInfo {
                ranks: 1,
                experts: ExpertsMode::Tp,
                group_size: 32,
                max_file_size: 10,
                experts_source: "int4".into(),
                splits: vec![],
            },
            files: vec![FileEntry {
                name: "rank-00-of-01.part-0000.safetensors".into(),
                rank: 0,
                part: 0,
                size: 1,
                sha256: "ab".into(),
            }],
            aux_files: vec![AuxFile {
                name: "tiktoken.model".into(),
                size: 3,
                sha256: "ef".into(),
            }],
            tensors: vec![TensorEntry {
                name: "w".into(),
                rank: 0,
                dtype: crate::Dtype::BF16,
                shape: vec![2],
                logical_shape: vec![2],
                layout: Layout::Plain,
                split_axis: None,
                split_offset: 0,
                file: "rank-00-of-01.part-0000.safetensors".into(),
                offset: 64,
                nbytes: 4,
                sha256: String::new(),
                xxh3: "00000000000000cd".into(),
            }],
        }
    }

    #[test]
    fn runtime_files_are_the_cost_files() {
        for ok in ["kdtree-cost-cpu.json", "kdtree-cost-cuda-nvidia-h200.json"] {
            assert!(is_runtime_file(ok), "{ok}");
        }
        for bad in [
            "kdtree-cost-.json",
            "kdtree-cost-CPU.json",
            "kdtree-cost-cpu.json.tmp",
            "kdtree-cost-a/b.json",
            "cost-cpu.json",
            "model.safetensors",
        ] {
            assert!(!is_runtime_file(bad), "{bad}");
        }
    }

    #[test]
    fn config_table_and_json_must_agree() {
        let mut m = tiny();
        m.model.text_config_json = r#"{"a":null,"b":1,"q":{"bits":4,"x":[1,2]}}"#.into();
        m.model.text_config =
            json_to_toml(&serde_json::from_str::<serde_json::Value>(&m.model.text_config_json).unwrap())
                .unwrap()
                .as_table()
                .unwrap()
                .clone();
        let s = m.to_toml().unwrap();
        assert_eq!(Manifest::parse("m", &s).unwrap(), m, "a faithful mirror parses");
        let err = |text: &str| Manifest::parse("m", text).unwrap_err().to_string();
        let e = err(&s.replace("b = 1", "b = 2"));
        assert!(
            e.contains("[model.text_config] b = 2, but text_config_json says b = 1"),
            "{e}"
        );
        let e = err(&s.replace("bits = 4", "bits = 8"));
        assert!(e.contains("q.bits = 8, but text_config_json says q.bits = 4"), "{e}");
        let e = err(&s.replace("b = 1", "b = 1\nextra = 3"));
        assert!(e.contains("extra = 3, but text_config_json says extra = absent"), "{e}");
        let e = err(&s.replace("b = 1\n", ""));
        assert!(e.contains("b = absent, but text_config_json says b = 1"), "{e}");
        // The drafter's pair: one without the other is refused.
        let mut d = m.clone();
        d.model.drafter_config_json = Some(r#"{"c":1}"#.into());
        let e = err(&d.to_toml().unwrap());
        assert!(e.contains("[model.drafter_config] is missing"), "{e}");
    }

    #[test]
    fn round_trips_and_drops_nulls() {
        let m = tiny();
        let s = m.to_toml().unwrap();
        assert!(s.starts_with("format_version = 2\n"), "{s}");
        assert!(!s.contains("a ="), "null kept: {s}");
        assert_eq!(Manifest::parse("m", &s).unwrap(), m);
    }

    #[test]
    fn refuses_bad_version_unsafe_names_and_unknown_fields() {
        let s = tiny().to_toml().unwrap();
        assert!(
            Manifest::parse("m", &s.replace("format_version = 2", "format_version = 9"))
                .unwrap_err()
                .to_string()
                .contains("format_version 9")
        );
        let e = Manifest::parse("m", &s.replace("\"rank-00-of-01.part-0000.safetensors\"", "\"../x\"")).unwrap_err();
        assert!(e.to_string().contains("../x"), "{e}");
        let mut m = tiny();
        m.files[0].name = "/etc/passwd".into();
        m.tensors[0].file = "/etc/passwd".into();
        assert!(m.check("m").is_err());
        let e = Manifest::parse("m", &s.replace("generator = ", "surprise = 1\ngenerator = ")).unwrap_err();
        assert!(e.to_string().contains("surprise"), "{e}");
    }

    #[test]
    fn the_version_line_scan_cannot_be_fooled_by_a_string() {
        // Found writing the fuzz target's contract (fuzz/fuzz_targets/manifest.rs): the quick scan for the
        // version line took `format_version = 1` inside a multi-line string, and the real value (7) was
        // accepted and then checked under format 2's rules.
        let s = tiny().to_toml().unwrap().replace(
            "format_version = 2\ngenerator = \"test\"\n",
            "generator = \"\"\"\nformat_version = 1\n\"\"\"\nformat_version = 7\n",
        );
        assert!(s.starts_with("generator = \"\"\"\nformat_version = 1\n"), "{s}");
        let e = Manifest::parse("m", &s).unwrap_err().to_string();
        assert!(e.contains("format_version 7 is not supported"), "{e}");
    }

    #[test]
    fn aux_files_are_optional_and_checked() {
        // Without aux files the section is not written, and a manifest without it still parses.
        let mut m = tiny();
        let s = m.to_toml().unwrap();
        assert!(
            s.contains("[[aux_files]]\nname = \"tiktoken.model\"\nsize = 3\n"),
            "{s}"
        );
        assert!(s.find("[[aux_files]]").unwrap() < s.find("[[tensors]]").unwrap(), "{s}");
        m.aux_files.clear();
        let s = m.to_toml().unwrap();
        assert!(!s.contains("aux_files"), "{s}");
        assert_eq!(Manifest::parse("m", &s).unwrap(), m);
        // Unsafe, reserved, duplicate or shard-colliding names are refused.
        for bad in [
            "../tiktoken.model",
            "/etc/passwd",
            "a/b",
            MANIFEST,
            SHA256SUMS,
            "rank-00-of-01.part-0000.safetensors",
        ] {
            let mut m = tiny();
            m.aux_files[0].name = bad.into();
            assert!(m.check("m").is_err(), "{bad} accepted");
        }
        let mut m = tiny();
        m.aux_files.push(m.aux_files[0].clone());
        assert!(m.check("m").unwrap_err().to_string().contains("listed twice"));
        let e = Manifest::parse(
            "m",
            &tiny().to_toml().unwrap().replace("size = 3\n", "size = 3\nmode = 1\n"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("mode"), "{e}");
    }

    #[test]
    fn v1_manifests_still_read_and_checksums_match_the_version() {
        // A v1 manifest: per-tensor sha256, no xxh3.
        let mut m = tiny();
        m.format_version = 1;
        m.tensors[0].xxh3.clear();
        m.tensors[0].sha256 = "cd".repeat(32);
        let s = m.to_toml().unwrap();
        assert!(
            s.starts_with("format_version = 1\n") && s.contains("sha256 = \"cdcd") && !s.contains("xxh3"),
            "{s}"
        );
        assert_eq!(Manifest::parse("m", &s).unwrap(), m);
        // Each version's checksum only: v1 with an xxh3, v2 with a sha256, a short or missing one: refused.
        let e = Manifest::parse("m", &s.replace("format_version = 1", "format_version = 2"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"w\"") && e.contains("needs xxh3"), "{e}");
        let v2 = tiny().to_toml().unwrap();
        for bad in [
            v2.replace("xxh3 = \"00000000000000cd\"", "xxh3 = \"cd\""),
            v2.replace("xxh3 = \"00000000000000cd\"\n", ""),
        ] {
            assert!(
                Manifest::parse("m", &bad)
                    .unwrap_err()
                    .to_string()
                    .contains("needs xxh3"),
                "{bad}"
            );
        }
    }

    #[test]
    fn sha256sums_round_trip() {
        let e = vec![("a b".to_string(), "0".repeat(64))];
        assert_eq!(parse_sha256sums("S", &sha256sums(&e)).unwrap(), e);
        assert!(parse_sha256sums("S", "zz  a\n").is_err());
    }
}
