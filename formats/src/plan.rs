//! The tensor-parallel plan: from the model config alone (shapes, no weights) decide every output tensor
//! of every rank, which source bytes it comes from, and which shard file it goes to. The table it
//! implements is docs/design/interfaces.md "The TP plan"; shared k26-format.md §5.2-§5.3 is the source.
//! A split that does not divide, or that would cut a 32-wide scale group, is refused naming the tensor.
//! Tests: bottom of this file and formats/tests/manifest_k26.rs (full K2.6 plan, manifest size/parse time).

use crate::config::{DrafterConfig, TextConfig};
use crate::dtype::{byte_len, Dtype};
use crate::error::{FormatError, Result};
use serde::{Deserialize, Serialize};

/// INT4 group size along K (one BF16 scale per 32 inputs).
pub const GROUP: usize = 32;

/// How routed experts are split over ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertsMode {
    /// Every rank holds every expert, split along the intermediate dimension.
    Tp,
    /// Rank r holds experts [r*E/R, (r+1)*E/R) whole.
    Ep,
}

/// Byte layout of an output tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Row-major, dtype as recorded.
    Plain,
    /// U8 `[E_r, N_r, K_r/2]`: INT4 nibbles packed along K, low nibble = even k, stored as q+8.
    Int4G32,
    /// BF16 `[E_r, N_r, K_r/32]`: one scale per group of 32 consecutive k.
    Int4G32Scale,
}

/// Which half of a routed-expert pair an output tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPart {
    Packed,
    Scale,
}

/// Where an output tensor's bytes come from. Source names of drafter tensors carry the `drafter.` prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    /// `len` rows (axis 0) or columns (axis 1) of a 2-D source from `start`; whole tensor when `axis` is None.
    Dense {
        src: String,
        axis: Option<usize>,
        start: usize,
        len: usize,
    },
    /// Experts `first..first+count` of `{stem}.{e}.{proj}`, each an `[n, k]` logical matrix, cut to
    /// rows (axis 0) or columns (axis 1) `start..start+len`, or whole when `axis` is None.
    Experts {
        stem: String,
        proj: String,
        part: ExpertPart,
        first: usize,
        count: usize,
        n: usize,
        k: usize,
        axis: Option<usize>,
        start: usize,
        len: usize,
    },
}

/// One tensor of one rank in the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutTensor {
    pub name: String,
    pub rank: usize,
    pub dtype: Dtype,
    /// Shape stored in the shard.
    pub shape: Vec<usize>,
    /// Shape of the whole (unsplit) tensor; for INT4 stacks `[E, N, K]` in elements, for scales `[E, N, K/32]`.
    pub logical_shape: Vec<usize>,
    pub layout: Layout,
    /// Axis of `logical_shape` this shard is a slice of (None: replicated), and where the slice starts.
    pub split_axis: Option<usize>,
    pub split_offset: usize,
    pub source: SourceSpec,
}

impl OutTensor {
    pub fn nbytes(&self) -> u64 {
        byte_len(self.dtype, &self.shape).expect("planned shapes are small") as u64
    }
}

/// A source tensor the plan needs, with the dtype and shape it must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedSource {
    pub name: String,
    /// Accepted dtypes (the first is the canonical one).
    pub dtypes: Vec<Dtype>,
    pub shape: Vec<usize>,
}

/// Routed-expert source form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceQuant {
    /// compressed-tensors pack-quantized: weight_packed I32, weight_scale BF16, weight_shape I32|I64.
    Int4,
    /// Plain BF16 `weight`, quantized by the converter.
    Bf16,
}

/// The full plan.
#[derive(Debug, Clone)]
pub struct Plan {
    pub ranks: usize,
    pub experts: ExpertsMode,
    pub tensors: Vec<OutTensor>,
    pub sources: Vec<ExpectedSource>,
}

struct Builder<'a> {
    r: usize,
    mode: ExpertsMode,
    quant: SourceQuant,
    out: Vec<OutTensor>,
    src: Vec<ExpectedSource>,
    _t: std::marker::PhantomData<&'a ()>,
}

/// How a dense tensor is split: replicated, or along `axis` in `units` equal blocks of `unit` rows/cols.
#[derive(Clone, Copy)]
enum Split {
    Rep,
    /// axis, number of units (heads, vocab rows, ...), what a unit is called.
    By(usize, usize, &'static str),
}

impl Builder<'_> {
    fn dense(&mut self, name: String, dtype: Dtype, shape: Vec<usize>, split: Split) -> Result<()> {
        self.src.push(ExpectedSource {
            name: name.clone(),
            dtypes: vec![dtype],
            shape: shape.clone(),
        });
        let out_name = name.clone();
        for rank in 0..self.r {
            let (axis, start, len) = match split {
                Split::Rep => (None, 0, 0),
                Split::By(axis, units, what) => {
                    if !units.is_multiple_of(self.r) {
                        return Err(FormatError::plan(
                            &name,
                            format!("{units} {what} do not divide over {} ranks", self.r),
                        ));
                    }
                    let len = shape[axis] / self.r;
                    (Some(axis), rank * len, len)
                }
            };
            let mut s = shape.clone();
            if let Some(a) = axis {
                s[a] = len;
            }
            self.out.push(OutTensor {
                name: out_name.clone(),
                rank,
                dtype,
                shape: s,
                logical_shape: shape.clone(),
                layout: Layout::Plain,
                split_axis: axis,
                split_offset: start,
                source: SourceSpec::Dense {
                    src: name.clone(),
                    axis,
                    start,
                    len,
                },
            });
        }
        Ok(())
    }

    /// Routed experts `{stem}.{0..e}.{proj}` of logical shape `[n, k]`; `k_split` says whether TP splits K (down).
    fn experts(&mut self, stem: &str, proj: &str, e: usize, n: usize, k: usize, k_split: bool) -> Result<()> {
        let r = self.r;
        let packed_name = format!("{stem}.{proj}.weight_packed");
        if !k.is_multiple_of(GROUP) {
            return Err(FormatError::plan(
                &packed_name,
                format!("K = {k} is not a multiple of the group size {GROUP}"),
            ));
        }
        for ex in 0..e {
            let base = format!("{stem}.{ex}.{proj}");
            match self.quant {
                SourceQuant::Int4 => {
                    self.src.push(ExpectedSource {
                        name: format!("{base}.weight_packed"),
                        dtypes: vec![Dtype::I32],
                        shape: vec![n, k / 8],
                    });
                    self.src.push(ExpectedSource {
                        name: format!("{base}.weight_scale"),
                        dtypes: vec![Dtype::BF16],
                        shape: vec![n, k / GROUP],
                    });
                    self.src.push(ExpectedSource {
                        name: format!("{base}.weight_shape"),
                        dtypes: vec![Dtype::I32, Dtype::I64],
                        shape: vec![2],
                    });
                }
                SourceQuant::Bf16 => self.src.push(ExpectedSource {
                    name: format!("{base}.weight"),
                    dtypes: vec![Dtype::BF16],
                    shape: vec![n, k],
                }),
            }
        }
        for rank in 0..r {
            // (first expert, count, per-expert axis, start, len, stacked split axis, offset in elements)
            let (first, count, axis, start, len) = match self.mode {
                ExpertsMode::Ep => {
                    if !e.is_multiple_of(r) {
                        return Err(FormatError::plan(
                            &packed_name,
                            format!("{e} experts do not divide over {r} ranks (--experts ep)"),
                        ));
                    }
                    (rank * e / r, e / r, None, 0, 0)
                }
                ExpertsMode::Tp => {
                    let dim = if k_split { k } else { n };
                    if !dim.is_multiple_of(r) {
                        return Err(FormatError::plan(
                            &packed_name,
                            format!("intermediate size {dim} does not divide over {r} ranks (--experts tp)"),
                        ));
                    }
                    let len = dim / r;
                    if k_split && !len.is_multiple_of(GROUP) {
                        return Err(FormatError::plan(
                            &packed_name,
                            format!(
                                "group-32 alignment: K = {k} over {r} ranks gives {len} columns per rank, not a \
                                 multiple of {GROUP}; use fewer ranks or --experts ep"
                            ),
                        ));
                    }
                    (0, e, Some(if k_split { 1 } else { 0 }), rank * len, len)
                }
            };
            let (nr, kr) = match axis {
                Some(0) => (len, k),
                Some(_) => (n, len),
                None => (n, k),
            };
            let stacked_axis = match axis {
                None => 0,
                Some(a) => a + 1,
            };
            let offset = match axis {
                None => first,
                Some(_) => start,
            };
            for part in [ExpertPart::Packed, ExpertPart::Scale] {
                let (suffix, dtype, layout, shape, logical, off) = match part {
                    ExpertPart::Packed => (
                        "weight_packed",
                        Dtype::U8,
                        Layout::Int4G32,
                        vec![count, nr, kr / 2],
                        vec![e, n, k],
                        offset,
                    ),
                    ExpertPart::Scale => {
                        let off = if stacked_axis == 2 { offset / GROUP } else { offset };
                        (
                            "weight_scale",
                            Dtype::BF16,
                            Layout::Int4G32Scale,
                            vec![count, nr, kr / GROUP],
                            vec![e, n, k / GROUP],
                            off,
                        )
                    }
                };
                self.out.push(OutTensor {
                    name: format!("{stem}.{proj}.{suffix}"),
                    rank,
                    dtype,
                    shape,
                    logical_shape: logical,
                    layout,
                    split_axis: if r == 1 && self.mode == ExpertsMode::Tp {
                        None
                    } else {
                        Some(stacked_axis)
                    },
                    split_offset: if r == 1 && self.mode == ExpertsMode::Tp { 0 } else { off },
                    source: SourceSpec::Experts {
                        stem: stem.into(),
                        proj: proj.into(),
                        part,
                        first,
                        count,
                        n,
                        k,
                        axis,
                        start,
                        len,
                    },
                });
            }
        }
        Ok(())
    }
}

/// Plan the target model (names under `prefix`, `"language_model."` on K2.6) and, when given, the drafter.
pub fn plan_model(
    text: &TextConfig,
    drafter: Option<&DrafterConfig>,
    prefix: &str,
    quant: SourceQuant,
    ranks: usize,
    experts: ExpertsMode,
) -> Result<Plan> {
    if ranks == 0 {
        return Err(FormatError::plan("(all)", "rank count must be at least 1"));
    }
    let mut b = Builder {
        r: ranks,
        mode: experts,
        quant,
        out: Vec::new(),
        src: Vec::new(),
        _t: Default::default(),
    };
    let t = text;
    let (h, nh, bf) = (t.hidden_size, t.num_attention_heads, Dtype::BF16);
    let qk = t.qk_head_dim();
    let heads = |a| Split::By(a, nh, "attention heads");
    let m = format!("{prefix}model.");
    b.dense(
        format!("{m}embed_tokens.weight"),
        bf,
        vec![t.vocab_size, h],
        Split::By(0, t.vocab_size, "vocab rows"),
    )?;
    b.dense(format!("{m}norm.weight"), bf, vec![h], Split::Rep)?;
    if !t.tie_word_embeddings {
        b.dense(
            format!("{prefix}lm_head.weight"),
            bf,
            vec![t.vocab_size, h],
            Split::By(0, t.vocab_size, "vocab rows"),
        )?;
    }
    for l in 0..t.num_hidden_layers {
        let p = format!("{m}layers.{l}.");
        b.dense(format!("{p}input_layernorm.weight"), bf, vec![h], Split::Rep)?;
        b.dense(format!("{p}post_attention_layernorm.weight"), bf, vec![h], Split::Rep)?;
        let a = format!("{p}self_attn.");
        match t.q_lora_rank {
            Some(ql) => {
                b.dense(format!("{a}q_a_proj.weight"), bf, vec![ql, h], Split::Rep)?;
                b.dense(format!("{a}q_a_layernorm.weight"), bf, vec![ql], Split::Rep)?;
                b.dense(format!("{a}q_b_proj.weight"), bf, vec![nh * qk, ql], heads(0))?;
            }
            None => b.dense(format!("{a}q_proj.weight"), bf, vec![nh * qk, h], heads(0))?,
        }
        b.dense(
            format!("{a}kv_a_proj_with_mqa.weight"),
            bf,
            vec![t.kv_lora_rank + t.qk_rope_head_dim, h],
            Split::Rep,
        )?;
        b.dense(
            format!("{a}kv_a_layernorm.weight"),
            bf,
            vec![t.kv_lora_rank],
            Split::Rep,
        )?;
        b.dense(
            format!("{a}kv_b_proj.weight"),
            bf,
            vec![nh * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank],
            heads(0),
        )?;
        b.dense(format!("{a}o_proj.weight"), bf, vec![h, nh * t.v_head_dim], heads(1))?;
        let mlp = format!("{p}mlp.");
        if !t.is_moe_layer(l) {
            mlp_dense(&mut b, &mlp, h, t.intermediate_size)?;
            continue;
        }
        let e = t.n_routed_experts;
        b.dense(format!("{mlp}gate.weight"), bf, vec![e, h], Split::Rep)?;
        if t.topk_method.as_deref() == Some("noaux_tc") {
            b.dense(
                format!("{mlp}gate.e_score_correction_bias"),
                Dtype::F32,
                vec![e],
                Split::Rep,
            )?;
        }
        if t.n_shared_experts > 0 {
            mlp_dense(
                &mut b,
                &format!("{mlp}shared_experts."),
                h,
                t.moe_intermediate_size * t.n_shared_experts,
            )?;
        }
        let stem = format!("{mlp}experts");
        let mi = t.moe_intermediate_size;
        b.experts(&stem, "gate_proj", e, mi, h, false)?;
        b.experts(&stem, "up_proj", e, mi, h, false)?;
        b.experts(&stem, "down_proj", e, h, mi, true)?;
    }
    if let Some(d) = drafter {
        plan_drafter(&mut b, d)?;
    }
    Ok(Plan {
        ranks,
        experts,
        tensors: b.out,
        sources: b.src,
    })
}

/// gate/up split by rows, down by columns, `i` = intermediate width.
fn mlp_dense(b: &mut Builder, p: &str, h: usize, i: usize) -> Result<()> {
    let bf = Dtype::BF16;
    let what = "intermediate rows";
    b.dense(format!("{p}gate_proj.weight"), bf, vec![i, h], Split::By(0, i, what))?;
    b.dense(format!("{p}up_proj.weight"), bf, vec![i, h], Split::By(0, i, what))?;
    b.dense(
        format!("{p}down_proj.weight"),
        bf,
        vec![h, i],
        Split::By(1, i, "intermediate columns"),
    )
}

/// DFlash drafter (Qwen3-style layers, no embedding / lm_head); every name gets the `drafter.` prefix.
fn plan_drafter(b: &mut Builder, d: &DrafterConfig) -> Result<()> {
    let (h, hd, nh, kv, bf) = (
        d.hidden_size,
        d.head_dim,
        d.num_attention_heads,
        d.num_key_value_heads,
        Dtype::BF16,
    );
    let nt = d.dflash_config.target_layer_ids.len();
    b.dense("drafter.fc.weight".into(), bf, vec![h, nt * h], Split::Rep)?;
    b.dense("drafter.hidden_norm.weight".into(), bf, vec![h], Split::Rep)?;
    b.dense("drafter.norm.weight".into(), bf, vec![h], Split::Rep)?;
    for l in 0..d.num_hidden_layers {
        let p = format!("drafter.layers.{l}.");
        b.dense(format!("{p}input_layernorm.weight"), bf, vec![h], Split::Rep)?;
        b.dense(format!("{p}post_attention_layernorm.weight"), bf, vec![h], Split::Rep)?;
        let a = format!("{p}self_attn.");
        b.dense(
            format!("{a}q_proj.weight"),
            bf,
            vec![nh * hd, h],
            Split::By(0, nh, "attention heads"),
        )?;
        b.dense(
            format!("{a}k_proj.weight"),
            bf,
            vec![kv * hd, h],
            Split::By(0, kv, "kv heads"),
        )?;
        b.dense(
            format!("{a}v_proj.weight"),
            bf,
            vec![kv * hd, h],
            Split::By(0, kv, "kv heads"),
        )?;
        b.dense(
            format!("{a}o_proj.weight"),
            bf,
            vec![h, nh * hd],
            Split::By(1, nh, "attention heads"),
        )?;
        b.dense(format!("{a}q_norm.weight"), bf, vec![hd], Split::Rep)?;
        b.dense(format!("{a}k_norm.weight"), bf, vec![hd], Split::Rep)?;
        mlp_dense(b, &format!("{p}mlp."), h, d.intermediate_size)?;
    }
    Ok(())
}

/// The split rules of the plan, as recorded in the manifest (class, how it is split).
pub fn split_rules(experts: ExpertsMode) -> Vec<(&'static str, &'static str)> {
    vec![
        (
            "q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm, layer norms, mlp.gate, \
             e_score_correction_bias, model.norm",
            "replicated",
        ),
        (
            "q_b_proj, kv_b_proj (q_proj without q_lora)",
            "rows (axis 0), by attention heads",
        ),
        ("o_proj", "columns (axis 1), by attention heads"),
        (
            "dense mlp / shared_experts gate_proj, up_proj",
            "rows (axis 0), intermediate / R",
        ),
        (
            "dense mlp / shared_experts down_proj",
            "columns (axis 1), intermediate / R",
        ),
        match experts {
            ExpertsMode::Tp => (
                "routed experts (stacked [E, N, K])",
                "tp: gate/up N rows (axis 1) moe_I / R; down K (axis 2) in whole 32-groups",
            ),
            ExpertsMode::Ep => (
                "routed experts (stacked [E, N, K])",
                "ep: experts axis (axis 0), E / R contiguous experts per rank",
            ),
        },
        ("embed_tokens, lm_head", "rows (axis 0), by vocab"),
        ("drafter q_proj / k_proj, v_proj", "rows (axis 0), by heads / kv heads"),
        ("drafter o_proj", "columns (axis 1), by heads"),
        ("drafter mlp gate/up / down", "rows (axis 0) / columns (axis 1)"),
        (
            "drafter fc, hidden_norm, norm, q_norm, k_norm, layer norms",
            "replicated",
        ),
    ]
}

/// One output file of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedFile {
    pub name: String,
    pub rank: usize,
    pub part: usize,
    /// Indices into `Plan::tensors`, sorted by tensor name (the order they are written in).
    pub tensors: Vec<usize>,
    pub data_bytes: u64,
}

/// `rank-03-of-08.part-0002.safetensors` (rank and part both count from 0).
pub fn shard_file_name(rank: usize, ranks: usize, part: usize) -> String {
    let w = (ranks.saturating_sub(1)).to_string().len().max(2);
    format!("rank-{rank:0w$}-of-{ranks:0w$}.part-{part:04}.safetensors")
}

/// Split each rank's tensors (sorted by name) into files of at most `max_file_size` data bytes,
/// greedily; a tensor larger than the limit gets a file of its own.
pub fn assign_files(plan: &Plan, max_file_size: u64) -> Vec<PlannedFile> {
    let mut files = Vec::new();
    for rank in 0..plan.ranks {
        let mut idx: Vec<usize> = (0..plan.tensors.len())
            .filter(|&i| plan.tensors[i].rank == rank)
            .collect();
        idx.sort_by(|&a, &b| plan.tensors[a].name.cmp(&plan.tensors[b].name));
        let mut cur = PlannedFile {
            name: String::new(),
            rank,
            part: 0,
            tensors: Vec::new(),
            data_bytes: 0,
        };
        for i in idx {
            let n = plan.tensors[i].nbytes();
            if !cur.tensors.is_empty() && cur.data_bytes + n > max_file_size {
                let part = cur.part + 1;
                files.push(std::mem::replace(
                    &mut cur,
                    PlannedFile {
                        name: String::new(),
                        rank,
                        part,
                        tensors: Vec::new(),
                        data_bytes: 0,
                    },
                ));
            }
            cur.tensors.push(i);
            cur.data_bytes += n;
        }
        files.push(cur);
    }
    for f in &mut files {
        f.name = shard_file_name(f.rank, plan.ranks, f.part);
    }
    files
}
