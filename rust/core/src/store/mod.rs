//! The tiered byte store: entries live in the host arena and move to NVMe
//! files under arena pressure or on request. It knows bytes, never tensors.
//!
//! Words: a "slot" is an entry's range of the host arena; "staged" transfers
//! stream through the staging buffer (entries with no slot); "zero copy" ones
//! (`write_from`, `read_into`) go between NVMe and caller memory directly;
//! "O_DIRECT" is only ever the file flag.

mod config;
mod entry;
mod evict;
mod inner;
mod placement;
mod stats;
mod transfer;

pub use config::{Backend, DeviceConfig, Eviction, StoreConfig};
pub use placement::Extent;
pub use stats::Stats;

use crate::alloc::RangeAllocator;
use crate::arena::Arena;
use crate::device::{DeviceFile, ALIGN};
use crate::engine::{Dir, IoQueue, PosixQueue, Throttle, UringQueue};
use crate::error::{Error, Result};
use crate::ticket::{Owner, Ticket};
use entry::{ReadDst, State, WriteSrc};
use evict::Room;
use inner::{Inner, Status};
use placement::{Piece, Space};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use transfer::{Mem, Staging, FIXED_BUF};

struct Device {
    // Dropped first: the queue's threads are joined before the file closes.
    queue: Box<dyn IoQueue>,
    /// None for a simulated device.
    file: Option<DeviceFile>,
}

pub struct Store {
    inner: Mutex<Inner>,
    // Emptied by close(). Field order matters on drop: the queues (and their threads) go
    // before staging and the arena.
    devices: RwLock<Vec<Device>>,
    staging: Mutex<Staging>,
    arena: Arena,
    cfg: StoreConfig,
    backend_name: &'static str,
    notices: Mutex<Vec<String>>,
    /// The fork generation it was made in (`fork`): a fork child never uses it.
    born: crate::fork::Born,
}

/// An entry's pieces handed out for a transfer outside the store, counted as the engine's are.
fn external(g: &mut Inner, pieces: &[Piece], dir: Dir) -> Vec<Extent> {
    for p in pieces {
        g.stats.count_io(dir, p.dev, p.len, 1);
    }
    pieces.iter().map(|p| Extent { dev: p.dev, file_off: p.file_off, entry_off: p.entry_off, len: p.len }).collect()
}

/// A null caller buffer with bytes to move is refused (a zero tensor, say, has no storage).
fn null_check(p: *const u8, len: u64) -> Result<()> {
    if p.is_null() && len > 0 {
        return Err(Error::Invalid(format!("a null buffer for {len} bytes")));
    }
    Ok(())
}

/// A filler that copies from `src` (the entry's bytes, `off` in).
///
/// # Safety
/// `src` must be valid for reads of the entry's length while the filler is used.
unsafe fn copy_from(src: *const u8) -> impl FnMut(u64, &mut [u8]) {
    // Safety: passed on from this function's contract.
    move |off, dst| unsafe { std::ptr::copy_nonoverlapping(src.add(off as usize), dst.as_mut_ptr(), dst.len()) }
}

fn aligned(p: *const u8, what: &str) -> Result<()> {
    if (p as u64) % ALIGN != 0 {
        return Err(Error::Invalid(format!("{what} needs a {ALIGN}-byte aligned buffer")));
    }
    Ok(())
}

/// What a wait requires of the store when it takes the lock again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    /// Taking work: not failed, not closed.
    Open,
    /// Giving things back (free): only not closed.
    NotClosed,
}

impl Store {
    pub fn new(cfg: StoreConfig) -> Result<Self> {
        cfg.validate()?;
        let mut notices = Vec::new();
        let arena = Arena::new(cfg.host_capacity as usize)?;
        if cfg.huge_pages {
            if let Err(e) = arena.advise_huge() {
                notices.push(format!("host.huge_pages: the kernel refused huge pages ({e}); small pages"));
            }
        }
        let buffers: Vec<(*mut u8, usize)> = if cfg.fixed_buffers && !arena.is_empty() {
            (0..arena.len() as u64)
                .step_by(FIXED_BUF as usize)
                // Safety: off < arena.len().
                .map(|off| {
                    (unsafe { arena.as_ptr().add(off as usize) }, (arena.len() as u64 - off).min(FIXED_BUF) as usize)
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut devices = Vec::new();
        let mut backend_name = "posix";
        let mut backend = cfg.backend;
        for d in &cfg.devices {
            // One cap per directory: each imitates its own slow disk.
            let throttle = Throttle::new(cfg.throttle_bytes_per_sec);
            let file = DeviceFile::open(&d.path, cfg.o_direct, &mut notices)?;
            let fd = file.raw_fd();
            let queue: Box<dyn IoQueue> = loop {
                if backend == Backend::Posix {
                    // Safety: the file outlives the queue (Device drops its queue first).
                    let q = unsafe { PosixQueue::new(fd, d.path.clone(), cfg.threads, throttle) }
                        .map_err(|e| Error::Config(format!("cannot start I/O threads: {e}")))?;
                    break Box::new(q);
                }
                let res = if std::env::var_os("SSDTIER_DISABLE_IO_URING").is_some() {
                    Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
                } else {
                    // Safety: the file outlives the queue, and the arena outlives every device
                    // (close() and Store's field order drop the devices first).
                    unsafe {
                        UringQueue::new(fd, d.path.clone(), cfg.queue_depth, &buffers, throttle.clone(), &mut notices)
                    }
                };
                match res {
                    Ok(q) => {
                        backend_name = "io_uring";
                        break Box::new(q);
                    }
                    Err(e) if backend == Backend::Auto => {
                        notices.push(format!("io_uring is not available ({e}); using the POSIX thread-pool backend"));
                        backend = Backend::Posix;
                    }
                    Err(e) => {
                        return Err(Error::Config(format!(
                            "io.backend = \"io_uring\" but io_uring cannot be set up: {e} \
                             (use backend = \"auto\" or \"posix\")"
                        )))
                    }
                }
            };
            devices.push(Device { queue, file: Some(file) });
        }
        Self::build(cfg, arena, devices, backend_name, notices)
    }

    /// A store over the given queues, one per configured device, with no files: for
    /// simulated engines (see [`crate::sim`]).
    pub fn with_queues(cfg: StoreConfig, queues: Vec<Box<dyn IoQueue>>, name: &'static str) -> Result<Self> {
        cfg.validate()?;
        if queues.len() != cfg.devices.len() {
            return Err(Error::Config(format!("{} queues for {} devices", queues.len(), cfg.devices.len())));
        }
        let arena = Arena::new(cfg.host_capacity as usize)?;
        let devices = queues.into_iter().map(|queue| Device { queue, file: None }).collect();
        Self::build(cfg, arena, devices, name, Vec::new())
    }

    fn build(
        cfg: StoreConfig,
        arena: Arena,
        devices: Vec<Device>,
        backend_name: &'static str,
        notices: Vec<String>,
    ) -> Result<Self> {
        // Streams entries that do not fit in the arena: a few blocks in flight at once.
        let staging = Arena::new((cfg.block_size * 8) as usize)?;
        let n = devices.len();
        // The files stay open while the store is: close() drops them only once it is closed,
        // and a closed store allocates nothing.
        let files = devices.iter().map(|d| d.file.as_ref().map(DeviceFile::raw_fd));
        let space = Space::new(
            cfg.devices.iter().zip(files).map(|(d, fd)| (d.path.clone(), d.capacity, fd)).collect(),
            cfg.prealloc_step,
        );
        let host = RangeAllocator::new(arena.len() as u64, ALIGN);
        let stats = Stats {
            host_capacity: host.capacity(),
            nvme_capacity: space.capacity(),
            device_bytes_written: vec![0; n],
            device_bytes_read: vec![0; n],
            ..Default::default()
        };
        Ok(Store {
            inner: Mutex::new(Inner::new(host, space, stats, cfg.eviction)),
            devices: RwLock::new(devices),
            staging: Mutex::new(Staging { buf: staging, lost: false }),
            arena,
            cfg,
            backend_name,
            notices: Mutex::new(notices),
            born: crate::fork::Born::now(),
        })
    }

    // ------------------------------------------------------------ accessors

    pub fn arena_ptr(&self) -> *mut u8 {
        self.arena.as_ptr()
    }
    pub fn arena_len(&self) -> usize {
        self.arena.len()
    }
    pub fn host_used(&self) -> u64 {
        if self.forked() {
            return 0;
        }
        self.lock_any().host.used()
    }
    /// Seconds spent waiting on transfers so far (cheap: no full stats).
    pub fn wait_seconds(&self) -> f64 {
        if self.forked() {
            return 0.0;
        }
        self.lock_any().stats.wait_seconds
    }
    pub fn backend(&self) -> &'static str {
        self.backend_name
    }
    pub fn fixed_buffers(&self) -> bool {
        let devs = self.devices.read().unwrap_or_else(PoisonError::into_inner);
        !devs.is_empty() && devs.iter().all(|d| d.queue.fixed_buffers())
    }
    /// Whether each device's file uses O_DIRECT.
    pub fn o_direct(&self) -> Vec<bool> {
        let devs = self.devices.read().unwrap_or_else(PoisonError::into_inner);
        devs.iter().map(|d| d.file.as_ref().is_some_and(|f| f.direct)).collect()
    }
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }
    /// Fallbacks taken so far (each reported once), drained.
    pub fn take_notices(&self) -> Vec<String> {
        std::mem::take(&mut *self.notices.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Counters from zero and peaks from now, for a store that serves another user.
    pub fn reset_counters(&self) {
        if !self.forked() {
            self.lock_any().reset_counters();
        }
    }

    /// Zeros in a fork child (its books are the parent's).
    pub fn stats(&self) -> Stats {
        if self.forked() {
            return Stats::default();
        }
        let mut g = self.lock_any();
        g.reap();
        let mut s = g.snapshot();
        let devs = self.devices.read().unwrap_or_else(PoisonError::into_inner);
        // After close the files are gone: their size is 0.
        s.device_file_size = (0..self.cfg.devices.len())
            .map(|i| devs.get(i).and_then(|d| d.file.as_ref()).map_or(0, |f| f.size()))
            .collect();
        s
    }

    /// Length of an entry in bytes.
    pub fn len_of(&self, key: u64) -> Result<u64> {
        let g = self.lock_for(Need::NotClosed)?;
        Ok(g.get(key)?.len)
    }

    /// Where an entry's bytes are: (in the host arena, or on their way there; on NVMe).
    pub fn location(&self, key: u64) -> Result<(bool, bool)> {
        let mut g = self.lock_for(Need::NotClosed)?;
        g.reap();
        let e = g.get(key)?;
        Ok((e.has_slot(), e.on_nvme()))
    }

    /// The lock, whatever the store's status. A panic under it (a bug) leaves books that
    /// cannot be trusted: the store then refuses new work.
    fn lock_any(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| {
            let mut g = poisoned.into_inner();
            g.fail("a panic inside the store left its books in doubt".into());
            g
        })
    }

    /// True in a child forked after the store was made: its threads, rings and locks are the
    /// parent's, so every call that needs them fails with [`Error::Forked`].
    pub fn forked(&self) -> bool {
        self.born.forked()
    }

    fn lock_for(&self, need: Need) -> Result<MutexGuard<'_, Inner>> {
        if self.forked() {
            return Err(Error::Forked);
        }
        let g = self.lock_any();
        match (&g.status, need) {
            (Status::Closed, _) | (Status::Closing, Need::Open) => Err(Error::Closed),
            (Status::Failed(why), Need::Open) => Err(Error::Failed(why.clone())),
            _ => Ok(g),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.lock_for(Need::Open)
    }

    /// Wait for a transfer (driving simulated engines meanwhile); the transfer's outcome.
    pub fn wait(&self, t: &Ticket) -> Result<()> {
        self.wait_io(t)
    }

    // ------------------------------------------------------------ put side

    /// Entries put from now on belong to `group` (a forward). The lifetime policy takes groups
    /// to be used in the order they were put, each one's entries in reverse (pipeline schedules).
    pub fn set_group(&self, group: u64) {
        if self.forked() {
            return;
        }
        self.lock_any().group = group;
    }

    /// Create an entry of `len` bytes. Returns its key and the arena offset of its slot,
    /// which the caller fills and then passes to [`Store::commit`]; None means the entry does
    /// not fit in the host tier, and the caller writes it with [`Store::write_staged`].
    pub fn reserve(&self, len: u64) -> Result<(u64, Option<u64>)> {
        let g = self.lock()?;
        let (mut g, slot) = self.make_room(g, len, Room::Put)?;
        let off = slot.as_ref().map(|s| s.off());
        let state = match slot {
            Some(slot) => State::Filling { slot },
            None if len == 0 => State::Empty,
            None => State::NoBytes,
        };
        let e = g.new_entry(len, state);
        Ok((g.insert(e), off))
    }

    /// Create an entry of `len` bytes with no arena slot, for a write outside the store
    /// ([`Store::begin_external_write`]) or through staging: its key.
    pub fn reserve_unslotted(&self, len: u64) -> Result<u64> {
        let mut g = self.lock()?;
        let state = if len == 0 { State::Empty } else { State::NoBytes };
        let e = g.new_entry(len, state);
        Ok(g.insert(e))
    }

    /// The slot of a reserved entry is filled: it may now be evicted.
    pub fn commit(&self, key: u64) -> Result<()> {
        let mut g = self.lock()?;
        let mut e = g.take(key)?;
        e.state = match std::mem::replace(&mut e.state, State::Empty) {
            State::Filling { slot } => State::Host { slot },
            other => {
                e.state = other;
                g.put_back(key, e);
                return Err(Error::Invalid(format!("entry {key} is not being filled")));
            }
        };
        g.stats.host_bytes_in += e.len;
        g.stats.host_puts += 1;
        g.put_back(key, e);
        Ok(())
    }

    /// Create an entry of `len` bytes filled by `fill(entry_offset, bytes)`: once for an
    /// arena slot, or batch by batch through staging when it does not fit in the host tier.
    /// Returns its key once the bytes are stored; on an error no entry is left behind.
    pub fn put_with(&self, len: u64, fill: &mut dyn FnMut(u64, &mut [u8])) -> Result<u64> {
        let (key, slot) = self.reserve(len)?;
        let res = match slot {
            Some(off) => {
                // Safety: the slot holds `len` bytes and is the caller's alone while it is filled.
                fill(0, unsafe { std::slice::from_raw_parts_mut(self.arena.as_ptr().add(off as usize), len as usize) });
                self.commit(key)
            }
            None => self.write_staged_with(key, fill),
        };
        match res {
            Ok(()) => Ok(key),
            Err(e) => {
                let _ = self.free(key);
                Err(e)
            }
        }
    }

    /// [`Store::put_with`] copying from `src`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes for the whole call.
    pub unsafe fn put_from(&self, src: *const u8, len: u64) -> Result<u64> {
        null_check(src, len)?;
        // Safety: src is valid for len bytes (this function's contract).
        self.put_with(len, &mut unsafe { copy_from(src) })
    }

    /// Write an entry reserved without a slot to NVMe through the staging buffer, its bytes
    /// given batch by batch by `fill(entry_offset, bytes)`. Blocks until written.
    pub fn write_staged_with(&self, key: u64, fill: &mut dyn FnMut(u64, &mut [u8])) -> Result<()> {
        let mut g = self.lock()?;
        g.reap();
        let mut e = g.take(key)?;
        if !matches!(e.state, State::NoBytes) {
            let empty = matches!(e.state, State::Empty);
            g.put_back(key, e);
            return if empty { Ok(()) } else { Err(Error::Invalid(format!("entry {key} already has its bytes"))) };
        }
        let len = e.len;
        let disk = match self.alloc_disk(&mut g, len) {
            Ok(d) => d,
            Err(err) => {
                g.put_back(key, e);
                return Err(err);
            }
        };
        let pieces = disk.pieces.clone();
        let marker = Ticket::new(1);
        e.state = State::Writing { src: WriteSrc::Staged, disk, io: marker.clone() };
        g.put_back(key, e);
        drop(g);
        let res = self.stream(&pieces, Dir::Write, len, fill);
        self.end_staged(key, &marker, &res, |g| g.stats.staged_puts += 1);
        res
    }

    /// [`Store::write_staged_with`] copying from `src`.
    ///
    /// # Safety
    /// `src` must be valid for reads of the entry's length for the whole call.
    pub unsafe fn write_staged(&self, key: u64, src: *const u8) -> Result<()> {
        null_check(src, self.len_of(key)?)?;
        // Safety: src is valid for the entry's length (this function's contract).
        self.write_staged_with(key, &mut unsafe { copy_from(src) })
    }

    /// Begin writing an entry reserved without a slot (`reserve` gave None) outside the
    /// store, as cuFile does from GPU memory: its NVMe extents, covering its length rounded
    /// up to 4096. The caller writes them to the files of [`Store::device_fds`] and then must
    /// call [`Store::end_external`]; until then `free` and `close` wait for it.
    pub fn begin_external_write(&self, key: u64) -> Result<Vec<Extent>> {
        let mut g = self.lock()?;
        g.reap();
        let mut e = g.take(key)?;
        if !matches!(e.state, State::NoBytes) {
            g.put_back(key, e);
            return Err(Error::Invalid(format!("entry {key} is not reserved without a slot and bytes")));
        }
        let disk = match self.alloc_disk(&mut g, e.len) {
            Ok(d) => d,
            Err(err) => {
                g.put_back(key, e);
                return Err(err);
            }
        };
        let extents = external(&mut g, &disk.pieces, Dir::Write);
        e.state = State::Writing { src: WriteSrc::External, disk, io: Ticket::new(1) };
        g.put_back(key, e);
        Ok(extents)
    }

    /// Begin reading an entry that is on NVMe only outside the store (cuFile, into GPU
    /// memory): its extents, as for [`Store::begin_external_write`]; a write in flight is
    /// waited for first. [`Store::end_external`] must follow.
    pub fn begin_external_read(&self, key: u64) -> Result<Vec<Extent>> {
        let mut g = self.settle(self.lock()?, key)?;
        let (mut e, disk) = g.take_disk(key, "is not on NVMe only")?;
        let extents = external(&mut g, &disk.pieces, Dir::Read);
        e.state = State::Reading { dst: ReadDst::External, disk, io: Ticket::new(1) };
        g.stats.nvme_hits += 1;
        g.put_back(key, e);
        Ok(extents)
    }

    /// The transfer begun by `begin_external_*` ended with `res`. A failed write leaves the
    /// entry without bytes (its caller still has them); a failed read leaves it on NVMe.
    pub fn end_external(&self, key: u64, res: Result<()>) -> Result<()> {
        if self.forked() {
            return Err(Error::Forked);
        }
        let marker = {
            let g = self.lock_any();
            match &g.get_any(key)?.state {
                // a discarded entry too: its space waits for this
                State::Writing { src: WriteSrc::External, io, .. }
                | State::Reading { dst: ReadDst::External, io, .. } => io.clone(),
                _ => return Err(Error::Invalid(format!("entry {key} has no transfer outside the store"))),
            }
        };
        self.end_staged(key, &marker, &res, |_| {});
        res
    }

    /// The file of each device, for transfers outside the store; open until `close`.
    pub fn device_fds(&self) -> Vec<Option<RawFd>> {
        let devs = self.devices.read().unwrap_or_else(PoisonError::into_inner);
        devs.iter().map(|d| d.file.as_ref().map(|f| f.raw_fd())).collect()
    }

    /// A staged transfer ended: the entry's new state, then its marker completes.
    fn end_staged(&self, key: u64, marker: &Ticket, res: &Result<()>, count: impl FnOnce(&mut Inner)) {
        let lost = self.staging.lock().unwrap_or_else(PoisonError::into_inner).lost;
        let mut g = self.lock_any();
        // The marker keeps the entry: free and close wait for it.
        if let Ok(mut e) = g.take(key) {
            e.state = match (std::mem::replace(&mut e.state, State::Empty), res) {
                (State::Writing { disk, .. }, Ok(())) => State::Disk { disk },
                (State::Writing { disk, .. }, Err(err)) => {
                    if lost {
                        g.space.quarantine(disk);
                    } else {
                        g.free_disk(disk);
                    }
                    g.note_error(err);
                    State::NoBytes
                }
                (State::Reading { disk, .. }, res) => {
                    if let Err(err) = res {
                        g.note_error(err);
                    }
                    State::Disk { disk }
                }
                (other, _) => other,
            };
            if res.is_ok() {
                count(&mut g);
            }
            g.settle(key, e);
        }
        marker.complete(Ok(()));
    }

    /// Create an entry of `len` bytes and write it to NVMe straight from caller memory,
    /// without a copy into the arena. Returns its key and the write's ticket at once; the
    /// ticket holds `owner` until the write is done. The bytes waiting in caller memory are
    /// bounded by the host capacity: while earlier writes from caller memory fill it, this
    /// waits for the oldest (one write may always be in flight).
    ///
    /// A failed write is reported through the ticket only (not deferred to `flush`): the
    /// entry then has no bytes and the caller, who still has them, frees it.
    ///
    /// # Safety
    /// `src` must be 4096-aligned and valid for reads of `len` rounded up to 4096 bytes, and
    /// unchanged, while `owner` lives (or, without one, until the ticket is done). The bytes
    /// past `len` are written to the file too (whatever they hold) and never read back as data.
    pub unsafe fn write_from(&self, src: *const u8, len: u64, owner: Option<Owner>) -> Result<(u64, Arc<Ticket>)> {
        null_check(src, len)?;
        aligned(src, "write_from")?;
        let rounded = len.div_ceil(ALIGN) * ALIGN;
        let mut g = self.lock()?;
        loop {
            g.reap();
            if g.books.caller_bytes == 0 || g.books.caller_bytes + rounded <= g.host.capacity() {
                break;
            }
            let Some(t) = g.oldest_write(|e| e.caller_held() > 0) else { break };
            g = self.wait_unlocked(g, &t)?.0;
        }
        g.stats.zero_copy_puts += 1;
        if len == 0 {
            let e = g.new_entry(0, State::Empty);
            return Ok((g.insert(e), Ticket::done()));
        }
        let disk = self.alloc_disk(&mut g, len)?;
        // Safety: passed on from this function's contract; the ticket holds the owner.
        let io = unsafe { self.submit_pieces(&mut g, &disk.pieces, Dir::Write, Mem::Caller(src as *mut u8), owner) };
        let e = g.new_entry(len, State::Writing { src: WriteSrc::Caller, disk, io: io.clone() });
        let key = g.insert(e);
        Ok((key, io))
    }

    // ------------------------------------------------------------ get side

    /// Wait (with the lock released) while the entry has a read in flight, or a write that
    /// makes it readable (its only copy is on its way to NVMe). Busy while it is filled.
    fn settle<'a>(&'a self, mut g: MutexGuard<'a, Inner>, key: u64) -> Result<MutexGuard<'a, Inner>> {
        loop {
            g.reap();
            let e = g.get(key)?;
            let io = match &e.state {
                State::Filling { .. } => return Err(Error::Busy { key, what: "it is still being filled" }),
                State::Reading { io, .. }
                | State::Writing { src: WriteSrc::Caller | WriteSrc::Staged | WriteSrc::External, io, .. } => {
                    io.clone()
                }
                _ => return Ok(g),
            };
            let (g2, r) = self.wait_unlocked(g, &io)?;
            g = g2;
            r?;
        }
    }

    /// Make the entry resident in the host tier (reading it back if needed) and pin it;
    /// returns its arena offset, or None if it cannot get a slot (then use
    /// [`Store::read_staged`]). Pair with [`Store::release`].
    pub fn acquire(&self, key: u64) -> Result<Option<u64>> {
        let mut g = self.lock()?;
        loop {
            g = self.settle(g, key)?;
            let e = g.get(key)?;
            let len = e.len;
            if let Some(off) = e.readable_slot() {
                let seq = g.next_seq();
                let mut e = g.take(key)?;
                e.pins += 1;
                e.prefetched = false;
                e.access_seq = seq;
                e.set_evict(false);
                g.put_back(key, e);
                g.stats.host_bytes_out += len;
                g.stats.host_gets += 1;
                g.stats.host_hits += 1;
                return Ok(Some(off));
            }
            match e.state {
                State::Empty => return Ok(None),
                State::NoBytes => return Err(Error::Invalid(format!("entry {key} has no bytes"))),
                _ => {}
            }
            // On NVMe only: read it into a slot. A read never displaces read-ahead entries:
            // without a slot it streams past the arena.
            let (g2, slot) = self.make_room(g, len, Room::Read)?;
            g = g2;
            let Some(slot) = slot else { return Ok(None) };
            // The lock may have been released: read only if the entry is still on NVMe only.
            match g.get(key).map(|e| matches!(e.state, State::Disk { .. })) {
                Ok(true) => {}
                other => {
                    g.free_slot(slot);
                    other?;
                    continue;
                }
            }
            let mut e = g.take(key)?;
            let State::Disk { disk } = std::mem::replace(&mut e.state, State::Empty) else { unreachable!() };
            self.start_read(&mut g, &mut e, disk, slot);
            let io = e.io().cloned().expect("a read just started");
            g.put_back(key, e);
            g.stats.nvme_hits += 1;
            let (g2, r) = self.wait_unlocked(g, &io)?;
            g = g2;
            r?;
        }
    }

    /// Unpin an entry acquired with [`Store::acquire`].
    pub fn release(&self, key: u64) -> Result<()> {
        let mut g = self.lock_for(Need::NotClosed)?;
        let mut e = g.take(key)?;
        let pinned = e.pins > 0;
        e.pins = e.pins.saturating_sub(1);
        g.put_back(key, e);
        if pinned {
            Ok(())
        } else {
            Err(Error::Invalid(format!("entry {key} is not acquired")))
        }
    }

    /// Read an entry into caller memory, batch by batch through `take(entry_offset, bytes)`:
    /// from its slot if it has one, else from NVMe through the staging buffer.
    pub fn read_staged_with(&self, key: u64, take: &mut dyn FnMut(u64, &mut [u8])) -> Result<()> {
        let mut g = self.settle(self.lock()?, key)?;
        let e = g.get(key)?;
        let len = e.len;
        if let Some(off) = e.readable_slot() {
            // Pinned and copied without the lock: `take` may wait for the caller's own locks.
            let mut e = g.take(key)?;
            e.pins += 1;
            e.prefetched = false;
            g.put_back(key, e);
            drop(g);
            // Safety: the pinned slot holds `len` bytes and is neither freed nor evicted meanwhile.
            take(0, unsafe { std::slice::from_raw_parts_mut(self.arena.as_ptr().add(off as usize), len as usize) });
            let mut g = self.lock_any();
            g.stats.host_hits += 1;
            drop(g);
            return self.release(key);
        }
        if matches!(g.get(key)?.state, State::Empty) {
            return Ok(());
        }
        let (mut e, disk) = g.take_disk(key, "has no bytes")?;
        let pieces = disk.pieces.clone();
        let marker = Ticket::new(1);
        e.state = State::Reading { dst: ReadDst::Staged, disk, io: marker.clone() };
        g.put_back(key, e);
        drop(g);
        let res = self.stream(&pieces, Dir::Read, len, take);
        self.end_staged(key, &marker, &res, |g| {
            g.stats.staged_gets += 1;
            g.stats.nvme_hits += 1;
        });
        res
    }

    /// [`Store::read_staged_with`] into `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of the entry's length for the whole call.
    pub unsafe fn read_staged(&self, key: u64, dst: *mut u8) -> Result<()> {
        null_check(dst, self.len_of(key)?)?;
        // Safety: dst has room for the entry's length (this function's contract).
        self.read_staged_with(key, &mut |off, src| unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(off as usize), src.len())
        })
    }

    /// Read an entry into caller memory without going through the arena. A resident entry
    /// is copied from its slot at once (the ticket is done); otherwise the read from NVMe is
    /// submitted straight into `dst` and the ticket, holding `owner`, completes when it lands.
    /// `room` is how many bytes `dst` holds: less than the entry's length rounded up to 4096
    /// is refused.
    ///
    /// # Safety
    /// `dst` must be 4096-aligned and valid for writes of `room` bytes while `owner` lives (or,
    /// without one, until the ticket is done), and untouched by others until the ticket is done.
    pub unsafe fn read_into(&self, key: u64, dst: *mut u8, room: u64, owner: Option<Owner>) -> Result<Arc<Ticket>> {
        let mut g = self.settle(self.lock()?, key)?;
        let e = g.get(key)?;
        let len = e.len;
        if len == 0 {
            return Ok(Ticket::done());
        }
        null_check(dst, len)?;
        let need = len.div_ceil(ALIGN) * ALIGN;
        if room < need {
            return Err(Error::Invalid(format!("read_into of entry {key} needs {need} bytes of room, got {room}")));
        }
        if let Some(off) = e.readable_slot() {
            let prefetched = e.prefetched;
            // Safety: the slot holds len bytes; dst has room per the contract.
            unsafe { std::ptr::copy_nonoverlapping(self.arena.as_ptr().add(off as usize), dst, len as usize) };
            if prefetched {
                let mut e = g.take(key)?;
                e.prefetched = false; // used: evicted in policy order again
                g.put_back(key, e);
            }
            g.stats.host_hits += 1;
            g.stats.host_bytes_out += len;
            return Ok(Ticket::done());
        }
        aligned(dst, "read_into")?;
        let (mut e, disk) = g.take_disk(key, "has no bytes")?;
        // Safety: passed on from this function's contract; the ticket holds the owner.
        let io = unsafe { self.submit_pieces(&mut g, &disk.pieces, Dir::Read, Mem::Caller(dst), owner) };
        e.state = State::Reading { dst: ReadDst::Caller, disk, io: io.clone() };
        g.put_back(key, e);
        g.stats.nvme_hits += 1;
        Ok(io)
    }

    /// Start reading the entry back into the host tier without waiting; an entry there
    /// already stays until used (its eviction, if under way, is called off). Best effort:
    /// when the arena has no room that can be made without waiting or without evicting an
    /// entry ranked after this one, nothing is read (counted as `prefetch_skipped`).
    pub fn prefetch(&self, key: u64) -> Result<Arc<Ticket>> {
        let mut g = self.lock()?;
        g.reap();
        let e = g.get(key)?;
        match &e.state {
            State::Reading { io, .. } => return Ok(io.clone()),
            State::Disk { .. } if e.len > 0 => {}
            _ if e.readable_slot().is_some() && e.pins == 0 => {
                let mut e = g.take(key)?;
                e.prefetched = true;
                e.set_evict(false);
                g.put_back(key, e);
                return Ok(Ticket::done());
            }
            _ => return Ok(Ticket::done()),
        }
        // Lifetime ranks by need: only what is needed after this entry may make room for it.
        let before = if matches!(g.policy, Eviction::Lifetime) { e.rank(g.policy) } else { u128::MAX };
        let len = e.len;
        let (mut g, slot) = self.make_room(g, len, Room::Ahead { before })?;
        let Some(slot) = slot else {
            g.stats.prefetch_skipped += 1;
            return Ok(Ticket::done());
        };
        let mut e = match g.take(key) {
            Ok(e) if matches!(e.state, State::Disk { .. }) => e,
            other => {
                g.free_slot(slot);
                let e = other?;
                let io = e.io().cloned().unwrap_or_else(Ticket::done);
                g.put_back(key, e);
                return Ok(io);
            }
        };
        let State::Disk { disk } = std::mem::replace(&mut e.state, State::Empty) else { unreachable!() };
        self.start_read(&mut g, &mut e, disk, slot);
        e.prefetched = true;
        let io = e.io().cloned().expect("a read just started");
        g.put_back(key, e);
        g.stats.prefetches += 1;
        Ok(io)
    }

    // ------------------------------------------------------------ evict, free, flush

    /// Make sure the entry's bytes are on NVMe and give up its host slot. Blocks.
    pub fn evict(&self, key: u64) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            g.reap();
            let e = g.get(key)?;
            if e.pins > 0 {
                return Err(Error::Busy { key, what: "it is acquired" });
            }
            match &e.state {
                State::Filling { .. } => return Err(Error::Busy { key, what: "it is still being filled" }),
                State::Empty | State::NoBytes | State::Disk { .. } => return Ok(()),
                State::Writing { .. } | State::Reading { .. } => {
                    let io = e.io().cloned().expect("in flight");
                    let mut e = g.take(key)?;
                    e.set_evict(true);
                    g.put_back(key, e);
                    let (g2, r) = self.wait_unlocked(g, &io)?;
                    g = g2;
                    r?;
                }
                State::Clean { .. } => return g.drop_clean(key),
                State::Host { .. } => {
                    let mut e = g.take(key)?;
                    let State::Host { slot } = std::mem::replace(&mut e.state, State::Empty) else { unreachable!() };
                    if let Err(err) = self.start_write(&mut g, &mut e, slot, true) {
                        g.put_back(key, e);
                        return Err(err);
                    }
                    let io = e.io().cloned().expect("a write just started");
                    g.put_back(key, e);
                    // Its outcome is this call's: a failed write is not started again and again.
                    let (g2, r) = self.wait_unlocked(g, &io)?;
                    g = g2;
                    r?;
                }
            }
        }
    }

    /// Forget an entry and give its space back. Waits for its transfer in flight; refused
    /// while it is acquired. Works on a failed store too.
    pub fn free(&self, key: u64) -> Result<()> {
        let mut g = self.lock_for(Need::NotClosed)?;
        loop {
            g.reap();
            let e = g.get(key)?;
            if e.pins > 0 {
                return Err(Error::Busy { key, what: "it is acquired (release it first)" });
            }
            if let Some(io) = e.io().cloned() {
                g = self.wait_for(g, &io, Need::NotClosed)?.0;
                continue;
            }
            let e = g.take(key)?;
            g.drop_entry(e);
            return Ok(());
        }
    }

    /// Forget an entry without waiting: its space comes back now, or when its transfer in
    /// flight ends. Refused while it is acquired; its key is unknown from now on.
    pub fn discard(&self, key: u64) -> Result<()> {
        let mut g = self.lock_for(Need::NotClosed)?;
        g.reap();
        let mut e = g.take(key)?;
        if e.doomed {
            g.put_back(key, e);
            return Err(Error::UnknownKey(key));
        }
        if e.pins > 0 {
            g.put_back(key, e);
            return Err(Error::Busy { key, what: "it is acquired (release it first)" });
        }
        if e.io().is_some() {
            e.doomed = true;
            g.put_back(key, e);
        } else {
            g.drop_entry(e);
        }
        Ok(())
    }

    /// Wait for every transfer in flight, reads and those of discarded entries included.
    pub fn quiesce(&self) -> Result<()> {
        let mut g = self.lock_for(Need::NotClosed)?;
        loop {
            g.reap();
            let Some(t) = g.any_io() else { return Ok(()) };
            g = self.wait_for(g, &t, Need::NotClosed)?.0;
        }
    }

    /// Whether the books agree with the entries' states (the simulation asks after each op).
    pub(crate) fn check_books(&self) -> std::result::Result<(), String> {
        self.lock_any().check_books()
    }

    /// Wait for every write in flight. Returns the first error of a write that nobody waited on.
    pub fn flush(&self) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            g.reap();
            let Some(t) = g.oldest_write(|_| true) else { break };
            g = self.wait_unlocked(g, &t)?.0;
        }
        g.deferred.take().map_or(Ok(()), Err)
    }

    /// Refuse new work, wait for the transfers in flight, free everything. Idempotent. The
    /// error of a background write nobody waited on is returned; the failure of a failed
    /// store was reported by the calls it refused, so closing it is Ok.
    pub fn close(&self) -> Result<()> {
        if self.forked() {
            return Ok(()); // the parent's to close: nothing here is touched
        }
        let mut g = self.lock_any();
        match g.status {
            Status::Closed => return Ok(()),
            Status::Open => g.status = Status::Closing,
            Status::Closing | Status::Failed(_) => {}
        }
        loop {
            g.reap();
            let Some(t) = g.any_io() else { break };
            drop(g);
            let _ = self.wait_io(&t);
            g = self.lock_any();
        }
        let failed = matches!(g.status, Status::Failed(_));
        let r = g.deferred.take().filter(|_| !failed).map_or(Ok(()), Err);
        g.status = Status::Closed;
        g.clear();
        drop(g);
        // No stream through staging runs once we hold its lock; then the queues (joining their
        // threads) and the files go.
        let _staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        self.devices.write().unwrap_or_else(PoisonError::into_inner).clear();
        r
    }

    fn wait_unlocked<'a>(
        &'a self,
        g: MutexGuard<'a, Inner>,
        t: &Ticket,
    ) -> Result<(MutexGuard<'a, Inner>, Result<()>)> {
        self.wait_for(g, t, Need::Open)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if self.forked() {
            // The queues' threads are not in this process and their rings are the parent's:
            // neither joined nor closed (the arenas are not mapped here either).
            let devices = std::mem::take(self.devices.get_mut().unwrap_or_else(PoisonError::into_inner));
            std::mem::forget(devices);
            return;
        }
        // Wait for transfers in flight before the arena and staging go away.
        let _ = self.close();
    }
}
