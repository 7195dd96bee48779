//! Room in the host arena: slots found by evicting entries in policy order,
//! their bytes written to NVMe first when they are not there yet.

use super::entry::{Entry, EvictKey, ReadDst, State, WriteSrc};
use super::inner::Inner;
use super::placement::Placement;
use super::transfer::Mem;
use super::Store;
use crate::alloc::Range;
use crate::engine::Dir;
use crate::error::Result;
use std::sync::MutexGuard;

/// What a caller of [`Store::make_room`] may do to get a slot.
#[derive(Clone, Copy)]
pub(crate) enum Room {
    /// A put: waits for eviction writes, keeps headroom, and at last takes read-ahead entries.
    Put,
    /// A read the caller waits for: as a put, but never takes read-ahead entries.
    Read,
    /// A read ahead: no waiting and no headroom, and only entries ranked before `before` in
    /// the eviction order go (with lifetime: those needed after the entry read ahead).
    Ahead { before: u128 },
}

impl Store {
    /// Find a host slot of `len` bytes, evicting by policy as `room` allows. None when the
    /// entry cannot get a slot (bigger than the arena, or everything else pinned or read
    /// ahead, or for `Ahead` none to be had without waiting).
    ///
    /// The lock may be released meanwhile: callers check their entry's state again.
    pub(crate) fn make_room<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        len: u64,
        room: Room,
    ) -> Result<(MutexGuard<'a, Inner>, Option<Range>)> {
        let Some(need) = g.host.round(len).filter(|&n| n > 0 && n <= g.host.capacity()) else {
            return Ok((g, None));
        };
        let (wait, before) = match room {
            Room::Put | Room::Read => (true, u128::MAX),
            Room::Ahead { before } => (false, before),
        };
        // Keep some of the arena free, on its way out or clean, so the disk stays busy while
        // the caller fills the next slot.
        let headroom = if wait { g.headroom() } else { 0 };
        loop {
            g.reap();
            if let Some(slot) = g.host.alloc(need) {
                if wait {
                    self.start_evictions(&mut g, 0, headroom, false, before);
                }
                return Ok((g, Some(slot)));
            }
            // No NVMe room is not an error here: without a slot the caller streams through
            // staging, which reports it if it applies.
            self.start_evictions(&mut g, need, headroom, false, before);
            if let Some(slot) = g.host.alloc(need) {
                return Ok((g, Some(slot)));
            }
            if !wait {
                return Ok((g, None));
            }
            if g.books.leaving == 0 && matches!(room, Room::Put) {
                self.start_evictions(&mut g, need, 0, true, before);
                if let Some(slot) = g.host.alloc(need) {
                    return Ok((g, Some(slot)));
                }
            }
            let Some(t) = g.oldest_write(|e| e.leaving() > 0) else { return Ok((g, None)) };
            let (g2, _) = self.wait_unlocked(g, &t)?;
            g = g2;
            if let Some(err) = g.deferred.take() {
                if err.errno() != Some(libc::ENOSPC) {
                    return Err(err);
                }
            }
        }
    }

    /// Make room among entries ranked before `before`: clean ones give up their slot while
    /// no free range holds `need`; dirty ones are written out (until NVMe has no room) while
    /// free + leaving + clean bytes fall short of `need + headroom`. Entries read ahead and
    /// not used yet go only with `take_prefetched`: evicting them would mean reading them again.
    fn start_evictions(&self, g: &mut Inner, need: u64, headroom: u64, take_prefetched: bool, before: u128) {
        let may_go = |&(prefetched, rank, _): &EvictKey| (take_prefetched || !prefetched) && rank < before;
        while g.host.largest_free() < need {
            let Some(&(_, _, key)) = g.books.clean.iter().next().filter(|k| may_go(k)) else { break };
            if g.drop_clean(key).is_err() {
                break;
            }
        }
        let mut budget = (need + headroom).saturating_sub(g.host.available() + g.books.leaving + g.books.clean_bytes);
        let mut after: Option<EvictKey> = None;
        while budget > 0 {
            let next = match after {
                None => g.books.dirty.iter().next(),
                Some(a) => g.books.dirty.range((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)).next(),
            };
            let Some(&cand) = next.filter(|k| may_go(k)) else { break };
            after = Some(cand);
            let Ok(mut e) = g.take(cand.2) else { continue };
            let res = match std::mem::replace(&mut e.state, State::Empty) {
                State::Host { slot } => {
                    let size = slot.len();
                    self.start_write(g, &mut e, slot, true).map(|()| size)
                }
                other => {
                    e.state = other;
                    Ok(0)
                }
            };
            g.put_back(cand.2, e);
            match res {
                Ok(size) => budget = budget.saturating_sub(size),
                Err(_) => break, // no NVMe room
            }
        }
    }

    /// Write an entry's slot to NVMe (its state becomes `Writing`); without NVMe room it
    /// stays in the host tier and the error says why.
    pub(crate) fn start_write(&self, g: &mut Inner, e: &mut Entry, slot: Range, evict: bool) -> Result<()> {
        let disk = match self.alloc_disk(g, e.len) {
            Ok(d) => d,
            Err(err) => {
                e.state = State::Host { slot };
                return Err(err);
            }
        };
        // Safety: the slot is the entry's and stays allocated to it until the write is reaped
        // (or quarantined if the write is abandoned).
        let io = unsafe { self.submit_pieces(g, &disk.pieces, Dir::Write, Mem::Arena(slot.off()), None) };
        e.state = State::Writing { src: WriteSrc::Slot { slot, evict }, disk, io };
        Ok(())
    }

    /// Read an entry on NVMe into `slot`.
    pub(crate) fn start_read(&self, g: &mut Inner, e: &mut Entry, disk: Placement, slot: Range) {
        let seq = g.next_seq();
        e.host_seq = seq;
        e.access_seq = seq;
        // Safety: as in start_write: the slot is the entry's until the read is reaped.
        let io = unsafe { self.submit_pieces(g, &disk.pieces, Dir::Read, Mem::Arena(slot.off()), None) };
        e.state = State::Reading { dst: ReadDst::Slot(slot), disk, io };
    }

    /// NVMe space for `len` bytes, growing the files ahead of use.
    pub(crate) fn alloc_disk(&self, g: &mut Inner, len: u64) -> Result<Placement> {
        let mut notices = Vec::new();
        let res = g.space.alloc(len, self.cfg.block_size, &mut notices);
        if !notices.is_empty() {
            self.notices.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(notices);
        }
        res
    }
}
