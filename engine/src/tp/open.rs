//! Opening a model as tensor-parallel groups: the group ranges, the placement (CPU, one GPU, several GPUs)
//! and, on GPUs, each group's device and communicator (one-GPU rendezvous or NCCL) before the loads.

use super::pool::{start, GroupInit, Sessions};

use crate::model::open::{Loaded, OpenOptions};
use crate::model::source::TensorSource;
use anyhow::{ensure, Context, Result};
use std::path::Path;
use std::sync::Arc;

/// Where the groups of a run go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Every group a CPU backend on its own thread (host communicator).
    Cpu,
    /// Every group on this one GPU, each its own stream (the one-GPU communicator).
    SharedGpu(usize),
    /// Group g on GPU `ordinals[g]` (NCCL; the ordinals distinct).
    Gpus(Vec<usize>),
}

/// Groups of a `ranks`-rank model over `groups`: group g holds ranks `g·R/G .. (g+1)·R/G`.
pub fn group_ranks(ranks: usize, groups: usize) -> Result<Vec<std::ops::Range<usize>>> {
    ensure!(groups >= 1, "--gpus must be at least 1");
    ensure!(
        ranks.is_multiple_of(groups),
        "the model was converted for {ranks} ranks, which do not divide over {groups} GPUs (use a divisor of \
         {ranks}, or convert with --ranks {groups})"
    );
    let per = ranks / groups;
    Ok((0..groups).map(|g| g * per..(g + 1) * per).collect())
}

/// Open the converted model `dir` as `groups` groups placed by `place` (each loads only its ranks' shards and
/// the drafter; see the module doc). `opts.progress`: group 0's load progress on stderr; `opts.check_weights`: every
/// group's load check.
pub fn open_tp(dir: &Path, groups: usize, place: Placement, opts: OpenOptions) -> Result<Loaded> {
    let (src, needed) = model_source(dir, groups, opts.no_drafter)?;
    open_tp_source(src, groups, place, Some(needed), opts)
        .with_context(|| format!("loading {} as {groups} tensor-parallel groups", dir.display()))
}

/// `dir`'s tensors and each of `groups` groups' upload bytes.
fn model_source(dir: &Path, groups: usize, no_drafter: bool) -> Result<(Arc<dyn TensorSource>, Vec<u64>)> {
    let md = kdtree_formats::ModelDir::open(dir).with_context(|| format!("opening model {}", dir.display()))?;
    // The bytes each group uploads: its ranks' target tensors, and the whole drafter (every group runs it).
    let ranges = group_ranks(md.manifest().plan.ranks, groups)?;
    let drafter: u64 = if no_drafter {
        0
    } else {
        md.manifest()
            .tensors
            .iter()
            .filter(|t| t.name.starts_with("drafter.") && (t.split_axis.is_some() || t.rank == 0))
            .map(|t| t.nbytes)
            .sum()
    };
    let needed = ranges
        .iter()
        .map(|r| {
            drafter
                + md.manifest()
                    .tensors
                    .iter()
                    .filter(|t| !t.name.starts_with("drafter.") && r.contains(&t.rank))
                    .map(|t| t.nbytes)
                    .sum::<u64>()
        })
        .collect();
    Ok((Arc::new(md), needed))
}

/// [`open_tp`] on GPUs, with each group's [`crate::cuda::Gpu`] (tests and benches read their counters).
#[cfg(feature = "cuda")]
pub fn open_tp_gpus(
    dir: &Path,
    groups: usize,
    place: Placement,
    opts: OpenOptions,
) -> Result<(Loaded, Vec<Arc<crate::cuda::Gpu>>)> {
    let (src, needed) = model_source(dir, groups, opts.no_drafter)?;
    let ranges = group_ranks(src.ranks(), groups)?;
    let r = match place {
        Placement::SharedGpu(o) => cuda_groups(src, ranges, o, None, Some(needed), opts),
        Placement::Gpus(o) => cuda_groups(src, ranges, o[0], Some(o), Some(needed), opts),
        Placement::Cpu => anyhow::bail!("open_tp_gpus: the CPU placement has no GPUs"),
    };
    r.with_context(|| format!("loading {} as {groups} tensor-parallel groups", dir.display()))
}

/// [`open_tp`] over any tensor source (tests: in-memory models); `needed`: each group's upload bytes where
/// known (checked against the GPU's free memory first).
pub fn open_tp_source(
    src: Arc<dyn TensorSource>,
    groups: usize,
    place: Placement,
    needed: Option<Vec<u64>>,
    opts: OpenOptions,
) -> Result<Loaded> {
    let ranges = group_ranks(src.ranks(), groups)?;
    match place {
        Placement::Cpu => {
            use crate::cpu::comm::{HostGroup, HostRank};
            let group = HostGroup::new(groups);
            let inits = ranges
                .into_iter()
                .enumerate()
                .map(|(g, range)| {
                    let (src, group) = (src.clone(), group.clone());
                    Box::new(move || {
                        let mut b = crate::cpu::CpuBackend::with_comm(HostRank { group, rank: g });
                        b.check_weights = opts.check_weights;
                        group_models(b, src, range, opts.no_drafter)
                    }) as GroupInit
                })
                .collect();
            let g2 = group.clone();
            start(
                inits,
                1,
                Box::new(move |why| g2.abort(why)),
                "cpu",
                "cpu".into(),
                opts.gpu.tp_trace,
            )
        }
        #[cfg(feature = "cuda")]
        Placement::SharedGpu(ordinal) => cuda_groups(src, ranges, ordinal, None, needed, opts).map(|r| r.0),
        #[cfg(feature = "cuda")]
        Placement::Gpus(ordinals) => cuda_groups(src, ranges, ordinals[0], Some(ordinals), needed, opts).map(|r| r.0),
        #[cfg(not(feature = "cuda"))]
        _ => {
            let _ = (opts, needed);
            Err(crate::backend::BackendError::NoCuda.into())
        }
    }
}

/// The target (and drafter, when the source has one) of ranks `range` on backend `b`.
fn group_models<B: crate::backend::Backend>(
    b: B,
    src: Arc<dyn TensorSource>,
    range: std::ops::Range<usize>,
    no_drafter: bool,
) -> Result<Sessions> {
    use crate::model::weights::Weights;
    let taps = match src.drafter_config() {
        Some(c) if !no_drafter => c.dflash_config.target_layer_ids.clone(),
        _ => Vec::new(),
    };
    let w = Arc::new(
        Weights::load_group(b.clone(), src.clone(), range.clone()).with_context(|| format!("ranks {range:?}"))?,
    );
    let target = crate::model::target::TargetModel::new(w.clone(), taps, crate::model::AttnMode::Absorbed)?;
    let drafter = match src.drafter_config() {
        Some(_) if !no_drafter => Some(crate::drafter::DFlashDrafter::load_on(b, &*src, w)?),
        _ => None,
    };
    // One model: the group's device rounds and batched steps reach its target and drafter together.
    Ok(crate::model::Model::new(target, drafter).into_sessions())
}

/// CUDA groups: all on GPU `ordinal` (the one-GPU communicator) or group g on `gpus[g]` (NCCL).
#[cfg(feature = "cuda")]
fn cuda_groups(
    src: Arc<dyn TensorSource>,
    ranges: Vec<std::ops::Range<usize>>,
    ordinal: usize,
    gpus: Option<Vec<usize>>,
    needed: Option<Vec<u64>>,
    opts: OpenOptions,
) -> Result<(Loaded, Vec<Arc<crate::cuda::Gpu>>)> {
    use crate::cuda::CudaBackend;
    let groups = ranges.len();
    if let Some(o) = &gpus {
        ensure!(o.len() == groups, "{} GPUs for {groups} groups", o.len());
    }
    // Each group's GPU and communicator first (NCCL is initialised over all of them at once), then the loads in
    // parallel on the groups' threads.
    let (devs, aborts) = crate::cuda::comm::open_groups(groups, ordinal, gpus.as_deref(), opts.gpu)?;
    let name = devs[0].name();
    let per_device = if gpus.is_none() { groups } else { 1 };
    let needed = needed.unwrap_or_else(|| vec![0; groups]);
    let (free, _) = devs[0].mem_info()?;
    let on_one: u64 = if per_device > 1 {
        needed.iter().sum()
    } else {
        needed.iter().copied().max().unwrap_or(0)
    };
    ensure!(
        on_one + (per_device as u64) * (1u64 << 30) <= free as u64,
        "the groups' weights need {:.2} GiB on {} (+1 GiB per group for caches and activations), but only {:.2} \
         GiB are free",
        on_one as f64 / (1u64 << 30) as f64,
        devs[0].describe(),
        free as f64 / (1u64 << 30) as f64
    );
    let keep = devs.clone();
    let inits = ranges
        .into_iter()
        .zip(devs)
        .zip(needed)
        .enumerate()
        .map(|(g, ((range, gpu), needed))| {
            let src = src.clone();
            Box::new(move || {
                gpu.set_weight_check(opts.check_weights);
                gpu.begin_load(needed, opts.progress && g == 0)?;
                let r = group_models(CudaBackend::new(gpu.clone()), src, range, opts.no_drafter);
                let ended = gpu.end_load().map(|_| ());
                let r = r?;
                ended?;
                Ok(r)
            }) as GroupInit
        })
        .collect();
    // A failed group wakes the others waiting at a launch gate (those waiting inside a device-side sum trap on
    // its timeout).
    let abort = Box::new(move |why: &str| aborts.iter().for_each(|c| c.abort(why)));
    Ok((start(inits, per_device, abort, "cuda", name, opts.gpu.tp_trace)?, keep))
}
