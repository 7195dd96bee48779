"""A stand-in for ``cuda.bindings.cufile`` that moves host memory: "device" pointers are CPU
addresses. It records its calls and can fail, shorten or slow them, so the cuFile transport's
books run on the CPU; real GPU memory is tests/test_cuda.py's. The cuFile bench's child
process imports it as ``fake_cufile``; there, FAKE_CUFILE_TRACE (a file that gets a JSON line
per call), FAKE_CUFILE_HANG and FAKE_CUFILE_CORRUPT drive it."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import threading
import time

lock = threading.Lock()
state: dict = {}


def reset() -> None:
    """Forget every call; no fault armed."""
    with lock:
        state.clear()
        state.update(
            opens=0,
            closes=0,
            fds={},  # handle -> our own fd on the same file, without O_DIRECT
            calls=[],  # (op, handle, ptr, size, file_offset, thread name)
            fail=None,  # "write" or "read": that call returns -5 (EIO)
            short=0,  # calls move at most this many bytes (0: all)
            delay=0.0,  # seconds each call sleeps
            hold_writes=None,  # a threading.Event that writes wait for
        )


_next = [1]  # handles are never reused, so a stale one from an earlier test is refused

reset()


class FileHandleType:
    OPAQUE_FD = 1


class _Handle:
    fd = -1


class Descr:
    _all: dict = {}

    def __init__(self) -> None:
        self.handle, self.type, self.fs_ops = _Handle(), None, None
        self.ptr = id(self)
        Descr._all[self.ptr] = self


def _trace(*call: object) -> None:
    path = os.environ.get("FAKE_CUFILE_TRACE")
    if path:
        with lock, open(path, "a") as f:
            f.write(json.dumps(call) + "\n")


def get_version() -> int:
    return 1170


def driver_open() -> None:
    state["opens"] += 1
    _trace("driver_open", os.getcwd(), os.environ.get("CUFILE_LOGFILE_PATH"))
    if os.environ.get("FAKE_CUFILE_HANG"):
        time.sleep(120)
    log = os.environ.get("CUFILE_LOGFILE_PATH")
    if os.environ.get("FAKE_CUFILE_TRACE") and log:  # as cuFile's own log says it
        with open(log, "a") as f:
            f.write("NOTICE cufio: GDS not available, using compat mode\n")


def driver_close() -> None:
    state["closes"] += 1
    _trace("driver_close")


def driver_get_properties(ptr: int) -> None:
    """nvidia-fs 0.0 (not loaded): compatibility mode, as on the lent GPU machines."""
    ctypes.memset(ptr, 0, 8)


def handle_register(ptr: int) -> int:
    d = Descr._all.pop(ptr)
    assert d.type == FileHandleType.OPAQUE_FD and d.fs_ops == 0, "descriptor not filled in"
    if fcntl.fcntl(d.handle.fd, fcntl.F_GETFL) & os.O_TMPFILE:  # as libcufile 1.15 on a real GPU
        raise RuntimeError("INVALID_FILE_OPEN_FLAG (5019): unsupported file open flags")
    # As libcufile 1.15 in compatibility mode: it opens the file again by its path, so a file
    # with no name (O_TMPFILE, or unlinked) is refused. Without O_DIRECT: unaligned host buffers.
    path = os.readlink(f"/proc/self/fd/{d.handle.fd}")
    if path.endswith(" (deleted)"):
        raise RuntimeError("GETNEWFD_FAILED (5031): failed to obtain new file descriptor")
    with lock:
        h = _next[0]
        _next[0] += 1
        state["fds"][h] = os.open(path, os.O_RDWR)
    _trace("handle_register", d.handle.fd)
    return h


def handle_deregister(h: int) -> None:
    with lock:
        os.close(state["fds"].pop(h))
    _trace("handle_deregister", h)


def buf_register(ptr: int, n: int, flags: int) -> None:
    _trace("buf_register", n, flags)


def buf_deregister(ptr: int) -> None:
    _trace("buf_deregister")


def _call(op: str, h: int, base: int, size: int, off: int, buf_off: int) -> int:
    ptr = base + buf_off
    state["calls"].append((op, h, ptr, size, off, threading.current_thread().name))
    if state["delay"]:
        time.sleep(state["delay"])
    if op == "write" and state["hold_writes"] is not None:
        assert state["hold_writes"].wait(30), "writes held for good"
    if state["fail"] == op:
        return -5
    n = min(size, state["short"] or size)
    fd = state["fds"][h]
    if op == "write":
        got = os.pwrite(fd, ctypes.string_at(ptr, n), off)
    else:
        data = os.pread(fd, n, off)
        if os.environ.get("FAKE_CUFILE_CORRUPT") and off == 0:
            data = data[:4096] + bytes([data[4096] ^ 0xFF]) + data[4097:]
        ctypes.memmove(ptr, data, len(data))
        got = len(data)
    _trace(op, got, off, buf_off)
    return got


def write(h: int, base: int, size: int, off: int, buf_off: int) -> int:
    return _call("write", h, base, size, off, buf_off)


def read(h: int, base: int, size: int, off: int, buf_off: int) -> int:
    return _call("read", h, base, size, off, buf_off)
