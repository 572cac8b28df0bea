//! CPU reference backend: plain kernels with f32 accumulation and a fixed reduction order, so results are
//! identical for any rayon thread count. `ops` is the spec the CUDA kernels are checked against.

pub mod ops;
