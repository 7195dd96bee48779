//! After fork() a child has a copy of the process's memory but none of its threads, and
//! shares the parent's io_uring rings: it must never use a store, or wait on a ticket,
//! made before the fork. Each object notes the fork generation it was made in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn in_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The fork generation an object was made in.
#[derive(Clone, Copy)]
pub struct Born(u64);

impl Born {
    /// Now; the first call installs the at-fork handler.
    pub fn now() -> Self {
        static HOOK: Once = Once::new();
        // Safety: the handler only bumps an atomic counter, which is safe in a fork child.
        HOOK.call_once(|| unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        });
        Born(FORKS.load(Ordering::Relaxed))
    }

    /// True in a child forked since.
    pub fn forked(self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_sees_a_new_generation() {
        let born = Born::now();
        assert!(!born.forked());
        // Safety: the child only reads an atomic and exits without running destructors.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe { libc::_exit(if born.forked() { 0 } else { 1 }) };
        }
        let mut status = 0;
        // Safety: waits for the child just made.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(!born.forked());
    }
}
