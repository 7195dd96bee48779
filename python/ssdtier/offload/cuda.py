"""The CUDA transport: device-to-host copies into pinned arena slots on an offload stream,
host-to-device copies back on a prefetch stream (read-ahead) or the compute stream (on
demand), with events for what each stream must wait for."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ._util import warn
from .entry import Entry

if TYPE_CHECKING:
    from .forward import Fwd
    from .offloader import Offloader


def _cuda_ok(rc: Any) -> bool:
    return int(rc[0] if isinstance(rc, tuple) else rc) == 0


def _clear_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error to the thread's next cudaGetLastError, which
    torch calls after its next kernel launch: that kernel would then fail with our error. Clear
    it in the libcudart that torch loaded (torch does not expose cudaGetLastError)."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
        if libs:
            return
        err: object = "no libcudart.so is loaded (a static build?)"
    except OSError as e:
        err = e
    warn(f"could not clear the CUDA error ({err}); torch may report it at its next kernel")


class CudaTransport:
    def __init__(self, off: Offloader) -> None:
        self.off = off
        self.store = off.store
        self.native = off.store.native
        self.streams: dict[torch.device, tuple[Any, Any]] = {}  # (offload stream, prefetch stream)
        self.registered = False
        self.pending: deque[Entry] = deque()  # copies to the arena in flight, in order
        self.h2d: deque[tuple[Any, int]] = deque()  # (event, key): slots pinned until their copy to the GPU is done
        self.free_later: set[int] = set()  # keys of released entries freed once their h2d copies are done
        self.staging: list[Entry] = []  # read-aheads not copied to the GPU yet
        self.stage_off = False  # no copies ahead until the next forward (out of GPU memory)

    def _streams(self, device: torch.device) -> tuple[Any, Any]:
        s = self.streams.get(device)
        if s is None:
            if not self.registered and self.store.arena is not None:
                self._register_arena()
            s = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self.streams[device] = s
        return s

    def _register_arena(self) -> None:
        arena = self.store.arena
        assert arena is not None
        rc = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
        self.registered = _cuda_ok(rc)
        if not self.registered:
            _clear_cuda_error()
            warn(f"cudaHostRegister of the host arena failed ({rc}); copies will be synchronous")

    # ---------------------------------------------------------------- forward

    def offload(self, whole: torch.Tensor, nbytes: int, f: Fwd) -> Entry:
        native = self.native
        stream = self._streams(whole.device)[0]
        self.poll()  # committed slots can be evicted to make room
        key, off = native.reserve(nbytes)
        entry = Entry(key, nbytes, whole.device, True, f)
        try:
            if off is None:
                # Bigger than the arena: a synchronous copy, streamed to NVMe. The host copy is
                # held by name: its bytes must outlive the write.
                if nbytes:
                    host = whole.cpu()
                    native.write_staged(key, host.data_ptr(), host)
                return entry
            entry.wrote = whole.data_ptr()
            slot = self.store.slot(off, nbytes)
            stream.wait_stream(torch.cuda.current_stream(whole.device))
            with torch.cuda.stream(stream):
                slot.copy_(whole, non_blocking=True)
                entry.event = torch.cuda.Event()
                entry.event.record(stream)
        except BaseException:
            if off is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()  # a copy into the slot may be queued: it ends first
            native.free(key)
            raise
        # Hold the source until the copy is done: its memory is not reused before.
        entry.gpu = whole
        self.off.res.gpu += nbytes
        self.pending.append(entry)
        self.poll()
        return entry

    def poll(self) -> None:
        """Commit the arena slots whose device-to-host copy is complete (dropping their GPU
        sources), and unpin the slots whose host-to-device copy is complete."""
        off, native = self.off, self.native
        while self.h2d and self.h2d[0][0].query():
            key = self.h2d.popleft()[1]
            native.release(key)
            if key in self.free_later and all(k != key for _, k in self.h2d):
                self.free_later.discard(key)
                off._free_key(key)
        while self.pending and self.pending[0].event.query():
            e = self.pending.popleft()
            e.event = None
            failed = off._moved(e, e.gpu.untyped_storage()) if e.refs else None
            if not e.refs:
                continue  # released meanwhile (a collection in _moved): its key is freed already
            if failed is not None:
                off._copy_lost(e, failed)  # e.gpu stays (resident) and serves the unpack
                continue
            native.commit(e.key)
            off.res.gpu -= e.nbytes
            e.gpu = None

    # ---------------------------------------------------------------- backward

    def start_read(self, e: Entry, from_host: bool) -> None:
        e.reading = (None, 0, None if from_host else self.native.prefetch(e.key), from_host)

    def stage_later(self, e: Entry) -> None:
        if not self.stage_off:
            self.staging.append(e)

    def stage_ready(self) -> None:
        """Copy to the GPU, on the prefetch stream, the read-ahead entries now in the arena."""
        if not self.staging:
            return
        waiting = []
        for e in self.staging:
            if self.stage_off:
                break  # out of GPU memory (_stage): the rest are copied at their unpack
            reading = e.reading
            if reading is None or e.key is None or e.staged is not None:
                continue  # unpacked, released, or failed meanwhile
            if reading[2] is not None and not reading[2].done():
                waiting.append(e)
                continue
            self._stage(e)
        self.staging = waiting

    def _stage(self, e: Entry) -> None:
        native = self.native
        assert e.key is not None
        if not native.location(e.key)[0]:
            return  # not in the arena (no room for the read, or it failed): the unpack reads it
        compute = torch.cuda.current_stream(e.device)
        prefetch = self._streams(e.device)[1]
        off = native.acquire(e.key)
        if off is None:
            return
        try:
            out, ev = self._copy_from_slot(e, off, prefetch)
        except torch.cuda.OutOfMemoryError:
            # Reading ahead is a bet: the unpack copies it on demand (the slot was released). Each
            # failed allocation empties the allocator's cache, so no more copies ahead until the
            # next forward.
            self.stage_off = True
            return
        e.staged = (out, ev, compute)
        self.off._track(out.untyped_storage(), e.nbytes)
        self.off.c["copied_ahead"] += 1

    def _copy_from_slot(self, e: Entry, off: int, stream: Any) -> tuple[torch.Tensor, Any]:
        """Copy an entry's acquired arena slot to new GPU bytes (allocated for the current
        stream) on ``stream``; returns them and the copy's event. The slot stays pinned until
        the copy has read it (poll unpins it); on failure it is released at once."""
        try:
            out = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
            current = torch.cuda.current_stream(e.device)
            if stream != current:
                # The block is allocated for the current stream, which uses it: the copy waits for
                # the work queued there, which may still use the block's previous tenant, and which
                # includes the fill of new memory that deterministic mode adds to torch.empty.
                stream.wait_stream(current)
            with torch.cuda.stream(stream):
                out.copy_(self.store.slot(off, e.nbytes), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
        except BaseException:
            self.native.release(e.key)
            raise
        self.h2d.append((ev, e.key))
        return out, ev

    def restore(self, e: Entry) -> torch.UntypedStorage:
        """The entry back on the GPU: the copy made ahead, or one made now on the compute stream."""
        staged, e.staged = e.staged, None
        if staged is not None:
            # Copied ahead on the prefetch stream: the compute stream waits for that copy.
            e.made = (staged[1], staged[2], [])
            st = staged[0].untyped_storage()  # tracked since it was staged
            self.use_on_current_stream(e, st)
            return st
        self.poll()
        out, ev = self._copy_now(e)
        st = out.untyped_storage()
        self.off._track(st, e.nbytes)
        current = torch.cuda.current_stream(e.device)
        if ev is None:
            ev = torch.cuda.Event()
            ev.record(current)
        e.made = (ev, current, [current])
        return st

    def _copy_now(self, e: Entry) -> tuple[torch.Tensor, Any]:
        """Copy an entry back to the GPU on the current stream; returns it and the copy's
        event (None: a synchronous copy from pageable memory)."""
        native, res = self.native, self.off.res
        # Not in the arena (no read-ahead brought it, or it was skipped for want of room):
        # acquire() or read_staged() reads it now, and the backward waits; count it as stall.
        resident = native.location(e.key)[0]
        t0 = time.perf_counter()
        off = native.acquire(e.key)
        if off is None:
            host = torch.empty(e.nbytes, dtype=torch.uint8)
            native.read_staged(e.key, host.data_ptr(), e.nbytes, host)
            res.stall += time.perf_counter() - t0
            return host.to(e.device), None
        if not resident:
            res.stall += time.perf_counter() - t0
        return self._copy_from_slot(e, off, torch.cuda.current_stream(e.device))

    def use_on_current_stream(self, e: Entry, st: torch.UntypedStorage) -> None:
        """Before the current stream uses a restored storage, it waits for the copy that made
        it, and a block allocated for another stream is recorded as used here too, so the
        allocator does not reuse it before this stream is done with it."""
        assert e.made is not None
        ev, allocated, waited = e.made
        current = torch.cuda.current_stream(e.device)
        if current in waited:
            return
        current.wait_event(ev)
        waited.append(current)
        if current != allocated:
            torch.empty(0, dtype=torch.uint8, device=e.device).set_(st).record_stream(current)

    # ---------------------------------------------------------------- release, close

    def release(self, e: Entry) -> None:
        """What an entry holds on the GPU side goes when its last handle does."""
        res = self.off.res
        if e.event is not None:
            # A copy into its arena slot is in flight: the slot must not be reused under it.
            e.event.synchronize()
            self.pending.remove(e)
            e.event = None
            res.gpu -= e.nbytes
        elif e.gpu is not None:  # its copy was lost (poll): the source served it
            res.gpu -= e.nbytes
        if e.staged is not None:
            # Copied ahead and never unpacked: its block goes back to the compute stream's
            # pool, so that stream must not reuse it before the copy into it is done.
            e.staged[2].wait_event(e.staged[1])
            e.staged = None
        e.gpu = None
        e.made = None

    def free_key(self, key: int | None) -> None:
        """Free a released entry's key, or once the copies out of its slot are done."""
        if key is not None and any(k == key for _, k in self.h2d):
            self.free_later.add(key)  # the slot stays pinned until then (poll frees it)
        else:
            self.off._free_key(key)
        if self.h2d:
            self.poll()  # so deferred keys go soon after the backward, not next forward

    def close(self) -> None:
        for ev, _ in self.h2d:  # copies out of the arena still running (their keys freed later)
            ev.synchronize()
        self.h2d.clear()
        self.free_later.clear()
        if self.registered and self.store.arena is not None:
            rc = torch.cuda.cudart().cudaHostUnregister(self.store.arena.data_ptr())
            if not _cuda_ok(rc):
                _clear_cuda_error()
                warn(f"cudaHostUnregister of the host arena failed ({rc})")
            self.registered = False
