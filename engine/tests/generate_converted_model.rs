//! End to end on files: `kdtree_convert::synth` writes the tiny preset with its DFlash drafter, `repack`
//! converts it for 2 ranks, `ModelDir` opens it, the CPU target and `DFlashDrafter::load` read it, and
//! greedy DDTree must equal greedy AR token for token (budgets 1..70) while stops cut identically.

use kdtree_convert::repack::{repack, RepackOptions, DEFAULT_MAX_FILE_SIZE};
use kdtree_engine::api::{Drafter, Target};
use kdtree_engine::drafter::{DFlashDrafter, TargetTables};
use kdtree_engine::generate::{generate_on as generate, FinishReason, GenRequest, Mode, Sampling};
use kdtree_engine::model::{AttnMode, CpuTarget, TensorSource, Weights};
use kdtree_formats::plan::ExpertsMode;
use kdtree_formats::ModelDir;
use std::sync::Arc;

#[test]
fn greedy_ddtree_equals_ar_on_a_converted_tiny_model() {
    let t0 = std::time::Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let (src, out) = (tmp.path().join("hf"), tmp.path().join("kd"));
    kdtree_convert::synth::write("tiny", &src, 5, true, None).unwrap();
    repack(&RepackOptions {
        src: src.clone(),
        out: out.clone(),
        drafter: Some(src.join("drafter")),
        ranks: 2,
        experts: ExpertsMode::Tp,
        max_file_size: DEFAULT_MAX_FILE_SIZE,
        quiet: true,
    })
    .unwrap();
    let dir: Arc<dyn TensorSource> = Arc::new(ModelDir::open(&out).unwrap());
    let taps = dir
        .drafter_config()
        .expect("drafter config in the manifest")
        .dflash_config
        .target_layer_ids
        .clone();
    let w = Arc::new(Weights::load(dir.clone()).unwrap());
    let mut d = DFlashDrafter::load(&*dir, w.clone() as Arc<dyn TargetTables>).unwrap();
    let mut t = CpuTarget::new(w.clone(), taps, AttnMode::Absorbed).unwrap();
    let v = w.vocab_size() as u32;
    eprintln!("synth + repack + load: {:.1}s", t0.elapsed().as_secs_f64());
    for prompt in [vec![1u32, 2, 3, 4], vec![700, 5, 99, 512, 3, 3, 3]] {
        let r = |mode| GenRequest {
            prompt: prompt.clone(),
            max_tokens: 12,
            stop_token_ids: vec![],
            sampling: Sampling::greedy(),
            mode,
        };
        let ar = generate(&mut t, None, &r(Mode::Ar), &mut |_| false).unwrap();
        assert!(ar.tokens.iter().all(|&x| x < v));
        for budget in [1, 8, 70] {
            let dd = generate(
                &mut t,
                Some(&mut d as &mut dyn Drafter),
                &r(Mode::DDTree { budget }),
                &mut |_| false,
            )
            .unwrap();
            assert_eq!(dd.tokens, ar.tokens, "prompt {prompt:?} budget {budget}");
            assert_eq!(d.context_len(), t.committed());
            eprintln!(
                "budget {budget}: tau {:.2}, {:.1}s",
                dd.spec.acceptance_length(),
                t0.elapsed().as_secs_f64()
            );
        }
        // A stop token from the middle of the AR output cuts both modes at its first occurrence.
        let stop = ar.tokens[6];
        let first = ar.tokens.iter().position(|&x| x == stop).unwrap();
        for mode in [Mode::Ar, Mode::DDTree { budget: 16 }] {
            let mut rq = r(mode);
            rq.stop_token_ids = vec![stop];
            let o = generate(&mut t, Some(&mut d as &mut dyn Drafter), &rq, &mut |_| false).unwrap();
            assert_eq!(o.tokens, ar.tokens[..=first].to_vec(), "{mode:?}");
            assert_eq!(o.finish_reason, FinishReason::Stop);
            assert_eq!(t.committed(), prompt.len() + first);
        }
    }
}
