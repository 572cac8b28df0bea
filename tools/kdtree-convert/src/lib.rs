//! kdtree-convert as a library: repack, verify, inspect and synth, callable from tests of other crates.
//! The binary (main.rs) only parses arguments and maps results to exit codes.
#![recursion_limit = "256"]

pub mod emit;
pub mod inspect;
pub mod lock;
pub mod log;
pub mod progress;
pub mod repack;
pub mod source;
pub mod stamp;
pub mod synth;
pub mod verify;
