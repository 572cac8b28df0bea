//! The CPU backend's communicator (issue 11): the ranks of one process, each on its own thread
//! (`crate::tp`), meet on the host. [`HostGroup::all_reduce`] sums every rank's partial in rank order
//! (`0 + p0 + p1 + …`, the order of `ops::all_reduce_sum`, so R threads of one rank each give the bits of one
//! controller running R ranks) and hands every rank the same sum. A rank that fails aborts the group: the
//! others wake with an error instead of waiting for it forever.
//!
//! Tests: engine/tests/tp_ranks.rs (R rank threads == one controller, bit for bit), and below.

use super::ops;
use std::sync::{Arc, Condvar, Mutex};

/// `world` ranks meeting on the host.
pub struct HostGroup {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    parts: Vec<Option<Vec<f32>>>,
    arrived: usize,
    /// Completed reductions; a waiter's own is done when this moves past the value it arrived at.
    generation: u64,
    sum: Arc<Vec<f32>>,
    aborted: Option<String>,
}

impl HostGroup {
    pub fn new(world: usize) -> Arc<HostGroup> {
        let state = State {
            parts: vec![None; world],
            arrived: 0,
            generation: 0,
            sum: Arc::new(Vec::new()),
            aborted: None,
        };
        Arc::new(HostGroup {
            world,
            state: Mutex::new(state),
            cv: Condvar::new(),
        })
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// Rank `rank`'s part of a sum over the group: every rank's `x` (same length), summed in rank order.
    /// Err when the group was aborted or the ranks' lengths differ.
    pub fn all_reduce(&self, rank: usize, x: Vec<f32>) -> Result<Vec<f32>, String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &st.aborted {
            return Err(why.clone());
        }
        if rank >= self.world || st.parts[rank].is_some() {
            return Err(format!("rank {rank} of {} entered an all-reduce twice", self.world));
        }
        st.parts[rank] = Some(x);
        st.arrived += 1;
        let gen = st.generation;
        if st.arrived == self.world {
            let parts: Vec<Vec<f32>> = st.parts.iter_mut().map(|p| p.take().unwrap_or_default()).collect();
            let n = parts[0].len();
            if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p.len() != n) {
                let why = format!("all-reduce: rank {r} gave {} values, rank 0 gave {n}", p.len());
                st.aborted = Some(why.clone());
                self.cv.notify_all();
                return Err(why);
            }
            st.sum = Arc::new(ops::all_reduce_sum(&parts, n));
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
            return Ok(st.sum.to_vec());
        }
        while st.generation == gen {
            if let Some(why) = &st.aborted {
                return Err(why.clone());
            }
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        // The next reduction cannot complete before this rank arrives at it, so `sum` is still this one's.
        Ok(st.sum.to_vec())
    }

    /// Wake every waiting rank with `why` (a rank failed); later calls fail at once.
    pub fn abort(&self, why: &str) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.aborted.get_or_insert_with(|| why.to_string());
        self.cv.notify_all();
    }
}

/// One rank's handle on its group (what a [`super::CpuBackend`] of that rank holds).
#[derive(Clone)]
pub struct HostRank {
    pub group: Arc<HostGroup>,
    pub rank: usize,
}

impl std::fmt::Debug for HostRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostRank({} of {})", self.rank, self.group.world)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_rank_order_sum() {
        // 1e8 + 1 - 1e8 depends on the order: rank order gives (0 + 1e8 + 1) - 1e8 = 0.
        let g = HostGroup::new(3);
        let parts = [vec![1e8f32, 1.0], vec![1.0, 2.0], vec![-1e8, 3.0]];
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = parts
                .iter()
                .enumerate()
                .map(|(r, p)| {
                    let g = g.clone();
                    s.spawn(move || {
                        let mut last = Vec::new();
                        for _ in 0..50 {
                            last = g.all_reduce(r, p.clone()).unwrap();
                        }
                        last
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in outs {
            assert_eq!(o, vec![0.0, 6.0]);
        }
    }

    #[test]
    fn an_abort_wakes_the_waiting_ranks() {
        let g = HostGroup::new(2);
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || g2.all_reduce(0, vec![1.0]));
        std::thread::sleep(std::time::Duration::from_millis(20));
        g.abort("rank 1 failed: test");
        assert_eq!(waiter.join().unwrap(), Err("rank 1 failed: test".to_string()));
        assert!(g.all_reduce(1, vec![1.0]).is_err());
    }

    #[test]
    fn mismatched_lengths_are_an_error_on_every_rank() {
        let g = HostGroup::new(2);
        let g2 = g.clone();
        let a = std::thread::spawn(move || g2.all_reduce(0, vec![1.0, 2.0]));
        let b = g.all_reduce(1, vec![1.0]);
        assert!(b.is_err() && a.join().unwrap().is_err());
    }
}
