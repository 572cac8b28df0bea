//! Where weights come from: the [`TensorSource`] trait (one tensor of one rank, as bytes), its two
//! implementations — `kdtree_formats::ModelDir` (mmapped shards) and [`MemSource`] (in-memory tensors split
//! by the *same* TP plan the converter uses, `kdtree_formats::plan::plan_model`) — and [`Slab`], a typed,
//! zero-copy view of a tensor's bytes that keeps its source alive.
//!
//! Must match: docs/design/interfaces.md (converted names, TP plan, `TensorRef`). Tested by the model
//! tests (engine/tests/target_model.rs) and engine/tests/target_plans.rs (real shards).

use crate::backend::Fill;
pub use crate::backend::{pod_vec, MappedView, Slab};
use anyhow::{bail, ensure, Context, Result};
use kdtree_formats::config::{DrafterConfig, TextConfig};
use kdtree_formats::plan::{plan_model, ExpertsMode, Layout, SourceQuant};
use kdtree_formats::{Dtype, ModelDir, TensorRef};
use std::collections::HashMap;

/// A set of per-rank tensors under the converted names of interfaces.md.
///
/// # Safety
/// Implementors promise that the `data` slices returned by [`TensorSource::tensor`] stay valid and
/// unchanged, at the same address, for as long as the source value lives (it is kept in an `Arc` and
/// never mutated after construction). [`Slab`] relies on this to hold zero-copy views.
pub unsafe trait TensorSource: Send + Sync + 'static {
    fn text_config(&self) -> &TextConfig;
    fn drafter_config(&self) -> Option<&DrafterConfig>;
    /// Rank count R of the plan.
    fn ranks(&self) -> usize;
    /// Tensor `name` of `rank` (error when absent).
    fn tensor(&self, name: &str, rank: usize) -> Result<TensorRef<'_>>;
    /// Some(r): this source holds rank r of its `ranks()` only (a rank slice, run alone on one device:
    /// model/dummy.rs); None (the default): every rank.
    fn slice_rank(&self) -> Option<usize> {
        None
    }
    /// Some(fill): `name` of `rank` has no bytes (its `TensorRef::data` is empty) and is filled on the
    /// backend from this seeded distribution instead (`Backend::fill_*`, `--load-format dummy`).
    fn fill(&self, _name: &str, _rank: usize) -> Option<Fill> {
        None
    }
}

// SAFETY: ModelDir maps its shards read-only once at open and never remaps or mutates them; the mmap
// contract (files must not change while mapped) is documented on `ModelDir::open`.
unsafe impl TensorSource for ModelDir {
    fn text_config(&self) -> &TextConfig {
        ModelDir::text_config(self)
    }
    fn drafter_config(&self) -> Option<&DrafterConfig> {
        ModelDir::drafter_config(self)
    }
    fn ranks(&self) -> usize {
        ModelDir::ranks(self)
    }
    fn tensor(&self, name: &str, rank: usize) -> Result<TensorRef<'_>> {
        Ok(ModelDir::tensor(self, name, rank)?)
    }
}

/// Fetch `name` of `rank`, checking dtype and shard shape; the error names the tensor and both shapes.
pub fn expect<'a>(
    src: &'a dyn TensorSource,
    name: &str,
    rank: usize,
    dtype: Dtype,
    shape: &[usize],
) -> Result<TensorRef<'a>> {
    let t = src.tensor(name, rank)?;
    ensure!(
        t.dtype == dtype && t.shape == shape,
        "{name} (rank {rank}): expected {dtype} {shape:?}, found {} {:?}",
        t.dtype,
        t.shape
    );
    Ok(t)
}

/// Check the recorded split of a shard against what the engine assumes: `axis` of the logical tensor,
/// starting at `offset` (`None` = replicated). This is where the engine proves it reads the plan right.
pub fn expect_split(t: &TensorRef<'_>, name: &str, rank: usize, axis: Option<usize>, offset: usize) -> Result<()> {
    let found = (t.split_axis, if t.split_axis.is_some() { t.split_offset } else { 0 });
    ensure!(
        found == (axis, offset),
        "{name} (rank {rank}): expected split {axis:?} at {offset}, manifest says {:?} at {}",
        t.split_axis,
        t.split_offset
    );
    Ok(())
}

/// One whole (unsplit) tensor held in memory, under its converted name.
#[derive(Clone)]
pub struct MemTensor {
    pub dtype: Dtype,
    /// Logical shape in elements (INT4 stacks `[E, N, K]`; their bytes are `[E, N, K/2]`).
    pub shape: Vec<usize>,
    pub layout: Layout,
    pub data: Vec<u8>,
}

/// Per-rank tensors cut from whole in-memory tensors by `kdtree_formats::plan::plan_model`, exactly as the
/// converter would write them. Used by tests and by anyone who builds a model without files.
pub struct MemSource {
    text: TextConfig,
    ranks: usize,
    /// (name, rank) → the shard
    shards: HashMap<(String, usize), MemShard>,
}

/// The manifest facts a `TensorRef` carries about one planned shard (what in-memory sources keep per tensor).
pub(crate) struct ShardFacts {
    dtype: Dtype,
    shape: Vec<usize>,
    logical_shape: Vec<usize>,
    layout: Layout,
    split_axis: Option<usize>,
    split_offset: usize,
}

impl ShardFacts {
    /// The facts of a planned tensor.
    pub(crate) fn of(o: &kdtree_formats::plan::OutTensor) -> ShardFacts {
        ShardFacts {
            dtype: o.dtype,
            shape: o.shape.clone(),
            logical_shape: o.logical_shape.clone(),
            layout: o.layout,
            split_axis: o.split_axis,
            split_offset: o.split_offset,
        }
    }
    pub(crate) fn dtype(&self) -> Dtype {
        self.dtype
    }
    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// A `TensorRef` of these facts over `data`.
    pub(crate) fn tensor_ref<'a>(&'a self, data: &'a [u8]) -> TensorRef<'a> {
        TensorRef {
            dtype: self.dtype,
            shape: &self.shape,
            logical_shape: &self.logical_shape,
            layout: self.layout,
            split_axis: self.split_axis,
            split_offset: self.split_offset,
            data,
            xxh3: None,
            file: None,
        }
    }
}

/// One rank's slice of a [`MemTensor`].
struct MemShard {
    facts: ShardFacts,
    data: Vec<u8>,
}

impl MemSource {
    /// Split `tensors` (converted names, prefix `prefix`, e.g. `"language_model."`) over `ranks` ranks.
    pub fn new(
        text: TextConfig,
        prefix: &str,
        tensors: &HashMap<String, MemTensor>,
        ranks: usize,
        experts: ExpertsMode,
    ) -> Result<MemSource> {
        let plan = plan_model(&text, None, prefix, SourceQuant::Bf16, ranks, experts)?;
        let mut shards = HashMap::new();
        for o in &plan.tensors {
            let whole = tensors
                .get(&o.name)
                .with_context(|| format!("MemSource: plan needs {} but it was not given", o.name))?;
            ensure!(
                whole.shape == o.logical_shape,
                "MemSource: {} has shape {:?}, plan expects {:?}",
                o.name,
                whole.shape,
                o.logical_shape
            );
            let bytes = slice_bytes(whole, o.split_axis, o.split_offset, &o.shape)?;
            let shard = MemShard {
                facts: ShardFacts::of(o),
                data: bytes,
            };
            shards.insert((o.name.clone(), o.rank), shard);
        }
        Ok(MemSource { text, ranks, shards })
    }
}

/// Cut `shard_shape` out of `whole` along `axis` from `offset` (shapes in elements; INT4 nibble stacks are
/// addressed in bytes along their last axis, K/2).
fn slice_bytes(whole: &MemTensor, axis: Option<usize>, offset: usize, shard_shape: &[usize]) -> Result<Vec<u8>> {
    let Some(a) = axis else { return Ok(whole.data.clone()) };
    // Byte-level shape: element size folded into the last axis.
    let nib = whole.layout == Layout::Int4G32;
    let mut shape: Vec<usize> = whole.shape.clone();
    let last = shape.len() - 1;
    let (mut off, mut len) = (
        offset,
        if nib && a == last {
            shard_shape[a] * 2
        } else {
            shard_shape[a]
        },
    );
    if nib {
        shape[last] /= 2;
        if a == last {
            ensure!(off % 2 == 0, "MemSource: odd INT4 split offset {off}");
            off /= 2;
            len /= 2;
        }
    }
    let es = if nib { 1 } else { whole.dtype.size() };
    let outer: usize = shape[..a].iter().product();
    let inner: usize = shape[a + 1..].iter().product::<usize>() * es;
    if off + len > shape[a] {
        bail!("MemSource: slice {off}+{len} exceeds axis {a} of {:?}", whole.shape);
    }
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let base = (o * shape[a] + off) * inner;
        out.extend_from_slice(&whole.data[base..base + len * inner]);
    }
    Ok(out)
}

// SAFETY: MemSource is immutable after `new`; each shard's Vec<u8> heap buffer never moves or changes.
unsafe impl TensorSource for MemSource {
    fn text_config(&self) -> &TextConfig {
        &self.text
    }
    fn drafter_config(&self) -> Option<&DrafterConfig> {
        None
    }
    fn ranks(&self) -> usize {
        self.ranks
    }
    fn tensor(&self, name: &str, rank: usize) -> Result<TensorRef<'_>> {
        let s = self
            .shards
            .get(&(name.to_string(), rank))
            .with_context(|| format!("MemSource: no tensor {name} for rank {rank}"))?;
        Ok(s.facts.tensor_ref(&s.data))
    }
}

/// The load check of a tensor read on the host (the drafter's gathered weights): every rank's shard bytes
/// against the manifest's xxh3-64 (shards without one are skipped: a source without checksums).
pub fn check_shards(src: &dyn TensorSource, name: &str) -> Result<()> {
    for r in 0..src.ranks() {
        let t = src.tensor(name, r)?;
        super::check::check_host_bytes(&super::weights::tensor_at(name, r, &t), &t)?;
        if t.split_axis.is_none() {
            break;
        }
    }
    Ok(())
}

/// Gather a whole bf16 tensor from all ranks (concatenating along its split axis in rank order, or rank 0's
/// copy when replicated), returned with its logical shape. For consumers that want unsplit weights
/// (the drafter); the target itself keeps per-rank shards.
pub fn gather_bf16(src: &dyn TensorSource, name: &str) -> Result<(Vec<half::bf16>, Vec<usize>)> {
    let t0 = src.tensor(name, 0)?;
    ensure!(t0.dtype == Dtype::BF16, "{name}: expected BF16, found {}", t0.dtype);
    let logical = t0.logical_shape.to_vec();
    let Some(a) = t0.split_axis else {
        return Ok((pod_vec(t0.data), logical));
    };
    let outer: usize = logical[..a].iter().product();
    let inner: usize = logical[a + 1..].iter().product();
    let mut out = vec![half::bf16::ZERO; logical.iter().product()];
    for r in 0..src.ranks() {
        let t = src.tensor(name, r)?;
        let v: Vec<half::bf16> = pod_vec(t.data);
        let len = t.shape[a];
        for o in 0..outer {
            let dst = (o * logical[a] + t.split_offset) * inner;
            out[dst..dst + len * inner].copy_from_slice(&v[o * len * inner..(o + 1) * len * inner]);
        }
    }
    Ok((out, logical))
}
