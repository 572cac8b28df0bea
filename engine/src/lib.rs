//! kdtree-engine
