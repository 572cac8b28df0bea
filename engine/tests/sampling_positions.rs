//! The sampled draw for the token at absolute position p depends on (seed, p) alone (sampling.rs header):
//! with a target whose logits ignore the prefix, prompts of different lengths give the same token at the
//! same absolute position, whatever number of draws came before, in AR and in DDTree mode alike.

mod generate_common;

use anyhow::Result;
use generate_common::{MockDrafter, MockTarget, VOCAB};
use kdtree_engine::api::{Drafter, LogitRows, StepOut, Target, TargetInfo};
use kdtree_engine::generate::{generate_on as generate, GenRequest, Mode, Sampling};
use kdtree_engine::sampling::sample;

/// MockTarget (taps, contract checks) with every logit row replaced by one fixed row.
struct BlindTarget(MockTarget);

fn fixed_row() -> Vec<f32> {
    (0..VOCAB).map(|v| ((v * 37 % 11) as f32) * 0.3).collect()
}

impl Target for BlindTarget {
    fn info(&self) -> &TargetInfo {
        self.0.info()
    }
    fn committed(&self) -> usize {
        self.0.committed()
    }
    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        let out = self.0.forward_rows(tokens, parents, rows)?;
        let n = out.logits.len() / VOCAB;
        Ok(StepOut {
            logits: fixed_row().repeat(n),
            taps: out.taps,
        })
    }
    fn commit(&mut self, path: &[usize]) -> Result<()> {
        self.0.commit(path)
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.0.truncate(len)
    }
    fn reset(&mut self) {
        self.0.reset()
    }
}

fn run(prompt: &[u32], mode: Mode, s: &Sampling) -> Vec<u32> {
    let mut t = BlindTarget(MockTarget::new(4096));
    let mut d = MockDrafter::new(8);
    let r = GenRequest {
        prompt: prompt.to_vec(),
        max_tokens: 40,
        stop_token_ids: vec![],
        sampling: s.clone(),
        mode,
    };
    let d = matches!(mode, Mode::DDTree { .. }).then_some(&mut d as &mut dyn Drafter);
    generate(&mut t, d, &r, &mut |_| false).unwrap().tokens
}

#[test]
fn the_token_at_position_p_depends_only_on_seed_and_p() {
    let row = fixed_row();
    for seed in [0u64, 1, 99, u64::MAX] {
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.95,
            top_k: 0,
            seed,
        };
        let prompts: [&[u32]; 3] = [&[1], &[3, 9, 27], &[5, 5, 5, 5, 5, 5]];
        for mode in [Mode::Ar, Mode::DDTree { budget: 6 }] {
            let outs: Vec<Vec<u32>> = prompts.iter().map(|p| run(p, mode, &s)).collect();
            for (p, out) in prompts.iter().zip(&outs) {
                // Token i of the output sits at absolute position prompt.len() + i.
                let want: Vec<u32> = (0..out.len()).map(|i| sample(&row, &s, p.len() + i)).collect();
                assert_eq!(out, &want, "seed {seed} {mode:?} prompt {p:?}");
            }
            // Same absolute position, same token: outputs are shifted copies of each other.
            assert_eq!(outs[0][2..], outs[1][..38], "seed {seed} {mode:?}");
            assert_eq!(outs[1][3..], outs[2][..37], "seed {seed} {mode:?}");
            assert_ne!(outs[0], outs[1], "a draw must depend on its position, not on its index");
        }
    }
}
