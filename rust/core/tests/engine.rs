//! The I/O engines on a real O_DIRECT file: round trips over many sizes and
//! offsets, many tickets in flight, a full submission queue, and parity
//! between io_uring and the POSIX pool.

mod common;
use common::*;
use ssdtier_core::device::DeviceFile;
use ssdtier_core::engine::{Dir, IoQueue, IoReq, PosixQueue, Throttle, Ticket, UringQueue};
use std::sync::Arc;

fn queues(dir: &std::path::Path, depth: u32, fixed: &[(*mut u8, usize)]) -> Vec<(DeviceFile, Box<dyn IoQueue>)> {
    let mut out: Vec<(DeviceFile, Box<dyn IoQueue>)> = Vec::new();
    let mut notes = Vec::new();
    let f = DeviceFile::open(&dir.join("uring"), true, &mut notes).unwrap();
    assert!(f.direct, "{notes:?}");
    let q = UringQueue::new(f.raw_fd(), dir.into(), depth, fixed, Throttle::new(0), &mut notes).unwrap();
    out.push((f, Box::new(q)));
    let f = DeviceFile::open(&dir.join("posix"), true, &mut notes).unwrap();
    let q = PosixQueue::new(f.raw_fd(), dir.into(), 4, Throttle::new(0)).unwrap();
    out.push((f, Box::new(q)));
    out
}

fn one(dir: Dir, buf: *mut u8, len: usize, off: u64, fixed: Option<u16>, t: &Arc<Ticket>) -> IoReq {
    IoReq { dir, file_off: off, buf, len, fixed, ticket: t.clone() }
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
    let q = UringQueue::new(f.raw_fd(), d.path().into(), 16, &fixed, Throttle::new(0), &mut notes).unwrap();
    if !q.fixed_buffers() {
        // Registration refused (RLIMIT_MEMLOCK): the notice must say so.
        assert!(notes.iter().any(|n| n.contains("register")), "{notes:?}");
    }
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
    let q = PosixQueue::new(f.raw_fd(), d.path().into(), 2, Throttle::new(64 << 20)).unwrap();
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
