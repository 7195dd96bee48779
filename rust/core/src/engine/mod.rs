//! I/O engines: one queue per device (io_uring, a POSIX thread pool, or the
//! simulation) behind one trait. Requests run on engine threads, never on the
//! caller's; callers hold a [`Ticket`] to poll or wait on.
//!
//! Ownership: a request's buffer belongs to the kernel from submission until
//! its completion is seen. A request is completed exactly once (consuming it);
//! one dropped unfinished completes its ticket with an error; one whose engine
//! died with it in the kernel is abandoned, and its memory is never reused.

mod posix;
mod uring;

pub use posix::PosixQueue;
pub use uring::UringQueue;

use crate::error::{Error, Result};
use crate::ticket::Ticket;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

impl Dir {
    pub(crate) fn op(self) -> &'static str {
        match self {
            Dir::Read => "read",
            Dir::Write => "write",
        }
    }
}

/// One chunk: bytes between a buffer and a file offset.
pub struct IoReq {
    dir: Dir,
    file_off: u64,
    buf: *mut u8,
    len: usize,
    /// Index of the registered buffer that holds `buf`, if it is one.
    fixed: Option<u16>,
    ticket: Arc<Ticket>,
    finished: bool,
}

// Safety: `buf` is valid for the request's lifetime (the contract of `IoReq::new`), and only
// the one engine thread that holds the request touches it.
unsafe impl Send for IoReq {}

impl IoReq {
    /// A request to move `len` bytes between `buf` and `file_off`.
    ///
    /// # Safety
    /// `buf` must be valid for `len` bytes (for reads of it with `Dir::Write`,
    /// for writes into it with `Dir::Read`) until `ticket` is done; and if the
    /// ticket is abandoned, forever (the memory is then leaked, never reused).
    /// Nobody else may write those bytes meanwhile, nor read them for a `Dir::Read`.
    /// With `fixed`, they must lie in that registered buffer.
    pub unsafe fn new(
        dir: Dir,
        file_off: u64,
        buf: *mut u8,
        len: usize,
        fixed: Option<u16>,
        ticket: Arc<Ticket>,
    ) -> Self {
        IoReq { dir, file_off, buf, len, fixed, ticket, finished: false }
    }

    pub fn dir(&self) -> Dir {
        self.dir
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn file_off(&self) -> u64 {
        self.file_off
    }

    pub(crate) fn complete(mut self, res: Result<()>) {
        self.finished = true;
        self.ticket.complete(res);
    }

    /// Given up while the kernel may still hold it: see [`Ticket`].
    pub(crate) fn abandon(mut self, err: Error) {
        self.finished = true;
        self.ticket.abandon(err);
    }

    fn error(&self, path: &Path, done: usize, errno: i32) -> Error {
        Error::io(self.dir.op(), path, self.file_off + done as u64, (self.len - done) as u64, errno)
    }
}

impl Drop for IoReq {
    fn drop(&mut self) {
        if !self.finished {
            // Never reached the kernel (dropped by a stopped engine): fail it, never leave it pending.
            self.ticket.complete(Err(engine_failed(Path::new(""), "a request was dropped by a stopped I/O engine")));
        }
    }
}

pub(crate) fn engine_failed(path: &Path, detail: &str) -> Error {
    Error::EngineFailed { path: path.to_path_buf(), detail: detail.to_string() }
}

/// A device's request queue, whatever the engine behind it.
pub trait IoQueue: Send + Sync {
    /// Queue requests. Each completes through its ticket, with an error if the engine has stopped.
    fn submit(&self, reqs: Vec<IoReq>);
    fn name(&self) -> &'static str;
    /// Whether requests with `fixed` set use registered buffers.
    fn fixed_buffers(&self) -> bool {
        false
    }
    /// Why the engine stopped taking work, once it has.
    fn failure(&self) -> Option<String> {
        None
    }
    /// Move simulated I/O forward by one step; true if something moved. Real engines run on
    /// their own threads and return false.
    fn drive(&self) -> bool {
        false
    }
}

/// Why an engine stopped, set once; shared by the engine's thread and its queue.
#[derive(Default)]
pub(crate) struct Health(OnceLock<String>);

impl Health {
    pub(crate) fn fail(&self, why: String) {
        let _ = self.0.set(why);
    }
    pub(crate) fn failure(&self) -> Option<String> {
        self.0.get().cloned()
    }
}

/// Fail requests that cannot be queued (the engine stopped) with its reason.
pub(crate) fn refuse(reqs: Vec<IoReq>, path: &Path, why: &str) {
    for r in reqs {
        r.complete(Err(engine_failed(path, why)));
    }
}

/// Largest transfer handed to the kernel at once (Linux moves at most about 2 GiB per call).
pub(crate) const MAX_XFER: usize = 1 << 30;
/// Retries of a transfer that made no progress (EAGAIN, EINTR, a zero-byte result) before it fails.
pub(crate) const MAX_AGAIN: u32 = 64;

/// A request and its progress, as the engines and the simulation drive it.
pub(crate) struct Op {
    pub(crate) req: IoReq,
    pub(crate) done: usize,
    again: u32,
}

/// What to do with an op after one kernel result.
pub(crate) enum Next {
    /// Completed (successfully or not).
    Finished,
    /// Submit the rest again (a short transfer or a retryable error).
    Again(Op),
}

impl Op {
    pub(crate) fn new(req: IoReq) -> Self {
        Op { req, done: 0, again: 0 }
    }

    /// Where the rest of the transfer starts, and how long the next piece is.
    pub(crate) fn next_piece(&self) -> (*mut u8, u64, usize) {
        // Safety (of the pointer arithmetic): `done <= len`, inside the request's buffer.
        let ptr = unsafe { self.req.buf.add(self.done) };
        (ptr, self.req.file_off + self.done as u64, (self.req.len - self.done).min(MAX_XFER))
    }

    pub(crate) fn fixed(&self) -> Option<u16> {
        self.req.fixed
    }

    /// Account one kernel result: bytes moved, or a negative errno.
    pub(crate) fn advance(mut self, res: i64, path: &Path) -> Next {
        let errno = if res < 0 { (-res) as i32 } else { 0 };
        let stalled = match res {
            r if r < 0 && retryable(errno) => true,
            r if r < 0 => {
                let err = self.req.error(path, self.done, errno);
                self.req.complete(Err(err));
                return Next::Finished;
            }
            0 if self.done < self.req.len => true,
            n => {
                self.done += n as usize;
                self.again = 0;
                false
            }
        };
        if stalled {
            self.again += 1;
            if self.again > MAX_AGAIN {
                // Zero bytes again and again: end of file on a read, no progress on a write.
                let errno = match (errno, self.req.dir) {
                    (0, Dir::Read) => libc::EIO,
                    (0, Dir::Write) => libc::ENOSPC,
                    (e, _) => e,
                };
                let err = self.req.error(path, self.done, errno);
                self.req.complete(Err(err));
                return Next::Finished;
            }
        }
        if self.done >= self.req.len {
            self.req.complete(Ok(()));
            return Next::Finished;
        }
        Next::Again(self)
    }

    /// Consecutive results without progress so far (engines back off on these).
    pub(crate) fn stalls(&self) -> u32 {
        self.again
    }
}

pub(crate) fn retryable(errno: i32) -> bool {
    matches!(errno, libc::EINTR | libc::EAGAIN | libc::EBUSY)
}

/// An optional bandwidth cap (benchmarks only): each transfer is submitted when a disk of
/// `bytes_per_sec` would have finished it, after those before it.
#[derive(Clone)]
pub struct Throttle {
    /// When the capped device is free again.
    inner: Option<Arc<Mutex<Instant>>>,
    bytes_per_sec: f64,
}

impl Throttle {
    pub fn new(bytes_per_sec: u64) -> Self {
        if bytes_per_sec == 0 {
            Throttle { inner: None, bytes_per_sec: 0.0 }
        } else {
            Throttle { inner: Some(Arc::new(Mutex::new(Instant::now()))), bytes_per_sec: bytes_per_sec as f64 }
        }
    }

    pub(crate) fn pace(&self, len: usize) {
        let Some(inner) = &self.inner else { return };
        let wait = {
            let mut free_at = inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = Instant::now();
            *free_at = (*free_at).max(now) + Duration::from_secs_f64(len as f64 / self.bytes_per_sec);
            free_at.saturating_duration_since(now)
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

/// The requests of a queue not yet handed to the kernel: reads first, so a
/// read that the backward waits for is not queued behind eviction writes.
#[derive(Default)]
pub(crate) struct Backlog {
    reads: std::collections::VecDeque<Op>,
    writes: std::collections::VecDeque<Op>,
}

impl Backlog {
    pub(crate) fn push(&mut self, op: Op) {
        match op.req.dir {
            Dir::Read => self.reads.push_back(op),
            Dir::Write => self.writes.push_back(op),
        }
    }
    /// A retry or the rest of a short transfer goes first in its direction.
    pub(crate) fn push_front(&mut self, op: Op) {
        match op.req.dir {
            Dir::Read => self.reads.push_front(op),
            Dir::Write => self.writes.push_front(op),
        }
    }
    pub(crate) fn pop(&mut self) -> Option<Op> {
        self.reads.pop_front().or_else(|| self.writes.pop_front())
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.reads.is_empty() && self.writes.is_empty()
    }
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Op> + '_ {
        self.reads.drain(..).chain(self.writes.drain(..))
    }
}
