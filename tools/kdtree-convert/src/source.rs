//! Opening the input: a Hugging Face checkpoint (config.json + model.safetensors.index.json + shards, or a
//! single model.safetensors) and an optional DFlash drafter dir. Every safetensors header is validated by
//! formats::reader before any byte is used; weight_map entries must be plain file names inside the dir.
//! Then every tensor the plan needs is checked (present, dtype, shape, weight_shape values) and anything
//! unexpected outside vision_tower.* / mm_projector.* is refused. Configs pass formats::validate first. Reference:
//! shared k26-format.md §1.4, §2. `aux_files` finds (and hashes) the tokenizer / chat-template files repack carries
//! along. Tests: tools/kdtree-convert/tests/bad_input.rs, tests/aux_files.rs.

use anyhow::{anyhow, bail, Context, Result};
use kdtree_formats::config::{parse_drafter_config, parse_text_config, DrafterConfig, TextConfig};
use kdtree_formats::manifest::{is_plain_file_name, DrafterSource, Source, SourceFile, AUX_FILES};
use kdtree_formats::plan::{Plan, SourceQuant};
use kdtree_formats::reader::{SafeFile, TensorInfo};
use kdtree_formats::validate::{check_drafter, check_text};
use kdtree_formats::Dtype;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Source tensor names not converted (the vision tower and its projector).
pub const SKIPPED_PREFIXES: [&str; 2] = ["vision_tower.", "mm_projector."];
/// Prefix given to drafter tensor names (source and output).
pub const DRAFTER_PREFIX: &str = "drafter.";

/// An opened, header-validated input: target (and drafter) tensors by (prefixed) name.
pub struct Checkpoint {
    pub text: TextConfig,
    /// `text_config` as in the source (compact JSON), authoritative copy for the manifest.
    pub text_json: serde_json::Value,
    pub drafter: Option<DrafterConfig>,
    pub drafter_json: Option<serde_json::Value>,
    /// `"language_model."` for K2.5/K2.6, `""` for a flat DeepseekV3 checkpoint.
    pub prefix: String,
    pub quant: SourceQuant,
    pub files: Vec<SafeFile>,
    /// name → index into `files` (drafter names carry `drafter.`).
    pub tensors: HashMap<String, usize>,
    /// Files from this index on belong to the drafter (their header names lack `drafter.`).
    pub drafter_base: usize,
    pub fingerprint: Source,
    pub skipped: Vec<String>,
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// One HF model dir: its config body, index hash, files and name → file map.
struct HfDir {
    config: String,
    config_sha: String,
    index_sha: Option<String>,
    files: Vec<SafeFile>,
    sizes: Vec<SourceFile>,
    map: BTreeMap<String, usize>,
}

fn open_hf_dir(dir: &Path) -> Result<HfDir> {
    let cpath = dir.join("config.json");
    let config = std::fs::read_to_string(&cpath).with_context(|| format!("reading {}", cpath.display()))?;
    let ipath = dir.join("model.safetensors.index.json");
    let (index_sha, weight_map): (Option<String>, Vec<(String, String)>) = if ipath.exists() {
        let body = std::fs::read(&ipath).with_context(|| format!("reading {}", ipath.display()))?;
        let v: serde_json::Value =
            serde_json::from_slice(&body).with_context(|| format!("{}: invalid JSON", ipath.display()))?;
        let wm = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| anyhow!("{}: no \"weight_map\" object", ipath.display()))?;
        let mut pairs = Vec::with_capacity(wm.len());
        for (k, f) in wm {
            let f = f
                .as_str()
                .ok_or_else(|| anyhow!("{}: weight_map[\"{k}\"] is not a string", ipath.display()))?;
            pairs.push((k.clone(), f.to_string()));
        }
        (Some(sha256_hex(&body)), pairs)
    } else if dir.join("model.safetensors").exists() {
        (None, Vec::new())
    } else {
        bail!(
            "{}: neither model.safetensors.index.json nor model.safetensors",
            dir.display()
        );
    };
    let mut names: Vec<String> = if index_sha.is_some() {
        weight_map.iter().map(|(_, f)| f.clone()).collect()
    } else {
        vec!["model.safetensors".into()]
    };
    names.sort();
    names.dedup();
    let mut files = Vec::with_capacity(names.len());
    let mut sizes = Vec::with_capacity(names.len());
    let mut by_file = HashMap::new();
    for n in &names {
        if !is_plain_file_name(n) || n == ".." || n == "." {
            let t = weight_map
                .iter()
                .find(|(_, f)| f == n)
                .map(|(t, _)| t.as_str())
                .unwrap_or("?");
            bail!(
                "{}: weight_map[\"{t}\"] names {n:?}, which is not a plain file name inside {}",
                ipath.display(),
                dir.display()
            );
        }
        let p = dir.join(n);
        if !p.is_file() {
            let t = weight_map
                .iter()
                .find(|(_, f)| f == n)
                .map(|(t, _)| t.as_str())
                .unwrap_or("?");
            bail!(
                "{}: weight_map[\"{t}\"] names {n}, which does not exist in {}",
                ipath.display(),
                dir.display()
            );
        }
        let f = SafeFile::open(&p)?;
        sizes.push(SourceFile {
            name: n.clone(),
            size: std::fs::metadata(&p)?.len(),
        });
        by_file.insert(n.clone(), files.len());
        files.push(f);
    }
    let mut map = BTreeMap::new();
    if index_sha.is_some() {
        for (t, f) in &weight_map {
            let fi = by_file[f];
            if files[fi].header.get(t).is_none() {
                bail!(
                    "{}: weight_map puts tensor \"{t}\" in {f}, but its header has no such tensor",
                    ipath.display()
                );
            }
            map.insert(t.clone(), fi);
        }
    }
    for (fi, f) in files.iter().enumerate() {
        for t in &f.header.tensors {
            match map.get(&t.name) {
                Some(&g) if g == fi => {}
                Some(&g) => bail!(
                    "{}: tensor \"{}\" also present in {} (duplicate across files)",
                    f.name(),
                    t.name,
                    files[g].name()
                ),
                None if index_sha.is_none() => {
                    map.insert(t.name.clone(), fi);
                }
                None => bail!(
                    "{}: tensor \"{}\" is not listed in model.safetensors.index.json",
                    f.name(),
                    t.name
                ),
            }
        }
    }
    Ok(HfDir {
        config_sha: sha256_hex(config.as_bytes()),
        config,
        index_sha,
        files,
        sizes,
        map,
    })
}

/// The only quantization accepted: compressed-tensors pack-quantized, int4, group 32, symmetric.
fn check_quant_config(path: &str, q: &serde_json::Value) -> Result<()> {
    let method = q.get("quant_method").and_then(|v| v.as_str()).unwrap_or("");
    let format = q.get("format").and_then(|v| v.as_str()).unwrap_or("");
    if method != "compressed-tensors" || format != "pack-quantized" {
        bail!(
            "{path}: unknown quantization config: quant_method {method:?}, format {format:?} (expected \
             compressed-tensors / pack-quantized)"
        );
    }
    let groups = q
        .get("config_groups")
        .and_then(|g| g.as_object())
        .ok_or_else(|| anyhow!("{path}: unknown quantization config: no config_groups"))?;
    for (g, v) in groups {
        let w = &v["weights"];
        let ok = w["type"] == "int"
            && w["num_bits"] == 4
            && w["group_size"] == 32
            && w["symmetric"] == true
            && w["strategy"] == "group";
        if !ok {
            bail!(
                "{path}: unknown quantization config: config_groups.{g}.weights = {w} (expected int, 4 bits, \
                 group_size 32, symmetric, strategy group)"
            );
        }
    }
    Ok(())
}

/// Open and validate SRC (and the drafter dir). Headers only; no tensor data is read except weight_shape.
pub fn open(src: &Path, drafter_dir: Option<&Path>) -> Result<Checkpoint> {
    let hf = open_hf_dir(src)?;
    let cname = src.join("config.json").display().to_string();
    let text = parse_text_config(&cname, &hf.config)?;
    // Bounds and cross-field rules first: nothing below may size anything from an unchecked value.
    check_text(&cname, &text)?;
    let root: serde_json::Value = serde_json::from_str(&hf.config)?;
    let mut text_json = root.get("text_config").cloned().unwrap_or_else(|| root.clone());
    if let (Some(q), Some(t)) = (root.get("quantization_config"), text_json.as_object_mut()) {
        t.entry("quantization_config").or_insert_with(|| q.clone());
    }
    if let Some(q) = text.quantization_config.as_ref().filter(|q| !q.is_null()) {
        check_quant_config(&cname, q)?;
    }
    let prefix = if hf.map.contains_key("language_model.model.embed_tokens.weight") {
        "language_model."
    } else {
        ""
    }
    .to_string();
    let first_moe = (0..text.num_hidden_layers).find(|&l| text.is_moe_layer(l));
    let quant = match first_moe {
        Some(l) => {
            let stem = format!("{prefix}model.layers.{l}.mlp.experts.0.gate_proj");
            if hf.map.contains_key(&format!("{stem}.weight_packed")) {
                if text.quantization_config.as_ref().is_none_or(|q| q.is_null()) {
                    bail!("{cname}: {stem}.weight_packed is INT4 but config has no quantization_config");
                }
                SourceQuant::Int4
            } else if hf.map.contains_key(&format!("{stem}.weight")) {
                SourceQuant::Bf16
            } else {
                bail!(
                    "{src}: layer {l} is missing tensor \"{stem}.weight_packed\" (nor an unquantized \
                     \"{stem}.weight\")",
                    src = src.display()
                );
            }
        }
        None => SourceQuant::Bf16,
    };
    let mut files = hf.files;
    let mut tensors: HashMap<String, usize> = hf.map.into_iter().collect();
    let mut skipped: Vec<String> = tensors
        .keys()
        .filter(|n| SKIPPED_PREFIXES.iter().any(|p| n.starts_with(p)))
        .cloned()
        .collect();
    skipped.sort();
    for s in &skipped {
        tensors.remove(s);
    }
    let mut fingerprint = Source {
        config_sha256: hf.config_sha,
        index_sha256: hf.index_sha,
        files: hf.sizes,
        drafter: None,
    };
    let (mut drafter, mut drafter_json) = (None, None);
    let drafter_base = files.len();
    if let Some(d) = drafter_dir {
        let dh = open_hf_dir(d)?;
        let dname = d.join("config.json").display().to_string();
        let dc = parse_drafter_config(&dname, &dh.config)?;
        check_drafter(&dname, &dc, &text)?;
        drafter = Some(dc);
        drafter_json = Some(serde_json::from_str(&dh.config)?);
        for (n, fi) in dh.map {
            tensors.insert(format!("{DRAFTER_PREFIX}{n}"), drafter_base + fi);
        }
        files.extend(dh.files);
        fingerprint.drafter = Some(DrafterSource {
            config_sha256: dh.config_sha,
            index_sha256: dh.index_sha,
            files: dh.sizes,
        });
    }
    Ok(Checkpoint {
        text,
        text_json,
        drafter,
        drafter_json,
        prefix,
        quant,
        files,
        tensors,
        drafter_base,
        fingerprint,
        skipped,
    })
}

impl Checkpoint {
    /// Header entry and file of a (prefixed) source tensor.
    pub fn get(&self, name: &str) -> Result<(&SafeFile, &TensorInfo)> {
        let &fi = self
            .tensors
            .get(name)
            .ok_or_else(|| anyhow!("source tensor \"{name}\" not found"))?;
        let f = &self.files[fi];
        let local = if fi >= self.drafter_base {
            &name[DRAFTER_PREFIX.len()..]
        } else {
            name
        };
        let t = f
            .header
            .get(local)
            .ok_or_else(|| anyhow!("{}: tensor \"{local}\" vanished", f.name()))?;
        Ok((f, t))
    }

    fn file_of(&self, name: &str) -> PathBuf {
        self.tensors
            .get(name)
            .map(|&i| self.files[i].path.clone())
            .unwrap_or_default()
    }

    /// Every tensor the plan needs is present with the right dtype and shape; nothing unexpected remains.
    pub fn check_against(&self, plan: &Plan) -> Result<()> {
        let mut expected = std::collections::HashSet::with_capacity(plan.sources.len());
        for e in &plan.sources {
            expected.insert(e.name.as_str());
            let Some(_) = self.tensors.get(&e.name) else {
                let what = layer_of(&e.name).map_or(String::new(), |l| format!("layer {l} "));
                bail!("source: {what}is missing tensor \"{}\"", e.name);
            };
            let (f, t) = self.get(&e.name)?;
            if !e.dtypes.contains(&t.dtype) || t.shape != e.shape {
                let want: Vec<String> = e.dtypes.iter().map(|d| d.to_string()).collect();
                bail!(
                    "{}: tensor \"{}\": expected {} {:?}, found {} {:?}",
                    f.name(),
                    e.name,
                    want.join("|"),
                    e.shape,
                    t.dtype,
                    t.shape
                );
            }
            if e.name.ends_with(".weight_shape") {
                self.check_weight_shape(&e.name, plan)?;
            }
        }
        let mut extra: Vec<&String> = self.tensors.keys().filter(|n| !expected.contains(n.as_str())).collect();
        extra.sort();
        if let Some(n) = extra.first() {
            bail!(
                "{}: tensor \"{n}\" is not part of the model the config describes ({} unexpected tensors)",
                self.file_of(n).display(),
                extra.len()
            );
        }
        Ok(())
    }

    /// `weight_shape` must hold the logical [out, in] of its packed tensor (I32 or I64, little-endian).
    fn check_weight_shape(&self, name: &str, _plan: &Plan) -> Result<()> {
        let (f, t) = self.get(name)?;
        let bytes = f.read_at(f.header.data_start() + t.begin, t.nbytes())?;
        let vals: Vec<i64> = match t.dtype {
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
            _ => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        };
        let packed = name.replace(".weight_shape", ".weight_packed");
        let (_, pt) = self.get(&packed)?;
        let want = [pt.shape[0] as i64, pt.shape[1] as i64 * 8];
        if vals != want {
            bail!(
                "{}: tensor \"{name}\": holds {vals:?} but {packed} is {:?} I32, i.e. logical {want:?}",
                f.name(),
                pt.shape
            );
        }
        Ok(())
    }
}

/// Layer index in a `...layers.{L}....` name.
fn layer_of(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + 7..];
    rest.split('.').next()?.parse().ok()
}

/// A source file carried into OUT byte-exactly (one of `AUX_FILES`), with its size and sha256 as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuxSource {
    pub name: String,
    /// `SRC/name` (may be a symlink, e.g. into a Hugging Face cache's blobs; it is followed).
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
}

/// Stream `path` through sha256: (size, hex digest).
pub fn hash_file(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hex::encode(h.finalize())))
}

/// The `AUX_FILES` present in `src`, in that order, hashed. An absent name is skipped (each is optional:
/// without tiktoken.model only token-id prompts work); a name that exists but is not a readable regular
/// file after following symlinks (a dangling link, a directory) is an error rather than silently dropped.
pub fn aux_files(src: &Path) -> Result<Vec<AuxSource>> {
    let mut out = Vec::new();
    for name in AUX_FILES {
        let path = src.join(name);
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
            Ok(_) => {}
        }
        let meta = std::fs::metadata(&path)
            .with_context(|| format!("{}: exists but cannot be followed (dangling symlink?)", path.display()))?;
        if !meta.is_file() {
            bail!("{}: not a regular file", path.display());
        }
        let (size, sha256) = hash_file(&path)?;
        out.push(AuxSource {
            name: name.to_string(),
            path,
            size,
            sha256,
        });
    }
    Ok(out)
}
