//! Progress on stderr (bytes done / total, rate, ETA) with indicatif; silent with --quiet or when
//! stderr is not a terminal. Logs go to stderr, data to stdout.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte-counting progress bar, cheap to share across rayon threads.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(what: &str, total: u64, quiet: bool) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total), if quiet { ProgressDrawTarget::hidden() } else { ProgressDrawTarget::stderr() });
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}")
                .expect("static template")
                .progress_chars("=> "),
        );
        bar.set_message(what.to_string());
        Progress { bar }
    }
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
