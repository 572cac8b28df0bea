//! The Kimi K2.6 target model (DeepSeek-V3 architecture) on the CPU reference backend.
//!
//! * `source`: where weights come from (`TensorSource`: `ModelDir` shards or in-memory `MemSource`).
//! * `weights`: per-rank weights under the TP plan, `ModelConfig`; embedding and lm_head for the drafter.
//! * `attention` (MLA, naive and absorbed), `ffn` (dense SwiGLU, MoE), `cache` (latent KV, tree mask).
//! * `target`: `CpuTarget`, the `api::Target` implementation; `trace`: per-layer recorder for goldens.
//! * `open`: `engine::open(dir, Device)`, the loader the tools call.
//! * `testing`: tiny random models for tests.
//!
//! Precision and determinism choices are in target.rs and docs/design/cpu-reference.md.

pub mod attention;
pub mod cache;
pub mod ffn;
pub mod open;
pub mod source;
pub mod target;
pub mod testing;
pub mod trace;
pub mod weights;

pub use attention::AttnMode;
pub use source::{MemSource, MemTensor, TensorSource};
pub use target::CpuTarget;
pub use trace::{Trace, TraceData, TraceTensor};
pub use weights::{ModelConfig, Weights, LATENT_NORM_EPS};
