//! Completion of one logical transfer made of many chunk requests.

use crate::error::{Error, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Whatever keeps the memory of a transfer alive (a caller's buffer object):
/// held until the transfer completes, and never dropped if it is abandoned.
pub type Owner = Box<dyn Send + Sync>;

pub struct Ticket {
    state: Mutex<State>,
    cv: Condvar,
    born: crate::fork::Born,
}

struct State {
    pending: usize,
    error: Option<Error>,
    /// A chunk was given up while the kernel may still have been moving its bytes.
    abandoned: bool,
    created: Instant,
    finished: Option<Instant>,
    owner: Option<Owner>,
}

impl Ticket {
    /// A ticket for `pending` chunk requests.
    pub fn new(pending: usize) -> Arc<Self> {
        Self::with_owner(pending, None)
    }

    /// Like [`Ticket::new`], holding `owner` until every chunk has completed.
    pub fn with_owner(pending: usize, owner: Option<Owner>) -> Arc<Self> {
        let created = Instant::now();
        let finished = (pending == 0).then_some(created);
        let owner = if pending == 0 { None } else { owner };
        Arc::new(Ticket {
            state: Mutex::new(State { pending, error: None, abandoned: false, created, finished, owner }),
            cv: Condvar::new(),
            born: crate::fork::Born::now(),
        })
    }

    /// A ticket with nothing to wait for.
    pub fn done() -> Arc<Self> {
        Self::new(0)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a few counters updated without panicking: a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One chunk finished; the first error is kept.
    pub(crate) fn complete(&self, res: Result<()>) {
        self.finish(res.err(), false);
    }

    /// One chunk given up while the kernel may still hold its buffer: the ticket
    /// fails with `err` and its owner is leaked, so that memory is never reused.
    pub(crate) fn abandon(&self, err: Error) {
        self.finish(Some(err), true);
    }

    fn finish(&self, err: Option<Error>, abandoned: bool) {
        let owner = {
            let mut s = self.lock();
            if let Some(e) = err {
                s.error.get_or_insert(e);
            }
            s.abandoned |= abandoned;
            if s.pending > 1 {
                s.pending -= 1;
                return;
            }
            let owner = s.owner.take();
            if s.abandoned {
                std::mem::forget(owner);
                None
            } else {
                owner
            }
        };
        // Released before the ticket shows done, so whoever sees it done sees the memory let go;
        // and outside the lock, as it may run arbitrary code (a Python object's release).
        drop(owner);
        let mut s = self.lock();
        s.pending = 0;
        s.finished = Some(Instant::now());
        self.cv.notify_all();
    }

    /// How long the transfer took, from the ticket's creation to its last chunk; None while
    /// chunks are in flight.
    pub fn elapsed(&self) -> Option<Duration> {
        let s = self.lock();
        s.finished.map(|f| f - s.created)
    }

    /// True for a ticket that had nothing to wait for from its creation (bytes copied at once).
    pub fn immediate(&self) -> bool {
        let s = self.lock();
        s.finished == Some(s.created)
    }

    /// Also true in a fork child, where nothing will complete it ([`Ticket::wait`] says why).
    pub fn is_done(&self) -> bool {
        self.forked() || self.lock().pending == 0
    }

    /// True in a child forked after the ticket was made: its I/O threads are the parent's.
    pub fn forked(&self) -> bool {
        self.born.forked()
    }

    /// True when a chunk was abandoned: its memory may still be written by the kernel.
    pub fn abandoned(&self) -> bool {
        self.lock().abandoned
    }

    /// The outcome once done, None while chunks are in flight.
    pub fn poll(&self) -> Option<Result<()>> {
        if self.forked() {
            return Some(Err(Error::Forked));
        }
        let s = self.lock();
        (s.pending == 0).then(|| s.error.clone().map_or(Ok(()), Err))
    }

    /// Block until every chunk has completed; the first error, if any.
    pub fn wait(&self) -> Result<()> {
        if self.forked() {
            return Err(Error::Forked);
        }
        let mut s = self.lock();
        while s.pending > 0 {
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.error.clone().map_or(Ok(()), Err)
    }

    /// Like [`Ticket::wait`], giving up after `timeout`: None if still in flight.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        if self.forked() {
            return Some(Err(Error::Forked));
        }
        let s = self.lock();
        let (s, _) = self.cv.wait_timeout_while(s, timeout, |s| s.pending > 0).unwrap_or_else(PoisonError::into_inner);
        (s.pending == 0).then(|| s.error.clone().map_or(Ok(()), Err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Count(Arc<AtomicUsize>);
    impl Drop for Count {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_owner_lives_until_the_last_chunk() {
        let drops = Arc::new(AtomicUsize::new(0));
        let t = Ticket::with_owner(2, Some(Box::new(Count(drops.clone()))));
        t.complete(Ok(()));
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        assert_eq!(t.wait_timeout(Duration::from_millis(1)), None);
        t.complete(Err(Error::Closed));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(t.wait(), Err(Error::Closed));
        assert!(!t.abandoned());
    }

    #[test]
    fn an_abandoned_ticket_never_releases_its_owner() {
        let drops = Arc::new(AtomicUsize::new(0));
        let t = Ticket::with_owner(2, Some(Box::new(Count(drops.clone()))));
        t.abandon(Error::Closed);
        t.complete(Ok(()));
        assert!(t.abandoned());
        assert_eq!(t.poll(), Some(Err(Error::Closed)));
        drop(t);
        assert_eq!(drops.load(Ordering::SeqCst), 0, "the kernel may still use what the owner keeps alive");
    }
}
