"""The direct transport: a CPU storage goes to NVMe from its own pages (zero copy) and comes
back straight into the page-aligned buffer that becomes the restored storage; the arena
takes only what cannot (with ``io.zero_copy`` off, or a storage not 64-byte aligned). With
cuFile, a CUDA storage goes the same way between GPU memory and NVMe (cufile.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SsdtierError
from . import cuda, cufile
from ._util import PAGE, aligned_storage, host_event
from .entry import Entry, Held, Made, Reading, Writing

if TYPE_CHECKING:
    from .cufile import CuFile
    from .forward import Fwd
    from .owner import CpuOwner


class CpuTransport:
    def __init__(self, off: CpuOwner, gds: CuFile | None = None) -> None:
        self.off = off
        self.native = off.store.native
        self.zero_copy = off.config.io.zero_copy
        self.writing: deque[Entry] = deque()  # writes from the tensors' own memory in flight, in order
        self.gds = gds
        self.gds_types: tuple[str, ...] = cufile.DEVICE_TYPES if gds is not None else ()
        self.side: dict[torch.device, Any] = {}  # per GPU: the stream cuFile's reads allocate on
        self.gds_inflight = 0  # bytes of sources held by cuFile writes not yet done
        self.gds_peak = 0  # the most at once

    def offload(self, st: torch.UntypedStorage, nbytes: int, f: Fwd) -> Entry:
        ptr = st.data_ptr()
        if st.device.type in self.gds_types:
            return self._offload_gds(st, ptr, nbytes, f)
        lead = ptr % PAGE
        # The restored view starts `lead` bytes into its page as the original did; a
        # multiple of 64 keeps every dtype's views aligned (torch allocates at 64).
        if self.zero_copy and lead % 64 == 0:
            self.hold_back(nbytes)
            # Held until written; the ticket holds it too, so its pages outlive the write.
            key, ticket = self.native.write_from(ptr - lead, lead + nbytes, st)
            e = self._writing(Entry(key, nbytes, st.device, False, f), st, ticket, ptr)
            e.lead = lead
            return e
        key = self.native.put_from(ptr, nbytes, st)  # a copy into the arena (or to NVMe)
        return Entry(key, nbytes, st.device, False, f)

    def _offload_gds(self, st: torch.UntypedStorage, ptr: int, nbytes: int, f: Fwd) -> Entry:
        """cuFile writes the storage from GPU memory once the work queued so far is done; the
        storage is held until then."""
        assert self.gds is not None
        self.hold_back(nbytes)
        bound = _queue_bound(st.device)
        while self.gds_inflight and self.gds_inflight + nbytes > bound:
            self._wait_gds()  # back-pressure, as copies to the arena have: a larger one goes alone
        key = self.native.reserve_unslotted(nbytes)
        try:
            ticket = self.gds.write(key, ptr, nbytes, _ready(st.device))
        except BaseException:
            self.native.free(key)
            raise
        self.gds_inflight += nbytes
        self.gds_peak = max(self.gds_peak, self.gds_inflight)
        return self._writing(Entry(key, nbytes, st.device, False, f), st, ticket, ptr)

    def _wait_gds(self) -> None:
        """The host waits for the oldest cuFile write, then ends it."""
        e = next(e for e in self.writing if isinstance(e.out.ticket, cufile.Transfer))
        t0 = time.perf_counter()
        concurrent.futures.wait([e.out.ticket.fut])
        self.off.res.waited(time.perf_counter() - t0, False)
        with self.off._lock:
            if e in self.writing:  # not ended by another thread's poll meanwhile
                self.writing.remove(e)
                self._end_write(e)
        self.poll()

    def wait_writes(self, nbytes: int) -> float:
        """Back-pressure within a device budget: before ``nbytes`` more are held, writes that
        lag the rate planned for are waited for, while that can make room, rather than their
        sources piling up past it. Returns the seconds waited."""
        waited = 0.0
        while self.writing:
            short = self.off.short(nbytes)
            if not short:
                break
            with self.off._lock:  # another thread's poll may end writes meanwhile
                pending = list(self.writing)
            if not pending or sum(e.nbytes for e in pending) < short:
                break  # held past the budget whatever the writes do (a plan that does not fit)
            w = pending[0].out
            if type(w) is not Writing:
                break
            t0 = time.perf_counter()
            with contextlib.suppress(SsdtierError):  # its end reports the failure
                w.ticket.wait()
            waited += time.perf_counter() - t0
            self.poll()
        return waited

    def hold_back(self, nbytes: int, backward: bool = False) -> None:
        """wait_writes, counted as the forward held back (or the backward stalled)."""
        if self.writing:
            waited = self.wait_writes(nbytes)
            if waited:
                self.off.res.waited(waited, backward)

    def _writing(self, e: Entry, st: torch.UntypedStorage, ticket: Any, ptr: int) -> Entry:
        """A new entry written from its source's memory: the source is held until a poll sees
        the write done."""
        e.out = Writing(st, ticket, ptr)
        self.off.res.sources += e.nbytes
        self.writing.append(e)
        return e

    def skip_write(self, e: Entry) -> None:
        """The backward wants a source whose cuFile write has not started: the source serves
        it, so the write is dropped and the disk left to the reads."""
        w = e.out
        assert type(w) is Writing
        if not isinstance(w.ticket, cufile.Transfer) or not w.ticket.cancel():
            return
        self.writing.remove(e)
        self.gds_inflight -= e.nbytes
        e.out = Held(w.src)
        key, e.key = e.key, None
        with contextlib.suppress(SsdtierError):  # it raises the reason given, as the store's error
            self.native.end_external(key, "not needed: the backward came first")
        self.off._free_key(key)
        self.off.c["writes_skipped"] += 1

    def poll(self) -> None:
        """Drop the sources of writes that are done."""
        if self.writing:
            with self.off._lock:  # another thread's pack or unpack may poll too
                while self.writing and self.writing[0].out.ticket.done():
                    self._end_write(self.writing.popleft())

    def _end_write(self, e: Entry) -> None:
        off = self.off
        w = e.out
        assert type(w) is Writing
        if isinstance(w.ticket, cufile.Transfer):
            self.gds_inflight -= e.nbytes
        e.out = Held(w.src)
        failed: SsdtierError | None = None
        try:
            w.ticket.wait()
        except SsdtierError as err:
            failed = err
        if failed is None and e.refs:
            failed = off._moved(e, w.src, w.wrote)
        if e.refs == 0:  # released while writing (its key was discarded then)
            off.drop_source(e)
        elif failed is not None:
            off._copy_lost(e, failed)  # the source stays in memory and serves the unpack
        elif not e.wanted:
            off.drop_source(e)
        # Else the backward is about to use it: it stays and serves the unpack, with no read.

    def start_read(self, e: Entry) -> None:
        """The bytes go from NVMe straight into the page-aligned buffer that becomes the
        restored storage; the arena is not used, so read-ahead never evicts what is about to
        be needed. The entry starts `lead` bytes before the data (a write covers whole pages)."""
        self.hold_back(e.nbytes, backward=True)  # earlier blocks' writes lag into the backward: room first
        if e.device.type in self.gds_types:
            self._read_gds(e)
            return
        st, pad = aligned_storage(e.lead + e.nbytes)
        self.off.res.track(st, e.nbytes)
        ticket = self.native.read_into(e.key, st.data_ptr() + pad, st.nbytes() - pad, st)
        e.back = Reading(st, pad + e.lead, ticket, ticket is None)  # None: copied from the arena

    def _read_gds(self, e: Entry) -> None:
        """cuFile reads into new memory. On a GPU it comes from a stream that runs no work, so
        nothing queued can still use it; the unpack records its use on its own stream
        (``made``, as the arena's copies do)."""
        assert self.gds is not None and e.key is not None
        made = event = None
        if e.device.type == "cuda":
            side = self.side.get(e.device)
            if side is None:
                side = self.side[e.device] = torch.cuda.Stream(e.device)
            buf = self.off.cuda._new_on(e, side)
            event = host_event()
            event.record(side)
            made = Made(event, side, [side])
        else:
            buf = torch.empty(e.nbytes, dtype=torch.uint8)
        st = buf.untyped_storage()
        self.off.res.track(st, e.nbytes)
        # After ``event``: with deterministic algorithms torch.empty queues a fill of the memory.
        e.back = Reading(st, 0, self.gds.read(e.key, st.data_ptr(), e.nbytes, event), False, made)

    def close(self) -> None:
        for e in self.writing:
            self.off.drop_source(e)
        self.writing.clear()
        self.gds_inflight = 0


def _ready(device: torch.device) -> Any:
    """An event after the work queued on the current stream, for a transfer outside stream order."""
    if device.type != "cuda":
        return None
    ev = host_event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def _queue_bound(device: torch.device) -> int:
    """The most bytes of sources cuFile writes may hold: what copies to the arena may."""
    return cuda.queue_bound(device) if device.type == "cuda" else cuda.QUEUE_MIN
