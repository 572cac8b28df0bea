//! The exclusive lock a repack holds on OUT (issue 16 item 6): `OUT/.kdtree-convert.lock`, locked with
//! flock(2) (released by the kernel when the process dies, so a killed run leaves no stale lock) and
//! holding the owner's pid, so a second repack into the same OUT fails at once naming who writes it.
//! The file is unlinked by its holder as the last step of a run; a waiter that locked a file which was
//! unlinked meanwhile notices (inode changed) and retries on the new one.
//! Test: tools/kdtree-convert/tests/lock.rs.

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Name of the lock file inside OUT.
pub const LOCK_FILE: &str = ".kdtree-convert.lock";

/// A held lock; dropping it releases the lock (the file stays until `release`).
pub struct OutLock {
    file: File,
    path: PathBuf,
}

/// Take the lock on `out` (which must exist) without waiting. Err names the holder's pid when busy.
pub fn lock_out(out: &Path) -> Result<OutLock> {
    let path = out.join(LOCK_FILE);
    for _ in 0..100 {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(e).with_context(|| format!("locking {}", path.display()));
            }
            let who = holder(&mut file);
            let who = who.trim();
            let who = if who.is_empty() {
                "another process".to_string()
            } else {
                format!("another kdtree-convert ({who})")
            };
            bail!(
                "{}: locked by {who}; two conversions cannot write one OUT at once (wait for it to finish, or stop it)",
                out.display()
            );
        }
        // The holder before us may have unlinked the file between our open and our lock: then it is not
        // the lock any more, and a newcomer may hold the new one. Retry on what the path names now.
        let same = std::fs::metadata(&path)
            .ok()
            .is_some_and(|m| file.metadata().is_ok_and(|f| f.ino() == m.ino() && f.dev() == m.dev()));
        if !same {
            continue;
        }
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "pid {}", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        return Ok(OutLock { file, path });
    }
    bail!(
        "{}: could not take the lock (its file keeps being replaced)",
        path.display()
    )
}

/// The holder's line in the lock file. The holder writes it just after taking the lock, so a waiter
/// that arrives in between sees an empty file: give the holder up to ~0.5 s to write it.
fn holder(file: &mut File) -> String {
    let mut who = String::new();
    for _ in 0..50 {
        who.clear();
        let _ = file.rewind().and_then(|_| file.read_to_string(&mut who));
        if who.ends_with('\n') {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    who
}

impl OutLock {
    /// Unlink the lock file while still holding it (the last step of a finished run), then release.
    pub fn release(self) {
        let _ = std::fs::remove_file(&self.path);
        drop(self.file);
    }
}
