//! kdtree-golden as a library: the bundle format (writer and reader), so `kdtree-run --verify` and
//! tests can load reference bundles without re-deriving the layout.

pub mod bundle;
