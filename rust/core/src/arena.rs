//! The host tier: one page-aligned anonymous mapping.

use crate::error::{Error, Result};
use std::ptr::NonNull;

/// A page-aligned anonymous memory region. Python views slots of it as tensors
/// and, on CUDA, registers the whole region with `cudaHostRegister`.
pub struct Arena {
    ptr: Option<NonNull<u8>>,
    len: usize,
    born: crate::fork::Born,
}

// Safety: the region is plain memory owned by this struct; callers coordinate
// access to slots through the store's allocator.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Map `len` bytes (rounded up to the page size). Zero maps nothing.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(Arena { ptr: None, len: 0, born: crate::fork::Born::now() });
        }
        let page = 4096usize;
        let len = len.div_ceil(page) * page;
        // Safety: anonymous private mapping with no fixed address; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::ENOMEM);
            return Err(Error::Invalid(format!(
                "cannot map a host arena of {len} bytes: {}",
                std::io::Error::from_raw_os_error(errno)
            )));
        }
        // Not copied into fork() children (DataLoader workers): the kernel would copy every
        // pinned page at the fork, and the parent's writes would fault on shared ones after it.
        // Safety: advice on the mapping just made.
        unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) };
        Ok(Arena { ptr: NonNull::new(p as *mut u8), len, born: crate::fork::Born::now() })
    }

    /// Ask for transparent huge pages (`MADV_HUGEPAGE`): fewer faults and pins per byte
    /// where the kernel has them free, slower where it must compact memory first.
    pub fn advise_huge(&self) -> std::io::Result<()> {
        let Some(p) = self.ptr else { return Ok(()) };
        // Safety: advice on this struct's own mapping.
        if unsafe { libc::madvise(p.as_ptr() as *mut libc::c_void, self.len, libc::MADV_HUGEPAGE) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.map_or(std::ptr::null_mut(), |p| p.as_ptr())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.born.forked() {
            return; // not mapped in a fork child: the range may hold another mapping now
        }
        if let Some(p) = self.ptr {
            // Safety: the mapping was made by `new` with this length and is unmapped once.
            unsafe { libc::munmap(p.as_ptr() as *mut libc::c_void, self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_page_advice_keeps_the_arena_usable() {
        let a = Arena::new(4 << 20).unwrap();
        if let Err(e) = a.advise_huge() {
            assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}"); // a kernel without THP
        }
        // Safety: inside the mapping.
        unsafe {
            *a.as_ptr().add(a.len() - 1) = 9;
            assert_eq!(*a.as_ptr().add(a.len() - 1), 9);
        }
        assert!(Arena::new(0).unwrap().advise_huge().is_ok());
    }

    #[test]
    fn page_aligned_and_writable() {
        let a = Arena::new(10_000).unwrap();
        assert_eq!(a.len(), 12_288);
        assert_eq!(a.as_ptr() as usize % 4096, 0);
        // Safety: inside the mapping.
        unsafe {
            *a.as_ptr().add(a.len() - 1) = 7;
            assert_eq!(*a.as_ptr().add(a.len() - 1), 7);
        }
        assert!(Arena::new(0).unwrap().is_empty());
    }
}
