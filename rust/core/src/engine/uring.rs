//! The io_uring engine: one ring and one thread per device.

use super::{refuse, Backlog, Dir, Health, IoQueue, IoReq, Next, Op, Throttle};
use crate::error::Error;
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{opcode, types, IoUring};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// After its ring fails, how long the engine waits for the kernel to finish what it holds
/// before abandoning it (its memory is then leaked, never reused).
const ABANDON_AFTER: Duration = Duration::from_secs(5);

pub struct UringQueue {
    tx: Option<Sender<Vec<IoReq>>>,
    thread: Option<JoinHandle<()>>,
    fixed: bool,
    health: Arc<Health>,
    path: PathBuf,
    ring_fd: RawFd,
    /// Written after each submission, so a worker waiting in the ring for a slow transfer
    /// takes new requests at once.
    wake: Arc<OwnedFd>,
}

impl UringQueue {
    /// Set up a ring of `depth` entries for `fd`. `buffers` are registered as
    /// fixed buffers when the kernel allows it; `notices` says when it does not.
    ///
    /// # Safety
    /// `fd` must stay open, and every buffer in `buffers` mapped, until this queue is dropped.
    pub unsafe fn new(
        fd: RawFd,
        path: PathBuf,
        depth: u32,
        buffers: &[(*mut u8, usize)],
        throttle: Throttle,
        notices: &mut Vec<String>,
    ) -> std::io::Result<Self> {
        // One entry more than `depth` for the wake-up read.
        let ring = IoUring::new((depth + 1).next_power_of_two())?;
        let mut fixed = false;
        if !buffers.is_empty() {
            let iov: Vec<libc::iovec> =
                buffers.iter().map(|&(p, l)| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: l }).collect();
            // Safety: the caller keeps the buffers mapped for the queue's life (this function's contract).
            match unsafe { ring.submitter().register_buffers(&iov) } {
                Ok(()) => fixed = true,
                Err(e) => notices.push(format!(
                    "cannot register the host arena with io_uring ({e}); using unregistered buffers \
                     (raise RLIMIT_MEMLOCK, `ulimit -l`, to enable fixed buffers)"
                )),
            }
        }
        let ring_fd = ring.as_raw_fd();
        // Safety: eventfd takes no pointers; the result is checked and owned at once.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Safety: a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let (tx, rx) = crossbeam_channel::unbounded::<Vec<IoReq>>();
        let health = Arc::new(Health::default());
        let worker = Worker {
            ring,
            fd,
            path: path.clone(),
            depth: depth as usize,
            fixed,
            throttle,
            health: health.clone(),
            rx,
            open: true,
            slab: Vec::new(),
            free: Vec::new(),
            backlog: Backlog::default(),
            inflight: 0,
            cqes: Vec::new(),
            unconsumed: VecDeque::new(),
            wake: wake.clone(),
            wake_buf: Box::leak(Box::new(0u64)),
            wake_armed: false,
        };
        let thread = std::thread::Builder::new()
            .name("ssdtier-uring".into())
            .spawn(move || worker.run())
            .map_err(std::io::Error::other)?;
        Ok(UringQueue { tx: Some(tx), thread: Some(thread), fixed, health, path, ring_fd, wake })
    }

    /// The ring's file descriptor, for tests that break the ring under the engine.
    #[doc(hidden)]
    pub fn ring_fd(&self) -> RawFd {
        self.ring_fd
    }
}

impl IoQueue for UringQueue {
    fn submit(&self, reqs: Vec<IoReq>) {
        if let Some(why) = self.health.failure() {
            return refuse(reqs, &self.path, &why);
        }
        if let Some(tx) = &self.tx {
            if let Err(e) = tx.send(reqs) {
                return refuse(e.0, &self.path, "its thread has stopped");
            }
            let one = 1u64;
            // Safety: writes 8 bytes from a live u64 to an eventfd we own; a full counter
            // (EAGAIN) means a wake-up is pending anyway.
            unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
    fn name(&self) -> &'static str {
        "io_uring"
    }
    fn fixed_buffers(&self) -> bool {
        self.fixed
    }
    fn failure(&self) -> Option<String> {
        self.health.failure()
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An op in the kernel's hands. `user_data` is the slab index and this generation, so a
/// completion can only ever finish the op it was submitted for.
struct Slot {
    gen: u32,
    op: Option<Op>,
}

struct Worker {
    ring: IoUring,
    fd: RawFd,
    path: PathBuf,
    depth: usize,
    fixed: bool,
    throttle: Throttle,
    health: Arc<Health>,
    rx: Receiver<Vec<IoReq>>,
    open: bool,
    slab: Vec<Slot>,
    free: Vec<usize>,
    backlog: Backlog,
    inflight: usize,
    cqes: Vec<(u64, i32)>,
    /// Slab indices (WAKE for the wake-up read) pushed to the submission queue in order and
    /// not yet known to be consumed by the kernel.
    unconsumed: VecDeque<usize>,
    wake: Arc<OwnedFd>,
    /// Leaked: the kernel may write it until the ring is gone.
    wake_buf: &'static mut u64,
    wake_armed: bool,
}

/// `user_data` and `unconsumed` tag of the wake-up read.
const WAKE: u64 = u64::MAX;

impl Worker {
    fn run(mut self) {
        loop {
            if self.inflight == 0 && self.backlog.is_empty() {
                if !self.open {
                    return;
                }
                match self.rx.recv() {
                    Ok(v) => v.into_iter().for_each(|r| self.backlog.push(Op::new(r))),
                    Err(_) => return,
                }
            }
            self.receive();
            self.push();
            if self.inflight == 0 {
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => self.note_consumed(),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {
                    self.note_consumed()
                }
                Err(e) => return self.after_failure(format!("its ring failed ({e})")),
            }
            self.reap();
        }
    }

    /// Forget the entries the kernel has taken from the submission queue.
    fn note_consumed(&mut self) {
        let left = self.ring.submission().len();
        while self.unconsumed.len() > left {
            self.unconsumed.pop_front();
        }
    }

    /// Keep a read of the eventfd in the ring, so a new submission ends the worker's wait.
    fn arm_wake(&mut self) {
        if self.wake_armed {
            return;
        }
        let buf: *mut u64 = self.wake_buf;
        let entry =
            opcode::Read::new(types::Fd(self.wake.as_raw_fd()), buf.cast(), 8).offset(0).build().user_data(WAKE);
        // Safety: the buffer is leaked, so it outlives the ring.
        if unsafe { self.ring.submission().push(&entry) }.is_ok() {
            self.wake_armed = true;
            self.unconsumed.push_back(usize::MAX);
        }
    }

    fn receive(&mut self) {
        while self.open {
            match self.rx.try_recv() {
                Ok(v) => v.into_iter().for_each(|r| self.backlog.push(Op::new(r))),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.open = false,
            }
        }
    }

    /// Move backlog ops into the submission queue while fewer than `depth` are in flight.
    fn push(&mut self) {
        self.arm_wake();
        while self.inflight < self.depth {
            let Some(op) = self.backlog.pop() else { break };
            #[cfg(test)]
            assert!(op.req.file_off() != tests::PANIC_AT, "a panic on the engine's thread, for a test");
            let (ptr, off, len) = op.next_piece();
            self.throttle.pace(len);
            let idx = self.free.pop().unwrap_or_else(|| {
                self.slab.push(Slot { gen: 0, op: None });
                self.slab.len() - 1
            });
            let fd = types::Fd(self.fd);
            let len = len as u32; // at most MAX_XFER
            let entry = match (op.req.dir(), op.fixed().filter(|_| self.fixed)) {
                (Dir::Write, Some(b)) => opcode::WriteFixed::new(fd, ptr, len, b).offset(off).build(),
                (Dir::Read, Some(b)) => opcode::ReadFixed::new(fd, ptr, len, b).offset(off).build(),
                (Dir::Write, None) => opcode::Write::new(fd, ptr, len).offset(off).build(),
                (Dir::Read, None) => opcode::Read::new(fd, ptr, len).offset(off).build(),
            }
            .user_data(((self.slab[idx].gen as u64) << 32) | idx as u64);
            // Safety: the buffer stays valid until the op's completion (IoReq::new's contract),
            // and the slab keeps the op until that completion is seen here.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                // Submission queue full: keep it for the next round.
                self.free.push(idx);
                self.backlog.push_front(op);
                break;
            }
            self.slab[idx].op = Some(op);
            self.inflight += 1;
            self.unconsumed.push_back(idx);
        }
    }

    /// Finish the ops whose completions are in the completion queue (read from shared
    /// memory: this works after the ring's syscalls have started to fail).
    fn reap(&mut self) {
        self.cqes.clear();
        self.cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for i in 0..self.cqes.len() {
            let (ud, res) = self.cqes[i];
            if ud == WAKE {
                self.wake_armed = false;
                continue;
            }
            let (idx, gen) = ((ud & 0xffff_ffff) as usize, (ud >> 32) as u32);
            let Some(slot) = self.slab.get_mut(idx).filter(|s| s.gen == gen) else { continue };
            let Some(op) = slot.op.take() else { continue };
            slot.gen = slot.gen.wrapping_add(1);
            self.free.push(idx);
            self.inflight -= 1;
            if let Next::Again(op) = op.advance(res as i64, &self.path) {
                self.backlog.push_front(op);
            }
        }
    }

    /// The ring cannot take more work: refuse everything not yet in the kernel, wait for
    /// what it holds to come back (or abandon it after a while), then refuse until closed.
    fn after_failure(mut self, why: String) {
        self.health.fail(why.clone());
        // What the kernel never took from the submission queue never reached it, and never will
        // (nothing enters this ring again): refuse it now.
        let left = self.ring.submission().len();
        if left <= self.unconsumed.len() {
            let never: Vec<usize> = self.unconsumed.drain(self.unconsumed.len() - left..).collect();
            for idx in never.into_iter().filter(|&i| i != usize::MAX) {
                if let Some(op) = self.slab[idx].op.take() {
                    self.inflight -= 1;
                    refuse(vec![op.req], &self.path, &why);
                }
            }
        }
        let deadline = Instant::now() + ABANDON_AFTER;
        let mut nap = Duration::from_millis(1);
        loop {
            self.receive();
            let backlog: Vec<IoReq> = self.backlog.drain().map(|op| op.req).collect();
            refuse(backlog, &self.path, &why);
            self.reap();
            let stale: Vec<IoReq> = self.backlog.drain().map(|op| op.req).collect();
            refuse(stale, &self.path, &why); // the rest of a short transfer: cannot be submitted now
            if self.inflight == 0 {
                while let Ok(v) = self.rx.recv() {
                    refuse(v, &self.path, &why);
                }
                return;
            }
            if Instant::now() >= deadline {
                self.abandon(&why);
                continue;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(50));
        }
    }

    /// Give up on every op the kernel holds: their tickets fail and their memory is leaked.
    fn abandon(&mut self, why: &str) {
        for slot in &mut self.slab {
            if let Some(op) = slot.op.take() {
                op.req.abandon(Error::EngineFailed { path: self.path.clone(), detail: why.to_string() });
            }
        }
        self.inflight = 0;
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return; // a normal exit leaves nothing behind
        }
        // Nothing will complete these ops now.
        let why = "its thread panicked".to_string();
        self.health.fail(why.clone());
        self.abandon(&why);
        let backlog: Vec<IoReq> = self.backlog.drain().map(|op| op.req).collect();
        refuse(backlog, &self.path, &why);
        // Requests still in the channel are failed when the channel drops them (IoReq's Drop).
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ticket::Ticket;

    /// A request at this offset makes the worker panic.
    pub(super) const PANIC_AT: u64 = 0xdead_0000;

    #[test]
    fn a_dead_worker_fails_waits_instead_of_hanging() {
        let (mut fds, mut buf, mut other) = ([0; 2], vec![0u8; 4096], vec![0u8; 4096]);
        // Safety: a pipe into a two-element array; its ends stay open for the whole test (leaked).
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let dir = PathBuf::from("/pipe");
        // Safety: the pipe and buffers outlive the queue (and the abandoned buffer is leaked below).
        let q = unsafe { UringQueue::new(fds[0], dir, 8, &[], Throttle::new(0), &mut Vec::new()) }.unwrap();
        let held = Ticket::new(1);
        // Safety: buf is leaked if the kernel may still write it.
        q.submit(vec![unsafe { IoReq::new(Dir::Read, u64::MAX, buf.as_mut_ptr(), 4096, None, held.clone()) }]);
        std::thread::sleep(Duration::from_millis(50));
        let doomed = Ticket::new(1);
        // Safety: never reaches the kernel.
        q.submit(vec![unsafe { IoReq::new(Dir::Read, PANIC_AT, other.as_mut_ptr(), 4096, None, doomed.clone()) }]);
        // Both waits end: the request the kernel held is abandoned, the other refused.
        let err = held.wait_timeout(Duration::from_secs(5)).expect("no hang").unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
        assert!(held.abandoned());
        assert!(doomed.wait_timeout(Duration::from_secs(5)).expect("no hang").is_err());
        assert!(!doomed.abandoned());
        assert!(q.failure().is_some_and(|w| w.contains("panicked")));
        let late = Ticket::new(1);
        // Safety: refused at once.
        q.submit(vec![unsafe { IoReq::new(Dir::Read, 0, other.as_mut_ptr(), 4096, None, late.clone()) }]);
        assert!(late.poll().is_some_and(|r| r.is_err()));
        drop(q);
        std::mem::forget(buf); // the kernel may still write it
                               // Safety: the write end of the pipe, still open.
        unsafe { libc::close(fds[1]) };
    }
}
