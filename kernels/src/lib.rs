//! kdtree-kernels
