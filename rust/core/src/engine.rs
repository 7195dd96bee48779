//! I/O engines: one queue per device, io_uring or a POSIX thread pool behind
//! one trait. Submission and completion run on engine threads, never on the
//! caller's; callers hold a [`Ticket`] to poll or wait on.

use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

impl Dir {
    fn op(self) -> &'static str {
        match self {
            Dir::Read => "read",
            Dir::Write => "write",
        }
    }
}

/// Completion state of one logical transfer made of many chunk requests.
pub struct Ticket {
    state: Mutex<TicketState>,
    cv: Condvar,
}

struct TicketState {
    pending: usize,
    error: Option<Error>,
    created: Instant,
    finished: Option<Instant>,
}

impl Ticket {
    pub fn new(pending: usize) -> Arc<Self> {
        let created = Instant::now();
        let finished = (pending == 0).then_some(created);
        Arc::new(Ticket {
            state: Mutex::new(TicketState { pending, error: None, created, finished }),
            cv: Condvar::new(),
        })
    }

    /// A ticket with nothing to wait for.
    pub fn done() -> Arc<Self> {
        Self::new(0)
    }

    /// One chunk finished; the first error is kept.
    pub fn complete(&self, res: Result<()>) {
        let mut s = self.state.lock().unwrap();
        if let Err(e) = res {
            s.error.get_or_insert(e);
        }
        s.pending -= 1;
        if s.pending == 0 {
            s.finished = Some(Instant::now());
            self.cv.notify_all();
        }
    }

    /// How long the transfer took, from the ticket's creation to its last chunk; None while
    /// chunks are in flight.
    pub fn elapsed(&self) -> Option<Duration> {
        let s = self.state.lock().unwrap();
        s.finished.map(|f| f - s.created)
    }

    pub fn is_done(&self) -> bool {
        self.state.lock().unwrap().pending == 0
    }

    /// The outcome once done, None while chunks are in flight.
    pub fn poll(&self) -> Option<Result<()>> {
        let s = self.state.lock().unwrap();
        (s.pending == 0).then(|| s.error.clone().map_or(Ok(()), Err))
    }

    /// Block until every chunk has completed; the first error, if any.
    pub fn wait(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        while s.pending > 0 {
            s = self.cv.wait(s).unwrap();
        }
        s.error.clone().map_or(Ok(()), Err)
    }
}

/// One chunk: at most `block_size` bytes between a buffer and a file offset.
pub struct IoReq {
    pub dir: Dir,
    pub file_off: u64,
    pub buf: *mut u8,
    pub len: usize,
    /// Index of the registered buffer that holds `buf`, if it is one.
    pub fixed: Option<u16>,
    pub ticket: Arc<Ticket>,
}

// Safety: `buf` points into memory the store keeps alive (arena or staging)
// until the ticket completes; no two in-flight requests share bytes for writing.
unsafe impl Send for IoReq {}

/// A device's request queue, whatever the engine behind it.
pub trait IoQueue: Send + Sync {
    fn submit(&self, reqs: Vec<IoReq>);
    fn name(&self) -> &'static str;
    /// Whether requests with `fixed` set use registered buffers.
    fn fixed_buffers(&self) -> bool {
        false
    }
}

fn io_error(req: &IoReq, path: &std::path::Path, done: usize, errno: i32) -> Error {
    Error::io(req.dir.op(), path, req.file_off + done as u64, (req.len - done) as u64, errno)
}

fn retryable(errno: i32) -> bool {
    matches!(errno, libc::EINTR | libc::EAGAIN | libc::EBUSY)
}

/// Shared by both engines: an optional bandwidth cap (benchmarks only) that
/// delays submission so the long-run rate stays below `bytes_per_sec`.
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

    fn pace(&self, len: usize) {
        let Some(inner) = &self.inner else { return };
        let wait = {
            let mut free_at = inner.lock().unwrap();
            let now = Instant::now();
            let start = (*free_at).max(now);
            *free_at = start + std::time::Duration::from_secs_f64(len as f64 / self.bytes_per_sec);
            start.saturating_duration_since(now)
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

// ---------------------------------------------------------------- io_uring

pub struct UringQueue {
    tx: Option<crossbeam_channel::Sender<Vec<IoReq>>>,
    thread: Option<JoinHandle<()>>,
    fixed: bool,
}

impl UringQueue {
    /// Set up a ring of `depth` entries for `fd`. `buffers` are registered as
    /// fixed buffers when the kernel allows it; `notices` says when it does not.
    pub fn new(
        fd: RawFd,
        path: PathBuf,
        depth: u32,
        buffers: &[(*mut u8, usize)],
        throttle: Throttle,
        notices: &mut Vec<String>,
    ) -> std::io::Result<Self> {
        let ring = io_uring::IoUring::new(depth.next_power_of_two())?;
        let mut fixed = false;
        if !buffers.is_empty() {
            let iov: Vec<libc::iovec> =
                buffers.iter().map(|&(p, l)| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: l }).collect();
            // Safety: the buffers live in the arena, which outlives the ring: the
            // store drops its queues (joining this thread and closing the ring) before the arena.
            match unsafe { ring.submitter().register_buffers(&iov) } {
                Ok(()) => fixed = true,
                Err(e) => notices.push(format!(
                    "cannot register the host arena with io_uring ({e}); using unregistered buffers \
                     (raise RLIMIT_MEMLOCK, `ulimit -l`, to enable fixed buffers)"
                )),
            }
        }
        let (tx, rx) = crossbeam_channel::unbounded::<Vec<IoReq>>();
        let thread = std::thread::Builder::new()
            .name("ssdtier-uring".into())
            .spawn(move || uring_worker(ring, fd, path, rx, depth as usize, fixed, throttle))
            .map_err(std::io::Error::other)?;
        Ok(UringQueue { tx: Some(tx), thread: Some(thread), fixed })
    }
}

impl IoQueue for UringQueue {
    fn submit(&self, reqs: Vec<IoReq>) {
        if let Some(tx) = &self.tx {
            // The worker only stops when the sender is dropped, so this cannot fail.
            let _ = tx.send(reqs);
        }
    }
    fn name(&self) -> &'static str {
        "io_uring"
    }
    fn fixed_buffers(&self) -> bool {
        self.fixed
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

struct InFlight {
    req: IoReq,
    done: usize,
}

fn uring_worker(
    mut ring: io_uring::IoUring,
    fd: RawFd,
    path: PathBuf,
    rx: crossbeam_channel::Receiver<Vec<IoReq>>,
    depth: usize,
    fixed: bool,
    throttle: Throttle,
) {
    use io_uring::{opcode, types};
    // user_data indexes this slab; no allocation per I/O once it has grown to `depth`.
    let mut slab: Vec<Option<InFlight>> = Vec::with_capacity(depth);
    let mut free_slots: Vec<usize> = Vec::with_capacity(depth);
    // Requests not yet in the ring (more than `depth` in flight, or a retry), in order.
    let mut backlog: VecDeque<InFlight> = VecDeque::new();
    let mut inflight = 0usize;
    let mut open = true;

    loop {
        if inflight == 0 && backlog.is_empty() {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(v) => backlog.extend(v.into_iter().map(|req| InFlight { req, done: 0 })),
                Err(_) => return,
            }
        }
        while open {
            match rx.try_recv() {
                Ok(v) => backlog.extend(v.into_iter().map(|req| InFlight { req, done: 0 })),
                Err(crossbeam_channel::TryRecvError::Empty) => break,
                Err(crossbeam_channel::TryRecvError::Disconnected) => open = false,
            }
        }

        let mut pushed = 0;
        while inflight < depth {
            let Some(op) = backlog.pop_front() else { break };
            let remaining = op.req.len - op.done;
            throttle.pace(remaining);
            // Safety: `buf + done .. buf + len` lies in the arena or a staging
            // buffer that the store keeps alive, untouched by others, until the ticket completes.
            let ptr = unsafe { op.req.buf.add(op.done) };
            let off = op.req.file_off + op.done as u64;
            let len = remaining as u32;
            let idx = free_slots.pop().unwrap_or_else(|| {
                slab.push(None);
                slab.len() - 1
            });
            let entry = match (op.req.dir, op.req.fixed.filter(|_| fixed)) {
                (Dir::Write, Some(b)) => opcode::WriteFixed::new(types::Fd(fd), ptr, len, b).offset(off).build(),
                (Dir::Read, Some(b)) => opcode::ReadFixed::new(types::Fd(fd), ptr, len, b).offset(off).build(),
                (Dir::Write, None) => opcode::Write::new(types::Fd(fd), ptr, len).offset(off).build(),
                (Dir::Read, None) => opcode::Read::new(types::Fd(fd), ptr, len).offset(off).build(),
            }
            .user_data(idx as u64);
            // Safety: the buffer outlives the op (see above); the slab slot keeps the request.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                // Submission queue full: keep it for the next round.
                free_slots.push(idx);
                backlog.push_front(op);
                break;
            }
            slab[idx] = Some(op);
            inflight += 1;
            pushed += 1;
        }

        if inflight == 0 {
            continue;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
            Err(e) => {
                // The ring itself failed: fail everything not yet submitted and in flight.
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                let _ = pushed;
                for op in backlog.drain(..) {
                    op.req.ticket.complete(Err(io_error(&op.req, &path, op.done, errno)));
                }
                for op in slab.iter_mut().filter_map(Option::take) {
                    op.req.ticket.complete(Err(io_error(&op.req, &path, op.done, errno)));
                }
                inflight = 0;
                free_slots = (0..slab.len()).collect();
                continue;
            }
        }
        let cqes: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (ud, res) in cqes {
            let idx = ud as usize;
            let Some(mut op) = slab[idx].take() else { continue };
            free_slots.push(idx);
            inflight -= 1;
            if res < 0 {
                let errno = -res;
                if retryable(errno) {
                    backlog.push_front(op);
                } else {
                    let err = io_error(&op.req, &path, op.done, errno);
                    op.req.ticket.complete(Err(err));
                }
            } else if res == 0 && op.req.len > op.done {
                // Zero bytes moved: end of file on read, no progress on write.
                let errno = if op.req.dir == Dir::Read { libc::EIO } else { libc::ENOSPC };
                let err = io_error(&op.req, &path, op.done, errno);
                op.req.ticket.complete(Err(err));
            } else {
                op.done += res as usize;
                if op.done < op.req.len {
                    // Short transfer: resubmit the rest first.
                    backlog.push_front(op);
                } else {
                    op.req.ticket.complete(Ok(()));
                }
            }
        }
    }
}

// ---------------------------------------------------------------- POSIX

/// A pool of threads doing pread/pwrite: the fallback where io_uring is not available.
pub struct PosixQueue {
    tx: Option<crossbeam_channel::Sender<IoReq>>,
    threads: Vec<JoinHandle<()>>,
}

impl PosixQueue {
    pub fn new(fd: RawFd, path: PathBuf, threads: usize, throttle: Throttle) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<IoReq>();
        let path = Arc::new(path);
        let mut handles = Vec::new();
        for _ in 0..threads.max(1) {
            let rx = rx.clone();
            let path = path.clone();
            let throttle = throttle.clone();
            handles.push(
                std::thread::Builder::new()
                    .name("ssdtier-posix".into())
                    .spawn(move || {
                        for req in rx.iter() {
                            throttle.pace(req.len);
                            let res = posix_transfer(fd, &req, &path);
                            req.ticket.complete(res);
                        }
                    })
                    .map_err(std::io::Error::other)?,
            );
        }
        Ok(PosixQueue { tx: Some(tx), threads: handles })
    }
}

fn posix_transfer(fd: RawFd, req: &IoReq, path: &std::path::Path) -> Result<()> {
    let mut done = 0usize;
    let mut zero_rounds = 0;
    while done < req.len {
        // Safety: the buffer range is valid and reserved for this request until its ticket completes.
        let n = unsafe {
            let p = req.buf.add(done) as *mut libc::c_void;
            let off = (req.file_off + done as u64) as libc::off_t;
            match req.dir {
                Dir::Read => libc::pread(fd, p, req.len - done, off),
                Dir::Write => libc::pwrite(fd, p, req.len - done, off),
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if retryable(errno) {
                continue;
            }
            return Err(io_error(req, path, done, errno));
        }
        if n == 0 {
            zero_rounds += 1;
            if zero_rounds > 3 {
                let errno = if req.dir == Dir::Read { libc::EIO } else { libc::ENOSPC };
                return Err(io_error(req, path, done, errno));
            }
            continue;
        }
        done += n as usize;
    }
    Ok(())
}

impl IoQueue for PosixQueue {
    fn submit(&self, reqs: Vec<IoReq>) {
        if let Some(tx) = &self.tx {
            for r in reqs {
                let _ = tx.send(r);
            }
        }
    }
    fn name(&self) -> &'static str {
        "posix"
    }
}

impl Drop for PosixQueue {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
