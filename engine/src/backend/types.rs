//! The seam's vocabulary: the host-side types both backends and the model share — weight bytes ([`Slab`]),
//! host weights as uploaded ([`Mat`], [`I4Stack`]), dummy-weight fills ([`Fill`]), MLA shapes ([`MlaDims`])
//! and form ([`AttnMode`]), the router's constants ([`Router`]), a forward's RoPE rows ([`RopeTable`],
//! [`rope_cos_sin`]) and the vocab-parallel shards ([`VocabShards`]). The ancestor mask is
//! [`super::Visibility`] (visibility.rs). The CPU reference (cpu/ops) and the CUDA backend (cuda/ops) both
//! import these from here; neither backend's module defines a type the other uses.

use half::bf16;
use std::sync::Arc;

/// A typed slice of tensor bytes: borrowed from its source (zero-copy) when the bytes are aligned for
/// `T`, otherwise copied once into an owned vector. Derefs to `[T]`. A mapped view can only be made by
/// [`Slab::new`] (its fields are private), so safe code cannot forge one from an arbitrary pointer.
pub enum Slab<T: bytemuck::Pod> {
    Mapped(MappedView<T>),
    Owned(Vec<T>),
}

/// A zero-copy view into memory owned by its source (a tensor source: model/source.rs), which it keeps alive.
///
/// ```compile_fail,E0451
/// // The fields are private: a view cannot be built outside this module.
/// # use kdtree_engine::backend::{MappedView, Slab};
/// let forged: Slab<u8> = Slab::Mapped(MappedView { _owner: todo!(), ptr: 8 as *const u8, len: 1 });
/// ```
pub struct MappedView<T> {
    _owner: Box<dyn Send + Sync>,
    ptr: *const T,
    len: usize,
}

// SAFETY: a mapped view is an immutable view into memory owned by `_owner` (Send + Sync, never mutated).
unsafe impl<T: bytemuck::Pod + Send> Send for MappedView<T> {}
unsafe impl<T: bytemuck::Pod + Sync> Sync for MappedView<T> {}

impl<T: bytemuck::Pod> Slab<T> {
    /// View `data` as `[T]`, keeping `owner` alive for as long as the view lives (copied when unaligned).
    ///
    /// # Safety
    /// `data` must point into memory owned by `owner` that stays valid and unchanged, at the same address,
    /// while `owner` lives: for a `TensorSource` (model/source.rs), a `TensorRef::data` returned by `owner.tensor(..)`
    /// (or a sub-slice of one), which the `TensorSource` contract keeps; bytes from anywhere else (a
    /// temporary Vec, another source) would dangle once their real owner is dropped.
    ///
    /// ```compile_fail,E0133
    /// // Calling it needs an `unsafe` block (and a reason): this does not compile.
    /// # use std::sync::Arc;
    /// # use kdtree_engine::backend::Slab;
    /// fn view(owner: &Arc<Vec<u8>>, bytes: &[u8]) -> Slab<u8> { Slab::new(owner, bytes) }
    /// ```
    pub unsafe fn new<O: ?Sized + Send + Sync + 'static>(owner: &Arc<O>, data: &[u8]) -> Slab<T> {
        match bytemuck::try_cast_slice::<u8, T>(data) {
            Ok(s) => Slab::Mapped(MappedView {
                _owner: Box::new(owner.clone()),
                ptr: s.as_ptr(),
                len: s.len(),
            }),
            Err(_) => Slab::Owned(pod_vec(data)),
        }
    }
}

impl<T: bytemuck::Pod> std::ops::Deref for Slab<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            // SAFETY: ptr/len came from a live, aligned slice of `_owner`, which this slab keeps alive and
            // which the TensorSource contract keeps unchanged.
            Slab::Mapped(m) => unsafe { std::slice::from_raw_parts(m.ptr, m.len) },
            Slab::Owned(v) => v,
        }
    }
}

/// Copy bytes into a fresh (aligned) vector of `T` (trailing bytes that do not fill a `T` are an error
/// upstream: every caller passes whole tensors).
pub fn pod_vec<T: bytemuck::Pod>(data: &[u8]) -> Vec<T> {
    let n = data.len() / std::mem::size_of::<T>();
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&data[..n * std::mem::size_of::<T>()]);
    v
}

/// How one dummy tensor is filled (the distribution is chosen per tensor by model/dummy.rs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    /// U(center − half, center + half) (bf16 or f32 tensors).
    Uniform { seed: u64, center: f32, half: f32 },
    /// Uniform bytes (u8 INT4 nibble stacks).
    Bytes { seed: u64 },
}

impl Fill {
    pub fn seed(&self) -> u64 {
        match *self {
            Fill::Uniform { seed, .. } | Fill::Bytes { seed } => seed,
        }
    }
    /// `(center, step)` of a uniform fill, as the kernel takes them; None for a byte fill.
    pub fn center_step(&self) -> Option<(f32, f32)> {
        match *self {
            Fill::Uniform { center, half, .. } => Some((center, half * (1.0 / (1u32 << 23) as f32))),
            Fill::Bytes { .. } => None,
        }
    }
}

/// Per-rank MLA shapes and the softmax scale.
#[derive(Debug, Clone, Copy)]
pub struct MlaDims {
    /// Hr: heads of this rank.
    pub heads: usize,
    /// Dn, P, Dv, C.
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kv_lora: usize,
    /// `qk_head_dim^-0.5 · mscale²`.
    pub scale: f32,
}

/// Router constants from the text config (`ModelConfig::router`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Router {
    pub n_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling: f32,
}

/// cos/sin `[D/2]` for one absolute position: angle `pos · inv_freq[i]` formed in f32 (as transformers
/// does: f32 `inv_freq @ position_ids`), cos/sin evaluated in f64 and rounded, times `attention_factor`.
pub fn rope_cos_sin(inv_freq: &[f32], pos: usize, attention_factor: f64) -> (Vec<f32>, Vec<f32>) {
    let ang = |f: f32| (pos as f32 * f) as f64;
    let cos = inv_freq
        .iter()
        .map(|&f| (ang(f).cos() * attention_factor) as f32)
        .collect();
    let sin = inv_freq
        .iter()
        .map(|&f| (ang(f).sin() * attention_factor) as f32)
        .collect();
    (cos, sin)
}

/// Which MLA form the forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnMode {
    /// Expand latents through kv_b (transformers' form).
    #[default]
    Naive,
    /// Weight-absorbed form over the latent cache.
    Absorbed,
}

/// A host bf16 matrix `[rows, cols]` (torch Linear layout `[out, in]`): what `Backend::upload_bf16` takes,
/// and the CPU backend's uploaded matrix itself.
pub struct Mat {
    pub w: Slab<bf16>,
    pub rows: usize,
    pub cols: usize,
}

/// Stacked INT4 group-32 experts of one rank: `packed` `[count, n, k/2]` u8, `scales` `[count, n, k/32]`
/// bf16, holding global experts `first..first + count` (what `Backend::upload_i4g32` takes).
pub struct I4Stack {
    pub packed: Slab<u8>,
    pub scales: Slab<bf16>,
    pub first: usize,
    pub count: usize,
    pub n: usize,
    pub k: usize,
}

impl I4Stack {
    /// The xxh3-64 of the stack's host bytes, `[packed, scales]` (the manifest's checksums of its two tensors).
    pub fn xxh3(&self) -> [u64; 2] {
        [
            crate::xxh3::xxh3_64_par(&self.packed[..]),
            crate::xxh3::xxh3_64_par(bytemuck::cast_slice(&self.scales[..])),
        ]
    }
    /// Whether this rank holds global expert `e`.
    pub fn holds(&self, e: usize) -> bool {
        e >= self.first && e < self.first + self.count
    }
}

/// Rows from which [`RopeTable::new`] computes on all cores.
const PARALLEL_ROPE_ROWS: usize = 512;

/// cos/sin of the rows' positions, `[T, D/2]` each (computed once per forward, host side: positions are
/// known on the host; a GPU backend uploads these T·D floats with the tokens).
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// cos/sin of `positions` ([`rope_cos_sin`]: angle in f32, cos/sin in f64, times `factor`).
    /// Rows are independent (each from its position alone), so a long prefill's table (16K rows: ~16 ms on one
    /// core, the GPU idle meanwhile) is computed on all cores: the same values.
    pub fn new(inv_freq: &[f32], positions: impl IntoIterator<Item = usize>, factor: f64) -> RopeTable {
        use rayon::prelude::*;
        let positions: Vec<usize> = positions.into_iter().collect();
        let half = inv_freq.len();
        let (mut cos, mut sin) = (vec![0f32; positions.len() * half], vec![0f32; positions.len() * half]);
        let row = |((c, s), &pos): ((&mut [f32], &mut [f32]), &usize)| {
            let (rc, rs) = rope_cos_sin(inv_freq, pos, factor);
            c.copy_from_slice(&rc);
            s.copy_from_slice(&rs);
        };
        if half > 0 && positions.len() >= PARALLEL_ROPE_ROWS {
            cos.par_chunks_mut(half)
                .zip(sin.par_chunks_mut(half))
                .zip(positions.par_iter())
                .for_each(row);
        } else if half > 0 {
            cos.chunks_mut(half)
                .zip(sin.chunks_mut(half))
                .zip(positions.iter())
                .for_each(row);
        }
        RopeTable { half, cos, sin }
    }
    /// Row `i`'s (cos, sin), `[D/2]` each.
    pub fn row(&self, i: usize) -> (&[f32], &[f32]) {
        (
            &self.cos[i * self.half..(i + 1) * self.half],
            &self.sin[i * self.half..(i + 1) * self.half],
        )
    }
}

/// The vocab-parallel shards of embed_tokens / lm_head a backend holds: `mats` in rank order, the first at
/// global row `first` of a `vocab`-row table. All of them here (`first` 0, rows summing to `vocab`: one GPU) is
/// the merge done locally. Otherwise (tensor parallelism over several GPUs, `crate::tp`) the rows / logit
/// columns of the other GPUs' shards come out zero and go through the backend's communicator sum: every id's
/// row and every logit column has exactly one non-zero part, so the merge is exact (x + 0 = x).
pub struct VocabShards<'a, M> {
    pub mats: Vec<&'a M>,
    pub first: usize,
    pub vocab: usize,
}

impl<M> VocabShards<'_, M> {
    /// Whether every shard is here (no merge through the communicator).
    pub fn whole(&self, rows: impl Fn(&M) -> usize) -> bool {
        self.first == 0 && self.mats.iter().map(|m| rows(m)).sum::<usize>() == self.vocab
    }
    /// The vocab's shards in all (the run's ranks) and the global index of this GPU's first, for the
    /// vocab-parallel argmax's slots; shards split the vocab evenly (`weights::load_rank`).
    pub fn slots(&self, rows: impl Fn(&M) -> usize) -> std::result::Result<(usize, usize), String> {
        let r = self.mats.first().map(|m| rows(m)).unwrap_or(0);
        if r == 0
            || !self.vocab.is_multiple_of(r)
            || !self.first.is_multiple_of(r)
            || self.mats.iter().any(|m| rows(m) != r)
        {
            let sizes: Vec<usize> = self.mats.iter().map(|m| rows(m)).collect();
            return Err(format!(
                "vocab shards of {sizes:?} rows from {} do not split a vocab of {} evenly",
                self.first, self.vocab
            ));
        }
        Ok((self.vocab / r, self.first / r))
    }
}
