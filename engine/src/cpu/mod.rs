//! CPU reference backend: plain kernels with f32 accumulation and a fixed reduction order, so results are
//! identical for any rayon thread count. `ops` (one op per file) is the spec the CUDA kernels are checked
//! against; `backend` implements `backend::Backend` with them.

pub mod backend;
pub mod cache;
pub mod comm;
mod compute;
pub mod ops;
mod tree_ops;

pub use backend::CpuBackend;
