//! The op profile of a GPU's eager work (`GpuOptions::op_profile`, `KDTREE_OP_PROFILE=1`): for every backend op
//! (`CudaBackend::run`: a linear, an MLA, the MoE's routing and experts, ...) outside a graph capture, the host's
//! time inside the call, the device's time between CUDA events recorded before and after it on the GPU's stream,
//! and the device's idle time before it (the previous op's end event to this op's start: the GPU waiting for the
//! host). A prefill is eager, so this splits its time to first token into kernels, host work and waits; a captured
//! step or round is one replay of its caller and is not broken down here (bench/ncu.sh does that).
//! The table goes to stderr when the GPU is dropped (the end of a kdtree-run). Nested ops count in the outermost.
//! Profiling costs two events and a capture-status query per op, and a synchronisation every
//! [`FLUSH_EVERY`] ops.

use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Ops timed before their events are read (a synchronisation).
pub const FLUSH_EVERY: usize = 2048;

/// One op's figures, summed over its calls.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct OpTotals {
    pub calls: usize,
    /// Host time inside the calls (launching, host-side work, any synchronisation they do).
    pub host: Duration,
    /// Device time from each call's start event to its end event.
    pub device_ms: f64,
    /// Device time from the previous op's end event to each call's start event.
    pub idle_before_ms: f64,
}

/// An op in flight: its events, read at the next flush.
pub struct Probe {
    op: String,
    t0: Instant,
    start: CudaEvent,
}

struct Timed {
    op: String,
    host: Duration,
    start: CudaEvent,
    end: CudaEvent,
}

#[derive(Default)]
struct State {
    pending: Vec<Timed>,
    last_end: Option<CudaEvent>,
    totals: HashMap<String, OpTotals>,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// See the module documentation.
#[derive(Default)]
pub struct OpProfile {
    depth: AtomicUsize,
    state: Mutex<State>,
}

fn capturing(stream: &CudaStream) -> bool {
    !matches!(
        stream.capture_status(),
        Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    )
}

fn timed_event(stream: &CudaStream) -> Option<CudaEvent> {
    stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).ok()
}

impl OpProfile {
    /// Starts timing `op` unless an op is already being timed (nesting) or the stream is capturing.
    pub fn begin(&self, stream: &CudaStream, op: &str) -> Option<Probe> {
        if self.depth.fetch_add(1, Ordering::Relaxed) > 0 || capturing(stream) {
            return None;
        }
        Some(Probe {
            op: op.to_string(),
            t0: Instant::now(),
            start: timed_event(stream)?,
        })
    }

    /// Ends the op [`OpProfile::begin`] started (call it whatever begin returned).
    pub fn end(&self, stream: &CudaStream, probe: Option<Probe>) {
        self.depth.fetch_sub(1, Ordering::Relaxed);
        let Some(p) = probe else { return };
        let host = p.t0.elapsed();
        let Some(end) = timed_event(stream) else { return };
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.first.get_or_insert(p.t0);
        s.last = Some(Instant::now());
        s.pending.push(Timed {
            op: p.op,
            host,
            start: p.start,
            end,
        });
        if s.pending.len() >= FLUSH_EVERY {
            flush(&mut s);
        }
    }

    /// Every op's totals so far (reads the pending events: synchronises with them).
    pub fn totals(&self) -> (HashMap<String, OpTotals>, Duration) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        flush(&mut s);
        let wall = match (s.first, s.last) {
            (Some(a), Some(b)) => b.duration_since(a),
            _ => Duration::ZERO,
        };
        (s.totals.clone(), wall)
    }

    /// The table: one line per op, the largest device + idle time first, and the sums.
    pub fn report(&self) -> String {
        let (totals, wall) = self.totals();
        let mut ops: Vec<_> = totals.into_iter().collect();
        ops.sort_by(|a, b| {
            (b.1.device_ms + b.1.idle_before_ms)
                .total_cmp(&(a.1.device_ms + a.1.idle_before_ms))
                .then(a.0.cmp(&b.0))
        });
        let mut out = format!(
            "kdtree: op profile (KDTREE_OP_PROFILE; eager ops only), host wall {:.1} ms from the first op to the last\n\
             {:<24} {:>8} {:>12} {:>12} {:>14}\n",
            wall.as_secs_f64() * 1e3,
            "op",
            "calls",
            "device ms",
            "host ms",
            "GPU idle ms"
        );
        let (mut d, mut h, mut i) = (0.0, 0.0, 0.0);
        for (op, t) in &ops {
            let host_ms = t.host.as_secs_f64() * 1e3;
            (d, h, i) = (d + t.device_ms, h + host_ms, i + t.idle_before_ms);
            out += &format!(
                "{op:<24} {:>8} {:>12.2} {:>12.2} {:>14.2}\n",
                t.calls, t.device_ms, host_ms, t.idle_before_ms
            );
        }
        out += &format!("{:<24} {:>8} {d:>12.2} {h:>12.2} {i:>14.2}\n", "total", "");
        out
    }
}

/// Reads the pending events in order and adds them to the totals.
fn flush(s: &mut State) {
    let pending = std::mem::take(&mut s.pending);
    for t in pending {
        let device = t.start.elapsed_ms(&t.end).map_or(0.0, f64::from);
        let idle = match &s.last_end {
            Some(prev) => prev.elapsed_ms(&t.start).map_or(0.0, f64::from).max(0.0),
            None => 0.0,
        };
        let e = s.totals.entry(t.op).or_default();
        e.calls += 1;
        e.host += t.host;
        e.device_ms += device;
        e.idle_before_ms += idle;
        s.last_end = Some(t.end);
    }
}
