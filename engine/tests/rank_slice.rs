//! A rank slice (`TensorSource::slice_rank`, what `--load-format dummy --ranks R --rank r` runs) computes
//! exactly rank r's share of the model: on the same bytes, rank 1 of a 2-rank plan loaded alone gives the
//! same logits, bit for bit, as the 1-rank model of the config with half the heads, half of every MLP and
//! expert intermediate width and half the vocabulary, built from that rank's shards. So a slice is one GPU
//! of R without the all-reduces: nothing of the other ranks leaks in, and nothing of rank r is missed.

use kdtree_engine::api::{LogitRows, Target};
use kdtree_engine::model::source::MemSource;
use kdtree_engine::model::testing::{random_tensors, tiny_config, PREFIX};
use kdtree_engine::model::{AttnMode, CpuTarget, MemTensor, TensorSource, Weights};
use kdtree_formats::config::{DrafterConfig, TextConfig};
use kdtree_formats::plan::{plan_model, ExpertsMode, Layout, SourceQuant};
use kdtree_formats::TensorRef;
use std::collections::HashMap;
use std::sync::Arc;

/// Rank `rank` of a several-rank source, marked as a rank slice.
struct Slice(MemSource, usize);

// SAFETY: forwards to a MemSource (immutable after construction) that this value owns.
unsafe impl TensorSource for Slice {
    fn text_config(&self) -> &TextConfig {
        self.0.text_config()
    }
    fn drafter_config(&self) -> Option<&DrafterConfig> {
        None
    }
    fn ranks(&self) -> usize {
        self.0.ranks()
    }
    fn tensor(&self, name: &str, rank: usize) -> anyhow::Result<TensorRef<'_>> {
        anyhow::ensure!(rank == self.1, "{name}: rank {rank} is not held");
        self.0.tensor(name, rank)
    }
    fn slice_rank(&self) -> Option<usize> {
        Some(self.1)
    }
}

fn logits(src: Arc<dyn TensorSource>, prompt: &[u32]) -> (usize, Vec<f32>) {
    let w = Arc::new(Weights::load(src).unwrap());
    let mut t = CpuTarget::new(w, vec![], AttnMode::Absorbed).unwrap();
    let parents: Vec<i32> = (0..prompt.len() as i32).map(|i| i - 1).collect();
    (
        t.info().vocab_size,
        t.forward_rows(prompt, &parents, LogitRows::All).unwrap().logits,
    )
}

#[test]
fn a_rank_slice_is_that_ranks_share() {
    let t = tiny_config(Some(32));
    let whole = random_tensors(&t, 4);
    let prompt = [3u32, 47, 0, 12, 40, 5];
    for rank in [0, 1] {
        // The reduced config and its tensors: rank `rank`'s shards of the 2-rank plan, taken as whole tensors.
        let full = MemSource::new(t.clone(), PREFIX, &whole, 2, ExpertsMode::Tp).unwrap();
        let mut half = t.clone();
        half.num_attention_heads /= 2;
        half.intermediate_size /= 2;
        half.moe_intermediate_size /= 2;
        half.vocab_size /= 2;
        let plan = plan_model(&t, None, PREFIX, SourceQuant::Bf16, 2, ExpertsMode::Tp).unwrap();
        let mut shards = HashMap::new();
        for o in plan.tensors.iter().filter(|o| o.rank == rank) {
            let s = full.tensor(&o.name, rank).unwrap();
            // INT4 stacks are recorded by their element shape [E, N, K] (bytes [E, N, K/2]).
            let shape = if s.layout == Layout::Int4G32 {
                vec![s.shape[0], s.shape[1], s.shape[2] * 2]
            } else {
                s.shape.to_vec()
            };
            shards.insert(
                o.name.clone(),
                MemTensor {
                    dtype: s.dtype,
                    shape,
                    layout: s.layout,
                    data: s.data.to_vec(),
                },
            );
        }
        let reduced = MemSource::new(half, PREFIX, &shards, 1, ExpertsMode::Tp).unwrap();
        let (v_slice, a) = logits(Arc::new(Slice(full, rank)), &prompt);
        let (v_red, b) = logits(Arc::new(reduced), &prompt);
        assert_eq!((v_slice, v_red), (48, 48), "V/R ids");
        assert!(a.iter().all(|x| x.is_finite()));
        assert_eq!(a, b, "rank {rank} of 2 alone == the 1-rank model of its shards");
        // And it is not the whole model's computation (the other rank's heads and experts are absent).
        let whole_src = MemSource::new(t.clone(), PREFIX, &whole, 1, ExpertsMode::Tp).unwrap();
        let (_, c) = logits(Arc::new(whole_src), &prompt);
        let c_rows: Vec<f32> = c
            .chunks(96)
            .flat_map(|r| r[rank * 48..(rank + 1) * 48].to_vec())
            .collect();
        assert_ne!(a, c_rows, "a slice is not the full model");
    }
}
