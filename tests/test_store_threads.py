"""Threads racing one TieredStore with a tiny arena, every byte checked; close() with
transfers in flight; the store usable after every recoverable error; Ctrl-C in a wait.

The throttle only widens race windows, and joins with a timeout only catch hangs: no outcome
depends on how threads happen to interleave."""

from __future__ import annotations

import mmap
import os
import random
import signal
import threading
import time
import traceback

import pytest
import torch

from ssdtier import (
    EntryBusyError,
    InvalidUseError,
    OutOfSpaceError,
    StoreClosedError,
    TieredStore,
    UnknownKeyError,
)
from ssdtier._native import ALIGN

from .conftest import store_config
from .test_store import BACKENDS, DTYPES, random_tensor, same

ARENA = 512 << 10
THREADS = 5
STEPS = 120
# A hung thread fails the test instead of hanging the run.
JOIN_TIMEOUT = 120


def _aligned(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of whole pages (O_DIRECT moves them) starting on a page boundary."""
    n = -(-nbytes // ALIGN) * ALIGN
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    pad = -raw.data_ptr() % ALIGN
    return raw[pad : pad + n]  # the view keeps raw's storage alive


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random_entry(rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    """Any dtype; 0 bytes to several arenas; flat, 2-d, 0-d, or a transposed (non-contiguous) view."""
    nbytes = rng.choice([0, rng.randrange(1, ALIGN), rng.randrange(ALIGN, ARENA // 2), rng.randrange(ARENA, 4 * ARENA)])
    t = random_tensor(nbytes, rng.choice(DTYPES), gen)
    n = t.numel()
    if n == 1 and rng.random() < 0.5:
        return t.reshape(())
    cols = [c for c in (2, 3, 8, 16) if n % c == 0]
    if cols and rng.random() < 0.6:
        t = t.reshape(-1, rng.choice(cols))
        if rng.random() < 0.5:
            t = t.t()  # stored through reserve/commit, or staged when bigger than the arena
    return t


class _Done:
    """The ticket of a write that has finished."""

    def wait(self) -> None:
        pass


def _run_threads(targets: list) -> None:
    threads = [threading.Thread(target=f, name=f"racer-{i}") for i, f in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not [t.name for t in threads if t.is_alive()], "threads still running: a deadlock?"


class _Racer:
    """One thread's seeded op sequence over its private keys and the keys all threads share."""

    def __init__(self, store: TieredStore, seed: int, tid: int, shared: dict[int, torch.Tensor]):
        self.store, self.seed, self.tid, self.shared = store, seed, tid, shared
        self.mine: dict[int, torch.Tensor] = {}
        # key -> (write ticket, the bytes written); the buffer itself lives only in the ticket.
        self.zero_copy: dict[int, tuple[object, torch.Tensor]] = {}
        self.failure: str | None = None
        self.busy = 0

    def __call__(self) -> None:
        where = "start"
        try:
            rng = random.Random(self.seed * 1000 + self.tid)
            gen = torch.Generator().manual_seed(self.seed * 1000 + self.tid)
            for step in range(STEPS):
                op = rng.choices(list(self.OPS), weights=list(self.OPS.values()))[0]
                where = f"step {step} op {op}"
                getattr(self, op)(rng, gen)
            where = "cleanup"
            self.cleanup()
        except BaseException:
            self.failure = f"seed {self.seed} thread {self.tid} {where}:\n{traceback.format_exc()}"

    OPS = {
        "put": 4,
        "get": 4,
        "evict": 2,
        "prefetch": 2,
        "free": 2,
        "zc_write": 1,
        "zc_read": 1,
        "zc_free": 1,
        "ext_write": 1,
        "ext_read": 1,
        "shared_get": 3,
        "shared_prefetch": 1,
        "shared_evict": 2,
        "shared_hold": 2,
    }

    def put(self, rng, gen):
        if len(self.mine) < 8:
            t = _random_entry(rng, gen)
            self.mine[self.store.put(t)] = t

    def get(self, rng, gen):
        if self.mine:
            k = rng.choice(list(self.mine))
            assert same(self.store.get(k), self.mine[k]), f"private key {k}"

    def evict(self, rng, gen):
        if self.mine:
            self.store.evict(rng.choice(list(self.mine)))

    def prefetch(self, rng, gen):
        if self.mine:
            ticket = self.store.prefetch(rng.choice(list(self.mine)))
            if rng.random() < 0.5:
                ticket.wait()

    def free(self, rng, gen):
        if self.mine:
            k = rng.choice(list(self.mine))
            self.store.free(k)
            del self.mine[k]

    def zc_write(self, rng, gen):
        nbytes = rng.choice([0, rng.randrange(1, 3 * ARENA)])
        buf = _aligned(nbytes)
        buf[:nbytes] = random_tensor(nbytes, torch.uint8, gen)
        want = buf[:nbytes].clone()
        key, ticket = self.store._native.write_from(buf.data_ptr(), nbytes, buf)
        # Dropped at once: only the ticket keeps the buffer alive until the write is done.
        del buf
        self.zero_copy[key] = (ticket, want)

    def zc_read(self, rng, gen):
        if self.zero_copy:
            k = rng.choice(list(self.zero_copy))
            want = self.zero_copy[k][1]
            out = _aligned(want.numel())
            ticket = self.store._native.read_into(k, out.data_ptr(), out.numel(), out)
            if ticket is not None:  # None: copied from the arena at once
                ticket.wait()
            assert torch.equal(out[: want.numel()], want), f"zero-copy key {k}"

    def ext_write(self, rng, gen):
        # As a cuFile transport writes: the store gives extents of its files, the bytes go in
        # from outside it (pwrite here), then end_external.
        nbytes = rng.randrange(ARENA + 1, 3 * ARENA)
        want = random_tensor(nbytes, torch.uint8, gen)
        native = self.store._native
        key, slot = native.reserve(nbytes)
        assert slot is None
        raw = want.numpy().tobytes()
        (fd,) = native.device_fds
        for _, file_off, entry_off, n in native.begin_external_write(key):
            buf = mmap.mmap(-1, n)
            buf[: min(n, nbytes - entry_off)] = raw[entry_off : entry_off + n]
            assert os.pwrite(fd, buf, file_off) == n
        native.end_external(key)
        self.zero_copy[key] = (_Done(), want)

    def ext_read(self, rng, gen):
        if not self.zero_copy:
            return
        k = rng.choice(list(self.zero_copy))
        want = self.zero_copy[k][1]
        native = self.store._native
        try:
            extents = native.begin_external_read(k)
        except InvalidUseError as e:
            assert want.numel() == 0 and "not on NVMe only" in str(e), e  # an empty entry has no extents
            return
        got = bytearray(want.numel())
        try:
            (fd,) = native.device_fds
            for _, file_off, entry_off, n in extents:
                buf = mmap.mmap(-1, n)
                assert os.preadv(fd, [buf], file_off) == n
                got[entry_off : entry_off + n] = buf[: min(n, want.numel() - entry_off)]
        finally:
            native.end_external(k)
        assert bytes(got) == want.numpy().tobytes(), f"external read of key {k}"

    def zc_free(self, rng, gen):
        if self.zero_copy:
            k = rng.choice(list(self.zero_copy))
            self.store._native.free(k)
            del self.zero_copy[k]

    def shared_get(self, rng, gen):
        k = rng.choice(list(self.shared))
        assert same(self.store.get(k), self.shared[k]), f"shared key {k}"

    def shared_prefetch(self, rng, gen):
        self.store.prefetch(rng.choice(list(self.shared)))

    def shared_evict(self, rng, gen):
        try:
            self.store.evict(rng.choice(list(self.shared)))
        except EntryBusyError as e:
            # The one race allowed: another thread's get holds the entry (acquire or staged read).
            assert "is acquired" in str(e), e
            self.busy += 1

    def shared_hold(self, rng, gen):
        # Pin the entry in the arena and read it there, as the offloader does; other threads'
        # evicts meanwhile are refused as busy.
        k = rng.choice(list(self.shared))
        off = self.store._native.acquire(k)
        if off is None:  # no bytes, or no slot to be had now
            return
        try:
            want = _bytes(self.shared[k])
            assert torch.equal(self.store.arena[off : off + want.numel()], want), f"shared key {k} in its slot"
            time.sleep(0)  # let others run while it is held
        finally:
            self.store._native.release(k)

    def cleanup(self):
        for k in list(self.mine):
            self.store.free(k)
        for k, (ticket, _) in self.zero_copy.items():
            ticket.wait()
            self.store._native.free(k)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_race_one_store_and_every_byte_survives(store_dir, backend, seed):
    # A 512 KiB arena and entries up to 2 MiB: evictions, staged transfers and waits on the
    # arena all the time; the throttle keeps transfers in flight while other threads act.
    cfg = store_config(store_dir, host="512KiB", backend=backend, throttle="64MB")
    with TieredStore(cfg) as store:
        gen = torch.Generator().manual_seed(seed)
        shared = {}
        small = [(0, torch.float32), (100, torch.int8), (ARENA // 4, torch.float16), (ARENA // 2, torch.bool)]
        for nbytes, dtype in small:
            t = random_tensor(nbytes, dtype, gen)
            shared[store.put(t)] = t
        for nbytes in (2 * ARENA, 3 * ARENA + 5):  # bigger than the arena: always streamed
            t = random_tensor(nbytes, torch.float64, gen)
            shared[store.put(t)] = t
        racers = [_Racer(store, seed, tid, shared) for tid in range(THREADS)]
        _run_threads(racers)
        failures = [r.failure for r in racers if r.failure]
        assert not failures, "\n".join(failures)
        for k, t in shared.items():
            assert same(store.get(k), t)
            store.free(k)
        store.flush()
        st = store.stats()
        assert (st.entries, st.host_used, st.nvme_used) == (0, 0, 0), st
        assert len(store) == 0
        # The race covered what it is meant to: evictions, streams past the arena, zero copy.
        assert st.evictions > 0 and st.staged_puts > 0 and st.staged_gets > 0 and st.zero_copy_puts > 0, st


class _InFlight:
    """Zero-copy writes, zero-copy reads and prefetches started on a throttled store, and the
    bytes each read must land."""

    def __init__(self, store: TieredStore, gen: torch.Generator):
        self.store, self.native = store, store._native
        self.on_disk: dict[int, torch.Tensor] = {}
        for i in range(8):
            t = random_tensor(300_000 + i, torch.uint8, gen)
            k = store.put(t)
            store.evict(k)
            self.on_disk[k] = t
        self.tickets: list = []
        self.reads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (landed, expected)
        self.lock = threading.Lock()
        for i in range(8):
            n = 200_000 + 7 * i
            buf = _aligned(n)
            buf[:n] = random_tensor(n, torch.uint8, gen)
            self.tickets.append(self.native.write_from(buf.data_ptr(), n, buf)[1])
            del buf  # the ticket holds it
        for i, k in enumerate(self.on_disk):
            self.prefetch(k) if i % 2 else self.read(k)

    def read(self, k: int) -> None:
        want = self.on_disk[k]
        out = _aligned(want.numel())
        ticket = self.native.read_into(k, out.data_ptr(), out.numel(), out)
        with self.lock:
            if ticket is not None:
                self.tickets.append(ticket)
            self.reads.append((out[: want.numel()], want))

    def prefetch(self, k: int) -> None:
        ticket = self.store.prefetch(k) if len(self.tickets) % 2 else self.native.prefetch(k)
        with self.lock:
            self.tickets.append(ticket)

    def write(self, nbytes: int) -> None:
        buf = _aligned(nbytes)
        ticket = self.native.write_from(buf.data_ptr(), nbytes, buf)[1]
        with self.lock:
            self.tickets.append(ticket)

    def one_more(self, rng: random.Random) -> None:
        """Start one more transfer, or use the store through its Python API."""
        k = rng.choice(list(self.on_disk))
        op = rng.randrange(5)
        if op == 0:
            self.write(rng.randrange(1, 100_000))
        elif op == 1:
            self.read(k)
        elif op == 2:
            self.prefetch(k)
        elif op == 3:
            assert same(self.store.get(k), self.on_disk[k])
        else:
            self.store.free(self.store.put(self.on_disk[k]))

    def check_landed(self) -> None:
        """Every ticket done, each one succeeded (close waits for them), every read exact."""
        assert all(t.done() for t in self.tickets)
        for t in self.tickets:
            t.wait()
        for got, want in self.reads:
            assert torch.equal(got, want)


def _check_closed(store: TieredStore, k: int) -> None:
    with pytest.raises(StoreClosedError):
        store.put(torch.ones(3))
    for call in (store.get, store.prefetch, store.evict, store.free, store.location):
        with pytest.raises(StoreClosedError):
            call(k)
    with pytest.raises(StoreClosedError):
        store.flush()
    native, buf = store._native, _aligned(ALIGN)
    for call in (
        lambda: native.write_from(buf.data_ptr(), ALIGN, buf),
        lambda: native.read_into(k, buf.data_ptr(), buf.numel(), buf),
        lambda: native.put_from(buf.data_ptr(), ALIGN, buf),
        lambda: native.prefetch(k),
        lambda: native.acquire(k),
        lambda: native.evict(k),
    ):
        with pytest.raises(StoreClosedError):
            call()
    store.close()  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_from_another_thread_with_transfers_in_flight(store_dir, backend):
    # Throttled so that transfers are still in flight when close() starts.
    store = TieredStore(store_config(store_dir, host="1MiB", backend=backend, throttle="32MB"))
    work = _InFlight(store, torch.Generator().manual_seed(3))
    failures: list[str] = []

    def racer(seed: int) -> None:
        # A few more transfers and calls racing close(): each one either works or is told
        # that the store is closed.
        rng = random.Random(seed)
        try:
            for _ in range(30):
                work.one_more(rng)
        except StoreClosedError:
            pass
        except BaseException:
            failures.append(f"racer {seed}:\n{traceback.format_exc()}")

    _run_threads([lambda: racer(1), lambda: racer(2), store.close])
    assert not failures, "\n".join(failures)
    work.check_landed()
    _check_closed(store, next(iter(work.on_disk)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_returns_while_other_threads_keep_starting_transfers(store_dir, backend):
    store = TieredStore(store_config(store_dir, host="1MiB", backend=backend, throttle="32MB"))
    work = _InFlight(store, torch.Generator().manual_seed(4))
    stop = threading.Event()
    failures: list[str] = []

    def racer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                # Faster than the throttled device drains them: writes are always queued.
                work.write(rng.randrange(1, 100_000))
        except StoreClosedError:
            pass
        except BaseException:
            failures.append(f"racer {seed}:\n{traceback.format_exc()}")

    racers = [threading.Thread(target=racer, args=(i,)) for i in range(2)]
    for t in racers:
        t.start()
    closer = threading.Thread(target=store.close)
    closer.start()
    # Not a timing assertion: a close that drains what was in flight takes well under a
    # second here; one that waits for the racers to stop never returns while they run.
    closer.join(10)
    held_up = closer.is_alive()
    stop.set()
    for t in [*racers, closer]:
        t.join(JOIN_TIMEOUT)
    assert not held_up, "close() waited for the threads that keep using the store to stop"
    assert not failures, "\n".join(failures)
    work.check_landed()
    _check_closed(store, next(iter(work.on_disk)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_get_racing_close_returns_its_bytes_or_store_closed(store_dir, backend):
    # At 1 MB/s the get's read of 256 KiB lands well before a 1 MiB write queued behind it,
    # which close() flushes first: the get finishes while close() is under way.
    store = TieredStore(store_config(store_dir, host="1MiB", backend=backend, throttle="1MB"))
    t = random_tensor(256 << 10, torch.uint8, torch.Generator().manual_seed(5))
    k = store.put(t)
    store.evict(k)
    outcome: list = []

    def getter() -> None:
        try:
            outcome.append(store.get(k))
        except StoreClosedError:
            outcome.append("closed")
        except BaseException:
            outcome.append(traceback.format_exc())

    thread = threading.Thread(target=getter)
    thread.start()
    while thread.is_alive() and store._native.location(k) != (True, True):  # its read has started
        time.sleep(0.001)
    buf = _aligned(1 << 20)
    store._native.write_from(buf.data_ptr(), 1 << 20, buf)
    store.close()
    thread.join(JOIN_TIMEOUT)
    assert len(outcome) == 1
    if isinstance(outcome[0], str) and outcome[0] != "closed":
        pytest.fail(f"a get racing close() raised:\n{outcome[0]}")
    assert outcome[0] == "closed" or same(outcome[0], t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_store_works_after_every_recoverable_error(store_dir, backend):
    gen = torch.Generator().manual_seed(6)
    # 256 KiB of arena and 1 MiB of NVMe: a few entries fill both.
    with TieredStore(store_config(store_dir, host="256KiB", nvme="1MiB", backend=backend)) as store:
        native = store._native
        kept: dict[int, torch.Tensor] = {}

        def still_works() -> None:
            """Every kept entry intact, nothing left behind, and a new entry round trips."""
            for k, t in kept.items():
                assert same(store.get(k), t), k
            st = store.stats()
            assert st.entries == len(kept) and st.failure is None
            t = random_tensor(5000, torch.float32, gen)
            k = store.put(t)
            assert same(store.get(k), t)
            store.free(k)

        # Full: a put, a put through reserve and staging, and a zero-copy write all say so.
        with pytest.raises(OutOfSpaceError):
            for _ in range(100):
                t = random_tensor(128 << 10, torch.int16, gen)
                kept[store.put(t)] = t
        assert len(kept) > 4
        with pytest.raises(OutOfSpaceError):
            store.put(random_tensor(1 << 20, torch.uint8, gen).reshape(1024, 1024).t())
        buf = _aligned(512 << 10)
        with pytest.raises(OutOfSpaceError):
            native.write_from(buf.data_ptr(), 512 << 10, buf)
        assert store.stats().entries == len(kept)
        # Freeing makes room: puts work again, with exact bytes.
        for k in list(kept)[:3]:
            store.free(k)
            del kept[k]
        still_works()

        # Busy: an entry acquired, or still being filled, cannot be evicted or freed.
        k = next(k for k in kept if store.location(k)[0])
        off = native.acquire(k)
        assert off is not None
        for call in (store.evict, store.free):
            with pytest.raises(EntryBusyError, match="acquired"):
                call(k)
        native.release(k)
        store.evict(k)
        still_works()
        filling, off = native.reserve(1000)
        assert off is not None
        for call in (native.evict, native.acquire):
            with pytest.raises(EntryBusyError, match="being filled"):
                call(filling)
        native.free(filling)
        still_works()

        # Misuse: an unknown key, a misaligned buffer, a release without an acquire.
        with pytest.raises(UnknownKeyError):
            store.get(123_456_789)
        with pytest.raises(InvalidUseError, match="aligned"):
            native.write_from(buf.data_ptr() + 1, 100, buf)
        with pytest.raises(InvalidUseError, match="not acquired"):
            native.release(k)
        with pytest.raises(TypeError):
            store.put([1, 2, 3])
        still_works()

        for k in list(kept):
            store.free(k)
        st = store.stats()
        assert (st.entries, st.host_used, st.nvme_used) == (0, 0, 0), st


@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_interrupts_a_wait_and_the_store_still_closes(store_dir, backend):
    # 1 MiB at 512 KiB/s: after its first block the write takes 1.5 s (reads are throttled too).
    store = TieredStore(store_config(store_dir, host="1MiB", backend=backend, throttle="512KiB"))
    native = store._native
    buf = _aligned(1 << 20)
    buf[:] = random_tensor(1 << 20, torch.uint8, torch.Generator().manual_seed(8))
    want = buf.clone()
    key, ticket = native.write_from(buf.data_ptr(), 1 << 20, buf)
    del buf
    waiting = threading.Event()

    def ctrl_c() -> None:
        waiting.wait()
        time.sleep(0.2)  # inside wait() by now
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Thread(target=ctrl_c)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            waiting.set()
            ticket.wait()
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not ticket.done()  # the wait was cut short, not the write (it has over 1 s to go)
    # The write goes on, holding its buffer: its bytes land, and the store closes.
    out = _aligned(1 << 20)
    native.read_into(key, out.data_ptr(), out.numel(), out).wait()  # from NVMe: a ticket
    assert ticket.done() and torch.equal(out, want)
    ticket.wait()
    store.close()
