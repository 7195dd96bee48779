//! The I/O engines on a real O_DIRECT file: round trips over many sizes and
//! offsets, many tickets in flight, a full submission queue, and parity
//! between io_uring and the POSIX pool.

mod common;
use common::*;
use ssdtier_core::device::DeviceFile;
use ssdtier_core::engine::{Dir, IoQueue, IoReq, PosixQueue, Throttle, UringQueue};
use ssdtier_core::Ticket;
use std::sync::Arc;

fn queues(dir: &std::path::Path, depth: u32, fixed: &[(*mut u8, usize)]) -> Vec<(DeviceFile, Box<dyn IoQueue>)> {
    let mut out: Vec<(DeviceFile, Box<dyn IoQueue>)> = Vec::new();
    let mut notes = Vec::new();
    let f = DeviceFile::open(&dir.join("uring"), true, &mut notes).unwrap();
    assert!(f.direct, "{notes:?}");
    // Safety: the file and the fixed buffers outlive the queue (the tests drop queues first).
    let q = unsafe { UringQueue::new(f.raw_fd(), dir.into(), depth, fixed, Throttle::new(0), &mut notes) }.unwrap();
    out.push((f, Box::new(q)));
    let f = DeviceFile::open(&dir.join("posix"), true, &mut notes).unwrap();
    // Safety: as above.
    let q = unsafe { PosixQueue::new(f.raw_fd(), dir.into(), 4, Throttle::new(0)) }.unwrap();
    out.push((f, Box::new(q)));
    out
}

/// A request; the tests keep `buf` alive and untouched until `t` is done.
fn one(dir: Dir, buf: *mut u8, len: usize, off: u64, fixed: Option<u16>, t: &Arc<Ticket>) -> IoReq {
    // Safety: every caller waits for `t` before its buffer goes.
    unsafe { IoReq::new(dir, off, buf, len, fixed, t.clone()) }
}

#[test]
fn round_trips_many_sizes_and_offsets() {
    let d = real_dir();
    for (_f, q) in queues(d.path(), 8, &[]) {
        let sizes = [4096usize, 8192, 12288, 65536, 1 << 20, 3 << 20];
        let mut off = 0u64;
        let mut placed = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let mut b = Aligned::new(len);
            b.slice_mut().copy_from_slice(&pattern(len, i as u64));
            let t = Ticket::new(1);
            q.submit(vec![one(Dir::Write, b.as_mut_ptr(), len, off, None, &t)]);
            t.wait().unwrap();
            placed.push((off, len, i));
            off += len as u64 + 4096 * (i as u64 + 1);
        }
        for (off, len, i) in placed {
            let b = Aligned::new(len);
            let t = Ticket::new(1);
            q.submit(vec![one(Dir::Read, b.as_mut_ptr(), len, off, None, &t)]);
            t.wait().unwrap();
            assert!(b.slice() == pattern(len, i as u64).as_slice(), "{} size {len} at {off}", q.name());
        }
    }
}

#[test]
fn many_tickets_in_flight_and_a_full_queue() {
    let d = real_dir();
    // Depth 2 with 512 requests: most wait in the backlog behind a full submission queue.
    for (_f, q) in queues(d.path(), 2, &[]) {
        let n = 512;
        let len = 8192;
        let mut src = Aligned::new(n * len);
        src.slice_mut().copy_from_slice(&pattern(n * len, 7));
        let tickets: Vec<Arc<Ticket>> = (0..n).map(|_| Ticket::new(1)).collect();
        let reqs = (0..n)
            // Safety: inside src.
            .map(|i| {
                one(Dir::Write, unsafe { src.as_mut_ptr().add(i * len) }, len, (i * len) as u64, None, &tickets[i])
            })
            .collect();
        q.submit(reqs);
        for t in &tickets {
            t.wait().unwrap();
        }
        let dst = Aligned::new(n * len);
        let t = Ticket::new(n);
        // One ticket for all: done only when every chunk is.
        let reqs = (0..n)
            // Safety: inside dst.
            .map(|i| one(Dir::Read, unsafe { dst.as_mut_ptr().add(i * len) }, len, (i * len) as u64, None, &t))
            .collect();
        q.submit(reqs);
        t.wait().unwrap();
        assert!(t.is_done());
        assert!(dst.slice() == src.slice(), "{}", q.name());
    }
}

#[test]
fn fixed_buffers_round_trip() {
    let d = real_dir();
    let mut buf = Aligned::new(4 << 20);
    let fixed = [(buf.as_mut_ptr(), 4 << 20)];
    let mut notes = Vec::new();
    let f = DeviceFile::open(d.path(), true, &mut notes).unwrap();
    // Safety: the file and buf outlive the queue.
    let q = unsafe { UringQueue::new(f.raw_fd(), d.path().into(), 16, &fixed, Throttle::new(0), &mut notes) }.unwrap();
    // 4 MiB is under the default RLIMIT_MEMLOCK (8 MiB): registration must work here.
    assert!(q.fixed_buffers(), "{notes:?}");
    buf.slice_mut().copy_from_slice(&pattern(4 << 20, 3));
    let t = Ticket::new(4);
    // Safety: four 1 MiB pieces of buf.
    let reqs = (0..4)
        .map(|i| one(Dir::Write, unsafe { buf.as_mut_ptr().add(i << 20) }, 1 << 20, (i as u64) << 20, Some(0), &t))
        .collect();
    q.submit(reqs);
    t.wait().unwrap();
    buf.slice_mut().fill(0);
    let t = Ticket::new(1);
    q.submit(vec![one(Dir::Read, buf.as_mut_ptr(), 4 << 20, 0, Some(0), &t)]);
    t.wait().unwrap();
    assert!(buf.slice() == pattern(4 << 20, 3).as_slice());
    // The kernel really checks requests against the registered buffer: memory outside it is refused.
    let outside = Aligned::new(4096);
    let t = Ticket::new(1);
    q.submit(vec![one(Dir::Read, outside.as_mut_ptr(), 4096, 0, Some(0), &t)]);
    assert_eq!(t.wait().unwrap_err().errno(), Some(libc::EFAULT));
}

#[test]
fn errors_carry_op_path_and_offset() {
    let d = real_dir();
    for (_f, q) in queues(d.path(), 4, &[]) {
        // A misaligned length on an O_DIRECT file is refused by the kernel (EINVAL).
        let b = Aligned::new(8192);
        let t = Ticket::new(1);
        q.submit(vec![one(Dir::Write, b.as_mut_ptr(), 100, 4096, None, &t)]);
        let err = t.wait().unwrap_err();
        assert_eq!(err.errno(), Some(libc::EINVAL), "{}: {err}", q.name());
        let msg = err.to_string();
        assert!(msg.starts_with("write of 100 bytes at offset 4096 in "), "{msg}");
        assert!(msg.contains(&d.path().display().to_string()), "{msg}");
        assert!(msg.contains("O_DIRECT"), "{msg}");
        // Reading beyond the end of the file is an error, not silent zeros.
        let t = Ticket::new(1);
        q.submit(vec![one(Dir::Read, b.as_mut_ptr(), 4096, 1 << 30, None, &t)]);
        assert_eq!(t.wait().unwrap_err().errno(), Some(libc::EIO), "{}", q.name());
    }
}

#[test]
fn throttle_caps_bandwidth() {
    let d = real_dir();
    let mut notes = Vec::new();
    let f = DeviceFile::open(d.path(), true, &mut notes).unwrap();
    // 8 MiB at 64 MiB/s takes at least ~110 ms (the first block goes at once).
    // Safety: the file outlives the queue.
    let q = unsafe { PosixQueue::new(f.raw_fd(), d.path().into(), 2, Throttle::new(64 << 20)) }.unwrap();
    let b = Aligned::new(8 << 20);
    let t0 = std::time::Instant::now();
    let t = Ticket::new(8);
    assert!(t.elapsed().is_none(), "in flight: no duration yet");
    // Safety: inside b.
    let reqs = (0..8)
        .map(|i| one(Dir::Write, unsafe { b.as_mut_ptr().add(i << 20) }, 1 << 20, (i as u64) << 20, None, &t))
        .collect();
    q.submit(reqs);
    t.wait().unwrap();
    let wall = t0.elapsed();
    // A lower bound only: the cap may never be exceeded; being slower is allowed.
    assert!(wall >= std::time::Duration::from_millis(100), "{wall:?}");
    // The ticket's own duration covers the same transfer, and no more than the wait for it.
    let took = t.elapsed().expect("done");
    assert!(took >= std::time::Duration::from_millis(100) && took <= wall, "{took:?} vs {wall:?}");
    assert_eq!(Ticket::done().elapsed(), Some(std::time::Duration::ZERO));
}

/// A queue on a FIFO, whose reads stay in the kernel until bytes are written to it, and two
/// buffers that outlive the queue. Dropping it fills the FIFO first, so that the queue can be
/// joined even after a failed assertion.
struct FifoQueue {
    q: UringQueue,
    bufs: [Aligned; 2],
    pipe: std::os::fd::OwnedFd,
    _dir: tempfile::TempDir,
}

impl FifoQueue {
    fn new() -> Self {
        use std::os::fd::{AsRawFd, FromRawFd};
        use std::os::unix::ffi::OsStrExt;
        let dir = real_dir();
        let path = std::ffi::CString::new(dir.path().join("fifo").as_os_str().as_bytes()).unwrap();
        // Safety: a valid C string; results checked; the fd is owned at once.
        let pipe = unsafe {
            assert_eq!(libc::mkfifo(path.as_ptr(), 0o600), 0);
            let fd = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            assert!(fd >= 0);
            std::os::fd::OwnedFd::from_raw_fd(fd)
        };
        let bufs = [Aligned::new(4096), Aligned::new(4096)];
        // Safety: the FIFO and the buffers outlive the queue (field order); no fixed buffers.
        let q =
            unsafe { UringQueue::new(pipe.as_raw_fd(), dir.path().into(), 8, &[], Throttle::new(0), &mut Vec::new()) }
                .unwrap();
        FifoQueue { q, bufs, pipe, _dir: dir }
    }

    fn write(&self, data: &[u8]) {
        use std::os::fd::AsRawFd;
        // Safety: a write from a live buffer to the FIFO.
        assert_eq!(
            unsafe { libc::write(self.pipe.as_raw_fd(), data.as_ptr().cast(), data.len()) },
            data.len() as isize
        );
    }
}

impl Drop for FifoQueue {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let bytes = [0u8; 16384];
        // Safety: a write from a live buffer to the FIFO, still open.
        unsafe { libc::write(self.pipe.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
    }
}

#[test]
fn a_failed_ring_waits_for_what_the_kernel_holds() {
    use std::os::fd::AsRawFd;
    use std::time::Duration;
    let f = FifoQueue::new();
    let (q, [held, other]) = (&f.q, &f.bufs);
    let t1 = Ticket::new(1);
    // Offset -1: the FIFO's current position (it has no other).
    q.submit(vec![one(Dir::Read, held.as_mut_ptr(), 4096, u64::MAX, None, &t1)]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!t1.is_done());
    // Break the ring: its descriptor now names /dev/null, so every io_uring_enter fails, while the
    // ring's memory (and the read in it) lives on.
    let null = std::fs::File::open("/dev/null").unwrap();
    // Safety: dup2 between two descriptors this test owns.
    assert!(unsafe { libc::dup2(null.as_raw_fd(), q.ring_fd()) } >= 0);
    let t2 = Ticket::new(1);
    q.submit(vec![one(Dir::Read, other.as_mut_ptr(), 4096, u64::MAX, None, &t2)]);
    // The request that never reached the kernel fails at once, and the queue says why.
    let err = t2.wait_timeout(Duration::from_secs(3)).expect("refused").unwrap_err();
    assert!(matches!(err, ssdtier_core::Error::EngineFailed { .. }), "{err}");
    assert!(q.failure().is_some_and(|w| w.contains("ring failed")), "{:?}", q.failure());
    // The read the kernel holds is not completed on its behalf: its buffer is still the kernel's.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!t1.is_done(), "completed while the kernel still holds its buffer");
    let data = pattern(4096, 11);
    f.write(&data);
    // Its completion still arrives, through the completion queue's memory.
    t1.wait_timeout(Duration::from_secs(3)).expect("the kernel's completion arrives").unwrap();
    assert!(held.slice() == data.as_slice());
    // New work is refused at once.
    let t3 = Ticket::new(1);
    q.submit(vec![one(Dir::Read, other.as_mut_ptr(), 4096, u64::MAX, None, &t3)]);
    assert!(t3.poll().is_some_and(|r| r.is_err()));
}

#[test]
fn a_request_waiting_behind_a_slow_one_starts_at_once() {
    use std::time::Duration;
    let f = FifoQueue::new();
    let (q, [a, b]) = (&f.q, &f.bufs);
    let slow = Ticket::new(1);
    q.submit(vec![one(Dir::Read, a.as_mut_ptr(), 4096, u64::MAX, None, &slow)]);
    std::thread::sleep(Duration::from_millis(100));
    // The engine waits in the ring for the slow read; a write submitted now must not wait for it.
    let t = Ticket::new(1);
    q.submit(vec![one(Dir::Write, b.as_mut_ptr(), 4096, u64::MAX, None, &t)]);
    t.wait_timeout(Duration::from_secs(3)).expect("the write was not held back").unwrap();
    // The write filled the FIFO, so the slow read completes with its bytes.
    slow.wait_timeout(Duration::from_secs(3)).expect("read").unwrap();
}
