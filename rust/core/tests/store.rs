//! The store: host arena, eviction to NVMe, striping, direct streaming,
//! capacity limits, and parity between the two backends.

mod common;
use common::*;
use ssdtier_core::{Backend, DeviceConfig, Error, Eviction, Store, StoreConfig};

fn cfg(dirs: &[&std::path::Path], host: u64, backend: Backend) -> StoreConfig {
    StoreConfig {
        host_capacity: host,
        devices: dirs.iter().map(|p| DeviceConfig { path: p.to_path_buf(), capacity: 1 << 30 }).collect(),
        backend,
        queue_depth: 16,
        block_size: 256 << 10,
        ..Default::default()
    }
}

fn put(s: &Store, data: &[u8]) -> u64 {
    // Safety: data is valid for its length for the call.
    unsafe { s.put_from(data.as_ptr(), data.len() as u64) }.unwrap()
}

fn get(s: &Store, key: u64) -> Vec<u8> {
    let len = s.len_of(key).unwrap() as usize;
    let mut out = vec![0u8; len];
    match s.acquire(key).unwrap() {
        Some(off) => {
            // Safety: the pinned slot holds len bytes.
            unsafe { std::ptr::copy_nonoverlapping(s.arena_ptr().add(off as usize), out.as_mut_ptr(), len) };
            s.release(key).unwrap();
        }
        // Safety: out holds len bytes.
        None => unsafe { s.read_staged(key, out.as_mut_ptr()).unwrap() },
    }
    out
}

const SIZES: [usize; 9] = [0, 1, 4095, 4096, 4097, 100_000, 256 << 10, (1 << 20) + 3, 3 << 20];

#[test]
fn round_trip_through_nvme_both_backends() {
    for backend in [Backend::IoUring, Backend::Posix] {
        let d = real_dir();
        // A 2 MiB arena: the larger entries stream past it, the rest are evicted.
        let s = Store::new(cfg(&[d.path()], 2 << 20, backend)).unwrap();
        assert_eq!(s.backend(), if backend == Backend::Posix { "posix" } else { "io_uring" });
        let keys: Vec<(u64, usize, u64)> = (0..60)
            .map(|i| {
                let len = SIZES[i % SIZES.len()];
                let seed = i as u64 * 31 + 1;
                (put(&s, &pattern(len, seed)), len, seed)
            })
            .collect();
        s.flush().unwrap();
        let st = s.stats();
        assert!(st.nvme_bytes_written > 0 && st.evictions > 0);
        // The arena was used, and the entries bigger than it streamed past it.
        assert!(st.host_peak > 0 && st.staged_puts > 0);
        for &(k, len, seed) in &keys {
            assert!(get(&s, k) == pattern(len, seed), "{backend:?} len {len}");
        }
        // Read them all twice, in reverse: each read brings entries back, evicting others.
        for &(k, len, seed) in keys.iter().rev() {
            assert!(get(&s, k) == pattern(len, seed), "{backend:?} len {len}");
        }
        assert!(s.stats().nvme_bytes_read > 0);
        for &(k, _, _) in &keys {
            s.free(k).unwrap();
        }
        let st = s.stats();
        assert_eq!((st.host_used, st.nvme_used, st.entries), (0, 0, 0));
    }
}

#[test]
fn evict_prefetch_and_locations() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 8 << 20, Backend::Auto)).unwrap();
    let data = pattern(300_000, 9);
    let k = put(&s, &data);
    assert_eq!(s.location(k).unwrap(), (true, false));
    s.evict(k).unwrap();
    assert_eq!(s.location(k).unwrap(), (false, true));
    assert_eq!(s.stats().host_used, 0);
    let t = s.prefetch(k).unwrap();
    t.wait().unwrap();
    assert_eq!(s.location(k).unwrap(), (true, true));
    let before = s.stats().nvme_bytes_read;
    assert!(get(&s, k) == data);
    assert_eq!(s.stats().nvme_bytes_read, before, "a prefetched entry is served from the host");
    // Evicting a clean entry is free: no second write.
    let w = s.stats().nvme_bytes_written;
    s.evict(k).unwrap();
    assert_eq!(s.stats().nvme_bytes_written, w);
    assert!(get(&s, k) == data);
    assert!(matches!(s.evict(999), Err(Error::UnknownKey(999))));
}

#[test]
fn zero_host_capacity_streams_everything() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 0, Backend::Auto)).unwrap();
    assert_eq!(s.arena_len(), 0);
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(len, i as u64);
        let k = put(&s, &data);
        assert!(get(&s, k) == data, "len {len}");
        s.free(k).unwrap();
    }
    assert_eq!(s.stats().nvme_used, 0);
}

#[test]
fn striping_spreads_bytes_over_directories() {
    let a = real_dir();
    let b = real_dir();
    let s = Store::new(cfg(&[a.path(), b.path()], 0, Backend::Auto)).unwrap();
    let data = pattern(4 << 20, 5);
    let k = put(&s, &data);
    let st = s.stats();
    // 16 units of 256 KiB, alternating over the two directories.
    assert_eq!(st.device_bytes_written, vec![2 << 20, 2 << 20]);
    assert!(get(&s, k) == data);
    assert_eq!(s.stats().device_bytes_read, vec![2 << 20, 2 << 20]);
}

#[test]
fn a_full_directory_hands_over_then_out_of_space() {
    let a = real_dir();
    let b = real_dir();
    let mut c = cfg(&[a.path(), b.path()], 0, Backend::Auto);
    c.devices[0].capacity = 1 << 20;
    c.devices[1].capacity = 4 << 20;
    let s = Store::new(c).unwrap();
    let mut keys = Vec::new();
    // 5 MiB in all fit: the first device fills and the second takes over.
    for i in 0..5 {
        keys.push((put(&s, &pattern(1 << 20, i)), i));
    }
    let st = s.stats();
    assert_eq!(st.nvme_used, 5 << 20);
    assert_eq!(st.device_used, vec![1 << 20, 4 << 20]);
    let (k, _) = s.reserve(4096).unwrap();
    // Safety: a valid 4096-byte buffer.
    let err = unsafe { s.write_staged(k, pattern(4096, 0).as_ptr()) }.unwrap_err();
    assert!(matches!(err, Error::OutOfSpace { .. }), "{err}");
    assert_eq!(err.errno(), Some(libc::ENOSPC));
    for (k, i) in keys {
        assert!(get(&s, k) == pattern(1 << 20, i));
    }
}

#[test]
fn arena_full_and_nvme_full_is_out_of_space_and_nothing_is_lost() {
    let d = real_dir();
    let mut c = cfg(&[d.path()], 1 << 20, Backend::Auto);
    c.devices[0].capacity = 1 << 20;
    let s = Store::new(c).unwrap();
    let mut keys = Vec::new();
    let mut err = None;
    for i in 0..12 {
        let data = pattern(256 << 10, i);
        match s.reserve(data.len() as u64).unwrap() {
            (k, Some(off)) => {
                // Safety: slot of the right size.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), s.arena_ptr().add(off as usize), data.len()) };
                s.commit(k).unwrap();
                keys.push((k, i));
            }
            // No slot can be made: streaming past the arena is what fails.
            // Safety: data is valid for its length.
            (k, None) => {
                err = Some(unsafe { s.write_staged(k, data.as_ptr()) }.unwrap_err());
                s.free(k).unwrap();
                break;
            }
        }
    }
    let err = err.expect("2 MiB of data cannot fit 1 MiB of arena plus 1 MiB of NVMe");
    assert!(matches!(err, Error::OutOfSpace { .. }), "{err}");
    assert!(err.to_string().contains("host arena is full"), "{err}");
    // 1 MiB of arena plus 1 MiB of NVMe hold exactly eight.
    assert_eq!(keys.len(), 8);
    // put_from fails the same way and leaves no entry behind.
    let data = pattern(256 << 10, 99);
    // Safety: data is valid for its length.
    let err = unsafe { s.put_from(data.as_ptr(), data.len() as u64) }.unwrap_err();
    assert!(matches!(err, Error::OutOfSpace { .. }), "{err}");
    assert_eq!(s.stats().entries, 8);
    for (k, i) in keys {
        assert!(get(&s, k) == pattern(256 << 10, i));
    }
}

#[test]
fn put_get_free_cycles_do_not_grow() {
    let d = real_dir();
    let mut c = cfg(&[d.path()], 1 << 20, Backend::Auto);
    c.prealloc_step = 1 << 20;
    let s = Store::new(c).unwrap();
    let mut live = std::collections::VecDeque::new();
    let mut sizes = Vec::new();
    for i in 0..1500u64 {
        let len = ((i * 7919) % 200_000) as usize + 1;
        live.push_back((put(&s, &pattern(len, i)), len, i));
        if live.len() > 12 {
            let (k, len, seed) = live.pop_front().unwrap();
            assert!(get(&s, k) == pattern(len, seed));
            s.free(k).unwrap();
        }
        if i % 250 == 249 {
            let st = s.stats();
            sizes.push((st.device_high_water[0], st.device_file_size[0]));
        }
    }
    // At most 13 entries of < 200 KiB are live at once: the space used never reaches past that,
    // and the file is grown at most one step (1 MiB here) beyond it.
    assert!(sizes.iter().all(|&(h, f)| h <= 13 * (200 << 10) && f >= h && f <= h + (1 << 20)), "{sizes:?}");
    for (k, _, _) in live {
        s.free(k).unwrap();
    }
    let st = s.stats();
    assert_eq!((st.nvme_used, st.host_used, st.entries), (0, 0, 0));
}

#[test]
fn eviction_policies_pick_their_victims() {
    // Arena of 4 pages; written entries stay until a slot is short, so each step below
    // evicts exactly one victim, chosen by the policy.
    // Steps: put A B C D · get B · put E · get A · get B. Expected resident sets after each step.
    let expect: [(Eviction, [&str; 3]); 3] = [
        // Lifetime goes by put order alone: B first although it was just read.
        (Eviction::Lifetime, ["BCDE", "ACDE", "BCDE"]),
        // FIFO goes by entry into the host tier: A, read back, counts as new.
        (Eviction::Fifo, ["BCDE", "ACDE", "ABDE"]),
        // LRU goes by last access: the read of B keeps it.
        (Eviction::Lru, ["BCDE", "ABDE", "ABDE"]),
    ];
    for (policy, want) in expect {
        let d = real_dir();
        let mut c = cfg(&[d.path()], 4 * 4096, Backend::Auto);
        c.eviction = policy;
        let s = Store::new(c).unwrap();
        let k: Vec<u64> = (0..4).map(|i| put(&s, &pattern(4096, i))).collect();
        s.flush().unwrap();
        get(&s, k[1]);
        let mut keys = k.clone();
        keys.push(put(&s, &pattern(4096, 4)));
        let resident = |s: &Store| -> String {
            s.flush().unwrap();
            let mut r: Vec<char> =
                (0..5).filter(|&i| s.location(keys[i]).unwrap().0).map(|i| (b'A' + i as u8) as char).collect();
            r.sort();
            r.into_iter().collect()
        };
        let mut got = vec![resident(&s)];
        assert_eq!(get(&s, keys[0]), pattern(4096, 0));
        got.push(resident(&s));
        assert_eq!(get(&s, keys[1]), pattern(4096, 1));
        got.push(resident(&s));
        let want: Vec<String> = want
            .iter()
            .map(|w| {
                let mut c: Vec<char> = w.chars().collect();
                c.sort();
                c.into_iter().collect()
            })
            .collect();
        assert_eq!(got, want, "{policy:?}");
    }
}

#[test]
fn io_uring_can_be_disabled_and_auto_falls_back() {
    // A separate process: the variable is read when the store starts.
    if std::env::var_os("SSDTIER_DISABLE_IO_URING").is_none() {
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["io_uring_can_be_disabled_and_auto_falls_back", "--exact", "--nocapture"])
            .env("SSDTIER_DISABLE_IO_URING", "1")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
        return;
    }
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Auto)).unwrap();
    assert_eq!(s.backend(), "posix");
    let notes = s.take_notices();
    assert!(notes.iter().any(|n| n.contains("io_uring is not available")), "{notes:?}");
    let err = Store::new(cfg(&[d.path()], 1 << 20, Backend::IoUring)).err().unwrap();
    assert!(err.to_string().contains("io_uring cannot be set up"), "{err}");
}

#[test]
fn closed_store_refuses_use() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Auto)).unwrap();
    let k = put(&s, &pattern(5000, 1));
    s.close().unwrap();
    assert!(matches!(s.acquire(k), Err(Error::Closed)));
    assert!(matches!(s.reserve(1), Err(Error::Closed)));
}

#[test]
fn bad_config_is_refused() {
    let d = real_dir();
    let mut c = cfg(&[d.path()], 1 << 20, Backend::Auto);
    c.block_size = 3000;
    assert!(Store::new(c).err().unwrap().to_string().contains("block_size"));
    let c = cfg(&[], 1 << 20, Backend::Auto);
    assert!(Store::new(c).err().unwrap().to_string().contains("NVMe directory"));
}

#[test]
fn read_into_caller_memory_skips_the_arena() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Auto)).unwrap();
    let data = pattern(700_001, 4);
    let k = put(&s, &data);
    let mut dst = Aligned::new(700_001usize.div_ceil(4096) * 4096);
    // Resident: copied from the slot, the ticket is done at once.
    // Safety: dst is aligned and large enough.
    let t = unsafe { s.read_into(k, dst.as_mut_ptr(), dst.len() as u64, None) }.unwrap();
    assert!(t.is_done() && t.immediate());
    assert!(&dst.slice()[..data.len()] == data.as_slice());
    s.evict(k).unwrap();
    dst.slice_mut().fill(0);
    let before = s.stats();
    // Safety: as above.
    let t = unsafe { s.read_into(k, dst.as_mut_ptr(), dst.len() as u64, None) }.unwrap();
    t.wait().unwrap();
    assert!(!t.immediate(), "a read from NVMe is not reported as copied at once");
    assert!(&dst.slice()[..data.len()] == data.as_slice());
    let after = s.stats();
    assert_eq!(after.host_used, 0, "the arena was not used");
    assert_eq!(after.nvme_bytes_read - before.nvme_bytes_read, 700_416);
    assert_eq!(s.location(k).unwrap(), (false, true));
    // Misaligned caller memory is refused, not silently corrupted.
    // Safety: the pointer is never written through (the call fails first).
    let err = unsafe { s.read_into(k, dst.as_mut_ptr().add(8), dst.len() as u64, None) }.err().unwrap();
    assert!(err.to_string().contains("aligned"), "{err}");
    // So is a buffer with less room than the entry needs.
    // Safety: the pointer is never written through (the call fails first).
    let err = unsafe { s.read_into(k, dst.as_mut_ptr(), 4096, None) }.err().unwrap();
    assert!(err.to_string().contains("needs 700416 bytes of room"), "{err}");
    s.free(k).unwrap();
}

/// A store with a 1 MiB arena (four entries) and `n` entries of 256 KiB, all on NVMe.
fn spilled(dir: &std::path::Path, n: usize) -> (Store, Vec<u64>) {
    let s = Store::new(cfg(&[dir], 1 << 20, Backend::Auto)).unwrap();
    let keys: Vec<u64> = (0..n).map(|i| put(&s, &pattern(256 << 10, i as u64))).collect();
    s.flush().unwrap();
    for &k in &keys {
        s.evict(k).unwrap();
    }
    (s, keys)
}

/// Read every entry of `spilled` in order, keeping `window` prefetches ahead of the one
/// being read (and freeing each once read, if `free`); returns the bytes read from NVMe.
fn read_through(s: &Store, keys: &[u64], window: usize, free: bool) -> u64 {
    let before = s.stats().nvme_bytes_read;
    for &k in keys.iter().take(window) {
        s.prefetch(k).unwrap();
    }
    for (i, &k) in keys.iter().enumerate() {
        if let Some(&next) = keys.get(i + window) {
            s.prefetch(next).unwrap();
        }
        assert!(get(s, k) == pattern(256 << 10, i as u64));
        if free {
            s.free(k).unwrap();
        }
    }
    s.stats().nvme_bytes_read - before
}

#[test]
fn read_ahead_does_not_evict_what_it_read_ahead() {
    // Arena of four entries, a read-ahead window of four: every entry is read exactly once.
    let d = real_dir();
    let (s, keys) = spilled(d.path(), 16);
    assert_eq!(read_through(&s, &keys, 3, true), keys.len() as u64 * (256 << 10), "no entry is read twice");
}

#[test]
fn a_skipped_read_ahead_does_not_cascade() {
    // The window (4) plus the entry being read need five slots; the arena has four, so one
    // read-ahead is skipped. Reading that entry later must not evict another read-ahead
    // entry (which would then be read twice, and so on): every entry is read exactly once.
    let d = real_dir();
    let (s, keys) = spilled(d.path(), 16);
    assert_eq!(read_through(&s, &keys, 4, false), keys.len() as u64 * (256 << 10));
    assert!(s.stats().prefetch_skipped >= 1);
}

/// A store with a 1 MiB arena (four entries of 256 KiB) whose writes take 0.25 s each.
fn slow_writes(dir: &std::path::Path, eviction: Eviction) -> Store {
    let mut c = cfg(&[dir], 1 << 20, Backend::Auto);
    c.throttle_bytes_per_sec = 1 << 20;
    c.eviction = eviction;
    Store::new(c).unwrap()
}

#[test]
fn read_ahead_never_evicts_what_is_needed_before_it() {
    // Lifetime: an entry put later is needed sooner. An arena full of those skips a read
    // ahead of an earlier entry rather than evicting one of them; LRU knows no such order.
    for (policy, evicts) in [(Eviction::Lifetime, false), (Eviction::Lru, true)] {
        let d = real_dir();
        let mut c = cfg(&[d.path()], 1 << 20, Backend::Auto);
        c.eviction = policy;
        let s = Store::new(c).unwrap();
        let keys: Vec<u64> = (0..8).map(|i| put(&s, &pattern(256 << 10, i))).collect();
        s.flush().unwrap();
        for &k in &keys {
            s.evict(k).unwrap();
        }
        for &k in keys[4..].iter().rev() {
            s.prefetch(k).unwrap().wait().unwrap();
        }
        for (i, &k) in keys.iter().enumerate().skip(4) {
            assert!(get(&s, k) == pattern(256 << 10, i as u64)); // no longer a read ahead
        }
        let resident = |s: &Store| keys[4..].iter().filter(|&&k| s.location(k).unwrap().0).count();
        assert_eq!(resident(&s), 4);
        s.prefetch(keys[3]).unwrap().wait().unwrap();
        assert_eq!(s.location(keys[3]).unwrap().0, evicts, "{policy:?}");
        assert_eq!(resident(&s), if evicts { 3 } else { 4 }, "{policy:?}");
        assert_eq!(s.stats().prefetch_skipped, u64::from(!evicts), "{policy:?}");
        if !evicts {
            // Once the backward used one of them, the read ahead finds room.
            s.free(keys[7]).unwrap();
            s.prefetch(keys[3]).unwrap().wait().unwrap();
            assert_eq!(s.location(keys[3]).unwrap(), (true, true));
        }
        assert!(get(&s, keys[3]) == pattern(256 << 10, 3));
    }
}

#[test]
fn read_ahead_of_an_entry_being_evicted_keeps_it() {
    for ahead in [false, true] {
        let d = real_dir();
        let s = slow_writes(d.path(), Eviction::Lifetime);
        // The fourth put fills the arena and starts writing the first out (the headroom).
        let keys: Vec<u64> = (0..4).map(|i| put(&s, &pattern(256 << 10, i))).collect();
        assert_eq!(s.location(keys[0]).unwrap(), (true, false), "its write is still in flight");
        if ahead {
            assert!(s.prefetch(keys[0]).unwrap().is_done());
        }
        s.flush().unwrap();
        // A fifth needs a slot: the written entry gives it up, unless it was asked for.
        put(&s, &pattern(256 << 10, 4));
        assert_eq!(s.location(keys[0]).unwrap().0, ahead, "ahead {ahead}");
        assert_eq!(s.location(keys[1]).unwrap().0, !ahead, "ahead {ahead}");
        let read = s.stats().nvme_bytes_read;
        assert!(get(&s, keys[0]) == pattern(256 << 10, 0));
        assert_eq!(s.stats().nvme_bytes_read > read, !ahead, "ahead {ahead}");
    }
}

#[test]
fn an_entry_read_ahead_and_used_is_evicted_in_order_again() {
    let d = real_dir();
    let (s, keys) = spilled(d.path(), 8);
    for &k in keys[4..].iter().rev() {
        s.prefetch(k).unwrap().wait().unwrap(); // the arena is full of entries read ahead
    }
    let dst = Aligned::new(256 << 10);
    // Safety: dst is aligned and holds the entry; the copy from the arena is done at once.
    unsafe { s.read_into(keys[7], dst.as_mut_ptr(), 256 << 10, None) }.unwrap().wait().unwrap();
    // Used, keys[7] is no longer held as read ahead: a read of another takes its slot.
    let evictions = s.stats().evictions;
    assert!(s.acquire(keys[3]).unwrap().is_some());
    s.release(keys[3]).unwrap();
    assert_eq!(s.location(keys[7]).unwrap(), (false, true));
    assert_eq!(s.stats().evictions, evictions + 1);
    s.evict(keys[3]).unwrap(); // an explicit evict counts too
    assert_eq!(s.stats().evictions, evictions + 2);
}

#[test]
fn an_eviction_write_keeps_its_slot_until_one_is_short() {
    for room in [false, true] {
        let d = real_dir();
        let s = slow_writes(d.path(), Eviction::Lifetime);
        let keys: Vec<u64> = (0..4).map(|i| put(&s, &pattern(256 << 10, i))).collect();
        s.flush().unwrap();
        assert_eq!(s.location(keys[0]).unwrap(), (true, true), "written, and still in the arena");
        if room {
            s.free(keys[3]).unwrap(); // used meanwhile, as a backward does
        }
        put(&s, &pattern(256 << 10, 4));
        assert_eq!(s.location(keys[0]).unwrap(), (room, true), "room {room}");
        // An explicit evict gives the slot up.
        s.evict(keys[0]).unwrap();
        assert_eq!(s.location(keys[0]).unwrap(), (false, true));
        assert!(get(&s, keys[0]) == pattern(256 << 10, 0));
    }
}

#[test]
fn write_from_caller_memory_skips_the_arena_both_backends() {
    for backend in [Backend::IoUring, Backend::Posix] {
        let (d1, d2) = (real_dir(), real_dir());
        let s = Store::new(cfg(&[d1.path(), d2.path()], 1 << 20, backend)).unwrap();
        let mut keys = Vec::new();
        for (i, &n) in SIZES.iter().enumerate() {
            let mut src = Aligned::new(n.div_ceil(4096) * 4096);
            src.slice_mut()[..n].copy_from_slice(&pattern(n, i as u64));
            // Safety: src is aligned, holds n rounded up to 4096, and outlives the wait below.
            let (k, t) = unsafe { s.write_from(src.as_mut_ptr(), n as u64, None) }.unwrap();
            t.wait().unwrap();
            drop(src);
            assert_eq!(s.location(k).unwrap(), (false, true), "{backend:?} size {n}");
            keys.push((k, n, i as u64));
        }
        let st = s.stats();
        assert_eq!(st.host_peak, 0, "the arena was not used");
        assert_eq!(st.zero_copy_puts, SIZES.len() as u64);
        for &(k, n, seed) in &keys {
            // Through a slot (acquire) and straight into caller memory (read_into).
            assert!(get(&s, k) == pattern(n, seed), "{backend:?} size {n}");
            s.evict(k).unwrap();
            let dst = Aligned::new(n.div_ceil(4096) * 4096);
            // Safety: dst is aligned and large enough, and outlives the wait.
            unsafe { s.read_into(k, dst.as_mut_ptr(), dst.len() as u64, None) }.unwrap().wait().unwrap();
            assert!(&dst.slice()[..n] == pattern(n, seed).as_slice(), "{backend:?} size {n}");
            s.free(k).unwrap();
        }
        s.flush().unwrap();
        let st = s.stats();
        assert_eq!((st.nvme_used, st.entries), (0, 0));
        // Misaligned caller memory is refused, not silently corrupted.
        let src = Aligned::new(8192);
        // Safety: the call fails before reading.
        let err = unsafe { s.write_from(src.as_mut_ptr().add(64), 100, None) }.err().unwrap();
        assert!(err.to_string().contains("aligned"), "{err}");
    }
}

#[test]
fn writes_from_caller_memory_wait_within_the_host_capacity() {
    let d = real_dir();
    let mut c = cfg(&[d.path()], 1 << 20, Backend::Auto);
    // Slow enough that no write finishes on its own while the next is submitted.
    c.throttle_bytes_per_sec = 8 << 20;
    let s = Store::new(c).unwrap();
    let bufs: Vec<Aligned> = (0..5).map(|_| Aligned::new(512 << 10)).collect();
    let mut tickets = Vec::new();
    for (i, b) in bufs.iter().enumerate() {
        // Safety: each buffer is aligned, 512 KiB, and outlives its ticket (waited below).
        let (_, t) = unsafe { s.write_from(b.as_mut_ptr(), 512 << 10, None) }.unwrap();
        tickets.push(t);
        // 1 MiB of capacity holds two writes in flight: the third waits for the first, and so on.
        if i >= 2 {
            assert!(tickets[i - 2].is_done(), "write {} still in flight when write {i} started", i - 2);
        }
    }
    assert!(s.stats().wait_seconds > 0.0);
    for t in tickets {
        t.wait().unwrap();
    }
    // A read of an entry whose write is in flight waits for the write.
    let mut src = Aligned::new(256 << 10);
    src.slice_mut().copy_from_slice(&pattern(256 << 10, 9));
    // Safety: src outlives the ticket (the read below waits for the write).
    let (k, t) = unsafe { s.write_from(src.as_mut_ptr(), 256 << 10, None) }.unwrap();
    let dst = Aligned::new(256 << 10);
    // Safety: dst is aligned and large enough, and outlives the wait.
    unsafe { s.read_into(k, dst.as_mut_ptr(), dst.len() as u64, None) }.unwrap().wait().unwrap();
    assert!(t.is_done());
    assert!(dst.slice() == pattern(256 << 10, 9).as_slice());
}

#[test]
fn null_buffers_are_refused_not_followed() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Auto)).unwrap();
    let null = std::ptr::null_mut::<u8>();
    // Safety: every call below is refused before the pointer is used.
    unsafe {
        assert!(s.put_from(null, 100).unwrap_err().to_string().contains("null buffer"));
        assert!(s.write_from(null, 4096, None).err().unwrap().to_string().contains("null buffer"));
        let (k, _) = s.reserve(3 << 20).unwrap(); // bigger than the arena: no slot
        assert!(s.write_staged(k, null).unwrap_err().to_string().contains("null buffer"));
        s.free(k).unwrap();
        let k = put(&s, &pattern(5000, 1));
        assert!(s.read_staged(k, null).unwrap_err().to_string().contains("null buffer"));
        assert!(s.read_into(k, null, 8192, None).err().unwrap().to_string().contains("null buffer"));
        // Nothing to move: a null buffer is fine.
        let k0 = s.put_from(null, 0).unwrap();
        s.free(k0).unwrap();
    }
    assert_eq!(s.stats().entries, 1, "no refused call left an entry behind");
}

#[test]
fn files_are_grown_a_step_ahead_of_their_use() {
    let d = real_dir();
    let mut c = cfg(&[d.path()], 0, Backend::Auto);
    c.devices[0].capacity = 40 << 20;
    c.prealloc_step = 16 << 20;
    let s = Store::new(c).unwrap();
    let data = pattern(1 << 20, 1);
    let mut keys = vec![put(&s, &data)];
    // One step ahead, not the whole capacity.
    assert_eq!(s.stats().device_file_size[0], 16 << 20);
    while s.stats().device_high_water[0] < 17 << 20 {
        keys.push(put(&s, &data));
    }
    assert_eq!(s.stats().device_file_size[0], 32 << 20);
    while s.stats().device_high_water[0] < 33 << 20 {
        keys.push(put(&s, &data));
    }
    // The last step stops at the capacity.
    assert_eq!(s.stats().device_file_size[0], 40 << 20);
    for k in keys {
        assert!(get(&s, k) == data);
    }
}

/// Write `data` at the extents into the devices' files, as cuFile would (O_DIRECT: aligned).
fn pwrite_extents(s: &Store, extents: &[ssdtier_core::Extent], data: &[u8]) {
    let fds = s.device_fds();
    for x in extents {
        let mut buf = Aligned::new(x.len as usize);
        let lo = (x.entry_off as usize).min(data.len());
        let hi = ((x.entry_off + x.len) as usize).min(data.len());
        buf.slice_mut()[..hi - lo].copy_from_slice(&data[lo..hi]);
        // Safety: buf holds x.len bytes; the fd is the store's open device file.
        let n =
            unsafe { libc::pwrite(fds[x.dev].unwrap(), buf.as_mut_ptr().cast(), x.len as usize, x.file_off as i64) };
        assert_eq!(n, x.len as isize, "{}", std::io::Error::last_os_error());
    }
}

fn pread_extents(s: &Store, extents: &[ssdtier_core::Extent], len: usize) -> Vec<u8> {
    let fds = s.device_fds();
    let mut out = vec![0u8; len];
    for x in extents {
        let buf = Aligned::new(x.len as usize);
        // Safety: buf holds x.len bytes; the fd is the store's open device file.
        let n = unsafe { libc::pread(fds[x.dev].unwrap(), buf.as_mut_ptr().cast(), x.len as usize, x.file_off as i64) };
        assert_eq!(n, x.len as isize, "{}", std::io::Error::last_os_error());
        let lo = (x.entry_off as usize).min(len);
        let hi = ((x.entry_off + x.len) as usize).min(len);
        out[lo..hi].copy_from_slice(&buf.slice()[..hi - lo]);
    }
    out
}

#[test]
fn transfers_outside_the_store_use_the_extents_they_are_given() {
    let (a, b) = (real_dir(), real_dir());
    let s = Store::new(cfg(&[a.path(), b.path()], 1 << 20, Backend::Auto)).unwrap();
    let data = pattern((3 << 20) + 5, 7);
    // Larger than the arena: reserved without a slot, as an entry written from GPU memory.
    let (k, slot) = s.reserve(data.len() as u64).unwrap();
    assert!(slot.is_none());
    let before = s.stats();
    let extents = s.begin_external_write(k).unwrap();
    assert_eq!(extents.iter().map(|x| x.len).sum::<u64>(), (data.len() as u64).next_multiple_of(4096));
    assert!(extents.iter().any(|x| x.dev == 0) && extents.iter().any(|x| x.dev == 1), "striped");
    pwrite_extents(&s, &extents, &data);
    s.end_external(k, Ok(())).unwrap();
    assert_eq!(s.stats().nvme_bytes_written - before.nvme_bytes_written, extents.iter().map(|x| x.len).sum::<u64>());
    assert_eq!(s.location(k).unwrap(), (false, true));
    assert!(get(&s, k) == data, "the store reads what was written outside it");
    // And back out: the store's own write, read outside it.
    let k2 = put(&s, &data[..700_001]);
    s.evict(k2).unwrap();
    let ext2 = s.begin_external_read(k2).unwrap();
    assert!(s.end_external(k, Ok(())).is_err(), "k has no transfer outside the store");
    assert!(pread_extents(&s, &ext2, 700_001) == data[..700_001]);
    s.end_external(k2, Ok(())).unwrap();
    assert_eq!(s.location(k2).unwrap(), (false, true));
    // A failed write leaves no bytes and gives its space back; the entry can be freed.
    let (k3, _) = s.reserve(data.len() as u64).unwrap();
    let used = s.stats().nvme_used;
    s.begin_external_write(k3).unwrap();
    let err = s.end_external(k3, Err(Error::External("cuFile said no".into()))).unwrap_err();
    assert!(err.to_string().contains("cuFile said no"));
    assert_eq!(s.stats().nvme_used, used);
    assert!(s.begin_external_read(k3).is_err(), "no bytes");
    // An entry with a slot is not written outside the store; one reserved without a slot
    // is, however small.
    let k4 = put(&s, &data[..1000]);
    assert!(s.begin_external_write(k4).is_err());
    let k5 = s.reserve_unslotted(1000).unwrap();
    let ext5 = s.begin_external_write(k5).unwrap();
    assert_eq!(ext5.iter().map(|x| x.len).sum::<u64>(), 4096);
    pwrite_extents(&s, &ext5, &data[..1000]);
    s.end_external(k5, Ok(())).unwrap();
    assert!(get(&s, k5) == data[..1000]);
    s.free(k5).unwrap();
    for k in [k, k2, k3, k4] {
        s.free(k).unwrap();
    }
    s.close().unwrap();
}

#[test]
fn a_discard_during_a_transfer_outside_the_store_frees_it_at_the_end() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Auto)).unwrap();
    let (k, _) = s.reserve(2 << 20).unwrap();
    s.begin_external_write(k).unwrap();
    s.discard(k).unwrap();
    assert!(s.stats().nvme_used > 0, "the space is the writer's until it ends");
    s.end_external(k, Ok(())).unwrap();
    assert_eq!(s.stats().nvme_used, 0);
    assert_eq!(s.stats().entries, 0);
    s.close().unwrap();
}

#[test]
fn lifetime_evicts_the_later_forward_first_under_a_pipeline_schedule() {
    // Two forwards outstanding (1F1B): the first one's backward comes first, so the second
    // one's entries are needed last, its earliest put last of all.
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Auto)).unwrap();
    s.set_group(1);
    let a: Vec<u64> = (0..4).map(|i| put(&s, &pattern(256 << 10, i))).collect();
    s.set_group(2);
    let b: Vec<u64> = (4..8).map(|i| put(&s, &pattern(256 << 10, i))).collect();
    s.flush().unwrap();
    let resident = |keys: &[u64]| keys.iter().map(|&k| s.location(k).unwrap().0).collect::<Vec<_>>();
    // The second forward's puts evicted its own earliest entries once the first one's were out
    // (put-order lifetime would have kept all four of its entries and none of the first's).
    assert_eq!((resident(&a), resident(&b)), (vec![false, false, true, true], vec![false, false, true, true]));
    // The first backward reads a[1] ahead: the second forward's entries make room for it.
    s.prefetch(a[1]).unwrap().wait().unwrap();
    assert_eq!((resident(&a), resident(&b)), (vec![false, true, true, true], vec![false, false, false, true]));
    // Nothing in the arena is needed after b[0]: its read ahead is skipped.
    s.prefetch(b[0]).unwrap().wait().unwrap();
    assert_eq!(s.stats().prefetch_skipped, 1);
    for (i, &k) in a.iter().chain(&b).enumerate() {
        assert!(get(&s, k) == pattern(256 << 10, i as u64));
    }
}

#[test]
fn a_fork_child_refuses_the_parents_store_and_drops_it_untouched() {
    for backend in [Backend::IoUring, Backend::Posix] {
        let d = real_dir();
        // 2 MiB into a 1 MiB arena: evictions to NVMe under way at the fork.
        let s = Store::new(cfg(&[d.path()], 1 << 20, backend)).unwrap();
        let keys: Vec<u64> = (0..8).map(|i| put(&s, &pattern(256 << 10, i))).collect();
        let t = s.prefetch(keys[0]).unwrap();
        // Safety: the child only calls the store and leaves with _exit, unwinding nothing.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // A panic must not unwind into the test harness, whose other threads are not here.
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let refused = s.forked()
                    && matches!(s.location(keys[1]), Err(Error::Forked))
                    && matches!(t.wait(), Err(Error::Forked))
                    && s.stats().nvme_bytes_written == 0;
                let closed = s.close().is_ok();
                drop(s); // neither joins the parent's I/O threads nor touches its rings or arena
                refused && closed
            }));
            unsafe { libc::_exit(if ok.unwrap_or(false) { 0 } else { 1 }) };
        }
        let mut status = 0;
        // Safety: waits for the child just made.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{backend:?}: child status {status}");
        assert!(!s.forked());
        t.wait().unwrap();
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(get(&s, k), pattern(256 << 10, i as u64));
        }
        s.close().unwrap();
    }
}

#[test]
fn reset_counters_starts_the_books_again_and_keeps_the_space() {
    let d = real_dir();
    let s = Store::new(cfg(&[d.path()], 1 << 20, Backend::Posix)).unwrap();
    let keys: Vec<u64> = (0..6).map(|i| put(&s, &pattern(300_000, i))).collect();
    s.flush().unwrap();
    let before = s.stats();
    assert!(before.nvme_bytes_written > 0 && before.host_peak > 0 && before.nvme_peak > 0);
    s.free(keys[0]).unwrap();
    s.reset_counters();
    let after = s.stats();
    assert_eq!((after.nvme_bytes_written, after.host_puts, after.evictions), (0, 0, 0));
    assert_eq!(after.device_bytes_written, vec![0]);
    assert_eq!((after.host_capacity, after.nvme_capacity), (before.host_capacity, before.nvme_capacity));
    // Peaks count from what is held now; the entries left are intact.
    assert_eq!((after.host_peak, after.nvme_peak), (after.host_used, after.nvme_used));
    assert!(after.nvme_peak < before.nvme_peak || after.host_peak < before.host_peak);
    assert_eq!(after.entries, 5);
    for (i, &k) in keys.iter().enumerate().skip(1) {
        assert!(get(&s, k) == pattern(300_000, i as u64));
    }
}
