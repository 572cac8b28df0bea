//! Exclusive advisory locks on a tool's output: a lock file locked with flock(2) (released by the kernel when
//! the process dies, so a killed run leaves no stale lock) that holds its owner's pid, so a second writer of
//! the same output fails at once naming who writes it. The holder unlinks the file as its last step (on drop);
//! a waiter that locked a file which was unlinked meanwhile notices (inode changed) and retries on the new one.
//! Used by kdtree-convert repack (`OUT/.kdtree-convert.lock`) and kdtree-run (`--out FILE` → `FILE.lock`).
//! Tests: bottom of this file; tools/kdtree-convert/tests/lock.rs; tools/kdtree-run/tests/hardening.rs.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// A held lock; dropping it unlinks the lock file (while still holding it), then releases the lock.
#[derive(Debug)]
pub struct Lock {
    /// Held open: the flock lives as long as this descriptor.
    _file: File,
    path: PathBuf,
}

/// Why [`try_lock`] did not take the lock.
#[derive(Debug)]
pub enum LockError {
    /// Another open file holds it; the holder's line (`pid N`), empty when it wrote none in time.
    Busy(String),
    /// The lock file could not be opened, locked or written.
    Io(std::io::Error),
}

impl std::fmt::Display for LockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockError::Busy(who) if who.is_empty() => write!(f, "locked by another process"),
            LockError::Busy(who) => write!(f, "locked by another process ({who})"),
            LockError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Take the lock file at `path` (created when missing) without waiting, and write this process's pid in it.
pub fn try_lock(path: &Path) -> Result<Lock, LockError> {
    for _ in 0..100 {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(LockError::Io)?;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(LockError::Io(e));
            }
            return Err(LockError::Busy(holder(&mut file).trim().to_string()));
        }
        // The holder before us may have unlinked the file between our open and our lock: then it is not
        // the lock any more, and a newcomer may hold the new one. Retry on what the path names now.
        let same = std::fs::metadata(path)
            .ok()
            .is_some_and(|m| file.metadata().is_ok_and(|f| f.ino() == m.ino() && f.dev() == m.dev()));
        if !same {
            continue;
        }
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "pid {}", std::process::id()))
            .map_err(LockError::Io)?;
        return Ok(Lock {
            _file: file,
            path: path.to_path_buf(),
        });
    }
    Err(LockError::Io(std::io::Error::other(
        "could not take the lock: its file keeps being replaced",
    )))
}

/// The holder's line in the lock file. The holder writes it just after taking the lock, so a waiter
/// that arrives in between sees an empty file: give the holder up to ~0.5 s to write it.
fn holder(file: &mut File) -> String {
    let mut who = String::new();
    for _ in 0..50 {
        who.clear();
        let _ = file.rewind().and_then(|_| file.take(4096).read_to_string(&mut who));
        if who.ends_with('\n') {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    who
}

impl Lock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Unlinked while still held: a waiter that opened this inode sees it replaced and retries.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_naming_the_pid_and_the_file_goes_with_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.lock");
        let held = try_lock(&p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            format!("pid {}\n", std::process::id())
        );
        // flock locks are per open file: a second open in this process is refused too.
        match try_lock(&p) {
            Err(LockError::Busy(who)) => assert_eq!(who, format!("pid {}", std::process::id())),
            other => panic!("{other:?}"),
        }
        drop(held);
        assert!(!p.exists(), "the holder removes its lock file");
        // A stale file (its holder died: no flock on it) does not block.
        std::fs::write(&p, "pid 999999\n").unwrap();
        let again = try_lock(&p).unwrap();
        assert_eq!(again.path(), p);
        let e = try_lock(&dir.path().join("no/such/dir.lock")).unwrap_err();
        assert!(matches!(e, LockError::Io(_)), "{e}");
    }
}
