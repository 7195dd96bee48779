//! Counters of traffic per tier and direction, and space in use.

/// "staged" transfers go through the staging buffer (entries bigger than the
/// arena); "zero copy" ones go between NVMe and caller memory directly.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub host_bytes_in: u64,
    pub host_bytes_out: u64,
    pub host_puts: u64,
    pub host_gets: u64,
    pub nvme_bytes_written: u64,
    pub nvme_bytes_read: u64,
    pub nvme_write_ops: u64,
    pub nvme_read_ops: u64,
    pub staged_puts: u64,
    pub staged_gets: u64,
    pub zero_copy_puts: u64,
    pub evictions: u64,
    pub prefetches: u64,
    pub prefetch_skipped: u64,
    pub host_hits: u64,
    pub nvme_hits: u64,
    pub wait_seconds: f64,
    pub host_used: u64,
    pub host_capacity: u64,
    pub host_peak: u64,
    pub nvme_used: u64,
    pub nvme_capacity: u64,
    pub nvme_peak: u64,
    /// Bytes never to be reused: the kernel may still move data there (an engine failed
    /// with transfers in flight). Counted in `host_used` and `nvme_used` too.
    pub quarantined_bytes: u64,
    pub entries: u64,
    pub device_used: Vec<u64>,
    pub device_bytes_written: Vec<u64>,
    pub device_bytes_read: Vec<u64>,
    pub device_file_size: Vec<u64>,
    /// The highest offset each device's space has reached.
    pub device_high_water: Vec<u64>,
    /// Why the store refuses new work, once it does.
    pub failure: Option<String>,
}

impl Stats {
    /// `ops` requests of `bytes` in all, to or from device `dev`.
    pub(crate) fn count_io(&mut self, dir: crate::engine::Dir, dev: usize, bytes: u64, ops: u64) {
        match dir {
            crate::engine::Dir::Write => {
                self.nvme_bytes_written += bytes;
                self.nvme_write_ops += ops;
                self.device_bytes_written[dev] += bytes;
            }
            crate::engine::Dir::Read => {
                self.nvme_bytes_read += bytes;
                self.nvme_read_ops += ops;
                self.device_bytes_read[dev] += bytes;
            }
        }
    }
}
