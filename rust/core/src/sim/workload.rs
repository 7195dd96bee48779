//! A seeded workload against a store over simulated devices, checked against
//! a model: every byte read back, every error allowed by the faults injected,
//! and after freeing everything no slot or extent left behind. Transfers outside the
//! store (cuFile's) are played here, on the simulated files at the extents handed out.

use super::{Rng, SimConfig, SimFile, SimQueue};
use crate::error::Error;
use crate::store::{DeviceConfig, Eviction, Extent, Store, StoreConfig};
use crate::ticket::Ticket;
use crate::{Backend, ALIGN};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// One run: a seed, how many operations each thread makes, and how many threads.
#[derive(Debug, Clone)]
pub struct Workload {
    pub seed: u64,
    pub ops: usize,
    /// 1 replays exactly; more race the store from several threads over a simulated device
    /// with its own thread (then a seed replays its choices, not its interleaving).
    pub threads: usize,
    /// Inject faults (chosen from the seed; some seeds still have none).
    pub faults: bool,
}

/// What a run did.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub ops: u64,
    pub bytes_checked: u64,
    pub errors_allowed: u64,
    /// Transfers outside the store (as cuFile's) begun and ended.
    pub external: u64,
    /// The simulated ring failed and the store refused work from then on.
    pub store_failed: bool,
    pub quarantined_bytes: u64,
}

/// Page-aligned memory for zero-copy transfers, shared with the ticket that keeps it alive.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

// Safety: plain heap memory; the workload reads it only once its transfer is done.
unsafe impl Send for Buf {}
unsafe impl Sync for Buf {}

impl Buf {
    fn new(len: usize) -> Arc<Self> {
        let len = len.div_ceil(ALIGN as usize).max(1) * ALIGN as usize;
        let layout = std::alloc::Layout::from_size_align(len, ALIGN as usize).expect("a page-aligned layout");
        // Safety: a non-zero size; the result is checked.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Arc::new(Buf { ptr, len })
    }
    fn bytes(&self, n: usize) -> &[u8] {
        // Safety: the buffer holds `len >= n` bytes and no transfer into it is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr, n.min(self.len)) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, ALIGN as usize).expect("as allocated");
        // Safety: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// What the model knows of an entry.
enum Known {
    Bytes(Arc<Vec<u8>>),
    /// Its write from caller memory failed: reading it must fail, never return bytes.
    NoBytes,
}

/// A transfer the workload started and has not waited for.
enum Pending {
    Write { key: u64, ticket: Arc<Ticket>, _src: Arc<Buf> },
    Read { key: u64, ticket: Arc<Ticket>, dst: Arc<Buf>, want: Arc<Vec<u8>> },
    External(External),
}

/// A transfer outside the store (begun, not ended) that the workload plays as cuFile would.
struct External {
    key: u64,
    extents: Vec<Extent>,
    write: bool,
    /// The bytes to write, or those a read must find.
    data: Arc<Vec<u8>>,
    /// It will end with an error (a write then lands only in part).
    fail: bool,
    /// Its entry was discarded meanwhile.
    discarded: bool,
}

struct Ctx<'a> {
    store: &'a Store,
    /// The devices' files, as a transfer outside the store sees them.
    files: &'a [SimFile],
    rng: Rng,
    faults: bool,
    shared: bool,
    /// End by closing the store with transfers in flight.
    close_early: bool,
    out: Outcome,
    arena: u64,
    max_len: u64,
}

type Check = Result<(), String>;

impl Ctx<'_> {
    /// An error is allowed if the faults of this run explain it.
    fn allowed(&mut self, err: &Error, what: &str, key_shared: bool) -> Check {
        let ok = match err {
            Error::OutOfSpace { .. } => true,
            Error::Io { errno, .. } => self.faults && [libc::EIO, libc::ENOSPC, libc::EAGAIN].contains(errno),
            Error::EngineFailed { .. } | Error::Failed(_) => self.faults,
            Error::Busy { .. } | Error::UnknownKey(_) => key_shared,
            _ => false,
        };
        if let Error::EngineFailed { .. } | Error::Failed(_) = err {
            self.out.store_failed = true;
        }
        if ok {
            self.out.errors_allowed += 1;
            Ok(())
        } else {
            Err(format!("{what}: unexpected error: {err}"))
        }
    }

    fn len(&mut self) -> u64 {
        match self.rng.below(8) {
            0 => 0,
            1 => 1 + self.rng.below(100),
            2 => ALIGN - 1 + self.rng.below(3),
            3 => self.arena + self.rng.below(self.arena / 2 + 4096), // bigger than the arena: staged
            _ => 1 + self.rng.below(self.max_len),
        }
    }

    fn data(&mut self, len: u64) -> Arc<Vec<u8>> {
        let seed = self.rng.next_u64();
        let mut r = Rng::new(seed);
        Arc::new((0..len).map(|_| r.next_u64() as u8).collect())
    }

    fn check_bytes(&mut self, got: &[u8], want: &[u8], what: &str, key: u64) -> Check {
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
            return Err(format!(
                "{what} of key {key}: wrong bytes ({} vs {} long, first difference at {at})",
                got.len(),
                want.len()
            ));
        }
        self.out.bytes_checked += want.len() as u64;
        Ok(())
    }

    /// Read `key` one way or another and compare it with what the model knows.
    fn read(&mut self, key: u64, known: &Known, shared: bool, pending: &mut Vec<Pending>) -> Check {
        let want = match known {
            Known::Bytes(w) => w.clone(),
            Known::NoBytes => Arc::new(Vec::new()),
        };
        let no_bytes = matches!(known, Known::NoBytes);
        // Room for the entry as the store has it (the model knows no bytes of a failed write).
        let room = self.store.len_of(key).map_or(want.len(), |n| n as usize);
        let res = match self.rng.below(5) {
            0 => match self.store.acquire(key) {
                Ok(Some(off)) => {
                    // Safety: the pinned slot holds the entry's bytes until release.
                    let got =
                        unsafe { std::slice::from_raw_parts(self.store.arena_ptr().add(off as usize), want.len()) };
                    let c = self.check_bytes(got, &want, "acquire", key);
                    self.store.release(key).map_err(|e| format!("release of key {key}: {e}"))?;
                    c.map(|_| Ok(()))?
                }
                Ok(None) => {
                    let mut got = vec![0u8; room];
                    match self.store.read_staged_with(key, &mut |off, b| {
                        got[off as usize..off as usize + b.len()].copy_from_slice(b)
                    }) {
                        Ok(()) => self.check_bytes(&got, &want, "read_staged after acquire", key).map(|_| Ok(()))?,
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            },
            1 => {
                let mut got = vec![0u8; room];
                match self
                    .store
                    .read_staged_with(key, &mut |off, b| got[off as usize..off as usize + b.len()].copy_from_slice(b))
                {
                    Ok(()) => self.check_bytes(&got, &want, "read_staged", key).map(|_| Ok(()))?,
                    Err(e) => Err(e),
                }
            }
            2 => {
                let dst = Buf::new(room);
                // Safety: dst is aligned, holds the rounded length, and the ticket keeps it alive.
                match unsafe { self.store.read_into(key, dst.ptr, dst.len as u64, Some(Box::new(dst.clone()))) } {
                    Ok(ticket) => {
                        if self.rng.chance(0.5) {
                            pending.push(Pending::Read { key, ticket, dst, want });
                            return Ok(());
                        }
                        let r = self.store.wait(&ticket);
                        finish_read(self, key, &ticket, dst, &want, r, shared)?;
                        return Ok(());
                    }
                    Err(e) => Err(e),
                }
            }
            3 => match self.store.prefetch(key) {
                Ok(t) => {
                    if self.rng.chance(0.5) {
                        // A failed read ahead is retried by the next read: its error is not the caller's.
                        let _ = self.store.wait(&t);
                    }
                    return Ok(()); // reads nothing back to check
                }
                Err(e) => Err(e),
            },
            _ => return self.read_external(key, known, shared, pending),
        };
        match res {
            Ok(()) if no_bytes => Err(format!("key {key} has no bytes, yet a read of it succeeded")),
            Ok(()) => Ok(()),
            Err(Error::Invalid(m)) if no_bytes && m.contains("no bytes") => Ok(()),
            Err(e @ Error::Io { .. }) if no_bytes => self.allowed(&e, "read of a failed write", shared),
            Err(e) => self.allowed(&e, "read", shared),
        }
    }

    /// Read an entry as the cuFile transport does: evicted, then its extents read by us.
    fn read_external(&mut self, key: u64, known: &Known, shared: bool, pending: &mut Vec<Pending>) -> Check {
        if let Err(e) = self.store.evict(key) {
            return self.allowed(&e, "evict before an external read", shared);
        }
        // Our own entry cannot change under us: on NVMe only, with bytes, its read must begin.
        let must = !shared && self.store.location(key).is_ok_and(|l| l == (false, true));
        let want = match known {
            Known::Bytes(w) if !w.is_empty() => w.clone(),
            _ => Arc::new(Vec::new()),
        };
        let extents = match self.store.begin_external_read(key) {
            Ok(x) if want.is_empty() => {
                let _ = self.store.end_external(key, Ok(()));
                return Err(format!("key {key} has no bytes, yet its external read began ({x:?})"));
            }
            Ok(x) => x,
            Err(Error::Invalid(m)) if m.contains("not on NVMe only") && (!must || want.is_empty()) => return Ok(()),
            Err(e) => return self.allowed(&e, "begin_external_read", shared),
        };
        let fail = self.faults && self.rng.chance(0.1);
        let x = External { key, extents, write: false, data: want, fail, discarded: false };
        let bad = check_extents(self, key, x.data.len() as u64, &x.extents);
        // Ended at once on shared keys: another thread may wait for it while we wait for one of its.
        if bad.is_err() || (!shared && self.rng.chance(0.5)) {
            pending.push(Pending::External(x)); // ended later, or as the run stops
            return bad;
        }
        end_external(self, x, None)
    }
}

/// The extents of an entry of `len` bytes cover its length rounded up to 4096 once, aligned,
/// inside its devices.
fn check_extents(c: &Ctx, key: u64, len: u64, extents: &[Extent]) -> Check {
    let mut v = extents.to_vec();
    v.sort_by_key(|x| x.entry_off);
    let mut at = 0;
    for x in &v {
        let cap = c.store.config().devices.get(x.dev).map_or(0, |d| d.capacity);
        if x.entry_off != at || x.len == 0 || x.file_off % ALIGN != 0 || x.file_off + x.len > cap {
            return Err(format!("extents of key {key} ({len} bytes): {v:?}"));
        }
        at += x.len;
    }
    if at != len.div_ceil(ALIGN) * ALIGN {
        return Err(format!("extents of key {key} cover {at} bytes, not {len} rounded up: {v:?}"));
    }
    Ok(())
}

/// Write a new entry as the cuFile transport does: reserved without a slot, its extents written
/// by us, then `end_external`, at once or after other operations.
fn put_external(c: &mut Ctx, model: &mut BTreeMap<u64, Known>, pending: &mut Vec<Pending>) -> Check {
    let len = c.len();
    let data = c.data(len);
    let key = match c.store.reserve_unslotted(len) {
        Ok(k) => k,
        Err(e) => return c.allowed(&e, "reserve_unslotted", false),
    };
    if len == 0 {
        model.insert(key, Known::Bytes(data)); // nothing to transfer
        return Ok(());
    }
    // No bytes until its write ends well (nor when the begin is refused).
    model.insert(key, Known::NoBytes);
    let extents = match c.store.begin_external_write(key) {
        Ok(x) => x,
        Err(e) => return c.allowed(&e, "begin_external_write", false),
    };
    let fail = c.faults && c.rng.chance(0.15);
    let x = External { key, extents, write: true, data, fail, discarded: false };
    let bad = check_extents(c, key, len, &x.extents);
    if bad.is_err() || c.rng.chance(0.5) {
        pending.push(Pending::External(x)); // ended later, or as the run stops
        return bad;
    }
    end_external(c, x, Some(model))
}

/// The bytes of an external transfer move now (as cuFile's would: only now may its space be
/// another entry's), then it ends; a failed write leaves the entry without bytes.
fn end_external(c: &mut Ctx, x: External, model: Option<&mut BTreeMap<u64, Known>>) -> Check {
    let External { key, extents, write, data, fail, discarded } = x;
    let mut got = vec![0u8; data.len()];
    for e in &extents {
        let file = &c.files[e.dev];
        let a = (e.entry_off as usize).min(data.len());
        let b = (e.entry_off + e.len).min(data.len() as u64) as usize;
        if write {
            let n = if fail { c.rng.below((b - a) as u64 + 1) as usize } else { b - a };
            file.write(e.file_off, &data[a..a + n]);
            // The rest of the last block may hold anything: it is never read back as data.
            if !fail && b - a < e.len as usize && c.rng.chance(0.5) {
                file.write(e.file_off + (b - a) as u64, &vec![0xa5; e.len as usize - (b - a)]);
            }
        } else if !fail {
            got[a..b].copy_from_slice(&file.read(e.file_off, b - a));
        }
    }
    let res = if fail { Err(Error::External("simulated cuFile failure".into())) } else { Ok(()) };
    let r = c.store.end_external(key, res.clone());
    if r != res {
        return Err(format!("end_external of key {key} answered {r:?} for {res:?}"));
    }
    if !write && !fail {
        c.check_bytes(&got, &data, "external read", key)?;
    }
    c.out.external += 1;
    if let (true, false, Some(model)) = (write, discarded, model) {
        model.insert(key, if fail { Known::NoBytes } else { Known::Bytes(data) });
    }
    // A second end is refused and changes nothing (writes only: shared keys are read by others).
    if write && c.rng.chance(0.1) {
        match c.store.end_external(key, Ok(())) {
            Err(Error::Invalid(_)) if !discarded => {}
            Err(Error::UnknownKey(_)) if discarded => {}
            other => return Err(format!("a second end_external of key {key} answered {other:?}")),
        }
    }
    Ok(())
}

/// A zero-copy read came back: its bytes must be right, or it failed as the faults allow.
/// An abandoned one keeps its buffer forever (the kernel may still write there).
fn finish_read(
    c: &mut Ctx,
    key: u64,
    t: &Ticket,
    dst: Arc<Buf>,
    want: &[u8],
    r: crate::Result<()>,
    shared: bool,
) -> Check {
    let res = match r {
        Ok(()) => c.check_bytes(dst.bytes(want.len()), want, "read_into", key),
        Err(e) => c.allowed(&e, "read_into", shared),
    };
    if t.abandoned() {
        std::mem::forget(dst);
    }
    res
}

/// Write a new entry one of five ways; its key, or None when the store said no (allowed).
fn put(c: &mut Ctx, model: &mut BTreeMap<u64, Known>, pending: &mut Vec<Pending>) -> Check {
    if c.rng.chance(0.25) {
        return put_external(c, model, pending);
    }
    let len = c.len();
    let data = c.data(len);
    let res = match c.rng.below(3) {
        0 => c.store.put_with(len, &mut |off, dst| dst.copy_from_slice(&data[off as usize..off as usize + dst.len()])),
        1 => match c.store.reserve(len) {
            Ok((key, Some(off))) => {
                // Safety: the slot is ours while it is filled.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), c.store.arena_ptr().add(off as usize), len as usize)
                };
                match c.store.commit(key) {
                    Ok(()) => Ok(key),
                    Err(e) => {
                        c.store.free(key).map_err(|f| format!("free after a failed commit: {f}"))?;
                        Err(e)
                    }
                }
            }
            Ok((key, None)) => {
                // Safety: data holds the entry's length.
                match unsafe { c.store.write_staged(key, data.as_ptr()) } {
                    Ok(()) => Ok(key),
                    Err(e) => {
                        c.store.free(key).map_err(|f| format!("free after a failed write_staged: {f}"))?;
                        Err(e)
                    }
                }
            }
            Err(e) => Err(e),
        },
        _ => {
            let src = Buf::new(len as usize);
            // Safety: the buffer is ours until the write below starts.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.ptr, len as usize) };
            // Safety: src is aligned, holds the rounded length, and the ticket keeps it alive.
            match unsafe { c.store.write_from(src.ptr, len, Some(Box::new(src.clone()))) } {
                Ok((key, ticket)) => {
                    model.insert(key, Known::Bytes(data));
                    pending.push(Pending::Write { key, ticket, _src: src });
                    return Ok(());
                }
                Err(e) => Err(e),
            }
        }
    };
    match res {
        Ok(key) => {
            model.insert(key, Known::Bytes(data));
            Ok(())
        }
        Err(e) => c.allowed(&e, "put", false),
    }
}

fn key_of(p: &Pending) -> u64 {
    match p {
        Pending::Write { key, .. } | Pending::Read { key, .. } | Pending::External(External { key, .. }) => *key,
    }
}

/// Finish our transfers in flight on `key` that `which` picks.
fn settle_key(
    c: &mut Ctx,
    key: u64,
    which: impl Fn(&Pending) -> bool,
    pending: &mut Vec<Pending>,
    model: &mut BTreeMap<u64, Known>,
) -> Check {
    let mut j = 0;
    while j < pending.len() {
        if key_of(&pending[j]) == key && which(&pending[j]) {
            let p = pending.swap_remove(j);
            settle(c, p, model)?;
        } else {
            j += 1;
        }
    }
    Ok(())
}

fn settle(c: &mut Ctx, p: Pending, model: &mut BTreeMap<u64, Known>) -> Check {
    match p {
        Pending::Write { key, ticket, _src } => {
            if let Err(e) = c.store.wait(&ticket) {
                c.allowed(&e, "write_from", false)?;
                model.insert(key, Known::NoBytes);
            }
            if ticket.abandoned() {
                std::mem::forget(_src);
            }
            Ok(())
        }
        Pending::Read { key, ticket, dst, want } => {
            let r = c.store.wait(&ticket);
            finish_read(c, key, &ticket, dst, &want, r, c.shared)
        }
        Pending::External(x) => end_external(c, x, Some(model)),
    }
}

/// Our transfers in flight. Those begun outside the store end when it drops (after an error or
/// a panic), or dropping the store would wait for them forever.
struct InFlight<'a> {
    store: &'a Store,
    list: Vec<Pending>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        for p in self.list.drain(..) {
            if let Pending::External(x) = p {
                let _ = self.store.end_external(x.key, Err(Error::External("the run stopped".into())));
            }
        }
    }
}

/// One thread's run over its own keys (and reads of `shared`).
fn thread_ops(c: &mut Ctx, ops: usize, shared: &[(u64, Arc<Vec<u8>>)]) -> Check {
    let mut pending = InFlight { store: c.store, list: Vec::new() };
    thread_ops_in(c, ops, shared, &mut pending.list)
}

/// The body of `thread_ops`, leaving in `pending` what it has not finished.
fn thread_ops_in(c: &mut Ctx, ops: usize, shared: &[(u64, Arc<Vec<u8>>)], pending: &mut Vec<Pending>) -> Check {
    let mut model: BTreeMap<u64, Known> = BTreeMap::new();
    for i in 0..ops {
        c.out.ops += 1;
        let keys: Vec<u64> = model.keys().copied().collect();
        if i % 16 == 0 {
            c.store.set_group(i as u64 / 16); // a forward every 16 ops (no draw: seeds keep their runs)
        }
        let roll = c.rng.below(100);
        let r = if roll < 30 || keys.is_empty() {
            put(c, &mut model, pending)
        } else if roll < 55 && !shared.is_empty() {
            let (key, want) = c.rng.pick(shared).clone();
            c.read(key, &Known::Bytes(want), true, pending)
        } else if roll < 65 {
            let key = *c.rng.pick(&keys);
            // A key with a write of ours in flight is read only after it: the caller keeps its
            // bytes until then anyway. An external transfer ends first: reads wait for its end.
            let writes = |p: &Pending| matches!(p, Pending::Write { .. } | Pending::External(_));
            settle_key(c, key, writes, pending, &mut model)?;
            let known = std::mem::replace(model.get_mut(&key).expect("a live key"), Known::NoBytes);
            let r = c.read(key, &known, false, pending);
            model.insert(key, known);
            r
        } else if roll < 75 {
            let key = *c.rng.pick(&keys);
            let external = |p: &Pending| matches!(p, Pending::External(_));
            settle_key(c, key, external, pending, &mut model)?;
            match c.store.evict(key) {
                Ok(()) => Ok(()),
                Err(e) => c.allowed(&e, "evict", false),
            }
        } else if roll < 90 {
            let key = *c.rng.pick(&keys);
            // Transfers of it in flight finish first (their bytes are checked), but a discard
            // leaves an external one pending: the entry goes at once, its space when it ends.
            let discard = c.rng.chance(0.5);
            let first = |p: &Pending| !(discard && matches!(p, Pending::External(_)));
            settle_key(c, key, first, pending, &mut model)?;
            model.remove(&key);
            for p in pending.iter_mut() {
                if let Pending::External(x) = p {
                    x.discarded |= x.key == key;
                }
            }
            let r = if discard { c.store.discard(key) } else { c.store.free(key) };
            r.map_err(|e| format!("free of key {key}: {e}"))?;
            match c.store.len_of(key) {
                Err(Error::UnknownKey(_)) => Ok(()),
                other => Err(format!("key {key} is still known after its free: {other:?}")),
            }
        } else if roll < 95 && !pending.is_empty() {
            let j = c.rng.below(pending.len() as u64) as usize;
            let p = pending.swap_remove(j);
            settle(c, p, &mut model)
        } else {
            match c.store.flush() {
                Ok(()) => Ok(()),
                Err(e) => c.allowed(&e, "flush", false),
            }
        };
        r.map_err(|e| format!("op {i}: {e}"))?;
        c.store.check_books().map_err(|e| format!("op {i}: {e}"))?;
    }
    if c.close_early {
        // Closed with the store's transfers in flight: close waits for them, and then refuses
        // use. External ones end first: close would wait for their ends forever.
        while let Some(j) = pending.iter().position(|p| matches!(p, Pending::External(_))) {
            let p = pending.swap_remove(j);
            settle(c, p, &mut model)?;
        }
        match c.store.close() {
            Ok(()) => {}
            Err(e) => c.allowed(&e, "close", false)?,
        }
        for p in pending.drain(..) {
            match p {
                Pending::Read { ticket, .. } | Pending::Write { ticket, .. } if !ticket.is_done() => {
                    return Err(format!("close returned with a transfer in flight (ticket {ticket:p})"));
                }
                Pending::Read { key, ticket, dst, want } => {
                    let r = ticket.poll().expect("done");
                    finish_read(c, key, &ticket, dst, &want, r, false)?;
                }
                _ => {}
            }
        }
        return match c.store.acquire(0) {
            Err(Error::Closed) => Ok(()),
            other => Err(format!("a closed store answered {other:?}")),
        };
    }
    while let Some(p) = pending.pop() {
        settle(c, p, &mut model)?;
    }
    for key in model.into_keys() {
        c.store.free(key).map_err(|e| format!("free of key {key} at the end: {e}"))?;
    }
    Ok(())
}

fn setup(w: &Workload, rng: &mut Rng) -> (StoreConfig, Vec<SimConfig>, u64) {
    let ndev = 1 + rng.below(3) as usize;
    let arena = *rng.pick(&[0u64, 16 << 10, 64 << 10, 256 << 10, 1 << 20]);
    let devices = (0..ndev)
        .map(|i| DeviceConfig {
            path: PathBuf::from(format!("/sim/dev{i}")),
            capacity: *rng.pick(&[256u64 << 10, 1 << 20, 4 << 20, 64 << 20]),
        })
        .collect();
    let cfg = StoreConfig {
        host_capacity: arena,
        devices,
        backend: Backend::Auto,
        block_size: *rng.pick(&[4096u64, 16 << 10, 64 << 10]),
        eviction: *rng.pick(&[Eviction::Lifetime, Eviction::Lru, Eviction::Fifo]),
        ..Default::default()
    };
    let faults = w.faults && rng.chance(0.8);
    let threaded = (w.threads > 1).then(|| Duration::from_micros(rng.below(200)));
    let sims = (0..ndev)
        .map(|i| {
            let mut s = SimConfig::quiet(rng.next_u64() ^ i as u64);
            s.threaded = threaded;
            if faults {
                s.p_eio = *rng.pick(&[0.0, 0.002, 0.02]);
                s.p_enospc = *rng.pick(&[0.0, 0.0, 0.01]);
                s.p_short = *rng.pick(&[0.0, 0.1, 0.3]);
                s.p_again = *rng.pick(&[0.0, 0.05]);
                if rng.chance(0.25) {
                    s.fail_after = Some(rng.below(400));
                    s.abandon = rng.chance(0.5);
                }
            } else {
                s.p_short = *rng.pick(&[0.0, 0.2]);
            }
            s
        })
        .collect();
    let max_len = (arena / 3).clamp(4 << 10, 96 << 10);
    (cfg, sims, max_len)
}

/// Run one seed; the error says what went wrong (the caller prints the seed).
pub fn run(w: &Workload) -> Result<Outcome, String> {
    let mut rng = Rng::new(w.seed);
    let (cfg, sims, max_len) = setup(w, &mut rng);
    let arena = cfg.host_capacity;
    let sims: Vec<SimQueue> = cfg.devices.iter().zip(sims).map(|(d, s)| SimQueue::new(d.path.clone(), s)).collect();
    let files: Vec<SimFile> = sims.iter().map(SimQueue::file).collect();
    let queues = sims.into_iter().map(|q| Box::new(q) as Box<dyn crate::engine::IoQueue>).collect();
    let store = Store::with_queues(cfg, queues, "sim").map_err(|e| e.to_string())?;
    if store.device_fds() != vec![None; files.len()] {
        return Err(format!("a simulated device has a file descriptor: {:?}", store.device_fds()));
    }
    let faults = w.faults;
    let close_early = w.threads == 1 && rng.chance(0.2);
    let mk = |seed: u64, shared: bool| Ctx {
        store: &store,
        files: &files,
        rng: Rng::new(seed),
        faults,
        shared,
        close_early: close_early && !shared,
        out: Outcome::default(),
        arena,
        max_len,
    };

    // Entries every thread reads (written before the threads start).
    let mut shared: Vec<(u64, Arc<Vec<u8>>)> = Vec::new();
    if w.threads > 1 {
        let mut c = mk(rng.next_u64(), true);
        for _ in 0..4 {
            let len = c.len();
            let data = c.data(len);
            if let Ok(k) =
                store.put_with(len, &mut |off, dst| dst.copy_from_slice(&data[off as usize..off as usize + dst.len()]))
            {
                shared.push((k, data));
            }
        }
    }
    let seeds: Vec<u64> = (0..w.threads).map(|_| rng.next_u64()).collect();
    let results: Vec<Result<Outcome, String>> = if w.threads == 1 {
        let mut c = mk(seeds[0], false);
        vec![thread_ops(&mut c, w.ops, &shared).map(|_| c.out)]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = seeds
                .iter()
                .map(|&seed| {
                    let shared = &shared;
                    let mut c = mk(seed, true);
                    s.spawn(move || thread_ops(&mut c, w.ops, shared).map(|_| c.out))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into()))).collect()
        })
    };
    let mut out = Outcome::default();
    for r in results {
        let o = r?;
        out.ops += o.ops;
        out.bytes_checked += o.bytes_checked;
        out.errors_allowed += o.errors_allowed;
        out.external += o.external;
        out.store_failed |= o.store_failed;
    }
    if close_early {
        return Ok(out);
    }
    for (k, _) in shared {
        store.free(k).map_err(|e| format!("free of shared key {k}: {e}"))?;
    }
    store.quiesce().map_err(|e| format!("quiesce: {e}"))?; // discarded entries' transfers end
    let st = store.stats();
    out.quarantined_bytes = st.quarantined_bytes;
    out.store_failed |= st.failure.is_some();
    if st.entries != 0 || st.host_used + st.nvme_used != st.quarantined_bytes {
        return Err(format!(
            "after freeing everything: {} entries, host {} and NVMe {} bytes in use, {} quarantined",
            st.entries, st.host_used, st.nvme_used, st.quarantined_bytes
        ));
    }
    if st.quarantined_bytes > 0 && !out.store_failed {
        return Err(format!("{} bytes quarantined, yet no engine failed", st.quarantined_bytes));
    }
    match store.close() {
        Ok(()) => {}
        // The error of a background write that nobody waited on is reported once, here.
        Err(Error::Io { errno, .. }) if faults && [libc::EIO, libc::ENOSPC].contains(&errno) => {}
        Err(e) => return Err(format!("close: {e}")),
    }
    Ok(out)
}
