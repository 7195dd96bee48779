//! The tiered byte store: entries live in the host arena and move to NVMe
//! files under arena pressure or on request. It knows bytes, never tensors.

use crate::alloc::RangeAllocator;
use crate::arena::Arena;
use crate::device::{DeviceFile, ALIGN};
use crate::engine::{Dir, IoQueue, IoReq, PosixQueue, Throttle, Ticket, UringQueue};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

/// io_uring limits one registered buffer to 1 GiB, so the arena is registered
/// in pieces of this size and no transfer crosses a piece boundary.
const FIXED_BUF: u64 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Auto,
    IoUring,
    Posix,
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Backend::Auto),
            "io_uring" => Ok(Backend::IoUring),
            "posix" => Ok(Backend::Posix),
            _ => Err(Error::Invalid(format!("unknown backend {s:?}: expected auto, io_uring or posix"))),
        }
    }
}

/// Which resident entry the host tier gives up first under pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// The earliest put first: backward needs activations in reverse order, so
    /// the earliest saved is the one needed furthest in the future.
    Lifetime,
    /// The least recently put or read.
    Lru,
    /// The one that entered the host tier first (a read back counts as entering).
    Fifo,
}

impl std::str::FromStr for Eviction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "lifetime" => Ok(Eviction::Lifetime),
            "lru" => Ok(Eviction::Lru),
            "fifo" => Ok(Eviction::Fifo),
            _ => Err(Error::Invalid(format!("unknown eviction policy {s:?}: expected lifetime, lru or fifo"))),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DeviceConfig {
    pub path: PathBuf,
    pub capacity: u64,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub host_capacity: u64,
    pub devices: Vec<DeviceConfig>,
    pub backend: Backend,
    pub queue_depth: u32,
    pub block_size: u64,
    pub direct: bool,
    pub fixed_buffers: bool,
    pub threads: usize,
    pub eviction: Eviction,
    /// Cap on each device's bandwidth in bytes/s, for benchmarks; 0 = none.
    pub throttle_bytes_per_sec: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            host_capacity: 1 << 30,
            devices: Vec::new(),
            backend: Backend::Auto,
            queue_depth: 64,
            block_size: 1 << 20,
            direct: true,
            fixed_buffers: true,
            threads: 4,
            eviction: Eviction::Lifetime,
            throttle_bytes_per_sec: 0,
        }
    }
}

impl StoreConfig {
    fn validate(&self) -> Result<()> {
        if self.devices.is_empty() {
            return Err(Error::Invalid("at least one NVMe directory is needed".into()));
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(Error::Invalid(format!("queue_depth {} is outside 1..=4096", self.queue_depth)));
        }
        if !self.block_size.is_power_of_two() || self.block_size < ALIGN || self.block_size > 64 << 20 {
            return Err(Error::Invalid(format!(
                "block_size {} must be a power of two between 4096 and 64 MiB",
                self.block_size
            )));
        }
        if self.threads == 0 {
            return Err(Error::Invalid("threads must be at least 1".into()));
        }
        for d in &self.devices {
            if d.capacity < ALIGN {
                return Err(Error::Invalid(format!(
                    "capacity of {} is {} bytes; at least 4096 is needed",
                    d.path.display(),
                    d.capacity
                )));
            }
        }
        Ok(())
    }
}

/// Where a transfer's bytes are in memory.
#[derive(Clone, Copy)]
enum Target {
    /// The slot at this arena offset.
    Arena(u64),
    /// Caller memory (page-aligned, the entry's length rounded up to 4096).
    User(*mut u8),
}

/// One range of an entry on one device.
#[derive(Debug, Clone, Copy)]
struct Piece {
    dev: usize,
    file_off: u64,
    /// Offset of these bytes within the entry.
    entry_off: u64,
    len: u64,
}

#[derive(Debug, Clone)]
struct Placement {
    pieces: Vec<Piece>,
    /// Allocator ranges to give back: (device, offset, length).
    ranges: Vec<(usize, u64, u64)>,
}

#[derive(Clone)]
enum Inflight {
    None,
    Write(Arc<Ticket>),
    /// NVMe to the entry's host slot.
    Read(Arc<Ticket>),
    /// NVMe straight into caller memory (`read_into`); the arena is not involved.
    Direct(Arc<Ticket>),
}

impl Inflight {
    fn ticket(&self) -> Option<&Arc<Ticket>> {
        match self {
            Inflight::None => None,
            Inflight::Write(t) | Inflight::Read(t) | Inflight::Direct(t) => Some(t),
        }
    }
}

struct Entry {
    len: u64,
    /// Offset of its slot in the arena.
    host: Option<u64>,
    nvme: Option<Placement>,
    /// The NVMe copy holds the bytes (written, or the source of the host copy).
    nvme_valid: bool,
    inflight: Inflight,
    /// Python holds the slot (filling it, or copying out of it).
    pins: u32,
    filling: bool,
    /// Give up the slot once the write completes.
    evicting: bool,
    /// Read ahead and not yet used: evicted only when nothing else is left.
    prefetched: bool,
    /// Its write (from caller memory, [`Store::write_from`]) is in flight and counts
    /// against the bytes that may wait for NVMe.
    from_user: bool,
    put_seq: u64,
    host_seq: u64,
    access_seq: u64,
}

/// Counters of traffic per tier and direction.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub host_bytes_in: u64,
    pub host_bytes_out: u64,
    pub host_puts: u64,
    pub host_gets: u64,
    pub nvme_bytes_written: u64,
    pub nvme_bytes_read: u64,
    pub nvme_write_ops: u64,
    pub nvme_read_ops: u64,
    pub direct_puts: u64,
    pub direct_gets: u64,
    pub zero_copy_puts: u64,
    pub evictions: u64,
    pub prefetches: u64,
    pub prefetch_skipped: u64,
    pub host_hits: u64,
    pub nvme_hits: u64,
    pub wait_seconds: f64,
    pub host_used: u64,
    pub host_capacity: u64,
    pub host_peak: u64,
    pub nvme_used: u64,
    pub nvme_capacity: u64,
    pub nvme_peak: u64,
    pub entries: u64,
    pub device_used: Vec<u64>,
    pub device_bytes_written: Vec<u64>,
    pub device_bytes_read: Vec<u64>,
    pub device_file_size: Vec<u64>,
}

struct Device {
    file: DeviceFile,
    queue: Box<dyn IoQueue>,
}

struct Inner {
    entries: HashMap<u64, Entry>,
    next_key: u64,
    seq: u64,
    host: RangeAllocator,
    devs: Vec<RangeAllocator>,
    /// A device that returned ENOSPC although under its capacity (the disk is full).
    dev_full: Vec<bool>,
    /// Keys with a write in flight (eviction or explicit).
    writing: Vec<u64>,
    /// Keys with a read in flight (to a slot or to caller memory).
    reading: Vec<u64>,
    /// Bytes (rounded to pages) of writes from caller memory in flight.
    user_inflight: u64,
    stats: Stats,
    /// An error of a background write that nobody waited on yet.
    deferred: Option<Error>,
    closed: bool,
}

pub struct Store {
    inner: Mutex<Inner>,
    // Emptied by close(). Field order matters on drop: the queues (and their
    // threads) go before the arena and staging.
    devices: RwLock<Vec<Device>>,
    staging: Mutex<Arena>,
    arena: Arena,
    cfg: StoreConfig,
    backend_name: &'static str,
    notices: Mutex<Vec<String>>,
}

fn now_secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

/// A null caller buffer with bytes to move is refused (a zero tensor, say, has no storage).
fn null_check(p: *const u8, len: u64) -> Result<()> {
    if p.is_null() && len > 0 {
        return Err(Error::Invalid(format!("a null buffer for {len} bytes")));
    }
    Ok(())
}

impl Store {
    pub fn new(cfg: StoreConfig) -> Result<Self> {
        cfg.validate()?;
        let mut notices = Vec::new();
        let arena = Arena::new(cfg.host_capacity as usize)?;
        // Streams entries that do not fit in the arena: a few blocks in flight at once.
        let staging = Arena::new((cfg.block_size * 8) as usize)?;

        let buffers: Vec<(*mut u8, usize)> = if cfg.fixed_buffers && !arena.is_empty() {
            (0..arena.len() as u64)
                .step_by(FIXED_BUF as usize)
                .map(|off| {
                    // Safety: off < arena.len().
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
            let file = DeviceFile::open(&d.path, cfg.direct, &mut notices)?;
            let fd = file.raw_fd();
            let queue: Box<dyn IoQueue> = loop {
                match backend {
                    Backend::Posix => {
                        break Box::new(
                            PosixQueue::new(fd, d.path.clone(), cfg.threads, throttle.clone())
                                .map_err(|e| Error::Invalid(format!("cannot start I/O threads: {e}")))?,
                        )
                    }
                    Backend::IoUring | Backend::Auto => {
                        let res = if std::env::var_os("SSDTIER_DISABLE_IO_URING").is_some() {
                            Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
                        } else {
                            UringQueue::new(
                                fd,
                                d.path.clone(),
                                cfg.queue_depth,
                                &buffers,
                                throttle.clone(),
                                &mut notices,
                            )
                        };
                        match res {
                            Ok(q) => {
                                backend_name = "io_uring";
                                break Box::new(q);
                            }
                            Err(e) if backend == Backend::Auto => {
                                notices.push(format!(
                                    "io_uring is not available ({e}); using the POSIX thread-pool backend"
                                ));
                                backend = Backend::Posix;
                            }
                            Err(e) => {
                                return Err(Error::Invalid(format!(
                                    "io.backend = \"io_uring\" but io_uring cannot be set up: {e} \
                                     (use backend = \"auto\" or \"posix\")"
                                )))
                            }
                        }
                    }
                }
            };
            devices.push(Device { file, queue });
        }

        let n = devices.len();
        let devs: Vec<RangeAllocator> = cfg.devices.iter().map(|d| RangeAllocator::new(d.capacity, ALIGN)).collect();
        let host = RangeAllocator::new(arena.len() as u64, ALIGN);
        let stats = Stats {
            host_capacity: host.capacity(),
            nvme_capacity: devs.iter().map(|d| d.capacity()).sum(),
            device_used: vec![0; n],
            device_bytes_written: vec![0; n],
            device_bytes_read: vec![0; n],
            device_file_size: vec![0; n],
            ..Default::default()
        };
        Ok(Store {
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                next_key: 1,
                seq: 0,
                host,
                devs,
                dev_full: vec![false; n],
                writing: Vec::new(),
                reading: Vec::new(),
                user_inflight: 0,
                stats,
                deferred: None,
                closed: false,
            }),
            devices: RwLock::new(devices),
            staging: Mutex::new(staging),
            arena,
            cfg,
            backend_name,
            notices: Mutex::new(notices),
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
        self.inner.lock().unwrap().host.used()
    }
    /// Seconds spent waiting on transfers so far (cheap: no full stats).
    pub fn wait_seconds(&self) -> f64 {
        self.inner.lock().unwrap().stats.wait_seconds
    }
    pub fn backend(&self) -> &'static str {
        self.backend_name
    }
    pub fn fixed_buffers(&self) -> bool {
        let devs = self.devices.read().unwrap();
        !devs.is_empty() && devs.iter().all(|d| d.queue.fixed_buffers())
    }
    pub fn direct(&self) -> Vec<bool> {
        self.devices.read().unwrap().iter().map(|d| d.file.direct).collect()
    }
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }
    /// Fallbacks taken so far (each reported once), drained.
    pub fn take_notices(&self) -> Vec<String> {
        std::mem::take(&mut *self.notices.lock().unwrap())
    }

    pub fn stats(&self) -> Stats {
        let mut g = self.inner.lock().unwrap();
        Self::reap(&mut g);
        let mut s = g.stats.clone();
        s.host_used = g.host.used();
        s.host_peak = g.host.peak_used();
        s.nvme_used = g.devs.iter().map(|d| d.used()).sum();
        s.nvme_peak = g.devs.iter().map(|d| d.peak_used()).sum();
        s.entries = g.entries.len() as u64;
        s.device_used = g.devs.iter().map(|d| d.used()).collect();
        let devs = self.devices.read().unwrap();
        // After close the files are gone: their size is 0.
        s.device_file_size = (0..g.devs.len()).map(|i| devs.get(i).map_or(0, |d| d.file.size())).collect();
        s
    }

    /// Length of an entry in bytes.
    pub fn len_of(&self, key: u64) -> Result<u64> {
        let g = self.lock()?;
        g.entries.get(&key).map(|e| e.len).ok_or(Error::UnknownKey(key))
    }

    /// Where an entry's bytes are: (in host arena, on NVMe).
    pub fn location(&self, key: u64) -> Result<(bool, bool)> {
        let mut g = self.lock()?;
        Self::reap(&mut g);
        let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
        Ok((e.host.is_some(), e.nvme_valid))
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        let g = self.inner.lock().unwrap();
        if g.closed {
            return Err(Error::Closed);
        }
        Ok(g)
    }

    /// Wait for a ticket with the lock released; time counts as waiting.
    fn wait_unlocked<'a>(&'a self, g: MutexGuard<'a, Inner>, t: &Arc<Ticket>) -> (MutexGuard<'a, Inner>, Result<()>) {
        drop(g);
        let t0 = Instant::now();
        let r = t.wait();
        let mut g = self.inner.lock().unwrap();
        g.stats.wait_seconds += now_secs(t0);
        Self::reap(&mut g);
        (g, r)
    }

    // ------------------------------------------------------------ put side

    /// Create an entry of `len` bytes. Returns its key and the arena offset of
    /// its slot, which the caller fills and then passes to [`Store::commit`];
    /// None means the entry does not fit in the host tier, and the caller
    /// writes it with [`Store::write_direct`].
    pub fn reserve(&self, len: u64) -> Result<(u64, Option<u64>)> {
        let g = self.lock()?;
        let (mut g, slot) = self.make_room(g, len, true, true)?;
        let key = g.next_key;
        g.next_key += 1;
        g.seq += 1;
        let seq = g.seq;
        g.entries.insert(
            key,
            Entry {
                len,
                host: slot,
                nvme: None,
                nvme_valid: false,
                inflight: Inflight::None,
                pins: u32::from(slot.is_some()),
                filling: slot.is_some(),
                evicting: false,
                prefetched: false,
                from_user: false,
                put_seq: seq,
                host_seq: seq,
                access_seq: seq,
            },
        );
        Ok((key, slot))
    }

    /// The slot of a reserved entry is filled: it may now be evicted.
    pub fn commit(&self, key: u64) -> Result<()> {
        let mut g = self.lock()?;
        let e = g.entries.get_mut(&key).ok_or(Error::UnknownKey(key))?;
        if !e.filling {
            return Err(Error::Invalid(format!("entry {key} is not being filled")));
        }
        e.filling = false;
        e.pins -= 1;
        let len = e.len;
        g.stats.host_bytes_in += len;
        g.stats.host_puts += 1;
        Ok(())
    }

    /// Create an entry holding a copy of `len` bytes at `src`: copied into an
    /// arena slot and committed, or, when it does not fit in the host tier,
    /// written to NVMe with [`Store::write_direct`]. Returns its key once the
    /// bytes are copied; on an error no entry is left behind.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes for the whole call.
    pub unsafe fn put_from(&self, src: *const u8, len: u64) -> Result<u64> {
        null_check(src, len)?;
        let (key, slot) = self.reserve(len)?;
        let res = match slot {
            Some(off) => {
                if len > 0 {
                    // The slot is pinned while it is filled: nothing else touches it.
                    unsafe { std::ptr::copy_nonoverlapping(src, self.arena.as_ptr().add(off as usize), len as usize) };
                }
                self.commit(key)
            }
            None => unsafe { self.write_direct(key, src) },
        };
        match res {
            Ok(()) => Ok(key),
            Err(e) => {
                let _ = self.free(key);
                Err(e)
            }
        }
    }

    /// Write an entry that has no host slot from `src` (`len` bytes, any
    /// alignment) to NVMe through the staging buffer. Blocks until written.
    ///
    /// # Safety
    /// `src` must be valid for reads of the entry's length for the whole call.
    pub unsafe fn write_direct(&self, key: u64, src: *const u8) -> Result<()> {
        let mut g = self.lock()?;
        let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
        if e.host.is_some() || e.nvme.is_some() {
            return Err(Error::Invalid(format!("entry {key} already has its bytes")));
        }
        let len = e.len;
        if len == 0 {
            return Ok(());
        }
        null_check(src, len)?;
        let pl = self.alloc_placement(&mut g, len)?;
        g.entries.get_mut(&key).unwrap().nvme = Some(pl.clone());
        drop(g);
        let res = self.stream(&pl, Dir::Write, src as *mut u8, len);
        let mut g = self.inner.lock().unwrap();
        match res {
            Ok(()) => {
                let e = g.entries.get_mut(&key).unwrap();
                e.nvme_valid = true;
                g.stats.direct_puts += 1;
                Ok(())
            }
            Err(err) => {
                if let Some(e) = g.entries.get_mut(&key) {
                    e.nvme = None;
                }
                Self::release_placement(&mut g, &pl);
                Self::note_write_error(&mut g, &err, &pl);
                Err(err)
            }
        }
    }

    /// Create an entry of `len` bytes and write it to NVMe straight from caller
    /// memory, without a copy into the arena. Returns its key and the write's
    /// ticket at once; the caller keeps `src` valid and unchanged until the
    /// ticket is done. The bytes waiting in caller memory are bounded by the
    /// host capacity: while earlier writes from caller memory fill it, this
    /// waits for the oldest (one write may always be in flight).
    ///
    /// A failed write is reported through the ticket only (not deferred to
    /// `flush`): the entry then has no bytes and the caller, who still has
    /// them, frees it.
    ///
    /// # Safety
    /// `src` must be 4096-aligned and valid for reads of `len` rounded up to
    /// 4096 bytes until the ticket is done. The bytes past `len` are written
    /// to the file too (whatever they hold) and never read back as data.
    pub unsafe fn write_from(&self, src: *const u8, len: u64) -> Result<(u64, Arc<Ticket>)> {
        null_check(src, len)?;
        if (src as u64) % ALIGN != 0 {
            return Err(Error::Invalid(format!("write_from needs a {ALIGN}-byte aligned buffer")));
        }
        let mut g = self.lock()?;
        let rounded = len.div_ceil(ALIGN) * ALIGN;
        loop {
            Self::reap(&mut g);
            if g.user_inflight == 0 || g.user_inflight + rounded <= g.host.capacity() {
                break;
            }
            let t = g.writing.iter().find_map(|k| match g.entries.get(k) {
                Some(Entry { inflight: Inflight::Write(t), from_user: true, .. }) => Some(t.clone()),
                _ => None,
            });
            let Some(t) = t else { break };
            let (g2, _) = self.wait_unlocked(g, &t);
            g = g2;
        }
        let (pl, ticket) = if len == 0 {
            (None, Ticket::done())
        } else {
            let pl = self.alloc_placement(&mut g, len)?;
            let t = self.submit_placement(&mut g, &pl, Dir::Write, Target::User(src as *mut u8));
            (Some(pl), t)
        };
        let key = g.next_key;
        g.next_key += 1;
        g.seq += 1;
        let seq = g.seq;
        let inflight = if len == 0 { Inflight::None } else { Inflight::Write(ticket.clone()) };
        g.entries.insert(
            key,
            Entry {
                len,
                host: None,
                nvme: pl,
                nvme_valid: len == 0,
                inflight,
                pins: 0,
                filling: false,
                evicting: false,
                prefetched: false,
                from_user: len > 0,
                put_seq: seq,
                host_seq: seq,
                access_seq: seq,
            },
        );
        if len > 0 {
            g.writing.push(key);
            g.user_inflight += rounded;
        }
        g.stats.zero_copy_puts += 1;
        Ok((key, ticket))
    }

    /// Move `pl`'s bytes between NVMe and `buf` through the staging buffer,
    /// a few blocks at a time. Serialised by the staging lock.
    fn stream(&self, pl: &Placement, dir: Dir, buf: *mut u8, len: u64) -> Result<()> {
        let staging = self.staging.lock().unwrap();
        let cap = staging.len() as u64;
        let mut chunk: Vec<Piece> = Vec::new();
        let mut chunk_bytes = 0u64;
        let flush = |chunk: &mut Vec<Piece>, bytes: &mut u64| -> Result<()> {
            if chunk.is_empty() {
                return Ok(());
            }
            let base = chunk[0].entry_off;
            let ticket = Ticket::new(chunk.len());
            // Safety: staging holds `cap` bytes and `chunk` covers at most that many bytes from `base`.
            unsafe {
                if dir == Dir::Write {
                    let n = chunk.iter().map(|p| p.len).sum::<u64>();
                    let n = n.min(len - base);
                    std::ptr::copy_nonoverlapping(buf.add(base as usize), staging.as_ptr(), n as usize);
                }
            }
            let mut per_dev: Vec<Vec<IoReq>> = (0..self.cfg.devices.len()).map(|_| Vec::new()).collect();
            for p in chunk.iter() {
                per_dev[p.dev].push(IoReq {
                    dir,
                    file_off: p.file_off,
                    // Safety: within staging (see above).
                    buf: unsafe { staging.as_ptr().add((p.entry_off - base) as usize) },
                    len: p.len as usize,
                    fixed: None,
                    ticket: ticket.clone(),
                });
            }
            self.submit(&mut self.inner.lock().unwrap(), per_dev, dir);
            let t0 = Instant::now();
            let r = ticket.wait();
            self.inner.lock().unwrap().stats.wait_seconds += now_secs(t0);
            r?;
            if dir == Dir::Read {
                let n = chunk.iter().map(|p| p.len).sum::<u64>().min(len - base);
                // Safety: the caller's buffer holds the entry's length; staging holds the chunk.
                unsafe { std::ptr::copy_nonoverlapping(staging.as_ptr(), buf.add(base as usize), n as usize) };
            }
            chunk.clear();
            *bytes = 0;
            Ok(())
        };
        for p in self.chunks(pl) {
            if chunk_bytes + p.len > cap {
                flush(&mut chunk, &mut chunk_bytes)?;
            }
            chunk_bytes += p.len;
            chunk.push(p);
        }
        flush(&mut chunk, &mut chunk_bytes)
    }

    // ------------------------------------------------------------ get side

    /// Make the entry resident in the host tier (reading it back if needed)
    /// and pin it; returns its arena offset, or None if it cannot get a slot
    /// (then use [`Store::read_direct`]). Pair with [`Store::release`].
    pub fn acquire(&self, key: u64) -> Result<Option<u64>> {
        let mut g = self.lock()?;
        loop {
            g = self.settle_reads(g, key)?;
            let e = &g.entries[&key];
            if let Some(off) = e.host {
                g.seq += 1;
                let seq = g.seq;
                let e = g.entries.get_mut(&key).unwrap();
                e.pins += 1;
                e.evicting = false;
                e.prefetched = false;
                e.access_seq = seq;
                let len = e.len;
                g.stats.host_bytes_out += len;
                g.stats.host_gets += 1;
                g.stats.host_hits += 1;
                return Ok(Some(off));
            }
            if e.len == 0 {
                return Ok(None);
            }
            // On NVMe only: read it into a slot.
            let len = e.len;
            // A read never displaces read-ahead entries: without a slot it streams past the arena.
            let (g2, slot) = self.make_room(g, len, true, false)?;
            g = g2;
            let Some(off) = slot else { return Ok(None) };
            if !g.entries.contains_key(&key) {
                g.host.free(off, len);
                return Err(Error::UnknownKey(key));
            }
            let t = self.start_read(&mut g, key, off);
            g.stats.nvme_hits += 1;
            let (g2, r) = self.wait_unlocked(g, &t);
            g = g2;
            r?;
        }
    }

    /// Unpin an entry acquired with [`Store::acquire`].
    pub fn release(&self, key: u64) -> Result<()> {
        let mut g = self.lock()?;
        let e = g.entries.get_mut(&key).ok_or(Error::UnknownKey(key))?;
        if e.pins == 0 || e.filling {
            return Err(Error::Invalid(format!("entry {key} is not acquired")));
        }
        e.pins -= 1;
        Ok(())
    }

    /// Read an entry that could not get a host slot into `dst` through the staging buffer.
    ///
    /// # Safety
    /// `dst` must be valid for writes of the entry's length for the whole call.
    pub unsafe fn read_direct(&self, key: u64, dst: *mut u8) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            Self::reap(&mut g);
            let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
            if let Some(t) = e.inflight.ticket() {
                let t = t.clone();
                let (g2, _) = self.wait_unlocked(g, &t);
                g = g2;
                continue;
            }
            if e.len == 0 {
                return Ok(());
            }
            null_check(dst, e.len)?;
            if let Some(off) = e.host {
                // Resident after all: copy from the slot.
                let len = e.len;
                // Safety: slot holds len bytes; dst is valid per the contract.
                std::ptr::copy_nonoverlapping(self.arena.as_ptr().add(off as usize), dst, len as usize);
                g.stats.host_hits += 1;
                return Ok(());
            }
            let pl = e.nvme.clone().ok_or_else(|| Error::Invalid(format!("entry {key} has no bytes")))?;
            let len = e.len;
            // Pin so a concurrent free waits for us.
            g.entries.get_mut(&key).unwrap().pins += 1;
            drop(g);
            let r = self.stream(&pl, Dir::Read, dst, len);
            let mut g = self.inner.lock().unwrap();
            if let Some(e) = g.entries.get_mut(&key) {
                e.pins -= 1;
            }
            g.stats.direct_gets += 1;
            g.stats.nvme_hits += 1;
            return r;
        }
    }

    /// Read an entry into caller memory without going through the arena.
    /// A resident entry is copied from its slot at once (the ticket is done);
    /// otherwise the read from NVMe is submitted straight into `dst` and the
    /// ticket completes when it lands. Only one transfer per entry at a time.
    ///
    /// # Safety
    /// `dst` must be 4096-aligned and valid for writes of the entry's length
    /// rounded up to 4096 until the ticket is done.
    pub unsafe fn read_into(&self, key: u64, dst: *mut u8) -> Result<Arc<Ticket>> {
        let g = self.lock()?;
        let mut g = self.settle_reads(g, key)?;
        let e = &g.entries[&key];
        let len = e.len;
        if len == 0 {
            return Ok(Ticket::done());
        }
        null_check(dst, len)?;
        if let Some(off) = e.host {
            // Safety: the slot holds len bytes; dst has room per the contract.
            std::ptr::copy_nonoverlapping(self.arena.as_ptr().add(off as usize), dst, len as usize);
            g.stats.host_hits += 1;
            g.stats.host_bytes_out += len;
            return Ok(Ticket::done());
        }
        if (dst as u64) % ALIGN != 0 {
            return Err(Error::Invalid(format!("read_into needs a {ALIGN}-byte aligned buffer")));
        }
        let pl = e.nvme.clone().ok_or_else(|| Error::Invalid(format!("entry {key} has no bytes")))?;
        let t = self.submit_placement(&mut g, &pl, Dir::Read, Target::User(dst));
        g.entries.get_mut(&key).unwrap().inflight = Inflight::Direct(t.clone());
        g.reading.push(key);
        g.stats.nvme_hits += 1;
        Ok(t)
    }

    /// Start reading the entry back into the host tier without waiting.
    /// Best effort: when the arena has no room that can be made without
    /// waiting, nothing is read (counted as `prefetch_skipped`).
    pub fn prefetch(&self, key: u64) -> Result<Arc<Ticket>> {
        let mut g = self.lock()?;
        Self::reap(&mut g);
        let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
        match (&e.inflight, e.host) {
            (Inflight::Read(t) | Inflight::Direct(t), _) => return Ok(t.clone()),
            (_, Some(_)) => return Ok(Ticket::done()),
            _ => {}
        }
        if e.len == 0 || !e.nvme_valid {
            return Ok(Ticket::done());
        }
        let len = e.len;
        let (mut g, slot) = self.make_room(g, len, false, false)?;
        let Some(off) = slot else {
            g.stats.prefetch_skipped += 1;
            return Ok(Ticket::done());
        };
        if !g.entries.contains_key(&key) {
            g.host.free(off, len);
            return Err(Error::UnknownKey(key));
        }
        g.stats.prefetches += 1;
        let t = self.start_read(&mut g, key, off);
        g.entries.get_mut(&key).unwrap().prefetched = true;
        Ok(t)
    }

    /// Reap, then wait (with the lock released) while the entry has a read in
    /// flight, or a write from caller memory (its only copy is not readable
    /// yet). An entry still being filled is refused.
    fn settle_reads<'a>(&'a self, mut g: MutexGuard<'a, Inner>, key: u64) -> Result<MutexGuard<'a, Inner>> {
        loop {
            Self::reap(&mut g);
            let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
            if e.filling {
                return Err(Error::Invalid(format!("entry {key} is still being filled")));
            }
            let t = match &e.inflight {
                Inflight::Read(t) | Inflight::Direct(t) => t.clone(),
                // Written from caller memory and not done yet: the file is not readable before.
                Inflight::Write(t) if e.host.is_none() => t.clone(),
                _ => return Ok(g),
            };
            let (g2, r) = self.wait_unlocked(g, &t);
            g = g2;
            r?;
        }
    }

    fn start_read(&self, g: &mut Inner, key: u64, off: u64) -> Arc<Ticket> {
        g.seq += 1;
        let seq = g.seq;
        let e = g.entries.get_mut(&key).unwrap();
        let pl = e.nvme.clone().expect("an entry without host slot has an NVMe copy");
        e.host = Some(off);
        e.host_seq = seq;
        e.access_seq = seq;
        let t = self.submit_placement(g, &pl, Dir::Read, Target::Arena(off));
        g.entries.get_mut(&key).unwrap().inflight = Inflight::Read(t.clone());
        g.reading.push(key);
        t
    }

    // ------------------------------------------------------------ evict, free, flush

    /// Make sure the entry's bytes are on NVMe and give up its host slot. Blocks.
    pub fn evict(&self, key: u64) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            Self::reap(&mut g);
            let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
            if e.pins > 0 {
                return Err(Error::Invalid(format!("entry {key} is in use (being filled or read)")));
            }
            if let Some(t) = e.inflight.ticket() {
                let t = t.clone();
                g.entries.get_mut(&key).unwrap().evicting = true;
                let (g2, r) = self.wait_unlocked(g, &t);
                g = g2;
                r?;
                continue;
            }
            let Some(off) = e.host else { return Ok(()) };
            if e.nvme_valid || e.len == 0 {
                let len = e.len;
                g.host.free(off, len);
                let e = g.entries.get_mut(&key).unwrap();
                e.host = None;
                e.prefetched = false;
                return Ok(());
            }
            self.start_write(&mut g, key)?;
        }
    }

    /// Forget an entry and give its space back. Waits for its transfer in flight.
    pub fn free(&self, key: u64) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            Self::reap(&mut g);
            let e = g.entries.get(&key).ok_or(Error::UnknownKey(key))?;
            if let Some(t) = e.inflight.ticket() {
                let t = t.clone();
                let (g2, _) = self.wait_unlocked(g, &t);
                g = g2;
                continue;
            }
            if e.pins > 0 && !e.filling {
                return Err(Error::Invalid(format!("entry {key} is in use")));
            }
            let e = g.entries.remove(&key).unwrap();
            if let Some(off) = e.host {
                g.host.free(off, e.len);
            }
            if let Some(pl) = &e.nvme {
                Self::release_placement(&mut g, pl);
            }
            return Ok(());
        }
    }

    /// Wait for every write in flight. Returns the first error of a write that nobody waited on.
    pub fn flush(&self) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            Self::reap(&mut g);
            let t = g.writing.iter().find_map(|k| match g.entries.get(k).map(|e| &e.inflight) {
                Some(Inflight::Write(t)) => Some(t.clone()),
                _ => None,
            });
            let Some(t) = t else { break };
            let (g2, _) = self.wait_unlocked(g, &t);
            g = g2;
        }
        match g.deferred.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Wait for all transfers, free everything and refuse further use.
    pub fn close(&self) -> Result<()> {
        let r = self.flush();
        let mut g = self.inner.lock().unwrap();
        loop {
            let t = g.entries.values().find_map(|e| e.inflight.ticket().cloned());
            let Some(t) = t else { break };
            drop(g);
            let _ = t.wait();
            g = self.inner.lock().unwrap();
            Self::reap(&mut g);
        }
        g.closed = true;
        g.entries.clear();
        drop(g);
        // No stream through staging is running once we hold its lock; then the
        // queues (joining their threads) and the files go.
        let _staging = self.staging.lock().unwrap();
        self.devices.write().unwrap().clear();
        match r {
            Err(Error::Closed) => Ok(()),
            r => r,
        }
    }

    // ------------------------------------------------------------ internals

    /// Finish transfers whose tickets are done: mark NVMe copies valid, give
    /// up the slots of evicted entries, keep the bytes where a write failed.
    fn reap(g: &mut Inner) {
        let mut i = 0;
        while i < g.writing.len() {
            let key = g.writing[i];
            let Some(e) = g.entries.get(&key) else {
                g.writing.swap_remove(i);
                continue;
            };
            let Inflight::Write(t) = &e.inflight else {
                g.writing.swap_remove(i);
                continue;
            };
            let Some(res) = t.poll() else {
                i += 1;
                continue;
            };
            g.writing.swap_remove(i);
            let e = g.entries.get_mut(&key).unwrap();
            e.inflight = Inflight::None;
            let from_user = std::mem::take(&mut e.from_user);
            if from_user {
                g.user_inflight -= e.len.div_ceil(ALIGN) * ALIGN;
            }
            let e = g.entries.get_mut(&key).unwrap();
            match res {
                Ok(()) => {
                    e.nvme_valid = true;
                    if e.evicting && e.pins == 0 {
                        e.evicting = false;
                        if let Some(off) = e.host.take() {
                            let len = e.len;
                            g.host.free(off, len);
                            g.stats.evictions += 1;
                        }
                    }
                }
                Err(err) => {
                    // From the arena, the bytes stay in the host slot; from caller memory,
                    // the caller still has them and learns of the error from its ticket.
                    e.evicting = false;
                    let pl = e.nvme.take().unwrap();
                    Self::release_placement(g, &pl);
                    Self::note_write_error(g, &err, &pl);
                    if !from_user {
                        g.deferred.get_or_insert(err);
                    }
                }
            }
        }
        let mut i = 0;
        while i < g.reading.len() {
            let key = g.reading[i];
            let res = match g.entries.get(&key).map(|e| &e.inflight) {
                Some(Inflight::Read(t) | Inflight::Direct(t)) => match t.poll() {
                    Some(r) => r,
                    None => {
                        i += 1;
                        continue;
                    }
                },
                _ => {
                    g.reading.swap_remove(i);
                    continue;
                }
            };
            g.reading.swap_remove(i);
            let e = g.entries.get_mut(&key).unwrap();
            let to_slot = matches!(e.inflight, Inflight::Read(_));
            e.inflight = Inflight::None;
            if to_slot && res.is_err() {
                // The NVMe copy is still there; give up the slot, the next acquire retries.
                let (off, len) = (e.host.take().unwrap(), e.len);
                e.prefetched = false;
                g.host.free(off, len);
            }
        }
    }

    fn note_write_error(g: &mut Inner, err: &Error, pl: &Placement) {
        if err.errno() == Some(libc::ENOSPC) {
            // The file system is full before our capacity: stop using these devices.
            for p in &pl.pieces {
                g.dev_full[p.dev] = true;
            }
        }
    }

    /// Find a host slot of `len` bytes, evicting by policy. With `wait`, waits
    /// for eviction writes; without, takes only what is free or clean. Entries
    /// read ahead and not used yet go only with `last_resort`, when nothing
    /// else is leaving. Returns None when the entry cannot get a slot (bigger
    /// than the arena, or everything else pinned or read ahead).
    fn make_room<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        len: u64,
        wait: bool,
        last_resort: bool,
    ) -> Result<(MutexGuard<'a, Inner>, Option<u64>)> {
        if len == 0 {
            return Ok((g, None));
        }
        let need = g.host.round(len);
        if need > g.host.capacity() {
            return Ok((g, None));
        }
        // Keep a quarter of the arena free or on its way out, so the disk stays busy
        // while the caller fills the next slot.
        let headroom = g.host.capacity() / 4;
        loop {
            Self::reap(&mut g);
            if let Some(off) = g.host.alloc(need) {
                if wait {
                    self.start_evictions(&mut g, 0, headroom, false);
                }
                return Ok((g, Some(off)));
            }
            // An NVMe allocation failure is not an error here: without a slot the
            // caller streams through staging, which reports it if it applies.
            self.start_evictions(&mut g, need, headroom, false);
            if let Some(off) = g.host.alloc(need) {
                return Ok((g, Some(off)));
            }
            if !wait {
                return Ok((g, None));
            }
            let writes_pending = g.writing.iter().any(|k| g.entries.get(k).is_some_and(|e| e.evicting));
            if !writes_pending && last_resort {
                // Nothing else is leaving: as a last resort, read-ahead entries go too.
                self.start_evictions(&mut g, need, 0, true);
                if let Some(off) = g.host.alloc(need) {
                    return Ok((g, Some(off)));
                }
            }
            // Wait for the oldest eviction write.
            let t = g.writing.iter().find_map(|k| match g.entries.get(k) {
                Some(Entry { inflight: Inflight::Write(t), evicting: true, .. }) => Some(t.clone()),
                _ => None,
            });
            match t {
                Some(t) => {
                    let (g2, _) = self.wait_unlocked(g, &t);
                    g = g2;
                    if let Some(err) = g.deferred.take() {
                        if err.errno() != Some(libc::ENOSPC) {
                            return Err(err);
                        }
                    }
                }
                None => return Ok((g, None)),
            }
        }
    }

    /// Start evictions until free + leaving ≥ `need + headroom`. Clean entries
    /// give up their slot at once; dirty ones are written first, until NVMe
    /// has no room for them. Entries read ahead and not used yet are taken
    /// only with `take_prefetched` (a caller that must have the space):
    /// evicting them would mean reading them again.
    fn start_evictions(&self, g: &mut Inner, need: u64, headroom: u64, take_prefetched: bool) {
        let leaving: u64 =
            g.writing.iter().filter_map(|k| g.entries.get(k)).filter(|e| e.evicting).map(|e| g.host.round(e.len)).sum();
        let mut budget = (need + headroom).saturating_sub(g.host.available() + leaving);
        if budget == 0 {
            return;
        }
        let policy = self.cfg.eviction;
        let mut cands: Vec<(bool, u64, u64)> = g
            .entries
            .iter()
            .filter(|(_, e)| {
                e.host.is_some()
                    && e.pins == 0
                    && !e.filling
                    && matches!(e.inflight, Inflight::None)
                    && e.len > 0
                    && (take_prefetched || !e.prefetched)
            })
            .map(|(k, e)| {
                let prio = match policy {
                    Eviction::Lifetime => e.put_seq,
                    Eviction::Lru => e.access_seq,
                    Eviction::Fifo => e.host_seq,
                };
                (e.prefetched, prio, *k)
            })
            .collect();
        cands.sort_unstable();
        let mut nvme_full = false;
        for (_, _, key) in cands {
            if budget == 0 {
                break;
            }
            let e = g.entries.get_mut(&key).unwrap();
            let size = g.host.round(e.len);
            if e.nvme_valid {
                let off = e.host.take().unwrap();
                e.prefetched = false;
                g.host.free(off, size);
                g.stats.evictions += 1;
            } else if nvme_full {
                continue;
            } else {
                e.evicting = true;
                if self.start_write(g, key).is_err() {
                    g.entries.get_mut(&key).unwrap().evicting = false;
                    nvme_full = true;
                    continue;
                }
            }
            budget = budget.saturating_sub(size);
        }
    }

    fn start_write(&self, g: &mut Inner, key: u64) -> Result<()> {
        let len = g.entries[&key].len;
        let pl = self.alloc_placement(g, len)?;
        let off = g.entries[&key].host.expect("a dirty entry has a host slot");
        let t = self.submit_placement(g, &pl, Dir::Write, Target::Arena(off));
        let e = g.entries.get_mut(&key).unwrap();
        e.nvme = Some(pl);
        e.inflight = Inflight::Write(t);
        g.writing.push(key);
        Ok(())
    }

    /// Space for `len` bytes over the devices that have room, striped by
    /// `block_size` units. A full device is left out and the others take over.
    fn alloc_placement(&self, g: &mut Inner, len: u64) -> Result<Placement> {
        let len = len.div_ceil(ALIGN) * ALIGN;
        let unit = self.cfg.block_size;
        let nunits = len.div_ceil(unit);
        let mut devs: Vec<usize> = (0..g.devs.len()).filter(|&d| !g.dev_full[d]).collect();
        // Rotate the first device per entry so small entries spread too.
        g.seq += 1;
        let rot = (g.seq as usize) % devs.len().max(1);
        devs.rotate_left(rot);
        while !devs.is_empty() {
            let k = devs.len() as u64;
            let unit_len = |i: u64| if i + 1 == nunits { len - i * unit } else { unit };
            let sizes: Vec<u64> = (0..k).map(|j| (j..nunits).step_by(k as usize).map(unit_len).sum::<u64>()).collect();
            let mut ranges = Vec::new();
            let mut failed = None;
            for (j, &d) in devs.iter().enumerate() {
                if sizes[j] == 0 {
                    continue;
                }
                match g.devs[d].alloc(sizes[j]) {
                    Some(off) => ranges.push((d, off, sizes[j])),
                    None => {
                        failed = Some(j);
                        break;
                    }
                }
            }
            if let Some(j) = failed {
                for &(d, off, l) in &ranges {
                    g.devs[d].free(off, l);
                }
                devs.remove(j);
                continue;
            }
            let bases: HashMap<usize, u64> = ranges.iter().map(|&(d, off, _)| (d, off)).collect();
            let pieces = (0..nunits)
                .map(|i| {
                    let dev = devs[(i % k) as usize];
                    Piece { dev, file_off: bases[&dev] + (i / k) * unit, entry_off: i * unit, len: unit_len(i) }
                })
                .collect();
            return Ok(Placement { pieces, ranges });
        }
        let states: Vec<String> = (0..g.devs.len())
            .map(|d| {
                let path = self.cfg.devices[d].path.display();
                if g.dev_full[d] {
                    format!("{path}: its file system is full")
                } else {
                    let (free, big) = (g.devs[d].available(), g.devs[d].largest_free());
                    format!("{path}: {free} of {} bytes free, largest free range {big}", g.devs[d].capacity())
                }
            })
            .collect();
        Err(Error::OutOfSpace {
            needed: len,
            detail: format!("the host arena is full and no NVMe directory has room ({})", states.join("; ")),
        })
    }

    fn release_placement(g: &mut Inner, pl: &Placement) {
        for &(d, off, l) in &pl.ranges {
            g.devs[d].free(off, l);
            // Room on a device whose file system was full: worth trying again.
            g.dev_full[d] = false;
        }
    }

    /// Chunks of at most `block_size`, not crossing a registered-buffer boundary
    /// of the arena when `arena_off` is given.
    fn chunks(&self, pl: &Placement) -> Vec<Piece> {
        let bs = self.cfg.block_size;
        let mut out = Vec::new();
        for p in &pl.pieces {
            let mut o = 0;
            while o < p.len {
                let l = (p.len - o).min(bs);
                out.push(Piece { dev: p.dev, file_off: p.file_off + o, entry_off: p.entry_off + o, len: l });
                o += l;
            }
        }
        out
    }

    fn submit_placement(&self, g: &mut Inner, pl: &Placement, dir: Dir, target: Target) -> Arc<Ticket> {
        let mut reqs: Vec<Piece> = Vec::new();
        for c in self.chunks(pl) {
            match target {
                // Split where the chunk crosses a 1 GiB registered-buffer boundary.
                Target::Arena(arena_off) => {
                    let start = arena_off + c.entry_off;
                    let end = start + c.len;
                    let boundary = (start / FIXED_BUF + 1) * FIXED_BUF;
                    if end > boundary {
                        let first = boundary - start;
                        reqs.push(Piece { len: first, ..c });
                        reqs.push(Piece {
                            file_off: c.file_off + first,
                            entry_off: c.entry_off + first,
                            len: c.len - first,
                            ..c
                        });
                        continue;
                    }
                    reqs.push(c)
                }
                Target::User(_) => reqs.push(c),
            }
        }
        let ticket = Ticket::new(reqs.len());
        let mut per_dev: Vec<Vec<IoReq>> = (0..self.cfg.devices.len()).map(|_| Vec::new()).collect();
        for c in reqs {
            let (buf, fixed) = match target {
                Target::Arena(arena_off) => {
                    let a = arena_off + c.entry_off;
                    // Safety: the slot [arena_off, arena_off + rounded len) lies in the arena.
                    (unsafe { self.arena.as_ptr().add(a as usize) }, Some((a / FIXED_BUF) as u16))
                }
                // Safety: the caller of read_into guarantees room for the rounded length.
                Target::User(p) => (unsafe { p.add(c.entry_off as usize) }, None),
            };
            per_dev[c.dev].push(IoReq {
                dir,
                file_off: c.file_off,
                buf,
                len: c.len as usize,
                fixed,
                ticket: ticket.clone(),
            });
        }
        self.submit(g, per_dev, dir);
        ticket
    }

    /// Hand requests to the device queues, counting them in `g`'s stats.
    fn submit(&self, g: &mut Inner, per_dev: Vec<Vec<IoReq>>, dir: Dir) {
        let devices = self.devices.read().unwrap();
        for (d, reqs) in per_dev.into_iter().enumerate() {
            if reqs.is_empty() {
                continue;
            }
            let bytes: u64 = reqs.iter().map(|r| r.len as u64).sum();
            Self::count(g, d, dir, bytes, reqs.len() as u64);
            match devices.get(d) {
                Some(dev) => dev.queue.submit(reqs),
                // Closed under a racing caller: fail the requests rather than lose them.
                None => reqs.iter().for_each(|r| r.ticket.complete(Err(Error::Closed))),
            }
        }
    }

    fn count(g: &mut Inner, d: usize, dir: Dir, bytes: u64, ops: u64) {
        match dir {
            Dir::Write => {
                g.stats.nvme_bytes_written += bytes;
                g.stats.nvme_write_ops += ops;
                g.stats.device_bytes_written[d] += bytes;
            }
            Dir::Read => {
                g.stats.nvme_bytes_read += bytes;
                g.stats.nvme_read_ops += ops;
                g.stats.device_bytes_read[d] += bytes;
            }
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Wait for transfers in flight before the arena and staging go away.
        let _ = self.close();
    }
}
