//! `ssdtier._native`: a thin binding over `ssdtier-core`. Every call that can
//! block (I/O, waiting for evictions) releases the GIL; copies from caller
//! memory take it again, so Python cannot resize the source meanwhile.

mod release;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use release::{drain, PyOwner};
use ssdtier_core::{self as core, Backend, DeviceConfig, Error, Eviction, StoreConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Turn a core error into the matching `ssdtier.errors` exception.
fn to_py(py: Python<'_>, err: Error) -> PyErr {
    let kind = match &err {
        Error::Io { .. } | Error::OutOfSpace { .. } | Error::EngineFailed { .. } | Error::External(_) => "os",
        Error::Failed(_) => "failed",
        Error::Config(_) => "config",
        Error::Invalid(_) => "invalid",
        Error::Busy { .. } => "busy",
        Error::UnknownKey(_) => "key",
        Error::Closed => "closed",
        Error::Forked => "forked",
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

/// A copy from caller memory at `address` into the store, batch by batch, each with the GIL
/// held so Python cannot free or resize the source meanwhile.
fn copy_in(address: usize) -> impl FnMut(u64, &mut [u8]) {
    move |off, dst| {
        Python::attach(|_| {
            // Safety: the caller's buffer holds the entry's length (checked non-null) and its owner
            // is held for the call; the GIL keeps Python from freeing or resizing it meanwhile.
            unsafe {
                std::ptr::copy_nonoverlapping((address as *const u8).add(off as usize), dst.as_mut_ptr(), dst.len())
            }
        })
    }
}

/// Extents as Python sees them: `(device, file offset, entry offset, length)`.
fn extent_tuples(x: Vec<core::Extent>) -> Vec<(usize, u64, u64, u64)> {
    x.iter().map(|x| (x.dev, x.file_off, x.entry_off, x.len)).collect()
}

/// A null address with bytes to move is refused (a zero-size storage has none).
fn check_address(address: usize, len: u64) -> PyResult<()> {
    if address == 0 && len > 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("a null buffer for {len} bytes")));
    }
    Ok(())
}

/// Completion of an asynchronous transfer.
#[pyclass(frozen, module = "ssdtier._native")]
struct Ticket {
    inner: Arc<core::Ticket>,
}

#[pymethods]
impl Ticket {
    /// True once the transfer has finished (successfully or not).
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        if self.inner.forked() {
            return Err(to_py(py, Error::Forked));
        }
        let done = self.inner.is_done();
        if done {
            drain(py); // its owner went before it showed done: gone now too
        }
        Ok(done)
    }

    /// Block until the transfer has finished; raises its error, if any. Ctrl-C interrupts the
    /// wait (the transfer goes on, and its memory stays held until it ends).
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        if let Some(r) = self.inner.poll() {
            drain(py);
            return r.py_err(py); // done: no GIL round trip
        }
        loop {
            let t = self.inner.clone();
            if let Some(r) = py.detach(move || t.wait_timeout(Duration::from_millis(50))) {
                drain(py);
                return r.py_err(py);
            }
            py.check_signals()?;
        }
    }

    /// Seconds from the start of the transfer to its end; None while it is in flight.
    #[getter]
    fn seconds(&self) -> Option<f64> {
        self.inner.elapsed().map(|d| d.as_secs_f64())
    }
}

/// The tiered byte store. Keys are integers; the Python layer maps them to tensors.
#[pyclass(frozen, weakref, module = "ssdtier._native")]
struct Store {
    inner: Arc<core::Store>,
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (
        devices, host_capacity, *, backend = "auto", queue_depth = 64, block_size = 1 << 20,
        direct = true, fixed_buffers = true, threads = 4, eviction = "lifetime", prealloc_step = 256 << 20,
        throttle_bytes_per_sec = 0, huge_pages = false
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
        prealloc_step: u64,
        throttle_bytes_per_sec: u64,
        huge_pages: bool,
    ) -> PyResult<Self> {
        let cfg = StoreConfig {
            host_capacity,
            huge_pages,
            devices: devices.into_iter().map(|(path, capacity)| DeviceConfig { path, capacity }).collect(),
            backend: backend.parse::<Backend>().py_err(py)?,
            queue_depth,
            block_size,
            o_direct: direct,
            fixed_buffers,
            threads,
            eviction: eviction.parse::<Eviction>().py_err(py)?,
            prealloc_step,
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

    /// Entries put from now on belong to `group` (a forward); see the lifetime policy.
    fn set_group(&self, py: Python<'_>, group: u64) {
        let s = self.inner.clone();
        py.detach(move || s.set_group(group));
    }

    /// Create an entry of `nbytes` with no arena slot (for `begin_external_write`): its key.
    fn reserve_unslotted(&self, py: Python<'_>, nbytes: u64) -> PyResult<u64> {
        self.inner.reserve_unslotted(nbytes).py_err(py)
    }

    /// The reserved slot is filled.
    fn commit(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        self.inner.commit(key).py_err(py)
    }

    /// Write an entry reserved without a slot from host memory at `address` (its length),
    /// which `owner` keeps alive; copied with the GIL held.
    fn write_staged(&self, py: Python<'_>, key: u64, address: usize, owner: Py<PyAny>) -> PyResult<()> {
        let s = self.inner.clone();
        let len = s.len_of(key).py_err(py)?;
        check_address(address, len)?;
        let _keep = owner;
        py.detach(move || s.write_staged_with(key, &mut copy_in(address))).map_err(|e| to_py(py, e))
    }

    /// New entry holding a copy of `nbytes` of host memory at `address`, which `owner` keeps
    /// alive: its key. Copied into an arena slot with the GIL held, or written to NVMe through
    /// staging when it does not fit in the host tier.
    fn put_from(&self, py: Python<'_>, address: usize, nbytes: u64, owner: Py<PyAny>) -> PyResult<u64> {
        let s = self.inner.clone();
        check_address(address, nbytes)?;
        let _keep = owner;
        py.detach(move || s.put_with(nbytes, &mut copy_in(address))).map_err(|e| to_py(py, e))
    }

    /// New entry written to NVMe straight from caller memory: (key, ticket of the write).
    ///
    /// `address` is page-aligned, holds `nbytes` rounded up to 4096, and stays unchanged while
    /// `owner` lives; the ticket holds `owner` until the write is done.
    fn write_from(&self, py: Python<'_>, address: usize, nbytes: u64, owner: Py<PyAny>) -> PyResult<(u64, Ticket)> {
        drain(py);
        let s = self.inner.clone();
        let owner: core::Owner = PyOwner::new(owner);
        // Safety: the Python layer passes the page-aligned start of a live CPU storage's pages,
        // kept alive by `owner`, which the ticket holds until the write is done.
        let (key, t) =
            py.detach(move || unsafe { s.write_from(address as *const u8, nbytes, Some(owner)) }).py_err(py)?;
        Ok((key, Ticket { inner: t }))
    }

    /// Begin writing an entry reserved without a slot outside the store (cuFile): its extents
    /// `(device, file offset, entry offset, length)`, covering its length rounded up to 4096.
    /// `end_external` must follow, even after an error.
    fn begin_external_write(&self, py: Python<'_>, key: u64) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let s = self.inner.clone();
        // Allocating NVMe space may grow a file (fallocate): without the GIL.
        py.detach(move || s.begin_external_write(key)).py_err(py).map(extent_tuples)
    }

    /// Begin reading an entry that is on NVMe only outside the store; as `begin_external_write`.
    /// Waits for a write of it in flight.
    fn begin_external_read(&self, py: Python<'_>, key: u64) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        let s = self.inner.clone();
        py.detach(move || s.begin_external_read(key)).py_err(py).map(extent_tuples)
    }

    /// The transfer begun outside the store ended; `error` says why it failed (the write's
    /// entry then has no bytes). Raises that error as the store's.
    #[pyo3(signature = (key, error = None))]
    fn end_external(&self, py: Python<'_>, key: u64, error: Option<String>) -> PyResult<()> {
        let s = self.inner.clone();
        let res = match error {
            None => Ok(()),
            Some(why) => Err(Error::External(why)),
        };
        py.detach(move || s.end_external(key, res)).py_err(py)
    }

    /// The file descriptor of each device's file (None: simulated), open until `close`.
    #[getter]
    fn device_fds(&self) -> Vec<Option<i32>> {
        self.inner.device_fds()
    }

    /// Make the entry resident and pin it: its arena offset, or None (use read_direct).
    fn acquire(&self, py: Python<'_>, key: u64) -> PyResult<Option<u64>> {
        let s = self.inner.clone();
        py.detach(move || s.acquire(key)).py_err(py)
    }

    fn release(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        self.inner.release(key).py_err(py)
    }

    /// Read an entry into host memory at `address` (`nbytes` of room, at least its length),
    /// which `owner` keeps alive; copied out with the GIL held.
    fn read_staged(&self, py: Python<'_>, key: u64, address: usize, nbytes: u64, owner: Py<PyAny>) -> PyResult<()> {
        let s = self.inner.clone();
        let len = s.len_of(key).py_err(py)?;
        check_address(address, len)?;
        if nbytes < len {
            return Err(to_py(
                py,
                Error::Invalid(format!("read_staged of entry {key} needs {len} bytes of room, got {nbytes}")),
            ));
        }
        let _keep = owner;
        py.detach(move || {
            s.read_staged_with(key, &mut |off, src| {
                Python::attach(|_| {
                    // Safety: the caller's buffer has room for the entry's length (checked above) and
                    // `owner` keeps it alive; the GIL keeps Python from freeing or resizing it meanwhile.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), (address as *mut u8).add(off as usize), src.len())
                    }
                })
            })
        })
        .map_err(|e| to_py(py, e))
    }

    /// Read an entry into page-aligned host memory at `address` (`nbytes` of room, at least
    /// the length rounded up to 4096), bypassing the arena: None when the bytes were copied
    /// from the host arena at once, else a Ticket of the read, holding `owner` until it lands.
    fn read_into(
        &self,
        py: Python<'_>,
        key: u64,
        address: usize,
        nbytes: u64,
        owner: Py<PyAny>,
    ) -> PyResult<Option<Ticket>> {
        drain(py);
        let s = self.inner.clone();
        let owner: core::Owner = PyOwner::new(owner);
        // Safety: the Python layer passes a page-aligned buffer of `nbytes` that `owner` keeps
        // alive, and the ticket holds `owner` until the read has landed.
        let t = py.detach(move || unsafe { s.read_into(key, address as *mut u8, nbytes, Some(owner)) }).py_err(py)?;
        Ok((!t.immediate()).then_some(Ticket { inner: t }))
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

    /// Wait for a ticket of this store (interruptible, as Ticket.wait).
    fn wait(&self, py: Python<'_>, ticket: &Ticket) -> PyResult<()> {
        ticket.wait(py)
    }

    /// Forget an entry without waiting: its space comes back when its transfer in flight ends.
    fn discard(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        drain(py);
        self.inner.discard(key).py_err(py)
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
        let r = py.detach(move || s.close()).py_err(py);
        drain(py); // the owners of the transfers it waited for
        r
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

    /// Traffic counters from zero and peaks from what is in use now.
    fn reset_counters(&self) {
        self.inner.reset_counters();
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
        self.inner.o_direct()
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
        d.set_item("staged_puts", s.staged_puts)?;
        d.set_item("staged_gets", s.staged_gets)?;
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
        d.set_item("device_high_water", s.device_high_water)?;
        d.set_item("quarantined_bytes", s.quarantined_bytes)?;
        d.set_item("failure", s.failure)?;
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
