#![allow(dead_code)]
use std::path::Path;

/// A directory on a real file system (the workspace's target directory), never
/// tmpfs: O_DIRECT must really be exercised.
pub fn real_dir() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-stores");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// Deterministic bytes: a xorshift stream seeded per buffer.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A page-aligned buffer for direct I/O tests.
pub struct Aligned {
    ptr: *mut u8,
    len: usize,
}

impl Aligned {
    pub fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096).unwrap();
        // Safety: non-zero size layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        Aligned { ptr, len: len.max(4096) }
    }
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn slice(&self) -> &[u8] {
        // Safety: allocated with len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn slice_mut(&mut self) -> &mut [u8] {
        // Safety: allocated with len bytes, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).unwrap();
        // Safety: allocated in new with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}
