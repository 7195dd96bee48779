//! What a store is built from, checked once.

use crate::device::ALIGN;
use crate::error::{Error, Result};
use std::path::PathBuf;

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
            _ => Err(Error::Config(format!("unknown backend {s:?}: expected auto, io_uring or posix"))),
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
            _ => Err(Error::Config(format!("unknown eviction policy {s:?}: expected lifetime, lru or fifo"))),
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
    /// Map the arena in transparent huge pages where the kernel allows.
    pub huge_pages: bool,
    pub devices: Vec<DeviceConfig>,
    pub backend: Backend,
    pub queue_depth: u32,
    pub block_size: u64,
    /// Open the NVMe files with O_DIRECT.
    pub o_direct: bool,
    pub fixed_buffers: bool,
    pub threads: usize,
    pub eviction: Eviction,
    /// Grow each NVMe file ahead of its use by this many bytes at a time (0: never
    /// preallocate; at least the device's capacity: all of it at once).
    pub prealloc_step: u64,
    /// Cap on each device's bandwidth in bytes/s, for benchmarks; 0 = none.
    pub throttle_bytes_per_sec: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            host_capacity: 1 << 30,
            huge_pages: false,
            devices: Vec::new(),
            backend: Backend::Auto,
            queue_depth: 64,
            block_size: 1 << 20,
            o_direct: true,
            fixed_buffers: true,
            threads: 4,
            eviction: Eviction::Lifetime,
            prealloc_step: 256 << 20,
            throttle_bytes_per_sec: 0,
        }
    }
}

impl StoreConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.devices.is_empty() {
            return Err(Error::Config("at least one NVMe directory is needed".into()));
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(Error::Config(format!("queue_depth {} is outside 1..=4096", self.queue_depth)));
        }
        if !self.block_size.is_power_of_two() || self.block_size < ALIGN || self.block_size > 64 << 20 {
            return Err(Error::Config(format!(
                "block_size {} must be a power of two between 4096 and 64 MiB",
                self.block_size
            )));
        }
        if self.threads == 0 {
            return Err(Error::Config("threads must be at least 1".into()));
        }
        if self.devices.len() > u16::MAX as usize {
            return Err(Error::Config(format!("{} NVMe directories: at most 65535", self.devices.len())));
        }
        for d in &self.devices {
            if d.capacity < ALIGN {
                return Err(Error::Config(format!(
                    "capacity of {} is {} bytes; at least 4096 is needed",
                    d.path.display(),
                    d.capacity
                )));
            }
        }
        Ok(())
    }
}
