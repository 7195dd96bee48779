//! `ssdtier._native`: a thin binding over `ssdtier-core`. Every call that can
//! block (I/O, waiting for evictions) releases the GIL.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use ssdtier_core::{self as core, Backend, DeviceConfig, Error, Eviction, StoreConfig};
use std::path::PathBuf;
use std::sync::Arc;

/// Turn a core error into the matching `ssdtier.errors` exception.
fn to_py(py: Python<'_>, err: Error) -> PyErr {
    let kind = match &err {
        Error::Io { .. } | Error::OutOfSpace { .. } => "os",
        Error::Invalid(_) => "invalid",
        Error::UnknownKey(_) => "key",
        Error::Closed => "closed",
    };
    let errno = err.errno();
    let filename = match &err {
        Error::Io { path, .. } => Some(path.display().to_string()),
        _ => None,
    };
    let message = err.message_without_path();
    let build = || -> PyResult<PyErr> {
        let errors = py.import("ssdtier.errors")?;
        let exc = errors.getattr("from_native")?.call1((kind, message.clone(), errno, filename.clone()))?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|e| e)
}

trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for core::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// Completion of an asynchronous transfer (a prefetch).
#[pyclass(frozen, module = "ssdtier._native")]
struct Ticket {
    inner: Arc<core::Ticket>,
}

#[pymethods]
impl Ticket {
    /// True once the transfer has finished (successfully or not).
    fn done(&self) -> bool {
        self.inner.is_done()
    }

    /// Block until the transfer has finished; raises its error, if any.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let t = self.inner.clone();
        py.detach(move || t.wait()).py_err(py)
    }

    /// Seconds from the start of the transfer to its end; None while it is in flight.
    #[getter]
    fn seconds(&self) -> Option<f64> {
        self.inner.elapsed().map(|d| d.as_secs_f64())
    }
}

/// The tiered byte store. Keys are integers; the Python layer maps them to tensors.
#[pyclass(frozen, module = "ssdtier._native")]
struct Store {
    inner: Arc<core::Store>,
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (
        devices, host_capacity, *, backend = "auto", queue_depth = 64, block_size = 1 << 20,
        direct = true, fixed_buffers = true, threads = 4, eviction = "lifetime", throttle_bytes_per_sec = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        devices: Vec<(PathBuf, u64)>,
        host_capacity: u64,
        backend: &str,
        queue_depth: u32,
        block_size: u64,
        direct: bool,
        fixed_buffers: bool,
        threads: usize,
        eviction: &str,
        throttle_bytes_per_sec: u64,
    ) -> PyResult<Self> {
        let cfg = StoreConfig {
            host_capacity,
            devices: devices.into_iter().map(|(path, capacity)| DeviceConfig { path, capacity }).collect(),
            backend: backend.parse::<Backend>().py_err(py)?,
            queue_depth,
            block_size,
            direct,
            fixed_buffers,
            threads,
            eviction: eviction.parse::<Eviction>().py_err(py)?,
            throttle_bytes_per_sec,
        };
        let store = py.detach(move || core::Store::new(cfg)).py_err(py)?;
        Ok(Store { inner: Arc::new(store) })
    }

    /// Create an entry of `nbytes`: (key, arena offset of its slot or None).
    fn reserve(&self, py: Python<'_>, nbytes: u64) -> PyResult<(u64, Option<u64>)> {
        let s = self.inner.clone();
        py.detach(move || s.reserve(nbytes)).py_err(py)
    }

    /// The reserved slot is filled.
    fn commit(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        self.inner.commit(key).py_err(py)
    }

    /// Write an entry that has no slot from host memory at `address`.
    ///
    /// The caller guarantees `address` holds the entry's length in bytes for the call.
    fn write_direct(&self, py: Python<'_>, key: u64, address: usize) -> PyResult<()> {
        let s = self.inner.clone();
        // Safety: the Python layer passes the data pointer of a live contiguous
        // CPU tensor of the entry's length and keeps it alive across this call.
        py.detach(move || unsafe { s.write_direct(key, address as *const u8) }).py_err(py)
    }

    /// New entry holding a copy of `nbytes` of host memory at `address`: its key.
    ///
    /// Copied into an arena slot, or written to NVMe when it does not fit in the host tier;
    /// the caller keeps `address` valid for the call only.
    fn put_from(&self, py: Python<'_>, address: usize, nbytes: u64) -> PyResult<u64> {
        let s = self.inner.clone();
        // Safety: the Python layer passes the data pointer of a live CPU storage of at least
        // `nbytes` and holds it across this call.
        py.detach(move || unsafe { s.put_from(address as *const u8, nbytes) }).py_err(py)
    }

    /// New entry written to NVMe straight from caller memory: (key, ticket of the write).
    ///
    /// The caller keeps `address` (4096-aligned) valid and unchanged for `nbytes`
    /// rounded up to 4096 until the ticket is done.
    fn write_from(&self, py: Python<'_>, address: usize, nbytes: u64) -> PyResult<(u64, Ticket)> {
        let s = self.inner.clone();
        // Safety: the Python layer passes the page-aligned start of a live CPU storage's
        // pages and holds that storage until the ticket is done.
        let (key, t) = py.detach(move || unsafe { s.write_from(address as *const u8, nbytes) }).py_err(py)?;
        Ok((key, Ticket { inner: t }))
    }

    /// Make the entry resident and pin it: its arena offset, or None (use read_direct).
    fn acquire(&self, py: Python<'_>, key: u64) -> PyResult<Option<u64>> {
        let s = self.inner.clone();
        py.detach(move || s.acquire(key)).py_err(py)
    }

    fn release(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        self.inner.release(key).py_err(py)
    }

    /// Read an entry into host memory at `address` (the entry's length in bytes).
    fn read_direct(&self, py: Python<'_>, key: u64, address: usize) -> PyResult<()> {
        let s = self.inner.clone();
        // Safety: the Python layer passes the data pointer of a live, writable,
        // contiguous CPU tensor of the entry's length.
        py.detach(move || unsafe { s.read_direct(key, address as *mut u8) }).py_err(py)
    }

    /// Read an entry into page-aligned host memory at `address` (room for the
    /// length rounded up to 4096), bypassing the arena; returns a Ticket.
    fn read_into(&self, py: Python<'_>, key: u64, address: usize) -> PyResult<Ticket> {
        let s = self.inner.clone();
        // Safety: the Python layer passes a page-aligned buffer of the rounded
        // length that it keeps alive until the ticket is done.
        let t = py.detach(move || unsafe { s.read_into(key, address as *mut u8) }).py_err(py)?;
        Ok(Ticket { inner: t })
    }

    /// Start reading the entry back into the host tier; returns a Ticket.
    fn prefetch(&self, py: Python<'_>, key: u64) -> PyResult<Ticket> {
        let s = self.inner.clone();
        let t = py.detach(move || s.prefetch(key)).py_err(py)?;
        Ok(Ticket { inner: t })
    }

    fn evict(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        let s = self.inner.clone();
        py.detach(move || s.evict(key)).py_err(py)
    }

    fn free(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        let s = self.inner.clone();
        py.detach(move || s.free(key)).py_err(py)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.inner.clone();
        py.detach(move || s.flush()).py_err(py)
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.inner.clone();
        py.detach(move || s.close()).py_err(py)
    }

    /// (in the host arena, on NVMe) for an entry.
    fn location(&self, py: Python<'_>, key: u64) -> PyResult<(bool, bool)> {
        self.inner.location(key).py_err(py)
    }

    fn nbytes(&self, py: Python<'_>, key: u64) -> PyResult<u64> {
        self.inner.len_of(key).py_err(py)
    }

    /// Fallbacks taken while opening (each once), drained.
    fn take_notices(&self) -> Vec<String> {
        self.inner.take_notices()
    }

    #[getter]
    fn arena_address(&self) -> usize {
        self.inner.arena_ptr() as usize
    }

    #[getter]
    fn arena_nbytes(&self) -> usize {
        self.inner.arena_len()
    }

    /// Bytes of the host arena in use (cheap: no full stats).
    #[getter]
    fn host_used(&self) -> u64 {
        self.inner.host_used()
    }

    /// Seconds spent waiting on transfers so far (cheap: no full stats).
    #[getter]
    fn wait_seconds(&self) -> f64 {
        self.inner.wait_seconds()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    #[getter]
    fn fixed_buffers(&self) -> bool {
        self.inner.fixed_buffers()
    }

    /// Whether each device's file uses O_DIRECT.
    #[getter]
    fn direct(&self) -> Vec<bool> {
        self.inner.direct()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("host_bytes_in", s.host_bytes_in)?;
        d.set_item("host_bytes_out", s.host_bytes_out)?;
        d.set_item("host_puts", s.host_puts)?;
        d.set_item("host_gets", s.host_gets)?;
        d.set_item("nvme_bytes_written", s.nvme_bytes_written)?;
        d.set_item("nvme_bytes_read", s.nvme_bytes_read)?;
        d.set_item("nvme_write_ops", s.nvme_write_ops)?;
        d.set_item("nvme_read_ops", s.nvme_read_ops)?;
        d.set_item("direct_puts", s.direct_puts)?;
        d.set_item("direct_gets", s.direct_gets)?;
        d.set_item("zero_copy_puts", s.zero_copy_puts)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("prefetches", s.prefetches)?;
        d.set_item("prefetch_skipped", s.prefetch_skipped)?;
        d.set_item("host_hits", s.host_hits)?;
        d.set_item("nvme_hits", s.nvme_hits)?;
        d.set_item("wait_seconds", s.wait_seconds)?;
        d.set_item("host_used", s.host_used)?;
        d.set_item("host_capacity", s.host_capacity)?;
        d.set_item("host_peak", s.host_peak)?;
        d.set_item("nvme_used", s.nvme_used)?;
        d.set_item("nvme_capacity", s.nvme_capacity)?;
        d.set_item("nvme_peak", s.nvme_peak)?;
        d.set_item("entries", s.entries)?;
        d.set_item("device_used", s.device_used)?;
        d.set_item("device_bytes_written", s.device_bytes_written)?;
        d.set_item("device_bytes_read", s.device_bytes_read)?;
        d.set_item("device_file_size", s.device_file_size)?;
        Ok(d)
    }
}

#[pymodule]
mod _native {
    #[pymodule_export]
    use super::{Store, Ticket};

    /// The alignment of direct transfers (buffer, offset and length).
    #[pymodule_export]
    const ALIGN: u64 = ssdtier_core::ALIGN;
}
