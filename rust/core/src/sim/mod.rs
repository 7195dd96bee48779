//! Testing the store like a database: a simulated device behind the same
//! trait as io_uring and POSIX, which completes requests out of order, short,
//! with EAGAIN, EIO or ENOSPC, or fails its whole "ring"; and a seeded
//! workload that checks every byte the store returns against a model
//! (`workload`). Without a background thread the simulation moves only when a
//! waiter drives it, so one seed on one thread replays exactly.

mod rng;
mod workload;

pub use rng::Rng;
pub use workload::{run, Outcome, Workload};

use crate::engine::{refuse, Dir, IoQueue, IoReq, Next, Op};
use crate::error::Error;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// Faults and pace of a simulated device. Probabilities are per kernel result.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub seed: u64,
    pub p_eio: f64,
    /// On writes only.
    pub p_enospc: f64,
    pub p_short: f64,
    pub p_again: f64,
    /// The ring fails once this many requests have been accepted.
    pub fail_after: Option<u64>,
    /// When the ring fails, the requests in the "kernel" are abandoned at once and their
    /// bytes land later, at random (true), or come back with their results (false).
    pub abandon: bool,
    /// A background thread completes requests after random delays up to this.
    pub threaded: Option<Duration>,
}

impl SimConfig {
    /// A device with no faults, moved only by waiters.
    pub fn quiet(seed: u64) -> Self {
        SimConfig {
            seed,
            p_eio: 0.0,
            p_enospc: 0.0,
            p_short: 0.0,
            p_again: 0.0,
            fail_after: None,
            abandon: false,
            threaded: None,
        }
    }
}

/// A transfer abandoned while "in the kernel": its bytes still move, later.
struct Late {
    dir: Dir,
    buf: *mut u8,
    off: u64,
    len: usize,
}

// Safety: the memory of an abandoned transfer is never reused by the store (the contract of
// an abandoned IoReq), so moving bytes there from any thread is what a late kernel does.
unsafe impl Send for Late {}

struct State {
    rng: Rng,
    cfg: SimConfig,
    disk: Vec<u8>,
    kernel: Vec<Op>,
    late: Vec<Late>,
    accepted: u64,
    failed: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
    path: PathBuf,
}

pub struct SimQueue {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl SimQueue {
    pub fn new(path: PathBuf, cfg: SimConfig) -> Self {
        let threaded = cfg.threaded;
        let state = State {
            rng: Rng::new(cfg.seed),
            cfg,
            disk: Vec::new(),
            kernel: Vec::new(),
            late: Vec::new(),
            accepted: 0,
            failed: None,
        };
        let shared =
            Arc::new(Shared { state: Mutex::new(state), wake: Condvar::new(), stop: AtomicBool::new(false), path });
        let thread = threaded.map(|max| {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("ssdtier-sim".into())
                .spawn(move || background(&shared, max))
                .expect("a thread for the simulated device")
        });
        SimQueue { shared, thread }
    }

    /// Bytes of the simulated file (for tests).
    pub fn file_len(&self) -> usize {
        self.shared.lock().disk.len()
    }

    /// Its file, for the workload to move bytes outside the store as cuFile does.
    fn file(&self) -> SimFile {
        SimFile(self.shared.clone())
    }
}

/// A simulated device's file, read and written directly (not through its queue).
struct SimFile(Arc<Shared>);

impl SimFile {
    fn write(&self, off: u64, src: &[u8]) {
        write_file(&mut self.0.lock().disk, off as usize, src);
    }

    fn read(&self, off: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        read_file(&self.0.lock().disk, off as usize, &mut out);
        out
    }
}

fn write_file(disk: &mut Vec<u8>, off: usize, src: &[u8]) {
    if disk.len() < off + src.len() {
        disk.resize(off + src.len(), 0);
    }
    disk[off..off + src.len()].copy_from_slice(src);
}

/// A hole, or the space past the file's end (preallocated, as the store's files are by default),
/// reads as zeros. An external write may end the file mid-block.
fn read_file(disk: &[u8], off: usize, dst: &mut [u8]) {
    let file = disk.get(off..).unwrap_or_default();
    let have = file.len().min(dst.len());
    dst[..have].copy_from_slice(&file[..have]);
    dst[have..].fill(0);
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One step: a late transfer lands, or one request in the kernel gets a result.
    fn step(&self) -> bool {
        let mut g = self.lock();
        let s = &mut *g;
        if !s.late.is_empty() && (s.kernel.is_empty() || s.rng.chance(0.2)) {
            let i = s.rng.below(s.late.len() as u64) as usize;
            let l = s.late.swap_remove(i);
            s.transfer(l.dir, l.buf, l.off, l.len);
            return true;
        }
        if s.kernel.is_empty() {
            return false;
        }
        let i = s.rng.below(s.kernel.len() as u64) as usize;
        let op = s.kernel.swap_remove(i);
        let res = s.result(&op);
        match op.advance(res, &self.path) {
            Next::Finished => {}
            Next::Again(op) => match s.failed.clone() {
                // The rest of a short transfer cannot be submitted to a failed ring.
                Some(why) => refuse(vec![op.req], &self.path, &why),
                None => s.kernel.push(op),
            },
        }
        true
    }
}

impl State {
    /// The kernel's result for the next piece of `op`, moving its bytes.
    fn result(&mut self, op: &Op) -> i64 {
        let (ptr, off, len) = op.next_piece();
        let dir = op.req.dir();
        let c = self.cfg.clone();
        let r = self.rng.unit();
        let mut acc = 0.0;
        let mut hit = |p: f64| {
            acc += p;
            r < acc
        };
        if hit(c.p_again) {
            return -(libc::EAGAIN as i64);
        }
        if hit(c.p_eio) {
            return -(libc::EIO as i64);
        }
        if dir == Dir::Write && hit(c.p_enospc) {
            return -(libc::ENOSPC as i64);
        }
        let n = if len > 1 && hit(c.p_short) { 1 + self.rng.below(len as u64 - 1) as usize } else { len };
        self.transfer(dir, ptr, off, n);
        n as i64
    }

    fn transfer(&mut self, dir: Dir, buf: *mut u8, off: u64, len: usize) {
        match dir {
            // Safety: the request's buffer holds `len` bytes from here (IoReq::new's contract).
            Dir::Write => write_file(&mut self.disk, off as usize, unsafe { std::slice::from_raw_parts(buf, len) }),
            // Safety: as above, for writes into the buffer.
            Dir::Read => read_file(&self.disk, off as usize, unsafe { std::slice::from_raw_parts_mut(buf, len) }),
        }
    }

    /// The ring fails: what the kernel holds is abandoned (its bytes land later) or left to
    /// come back with its results.
    fn fail(&mut self, path: &std::path::Path) {
        let why = "its simulated ring failed".to_string();
        self.failed = Some(why.clone());
        if self.cfg.abandon {
            for op in std::mem::take(&mut self.kernel) {
                let (buf, off, len) = op.next_piece();
                self.late.push(Late { dir: op.req.dir(), buf, off, len });
                op.req.abandon(Error::EngineFailed { path: path.to_path_buf(), detail: why.clone() });
            }
        }
    }
}

fn background(shared: &Shared, max: Duration) {
    let mut rng = Rng::new(shared.lock().cfg.seed ^ 0x5eed);
    while !shared.stop.load(Ordering::Acquire) {
        if !shared.step() {
            let g = shared.lock();
            let _ = shared.wake.wait_timeout(g, Duration::from_millis(5));
            continue;
        }
        let nap = rng.below(max.as_micros() as u64 + 1);
        if nap > 0 {
            std::thread::sleep(Duration::from_micros(nap));
        }
    }
}

impl IoQueue for SimQueue {
    fn submit(&self, reqs: Vec<IoReq>) {
        let mut s = self.shared.lock();
        if let Some(why) = s.failed.clone() {
            drop(s);
            return refuse(reqs, &self.shared.path, &why);
        }
        s.accepted += reqs.len() as u64;
        let fail_now = s.cfg.fail_after.is_some_and(|n| s.accepted > n);
        s.kernel.extend(reqs.into_iter().map(Op::new));
        if fail_now {
            s.fail(&self.shared.path);
        }
        drop(s);
        self.shared.wake.notify_all();
    }
    fn name(&self) -> &'static str {
        "sim"
    }
    fn failure(&self) -> Option<String> {
        self.shared.lock().failed.clone()
    }
    fn drive(&self) -> bool {
        self.shared.step()
    }
}

impl Drop for SimQueue {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // What is still in the "kernel" finishes, and late bytes land, before the memory goes.
        while self.shared.step() {}
    }
}
