//! Golden bundles on disk: one safetensors file per prompt plus `index.json`.
//!
//! Written by `kdtree-golden`, read back by `kdtree-run --verify` and by crosscheck/crosscheck.py.
//! Everything here is deterministic: the safetensors crate sorts tensors by (dtype, name) and we give it
//! a single metadata key; `index.json` is built from structs (fixed field order) and holds no floats.
//!
//! Tensors of one prompt file (T = generated tokens, k = top-k, S = full-logit steps, V = vocab,
//! L = layers, N+1 = tree nodes with the root, R = draft rows):
//!
//! | name | dtype | shape | meaning |
//! |---|---|---|---|
//! | `prompt_ids` | I32 | [P] | prompt token ids |
//! | `ar.tokens` | I32 | [T] | greedy AR continuation; step s chose `ar.tokens[s]` from the logits after `prompt + ar.tokens[..s]`; stop tokens do not end it (always `--max-tokens`), so a run that stops at EOS must equal a prefix |
//! | `ar.topk_ids`, `ar.topk_logits` | I32, F32 | [T, k] | top-k of every step, by logit descending, ties to the lower id |
//! | `ar.full_logits` | F32 | [S, V] | all logits of steps 0..S |
//! | `trace.meta` | I32 | [3] | (decode step, position, input token) of the traced forward |
//! | `trace.layer.{l}.attn_out` | F32 | [H] | attention block output (before the residual add) |
//! | `trace.layer.{l}.router_ids`, `.router_weights` | I32, F32 | [topk] | MoE layers only: chosen experts and their final weights |
//! | `trace.layer.{l}.mlp_out` | F32 | [H] | MLP / MoE output (before the residual add) |
//! | `trace.layer.{l}.residual` | F32 | [H] | residual stream after the layer |
//! | `ddtree.meta` | I32 | [4] | (start position, root token, budget, bonus token) |
//! | `ddtree.draft_logits` | F32 | [R, V] | raw draft logits of block positions 1..=R |
//! | `ddtree.tree_tokens`, `.tree_parents`, `.tree_depths` | I32 | [N+1] | tree, node 0 = root |
//! | `ddtree.visibility` | U64 | [N+1, W] | ancestor bitmasks: bit j of word j/64 in row i = node j visible to i |
//! | `ddtree.verify_logits` | F32 | [N+1, V] | target logits of every tree node |
//! | `ddtree.accepted` | I32 | [A] | accepted path (node indices, starts with 0) |
//! | `ddtree.decisions` | I32 | [A] | the target's token at each accepted node; the last one is the bonus |

use anyhow::{bail, ensure, Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// `format` of index.json and the one metadata value of every prompt file.
/// Format 2: recorded through the Session API with the shipping configuration (absorbed MLA); format 1
/// bundles (naive MLA) are refused, not misread.
pub const FORMAT: &str = "kdtree-golden/2";
pub const INDEX_FILE: &str = "index.json";

/// Greedy autoregressive continuation of one prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ArRecord {
    pub tokens: Vec<u32>,
    /// k of the top-k arrays.
    pub topk: usize,
    /// [T, k]
    pub topk_ids: Vec<u32>,
    /// [T, k]
    pub topk_logits: Vec<f32>,
    pub vocab: usize,
    /// Steps with full logits (S <= T).
    pub full_steps: usize,
    /// [S, V]
    pub full_logits: Vec<f32>,
}

impl ArRecord {
    /// Top-k (ids, logits) of step `s`.
    pub fn topk_row(&self, s: usize) -> (&[u32], &[f32]) {
        let k = self.topk;
        (
            &self.topk_ids[s * k..(s + 1) * k],
            &self.topk_logits[s * k..(s + 1) * k],
        )
    }
    /// Full logits of step `s` when recorded.
    pub fn full_row(&self, s: usize) -> Option<&[f32]> {
        (s < self.full_steps).then(|| &self.full_logits[s * self.vocab..(s + 1) * self.vocab])
    }
}

/// One layer of the traced decode step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerTrace {
    pub attn_out: Vec<f32>,
    /// Empty on dense layers.
    pub router_ids: Vec<u32>,
    pub router_weights: Vec<f32>,
    pub mlp_out: Vec<f32>,
    pub residual: Vec<f32>,
}

/// Per-layer tensors of one single-token decode forward.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TraceRecord {
    /// AR step whose input token was traced (the forward feeding `ar.tokens[step]`).
    pub step: usize,
    pub position: usize,
    pub token: u32,
    pub layers: Vec<LayerTrace>,
}

/// One DDTree round right after the prompt (root = greedy first token).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DdtreeRecord {
    pub start: usize,
    pub root: u32,
    pub budget: usize,
    pub vocab: usize,
    pub draft_rows: usize,
    /// [R, V]
    pub draft_logits: Vec<f32>,
    pub tree_tokens: Vec<u32>,
    pub tree_parents: Vec<i32>,
    pub tree_depths: Vec<u32>,
    pub visibility_words: usize,
    /// [N+1, W]
    pub visibility: Vec<u64>,
    /// [N+1, V]
    pub verify_logits: Vec<f32>,
    pub accepted: Vec<usize>,
    pub decisions: Vec<u32>,
    pub bonus: u32,
}

/// Everything recorded for one prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PromptRecord {
    pub prompt_ids: Vec<u32>,
    pub ar: ArRecord,
    pub trace: Option<TraceRecord>,
    pub ddtree: Option<DdtreeRecord>,
}

// ------------------------------------------------------------------------------------------------
// index.json

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub tool: String,
    pub tool_version: String,
    pub engine_version: String,
    /// The command with paths replaced by `MODEL` / `PROMPTS` / `OUT`, so the index does not depend on
    /// where things were built.
    pub command: String,
    pub model: ModelInfo,
    pub settings: Settings,
    pub prompts: Vec<PromptEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// sha256 of the model dir's manifest.toml.
    pub manifest_sha256: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub tap_layers: Vec<usize>,
    /// Drafter block size B (0 without drafter).
    pub block_size: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub max_tokens: usize,
    pub budget: usize,
    pub full_logits_steps: usize,
    pub topk: usize,
    pub trace_step: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptEntry {
    pub id: String,
    pub file: String,
    pub sha256: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Tokens the DDTree round emits (accepted drafted tokens + bonus); 0 without a round.
    pub ddtree_tokens: usize,
    /// Whether those tokens equal the AR continuation's first tokens (greedy DDTree == greedy AR).
    pub ddtree_matches_ar: bool,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A prompt id usable as a file name: `[A-Za-z0-9_.-]`, not starting with '.', at most 64 chars.
pub fn file_name_for(id: &str, ordinal: usize) -> String {
    let ok = !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        format!("{id}.safetensors")
    } else {
        format!("prompt-{ordinal:04}.safetensors")
    }
}

// ------------------------------------------------------------------------------------------------
// writing

/// Owned tensor for the safetensors writer.
struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &Owned {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

#[derive(Default)]
struct Tensors(BTreeMap<String, Owned>);

impl Tensors {
    fn put(&mut self, name: impl Into<String>, dtype: Dtype, shape: &[usize], data: Vec<u8>) {
        let name = name.into();
        let prev = self.0.insert(
            name.clone(),
            Owned {
                dtype,
                shape: shape.to_vec(),
                data,
            },
        );
        assert!(prev.is_none(), "tensor {name} written twice");
    }
    fn f32(&mut self, name: impl Into<String>, shape: &[usize], v: &[f32]) {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        self.put(
            name,
            Dtype::F32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
    fn i32(&mut self, name: impl Into<String>, shape: &[usize], v: impl IntoIterator<Item = i64>) {
        let data: Vec<u8> = v
            .into_iter()
            .flat_map(|x| i32::try_from(x).expect("value does not fit i32").to_le_bytes())
            .collect();
        assert_eq!(shape.iter().product::<usize>() * 4, data.len());
        self.put(name, Dtype::I32, shape, data);
    }
    fn u64(&mut self, name: impl Into<String>, shape: &[usize], v: &[u64]) {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        self.put(
            name,
            Dtype::U64,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
}

fn ids(v: &[u32]) -> impl Iterator<Item = i64> + '_ {
    v.iter().map(|&x| x as i64)
}

impl PromptRecord {
    /// The safetensors bytes of this record (deterministic).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut t = Tensors::default();
        t.i32("prompt_ids", &[self.prompt_ids.len()], ids(&self.prompt_ids));
        let ar = &self.ar;
        let n = ar.tokens.len();
        ensure!(
            ar.topk_ids.len() == n * ar.topk && ar.topk_logits.len() == n * ar.topk,
            "ar top-k arrays do not match {n} steps x k {}",
            ar.topk
        );
        ensure!(
            ar.full_logits.len() == ar.full_steps * ar.vocab && ar.full_steps <= n,
            "ar full logits do not match {} steps x vocab {}",
            ar.full_steps,
            ar.vocab
        );
        t.i32("ar.tokens", &[n], ids(&ar.tokens));
        t.i32("ar.topk_ids", &[n, ar.topk], ids(&ar.topk_ids));
        t.f32("ar.topk_logits", &[n, ar.topk], &ar.topk_logits);
        t.f32("ar.full_logits", &[ar.full_steps, ar.vocab], &ar.full_logits);
        if let Some(tr) = &self.trace {
            t.i32(
                "trace.meta",
                &[3],
                [tr.step as i64, tr.position as i64, tr.token as i64],
            );
            for (l, lt) in tr.layers.iter().enumerate() {
                let p = format!("trace.layer.{l}");
                t.f32(format!("{p}.attn_out"), &[lt.attn_out.len()], &lt.attn_out);
                t.f32(format!("{p}.mlp_out"), &[lt.mlp_out.len()], &lt.mlp_out);
                t.f32(format!("{p}.residual"), &[lt.residual.len()], &lt.residual);
                ensure!(
                    lt.router_ids.len() == lt.router_weights.len(),
                    "layer {l}: router ids/weights lengths differ"
                );
                if !lt.router_ids.is_empty() {
                    t.i32(format!("{p}.router_ids"), &[lt.router_ids.len()], ids(&lt.router_ids));
                    t.f32(
                        format!("{p}.router_weights"),
                        &[lt.router_weights.len()],
                        &lt.router_weights,
                    );
                }
            }
        }
        if let Some(d) = &self.ddtree {
            let nodes = d.tree_tokens.len();
            ensure!(
                d.tree_parents.len() == nodes && d.tree_depths.len() == nodes,
                "ddtree tree arrays differ in length"
            );
            ensure!(
                d.visibility.len() == nodes * d.visibility_words,
                "ddtree visibility is not [N+1, W]"
            );
            ensure!(
                d.verify_logits.len() == nodes * d.vocab,
                "ddtree verify logits are not [N+1, V]"
            );
            ensure!(
                d.draft_logits.len() == d.draft_rows * d.vocab,
                "ddtree draft logits are not [R, V]"
            );
            ensure!(
                d.accepted.len() == d.decisions.len(),
                "ddtree accepted/decisions lengths differ"
            );
            t.i32(
                "ddtree.meta",
                &[4],
                [d.start as i64, d.root as i64, d.budget as i64, d.bonus as i64],
            );
            t.f32("ddtree.draft_logits", &[d.draft_rows, d.vocab], &d.draft_logits);
            t.i32("ddtree.tree_tokens", &[nodes], ids(&d.tree_tokens));
            t.i32(
                "ddtree.tree_parents",
                &[nodes],
                d.tree_parents.iter().map(|&x| x as i64),
            );
            t.i32("ddtree.tree_depths", &[nodes], ids(&d.tree_depths));
            t.u64("ddtree.visibility", &[nodes, d.visibility_words], &d.visibility);
            t.f32("ddtree.verify_logits", &[nodes, d.vocab], &d.verify_logits);
            t.i32(
                "ddtree.accepted",
                &[d.accepted.len()],
                d.accepted.iter().map(|&x| x as i64),
            );
            t.i32("ddtree.decisions", &[d.decisions.len()], ids(&d.decisions));
        }
        let meta = HashMap::from([("format".to_string(), FORMAT.to_string())]);
        Ok(safetensors::serialize(
            t.0.iter().map(|(k, v)| (k.as_str(), v)),
            Some(meta),
        )?)
    }

    /// Parse the bytes of one prompt file.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).with_context(|| format!("{what}: not a safetensors file"))?;
        let (_, meta) = SafeTensors::read_metadata(bytes)?;
        let fmt = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format"))
            .map(String::as_str);
        ensure!(
            fmt == Some(FORMAT),
            "{what}: metadata format {fmt:?}, expected {FORMAT:?}"
        );
        let r = Reader { st: &st, what };
        let prompt_ids = r.u32s("prompt_ids")?.1;
        let (tshape, tokens) = r.u32s("ar.tokens")?;
        let n = tshape[0];
        let (kshape, topk_ids) = r.u32s("ar.topk_ids")?;
        let (_, topk_logits) = r.f32s("ar.topk_logits", Some(&kshape))?;
        ensure!(
            kshape.len() == 2 && kshape[0] == n,
            "{what}: ar.topk_ids shape {kshape:?} vs {n} tokens"
        );
        let (fshape, full_logits) = r.f32s("ar.full_logits", None)?;
        ensure!(
            fshape.len() == 2 && fshape[0] <= n,
            "{what}: ar.full_logits shape {fshape:?}"
        );
        let ar = ArRecord {
            tokens,
            topk: kshape[1],
            topk_ids,
            topk_logits,
            vocab: fshape[1],
            full_steps: fshape[0],
            full_logits,
        };

        let trace = if r.has("trace.meta") {
            let meta = r.u32s("trace.meta")?.1;
            ensure!(meta.len() == 3, "{what}: trace.meta has {} values", meta.len());
            let mut layers = Vec::new();
            while r.has(&format!("trace.layer.{}.attn_out", layers.len())) {
                let p = format!("trace.layer.{}", layers.len());
                let (router_ids, router_weights) = if r.has(&format!("{p}.router_ids")) {
                    let (s, ids) = r.u32s(&format!("{p}.router_ids"))?;
                    (ids, r.f32s(&format!("{p}.router_weights"), Some(&s))?.1)
                } else {
                    (Vec::new(), Vec::new())
                };
                layers.push(LayerTrace {
                    attn_out: r.f32s(&format!("{p}.attn_out"), None)?.1,
                    router_ids,
                    router_weights,
                    mlp_out: r.f32s(&format!("{p}.mlp_out"), None)?.1,
                    residual: r.f32s(&format!("{p}.residual"), None)?.1,
                });
            }
            Some(TraceRecord {
                step: meta[0] as usize,
                position: meta[1] as usize,
                token: meta[2],
                layers,
            })
        } else {
            None
        };

        let ddtree = if r.has("ddtree.meta") {
            let meta = r.u32s("ddtree.meta")?.1;
            ensure!(meta.len() == 4, "{what}: ddtree.meta has {} values", meta.len());
            let (dshape, draft_logits) = r.f32s("ddtree.draft_logits", None)?;
            let (nshape, tree_tokens) = r.u32s("ddtree.tree_tokens")?;
            let (_, parents) = r.ints("ddtree.tree_parents", Some(&nshape))?;
            let (_, tree_depths) = r.u32s_shaped("ddtree.tree_depths", Some(&nshape))?;
            let (vshape, visibility) = r.u64s("ddtree.visibility")?;
            ensure!(
                vshape.len() == 2 && vshape[0] == nshape[0],
                "{what}: ddtree.visibility shape {vshape:?}"
            );
            let (lshape, verify_logits) = r.f32s("ddtree.verify_logits", None)?;
            ensure!(
                lshape == [nshape[0], dshape[1]],
                "{what}: ddtree.verify_logits shape {lshape:?}"
            );
            let (ashape, accepted) = r.u32s("ddtree.accepted")?;
            let (_, decisions) = r.u32s_shaped("ddtree.decisions", Some(&ashape))?;
            Some(DdtreeRecord {
                start: meta[0] as usize,
                root: meta[1],
                budget: meta[2] as usize,
                bonus: meta[3],
                vocab: dshape[1],
                draft_rows: dshape[0],
                draft_logits,
                tree_tokens,
                tree_parents: parents,
                tree_depths,
                visibility_words: vshape[1],
                visibility,
                verify_logits,
                accepted: accepted.iter().map(|&x| x as usize).collect(),
                decisions,
            })
        } else {
            None
        };
        Ok(PromptRecord {
            prompt_ids,
            ar,
            trace,
            ddtree,
        })
    }
}

struct Reader<'a> {
    st: &'a SafeTensors<'a>,
    what: &'a str,
}

impl<'a> Reader<'a> {
    fn has(&self, name: &str) -> bool {
        self.st.tensor(name).is_ok()
    }
    fn get(&self, name: &str, dtype: Dtype, shape: Option<&[usize]>) -> Result<TensorView<'a>> {
        let t = self
            .st
            .tensor(name)
            .with_context(|| format!("{}: no tensor {name}", self.what))?;
        ensure!(
            t.dtype() == dtype,
            "{}: {name} is {:?}, expected {dtype:?}",
            self.what,
            t.dtype()
        );
        if let Some(s) = shape {
            ensure!(
                t.shape() == s,
                "{}: {name} has shape {:?}, expected {s:?}",
                self.what,
                t.shape()
            );
        }
        Ok(t)
    }
    fn ints(&self, name: &str, shape: Option<&[usize]>) -> Result<(Vec<usize>, Vec<i32>)> {
        let t = self.get(name, Dtype::I32, shape)?;
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
    fn u32s_shaped(&self, name: &str, shape: Option<&[usize]>) -> Result<(Vec<usize>, Vec<u32>)> {
        let (s, v) = self.ints(name, shape)?;
        if let Some(bad) = v.iter().find(|&&x| x < 0) {
            bail!("{}: {name} holds negative value {bad}", self.what);
        }
        Ok((s, v.into_iter().map(|x| x as u32).collect()))
    }
    fn u32s(&self, name: &str) -> Result<(Vec<usize>, Vec<u32>)> {
        self.u32s_shaped(name, None)
    }
    fn f32s(&self, name: &str, shape: Option<&[usize]>) -> Result<(Vec<usize>, Vec<f32>)> {
        let t = self.get(name, Dtype::F32, shape)?;
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
    fn u64s(&self, name: &str) -> Result<(Vec<usize>, Vec<u64>)> {
        let t = self.get(name, Dtype::U64, None)?;
        let v = t
            .data()
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok((t.shape().to_vec(), v))
    }
}

/// Write the prompt files and `index.json` into `dir` (created if missing). `records` pairs each
/// record with its prompt id. Fills in file names and hashes of `index.prompts` (which must be empty).
pub fn write_bundle(
    dir: &Path,
    mut index: Index,
    records: &[(String, PromptRecord, PromptEntryExtra)],
) -> Result<Index> {
    ensure!(
        index.prompts.is_empty(),
        "write_bundle: index.prompts is filled in here"
    );
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut seen = std::collections::HashSet::new();
    for (i, (id, rec, extra)) in records.iter().enumerate() {
        let file = file_name_for(id, i);
        ensure!(
            seen.insert(file.clone()),
            "two prompts map to file {file} (duplicate id {id:?}?)"
        );
        let bytes = rec.to_bytes()?;
        let path = dir.join(&file);
        std::fs::write(&path, &bytes).with_context(|| format!("writing {}", path.display()))?;
        index.prompts.push(PromptEntry {
            id: id.clone(),
            file,
            sha256: sha256_hex(&bytes),
            prompt_tokens: rec.prompt_ids.len(),
            generated_tokens: rec.ar.tokens.len(),
            ddtree_tokens: extra.ddtree_tokens,
            ddtree_matches_ar: extra.ddtree_matches_ar,
        });
    }
    let mut json = serde_json::to_string_pretty(&index)?;
    json.push('\n');
    std::fs::write(dir.join(INDEX_FILE), json)
        .with_context(|| format!("writing {}", dir.join(INDEX_FILE).display()))?;
    Ok(index)
}

/// Per-prompt facts for the index that the record itself does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PromptEntryExtra {
    pub ddtree_tokens: usize,
    pub ddtree_matches_ar: bool,
}

// ------------------------------------------------------------------------------------------------
// reading

/// A bundle directory opened for reading: index.json parsed, every file's sha256 checked on load.
#[derive(Debug, Clone)]
pub struct Bundle {
    pub dir: PathBuf,
    pub index: Index,
}

impl Bundle {
    pub fn open(dir: impl AsRef<Path>) -> Result<Bundle> {
        let dir = dir.as_ref().to_path_buf();
        let path = dir.join(INDEX_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let index: Index = serde_json::from_str(&text).with_context(|| format!("{}: invalid index", path.display()))?;
        ensure!(
            index.format == FORMAT,
            "{}: format {:?}, expected {FORMAT:?}",
            path.display(),
            index.format
        );
        for p in &index.prompts {
            let stem = p.file.strip_suffix(".safetensors").unwrap_or("");
            ensure!(
                file_name_for(stem, 0) == p.file,
                "{}: prompt {:?} has file name {:?} that is not a plain name",
                path.display(),
                p.id,
                p.file
            );
        }
        Ok(Bundle { dir, index })
    }

    pub fn entry(&self, id: &str) -> Option<&PromptEntry> {
        self.index.prompts.iter().find(|p| p.id == id)
    }

    /// Load one prompt's record, checking the file's sha256 against the index.
    pub fn load(&self, id: &str) -> Result<PromptRecord> {
        let e = self
            .entry(id)
            .with_context(|| format!("{}: no prompt {id:?} in the index", self.dir.display()))?;
        let path = self.dir.join(&e.file);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let got = sha256_hex(&bytes);
        ensure!(
            got == e.sha256,
            "{}: sha256 {got} differs from index {}",
            path.display(),
            e.sha256
        );
        PromptRecord::from_bytes(&bytes, &path.display().to_string())
    }

    /// Load all prompts in index order.
    pub fn load_all(&self) -> Result<Vec<(String, PromptRecord)>> {
        self.index
            .prompts
            .iter()
            .map(|p| Ok((p.id.clone(), self.load(&p.id)?)))
            .collect()
    }
}

/// Top-k of a logit row: (ids, values), by value descending, ties to the lower id; NaN never ranks.
pub fn topk_of(row: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut idx: Vec<u32> = (0..row.len() as u32).filter(|&i| !row[i as usize].is_nan()).collect();
    idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    idx.truncate(k);
    let vals = idx.iter().map(|&i| row[i as usize]).collect();
    (idx, vals)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_record(seed: u32) -> PromptRecord {
        let v = 10;
        let f = |i: usize| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 100.0 - 5.0;
        let full: Vec<f32> = (0..2 * v).map(f).collect();
        PromptRecord {
            prompt_ids: vec![1, 5, 9],
            ar: ArRecord {
                tokens: vec![3, 4, 7],
                topk: 2,
                topk_ids: vec![3, 1, 4, 0, 7, 2],
                topk_logits: vec![1.5, 1.0, 2.0, -1.0, 0.25, 0.125],
                vocab: v,
                full_steps: 2,
                full_logits: full,
            },
            trace: Some(TraceRecord {
                step: 1,
                position: 4,
                token: 3,
                layers: vec![
                    LayerTrace {
                        attn_out: vec![0.5; 4],
                        router_ids: vec![],
                        router_weights: vec![],
                        mlp_out: vec![1.0; 4],
                        residual: vec![2.0; 4],
                    },
                    LayerTrace {
                        attn_out: vec![-0.5; 4],
                        router_ids: vec![2, 0],
                        router_weights: vec![1.25, 0.75],
                        mlp_out: vec![3.0; 4],
                        residual: vec![4.0; 4],
                    },
                ],
            }),
            ddtree: Some(DdtreeRecord {
                start: 3,
                root: 3,
                budget: 2,
                vocab: v,
                draft_rows: 1,
                draft_logits: (0..v).map(f).collect(),
                tree_tokens: vec![3, 4, 5],
                tree_parents: vec![-1, 0, 0],
                tree_depths: vec![0, 1, 1],
                visibility_words: 1,
                visibility: vec![0b1, 0b11, 0b101],
                verify_logits: (0..3 * v).map(f).collect(),
                accepted: vec![0, 1],
                decisions: vec![4, 7],
                bonus: 7,
            }),
        }
    }

    #[test]
    fn record_roundtrips() {
        let r = sample_record(1);
        let bytes = r.to_bytes().unwrap();
        assert_eq!(PromptRecord::from_bytes(&bytes, "t").unwrap(), r);
        let bare = PromptRecord {
            trace: None,
            ddtree: None,
            ..sample_record(2)
        };
        assert_eq!(PromptRecord::from_bytes(&bare.to_bytes().unwrap(), "t").unwrap(), bare);
    }

    #[test]
    fn bytes_are_deterministic_and_header_is_sorted() {
        let r = sample_record(3);
        let a = r.to_bytes().unwrap();
        for _ in 0..8 {
            // fresh HashMaps inside serialize get fresh random seeds; the bytes must not move
            assert_eq!(r.clone().to_bytes().unwrap(), a);
        }
        let n = u64::from_le_bytes(a[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&a[8..8 + n]).unwrap();
        assert!(
            header.starts_with("{\"__metadata__\":{\"format\":\"kdtree-golden/2\"}"),
            "{header}"
        );
        // within one dtype, names appear in sorted order
        let pos = |s: &str| header.find(&format!("\"{s}\"")).unwrap();
        assert!(pos("ar.full_logits") < pos("ar.topk_logits"));
        assert!(pos("ar.tokens") < pos("prompt_ids"));
    }

    #[test]
    fn reader_rejects_corruption() {
        let r = sample_record(4);
        let mut bytes = r.to_bytes().unwrap();
        assert!(PromptRecord::from_bytes(&bytes[..bytes.len() - 4], "t").is_err());
        // wrong format tag
        let meta = HashMap::from([("format".to_string(), "other".to_string())]);
        let other = safetensors::serialize(Vec::<(&str, &Owned)>::new(), Some(meta)).unwrap();
        assert!(PromptRecord::from_bytes(&other, "t")
            .unwrap_err()
            .to_string()
            .contains("format"));
        let last = bytes.len() - 1;
        bytes[last] ^= 1; // still parses; the bundle's sha256 check catches it (below)
        assert!(PromptRecord::from_bytes(&bytes, "t").is_ok());
    }

    fn index() -> Index {
        Index {
            format: FORMAT.into(),
            tool: "kdtree-golden".into(),
            tool_version: "0".into(),
            engine_version: "0".into(),
            command: "kdtree-golden MODEL --prompts PROMPTS --out OUT".into(),
            model: ModelInfo {
                manifest_sha256: "00".into(),
                vocab_size: 10,
                hidden_size: 4,
                num_layers: 2,
                tap_layers: vec![1],
                block_size: 2,
            },
            settings: Settings {
                max_tokens: 3,
                budget: 2,
                full_logits_steps: 2,
                topk: 2,
                trace_step: 1,
            },
            prompts: vec![],
        }
    }

    #[test]
    fn bundle_write_read_and_sha_check() {
        let dir = tempfile::tempdir().unwrap();
        let recs = vec![
            (
                "a".to_string(),
                sample_record(5),
                PromptEntryExtra {
                    ddtree_tokens: 2,
                    ddtree_matches_ar: true,
                },
            ),
            ("bad id/..".to_string(), sample_record(6), PromptEntryExtra::default()),
        ];
        let idx = write_bundle(dir.path(), index(), &recs).unwrap();
        assert_eq!(idx.prompts[0].file, "a.safetensors");
        assert_eq!(idx.prompts[1].file, "prompt-0001.safetensors");
        let b = Bundle::open(dir.path()).unwrap();
        assert_eq!(b.index, idx);
        let all = b.load_all().unwrap();
        assert_eq!(all[0].1, recs[0].1);
        assert_eq!(all[1].0, "bad id/..");
        // a flipped byte is caught by the hash
        let p = dir.path().join("a.safetensors");
        let mut bytes = std::fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&p, bytes).unwrap();
        assert!(b.load("a").unwrap_err().to_string().contains("sha256"));
        // writing the same records again gives identical index.json bytes
        let dir2 = tempfile::tempdir().unwrap();
        write_bundle(dir2.path(), index(), &recs).unwrap();
        write_bundle(dir.path(), index(), &recs).unwrap();
        for f in ["index.json", "a.safetensors", "prompt-0001.safetensors"] {
            assert_eq!(
                std::fs::read(dir.path().join(f)).unwrap(),
                std::fs::read(dir2.path().join(f)).unwrap(),
                "{f}"
            );
        }
    }

    #[test]
    fn topk_orders_ties_by_id_and_skips_nan() {
        let (i, v) = topk_of(&[1.0, 3.0, f32::NAN, 3.0, -1.0], 3);
        assert_eq!(i, vec![1, 3, 0]);
        assert_eq!(v, vec![3.0, 3.0, 1.0]);
        assert_eq!(topk_of(&[0.5], 4).0, vec![0]);
    }
}
