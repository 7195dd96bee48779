"""GPU memory to NVMe and back through cuFile (GPUDirect Storage), with no host bounce. The
store allocates each entry's extents and keeps its state (``begin_external_*`` and
``end_external``); worker threads move the bytes with cuFile's synchronous calls.
docs/offloader.md ("cuFile") has the design."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import fcntl
import functools
import importlib
import logging
import os
import secrets
import stat
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..errors import SsdtierError
from ..gds import Gds, GdsState, probe
from ..paths import CUFILE_LINK_PREFIX, remove_stale_links
from ._util import on_device, warn

log = logging.getLogger("ssdtier")

MODULE = "cuda.bindings.cufile"  # the tests give a stand-in that moves host memory
DEVICE_TYPES = ("cuda",)  # whose storages it moves (the tests add "cpu")

OPEN_TIMEOUT_S = 30.0  # driver_open has been seen to spin forever (no libcuda.so.1)

# cuFile's driver is opened once per process and closed when its last user closes.
_driver_lock = threading.Lock()
_driver_users = 0
_driver_stuck = False  # a driver_open never returned: not tried again in this process


class Transfer:
    """One entry's transfer on a worker, as the store's tickets: ``done()``, ``wait()``
    (raises the transfer's error as the store's OS error), ``seconds`` from submit to end."""

    __slots__ = ("fut", "t0", "t1")

    def __init__(self, fut: Future) -> None:
        self.fut, self.t0, self.t1 = fut, time.perf_counter(), None
        fut.add_done_callback(self._ended)

    def _ended(self, fut: Future) -> None:
        self.t1 = time.perf_counter()

    def done(self) -> bool:
        return self.fut.done()

    def cancel(self) -> bool:
        """True if it never started and now never will (``end_external`` is then the caller's)."""
        return self.fut.cancel()

    def wait(self) -> None:
        err = self.fut.exception()
        if err is not None:
            # A fresh one each time: the stored error, raised here, would keep every frame up to
            # the backward's (and so the graph, which holds this transfer) alive for good.
            raise copy.copy(err)

    @property
    def seconds(self) -> float | None:
        return None if self.t1 is None else self.t1 - self.t0


class CuFile:
    """cuFile's driver, a handle on each of the store's files, and the workers."""

    def __init__(self, native: Any, threads: int, device: torch.device | None, module: Any) -> None:
        global _driver_users
        self.native, self.mod = native, module
        fds = native.device_fds
        if not fds or any(fd is None for fd in fds):
            raise SsdtierError("cuFile needs the store's NVMe files (none is configured, or one is simulated)")
        with _driver_lock:
            if _driver_users == 0:
                _open_driver(module)
            _driver_users += 1
        self.handles: list[int] = []
        self.fds: list[int] = []
        self.links: list[str] = []  # names given to the store's nameless files, removed at close
        try:
            for fd in fds:
                self.fds.append(self._named_fd(fd))
                descr = module.Descr()
                descr.type = module.FileHandleType.OPAQUE_FD
                descr.handle.fd = self.fds[-1]
                descr.fs_ops = 0
                self.handles.append(module.handle_register(descr.ptr))
        except BaseException:
            self._close_handles()
            self._close_driver()
            raise
        index = device.index if device is not None and device.type == "cuda" else None
        # cuFile needs the device's context current on the thread that calls it.
        init = (lambda: torch.cuda.set_device(index)) if index is not None else None
        # Reads have workers of their own: the backward's never queue behind the forward's writes.
        self.writers = ThreadPoolExecutor(threads, "ssdtier-cufile-w", initializer=init)
        self.readers = ThreadPoolExecutor(threads, "ssdtier-cufile-r", initializer=init)

    # ---------------------------------------------------------------- transfers

    def write(self, key: int, ptr: int, nbytes: int, ready: Any) -> Transfer:
        """Write ``nbytes`` at ``ptr`` as entry ``key`` (reserved without a slot) once the
        ``ready`` event is done. Raises the store's errors (out of space) at once."""
        extents = self.native.begin_external_write(key)
        return self._submit(self.writers, key, extents, ptr, nbytes, ready, self.mod.write)

    def read(self, key: int, ptr: int, nbytes: int, ready: Any) -> Transfer:
        """Read the ``nbytes`` of entry ``key`` (on NVMe only) to ``ptr`` once the ``ready``
        event is done."""
        extents = self.native.begin_external_read(key)
        return self._submit(self.readers, key, extents, ptr, nbytes, ready, self.mod.read)

    def _submit(
        self, pool: ThreadPoolExecutor, key: int, extents: list, ptr: int, nbytes: int, ready: Any, fn: Any
    ) -> Transfer:
        try:
            return Transfer(pool.submit(self._run, key, extents, ptr, nbytes, ready, fn))
        except BaseException as e:  # the pool is shut down: the store must hear of it all the same
            self.native.end_external(key, f"not started: {e}")  # raises it as the store's error
            raise

    def _run(self, key: int, extents: list, ptr: int, nbytes: int, ready: Any, fn: Any) -> None:
        """On a worker: the extents, then ``end_external`` whatever happened (it raises the
        transfer's error as the store's)."""
        why = None
        try:
            # The buffer's device current: a model may span GPUs, the workers start on its first.
            with on_device(ready.device if ready is not None else None):
                if ready is not None:
                    ready.synchronize()  # cuFile works outside stream order
                for dev, file_off, entry_off, length in extents:
                    # Both stop at the entry's end: past the source may be unmapped, and past a
                    # file's end (not preallocated) a read would come back short.
                    n = min(length, nbytes - entry_off)
                    if n > 0:
                        self._move(fn, self.handles[dev], ptr + entry_off, n, file_off)
        except BaseException as e:
            why = f"cuFile {fn.__name__}: {type(e).__name__}: {e}"
        self.native.end_external(key, why)

    @staticmethod
    def _move(fn: Any, handle: int, ptr: int, n: int, file_off: int) -> None:
        done = 0
        while done < n:
            # Older bindings return None (all moved, or raised); newer ones the byte count.
            r = fn(handle, ptr, n - done, file_off + done, done)
            if r is None:
                return
            if r <= 0:
                raise OSError(f"{n - done} bytes at file offset {file_off + done}: returned {r}")
            done += r

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Wait for the transfers queued, then let cuFile go."""
        self.writers.shutdown(wait=True)
        self.readers.shutdown(wait=True)
        self._close_handles()
        self._close_driver()

    def _close_handles(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):
                self.mod.handle_deregister(h)
        self.handles.clear()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        for name in self.links:
            with contextlib.suppress(OSError):
                os.unlink(name)
        self.links.clear()

    def _named_fd(self, fd: int) -> int:
        """A descriptor of the store's file opened by a name. cuFile opens a registered file
        again by its path: the store's files have none (O_TMPFILE), so one is linked while
        registered. cuFile also refuses the O_TMPFILE flags the store's own fd reports."""
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        proc = f"/proc/self/fd/{fd}"
        path = os.readlink(proc)
        if path.endswith(" (deleted)"):
            folder = os.path.dirname(path)
            remove_stale_links(folder)
            path = os.path.join(folder, f"{CUFILE_LINK_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
            _link_open_file(proc, path)
            self.links.append(path)
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | direct)

    def _close_driver(self) -> None:
        global _driver_users
        with _driver_lock:
            _driver_users -= 1
            if _driver_users == 0:
                with contextlib.suppress(Exception):
                    self.mod.driver_close()


def _link_open_file(proc: str, path: str) -> None:
    """linkat(AT_SYMLINK_FOLLOW) of /proc's link to an open file: os.link calls link(2) on
    some Pythons, which links the /proc entry itself (EXDEV)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, at_symlink_follow = -100, 0x400
    if libc.linkat(at_fdcwd, os.fsencode(proc), at_fdcwd, os.fsencode(path), at_symlink_follow) != 0:
        err = ctypes.get_errno()
        if err == errno.ENOENT:
            raise SsdtierError(
                "cuFile opens its files by name, and this store's file can be named once: "
                "it was given to cuFile before, by an earlier CuFile on the same store"
            )
        raise OSError(err, f"cannot give the store's file a name for cuFile: {os.strerror(err)}", path)


def _open_driver(module: Any) -> None:
    """``driver_open`` on a thread of its own, given OPEN_TIMEOUT_S: a hang is an error,
    not a training job that never starts (the thread is left behind)."""
    global _driver_stuck
    if _driver_stuck:
        raise SsdtierError("cuFile's driver_open did not return earlier in this process")
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            module.driver_open()
        except BaseException as e:
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="ssdtier-cufile-open", daemon=True).start()
    if not done.wait(OPEN_TIMEOUT_S):
        _driver_stuck = True
        raise SsdtierError(f"cuFile's driver_open did not return in {OPEN_TIMEOUT_S:g} s")
    if failed:
        raise failed[0]


def _model_device(model: torch.nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def carries(config: Any, device: torch.device | None) -> bool:
    """Whether cuFile would carry a model's CUDA activations under ``config`` (the probe's
    answer, as :func:`open_cufile` asks it): then the host arena carries none of them."""
    backend = config.io.backend
    if backend not in ("cufile", "auto") or device is None or device.type != "cuda" or not config.nvme:
        return False
    state = probe_once().state
    return state is GdsState.USABLE or (backend == "cufile" and state is GdsState.COMPAT)


def open_cufile(model: torch.nn.Module, config: Any, native: Any) -> CuFile | None:
    """cuFile for this offloader's CUDA activations, or None (the pinned arena's path).
    ``io.backend = "cufile"`` asks for it (in compatibility mode too; a fallback is said
    once); ``"auto"`` takes it only where GPUDirect Storage is usable."""
    backend = config.io.backend
    if backend not in ("cufile", "auto"):
        return None
    device = _model_device(model)
    if backend == "auto" and (device is None or device.type != "cuda" or not config.nvme):
        return None  # nothing for cuFile to do: not worth a probe
    if not config.nvme:
        warn(
            'io.backend = "cufile" needs an [[nvme]] table naming a directory on a local NVMe, not '
            "$SSDTIER_DIR's default; activations go through the host arena"
        )
        return None
    gds = probe_once()
    if gds.state is GdsState.UNAVAILABLE or (backend == "auto" and gds.state is not GdsState.USABLE):
        if backend == "cufile":
            warn(f"cuFile is {gds}; activations go through the host arena instead")
        return None
    if gds.state is GdsState.COMPAT:
        warn(f"cuFile runs in {gds}; it moves the bytes through host memory")
    try:
        # cuFile writes cufile.log into the working directory unless told otherwise.
        os.environ.setdefault("CUFILE_LOGFILE_PATH", os.path.join(_log_dir(), "cufile.log"))
        module = importlib.import_module(MODULE)
        return CuFile(native, config.io.threads, device, module)
    except Exception as e:
        msg = (
            f"cuFile could not be set up ({type(e).__name__}: {e}; its log: {os.environ['CUFILE_LOGFILE_PATH']}); "
            "activations go through the host arena"
        )
        if backend == "auto":
            log.info("ssdtier: %s", msg)
        else:
            warn(msg)
        return None


@functools.cache
def probe_once() -> Gds:
    """:func:`ssdtier.gds.probe`, once per process (it starts a child)."""
    return probe()


def _log_dir() -> str:
    """A directory of this user's own under the temporary directory."""
    d = os.path.join(tempfile.gettempdir(), f"ssdtier-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        d = tempfile.mkdtemp(prefix="ssdtier-")  # someone else's: a fresh one
    return d
