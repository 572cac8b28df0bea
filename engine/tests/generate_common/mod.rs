//! Mock target and drafter for the generation-loop tests (no model math, no files).
//!
//! MockTarget: a toy LM whose logits at a node depend on the node's *whole* token prefix (committed tokens,
//! ancestors, itself) through a running hash, plus a strong preference for `fav(prev, last)` and a
//! weaker one for `alt(prev, last)`; the hash noise sometimes lets `alt` win, so greedy continuations are
//! prefix-dependent and a drafter that only knows `fav`/`alt` is right often but not always. It checks the
//! `api::Target` contract (parents, positions < max_positions, root-to-node commit paths) and its taps
//! carry (token, position, prefix hash) so the mock drafter can check it receives exactly the committed
//! tokens in order. MockDrafter rebuilds the context from those taps and drafts a chain of `fav` guesses
//! (`alt` as the runner-up) as B−1 marginal rows.
#![allow(dead_code)]

use anyhow::{ensure, Result};
use kdtree_engine::api::{Drafter, LogitRows, StepOut, Target, TargetInfo};

pub const VOCAB: usize = 48;
pub const HIDDEN: usize = 3;
pub const N_TAPS: usize = 2;

fn mix(h: u64, t: u32) -> u64 {
    (h ^ (t as u64 + 0x9E37_79B9))
        .wrapping_mul(0x100_0000_01B3)
        .rotate_left(17)
}

fn noise(h: u64, v: usize) -> f32 {
    let x = mix(h, v as u32 + 7777).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    (x >> 40) as f32 / (1u64 << 24) as f32 // [0, 1)
}

pub fn fav(prev: u32, last: u32) -> u32 {
    (prev * 7 + last * 3 + 1) % VOCAB as u32
}

pub fn alt(prev: u32, last: u32) -> u32 {
    (prev * 5 + last * 11 + 2) % VOCAB as u32
}

/// Logits of the next token after a prefix with hash `h` ending in (prev, last).
fn logits_for(h: u64, prev: u32, last: u32) -> Vec<f32> {
    let mut r: Vec<f32> = (0..VOCAB).map(|v| noise(h, v)).collect();
    r[fav(prev, last) as usize] += 3.0;
    r[alt(prev, last) as usize] += 2.6;
    r
}

pub struct MockTarget {
    info: TargetInfo,
    committed: Vec<u32>,
    hash: u64,
    /// Last forward: tokens, parents and per-node prefix hash.
    scratch: Option<(Vec<u32>, Vec<i32>)>,
    pub forwards: usize,
}

impl MockTarget {
    pub fn new(max_positions: usize) -> Self {
        MockTarget {
            info: TargetInfo {
                vocab_size: VOCAB,
                hidden_size: HIDDEN,
                num_layers: 1,
                max_positions,
                tap_layers: vec![0, 0],
            },
            committed: Vec::new(),
            hash: 0,
            scratch: None,
            forwards: 0,
        }
    }
    pub fn committed_tokens(&self) -> &[u32] {
        &self.committed
    }
}

impl Target for MockTarget {
    fn info(&self) -> &TargetInfo {
        &self.info
    }
    fn committed(&self) -> usize {
        self.committed.len()
    }
    fn forward_rows(&mut self, tokens: &[u32], parents: &[i32], rows: LogitRows) -> Result<StepOut> {
        ensure!(
            tokens.len() == parents.len() && !tokens.is_empty(),
            "tokens/parents length"
        );
        let n = tokens.len();
        let (mut hash, mut depth, mut prev) = (vec![0u64; n], vec![0usize; n], vec![0u32; n]);
        let mut logits = Vec::with_capacity(n * VOCAB);
        let mut taps = Vec::with_capacity(n * N_TAPS * HIDDEN);
        for i in 0..n {
            ensure!(tokens[i] < VOCAB as u32, "token {} out of vocab", tokens[i]);
            let p = parents[i];
            ensure!(p == -1 || (p >= 0 && (p as usize) < i), "parents[{i}] = {p}");
            let (ph, pd, pprev) = if p < 0 {
                (self.hash, 0, self.committed.last().copied().unwrap_or(0))
            } else {
                let p = p as usize;
                (hash[p], depth[p] + 1, tokens[p])
            };
            hash[i] = mix(ph, tokens[i]);
            depth[i] = pd;
            prev[i] = pprev;
            let pos = self.committed.len() + pd;
            ensure!(
                pos < self.info.max_positions,
                "node {i} at position {pos} >= max_positions {}",
                self.info.max_positions
            );
            logits.extend(logits_for(hash[i], pprev, tokens[i]));
            let row = [tokens[i] as f32, pos as f32, (hash[i] & 0xFFFF) as f32];
            taps.extend(row.iter().chain(row.iter().map(|x| x + 0.5).collect::<Vec<_>>().iter()));
        }
        self.forwards += 1;
        self.scratch = Some((tokens.to_vec(), parents.to_vec()));
        let logits = match rows {
            LogitRows::All => logits,
            LogitRows::Last => logits[(n - 1) * VOCAB..].to_vec(),
            LogitRows::None => Vec::new(),
        };
        Ok(StepOut { logits, taps })
    }
    fn commit(&mut self, path: &[usize]) -> Result<()> {
        let (tokens, parents) = self.scratch.take().expect("commit without forward");
        ensure!(!path.is_empty(), "empty commit path");
        for (j, &n) in path.iter().enumerate() {
            ensure!(n < tokens.len(), "path node {n} out of range");
            let want = if j == 0 { -1 } else { path[j - 1] as i32 };
            ensure!(
                parents[n] == want,
                "path node {n} has parent {}, expected {want}",
                parents[n]
            );
            self.committed.push(tokens[n]);
            self.hash = mix(self.hash, tokens[n]);
        }
        Ok(())
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        ensure!(
            len <= self.committed.len(),
            "truncate to {len} of {}",
            self.committed.len()
        );
        self.committed.truncate(len);
        self.hash = self.committed.iter().fold(0, |h, &t| mix(h, t));
        self.scratch = None;
        Ok(())
    }
    fn reset(&mut self) {
        self.committed.clear();
        self.hash = 0;
        self.scratch = None;
    }
}

pub struct MockDrafter {
    pub block: usize,
    ctx: Vec<u32>,
    hash: u64,
    pub drafts: usize,
}

impl MockDrafter {
    pub fn new(block: usize) -> Self {
        MockDrafter {
            block,
            ctx: Vec::new(),
            hash: 0,
            drafts: 0,
        }
    }
}

impl Drafter for MockDrafter {
    fn block_size(&self) -> usize {
        self.block
    }
    fn context_len(&self) -> usize {
        self.ctx.len()
    }
    fn extend_context(&mut self, taps: &[f32], n: usize) -> Result<()> {
        let w = N_TAPS * HIDDEN;
        ensure!(taps.len() == n * w, "taps {} != {n} x {w}", taps.len());
        for r in taps.chunks(w) {
            let (tok, pos, h) = (r[0] as u32, r[1] as usize, r[2] as u64);
            ensure!(
                pos == self.ctx.len(),
                "context row for position {pos} arrived at {}",
                self.ctx.len()
            );
            self.hash = mix(self.hash, tok);
            ensure!(
                self.hash & 0xFFFF == h,
                "context tokens differ from the target's committed prefix at {pos}"
            );
            self.ctx.push(tok);
        }
        Ok(())
    }
    fn draft(&mut self, bonus: u32, start: usize) -> Result<Vec<f32>> {
        ensure!(
            start == self.ctx.len(),
            "draft at {start} with context {}",
            self.ctx.len()
        );
        self.drafts += 1;
        let (mut prev, mut last) = (self.ctx.last().copied().unwrap_or(0), bonus);
        let mut out = Vec::with_capacity((self.block - 1) * VOCAB);
        for r in 0..self.block - 1 {
            let mut row: Vec<f32> = (0..VOCAB)
                .map(|v| noise(start as u64 * 131 + r as u64, v) * 0.5)
                .collect();
            let (f, a) = (fav(prev, last), alt(prev, last));
            row[f as usize] += 2.0;
            row[a as usize] += 1.4;
            out.extend(row);
            (prev, last) = (last, f);
        }
        Ok(out)
    }
    fn truncate_context(&mut self, len: usize) -> Result<()> {
        ensure!(len <= self.ctx.len(), "truncate_context to {len} of {}", self.ctx.len());
        self.ctx.truncate(len);
        self.hash = self.ctx.iter().fold(0, |h, &t| mix(h, t));
        Ok(())
    }
    fn reset(&mut self) {
        self.ctx.clear();
        self.hash = 0;
    }
}
