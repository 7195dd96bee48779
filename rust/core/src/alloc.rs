//! A first-fit range allocator, shared by the host arena and the NVMe extents.

use std::collections::BTreeMap;

/// A range handed out by [`RangeAllocator::alloc`]. Not `Clone`: it goes back
/// with [`RangeAllocator::free`], which takes it by value, so one range cannot
/// be freed twice.
#[must_use]
#[derive(Debug, PartialEq, Eq)]
pub struct Range {
    off: u64,
    len: u64,
}

impl Range {
    pub fn off(&self) -> u64 {
        self.off
    }
    /// The length as allocated (rounded up to the alignment).
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A range given back that overlaps free space: the allocator's books and its
/// callers disagree, and handing out more ranges could overlap live ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoubleFree {
    pub off: u64,
    pub len: u64,
}

/// Hands out aligned ranges of `[0, capacity)`.
///
/// First fit by address keeps allocations packed at the low end, so a file
/// that is reused through many put/free cycles does not grow.
#[derive(Debug)]
pub struct RangeAllocator {
    capacity: u64,
    align: u64,
    /// offset -> length of each free range; ranges never touch (they are coalesced).
    free: BTreeMap<u64, u64>,
    used: u64,
    peak_used: u64,
    high_water: u64,
}

impl RangeAllocator {
    /// `capacity` is rounded down to `align`, which must be a power of two.
    pub fn new(capacity: u64, align: u64) -> Self {
        assert!(align.is_power_of_two(), "alignment must be a power of two");
        let capacity = capacity & !(align - 1);
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        RangeAllocator { capacity, align, free, used: 0, peak_used: 0, high_water: 0 }
    }

    /// `len` rounded up to the alignment; None past `u64::MAX`.
    pub fn round(&self, len: u64) -> Option<u64> {
        len.checked_add(self.align - 1).map(|l| l & !(self.align - 1))
    }

    /// A free range of `round(len)` bytes, or None if none is large enough.
    /// A zero length takes no space and gets offset 0.
    pub fn alloc(&mut self, len: u64) -> Option<Range> {
        let len = self.round(len)?;
        if len == 0 {
            return Some(Range { off: 0, len: 0 });
        }
        let (&off, &flen) = self.free.iter().find(|(_, &flen)| flen >= len)?;
        self.free.remove(&off);
        if flen > len {
            self.free.insert(off + len, flen - len);
        }
        self.used += len;
        self.peak_used = self.peak_used.max(self.used);
        self.high_water = self.high_water.max(off + len);
        Some(Range { off, len })
    }

    /// Give a range back. One that overlaps free space or lies outside the
    /// allocator is refused (and leaked): checked in every build.
    pub fn free(&mut self, r: Range) -> Result<(), DoubleFree> {
        let Range { off, len } = r;
        if len == 0 {
            return Ok(());
        }
        let end = off.checked_add(len).filter(|&e| e <= self.capacity).ok_or(DoubleFree { off, len })?;
        let prev = self.free.range(..off).next_back().map(|(&o, &l)| (o, l));
        let next = self.free.range(off..).next().map(|(&o, &l)| (o, l));
        if prev.is_some_and(|(po, pl)| po + pl > off) || next.is_some_and(|(no, _)| no < end) {
            return Err(DoubleFree { off, len });
        }
        let mut start = off;
        let mut stop = end;
        if let Some((po, _)) = prev.filter(|&(po, pl)| po + pl == off) {
            self.free.remove(&po);
            start = po;
        }
        if let Some((no, nl)) = next.filter(|&(no, _)| no == end) {
            self.free.remove(&no);
            stop = no + nl;
        }
        self.free.insert(start, stop - start);
        self.used -= len;
        Ok(())
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    pub fn used(&self) -> u64 {
        self.used
    }
    pub fn available(&self) -> u64 {
        self.capacity - self.used
    }
    pub fn peak_used(&self) -> u64 {
        self.peak_used
    }
    /// The peak from now on counts from what is in use now.
    pub fn reset_peak(&mut self) {
        self.peak_used = self.used;
    }
    /// The highest end offset ever handed out: the size a file backed by this allocator reaches.
    pub fn high_water(&self) -> u64 {
        self.high_water
    }
    pub fn largest_free(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }
    pub fn fragments(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_and_aligns() {
        let mut a = RangeAllocator::new(1 << 20, 4096);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(4097).unwrap();
        assert_eq!((x.off(), x.len()), (0, 4096));
        assert_eq!((y.off(), y.len()), (4096, 8192));
        assert_eq!(a.used(), 3 * 4096);
        assert_eq!(a.alloc(0).unwrap().off(), 0);
        assert_eq!(a.used(), 3 * 4096);
    }

    #[test]
    fn huge_lengths_do_not_wrap() {
        let mut a = RangeAllocator::new(1 << 20, 4096);
        assert_eq!(a.round(u64::MAX), None);
        assert_eq!(a.alloc(u64::MAX), None);
        assert_eq!(a.alloc(u64::MAX - 4094), None);
        assert_eq!(a.used(), 0);
    }

    #[test]
    fn capacity_rounds_down() {
        let a = RangeAllocator::new(10_000, 4096);
        assert_eq!(a.capacity(), 8192);
        assert_eq!(RangeAllocator::new(4095, 4096).capacity(), 0);
    }

    #[test]
    fn exhaustion_then_reuse() {
        let mut a = RangeAllocator::new(16 * 4096, 4096);
        let mut rs: Vec<Range> = (0..16).map(|_| a.alloc(4096).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.available(), 0);
        let r5 = rs.remove(5);
        let off = r5.off();
        a.free(r5).unwrap();
        assert_eq!(a.alloc(4096).unwrap().off(), off);
        assert_eq!(a.alloc(4096), None);
    }

    #[test]
    fn a_double_free_is_refused_in_every_build() {
        let mut a = RangeAllocator::new(8 * 4096, 4096);
        let x = a.alloc(2 * 4096).unwrap();
        let _y = a.alloc(4096).unwrap();
        // A forged copy of x, as a caller whose books went wrong would give back.
        let twin = Range { off: x.off(), len: x.len() };
        a.free(x).unwrap();
        assert_eq!(a.free(twin), Err(DoubleFree { off: 0, len: 2 * 4096 }));
        // Overlapping the free tail, and outside the allocator.
        assert!(a.free(Range { off: 4 * 4096, len: 4096 }).is_err());
        assert!(a.free(Range { off: 8 * 4096, len: 4096 }).is_err());
        assert!(a.free(Range { off: u64::MAX - 4095, len: 4096 }).is_err());
        // The books are unchanged: two ranges free, one in use.
        assert_eq!(a.used(), 4096);
        assert_eq!(a.fragments(), 2);
        let big = a.alloc(5 * 4096).unwrap();
        assert_eq!(big.off(), 3 * 4096);
    }

    #[test]
    fn fragmentation_and_coalescing() {
        let mut a = RangeAllocator::new(8 * 4096, 4096);
        let rs: Vec<Range> = (0..8).map(|_| a.alloc(4096).unwrap()).collect();
        let (even, odd): (Vec<_>, Vec<_>) = rs.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        for (_, r) in even {
            a.free(r).unwrap();
        }
        // Half the space is free, but no two blocks are adjacent.
        assert_eq!(a.available(), 4 * 4096);
        assert_eq!(a.fragments(), 4);
        assert_eq!(a.alloc(2 * 4096), None);
        for (_, r) in odd {
            a.free(r).unwrap();
        }
        assert_eq!(a.fragments(), 1);
        assert_eq!(a.largest_free(), 8 * 4096);
        assert_eq!(a.alloc(8 * 4096).unwrap().off(), 0);
    }

    #[test]
    fn first_fit_keeps_high_water_bounded() {
        let mut a = RangeAllocator::new(1 << 30, 4096);
        let mut live = Vec::new();
        let mut rng = 0x9e3779b97f4a7c15u64;
        for i in 0..20_000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = (rng % (256 * 1024)) + 1;
            live.push(a.alloc(len).unwrap());
            if live.len() > 32 || i % 3 == 0 {
                let r = live.remove((rng as usize / 7) % live.len());
                a.free(r).unwrap();
            }
        }
        // At most ~33 live ranges of < 256 KiB each: first fit stays far below capacity.
        assert!(a.high_water() < 64 << 20, "high water {}", a.high_water());
        for r in live.drain(..) {
            a.free(r).unwrap();
        }
        assert_eq!(a.used(), 0);
        assert_eq!(a.fragments(), 1);
    }

    #[test]
    fn random_ops_never_overlap() {
        let mut a = RangeAllocator::new(256 * 4096, 4096);
        let mut live: Vec<Range> = Vec::new();
        let mut rng = 12345u64;
        for _ in 0..5000 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            if rng % 3 != 0 {
                let len = (rng >> 33) % (8 * 4096) + 1;
                if let Some(r) = a.alloc(len) {
                    for l in &live {
                        assert!(r.off() + r.len() <= l.off() || l.off() + l.len() <= r.off(), "overlap");
                    }
                    assert_eq!(r.off() % 4096, 0);
                    live.push(r);
                }
            } else if !live.is_empty() {
                let r = live.swap_remove((rng >> 20) as usize % live.len());
                a.free(r).unwrap();
            }
            assert_eq!(a.used(), live.iter().map(|x| x.len()).sum::<u64>());
        }
    }
}
