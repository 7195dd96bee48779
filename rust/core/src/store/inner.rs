//! The books of a store, behind its lock: entries and their states, the
//! eviction indexes, transfers in flight, free space, and whether the store
//! still takes work.

use super::entry::{Entry, EvictKey, ReadDst, State, WriteSrc};
use super::placement::{Placement, Space};
use super::stats::Stats;
use super::Eviction;
use crate::alloc::{Range, RangeAllocator};
use crate::error::{Error, Result};
use std::collections::{BTreeSet, HashMap};

/// Whether the store takes work.
pub(crate) enum Status {
    Open,
    /// An engine failed, or the books went wrong: new work is refused with this reason.
    Failed(String),
    /// close() is waiting for the transfers in flight: new work is refused, giving back works.
    Closing,
    Closed,
}

/// What `take` and `put_back` keep in step with the entries' states.
#[derive(Default, PartialEq, Eq)]
pub(crate) struct Books {
    /// Entries that may give up their slot now, in eviction order (prefetched, rank, key):
    /// dirty ones, to be written first, and clean ones, whose slot goes at once.
    pub dirty: BTreeSet<EvictKey>,
    pub clean: BTreeSet<EvictKey>,
    /// Slot bytes of the clean entries not read ahead.
    pub clean_bytes: u64,
    /// Entries with a transfer in flight that `reap` finishes.
    inflight: BTreeSet<u64>,
    /// Bytes of caller memory held by writes from it (`write_from`).
    pub caller_bytes: u64,
    /// Bytes of slots on their way out (eviction writes in flight).
    pub leaving: u64,
    /// Entries discarded while a transfer was in flight: not counted as entries any more.
    doomed: u64,
}

impl Books {
    /// Count entry `key` in (`add`) or out of the books.
    fn count(&mut self, policy: Eviction, key: u64, e: &Entry, add: bool) {
        fn set<T: Ord>(s: &mut BTreeSet<T>, x: T, add: bool) {
            if add {
                s.insert(x);
            } else {
                s.remove(&x);
            }
        }
        let n = |x: u64, total: &mut u64| if add { *total += x } else { *total -= x };
        if let Some(k) = e.evict_key(policy, key) {
            if e.on_nvme() {
                set(&mut self.clean, k, add);
                n(e.clean_bytes(), &mut self.clean_bytes);
            } else {
                set(&mut self.dirty, k, add);
            }
        }
        if e.reaped() {
            set(&mut self.inflight, key, add);
        }
        n(e.caller_held(), &mut self.caller_bytes);
        n(e.leaving(), &mut self.leaving);
        n(u64::from(e.doomed), &mut self.doomed);
    }
}

pub(crate) struct Inner {
    entries: HashMap<u64, Entry>,
    pub books: Books,
    pub next_key: u64,
    pub seq: u64,
    /// The group of the entries put from now on (`Store::set_group`).
    pub group: u64,
    pub host: RangeAllocator,
    host_quarantine: Vec<Range>,
    pub space: Space,
    pub stats: Stats,
    /// An error of a background write that nobody waited on yet.
    pub deferred: Option<Error>,
    pub status: Status,
    pub policy: Eviction,
}

impl Inner {
    pub fn new(host: RangeAllocator, space: Space, stats: Stats, policy: Eviction) -> Self {
        Inner {
            entries: HashMap::new(),
            books: Books::default(),
            next_key: 1,
            seq: 0,
            group: 0,
            host,
            host_quarantine: Vec::new(),
            space,
            stats,
            deferred: None,
            status: Status::Open,
            policy,
        }
    }

    /// Refuse new work from now on (the first reason is kept).
    pub fn fail(&mut self, why: String) {
        if matches!(self.status, Status::Open) {
            self.status = Status::Failed(why);
        }
    }

    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A new entry, next in the put order, in the current group (not inserted yet).
    pub fn new_entry(&mut self, len: u64, state: State) -> Entry {
        let seq = self.next_seq();
        Entry::new(len, state, seq, self.group)
    }

    /// A live entry (not discarded).
    pub fn get(&self, key: u64) -> Result<&Entry> {
        self.entries.get(&key).filter(|e| !e.doomed).ok_or(Error::UnknownKey(key))
    }

    /// Take out an entry that is on NVMe only, with its placement; else leave it and say
    /// the entry `why_not`.
    pub fn take_disk(&mut self, key: u64, why_not: &str) -> Result<(Entry, Placement)> {
        let mut e = self.take(key)?;
        match std::mem::replace(&mut e.state, State::Empty) {
            State::Disk { disk } => Ok((e, disk)),
            other => {
                e.state = other;
                self.put_back(key, e);
                Err(Error::Invalid(format!("entry {key} {why_not}")))
            }
        }
    }

    /// An entry, discarded ones (whose transfer is still in flight) included.
    pub fn get_any(&self, key: u64) -> Result<&Entry> {
        self.entries.get(&key).ok_or(Error::UnknownKey(key))
    }

    /// The transfer of any entry still in flight, discarded ones included.
    pub fn any_io(&self) -> Option<std::sync::Arc<crate::Ticket>> {
        self.entries.values().find_map(|e| e.io().cloned())
    }

    /// A new entry under a fresh key.
    pub fn insert(&mut self, e: Entry) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        self.put_back(key, e);
        key
    }

    /// Take an entry out to change it; give it back with `put_back`.
    pub fn take(&mut self, key: u64) -> Result<Entry> {
        let e = self.entries.remove(&key).ok_or(Error::UnknownKey(key))?;
        self.books.count(self.policy, key, &e, false);
        Ok(e)
    }

    pub fn put_back(&mut self, key: u64, e: Entry) {
        self.books.count(self.policy, key, &e, true);
        self.entries.insert(key, e);
    }

    /// The oldest write in flight matching `pred`, to wait on.
    pub fn oldest_write(&self, pred: impl Fn(&Entry) -> bool) -> Option<std::sync::Arc<crate::Ticket>> {
        self.books
            .inflight
            .iter()
            .filter_map(|k| self.entries.get(k))
            .find(|e| matches!(e.state, State::Writing { .. }) && pred(e))
            .and_then(|e| e.io().cloned())
    }

    // ------------------------------------------------------------ space

    pub fn free_slot(&mut self, slot: Range) {
        if let Err(e) = self.host.free(slot) {
            self.fail(format!(
                "the host arena's books are wrong (slot at {} of {} bytes given back twice)",
                e.off, e.len
            ));
        }
    }

    pub fn free_disk(&mut self, pl: Placement) {
        if let Err(e) = self.space.release(pl) {
            self.fail(format!(
                "the NVMe space's books are wrong (range at {} of {} bytes given back twice)",
                e.off, e.len
            ));
        }
    }

    /// Space of a transfer abandoned in the kernel: never handed out again.
    fn lose_slot(&mut self, slot: Range) {
        self.host_quarantine.push(slot);
    }

    pub fn quarantined_bytes(&self) -> u64 {
        self.host_quarantine.iter().map(Range::len).sum::<u64>() + self.space.quarantined_bytes()
    }

    // ------------------------------------------------------------ completions

    /// Finish the transfers whose tickets are done.
    pub fn reap(&mut self) {
        let done: Vec<u64> = self
            .books
            .inflight
            .iter()
            .copied()
            .filter(|k| self.entries.get(k).and_then(Entry::io).is_some_and(|t| t.is_done()))
            .collect();
        for key in done {
            let Ok(mut e) = self.take(key) else { continue };
            let io = e.io().cloned().expect("in flight");
            let res = io.poll().expect("done");
            let abandoned = io.abandoned();
            e.state = match std::mem::replace(&mut e.state, State::Empty) {
                State::Writing { src, disk, .. } => self.end_write(&mut e, src, disk, res, abandoned),
                State::Reading { dst, disk, .. } => self.end_read(&mut e, dst, disk, res, abandoned),
                other => other,
            };
            self.settle(key, e);
        }
    }

    /// Put an entry back after its transfer ended, or let it go if it was discarded meanwhile.
    pub fn settle(&mut self, key: u64, e: Entry) {
        if e.doomed {
            self.drop_entry(e);
        } else {
            self.put_back(key, e);
        }
    }

    /// Give an entry's space back (it was taken out and has no transfer in flight).
    pub fn drop_entry(&mut self, e: Entry) {
        match e.state {
            State::Filling { slot } | State::Host { slot } => self.free_slot(slot),
            State::Clean { slot, disk } => {
                self.free_slot(slot);
                self.free_disk(disk);
            }
            State::Disk { disk } => self.free_disk(disk),
            State::Empty | State::NoBytes | State::Writing { .. } | State::Reading { .. } => {}
        }
    }

    /// A clean entry gives up its slot (its bytes stay on NVMe); anything else is left as is.
    pub fn drop_clean(&mut self, key: u64) -> Result<()> {
        let mut e = self.take(key)?;
        e.state = match std::mem::replace(&mut e.state, State::Empty) {
            State::Clean { slot, disk } => {
                self.free_slot(slot);
                self.stats.evictions += 1;
                e.prefetched = false;
                State::Disk { disk }
            }
            other => other,
        };
        self.put_back(key, e);
        Ok(())
    }

    /// What evictions keep free, on its way out or clean: a quarter of the arena.
    pub fn headroom(&self) -> u64 {
        self.host.capacity() / 4
    }

    fn end_write(&mut self, e: &mut Entry, src: WriteSrc, disk: Placement, res: Result<()>, abandoned: bool) -> State {
        match (src, res) {
            // Even an eviction keeps its slot, clean: `make_room` drops it once a slot is short
            // (at once), and by then the backward may have used it or freed room.
            (WriteSrc::Slot { slot, evict }, Ok(())) => {
                if evict {
                    e.prefetched = false; // read ahead, and taken as a last resort all the same
                }
                State::Clean { slot, disk }
            }
            (WriteSrc::Caller | WriteSrc::Staged | WriteSrc::External, Ok(())) => State::Disk { disk },
            (src, Err(err)) => {
                // The file's range may still be written by the kernel if abandoned: keep it out of use.
                if abandoned {
                    self.space.quarantine(disk);
                } else {
                    self.free_disk(disk);
                }
                self.note_error(&err);
                match src {
                    // From the arena the bytes stay in the slot; the error waits for `flush`.
                    WriteSrc::Slot { slot, .. } => {
                        self.deferred.get_or_insert(err);
                        State::Host { slot }
                    }
                    // From caller memory the caller has the bytes and learns of it from its ticket.
                    WriteSrc::Caller | WriteSrc::Staged | WriteSrc::External => State::NoBytes,
                }
            }
        }
    }

    fn end_read(&mut self, e: &mut Entry, dst: ReadDst, disk: Placement, res: Result<()>, abandoned: bool) -> State {
        match (dst, res) {
            (ReadDst::Slot(slot), Ok(())) => State::Clean { slot, disk },
            (ReadDst::Slot(slot), Err(err)) => {
                // The NVMe copy is still there: the next acquire reads it again.
                if abandoned {
                    self.lose_slot(slot);
                } else {
                    self.free_slot(slot);
                }
                e.prefetched = false;
                self.note_error(&err);
                State::Disk { disk }
            }
            (ReadDst::Caller | ReadDst::Staged | ReadDst::External, res) => {
                if let Err(err) = res {
                    self.note_error(&err);
                }
                State::Disk { disk }
            }
        }
    }

    /// What an error of a transfer says about the store: a failed engine stops it; a full
    /// file system takes its device out of use until space is freed.
    pub fn note_error(&mut self, err: &Error) {
        match err {
            Error::EngineFailed { .. } => self.fail(err.to_string()),
            Error::Io { path, errno, .. } if *errno == libc::ENOSPC => self.space.mark_full(path),
            _ => {}
        }
    }

    /// Traffic counters from zero, peaks from what is in use now (capacities stay).
    pub fn reset_counters(&mut self) {
        let s = &self.stats;
        let devices = s.device_bytes_written.len();
        self.stats = Stats {
            host_capacity: s.host_capacity,
            nvme_capacity: s.nvme_capacity,
            device_bytes_written: vec![0; devices],
            device_bytes_read: vec![0; devices],
            ..Stats::default()
        };
        self.host.reset_peak();
        self.space.reset_peak();
    }

    /// Counters and space, as of now.
    pub fn snapshot(&self) -> Stats {
        let mut s = self.stats.clone();
        s.host_used = self.host.used();
        s.host_peak = self.host.peak_used();
        s.nvme_used = self.space.used();
        s.nvme_peak = self.space.peak();
        s.quarantined_bytes = self.quarantined_bytes();
        s.entries = self.entries.len() as u64 - self.books.doomed;
        s.device_used = self.space.device_used();
        s.device_high_water = self.space.device_high_water();
        s.failure = match &self.status {
            Status::Failed(why) => Some(why.clone()),
            _ => None,
        };
        s
    }

    /// The books rebuilt from the entries' states, against those kept: for the simulation.
    pub fn check_books(&self) -> std::result::Result<(), String> {
        let (mut books, mut slots) = (Books::default(), 0);
        for (&k, e) in &self.entries {
            books.count(self.policy, k, e, true);
            slots += e.slot().map_or(0, |r| r.len());
            if e.prefetched && !e.has_slot() {
                return Err(format!("entry {k} is read ahead without a slot"));
            }
        }
        let quarantined: u64 = self.host_quarantine.iter().map(Range::len).sum();
        if books != self.books {
            return Err("the books differ from the entries' states".into());
        }
        if slots + quarantined != self.host.used() {
            return Err(format!("{} arena bytes used, {} in slots", self.host.used(), slots + quarantined));
        }
        Ok(())
    }

    /// Forget everything (close): the space goes with the store.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.books = Books::default();
    }
}
