//! The state of one entry. Every change goes through `Inner::take` and
//! `Inner::put_back` (store/mod.rs), which keep the eviction indexes, the list
//! of transfers in flight and the byte counters in step with the states.

use super::placement::Placement;
use crate::alloc::Range;
use crate::ticket::Ticket;
use std::sync::Arc;

pub(crate) enum State {
    /// Zero bytes: nothing stored anywhere.
    Empty,
    /// Reserved with an arena slot that the caller is filling (until `commit`).
    Filling { slot: Range },
    /// No bytes yet: reserved without a slot (for `write_staged`), or its write from
    /// caller memory failed.
    NoBytes,
    /// In the arena only.
    Host { slot: Range },
    /// Being written to NVMe.
    Writing { src: WriteSrc, disk: Placement, io: Arc<Ticket> },
    /// In the arena and on NVMe.
    Clean { slot: Range, disk: Placement },
    /// On NVMe only.
    Disk { disk: Placement },
    /// Being read from NVMe.
    Reading { dst: ReadDst, disk: Placement, io: Arc<Ticket> },
}

pub(crate) enum WriteSrc {
    /// Its arena slot; with `evict`, written to make room, so its slot counts as on its way out.
    Slot { slot: Range, evict: bool },
    /// Caller memory (`write_from`); counts against the bytes that may wait for NVMe.
    Caller,
    /// Caller memory copied through staging by the calling thread, which finishes it.
    Staged,
    /// Written by the caller outside the store (cuFile), finished by `end_external`.
    External,
}

pub(crate) enum ReadDst {
    /// An arena slot, which the entry keeps.
    Slot(Range),
    /// Caller memory (`read_into`).
    Caller,
    /// Caller memory through staging, by the calling thread, which finishes it.
    Staged,
    /// Read by the caller outside the store (cuFile), finished by `end_external`.
    External,
}

pub(crate) struct Entry {
    pub len: u64,
    pub state: State,
    /// Callers holding its slot (`acquire` .. `release`).
    pub pins: u32,
    /// Read ahead and not used yet: evicted only when nothing else can go.
    pub prefetched: bool,
    /// Freed while a transfer was in flight (`discard`): gone once it ends.
    pub doomed: bool,
    /// The group it was put in (`Store::set_group`: a forward), and its place in the put order.
    pub group: u64,
    pub put_seq: u64,
    pub host_seq: u64,
    pub access_seq: u64,
}

/// An entry's place in an eviction index: (read ahead, rank, key), the smallest goes first.
pub(crate) type EvictKey = (bool, u128, u64);

impl Entry {
    pub fn new(len: u64, state: State, seq: u64, group: u64) -> Self {
        let (pins, prefetched, doomed) = (0, false, false);
        Entry { len, state, pins, prefetched, doomed, group, put_seq: seq, host_seq: seq, access_seq: seq }
    }

    /// Its eviction rank under `policy`. Lifetime: groups are used in the order they were put
    /// and each one's entries in reverse, so the latest group's earliest entry is needed last.
    pub fn rank(&self, policy: super::Eviction) -> u128 {
        match policy {
            super::Eviction::Lifetime => (u128::from(u64::MAX - self.group) << 64) | u128::from(self.put_seq),
            super::Eviction::Lru => u128::from(self.access_seq),
            super::Eviction::Fifo => u128::from(self.host_seq),
        }
    }

    /// The arena offset to serve a read from: its bytes are in the slot.
    pub fn readable_slot(&self) -> Option<u64> {
        match &self.state {
            State::Host { slot }
            | State::Clean { slot, .. }
            | State::Writing { src: WriteSrc::Slot { slot, .. }, .. } => Some(slot.off()),
            _ => None,
        }
    }

    /// Its arena slot, filled or not.
    pub fn slot(&self) -> Option<&Range> {
        match &self.state {
            State::Filling { slot }
            | State::Host { slot }
            | State::Clean { slot, .. }
            | State::Writing { src: WriteSrc::Slot { slot, .. }, .. }
            | State::Reading { dst: ReadDst::Slot(slot), .. } => Some(slot),
            _ => None,
        }
    }

    /// Whether it holds an arena slot (filled or not).
    pub fn has_slot(&self) -> bool {
        self.slot().is_some()
    }

    /// Its NVMe copy holds the bytes (written, or being read back; none are needed for zero bytes).
    pub fn on_nvme(&self) -> bool {
        matches!(self.state, State::Empty | State::Clean { .. } | State::Disk { .. } | State::Reading { .. })
    }

    /// The transfer in flight, if any.
    pub fn io(&self) -> Option<&Arc<Ticket>> {
        match &self.state {
            State::Writing { io, .. } | State::Reading { io, .. } => Some(io),
            _ => None,
        }
    }

    /// In flight and finished by `reap` (not by a thread streaming through staging).
    pub fn reaped(&self) -> bool {
        matches!(
            self.state,
            State::Writing { src: WriteSrc::Slot { .. } | WriteSrc::Caller, .. }
                | State::Reading { dst: ReadDst::Slot(_) | ReadDst::Caller, .. }
        )
    }

    /// The key of this entry in the eviction index, if it may give up its slot now.
    pub fn evict_key(&self, policy: super::Eviction, key: u64) -> Option<EvictKey> {
        if self.pins > 0 || self.len == 0 || !matches!(self.state, State::Host { .. } | State::Clean { .. }) {
            return None;
        }
        Some((self.prefetched, self.rank(policy), key))
    }

    /// Bytes of its slot if clean (also on NVMe) and not read ahead: had at once.
    pub fn clean_bytes(&self) -> u64 {
        match &self.state {
            State::Clean { slot, .. } if !self.prefetched => slot.len(),
            _ => 0,
        }
    }

    /// Whether its slot write in flight (if any) gives up the slot's room once it ends.
    pub fn set_evict(&mut self, to: bool) {
        if let State::Writing { src: WriteSrc::Slot { evict, .. }, .. } = &mut self.state {
            *evict = to;
        }
    }

    /// Bytes of its slot on the way out (an eviction write in flight).
    pub fn leaving(&self) -> u64 {
        match &self.state {
            State::Writing { src: WriteSrc::Slot { slot, evict: true }, .. } => slot.len(),
            _ => 0,
        }
    }

    /// Bytes of caller memory its write from caller memory holds.
    pub fn caller_held(&self) -> u64 {
        match self.state {
            State::Writing { src: WriteSrc::Caller, .. } => self.len.div_ceil(crate::ALIGN) * crate::ALIGN,
            _ => 0,
        }
    }
}
