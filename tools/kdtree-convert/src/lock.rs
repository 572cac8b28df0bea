//! The exclusive lock a repack holds on OUT (issue 16 item 6): `OUT/.kdtree-convert.lock`, through
//! kdtree_text::lock (flock(2), released by the kernel when the process dies, so a killed run leaves no stale
//! lock; the file holds the owner's pid, so a second repack into the same OUT fails at once naming who writes
//! it; the holder unlinks it as the last step of a run). Test: tools/kdtree-convert/tests/lock.rs.

use anyhow::{bail, Context, Result};
use kdtree_text::lock::{try_lock, Lock, LockError};
use std::path::Path;

/// Name of the lock file inside OUT.
pub const LOCK_FILE: &str = ".kdtree-convert.lock";

/// A held lock; dropping it (or `release`) unlinks the lock file and releases the lock.
pub struct OutLock(Lock);

/// Take the lock on `out` (which must exist) without waiting. Err names the holder's pid when busy.
pub fn lock_out(out: &Path) -> Result<OutLock> {
    let path = out.join(LOCK_FILE);
    match try_lock(&path) {
        Ok(l) => Ok(OutLock(l)),
        Err(LockError::Busy(who)) => {
            let who = if who.is_empty() {
                "another process".to_string()
            } else {
                format!("another kdtree-convert ({who})")
            };
            bail!(
                "{}: locked by {who}; two conversions cannot write one OUT at once (wait for it to finish, or stop it)",
                out.display()
            )
        }
        Err(LockError::Io(e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

impl OutLock {
    /// Unlink the lock file while still holding it (the last step of a finished run), then release.
    pub fn release(self) {
        drop(self.0);
    }
}
