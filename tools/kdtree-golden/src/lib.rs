//! kdtree-golden as a library: the bundle format (writer and reader), the reference computations the
//! bundles record (`reference`: model loading, greedy AR, one DDTree round) and the bundle maker the
//! binary runs (`make`) and the teacher-forced scorer of other engines' tokens (`score`), so `kdtree-run --verify`
//! and tests re-run exactly what was recorded.

pub mod bundle;
pub mod make;
pub mod reference;
pub mod score;
