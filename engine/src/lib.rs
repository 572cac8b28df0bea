//! kdtree-engine: the math of Kimi K2.6 + DFlash + DDTree.
//!
//! The round logic (DDTree, generation loops) drives the model through the traits in [`api`]; the model
//! itself (MLA, MoE, dense MLP, embedding / lm_head, the DFlash drafter) is written once against the
//! op-level [`backend::Backend`]. `cpu` is the reference backend (one op per file in `cpu::ops`; rayon,
//! f32 accumulation, fixed reduction order). Weights are read only through kdtree-formats (`ModelDir`),
//! rank by rank; this crate opens no files by path itself and knows nothing of JSON prompts, clap or
//! exit codes.

pub mod api;
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ddtree;
pub mod drafter;
pub mod generate;
pub mod model;
pub mod options;
pub mod sampling;
pub mod session;
pub mod session_batch;
pub mod tp;
pub mod xxh3;

pub use backend::WeightCheck;
pub use model::open::{open, open_cpu, open_with, CpuModel, Device, Loaded, OpenOptions};
#[cfg(feature = "cuda")]
pub use model::open::{open_cuda_on, open_cuda_with};
pub use model::AttnMode;
pub use options::GpuOptions;
pub use session::{Emitted, Mode, ProbeSet, Probes, RoundRecord, Session};
pub use session_batch::{Admit, Batch, KvBudget, KvTooLarge, Tally, TimeSplit};
