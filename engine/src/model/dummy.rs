//! [`DummySource`]: `--load-format dummy` (vLLM's convention) — a [`TensorSource`] with the converter's
//! exact plan (`kdtree_formats::plan::plan_model`: names, dtypes, shapes, layouts, splits) and no bytes:
//! each tensor carries a seeded [`Fill`] instead, and the loaders fill it on the backend
//! (`Backend::fill_*`; the CUDA backend fills device buffers in place, so no weight byte is ever on the
//! host). It holds one rank r of an R-rank plan (R = 1, r = 0: the whole model), i.e. a rank slice
//! (`TensorSource::slice_rank`): what one GPU of R computes, without the all-reduces. That is how the TP8
//! rank-0 slice of the full K2.6 (74 GB) runs on one H200 without its shards.
//!
//! Distributions (cpu::ops::fill is the bit-level spec), per tensor of the plan:
//! * 2-D bf16 (projections, routers, embed_tokens, lm_head, the drafter's fc): U(−a, a), a = 1/√fan_in,
//!   fan_in = the logical (unsplit) column count;
//! * 1-D bf16 (every norm weight): U(0.9, 1.1);
//! * f32 (e_score_correction_bias): U(−0.01, 0.01);
//! * INT4 nibble stacks: uniform bytes (q uniform over −8..7); their bf16 group scales U(0.5, 1.5)/(8√K),
//!   K = the logical input width, so a dequantised weight is below 12/(8√K) = 1.5/√K in magnitude.
//!
//! Tensor seed = splitmix64 chain of (seed, rank, FNV-1a of the name): distinct per tensor and rank,
//! stable across runs and builds. Tests: engine/tests/dummy_load.rs; GPU: engine/tests/cuda_target.rs.

use super::source::{ShardFacts, TensorSource};
use crate::cpu::ops::Fill;
use anyhow::{ensure, Context, Result};
use kdtree_formats::config::{parse_drafter_config, parse_text_config, DrafterConfig, TextConfig};
use kdtree_formats::plan::{plan_model, ExpertsMode, Layout, SourceQuant};
use kdtree_formats::{Dtype, TensorRef};
use std::collections::HashMap;

/// One planned tensor of the held rank, with its fill.
struct DummyTensor {
    facts: ShardFacts,
    fill: Fill,
    nbytes: u64,
}

/// Rank `rank` of the `ranks`-rank plan of a config, every tensor a seeded fill (module header).
pub struct DummySource {
    text: TextConfig,
    drafter: Option<DrafterConfig>,
    ranks: usize,
    rank: usize,
    seed: u64,
    tensors: HashMap<String, DummyTensor>,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fill seed of tensor `name` of `rank` under run seed `seed` (module header).
pub fn tensor_seed(seed: u64, rank: usize, name: &str) -> u64 {
    let fnv = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    });
    splitmix64(splitmix64(splitmix64(seed) ^ rank as u64) ^ fnv)
}

/// The distribution of one planned tensor (module header).
fn fill_for(name: &str, dtype: Dtype, layout: Layout, logical: &[usize], seed: u64) -> Result<Fill> {
    Ok(match (layout, dtype, logical.len()) {
        (Layout::Int4G32, Dtype::U8, 3) => Fill::Bytes { seed },
        (Layout::Int4G32Scale, Dtype::BF16, 3) => {
            let b = 1.0 / (8.0 * ((logical[2] * 32) as f32).sqrt());
            Fill::Uniform {
                seed,
                center: b,
                half: 0.5 * b,
            }
        }
        (Layout::Plain, Dtype::BF16, 2) => Fill::Uniform {
            seed,
            center: 0.0,
            half: 1.0 / (logical[1] as f32).sqrt(),
        },
        (Layout::Plain, Dtype::BF16, 1) => Fill::Uniform {
            seed,
            center: 1.0,
            half: 0.1,
        },
        (Layout::Plain, Dtype::F32, 1) => Fill::Uniform {
            seed,
            center: 0.0,
            half: 0.01,
        },
        _ => anyhow::bail!("{name}: no dummy fill for a {dtype} {layout:?} tensor of logical shape {logical:?}"),
    })
}

impl DummySource {
    /// Rank `rank` of the `ranks`-rank plan (`experts`: how routed experts split) of `text` (tensor names
    /// under `prefix`, `"language_model."` on K2.6) and, when given, the drafter; fills from `seed`.
    pub fn new(
        text: TextConfig,
        drafter: Option<DrafterConfig>,
        prefix: &str,
        ranks: usize,
        rank: usize,
        experts: ExpertsMode,
        seed: u64,
    ) -> Result<DummySource> {
        ensure!(
            rank < ranks,
            "dummy weights: rank {rank} of {ranks} ranks (ranks count from 0)"
        );
        let plan = plan_model(&text, drafter.as_ref(), prefix, SourceQuant::Bf16, ranks, experts)?;
        let mut tensors = HashMap::new();
        for o in plan.tensors.into_iter().filter(|o| o.rank == rank) {
            let fill = fill_for(
                &o.name,
                o.dtype,
                o.layout,
                &o.logical_shape,
                tensor_seed(seed, rank, &o.name),
            )?;
            let nbytes = o.nbytes();
            let t = DummyTensor {
                facts: ShardFacts::of(&o),
                fill,
                nbytes,
            };
            tensors.insert(o.name, t);
        }
        Ok(DummySource {
            text,
            drafter,
            ranks,
            rank,
            seed,
            tensors,
        })
    }

    /// From config.json bodies (HF layout: nested `text_config` means K2.6 names, `language_model.`;
    /// a drafter's config.json when given); `path` names them in errors. Routed experts are split MoE-TP
    /// (vLLM's default without expert parallelism; the CUDA backend runs only that split).
    pub fn from_json(
        path: &str,
        config: &str,
        drafter: Option<(&str, &str)>,
        ranks: usize,
        rank: usize,
        seed: u64,
    ) -> Result<DummySource> {
        let text = parse_text_config(path, config)?;
        let nested = kdtree_formats::config::has_text_config(config);
        let drafter = match drafter {
            Some((p, body)) => Some(parse_drafter_config(p, body)?),
            None => None,
        };
        let prefix = if nested { "language_model." } else { "" };
        DummySource::new(text, drafter, prefix, ranks, rank, ExpertsMode::Tp, seed)
            .with_context(|| format!("dummy weights for {path}"))
    }

    /// Bytes the held rank's tensors take (target and drafter): what a load fills.
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.nbytes).sum()
    }
    /// The held rank and the plan's rank count.
    pub fn rank(&self) -> (usize, usize) {
        (self.rank, self.ranks)
    }
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// Names of the held rank's tensors with their dtype and shard shape, sorted by name.
    pub fn listing(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        let mut v: Vec<_> = self
            .tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.facts.dtype(), t.facts.shape().to_vec()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

// SAFETY: a DummySource holds no tensor bytes: every `TensorRef::data` is the empty static slice, which is
// valid and unchanged forever.
unsafe impl TensorSource for DummySource {
    fn text_config(&self) -> &TextConfig {
        &self.text
    }
    fn drafter_config(&self) -> Option<&DrafterConfig> {
        self.drafter.as_ref()
    }
    fn ranks(&self) -> usize {
        self.ranks
    }
    fn tensor(&self, name: &str, rank: usize) -> Result<TensorRef<'_>> {
        ensure!(
            rank == self.rank,
            "dummy weights: {name} asked for rank {rank}, this source holds rank {} of {} only",
            self.rank,
            self.ranks
        );
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("dummy weights: no tensor {name} in the plan (rank {rank})"))?;
        Ok(t.facts.tensor_ref(&[]))
    }
    fn slice_rank(&self) -> Option<usize> {
        Some(self.rank)
    }
    fn fill(&self, name: &str, rank: usize) -> Option<Fill> {
        (rank == self.rank)
            .then(|| self.tensors.get(name).map(|t| t.fill))
            .flatten()
    }
}
