//! The backend seam: which backends this build has, and the typed error for the ones it lacks.
//!
//! Test: engine/tests/target_plans.rs (`cuda_without_the_feature_is_a_typed_error`).

/// Why a backend cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// `--device cuda` on a build without the `cuda` feature.
    #[error("this kdtree build has no CUDA backend: rebuild with --features cuda")]
    NoCuda,
    /// A `cuda` build whose engine has no CUDA backend implementation yet.
    #[error("CUDA backend not yet wired: this build has the cuda feature but the engine does not run on CUDA yet (use --device cpu)")]
    CudaNotWired,
}

impl BackendError {
    /// The error `Device::Cuda` gets in this build.
    pub fn cuda_unavailable() -> BackendError {
        if cfg!(feature = "cuda") {
            BackendError::CudaNotWired
        } else {
            BackendError::NoCuda
        }
    }
}
