//! Golden bundles on disk: one safetensors file per prompt plus `index.json`.
//!
//! Written by `kdtree-golden`, read back by `kdtree-run --verify` and by crosscheck/crosscheck.py.
//! Everything here is deterministic: the safetensors crate sorts tensors by (dtype, name) and we give it
//! a single metadata key; `index.json` is built from structs (fixed field order) and holds no floats.
//!
//! Tensors of one prompt file (T = generated tokens, k = top-k, S = full-logit steps, V = vocab,
//! L = layers, N+1 = tree nodes with the root, R = draft rows):
//!
//! - `prompt_ids` (I32, [P]): prompt token ids
//! - `ar.tokens` (I32, [T]): greedy AR continuation; step s chose `ar.tokens[s]` from the logits after `prompt +
//!   ar.tokens[..s]`; stop tokens do not end it (always `--max-tokens`), so a run that stops at EOS must equal a prefix
//! - `ar.topk_ids`, `ar.topk_logits` (I32, F32, [T, k]): top-k of every step, by logit descending, ties to the lower id
//! - `ar.full_logits` (F32, [S, V]): all logits of steps 0..S
//! - `ar.router_margins` (F32, [T]): CPU bundles: the smallest CPU router decision margin (`cpu::ops::route_margin`,
//!   over the MoE layers) of the rows step s depends on: the rows of steps 0..=s (+inf without MoE layers); the
//!   evidence `--verify` needs before it takes a logit row beyond its tolerance for a route flip
//! - `trace.meta` (I32, [3]): (decode step, position, input token) of the traced forward
//! - `trace.layer.{l}.attn_out` (F32, [H]): attention block output (before the residual add)
//! - `trace.layer.{l}.router_ids`, `.router_weights` (I32, F32, [topk]): MoE layers only: chosen experts and their
//!   final weights
//! - `trace.layer.{l}.mlp_out` (F32, [H]): MLP / MoE output (before the residual add)
//! - `trace.layer.{l}.residual` (F32, [H]): residual stream after the layer
//! - `ddtree.meta` (I32, [4]): (start position, root token, budget, bonus token)
//! - `ddtree.draft_logits` (F32, [R, V]): raw draft logits of block positions 1..=R
//! - `ddtree.tree_tokens`, `.tree_parents`, `.tree_depths` (I32, [N+1]): tree, node 0 = root
//! - `ddtree.visibility` (U64, [N+1, W]): ancestor bitmasks: bit j of word j/64 in row i = node j visible to i
//! - `ddtree.verify_logits` (F32, [N+1, V]): target logits of every tree node
//! - `ddtree.router_margins` (F32, [N+1]): CPU bundles: the smallest CPU router decision margin of node n's row and its
//!   ancestors' rows in the tree's verify forward
//! - `ddtree.accepted` (I32, [A]): accepted path (node indices, starts with 0)
//! - `ddtree.decisions` (I32, [A]): the target's token at each accepted node; the last one is the bonus

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
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
    /// [T] or empty (recorded on the CPU only): the smallest CPU router decision margin over the rows of
    /// steps 0..=s (`ar.router_margins`).
    pub router_margins: Vec<f32>,
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
    /// [N+1] or empty (recorded on the CPU only): the smallest CPU router decision margin over node n's row
    /// and its ancestors' rows (`ddtree.router_margins`).
    pub router_margins: Vec<f32>,
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

mod records;
#[cfg(test)]
mod tests;

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
