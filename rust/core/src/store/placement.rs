//! NVMe space: where an entry's bytes go over the devices (striped by
//! `block_size` units), the files grown ahead of use, and chunking into requests.

use crate::alloc::{DoubleFree, Range, RangeAllocator};
use crate::device::ALIGN;
use crate::error::{Error, Result};
use std::os::fd::RawFd;
use std::path::PathBuf;

/// A range of an entry's bytes in one device's file, for a transfer outside the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub dev: usize,
    pub file_off: u64,
    /// Offset of these bytes within the entry.
    pub entry_off: u64,
    pub len: u64,
}

/// One range of an entry on one device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub dev: usize,
    pub file_off: u64,
    /// Offset of these bytes within the entry.
    pub entry_off: u64,
    pub len: u64,
}

/// An entry's space: the pieces to transfer and the ranges that own the space.
pub(crate) struct Placement {
    pub pieces: Vec<Piece>,
    extents: Vec<(usize, Range)>,
}

struct DevSpace {
    alloc: RangeAllocator,
    path: PathBuf,
    /// Its file, grown ahead of use; None for a simulated device. Open while the store is.
    fd: Option<RawFd>,
    /// The file system said ENOSPC under our capacity: left out until space is freed.
    full: bool,
    /// The file is allocated up to here (fallocate); writes below it do not extend the file.
    grown: u64,
    /// fallocate works on this file system.
    can_grow: bool,
}

/// The space of every device, and what must never be handed out again.
pub(crate) struct Space {
    devs: Vec<DevSpace>,
    step: u64,
    rotation: usize,
    quarantined: Vec<(usize, Range)>,
}

impl Space {
    /// One device per (directory, capacity, file).
    pub fn new(devices: Vec<(PathBuf, u64, Option<RawFd>)>, step: u64) -> Self {
        let devs = devices
            .into_iter()
            .map(|(path, cap, fd)| DevSpace {
                alloc: RangeAllocator::new(cap, ALIGN),
                path,
                fd,
                full: false,
                grown: 0,
                can_grow: step > 0,
            })
            .collect();
        Space { devs, step, rotation: 0, quarantined: Vec::new() }
    }

    /// Space for `len` bytes over the devices that have room, striped by `unit`. A device
    /// that is full is left out and the others take over.
    pub fn alloc(&mut self, len: u64, unit: u64, notices: &mut Vec<String>) -> Result<Placement> {
        let Some(len) = len.checked_next_multiple_of(ALIGN) else {
            return Err(Error::OutOfSpace { needed: len, detail: "the entry is larger than any device".into() });
        };
        let nunits = len.div_ceil(unit);
        let mut devs: Vec<usize> = (0..self.devs.len()).filter(|&d| !self.devs[d].full).collect();
        // Rotate the first device per entry so small entries spread too.
        self.rotation = self.rotation.wrapping_add(1);
        let rot = self.rotation % devs.len().max(1);
        devs.rotate_left(rot);
        'retry: while !devs.is_empty() {
            let k = devs.len() as u64;
            let unit_len = |i: u64| if i + 1 == nunits { len - i * unit } else { unit };
            let mut extents: Vec<(usize, Range)> = Vec::with_capacity(devs.len());
            for (j, &d) in devs.iter().enumerate() {
                let size: u64 = (j as u64..nunits).step_by(k as usize).map(unit_len).sum();
                if size == 0 {
                    continue;
                }
                let got = self.devs[d].alloc.alloc(size);
                let grown = match &got {
                    Some(r) => self.grow(d, r.off() + r.len(), notices),
                    None => false,
                };
                if !grown {
                    if let Some(r) = got {
                        let _ = self.devs[d].alloc.free(r);
                    }
                    for (d, r) in extents {
                        let _ = self.devs[d].alloc.free(r);
                    }
                    devs.remove(j);
                    continue 'retry;
                }
                extents.push((d, got.expect("allocated above")));
            }
            let base = |dev: usize| extents.iter().find(|(d, _)| *d == dev).map_or(0, |(_, r)| r.off());
            let pieces = (0..nunits)
                .map(|i| {
                    let dev = devs[(i % k) as usize];
                    Piece { dev, file_off: base(dev) + (i / k) * unit, entry_off: i * unit, len: unit_len(i) }
                })
                .collect();
            return Ok(Placement { pieces, extents });
        }
        let states: Vec<String> = self
            .devs
            .iter()
            .map(|d| {
                let path = d.path.display();
                if d.full {
                    format!("{path}: its file system is full")
                } else {
                    let (free, big) = (d.alloc.available(), d.alloc.largest_free());
                    format!("{path}: {free} of {} bytes free, largest free range {big}", d.alloc.capacity())
                }
            })
            .collect();
        Err(Error::OutOfSpace {
            needed: len,
            detail: format!("the host arena is full and no NVMe directory has room ({})", states.join("; ")),
        })
    }

    /// Make sure the file of device `d` is allocated up to `end`, growing it a step at a time
    /// so that writes do not extend the file (which file systems serialise). False when the
    /// file system has no room for it.
    fn grow(&mut self, d: usize, end: u64, notices: &mut Vec<String>) -> bool {
        let (step, dev) = (self.step, &mut self.devs[d]);
        let Some(fd) = dev.fd.filter(|_| dev.can_grow && end > dev.grown) else { return true };
        let target = end.max(dev.grown.saturating_add(step)).min(dev.alloc.capacity()).max(end);
        for want in [target, end] {
            // Safety: fallocate on a file descriptor the store keeps open.
            let rc = unsafe { libc::fallocate(fd, 0, dev.grown as libc::off_t, (want - dev.grown) as libc::off_t) };
            if rc == 0 {
                dev.grown = want;
                return true;
            }
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if errno != libc::ENOSPC && errno != libc::EDQUOT {
                dev.can_grow = false;
                notices.push(format!(
                    "cannot preallocate the file in {} ({}); it grows as it is written",
                    dev.path.display(),
                    std::io::Error::from_raw_os_error(errno)
                ));
                return true;
            }
        }
        dev.full = true;
        false
    }

    /// Give an entry's space back. Room on a device whose file system was full makes it worth
    /// trying again.
    pub fn release(&mut self, pl: Placement) -> std::result::Result<(), DoubleFree> {
        let mut res = Ok(());
        for (d, r) in pl.extents {
            if let Err(e) = self.devs[d].alloc.free(r) {
                res = Err(e);
            }
            self.devs[d].full = false;
        }
        res
    }

    /// Never hand this space out again: the kernel may still write it.
    pub fn quarantine(&mut self, pl: Placement) {
        self.quarantined.extend(pl.extents);
    }

    pub fn quarantined_bytes(&self) -> u64 {
        self.quarantined.iter().map(|(_, r)| r.len()).sum()
    }

    /// The device whose directory is `path` filled up (ENOSPC from its file system).
    pub fn mark_full(&mut self, path: &std::path::Path) {
        if let Some(d) = self.devs.iter_mut().find(|d| d.path == path) {
            d.full = true;
        }
    }

    pub fn capacity(&self) -> u64 {
        self.devs.iter().map(|d| d.alloc.capacity()).sum()
    }
    pub fn used(&self) -> u64 {
        self.devs.iter().map(|d| d.alloc.used()).sum()
    }
    pub fn peak(&self) -> u64 {
        self.devs.iter().map(|d| d.alloc.peak_used()).sum()
    }
    pub fn reset_peak(&mut self) {
        self.devs.iter_mut().for_each(|d| d.alloc.reset_peak());
    }
    pub fn device_used(&self) -> Vec<u64> {
        self.devs.iter().map(|d| d.alloc.used()).collect()
    }
    pub fn device_high_water(&self) -> Vec<u64> {
        self.devs.iter().map(|d| d.alloc.high_water()).collect()
    }
}

/// Pieces of at most `block` bytes, in entry order.
pub(crate) fn chunks(pieces: &[Piece], block: u64) -> impl Iterator<Item = Piece> + '_ {
    pieces.iter().flat_map(move |p| {
        (0..p.len.div_ceil(block)).map(move |i| {
            let o = i * block;
            Piece { dev: p.dev, file_off: p.file_off + o, entry_off: p.entry_off + o, len: (p.len - o).min(block) }
        })
    })
}
