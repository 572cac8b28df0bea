//! kdtree-text
