//! Tensor parallelism with a thread per GPU (issue 11): a model converted for R ranks runs as G groups of R/G
//! ranks ("GPUs"), each group on its own thread with its own backend (stream, weights, caches and captured
//! graphs), loading only its own ranks' shards ([`Weights::load_group`]). Every group runs the same model
//! code as one GPU does; its all-reduces (after o_proj, after the MoE / MLP) and the vocab merges of
//! embed_tokens / lm_head go through its backend's communicator:
//! * CPU: [`crate::cpu::comm::HostGroup`] (rank-order sum on the host; what CI checks),
//! * one GPU, G groups side by side ([`Placement::SharedGpu`]): `cuda::comm::SharedGpu`, a device-side
//!   rendezvous inside every group's graphs,
//! * G GPUs ([`Placement::Gpus`]): NCCL (`cuda::comm::Nccl::group`), one communicator per GPU.
//!
//! Driving: [`TpTarget`] / [`TpDrafter`] / [`TpBatchOps`] are the engine's `Target` / `Drafter` / `BatchOps`
//! for the whole run. Each call goes to every group's thread, which makes the same call on its own session;
//! the groups then run it in lock-step with no host round trip between them (a DDTree round or AR step is one
//! graph launch per group with the collectives inside; the groups' threads only pace their launches at
//! `cuda::comm::LaunchGate`s, see docs/design/tensor-parallel.md). Every group computes the replicated parts itself
//! (norms, q_a / kv_a, the router, the tree, the walk) from the same summed values, so the host decisions agree; the
//! results of each call are compared across groups (a difference is an error naming the group), then group
//! 0's are returned. Sessions, batches and `generate` above are unchanged.
//!
//! Must match: one controller running all R ranks (model/attention.rs, ffn.rs): with one rank per group the
//! sums are the same chain of adds in the same order, so the tokens are the same bit for bit.
//! Tests: engine/tests/tp_ranks.rs (CPU), engine/tests/cuda_tp.rs (one GPU), scripts/gpu-test.sh.

mod group;
mod open;
mod pool;

pub use group::{TpBatchOps, TpDrafter, TpTarget};
#[cfg(feature = "cuda")]
pub use open::open_tp_gpus;
pub use open::{group_ranks, open_tp, open_tp_source, Placement};
pub use pool::{start, GroupInit, GroupState, Sessions};
