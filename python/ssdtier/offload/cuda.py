"""The CUDA transport: device-to-host copies into pinned arena slots on an offload stream,
host-to-device copies back on a prefetch stream (read-ahead) or the compute stream (on
demand), with events for what each stream must wait for. docs/offloader.md has the design."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SsdtierError
from ..sizes import format_size
from ..store import SLOW_ARENA, say_slow
from ._util import host_event, on_device, warn
from .entry import Bouncing, Copying, Entry, Held, Made, Reading

if TYPE_CHECKING:
    from .forward import Fwd
    from .owner import CudaOwner


_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
# A queued copy's source stays reserved until it has run: the queue may hold this share of a
# GPU's memory, at least QUEUE_MIN (a larger tensor still goes, alone). The planner counts it in
# the peak; 1/32 held the forward back enough to miss the H100/H200 targets (docs/planner.md).
QUEUE_SHARE = 1 / 16
QUEUE_MIN = 256 << 20

log = logging.getLogger("ssdtier")


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


class Pinned:
    """The host arena registered with CUDA (page-locked) while this lives. It holds the arena
    tensor, which keeps the native store's mapping alive, so the memory is unregistered before
    it can be unmapped, also when an offloader is collected without ``detach()``."""

    def __init__(self, arena: torch.Tensor, device: torch.device) -> None:
        self.arena: torch.Tensor | None = None
        self.device = device
        # Portable: pinned for every device's context, not only the current one's.
        with on_device(device):  # else the current device's (0's) context, made if it was not
            rc = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), _REGISTER_PORTABLE)
        if _cuda_ok(rc):
            self.arena = arena
        else:
            _clear_cuda_error()
            warn(f"cudaHostRegister of the host arena failed ({rc}); copies will be synchronous")

    def close(self) -> None:
        arena, self.arena = self.arena, None
        if arena is not None:
            with on_device(self.device):
                rc = torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
            if not _cuda_ok(rc):
                _clear_cuda_error()
                warn(f"cudaHostUnregister of the host arena failed ({rc})")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: CUDA may be gone already
            self.close()


class Unpins:
    """Arena slots pinned until their copy to the GPU is done, one queue per stream: a stream's
    events end in order, two streams' need not (an unpack's copy on the compute stream waits
    behind its kernels; the prefetch stream's copies, done, should not wait for it)."""

    def __init__(self) -> None:
        self.queues: dict[Any, deque[tuple[Any, int]]] = {}  # stream -> (event, key)

    def __bool__(self) -> bool:
        return bool(self.queues)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def add(self, stream: Any, event: Any, key: int) -> None:
        self.queues.setdefault(stream, deque()).append((event, key))

    def holds(self, key: int) -> bool:
        return any(k == key for q in self.queues.values() for _, k in q)

    def done(self) -> Iterator[int]:
        """The keys whose copies are done, each taken off as it is yielded (a key copied twice
        is still held by its other copy until that one is yielded)."""
        for stream, q in list(self.queues.items()):
            while q and q[0][0].query():
                yield q.popleft()[1]
            if not q:
                del self.queues[stream]

    def oldest(self, prefer: Any = None) -> Any:
        """The event of the first copy of ``prefer``'s queue, else of some stream's."""
        q = self.queues.get(prefer) or next(iter(self.queues.values()))
        return q[0][0]

    def events(self) -> list[Any]:
        return [ev for q in self.queues.values() for ev, _ in q]


class GpuWaits:
    """How long the compute stream waits for copies back (or makes them itself), timed by
    CUDA events around each wait: the host, running ahead, does not see these stalls."""

    __slots__ = ("pairs", "seconds")

    def __init__(self) -> None:
        self.pairs: deque[tuple[Any, Any]] = deque()  # (before, after) on the compute stream, in order
        self.seconds = 0.0

    def begin(self, stream: Any, awaited: Any = None) -> Any:
        """An event before the wait, or None: in a CUDA graph capture, or when the copy
        ``awaited`` is done already (nothing to wait for, and two event records saved)."""
        if torch.cuda.is_current_stream_capturing() or (awaited is not None and awaited.query()):
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def end(self, stream: Any, before: Any) -> None:
        if before is not None:
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            self.pairs.append((before, after))

    def collect(self) -> None:
        """Add the waits the GPU is done with (call only outside a capture)."""
        pairs = self.pairs
        while pairs and pairs[0][1].query():
            before, after = pairs.popleft()
            self.seconds += before.elapsed_time(after) / 1e3


def device_memory(device: torch.device) -> int:
    """A GPU's memory in bytes (a function of its own: the CPU tests stand in for it)."""
    return torch.cuda.get_device_properties(device).total_memory


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """Page-locked host bytes from torch's caching host allocator: the same sizes each step
    reuse its blocks, and a block goes back only once the copies using it are done."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def landing(out: object) -> bool:
    """An entry's bytes are in the transport's own host memory, or on their way there: an
    arena slot being filled, or a pinned buffer of its own. Reads copy back from there."""
    return type(out) is Copying or type(out) is Bouncing


def queue_bound(device: torch.device) -> int:
    """The most bytes of sources that copies or writes out of a GPU may hold at once."""
    return max(QUEUE_MIN, int(device_memory(device) * QUEUE_SHARE))


class CudaTransport:
    def __init__(self, off: CudaOwner) -> None:
        self.off = off
        self.store = off.store
        self.native = off.store.native
        self.streams: dict[torch.device, tuple[Any, Any]] = {}  # (offload stream, prefetch stream)
        self.pinned: Pinned | None = None
        self.pending: deque[Entry] = deque()  # copies to the arena in flight, in order
        self.inflight = 0  # their bytes
        self.inflight_peak = 0  # the most since adaptive mode last looked (device_budget = "auto")
        arena = self.store.arena
        # Back-pressure: at most half the arena in flight, so that reserving a slot finds room
        # (committed slots can be evicted, slots being filled cannot); cut for each GPU seen.
        self.bound = arena.numel() // 2 if arena is not None else 0
        self.h2d = Unpins()
        self.free_later: set[int] = set()  # keys of released entries freed once their h2d copies are done
        self.staging: list[Entry] = []  # read-aheads not copied to the GPU yet
        self.stage_off = False  # no copies ahead until the next forward (out of GPU memory)
        self.waits = GpuWaits()
        self.bounces: deque[Entry] = deque()  # Bouncing entries, in order: being copied, then written
        self.writer: concurrent.futures.ThreadPoolExecutor | None = None  # writes their buffers to NVMe

    @property
    def registered(self) -> bool:
        return self.pinned is not None and self.pinned.arena is not None

    def prepare(self, device: torch.device) -> None:
        """At attach, for a model on ``device``: register the arena now, not inside the first
        forward (pinning faults in every page of it: for GiBs that takes seconds)."""
        t0 = time.perf_counter()
        self._streams(device)
        if self.registered:
            size = format_size(self.store.arena.numel())
            log.info("ssdtier: pinned the %s host arena in %.2f s", size, time.perf_counter() - t0)

    def _streams(self, device: torch.device) -> tuple[Any, Any]:
        s = self.streams.get(device)
        if s is None:
            if self.off.auto_on_cpu:
                self.off.once.warn(
                    "moved",
                    'the model was on the CPU at attach, so policy.mode "auto" chose "all" (offload every '
                    "block); attach after moving it to the GPU for adaptive mode, or set policy.mode",
                )
            arena = self.store.arena
            if self.pinned is None and arena is not None and not self.off.uses_cufile:
                if arena.numel() >= SLOW_ARENA:
                    say_slow(f"ssdtier: pinning the {format_size(arena.numel())} host arena for CUDA...")
                self.pinned = Pinned(arena, device)
            s = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self.streams[device] = s
            queue = queue_bound(device)
            if queue < self.bound:
                self.bound = queue
                log.info("ssdtier: copies out queued hold at most %s of %s's memory", format_size(queue), device)
        return s

    # ---------------------------------------------------------------- forward

    def offload(self, whole: torch.Tensor, nbytes: int, f: Fwd) -> Entry:
        native = self.native
        stream = self._streams(whole.device)[0]
        self.poll()  # committed slots can be evicted to make room
        self.hold_back(nbytes)
        while self.pending and self.inflight + nbytes > self.bound:
            self._wait_oldest()
        while True:
            key, off = native.reserve(nbytes)
            if off is not None or not nbytes or not (self.pending or self.h2d):
                break
            native.free(key)  # no room: slots being filled or copied out; wait for the oldest
            self._wait_oldest()
        entry = Entry(key, nbytes, whole.device, True, f)
        buf = None
        try:
            if off is None:
                buf = self._bounce_buffer(nbytes) if nbytes else None
                if buf is None:
                    if nbytes:
                        self._write_through(key, whole, nbytes)
                    return entry
            dest = buf if buf is not None else self.store.slot(off, nbytes)
            stream.wait_stream(torch.cuda.current_stream(whole.device))
            with torch.cuda.stream(stream):
                dest.copy_(whole, non_blocking=True)
                event = host_event()
                event.record(stream)
            # The allocator reuses the source's block only once the copy is done.
            whole.record_stream(stream)
        except BaseException:
            if off is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()  # a copy into the slot may be queued: it ends first
            native.free(key)
            raise
        src = weakref.ref(whole.untyped_storage())
        if buf is None:
            entry.out = Copying(event, off, src, whole.data_ptr())
        else:
            entry.out = Bouncing(event, buf, src, whole.data_ptr())
            self.bounces.append(entry)
        self.inflight += nbytes
        if self.inflight > self.inflight_peak:
            self.inflight_peak = self.inflight
        self.pending.append(entry)
        return entry

    @property
    def bounced(self) -> int:
        """Bytes of the pinned buffers held: at most QUEUE_MIN (one larger goes alone). torch's
        host allocator keeps them cached (in powers of two) beside the arena: kept small."""
        return sum(e.nbytes for e in self.bounces)

    def _bounce_buffer(self, nbytes: int) -> torch.Tensor | None:
        """No slot (bigger than the arena, or none free): pinned bytes of its own to copy it
        into, once the buffers still held leave room; None where it cannot have them."""
        size = self.store.arena.numel() if self.store.arena is not None else 0
        why = "is larger than" if nbytes > size else "found no free slot in"
        self.off.once.warn(
            "no slot",
            f"a saved activation of {nbytes} bytes {why} the host arena ({size} bytes): it goes to "
            "NVMe through a pinned copy of its own, at the disk's rate (said once); raise host.capacity",
        )
        if torch.cuda.is_current_stream_capturing():
            return None
        while self.bounces and self.bounced + nbytes > QUEUE_MIN:
            self._wait_bounce()
        try:
            return pinned_buffer(nbytes)
        except RuntimeError as err:  # out of pinnable memory
            self.off.once.warn("unpinned", f"no pinned buffer of {nbytes} bytes ({err}): copied synchronously")
            return None

    def _write_through(self, key: int, whole: torch.Tensor, nbytes: int) -> None:
        """A synchronous copy, streamed to NVMe."""
        host = whole.cpu()  # held by name: its bytes must outlive the write
        self.native.write_staged(key, host.data_ptr(), host)

    def _wait_bounce(self) -> None:
        """Back-pressure on pinned buffers: the host waits for the oldest's copy, or its write."""
        t0 = time.perf_counter()
        b = self.bounces[0].out
        assert type(b) is Bouncing
        if b.write is None:
            b.event.synchronize()
        else:
            concurrent.futures.wait([b.write])
        self.off.res.waited(time.perf_counter() - t0, False)
        self.poll()

    def hold_back(self, nbytes: int, backward: bool = False) -> None:
        """Back-pressure within a device budget: before ``nbytes`` more are held, copies out
        that lag the link's planned rate are waited for, while that can make room, rather
        than their sources piling up past it (as ``CpuTransport.wait_writes``)."""
        while self.pending and not torch.cuda.is_current_stream_capturing():
            short = self.off.short(nbytes)
            if not short or self.inflight < short:
                break  # within it, or held past it whatever the copies do (a plan that does not fit)
            self._wait_oldest(backward)

    def _wait_oldest(self, backward: bool = False) -> None:
        """Back-pressure: the host waits for the oldest copy into or out of the arena."""
        t0 = time.perf_counter()
        if self.pending:
            self.pending[0].out.event.synchronize()
        elif self.h2d:
            self.h2d.oldest().synchronize()
        self.off.res.waited(time.perf_counter() - t0, backward)
        self.poll()

    def poll(self) -> None:
        """Commit the arena slots whose device-to-host copy has landed, and unpin the slots
        whose host-to-device copy is done."""
        off, native = self.off, self.native
        if (self.h2d or self.pending or self.waits.pairs) and torch.cuda.is_current_stream_capturing():
            return  # querying an event is not allowed while a CUDA graph is captured
        for key in self.h2d.done() if self.h2d else ():
            native.release(key)
            if key in self.free_later and not self.h2d.holds(key):
                self.free_later.discard(key)
                off._free_key(key)
        while self.pending and self.pending[0].out.event.query():
            self._landed(self.pending.popleft())
        while self.bounces and (w := self.bounces[0].out.write) is not None and w.done():
            self._written(self.bounces.popleft())
        if self.waits.pairs:
            self.waits.collect()

    def _landed(self, e: Entry) -> None:
        off = self.off
        copy = e.out
        assert landing(copy)
        self.inflight -= e.nbytes
        if not e.refs:  # released while in flight: its key was left to free now
            self._unbounce(e)
            key, e.key = e.key, None
            off._free_key(key)
            return
        src = copy.src()
        failed = off._moved(e, src, copy.wrote) if src is not None else None
        if failed is not None:
            # The storage lives on with other bytes (freed or resized meanwhile): it serves
            # the unpack, as autograd without ssdtier would read it.
            self._unbounce(e)
            e.out = Held(src)
            off.res.sources += e.nbytes
            off._copy_lost(e, failed)
            return
        if type(copy) is Copying:
            e.out = None
            self.native.commit(e.key)
            return
        if self.writer is None:
            self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ssdtier-write")
        copy.write = self.writer.submit(self.native.write_staged, e.key, copy.buf.data_ptr(), copy.buf)

    def _unbounce(self, e: Entry) -> None:
        """An entry's pinned buffer is let go (or it had none)."""
        if type(e.out) is Bouncing:
            self.bounces.remove(e)
        e.out = None

    def _written(self, e: Entry) -> None:
        """A pinned buffer's write to NVMe ended."""
        b = e.out
        assert type(b) is Bouncing
        try:
            b.write.result()
        except SsdtierError as err:
            if e.refs:
                self.off._copy_lost(e, err)  # the buffer stays and serves the unpack
                return
        e.out = None
        if not e.refs:  # released while written: its key was left to free now
            key, e.key = e.key, None
            self.off._free_key(key)

    # ---------------------------------------------------------------- backward

    def start_read(self, e: Entry, from_host: bool) -> None:
        if landing(e.out):  # copied back from its slot or buffer
            e.back = Reading(None, 0, None, True)
            return
        # Asked even when in the arena: the store then keeps it there until its unpack.
        ticket = self.native.prefetch(e.key)
        e.back = Reading(None, 0, None if from_host and ticket.done() else ticket, from_host)

    def stage_later(self, e: Entry) -> None:
        """Queue a read's copy to the GPU ahead, once (none while out of GPU memory)."""
        if not self.stage_off and type(e.back) is Reading and not e.back.queued:
            e.back.queued = True
            self.staging.append(e)

    def pending_bytes(self) -> int:
        """Bytes of reads ahead not copied to the GPU yet: they will be."""
        return sum(e.nbytes for e in self.staging if type(e.back) is Reading and e.back.staged is None)

    def stage_ready(self) -> None:
        """Copy to the GPU, on the prefetch stream, the read-ahead entries now in the arena."""
        if not self.staging:
            return
        waiting = []
        for e in self.staging:
            if self.stage_off:
                break  # out of GPU memory (_stage): the rest are copied at their unpack
            r = e.back
            if type(r) is not Reading or e.key is None or r.staged is not None:
                continue  # unpacked, released, or failed meanwhile
            if r.ticket is not None and not r.ticket.done():
                waiting.append(e)
                continue
            if not r.from_host and not landing(e.out) and not self.native.location(e.key)[0]:
                # The store skipped the read (no room in the arena then): ask again, as the
                # backward frees slots and the writes under way end.
                ticket = self.native.prefetch(e.key)
                if not ticket.done():
                    r.ticket = ticket
                waiting.append(e)
                continue
            self._stage(e, r)
        self.staging = waiting

    def _stage(self, e: Entry, r: Reading) -> None:
        prefetch = self._streams(e.device)[1]
        try:
            if landing(e.out):
                out, ev = self._copy_landing(e, prefetch)
            else:
                assert e.key is not None
                if not self.native.location(e.key)[0]:
                    return  # not in the arena (no room for the read, or it failed): the unpack reads it
                off = self.native.acquire(e.key)
                if off is None:
                    return
                out, ev = self._copy_from_slot(e, off, prefetch)
        except torch.cuda.OutOfMemoryError:
            # Reading ahead is a bet: the unpack copies it on demand (the slot was released). Each
            # failed allocation empties the allocator's cache, so no more copies ahead until the
            # next forward.
            self.stage_off = True
            return
        r.staged = (out, ev, prefetch)  # from that stream's pool: the copy waits for nothing
        self.off.res.track(out.untyped_storage(), e.nbytes)
        self.off.c["copied_ahead"] += 1

    @staticmethod
    def _new_on(e: Entry, stream: Any) -> torch.Tensor:
        """GPU bytes for an entry, from ``stream``'s pool: the copy into them on that stream
        needs to wait for nothing else."""
        with torch.cuda.stream(stream):
            return torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)

    def _copy_from_slot(self, e: Entry, off: int, stream: Any) -> tuple[torch.Tensor, Any]:
        """Copy an entry's acquired arena slot to new GPU bytes of ``stream``'s pool; returns
        them and the copy's event. The slot stays pinned until the copy has read it (poll
        unpins it); on failure it is released at once."""
        try:
            out = self._new_on(e, stream)
            with torch.cuda.stream(stream):
                out.copy_(self.store.slot(off, e.nbytes), non_blocking=True)
                ev = host_event()
                ev.record(stream)
        except BaseException:
            self.native.release(e.key)
            raise
        self.h2d.add(stream, ev, e.key)
        return out, ev

    def _copy_landing(self, e: Entry, stream: Any) -> tuple[torch.Tensor, Any]:
        """Copy an entry back from the slot its copy to the arena is still filling, or from
        its pinned buffer: ``stream`` waits for that copy, and the slot is committed (may be
        evicted) only after this one."""
        copy = e.out
        assert landing(copy)
        out = self._new_on(e, stream)
        stream.wait_event(copy.event)
        held = self.store.slot(copy.slot, e.nbytes) if type(copy) is Copying else copy.buf
        with torch.cuda.stream(stream):
            out.copy_(held, non_blocking=True)
            ev = host_event()
            ev.record(stream)
        copy.event = ev
        return out, ev

    def restore(self, e: Entry, staged: tuple[torch.Tensor, Any, Any] | None) -> tuple[torch.UntypedStorage, Made]:
        """The entry back on the GPU: the copy made ahead (``staged``), or one made now on the
        compute stream; and how it was made."""
        if staged is not None:
            # Copied ahead on the prefetch stream: the compute stream waits for that copy.
            made = Made(staged[1], staged[2], [])
            st = staged[0].untyped_storage()  # tracked since it was staged
            self.use_on_current_stream(e.device, made, st)
            return st, made
        self.poll()
        current = torch.cuda.current_stream(e.device)
        if landing(e.out):
            before = self.waits.begin(current)
            out, ev = self._copy_landing(e, current)
            self.waits.end(current, before)
        else:
            out, ev = self._copy_now(e)
        st = out.untyped_storage()
        self.off.res.track(st, e.nbytes)
        if ev is None:
            ev = host_event()
            ev.record(current)
        return st, Made(ev, current, [current])

    def _copy_now(self, e: Entry) -> tuple[torch.Tensor, Any]:
        """Copy an entry back to the GPU on the current stream; returns it and the copy's
        event (None: a synchronous copy from pageable memory)."""
        native, res = self.native, self.off.res
        # Not in the arena (no read-ahead brought it, or it was skipped for want of room):
        # acquire() or read_staged() reads it now, and the backward waits; count it as stall.
        resident = native.location(e.key)[0]
        t0 = time.perf_counter()
        off = native.acquire(e.key)
        arena = self.store.arena.numel() if self.store.arena is not None else 0
        if off is None and e.nbytes <= arena and not torch.cuda.is_current_stream_capturing():
            # Copies back pin the arena: wait for one (the prefetch stream's first, which run
            # no kernels), not for the whole stream as a copy from pageable memory would.
            prefetch = self._streams(e.device)[1]
            while off is None and self.h2d:
                self.poll()
                off = native.acquire(e.key)
                if off is None and self.h2d:
                    self.h2d.oldest(prefetch).synchronize()
        current = torch.cuda.current_stream(e.device)
        # The GPU's part is timed from here on: the read above is the host's stall, not twice.
        if off is None:
            self.off.once.warn(
                "pageable",
                f"an activation of {e.nbytes} bytes found no room in the host arena to be read back: "
                "copied from pageable memory, which waits for the GPU (said once); raise host.capacity",
            )
            host = torch.empty(e.nbytes, dtype=torch.uint8)
            native.read_staged(e.key, host.data_ptr(), e.nbytes, host)
            res.stall += time.perf_counter() - t0
            before = self.waits.begin(current)
            out = host.to(e.device)
            self.waits.end(current, before)
            return out, None
        if not resident:
            res.stall += time.perf_counter() - t0
        before = self.waits.begin(current)
        out, ev = self._copy_from_slot(e, off, current)
        self.waits.end(current, before)
        return out, ev

    def use_on_current_stream(self, device: torch.device, made: Made, st: torch.UntypedStorage) -> None:
        """Before the current stream uses a restored storage, it waits for the copy that made
        it, and a block allocated for another stream is recorded as used here too, so the
        allocator does not reuse it before this stream is done with it."""
        current = torch.cuda.current_stream(device)
        if current in made.waited:
            return
        before = self.waits.begin(current, made.event)
        current.wait_event(made.event)
        self.waits.end(current, before)
        made.waited.append(current)
        if current != made.allocated:
            torch.empty(0, dtype=torch.uint8, device=device).set_(st).record_stream(current)

    # ---------------------------------------------------------------- release, close

    def free_key(self, e: Entry) -> None:
        """Free a released entry's key, or once the copies into and out of its slot are done."""
        key = e.key
        if landing(e.out) and key is not None:
            pass  # poll frees it when its copy lands, or its buffer's write ends
        elif key is not None and self.h2d.holds(key):
            self.free_later.add(key)  # the slot stays pinned until then (poll frees it)
        else:
            self.off._free_key(key)
        if self.h2d or self.pending:
            self.poll()  # so deferred keys go soon after the backward, not next forward

    def forget_pin(self) -> None:
        """In a fork child: the arena is not mapped here, and CUDA is the parent's."""
        if self.pinned is not None:
            self.pinned.arena = None
        self.writer = None  # its thread is the parent's

    def close(self) -> None:
        for e in self.pending:  # copies into the arena still running
            e.out.event.synchronize()
        for ev in self.h2d.events():  # copies out of the arena still running (their keys freed later)
            ev.synchronize()
        if self.writer is not None:
            self.writer.shutdown()  # the buffers' writes end before the store closes
            self.writer = None
        self.poll()  # their keys freed: a store kept open (shelf.py) holds nothing of this one's
        self.bounces.clear()
        self.pending.clear()
        self.staging.clear()
        self.inflight = 0
        self.h2d = Unpins()
        self.free_later.clear()
        if self.pinned is not None:
            self.pinned.close()
