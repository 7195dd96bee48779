//! The store under faults and races, on simulated devices where a fault can be
//! forced: failed writes and reads, a full file system, a failed ring, and
//! calls racing each other.

mod common;
use common::*;
use ssdtier_core::sim::{SimConfig, SimQueue};
use ssdtier_core::{DeviceConfig, Error, Store, StoreConfig};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn sim_store(host: u64, sims: Vec<SimConfig>) -> Store {
    let cfg = StoreConfig {
        host_capacity: host,
        devices: (0..sims.len())
            .map(|i| DeviceConfig { path: format!("/sim/{i}").into(), capacity: 64 << 20 })
            .collect(),
        block_size: 64 << 10,
        ..Default::default()
    };
    let queues = cfg
        .devices
        .iter()
        .zip(sims)
        .map(|(d, s)| Box::new(SimQueue::new(d.path.clone(), s)) as Box<dyn ssdtier_core::engine::IoQueue>)
        .collect();
    Store::with_queues(cfg, queues, "sim").unwrap()
}

fn put(s: &Store, data: &[u8]) -> u64 {
    s.put_with(data.len() as u64, &mut |off, dst| dst.copy_from_slice(&data[off as usize..off as usize + dst.len()]))
        .unwrap()
}

fn read(s: &Store, key: u64) -> ssdtier_core::Result<Vec<u8>> {
    let mut out = vec![0u8; s.len_of(key)? as usize];
    s.read_staged_with(key, &mut |off, b| out[off as usize..off as usize + b.len()].copy_from_slice(b))?;
    Ok(out)
}

/// Counts its drops: stands for a caller's buffer object.
struct Owner(Arc<AtomicUsize>);
impl Drop for Owner {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_failed_zero_copy_write_leaves_an_entry_that_cannot_be_read() {
    let mut sim = SimConfig::quiet(1);
    sim.p_eio = 1.0;
    let s = sim_store(1 << 20, vec![sim]);
    let src = Aligned::new(8192);
    // Safety: src is aligned and outlives the ticket (waited below).
    let (k, t) = unsafe { s.write_from(src.as_mut_ptr(), 8192, None) }.unwrap();
    assert_eq!(s.wait(&t).unwrap_err().errno(), Some(libc::EIO));
    // Never written: a read must fail, not return whatever the file holds there.
    let dst = Aligned::new(8192);
    // Safety: dst is aligned, large enough, and outlives the call (which fails).
    let err = unsafe { s.read_into(k, dst.as_mut_ptr(), dst.len() as u64, None) }.err().unwrap();
    assert!(err.to_string().contains("has no bytes"), "{err}");
    assert!(read(&s, k).unwrap_err().to_string().contains("has no bytes"));
    assert!(s.acquire(k).unwrap_err().to_string().contains("has no bytes"));
    s.free(k).unwrap();
    let st = s.stats();
    assert_eq!((st.entries, st.nvme_used, st.host_used), (0, 0, 0));
}

#[test]
fn a_full_file_system_takes_only_its_own_device_out() {
    let mut full = SimConfig::quiet(2);
    full.p_enospc = 1.0;
    let s = sim_store(0, vec![full, SimConfig::quiet(3)]);
    let data = pattern(64 << 10, 4);
    // Entries of one 64 KiB unit go to one device each, alternating: the first write that lands
    // on the full device fails, and it is left out from then on.
    let mut failed = 0;
    let mut keys = Vec::new();
    for _ in 0..6 {
        match s.put_with(data.len() as u64, &mut |_, dst| dst.copy_from_slice(&data)) {
            Ok(k) => keys.push(k),
            Err(e) => {
                assert_eq!(e.errno(), Some(libc::ENOSPC), "{e}");
                assert!(e.to_string().contains("/sim/0"), "the error names the full device: {e}");
                failed += 1;
            }
        }
    }
    assert_eq!(failed, 1, "after one ENOSPC only the other device is used");
    assert_eq!(s.stats().device_used, vec![0, keys.len() as u64 * (64 << 10)]);
    for k in keys {
        assert!(read(&s, k).unwrap() == data);
    }
}

#[test]
fn a_busy_entry_is_a_busy_error() {
    let s = sim_store(1 << 20, vec![SimConfig::quiet(5)]);
    let k = put(&s, &pattern(5000, 1));
    s.acquire(k).unwrap();
    assert!(matches!(s.free(k), Err(Error::Busy { .. })));
    assert!(matches!(s.evict(k), Err(Error::Busy { .. })));
    s.release(k).unwrap();
    s.evict(k).unwrap();
    let (k2, _) = s.reserve(100).unwrap();
    assert!(matches!(s.acquire(k2), Err(Error::Busy { .. })), "being filled");
    s.free(k2).unwrap();
    s.free(k).unwrap();
}

#[test]
fn a_failed_ring_stops_new_work_and_gives_everything_back() {
    let mut sim = SimConfig::quiet(6);
    sim.fail_after = Some(3);
    sim.abandon = true;
    let s = sim_store(64 << 10, vec![sim]);
    let data = pattern(16 << 10, 7);
    let mut keys = Vec::new();
    let mut failure = None;
    for _ in 0..20 {
        match s.put_with(data.len() as u64, &mut |_, dst| dst.copy_from_slice(&data)) {
            Ok(k) => keys.push(k),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
        for &k in &keys {
            if let Err(e) = s.evict(k) {
                failure = Some(e);
                break;
            }
        }
        if failure.is_some() {
            break;
        }
    }
    let err = failure.expect("the ring fails after three requests");
    assert_eq!(err.errno(), Some(libc::EIO), "{err}");
    // From now on: a clear error for new work, while free and stats still work.
    assert!(matches!(s.reserve(100), Err(Error::Failed(_))));
    assert!(matches!(s.prefetch(keys[0]), Err(Error::Failed(_))));
    let st = s.stats();
    assert!(st.failure.as_deref().is_some_and(|f| f.contains("simulated ring failed")), "{:?}", st.failure);
    for k in keys {
        s.free(k).unwrap();
    }
    let st = s.stats();
    assert_eq!(st.entries, 0);
    // What the kernel held when the ring failed is never handed out again, and nothing else is kept.
    assert!(st.quarantined_bytes > 0);
    assert_eq!(st.host_used + st.nvme_used, st.quarantined_bytes);
    s.close().unwrap();
}

#[test]
fn zero_copy_tickets_keep_the_caller_memory_alive() {
    let mut sim = SimConfig::quiet(8);
    sim.threaded = Some(Duration::from_millis(2));
    let s = sim_store(1 << 20, vec![sim]);
    let drops = Arc::new(AtomicUsize::new(0));
    let src = Aligned::new(64 << 10);
    // Safety: src lives until the end of the test, past the ticket.
    let (k, t) = unsafe { s.write_from(src.as_mut_ptr(), 64 << 10, Some(Box::new(Owner(drops.clone())))) }.unwrap();
    // The caller lets go at once; the ticket keeps the owner until the write lands.
    assert!(drops.load(Ordering::SeqCst) == 0 || t.is_done());
    s.wait(&t).unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let dst = Aligned::new(64 << 10);
    // Safety: as above.
    let t = unsafe { s.read_into(k, dst.as_mut_ptr(), 64 << 10, Some(Box::new(Owner(drops.clone())))) }.unwrap();
    s.wait(&t).unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 2);
}

#[test]
fn free_and_close_wait_for_a_staged_write_in_progress() {
    // A slow fill keeps a staged write (an entry bigger than the arena) in progress while
    // other threads free the entry and close the store.
    let s = Arc::new(sim_store(64 << 10, vec![SimConfig::quiet(9)]));
    let data = pattern(1 << 20, 10);
    let (k, slot) = s.reserve(data.len() as u64).unwrap();
    assert!(slot.is_none());
    let (started, ended) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    std::thread::scope(|sc| {
        let writer = sc.spawn(|| {
            s.write_staged_with(k, &mut |off, dst| {
                started.store(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
                dst.copy_from_slice(&data[off as usize..off as usize + dst.len()]);
            })
        });
        while started.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let freer = sc.spawn(|| {
            let r = s.free(k);
            ended.store(1, Ordering::SeqCst);
            r
        });
        writer.join().unwrap().unwrap();
        freer.join().unwrap().unwrap();
    });
    // The free waited for the write, then gave its space back exactly once.
    let st = s.stats();
    assert_eq!((st.entries, st.nvme_used, st.failure), (0, 0, None));
    // close() during another staged write: it waits, and nothing panics under the lock.
    let (k, _) = s.reserve(data.len() as u64).unwrap();
    std::thread::scope(|sc| {
        let w = sc.spawn(|| {
            s.write_staged_with(k, &mut |off, dst| {
                std::thread::sleep(Duration::from_millis(10));
                dst.copy_from_slice(&data[off as usize..off as usize + dst.len()]);
            })
        });
        std::thread::sleep(Duration::from_millis(15));
        s.close().unwrap();
        let r = w.join().unwrap();
        assert!(matches!(r, Ok(()) | Err(Error::Closed)), "{r:?}");
    });
    assert!(matches!(s.reserve(1), Err(Error::Closed)));
}

#[test]
fn a_seed_replays_exactly() {
    use ssdtier_core::sim::{run, Workload};
    let w = Workload { seed: 42, ops: 200, threads: 1, faults: true };
    let (a, b) = (run(&w).unwrap(), run(&w).unwrap());
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
}

#[test]
fn endless_eagain_is_an_error_not_a_hang() {
    let mut sim = SimConfig::quiet(11);
    sim.p_again = 1.0;
    let s = sim_store(0, vec![sim]);
    let err = s.put_with(8192, &mut |_, dst| dst.fill(1)).unwrap_err();
    assert_eq!(err.errno(), Some(libc::EAGAIN), "{err}");
    assert_eq!(s.stats().entries, 0);
}

#[test]
fn a_discarded_entry_goes_when_its_transfer_ends() {
    let s = sim_store(1 << 20, vec![SimConfig::quiet(12)]);
    let src = Aligned::new(64 << 10);
    // Safety: src outlives the store's use of it (quiesce below waits for the write).
    let (k, t) = unsafe { s.write_from(src.as_mut_ptr(), 64 << 10, None) }.unwrap();
    assert!(!t.is_done(), "a simulated write waits for a driver");
    s.discard(k).unwrap();
    // Gone at once for callers; its space is the write's until the write ends.
    assert!(matches!(s.len_of(k), Err(Error::UnknownKey(_))));
    assert!(matches!(s.discard(k), Err(Error::UnknownKey(_))));
    let st = s.stats();
    assert_eq!((st.entries, st.nvme_used), (0, 64 << 10));
    s.quiesce().unwrap();
    assert!(t.is_done());
    assert_eq!(s.stats().nvme_used, 0);
}
