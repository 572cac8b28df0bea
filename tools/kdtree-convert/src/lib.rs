//! kdtree-convert as a library: repack, verify, inspect and synth, callable from tests of other crates.

pub mod synth;
