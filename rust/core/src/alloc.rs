//! A first-fit range allocator, shared by the host arena and the NVMe extents.

use std::collections::BTreeMap;

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

    /// `len` rounded up to the alignment.
    pub fn round(&self, len: u64) -> u64 {
        len.div_ceil(self.align) * self.align
    }

    /// The offset of a free range of `round(len)` bytes, or None if none is large enough.
    /// A zero length takes no space and gets offset 0.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let len = self.round(len);
        if len == 0 {
            return Some(0);
        }
        let (&off, &flen) = self.free.iter().find(|(_, &flen)| flen >= len)?;
        self.free.remove(&off);
        if flen > len {
            self.free.insert(off + len, flen - len);
        }
        self.used += len;
        self.peak_used = self.peak_used.max(self.used);
        self.high_water = self.high_water.max(off + len);
        Some(off)
    }

    /// Return a range given by `alloc` (same `len`).
    pub fn free(&mut self, off: u64, len: u64) {
        let len = self.round(len);
        if len == 0 {
            return;
        }
        debug_assert!(off + len <= self.capacity, "range outside the allocator");
        let mut start = off;
        let mut end = off + len;
        if let Some((&poff, &plen)) = self.free.range(..off).next_back() {
            debug_assert!(poff + plen <= off, "double free at {off}");
            if poff + plen == off {
                self.free.remove(&poff);
                start = poff;
            }
        }
        if let Some((&noff, &nlen)) = self.free.range(off..).next() {
            debug_assert!(noff >= end, "double free at {off}");
            if noff == end {
                self.free.remove(&noff);
                end = noff + nlen;
            }
        }
        self.free.insert(start, end - start);
        self.used -= len;
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
        assert_eq!(x, 0);
        assert_eq!(y, 4096);
        assert_eq!(a.used(), 3 * 4096);
        assert!([x, y].iter().all(|o| o % 4096 == 0));
        assert_eq!(a.alloc(0), Some(0));
        assert_eq!(a.used(), 3 * 4096);
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
        let offs: Vec<u64> = (0..16).map(|_| a.alloc(4096).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.available(), 0);
        a.free(offs[5], 4096);
        assert_eq!(a.alloc(4096), Some(offs[5]));
        assert_eq!(a.alloc(4096), None);
    }

    #[test]
    fn fragmentation_and_coalescing() {
        let mut a = RangeAllocator::new(8 * 4096, 4096);
        let offs: Vec<u64> = (0..8).map(|_| a.alloc(4096).unwrap()).collect();
        for o in offs.iter().step_by(2) {
            a.free(*o, 4096);
        }
        // Half the space is free, but no two blocks are adjacent.
        assert_eq!(a.available(), 4 * 4096);
        assert_eq!(a.fragments(), 4);
        assert_eq!(a.alloc(2 * 4096), None);
        for o in offs.iter().skip(1).step_by(2) {
            a.free(*o, 4096);
        }
        assert_eq!(a.fragments(), 1);
        assert_eq!(a.largest_free(), 8 * 4096);
        assert_eq!(a.alloc(8 * 4096), Some(0));
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
            live.push((a.alloc(len).unwrap(), len));
            if live.len() > 32 || i % 3 == 0 {
                let (o, l) = live.remove((rng as usize / 7) % live.len());
                a.free(o, l);
            }
        }
        // At most ~33 live ranges of < 256 KiB each: first fit stays far below capacity.
        assert!(a.high_water() < 64 << 20, "high water {}", a.high_water());
        for (o, l) in live.drain(..) {
            a.free(o, l);
        }
        assert_eq!(a.used(), 0);
        assert_eq!(a.fragments(), 1);
    }

    #[test]
    fn random_ops_never_overlap() {
        let mut a = RangeAllocator::new(256 * 4096, 4096);
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut rng = 12345u64;
        for _ in 0..5000 {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            if rng % 3 != 0 {
                let len = (rng >> 33) % (8 * 4096) + 1;
                if let Some(o) = a.alloc(len) {
                    let l = a.round(len);
                    for &(lo, ll) in &live {
                        assert!(o + l <= lo || lo + ll <= o, "overlap");
                    }
                    assert_eq!(o % 4096, 0);
                    live.push((o, l));
                }
            } else if !live.is_empty() {
                let (o, l) = live.swap_remove((rng >> 20) as usize % live.len());
                a.free(o, l);
            }
            assert_eq!(a.used(), live.iter().map(|x| x.1).sum::<u64>());
        }
    }
}
