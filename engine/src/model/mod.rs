//! The Kimi K2.6 target model (DeepSeek-V3 architecture) on the CPU reference backend.
//!
//! * `source`: where weights come from (`TensorSource`: `ModelDir` shards or in-memory `MemSource`);
//!   `dummy`: `DummySource`, the plan with seeded fills instead of bytes (`--load-format dummy`).
//! * `config`: `ModelConfig`; `weights`: rank-first weights under the TP plan, uploaded through the backend.
//! * `attention` (MLA, naive and absorbed), `ffn` (dense SwiGLU, MoE), `cache` (latent KV, tree mask).
//! * `target`: `TargetModel<B>` (`CpuTarget` on the CPU), the `api::Target` implementation written once
//!   against `backend::Backend`; `trace`: per-layer recorder for goldens.
//! * `seq`: `Model<B>`, one sequence's target and drafter on one backend, and its two `api` views;
//!   `round`: the device round and AR step, once (a single sequence is a batch of one); `batch`: the
//!   batch engine over a model's forks.
//! * `open`: `open_cpu` (the one CPU loader) and `engine::open(dir, Device)`, which boxes it.
//! * `testing`: tiny random models for tests.
//!
//! Precision and determinism choices are in target.rs and docs/design/cpu-reference.md.

pub mod attention;
pub mod batch;
pub(crate) mod check;
pub mod config;
pub mod dummy;
pub mod ffn;
pub mod open;
pub(crate) mod round;
pub mod seq;
pub mod source;
pub mod target;
pub mod testing;
pub mod trace;
pub mod weights;

pub use attention::AttnMode;
pub use dummy::DummySource;
pub use seq::{Model, ModelDrafter, ModelTarget};
pub use source::{MemSource, MemTensor, TensorSource};
pub use target::{CpuTarget, TargetModel};
pub use trace::{Trace, TraceData, TraceTensor};
pub use weights::{ModelConfig, Weights, LATENT_NORM_EPS};
