//! After fork() a child has a copy of the process's memory but none of its threads, and
//! shares the parent's io_uring rings: it must never use a store, or wait on a ticket,
//! made before the fork. Each object notes the fork generation it was made in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn in_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation; the first call installs the at-fork handler.
pub fn generation() -> u64 {
    static HOOK: Once = Once::new();
    // Safety: the handler only bumps an atomic counter, which is safe in a fork child.
    HOOK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(in_child));
    });
    FORKS.load(Ordering::Relaxed)
}

/// True in a child forked after `born` was taken (by [`generation`]).
pub fn since(born: u64) -> bool {
    FORKS.load(Ordering::Relaxed) != born
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_sees_a_new_generation() {
        let born = generation();
        assert!(!since(born));
        // Safety: the child only reads an atomic and exits without running destructors.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe { libc::_exit(if since(born) { 0 } else { 1 }) };
        }
        let mut status = 0;
        // Safety: waits for the child just made.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(!since(born));
    }
}
