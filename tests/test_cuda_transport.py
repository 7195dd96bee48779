"""The CUDA transport's books, run on the CPU against fake streams and events: a copy's
event is done only when the test lets the fake GPU run, so the transport sees copies in
flight as it would on a GPU (the bytes themselves move at once). What this cannot check,
stream ordering on real hardware, is tests/test_cuda.py's."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import random
import re
import sys
import threading
import time

import pytest
import torch

import ssdtier
from ssdtier.bench.models import batch_loss, build_model, make_batch
from ssdtier.errors import SsdtierError
from ssdtier.offload import cuda, offloader
from ssdtier.offload.cuda import GpuWaits, Pinned
from ssdtier.offload.entry import Bouncing, Copying, Held, Reading, Restored
from ssdtier.offload.readahead import Backward
from ssdtier.store import ByteStore

from .test_attach import CONFIGS, assert_same, offload_config, train
from .test_fork import _in_child


class FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.done = False
        self.timing, self.at = enable_timing, None  # when the fake GPU ran it
        # The host waits on events for copies: a blocking one sleeps, the default spins a core.
        assert blocking or enable_timing, "an event the host may wait on, made non-blocking"

    def elapsed_time(self, end) -> float:
        assert self.timing and end.timing and self.done and end.done, "elapsed_time of an event not done or untimed"
        return (end.at - self.at) * 1e3

    def record(self, stream=None) -> None:
        (stream or FakeGPU.now.current).events.append(self)

    def query(self) -> bool:
        assert not FakeGPU.now.capturing, "cudaEventQuery while a CUDA graph is captured"
        return self.done

    def synchronize(self) -> None:
        FakeGPU.now.run(until=self)


class FakeStream:
    def __init__(self, device=None) -> None:
        self.events: list[FakeEvent] = []
        self.waits: list[object] = []

    def wait_stream(self, other) -> None:
        self.waits.append(other)

    def wait_event(self, ev) -> None:
        self.waits.append(ev)

    def synchronize(self) -> None:
        FakeGPU.now.run()


class FakeGPU:
    """Streams whose events complete only in ``run``."""

    now: FakeGPU

    def __init__(self) -> None:
        self.current = FakeStream()
        self.registered: dict[int, int] = {}
        self.device: torch.device | None = None  # set by torch.cuda.device
        self.pinned_on: list[tuple[str, torch.device | None]] = []  # (call, current device)
        self.recorded: list[tuple[int, FakeStream]] = []
        self.capturing = False  # a CUDA graph being captured: event queries are not allowed
        FakeGPU.now = self

    def run(self, until: FakeEvent | None = None) -> None:
        for s in self.streams():
            for ev in s.events:
                if not ev.done:
                    ev.done, ev.at = True, time.perf_counter()
                if ev is until:
                    return

    def streams(self) -> list[FakeStream]:
        return [*self.made, self.current]

    made: list[FakeStream] = []


@pytest.fixture
def gpu(monkeypatch):
    g = FakeGPU()
    g.made = []

    def new_stream(device=None):
        s = FakeStream(device)
        g.made.append(s)
        return s

    @contextlib.contextmanager
    def use(stream):
        before, g.current = g.current, stream
        try:
            yield
        finally:
            g.current = before

    @contextlib.contextmanager
    def on_device(device):
        before, g.device = g.device, torch.device(device)
        try:
            yield
        finally:
            g.device = before

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            g.pinned_on.append(("register", g.device))
            if ptr in g.registered:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
            g.registered[ptr] = n
            return 0

        def cudaHostUnregister(self, ptr):
            g.pinned_on.append(("unregister", g.device))
            return 0 if g.registered.pop(ptr, None) is not None else 713

    monkeypatch.setattr(cuda, "device_memory", lambda device: 1 << 40)  # the arena bounds the queue
    monkeypatch.setattr(cuda, "pinned_buffer", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: g.current)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "device", on_device)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: g.capturing)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: g.recorded.append((t.data_ptr(), s)))
    return g


@pytest.fixture
def transport(store_dir, gpu):
    """A CUDA transport over a 1 MiB arena (at most 512 KiB in flight)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    off = ssdtier.attach(model, offload_config(store_dir, host="1MiB"))
    yield off.cuda
    off.detach()


class _Native:
    """The native store with some of its methods replaced."""

    def __init__(self, native, **methods) -> None:
        self._native, self._methods = native, methods

    def __getattr__(self, name):
        return self._methods.get(name) or getattr(self._native, name)


def source(nbytes: int, value: int) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8)


def offload(tr, src: torch.Tensor):
    e = tr.offload(src, src.numel(), tr.off._last_fwd)
    e.refs = 1  # as its Saved handle would
    return e


def let_go(tr, *entries) -> None:
    """Each entry's last handle goes, as autograd drops it."""
    for e in entries:
        e.refs, e.back = 0, None
        tr.off.drop_source(e)
        tr.free_key(e)


def settle(tr, gpu) -> None:
    """The fake GPU runs, and the writes of the pinned buffers end."""
    gpu.run()
    tr.poll()
    concurrent.futures.wait([e.out.write for e in tr.bounces])
    tr.poll()


def in_store(tr, key) -> bool:
    try:
        tr.native.location(key)
    except SsdtierError:
        return False
    return True


def test_a_source_is_dropped_at_once_and_committed_when_its_copy_lands(transport, gpu):
    src = source(64 << 10, 7)
    e = offload(transport, src)
    assert gpu.recorded == [(src.data_ptr(), transport.streams[src.device][0])]
    assert type(e.out) is Copying and list(transport.pending) == [e] and transport.inflight == 64 << 10
    transport.poll()
    assert type(e.out) is Copying  # not landed: nothing ran
    gpu.run()
    transport.poll()
    assert e.out is None and not transport.pending and transport.inflight == 0
    off = transport.native.acquire(e.key)  # committed: readable
    assert torch.equal(transport.store.slot(off, e.nbytes), src)
    transport.native.release(e.key)


def test_copies_in_flight_are_bounded_by_half_the_arena(transport, gpu, monkeypatch):
    sync = FakeEvent.synchronize

    def slow(ev):
        time.sleep(0.01)
        sync(ev)

    monkeypatch.setattr(FakeEvent, "synchronize", slow)
    es = [offload(transport, source(192 << 10, i)) for i in range(4)]
    # 3 x 192 KiB would pass 512 KiB: the host waited for the oldest copies first.
    assert transport.inflight <= 512 << 10
    assert es[0].out is None and type(es[-1].out) is Copying
    assert transport.store.arena is not None
    res = transport.off.res
    assert res.held_back >= 0.01 and res.forward_wait == res.held_back  # counted as the forward's wait


def test_copies_in_flight_hold_a_share_of_the_gpus_memory_at_most(store_dir, gpu, monkeypatch, caplog):
    """A queued copy's source stays reserved until copied: a large arena does not let the
    queue hold more than QUEUE_SHARE of the GPU."""
    monkeypatch.setattr(cuda, "device_memory", lambda device: 4 << 20)
    monkeypatch.setattr(cuda, "QUEUE_MIN", 128 << 10)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    off = ssdtier.attach(model, offload_config(store_dir, host="64MiB"))
    try:
        tr = off.cuda
        with caplog.at_level("INFO", logger="ssdtier"):
            es = [offload(tr, source(96 << 10, i)) for i in range(4)]
        assert tr.bound == 256 << 10  # 4 MiB / 16, not half the arena
        assert "copies out queued hold at most 256KiB" in caplog.text
        assert tr.inflight <= 256 << 10 and tr.inflight_peak <= 256 << 10
        assert es[0].out is None and type(es[-1].out) is Copying  # the oldest waited for
    finally:
        off.detach()


def test_no_event_is_queried_while_a_cuda_graph_is_captured(transport, gpu):
    e = offload(transport, source(64 << 10, 2))
    gpu.run()
    gpu.capturing = True  # a graph captured by hand (torch.cuda.graph) after an eager step
    transport.poll()
    assert type(e.out) is Copying and list(transport.pending) == [e]
    gpu.capturing = False
    transport.poll()
    assert e.out is None and not transport.pending


def test_an_entry_released_in_flight_keeps_its_slot_until_the_copy_lands(transport, gpu):
    e = offload(transport, source(64 << 10, 1))
    key = e.key
    let_go(transport, e)
    assert in_store(transport, key)  # a read could fill a free slot under the copy
    gpu.run()
    transport.poll()
    assert not in_store(transport, key) and e.key is None and not transport.pending


def test_an_unpack_before_landing_copies_from_the_slot_after_the_copy(transport, gpu):
    src = source(64 << 10, 9)
    e = offload(transport, src)
    first = e.out.event
    st = transport.restore(e, None)[0]
    assert bytes(st) == bytes(src.numpy())
    # The copy back waited for the copy in; the slot is committed only after the copy back.
    assert first in gpu.current.waits and e.out.event is not first
    gpu.run(until=first)
    transport.poll()
    assert type(e.out) is Copying
    gpu.run()
    transport.poll()
    assert e.out is None and transport.native.location(e.key)[0]


def test_the_gpus_waits_for_copies_back_are_timed(transport, gpu):
    # The host runs ahead: the compute stream's waits for copies back are seen only on the GPU,
    # between events recorded around each wait.
    e = offload(transport, source(64 << 10, 4))
    transport.restore(e, None)  # before landing: the compute stream waits for the copy in
    before, after = gpu.current.events[-2], gpu.current.events[-1]
    gpu.run(until=before)
    time.sleep(0.02)  # the copy the stream waits for takes 20 ms
    assert transport.off.stats().gpu_wait_seconds == 0  # not done yet: not counted
    gpu.run()
    assert after.done and transport.off.gpu_wait() >= 0.02
    assert transport.off.stats().gpu_wait_seconds == transport.off.gpu_wait()
    assert transport.off.io_wait() >= transport.off.gpu_wait()
    e2 = offload(transport, source(64 << 10, 5))
    n = len(gpu.current.events)
    gpu.capturing = True  # no timing events in a capture, and none queried
    transport.restore(e2, None)
    transport.off.gpu_wait()
    gpu.capturing = False
    assert not transport.waits.pairs and not any(ev.timing for ev in gpu.current.events[n:])


def test_an_unpack_that_reads_from_nvme_times_only_the_gpus_copy(transport, gpu, monkeypatch):
    # The read is the host's stall (stall_seconds); the GPU's wait is timed after it, so the
    # same time is not counted twice.
    e = offload(transport, source(64 << 10, 8))
    gpu.run()
    transport.poll()
    transport.native.evict(e.key)  # on NVMe only: the unpack reads it now
    order = []

    class Native:
        def __getattr__(self, name):
            return getattr(native, name)

        def acquire(self, key):
            order.append("read")
            return native.acquire(key)

    native = transport.native
    monkeypatch.setattr(transport, "native", Native())
    real_begin = GpuWaits.begin
    monkeypatch.setattr(GpuWaits, "begin", lambda *a: order.append("timed") or real_begin(*a))
    transport.restore(e, None)
    assert order == ["read", "timed"] and len(transport.waits.pairs) == 1


def test_a_copy_ahead_already_done_is_waited_for_untimed(transport, gpu):
    e = offload(transport, source(64 << 10, 6))
    transport.start_read(e, False)
    transport.stage_later(e)
    transport.stage_ready()
    ev = e.back.staged[1]
    gpu.run()  # the copy ahead is done before its unpack: no timing events for it
    n = len(gpu.current.events)
    transport.restore(e, e.back.staged)
    assert ev in gpu.current.waits and not any(x.timing for x in gpu.current.events[n:])
    assert not transport.waits.pairs


def test_read_ahead_of_an_entry_still_landing_copies_on_the_prefetch_stream(transport, gpu):
    src = source(64 << 10, 3)
    e = offload(transport, src)
    transport.start_read(e, False)
    assert e.back.ticket is None  # no NVMe read: its bytes are on their way to the arena
    transport.stage_later(e)
    transport.stage_ready()
    out, ev, stream = e.back.staged
    prefetch = transport.streams[src.device][1]
    assert stream is prefetch and ev in prefetch.events and torch.equal(out, src)
    st = transport.restore(e, e.back.staged)[0]
    # The compute stream waits for the copy and its use of the prefetch stream's block is recorded.
    assert ev in gpu.current.waits and (st.data_ptr(), gpu.current) in gpu.recorded


def copied_ahead(tr, gpu, src: torch.Tensor):
    """An entry whose copy to the arena landed, then copied back ahead of its unpack."""
    e = offload(tr, src)
    gpu.run()
    tr.poll()  # landed: the copy ahead reads the committed slot
    tr.start_read(e, True)
    tr.stage_later(e)
    tr.stage_ready()
    return e


def test_a_copy_ahead_never_unpacked_keeps_its_slot_until_done(transport, gpu):
    # Released unused (a graph dropped before its backward ended): its block goes back to
    # the prefetch stream's pool, in that stream's order; the arena slot the copy reads
    # stays pinned, and its key, until the copy is done.
    e = copied_ahead(transport, gpu, source(64 << 10, 9))
    key = e.key
    transport.off._release(e)
    assert key in transport.free_later
    gpu.run()
    transport.poll()
    assert key not in transport.free_later


def test_the_byte_window_learns_from_reads_into_the_arena(transport, gpu):
    # "auto" read-ahead sizes its window from the reads it started; on CUDA they go from
    # NVMe into the arena, and without them it would never leave its first guess.
    e = offload(transport, source(64 << 10, 5))
    gpu.run()
    transport.poll()
    transport.native.evict(e.key)
    ahead = transport.off.ahead
    assert ahead.auto
    ahead._want(e)
    ticket = e.back.ticket
    assert ticket is not None and [(t, n) for _, t, n in ahead.reads] == [(ticket, 64 << 10)]
    ticket.wait()


def test_a_source_resized_while_copied_serves_its_unpack(transport, gpu, warned):
    src = source(64 << 10, 5)
    e = offload(transport, src)
    key = e.key
    src.untyped_storage().resize_(0)
    gpu.run()
    transport.poll()
    assert e.key is None and type(e.out) is Held and not in_store(transport, key)
    assert transport.off.c["failed_writes"] == 1
    assert warned("freed or resized while it was being copied out")


def test_the_arena_is_unregistered_before_it_can_be_unmapped(store_dir, gpu):
    store = ByteStore(offload_config(store_dir, host="1MiB"))
    arena = store.arena
    p = Pinned(arena, torch.device("cpu"))
    assert gpu.registered == {arena.data_ptr(): arena.numel()}
    del store
    gc.collect()
    assert gpu.registered  # the pin holds the arena, and so the mapping
    del p
    assert not gpu.registered


def test_the_arena_is_pinned_at_attach_for_a_model_on_a_gpu(store_dir, gpu, monkeypatch, caplog):
    # Not in the first forward: pinning faults in every page of the arena.
    monkeypatch.setattr(offloader, "cuda_device", lambda model: torch.device("cuda", 1))
    monkeypatch.setattr(cuda, "SLOW_ARENA", 1 << 20)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with caplog.at_level("INFO", logger="ssdtier"):
        off = ssdtier.attach(model, offload_config(store_dir, host="1MiB"))
    # A large arena takes seconds: said before, and how long after.
    assert re.search(r"pinning the 1MiB host arena for CUDA\.\.\.\n.*pinned the 1MiB host arena in", caplog.text)
    arena = off.store.arena
    assert off.cuda.registered and gpu.registered == {arena.data_ptr(): arena.numel()}
    off.detach()
    assert not gpu.registered
    # With the model's device current, not device 0 (a context made there for nothing).
    cuda1 = torch.device("cuda", 1)
    assert gpu.pinned_on == [("register", cuda1), ("unregister", cuda1)]
    with ssdtier.attach(model, offload_config(store_dir, host="1MiB", mode="none")) as off:
        assert not gpu.registered  # keeps everything: the arena is not used


def test_an_auto_arena_is_a_quarter_of_the_models_gpu(store_dir, gpu, monkeypatch):
    sized = []
    monkeypatch.setattr(offloader, "cuda_device", lambda model: torch.device("cuda", 1))
    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(cuda, "device_memory", lambda device: sized.append(device) or 32 << 20)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with ssdtier.attach(model, offload_config(store_dir, host="auto")) as off:
        assert off.store.arena.numel() == off.config.host.capacity == 8 << 20
        assert torch.device("cuda", 1) in sized and gpu.registered == {off.store.arena.data_ptr(): 8 << 20}
        assert "host.capacity = 8MiB: 'auto' on a GPU: a quarter of the GPU's memory" in off.stats().chosen
    monkeypatch.setattr(offloader, "carries", lambda config, device: True)  # cuFile: the arena carries nothing
    with ssdtier.attach(model, offload_config(store_dir, host="auto")) as off:
        assert off.config.host.capacity == 1 << 30 and not any("host.capacity" in c for c in off.stats().chosen)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_fork_child_leaves_the_parents_pinned_arena_and_copies_alone(store_dir, gpu, monkeypatch):
    monkeypatch.setattr(offloader, "cuda_device", lambda model: torch.device("cuda", 0))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    off = ssdtier.attach(model, offload_config(store_dir, host="1MiB"))
    pinned = dict(gpu.registered)
    e = offload(off.cuda, source(64 << 10, 1))  # its copy in flight at the fork

    def child():
        off.detach()  # nothing to do here: the store, the pin and the copies are the parent's
        off.cuda.pinned.close()
        assert gpu.registered == pinned and list(off.cuda.pending) == [e]

    assert _in_child(child) == 0
    gpu.run()
    off.cuda.poll()
    assert type(e.out) is not Copying and off.cuda.native.location(e.key)[0]
    let_go(off.cuda, e)
    off.detach()
    assert not gpu.registered


def test_an_offloader_collected_undetached_unregisters_its_arena(store_dir, gpu):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    off = ssdtier.attach(model, offload_config(store_dir, host="1MiB"))
    offload(off.cuda, source(4096, 1))
    assert off.cuda.registered
    del model, off
    gc.collect()
    assert not gpu.registered


def test_an_activation_larger_than_the_arena_goes_through_a_pinned_copy_of_its_own(transport, gpu, warned):
    src = source(2 << 20, 4)
    e = offload(transport, src)
    # Nothing waited for: the copy is queued on the offload stream, the write after it lands.
    assert type(e.out) is Bouncing and e.out.write is None and list(transport.pending) == [e]
    assert warned("is larger than the host arena") and transport.bounced == 2 << 20
    assert gpu.recorded == [(src.data_ptr(), transport.streams[src.device][0])]
    settle(transport, gpu)
    assert e.out is None and not transport.pending and not transport.bounces and transport.bounced == 0
    assert transport.native.location(e.key) == (False, True)
    st = transport.restore(e, None)[0]  # read back from NVMe
    assert bytes(st) == bytes(src.numpy())


def test_an_unpack_before_a_pinned_copy_is_written_is_served_from_it(transport, gpu):
    src = source(2 << 20, 5)
    e = offload(transport, src)
    first = e.out.event
    transport.start_read(e, False)
    st = transport.restore(e, None)[0]
    assert bytes(st) == bytes(src.numpy()) and first in gpu.current.waits  # after the copy out
    let_go(transport, e)
    key = e.key
    assert in_store(transport, key)  # its key goes once the copy has landed
    gpu.run()
    transport.poll()
    assert not in_store(transport, key) and not transport.bounces and transport.bounced == 0


def test_a_pinned_copy_serves_reads_and_keeps_its_key_while_written(transport, gpu, monkeypatch):
    real, go = transport.native, threading.Event()

    def slow(key, ptr, owner):
        assert go.wait(60)
        real.write_staged(key, ptr, owner)

    monkeypatch.setattr(transport, "native", _Native(real, write_staged=slow))
    src = source(2 << 20, 7)
    e = offload(transport, src)
    gpu.run()
    transport.poll()
    assert type(e.out) is Bouncing and not e.out.write.done()
    transport.start_read(e, False)
    assert bytes(transport.restore(e, None)[0]) == bytes(src.numpy())  # from its buffer
    key = e.key
    let_go(transport, e)
    assert in_store(transport, key)  # a write from the buffer is under way
    go.set()
    settle(transport, gpu)
    assert not in_store(transport, key) and not transport.bounces and transport.bounced == 0


def test_pinned_buffers_held_at_once_are_bounded(transport, gpu, monkeypatch):
    real, writes = transport.native, []

    def write_staged(key, ptr, owner):
        writes.append(key)
        real.write_staged(key, ptr, owner)

    monkeypatch.setattr(transport, "native", _Native(real, write_staged=write_staged))
    monkeypatch.setattr(cuda, "QUEUE_MIN", 2 << 20)
    es, held = [], []
    for i in range(3):  # each larger than the 1 MiB arena, two past the 2 MiB bound: one at a time
        es.append(offload(transport, source(3 << 19, i)))
        held.append(transport.bounced)
    assert held == [3 << 19] * 3 and writes == [es[0].key, es[1].key]  # the host waited for each write
    assert transport.off.res.held_back > 0
    settle(transport, gpu)
    for i, e in enumerate(es):
        out = torch.empty(e.nbytes, dtype=torch.uint8)
        transport.native.read_staged(e.key, out.data_ptr(), e.nbytes, out)
        assert torch.equal(out, source(3 << 19, i))


def test_a_failed_write_of_a_pinned_copy_leaves_it_serving_the_unpack(transport, gpu, warned, monkeypatch):
    def full(key, ptr, owner):
        raise SsdtierError("no space left on the device")

    monkeypatch.setattr(transport, "native", _Native(transport.native, write_staged=full))
    src = source(2 << 20, 6)
    e = offload(transport, src)
    settle(transport, gpu)
    assert type(e.out) is Bouncing and e.key is None and warned("no space left on the device")
    transport.start_read(e, False)
    assert bytes(transport.restore(e, None)[0]) == bytes(src.numpy())


def test_a_read_ahead_the_store_skipped_is_asked_again(store_dir, gpu):
    # The arena full of entries needed sooner, still being written (a slow disk): a read
    # ahead finds no room and the store skips it. Asked again once the backward used one of
    # them, it is read and copied ahead, not read at its unpack.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cfg = offload_config(store_dir, host="1MiB")
    cfg["io"]["throttle"] = "1MB"  # 0.26 s a 256 KiB write or read
    with ssdtier.attach(model, cfg) as off:
        tr = off.cuda
        old = offload(tr, source(256 << 10, 1))
        gpu.run()
        tr.poll()
        tr.native.evict(old.key)
        fill = [offload(tr, source(256 << 10, 2 + i)) for i in range(4)]
        gpu.run()
        tr.poll()
        assert not tr.native.location(old.key)[0]
        tr.start_read(old, False)
        tr.stage_later(old)
        tr.stage_ready()
        assert tr.store.stats().prefetch_skipped >= 1 and old.back.staged is None
        used = fill.pop()
        let_go(tr, used)  # its slot comes back once its write ends
        for _ in range(1000):  # 5 s at most
            if old.back.staged is not None:
                break
            time.sleep(0.005)
            tr.stage_ready()
        assert old.back.staged is not None and tr.store.stats().prefetches == 1
        assert bytes(tr.restore(old, old.back.staged)[0])[:4] == bytes([1]) * 4
        let_go(tr, old, *fill)
        gpu.run()
        tr.poll()


def test_a_read_ahead_keeps_its_entry_in_the_arena(store_dir, gpu):
    # The arena full, its oldest entry is being written out to make room. Read ahead, it
    # stays in the arena when the next copy needs a slot: that copy takes the next one's.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cfg = offload_config(store_dir, host="1MiB")
    cfg["io"]["throttle"] = "1MB"  # 0.26 s a 256 KiB write
    with ssdtier.attach(model, cfg) as off:
        tr = off.cuda
        es = []
        for i in range(4):
            es.append(offload(tr, source(256 << 10, i)))
            gpu.run()
            tr.poll()
        assert tr.native.location(es[0].key) == (True, False)  # its write under way
        tr.start_read(es[0], True)
        assert es[0].back.ticket is None  # nothing to read
        tr.store.flush()
        es.append(offload(tr, source(256 << 10, 4)))
        gpu.run()
        tr.poll()
        assert tr.native.location(es[0].key) == (True, True)
        assert tr.native.location(es[1].key) == (False, True)
        let_go(tr, *es)


def test_the_read_ahead_window_stays_within_half_the_arena(transport, gpu):
    # Reads ahead land in the arena, which also holds what the backward needs first: a window
    # learned on a fast disk (64 MiB here) reads at most half the arena (512 KiB) ahead.
    es = [offload(transport, source(128 << 10, i)) for i in range(8)]
    gpu.run()
    transport.poll()
    b = Backward()
    for e in es:
        e.pos = len(b.seq)
        b.seq.append(e)
        b.cum += e.nbytes
    ahead = transport.off.ahead
    ahead.window = 64 << 20
    ahead.advance(b, -1)
    assert b.sweep.arena_cap == 512 << 10 and b.sweep.read_to == 3  # 4 x 128 KiB
    let_go(transport, *es)


def through_the_cuda_transport(gpu, monkeypatch) -> None:
    """CPU tensors take the CUDA transport's path; each event query lets the fake GPU run
    everything queued with probability 0.3 (seeded)."""
    rng = random.Random(0)
    query = FakeEvent.query

    def ends_at_random(ev):
        if rng.random() < 0.3:
            gpu.run()
        return query(ev)

    monkeypatch.setattr(FakeEvent, "query", ends_at_random)
    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))


@pytest.mark.parametrize(
    ("model", "host", "policy"),
    [
        *((m, h, {"prefetch_layers": "auto"}) for m in ("gpt", "t5") for h in ("64KiB", "64MiB")),
        ("bert", "128KiB", {"prefetch_layers": 2}),
        ("bert", "128KiB", {"mode": "adaptive"}),
    ],
)
def test_training_through_the_cuda_transport_is_exact(store_dir, gpu, monkeypatch, model, host, policy):
    # CPU tensors take the CUDA transport's whole path, on fake streams whose events end at
    # random as the transport asks: copies still landing at their unpack, spills to NVMe
    # (small arenas), reads ahead staged on the prefetch stream, and exact gradients.
    ref = train(CONFIGS[model], micro=3)
    through_the_cuda_transport(gpu, monkeypatch)
    got = train(CONFIGS[model], offload_config(store_dir, host=host, **policy), micro=3)
    assert_same(ref, got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.copied_ahead > 0, s
    assert (s.bytes_read_nvme > 0) == (host != "64MiB"), s


@pytest.mark.parametrize("bound", [256 << 20, 0])
def test_training_with_every_tensor_larger_than_the_arena_is_exact(store_dir, gpu, monkeypatch, bound):
    # Each goes through a pinned buffer of its own, copies landing at random, at most one at
    # a time with no room for buffers (bound 0).
    ref = train(CONFIGS["gpt"], micro=3)
    through_the_cuda_transport(gpu, monkeypatch)
    monkeypatch.setattr(cuda, "QUEUE_MIN", bound)
    made, real = [], cuda.CudaTransport._bounce_buffer
    monkeypatch.setattr(cuda.CudaTransport, "_bounce_buffer", lambda self, n: made.append(n) or real(self, n))
    got = train(CONFIGS["gpt"], offload_config(store_dir, host="8KiB"), micro=3)
    assert_same(ref, got)
    assert made  # (the stats are read before the writes of the last buffers need have ended)


def test_a_copy_landed_after_the_last_unpack_is_not_held_at_the_next_forward(store_dir, gpu, monkeypatch):
    # Blocks kept, the head's logits offloaded past the budget: their unpack polls before the
    # copy lands and no later one polls. On the H100 the stale 3.9 GiB made the guard recompute
    # block 0 and cut every other step's auto budget.
    from ssdtier.bench.models import GPTConfig
    from ssdtier.offload.adaptive import Adaptive
    from ssdtier.plan import Action

    from .test_rok import forced

    cfg = GPTConfig(n_layers=4, vocab_size=2048, seq_len=16, d_model=32, n_heads=4)
    guard, seen = Adaptive.guard, []

    def at_first_block(self, f, tag):
        if tag == 1:
            cu = self.off.cuda
            seen.append((cu.inflight, sum(e.nbytes for e in cu.pending if not e.out.event.done)))
        return guard(self, f, tag)

    ref = train(cfg, sizes=[2] * 4)
    forced(monkeypatch, (Action.KEEP,) * 4)
    monkeypatch.setattr(Adaptive, "guard", at_first_block)
    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    ssd = offload_config(store_dir, host="64MiB", mode="adaptive", device_budget=100_000)
    got = train(cfg, ssd, sizes=[2] * 4, on_step=lambda off: gpu.run())  # the GPU ends each step
    assert_same(ref, got)
    assert got[2].tensors_offloaded > 0
    assert all(inflight == queued for inflight, queued in seen), seen


def test_the_guard_counts_no_copy_that_landed_within_the_forward(store_dir, gpu, monkeypatch):
    # Block 0 offloaded, the rest kept: no later save polls, so copies that landed as block
    # 1 ran stayed counted as held, and the guard recomputed blocks that had room.
    from ssdtier.bench.models import GPTConfig
    from ssdtier.offload.adaptive import Adaptive
    from ssdtier.plan import Action

    from .test_rok import forced

    cfg = GPTConfig(n_layers=4, vocab_size=64, seq_len=16, d_model=32, n_heads=4)
    guard, seen = Adaptive.guard, []

    def at_each_block(self, f, tag):
        if tag > 2:
            cu = self.off.cuda
            seen.append((cu.inflight, sum(e.nbytes for e in cu.pending if not e.out.event.done)))
        return guard(self, f, tag)

    def run_the_gpu(module, args):
        gpu.run()

    ref = train(cfg, sizes=[2] * 3)
    forced(monkeypatch, (Action.OFFLOAD,) + (Action.KEEP,) * 3)
    monkeypatch.setattr(Adaptive, "guard", at_each_block)
    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    ssd = offload_config(store_dir, host="64MiB", mode="adaptive", device_budget=1 << 30)
    build = build_model

    def built(c):  # the fake GPU finishes block 0's copies as block 1 starts
        model = build(c)
        model.blocks[1].register_forward_pre_hook(run_the_gpu)
        return model

    monkeypatch.setattr(sys.modules[train.__module__], "build_model", built)
    got = train(cfg, ssd, sizes=[2] * 3)
    assert_same(ref, got)
    assert got[2].tensors_offloaded > 0 and seen
    assert all(inflight == queued for inflight, queued in seen), seen


def test_an_auto_device_budget_leaves_room_for_the_copies_queued(store_dir, gpu, monkeypatch):
    # The sources of copies still queued are freed, yet their memory is held until copied:
    # the most queued at once in a step is taken off the next step's budget.
    from ssdtier.offload.adaptive import Adaptive
    from ssdtier.offload.budget import AutoBudget, Memory
    from ssdtier.plan import Action

    from .test_rok import forced

    gib = 1 << 30
    init, budget_for = Adaptive.__init__, AutoBudget.next
    budgets = []

    class FakeGpu:  # 50 GiB free, 8 cached, 3 GiB allocated beside the activations held
        def __init__(self, off):
            self.off = off

        def memory(self):
            return Memory(50 * gib, 100 * gib, 8 * gib, 1 * gib, 0)

        def allocated(self):
            return self.off.adaptive.held() + 3 * gib

    def on_a_fake_gpu(self, off):
        init(self, off)
        self.watch.gpu = FakeGpu(off)

    def recorded(self, held, queued, mem, **kw):
        budgets.append((queued, budget_for(self, held, queued, mem, **kw)))
        return budgets[-1][1]

    monkeypatch.setattr(Adaptive, "__init__", on_a_fake_gpu)
    monkeypatch.setattr(AutoBudget, "next", recorded)
    forced(monkeypatch, (Action.OFFLOAD,) * 3)  # with room for all, the plan would keep them
    ref = train(CONFIGS["gpt"], micro=3)
    through_the_cuda_transport(gpu, monkeypatch)
    got = train(CONFIGS["gpt"], offload_config(store_dir, host="64MiB", mode="adaptive", device_budget="auto"), micro=3)
    assert_same(ref, got)
    assert budgets[0] == (0, None)  # the first look: no step seen
    for queued, budget in budgets[1:]:
        assert queued > 0 and budget == (50 + 8 - 5 - 3) * gib - queued, budgets


class Groups:
    """The offloader's native store, recording the groups it is told of."""

    def __init__(self, native) -> None:
        self.native, self.seen = native, []

    def set_group(self, group: int) -> None:
        self.seen.append(group)
        self.native.set_group(group)

    def __getattr__(self, name):
        return getattr(self.native, name)


def pipelined(cfg, ssd=None, micro=4, steps=2, summed=False):
    """Steps of ``micro`` forwards, then their backwards, earliest first (a pipeline schedule's
    warmup, 1F1B), or of the sum of their losses (``summed``: latest first). Returns losses,
    grads, stats and the groups the store was told of."""
    torch.manual_seed(0)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(2)
    batches = [make_batch(cfg, 2, gen) for _ in range(micro)]
    off = ssdtier.attach(model, ssd) if ssd is not None else None
    if off is not None:
        off._native = Groups(off._native)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        losses += [batch_loss(model, b) for b in batches]
        for loss in [sum(losses[-micro:])] if summed else losses[-micro:]:
            loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    stats = groups = None
    if off is not None:
        stats, groups = off.stats(), off._native.seen
        off.detach()
    return [x.detach() for x in losses], grads, stats, groups


@pytest.mark.parametrize("summed", [False, True], ids=["1f1b", "summed"])
@pytest.mark.parametrize("prefetch", [3, "auto"])
def test_forwards_outstanding_are_exact_and_ranked_as_their_backwards_come(
    store_dir, gpu, monkeypatch, prefetch, summed
):
    # Once a backward was seen to come earliest forward first while later ones wait, each
    # forward is a group of the store's, whose lifetime policy then evicts the later forwards'
    # entries first (tests/store.rs checks the order). Latest first is put order: no groups.
    ref = pipelined(CONFIGS["gpt"], summed=summed)
    through_the_cuda_transport(gpu, monkeypatch)
    got = pipelined(CONFIGS["gpt"], offload_config(store_dir, host="512KiB", prefetch_layers=prefetch), summed=summed)
    assert_same(ref[:3], got[:3])
    s, groups = got[2], got[3]
    assert groups == ([0] * 8 if summed else [0, 0, 0, 0, 5, 6, 7, 8])
    assert s.bytes_read_nvme > 0 and s.copied_ahead > 0, s


def test_a_done_copy_unpins_its_slot_whatever_another_streams_copy_does():
    from ssdtier.offload.cuda import Unpins

    compute, prefetch = FakeStream(), FakeStream()
    u = Unpins()
    slow, fast, twice = FakeEvent(blocking=True), FakeEvent(blocking=True), FakeEvent(blocking=True)
    u.add(compute, slow, 1)  # an unpack's copy, behind the compute stream's kernels
    u.add(prefetch, fast, 2)
    u.add(prefetch, twice, 1)  # slot 1 copied again, ahead
    fast.done = twice.done = True
    got = []
    for key in u.done():
        got.append((key, u.holds(key)))
    assert got == [(2, False), (1, True)]  # slot 1 stays pinned: its first copy still runs
    assert u and u.oldest() is slow and u.events() == [slow]
    slow.done = True
    assert list(u.done()) == [1] and not u


def test_adaptive_does_not_count_the_hosts_wait_for_copies_as_a_blocks_time(store_dir, gpu):
    """While the host waits for copies out, the GPU may run dry inside a block: that time
    would make the block look slow, and the plan offload more, so it is left out."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    off = ssdtier.attach(model, offload_config(store_dir, host="1MiB", mode="adaptive"))
    try:
        prof = off.adaptive.profile
        prof.clock.device = torch.device("cpu")  # its GPU path, on the fake streams
        prof.block_enter(1, ())
        gpu.run()  # the block starts on the GPU...
        time.sleep(0.06)
        off.res.held_back += 0.05  # ...while the host waits 50 ms of its 60 ms
        prof.block_exit(1)
        gpu.run()
        t = prof.clock.seconds(prof.spans[0][1])
        assert 0.005 < t < 0.03, t
    finally:
        off.detach()


def test_adaptive_plans_from_a_gpus_second_iteration_not_its_first(store_dir, gpu):
    """The first iteration on a GPU loads kernels and tunes cuBLAS: not planned from."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    off = ssdtier.attach(model, offload_config(store_dir, host="1MiB", mode="adaptive"))
    try:
        ad = off.adaptive
        ad.device = ad.profile.clock.device = torch.device("cpu")  # its GPU path, on the fake streams
        f = off._tls.fwd
        plans = []
        for _ in range(2):
            for tag in (1, 2):
                ad.profile.block_enter(tag, ())
                ad.saved(tag, 1 << 20, True)
                ad.profile.block_exit(tag)
            ad.profile.forward_end()
            for tag in (2, 1):  # its backward (a forward with none is not planned from)
                ad.profile.backward_reached(tag)
            gpu.run()
            ad.replan(f)
            plans.append(ad.plan)
        assert plans[0] is None and plans[1] is not None and ad.warm
    finally:
        off.detach()


@pytest.mark.parametrize("mode", [None, "all"], ids=["auto", "all"])
def test_a_model_moved_to_a_gpu_after_attach_is_told_what_auto_chose(store_dir, gpu, warned, mode):
    cfg = offload_config(store_dir, host="1MiB")
    if mode is None:
        del cfg["policy"]["mode"]
    with ssdtier.attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), cfg) as off:  # on the CPU
        assert off.config.policy.mode == "all"
        e = offload(off.cuda, source(64 << 10, 7))  # the first CUDA tensor
        gpu.run()
        off.cuda.poll()
        let_go(off.cuda, e)
    assert len(warned('so policy.mode "auto" chose "all"')) == (mode is None)


def test_an_unpack_with_the_arena_pinned_by_copies_waits_for_one_not_a_pageable_copy(transport, gpu, monkeypatch):
    """An entry on NVMe only, unpacked while copies back to the GPU pin the arena's slots: it
    waits for the oldest copy to release its slot and reads into the arena, not into pageable
    memory (a copy from pageable memory waits for everything queued on the stream)."""
    z = offload(transport, source(384 << 10, 1))
    gpu.run()
    transport.poll()
    transport.native.evict(z.key)  # on NVMe only
    pinned = [offload(transport, source(384 << 10, v)) for v in (2, 3)]
    gpu.run()
    transport.poll()
    for e in pinned:  # copied back on demand, the copies not run: their slots stay pinned
        transport.restore(e, None)
    assert len(transport.h2d) == 2
    staged = []
    native = transport.native

    class Native:
        def __getattr__(self, name):
            return getattr(native, name)

        def read_staged(self, *a):
            staged.append(a)
            return native.read_staged(*a)

    monkeypatch.setattr(transport, "native", Native())
    st, made = transport.restore(z, None)
    assert not staged and len(transport.h2d) == 2  # one copy done and unpinned, z's added
    gpu.run()
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(st)[: 384 << 10], source(384 << 10, 1))


def test_an_unpack_larger_than_the_arena_waits_for_no_copy_back(transport, gpu, warned):
    """Waiting for copies back cannot make room for more than the arena: it is read from
    NVMe into pageable memory at once, said once."""
    big = offload(transport, source(2 << 20, 5))  # larger than the 1 MiB arena: to NVMe from a buffer of its own
    e = offload(transport, source(64 << 10, 6))
    settle(transport, gpu)
    assert big.out is None  # on NVMe only
    transport.restore(e, None)  # its copy back not run: its slot pinned
    st, _ = transport.restore(big, None)
    assert len(transport.h2d) == 1 and warned("found no room in the host arena to be read back")
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(st), source(2 << 20, 5))


def test_copies_that_lag_hold_the_forward_back_within_the_budget(store_dir, gpu, monkeypatch):
    # The twin of test_within_budget's lagging writes: copies out the GPU had not finished
    # held their sources past the budget (1.65x) while the forward never waited.
    from ssdtier.offload.adaptive import Adaptive
    from ssdtier.offload.stats import Resident
    from ssdtier.plan import Action

    from .test_rok import GPT, adaptive, forced

    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    forced(monkeypatch, (Action.OFFLOAD,) * 4)
    monkeypatch.setattr(Adaptive, "calibrate", lambda self: (1e9, 1e9))
    monkeypatch.setattr(Adaptive, "guard", lambda self, f, tag: None)  # no plan to guard
    budget = 512 << 10
    cfg = adaptive(store_dir, device_budget=budget)
    cfg["host"]["capacity"] = "8MiB"  # the arena's own bound on copies in flight: not first
    held, offs = [0], []
    note, init = Resident.note, offloader.Offloader.__init__

    def noted(res, host_used):  # the device's bytes: the arena is host memory
        note(res, host_used)
        for o in offs:
            if o.res is res:
                held[0] = max(held[0], res.kept + res.sources + res.restored + o.cuda.inflight)

    def made(self, *a, **k):
        init(self, *a, **k)
        offs.append(self)

    monkeypatch.setattr(Resident, "note", noted)
    monkeypatch.setattr(offloader.Offloader, "__init__", made)
    got = train(GPT, cfg, sizes=(4, 4), on_step=lambda off: gpu.run())
    assert_same(train(GPT, sizes=(4, 4)), got)
    largest = 4 * 16 * 128 * 4  # an MLP's hidden activation: the entry read ahead past the room
    assert held[0] <= budget + largest, held
    assert got[2].forward_wait_seconds > 0  # it did wait


@pytest.mark.parametrize("prefetch", ["auto", 2])
def test_reads_ahead_past_the_budget_still_come_from_nvme_into_the_arena(store_dir, gpu, monkeypatch, prefetch):
    # With no room left in the device budget, reads ahead stopped whole, and each entry on
    # NVMe was read at its unpack (82 of 180 with "auto", 154 with 2). Only the copy to the
    # GPU needs the room: the read into the host arena goes ahead.
    from ssdtier.offload.adaptive import Adaptive
    from ssdtier.plan import Action

    from .test_rok import GPT, adaptive, forced

    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    forced(monkeypatch, (Action.OFFLOAD,) * 4)
    monkeypatch.setattr(Adaptive, "calibrate", lambda self: (1e9, 1e9))
    monkeypatch.setattr(Adaptive, "guard", lambda self, f, tag: None)  # no plan to guard
    budget = 1  # no room for anything read ahead, but the entry needed next
    restored, restore = [], offloader.Offloader._restore
    staged, most, stage = set(), [0], cuda.CudaTransport._stage

    def spied(self, e):
        back = e.back
        if e.source() is None and type(back) is not Restored:
            if type(back) is Reading:
                restored.append("host" if back.from_host else "nvme, ahead")
            else:
                restored.append("host" if self._native.location(e.key)[0] else "nvme, now")
        staged.discard(e)
        return restore(self, e)

    def copied_ahead(self, e, r):
        stage(self, e, r)
        if r.staged is not None:
            staged.add(e)
            most[0] = max(most[0], len(staged))

    monkeypatch.setattr(offloader.Offloader, "_restore", spied)
    monkeypatch.setattr(cuda.CudaTransport, "_stage", copied_ahead)
    cfg = adaptive(store_dir, device_budget=budget, prefetch_layers=prefetch)
    got = train(GPT, cfg, sizes=(4, 4), on_step=lambda off: gpu.run())
    assert_same(train(GPT, sizes=(4, 4)), got)
    assert "nvme, now" not in restored and "nvme, ahead" in restored, collections.Counter(restored)
    assert most[0] <= 2, most  # copied to the GPU ahead: the entry being unpacked and the next
