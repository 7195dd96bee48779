//! The POSIX engine: a pool of threads doing pread/pwrite, where io_uring is not available.

use super::{refuse, Dir, IoQueue, IoReq, Next, Op, Throttle};
use crossbeam_channel::{select_biased, Receiver, Sender};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct PosixQueue {
    /// Reads and writes apart: a thread takes a read first when both wait.
    reads: Option<Sender<IoReq>>,
    writes: Option<Sender<IoReq>>,
    threads: Vec<JoinHandle<()>>,
    path: PathBuf,
}

impl PosixQueue {
    /// # Safety
    /// `fd` must stay open until this queue is dropped.
    pub unsafe fn new(fd: RawFd, path: PathBuf, threads: usize, throttle: Throttle) -> std::io::Result<Self> {
        let (rtx, rrx) = crossbeam_channel::unbounded::<IoReq>();
        let (wtx, wrx) = crossbeam_channel::unbounded::<IoReq>();
        let shared = Arc::new(path.clone());
        let mut handles = Vec::new();
        for _ in 0..threads.max(1) {
            let (rrx, wrx, path, throttle) = (rrx.clone(), wrx.clone(), shared.clone(), throttle.clone());
            handles.push(
                std::thread::Builder::new()
                    .name("ssdtier-posix".into())
                    .spawn(move || serve(fd, &path, rrx, wrx, throttle))
                    .map_err(std::io::Error::other)?,
            );
        }
        Ok(PosixQueue { reads: Some(rtx), writes: Some(wtx), threads: handles, path })
    }
}

fn serve(fd: RawFd, path: &Path, reads: Receiver<IoReq>, writes: Receiver<IoReq>, throttle: Throttle) {
    loop {
        let req = select_biased! {
            recv(reads) -> r => r,
            recv(writes) -> w => w,
        };
        // Both senders go together when the queue is dropped.
        let Ok(req) = req else { return };
        throttle.pace(req.len());
        transfer(fd, Op::new(req), path);
    }
}

fn transfer(fd: RawFd, mut op: Op, path: &Path) {
    loop {
        let (ptr, off, len) = op.next_piece();
        // Safety: the piece lies in the request's buffer, which is valid and reserved for it
        // until its ticket completes (IoReq::new's contract).
        let n = unsafe {
            match op.req.dir() {
                Dir::Read => libc::pread(fd, ptr as *mut libc::c_void, len, off as libc::off_t),
                Dir::Write => libc::pwrite(fd, ptr as *const libc::c_void, len, off as libc::off_t),
            }
        };
        let res = if n < 0 {
            -(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) as i64)
        } else {
            n as i64
        };
        match op.advance(res, path) {
            Next::Finished => return,
            Next::Again(o) => {
                op = o;
                if op.stalls() > 0 {
                    std::thread::sleep(Duration::from_micros(100 << op.stalls().min(7)));
                }
            }
        }
    }
}

impl IoQueue for PosixQueue {
    fn submit(&self, reqs: Vec<IoReq>) {
        for r in reqs {
            let tx = if r.dir() == Dir::Read { &self.reads } else { &self.writes };
            match tx {
                Some(tx) => {
                    if let Err(e) = tx.send(r) {
                        refuse(vec![e.0], &self.path, "its threads have stopped");
                    }
                }
                None => refuse(vec![r], &self.path, "it is closed"),
            }
        }
    }
    fn name(&self) -> &'static str {
        "posix"
    }
}

impl Drop for PosixQueue {
    fn drop(&mut self) {
        self.reads.take();
        self.writes.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
