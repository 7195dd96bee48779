//! Moving an entry's bytes: requests from a placement to an arena slot or
//! caller memory, streaming through the staging buffer, and waiting.

use super::inner::Inner;
use super::placement::{chunks, Piece};
use super::{Need, Store};
use crate::engine::{Dir, IoReq};
use crate::error::{Error, Result};
use crate::ticket::{Owner, Ticket};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

/// io_uring limits one registered buffer to 1 GiB, so the arena is registered
/// in pieces of this size and no transfer crosses a piece boundary.
pub(crate) const FIXED_BUF: u64 = 1 << 30;

/// Where a transfer's bytes are in memory.
#[derive(Clone, Copy)]
pub(crate) enum Mem {
    /// The slot at this arena offset.
    Arena(u64),
    /// Caller memory (page-aligned, room for the entry's length rounded up to 4096).
    Caller(*mut u8),
}

/// The staging buffer, through which entries without a slot stream.
pub(crate) struct Staging {
    pub buf: crate::arena::Arena,
    /// A transfer through it was abandoned in the kernel: it is never used again.
    pub lost: bool,
}

impl Store {
    /// Submit the transfer of `pieces` between NVMe and `mem`; its ticket holds `owner`.
    ///
    /// # Safety
    /// `mem` must be valid for the pieces' extent until the ticket is done (forever if it is
    /// abandoned), and untouched by others meanwhile (see `IoReq::new`).
    pub(crate) unsafe fn submit_pieces(
        &self,
        g: &mut Inner,
        pieces: &[Piece],
        dir: Dir,
        mem: Mem,
        owner: Option<Owner>,
    ) -> Arc<Ticket> {
        let mut reqs: Vec<(Piece, Option<u16>)> = Vec::new();
        for c in chunks(pieces, self.cfg.block_size) {
            match mem {
                Mem::Arena(base) => {
                    // Split where a chunk crosses a registered-buffer boundary of the arena.
                    let start = base + c.entry_off;
                    let boundary = (start / FIXED_BUF + 1) * FIXED_BUF;
                    let first = c.len.min(boundary - start);
                    reqs.push((Piece { len: first, ..c }, Some((start / FIXED_BUF) as u16)));
                    if first < c.len {
                        let rest = Piece {
                            file_off: c.file_off + first,
                            entry_off: c.entry_off + first,
                            len: c.len - first,
                            ..c
                        };
                        reqs.push((rest, Some((boundary / FIXED_BUF) as u16)));
                    }
                }
                Mem::Caller(_) => reqs.push((c, None)),
            }
        }
        let ticket = Ticket::with_owner(reqs.len(), owner);
        let mut per_dev: Vec<Vec<IoReq>> = (0..self.cfg.devices.len()).map(|_| Vec::new()).collect();
        for (c, fixed) in reqs {
            let buf = match mem {
                // Safety: the slot [base, base + rounded len) lies in the arena.
                Mem::Arena(base) => unsafe { self.arena.as_ptr().add((base + c.entry_off) as usize) },
                // Safety: the caller's buffer has room for the rounded length (this function's contract).
                Mem::Caller(p) => unsafe { p.add(c.entry_off as usize) },
            };
            // Safety: passed on from this function's contract.
            per_dev[c.dev].push(unsafe { IoReq::new(dir, c.file_off, buf, c.len as usize, fixed, ticket.clone()) });
        }
        self.submit(g, per_dev, dir);
        ticket
    }

    /// Hand requests to the device queues, counting them.
    fn submit(&self, g: &mut Inner, per_dev: Vec<Vec<IoReq>>, dir: Dir) {
        let devices = self.devices.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (d, reqs) in per_dev.into_iter().enumerate() {
            if reqs.is_empty() {
                continue;
            }
            let bytes: u64 = reqs.iter().map(|r| r.len() as u64).sum();
            g.stats.count_io(dir, d, bytes, reqs.len() as u64);
            match devices.get(d) {
                Some(dev) => dev.queue.submit(reqs),
                // Closed under a racing caller: fail the requests rather than lose them.
                None => reqs.into_iter().for_each(|r| r.complete(Err(Error::Closed))),
            }
        }
    }

    /// Wait for a ticket, driving simulated engines meanwhile.
    pub(crate) fn wait_io(&self, t: &Ticket) -> Result<()> {
        loop {
            if let Some(r) = t.poll() {
                return r;
            }
            let moved = {
                let devices = self.devices.read().unwrap_or_else(std::sync::PoisonError::into_inner);
                devices.iter().any(|d| d.queue.drive())
            };
            if !moved {
                if let Some(r) = t.wait_timeout(Duration::from_millis(20)) {
                    return r;
                }
            }
        }
    }

    /// Wait for a ticket with the lock released (the time counts as waiting), then take the
    /// lock again and finish what completed meanwhile; fails if the store no longer meets `need`.
    pub(super) fn wait_for<'a>(
        &'a self,
        g: MutexGuard<'a, Inner>,
        t: &Ticket,
        need: Need,
    ) -> Result<(MutexGuard<'a, Inner>, Result<()>)> {
        drop(g);
        let t0 = Instant::now();
        let r = self.wait_io(t);
        let mut g = self.lock_for(need)?;
        g.stats.wait_seconds += t0.elapsed().as_secs_f64();
        g.reap();
        Ok((g, r))
    }

    /// Move `pieces` between NVMe and caller memory through the staging buffer, a few blocks
    /// at a time; `io(entry_off, bytes)` fills each batch before a write, or takes it after a
    /// read. Only the entry's `len` bytes are passed; the lock is not held.
    pub(crate) fn stream(
        &self,
        pieces: &[Piece],
        dir: Dir,
        len: u64,
        io: &mut dyn FnMut(u64, &mut [u8]),
    ) -> Result<()> {
        let mut staging = self.staging.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if staging.lost {
            return Err(Error::Failed("the staging buffer was lost to an abandoned transfer".into()));
        }
        let cap = staging.buf.len() as u64;
        let all: Vec<Piece> = chunks(pieces, self.cfg.block_size).collect();
        let mut start = 0;
        while start < all.len() {
            let base = all[start].entry_off;
            let mut end = start;
            while end < all.len() && all[end].entry_off + all[end].len - base <= cap {
                end += 1;
            }
            let batch = &all[start..end];
            let span = batch.iter().map(|p| p.len).sum::<u64>();
            let data = span.min(len - base) as usize;
            let sp = staging.buf.as_ptr();
            // Safety: staging holds `cap` bytes; nobody else uses it while its lock is held, and
            // the kernel does not while this slice lives.
            let bytes = || unsafe { std::slice::from_raw_parts_mut(sp, data) };
            if dir == Dir::Write {
                io(base, bytes());
            }
            let ticket = {
                let mut g = self.lock()?;
                let pieces: Vec<Piece> = batch.iter().map(|p| Piece { entry_off: p.entry_off - base, ..*p }).collect();
                // Safety: staging holds the batch and is ours (its lock) until the ticket is done;
                // if the ticket is abandoned, staging is marked lost below and never used again.
                unsafe { self.submit_pieces(&mut g, &pieces, dir, Mem::Caller(sp), None) }
            };
            let t0 = Instant::now();
            let r = self.wait_io(&ticket);
            self.lock_any().stats.wait_seconds += t0.elapsed().as_secs_f64();
            if ticket.abandoned() {
                staging.lost = true;
            }
            r?;
            if dir == Dir::Read {
                io(base, bytes());
            }
            start = end;
        }
        Ok(())
    }
}
