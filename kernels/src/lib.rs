//! kdtree-kernels: CUDA kernel sources (built for sm_90a and sm_120a) and their loading.
//!
//! This crate knows no model layer: each kernel is one op with a CPU twin in
//! `kdtree-engine::cpu::ops`. It builds without a CUDA toolkit; the `cuda` feature gates the loader once
//! kernels exist.
//! The kernel index (op | CPU twin | CUDA wrapper | .cu | test | bench) is kernels/README.md; no kernel has
//! landed yet.
