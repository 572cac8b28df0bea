//! kdtree-formats: the bytes on disk and nothing else.
//!
//! Reads Hugging Face safetensors checkpoints (validated like the reference parser), writes the kdtree
//! shard format (safetensors files per rank + `manifest.toml` + `SHA256SUMS`), knows the INT4 group-32
//! nibble layout and the tensor-parallel plan. It never interprets a tensor's math: the engine does that.
//! See FORMAT.md for the on-disk format.

pub mod assemble;
pub mod config;
pub mod dtype;
pub mod error;
pub mod int4;
pub mod manifest;
pub mod model_dir;
pub mod plan;
pub mod reader;
pub mod validate;
pub mod writer;

pub use dtype::Dtype;
pub use error::FormatError;
pub use manifest::Manifest;
pub use model_dir::{ModelDir, TensorRef};
pub use plan::{ExpertsMode, Layout};
