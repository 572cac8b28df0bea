//! Messages to stderr that never panic: `elog!` is `eprintln!` with write errors ignored (a closed or
//! full stderr must not turn a finished conversion into exit 101; issue 16 item 7). Data goes to stdout
//! through `out`, whose error the caller handles (a closed stdout is a broken pipe, not a crash).
//! Tests: tools/kdtree-convert/tests/closed_pipes.rs.

use std::io::Write;

/// Write one line to stderr; a failed write is dropped (nowhere left to report it).
pub fn log(args: std::fmt::Arguments) {
    let mut e = std::io::stderr().lock();
    let _ = e.write_fmt(args).and_then(|_| e.write_all(b"\n"));
}

/// Write `s` to stdout and flush; the error is returned (the caller decides what a closed stdout means).
pub fn out(s: &str) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    o.write_all(s.as_bytes())?;
    o.flush()
}

/// `eprintln!` that cannot panic.
#[macro_export]
macro_rules! elog {
    ($($t:tt)*) => { $crate::log::log(format_args!($($t)*)) };
}
