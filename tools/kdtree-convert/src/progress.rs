//! Progress on stderr (bytes done / total, rate, ETA). On a terminal: an indicatif bar. Otherwise (a
//! `nohup` run, a log file, a pipe): one plain line every `LOG_EVERY` and one at the end, so a long run
//! is never silent (issue 16 item 15). Nothing at all with --quiet (and no per-chunk cost then).
//! Logs go to stderr, data to stdout; a closed stderr is ignored. Test: bottom of this file.

use indicatif::{BinaryBytes, HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Interval between two plain progress lines.
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// The clock is read at most once per this many bytes (keeps `inc` cheap on 4 MiB chunks).
const CHECK_BYTES: u64 = 32 << 20;

/// Where plain lines go and when the last one went.
struct Log {
    sink: Box<dyn Write + Send>,
    every: Duration,
    last: Instant,
}

enum Mode {
    Hidden,
    Bar(ProgressBar),
    Lines(Mutex<Log>),
}

/// A byte-counting progress reporter, cheap to share across threads.
pub struct Progress {
    what: String,
    total: u64,
    done: AtomicU64,
    start: Instant,
    mode: Mode,
}

/// The terminal bar: the bar takes what the terminal's width leaves (`wide_bar`), so the line is never
/// wider than the terminal (a fixed 30-column bar made 81+ columns on an 80-column terminal).
fn styled(bar: ProgressBar, what: &str) -> ProgressBar {
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{wide_bar}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

impl Progress {
    pub fn new(what: &str, total: u64, quiet: bool) -> Progress {
        if quiet {
            return Progress::with_mode(what, total, Mode::Hidden);
        }
        if !std::io::stderr().is_terminal() {
            return Progress::lines(what, total, LOG_EVERY, Box::new(std::io::stderr()));
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        Progress::with_mode(what, total, Mode::Bar(styled(bar, what)))
    }

    /// Plain lines into `sink`, one per `every` (and a last one from `finish`).
    pub fn lines(what: &str, total: u64, every: Duration, sink: Box<dyn Write + Send>) -> Progress {
        Progress::with_mode(
            what,
            total,
            Mode::Lines(Mutex::new(Log {
                sink,
                every,
                last: Instant::now(),
            })),
        )
    }

    fn with_mode(what: &str, total: u64, mode: Mode) -> Progress {
        Progress {
            what: what.to_string(),
            total,
            done: AtomicU64::new(0),
            start: Instant::now(),
            mode,
        }
    }

    pub fn inc(&self, n: u64) {
        match &self.mode {
            Mode::Hidden => {}
            Mode::Bar(b) => b.inc(n),
            Mode::Lines(log) => {
                let before = self.done.fetch_add(n, Ordering::Relaxed);
                if before / CHECK_BYTES == (before + n) / CHECK_BYTES {
                    return;
                }
                let Ok(mut l) = log.try_lock() else { return };
                if l.last.elapsed() >= l.every {
                    l.last = Instant::now();
                    let line = self.line(before + n, false);
                    let _ = l.sink.write_all(line.as_bytes());
                }
            }
        }
    }

    /// `repack: 1.50 GiB of 10.00 GiB (15%), 312.4 MiB/s, ETA 28 seconds`.
    fn line(&self, done: u64, last: bool) -> String {
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        let rate = done as f64 / secs;
        let pct = if self.total == 0 {
            100.0
        } else {
            100.0 * done as f64 / self.total as f64
        };
        if last {
            return format!(
                "{}: {} in {}, {}/s\n",
                self.what,
                BinaryBytes(done),
                HumanDuration(self.start.elapsed()),
                BinaryBytes(rate as u64)
            );
        }
        let eta = if rate > 0.0 {
            Duration::from_secs_f64(self.total.saturating_sub(done) as f64 / rate)
        } else {
            Duration::ZERO
        };
        format!(
            "{}: {} of {} ({pct:.0}%), {}/s, ETA {}\n",
            self.what,
            BinaryBytes(done),
            BinaryBytes(self.total),
            BinaryBytes(rate as u64),
            HumanDuration(eta)
        )
    }

    pub fn finish(&self) {
        match &self.mode {
            Mode::Hidden => {}
            Mode::Bar(b) => b.finish_and_clear(),
            Mode::Lines(log) => {
                let line = self.line(self.done.load(Ordering::Relaxed), true);
                if let Ok(mut l) = log.lock() {
                    let _ = l.sink.write_all(line.as_bytes());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A sink the test can read back.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// An 80-column terminal that keeps what is drawn.
    #[derive(Debug, Clone, Default)]
    struct Term80(Arc<Mutex<Vec<String>>>);
    impl indicatif::TermLike for Term80 {
        fn width(&self) -> u16 {
            80
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.0.lock().unwrap().push(s.to_string());
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_bar_fits_an_80_column_terminal() {
        let term = Term80::default();
        // Widest figures: 1000+ MiB of 1000+ GiB at a 1000+ MiB/s rate.
        let total = 1023 << 30;
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::term_like(Box::new(term.clone())));
        let bar = styled(bar, "repack");
        bar.set_position((1023 << 20) + 12345);
        bar.tick();
        bar.finish();
        let drawn = term.0.lock().unwrap().clone();
        assert!(drawn.iter().any(|l| l.starts_with("repack [")), "{drawn:?}");
        for l in &drawn {
            assert!(l.chars().count() <= 80, "{} columns: {l:?}", l.chars().count());
        }
    }

    #[test]
    fn plain_lines_come_periodically_with_bytes_rate_and_eta() {
        let buf = Buf::default();
        let p = Progress::lines(
            "repack",
            10 * CHECK_BYTES,
            Duration::from_millis(20),
            Box::new(buf.clone()),
        );
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(30));
            p.inc(CHECK_BYTES);
        }
        p.inc(6 * CHECK_BYTES);
        p.finish();
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.len() >= 4, "{text}");
        assert!(
            lines[0].starts_with("repack: 32.00 MiB of 320.00 MiB (10%), ") && lines[0].contains("/s, ETA "),
            "{text}"
        );
        assert!(lines.last().unwrap().starts_with("repack: 320.00 MiB in "), "{text}");
        // Below the clock-check granularity nothing is printed between the periodic lines.
        let quiet = Buf::default();
        let p = Progress::lines("x", 100, Duration::ZERO, Box::new(quiet.clone()));
        p.inc(10);
        assert!(quiet.0.lock().unwrap().is_empty());
    }
}
