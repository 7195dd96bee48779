"""reusing_stores(): a detached offloader's store (its arena mapped, registered, pinned) serves
the next attach with the same store settings, from zero counters; anything else closes it."""

from __future__ import annotations

import warnings

import torch

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch
from ssdtier.offload import offloader, shelf
from ssdtier.store import ByteStore

from .test_attach import TINY, assert_same, offload_config, store_config, train
from .test_cuda_transport import gpu  # noqa: F401 - a fixture

GPT = GPTConfig(n_layers=2, **TINY)


def stores_seen(monkeypatch) -> list:
    """Each attach's store, as it attaches."""
    seen = []
    init = offloader.Offloader.__init__

    def record(self, model, config):
        init(self, model, config)
        seen.append(self.store)

    monkeypatch.setattr(offloader.Offloader, "__init__", record)
    return seen


def test_the_next_attach_takes_the_detached_store_and_trains_exactly(store_dir, monkeypatch):
    seen = stores_seen(monkeypatch)
    ref = train(GPT)
    cfg = offload_config(store_dir)
    with ssdtier.reusing_stores():
        first = train(GPT, cfg)
        second = train(GPT, cfg)
        assert seen[0] is seen[1] and not seen[0].closed  # shelved, open
    assert seen[0].closed  # the context closed it
    assert_same(ref, first)
    assert_same(ref, second)
    # The second attach's counters are its own: the same traffic as the first's.
    a, b = first[2].store, second[2].store
    assert 0.9 * a.nvme_bytes_written <= b.nvme_bytes_written <= 1.1 * a.nvme_bytes_written  # not both
    assert b.nvme_bytes_written > 0 and b.entries == 0


def test_other_store_settings_or_no_context_close_the_store(store_dir, monkeypatch):
    seen = stores_seen(monkeypatch)
    train(GPT, offload_config(store_dir))
    assert seen[0].closed  # outside reusing_stores(): as always
    with ssdtier.reusing_stores():
        train(GPT, offload_config(store_dir))
        train(GPT, offload_config(store_dir, host="128KiB"))  # another arena: a store of its own
        assert seen[1] is not seen[2] and seen[1].closed and not seen[2].closed
        # Another policy is the same store.
        train(GPT, offload_config(store_dir, host="128KiB", min_tensor_bytes=1024))
        assert seen[3] is seen[2]
    assert seen[2].closed


def test_a_store_holding_an_entry_is_not_shelved(store_dir):
    store = ByteStore(store_config(store_dir))
    data = torch.arange(1000, dtype=torch.int64)
    key = store.native.put_from(data.data_ptr(), data.nbytes, data)
    assert not shelf.put(store, None)  # no reusing_stores(): nothing is shelved
    with ssdtier.reusing_stores():
        assert not shelf.put(store, None)  # an entry is still in it
        store.native.free(key)
        assert shelf.put(store, None)
    assert store.closed
    store.close()


def test_the_pinned_arena_goes_with_the_store(store_dir, gpu, monkeypatch):  # noqa: F811
    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    cfg = offload_config(store_dir, host="1MiB", zero_copy=False)
    ref = train(GPT)
    with ssdtier.reusing_stores():
        first = train(GPT, cfg)
        second = train(GPT, cfg)
        assert [p for p, _ in gpu.pinned_on] == ["register"], gpu.pinned_on  # pinned once, for both
        assert len(gpu.registered) == 1
    assert [p for p, _ in gpu.pinned_on] == ["register", "unregister"] and not gpu.registered
    assert_same(ref, first)
    assert_same(ref, second)
    assert second[2].bytes_offloaded == first[2].bytes_offloaded > 0  # through the arena pinned once


def test_the_shelved_arena_counts_as_memory_the_next_attach_can_pin(store_dir, gpu, monkeypatch):  # noqa: F811
    # 8 MiB fit in what is left at the first attach; pinned, it leaves too little for another,
    # yet the next attach takes that very arena: not cut, not warned of.
    from ssdtier.ram import Available

    mib = 1 << 20
    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    left = {"bytes": (2 << 30) + 10 * mib}
    monkeypatch.setattr(offloader, "available", lambda: Available(left["bytes"], "MemAvailable"))
    seen = stores_seen(monkeypatch)
    cfg = offload_config(store_dir, host="8MiB", zero_copy=False)
    with ssdtier.reusing_stores(), warnings.catch_warnings():
        warnings.simplefilter("error")
        train(GPT, cfg)
        left["bytes"] -= 8 * mib  # the arena, pinned
        train(GPT, cfg)
        assert seen[0] is seen[1] and seen[1].config.host.capacity == 8 * mib


def test_a_fork_child_never_takes_the_parents_store(store_dir):
    import multiprocessing

    with ssdtier.reusing_stores():
        train(GPT, offload_config(store_dir))
        assert shelf._shelf is not None
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=lambda: q.put((shelf._shelf is None, shelf.wanted())))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
    assert got == (True, False)


def test_an_attach_that_fails_leaves_no_store_open_nor_takes_the_shelved_one(store_dir, gpu, monkeypatch):  # noqa: F811
    import pytest

    from ssdtier.errors import ConfigError
    from ssdtier.offload import readahead

    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    seen = stores_seen(monkeypatch)
    cfg = offload_config(store_dir, host="1MiB", zero_copy=False)
    with ssdtier.reusing_stores():
        train(GPT, cfg)
        shelved = shelf._shelf
        # Bad settings fail before a store is taken: the shelved one waits, still pinned.
        with pytest.raises(ConfigError):
            ssdtier.attach(build_model(GPT), {**cfg, "policy": {**cfg["policy"], "layers": "nope"}})
        assert shelf._shelf is shelved and len(gpu.registered) == 1
        # A failure after it took the store closes it, the arena unregistered first.
        monkeypatch.setattr(readahead.ReadAhead, "__init__", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            ssdtier.attach(build_model(GPT), cfg)
        assert shelf._shelf is None and shelved.store.closed and not gpu.registered
    assert seen == [shelved.store]


def test_a_store_is_shelved_once_when_both_a_detach_and_a_release_ask(store_dir):
    # A graph outlives detach(): its last release closes the store. Asked again (a detach
    # racing that release on another thread), the store on the shelf stays open.
    torch.manual_seed(0)
    model = build_model(GPT)
    with ssdtier.reusing_stores():
        off = ssdtier.attach(model, offload_config(store_dir))
        loss = batch_loss(model, make_batch(GPT, 2, torch.Generator().manual_seed(1)))
        assert off.entries.live
        off.detach()
        assert shelf._shelf is None  # the graph holds entries
        del loss
        assert shelf._shelf is not None and shelf._shelf.store is off.store
        with off._lock:
            off._close_store()
        assert shelf._shelf.store is off.store and not off.store.closed


def test_a_fork_child_leaving_its_parents_context_closes_nothing(store_dir):
    import os

    with ssdtier.reusing_stores():
        train(GPT, offload_config(store_dir))
        r, w = os.pipe()
        pid = os.fork()
    if pid == 0:  # the child, past the context it inherited
        os.write(w, str(shelf._depth).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"0"
    os.close(r)
    os.close(w)


def test_an_arena_whose_pinning_failed_is_pinned_again_by_the_next_attach(store_dir, gpu, monkeypatch):  # noqa: F811
    import pytest

    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    real = torch.cuda.cudart()
    fails = iter([True])

    class Flaky:  # the first registration fails (cudaErrorMemoryAllocation)
        def cudaHostRegister(self, ptr, n, flags):
            return 2 if next(fails, False) else real.cudaHostRegister(ptr, n, flags)

        def cudaHostUnregister(self, ptr):
            return real.cudaHostUnregister(ptr)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Flaky())
    cfg = offload_config(store_dir, host="1MiB", zero_copy=False)
    seen = stores_seen(monkeypatch)
    with ssdtier.reusing_stores():
        with pytest.warns(UserWarning, match="cudaHostRegister of the host arena failed"):
            train(GPT, cfg)
        train(GPT, cfg)
        assert seen[0] is seen[1] and len(gpu.registered) == 1  # the same store, pinned this time
    assert not gpu.registered


def test_two_threads_detaching_at_once_close_the_store_once(store_dir, monkeypatch):
    import threading

    class Gate:  # the offloader's lock, let through only once both threads wait at it
        def __init__(self) -> None:
            self.arrived, self.cv, self.inner = 0, threading.Condition(), threading.RLock()

        def __enter__(self) -> None:
            with self.cv:
                self.arrived += 1
                self.cv.notify_all()
                self.cv.wait_for(lambda: self.arrived >= 2, timeout=60)
            self.inner.acquire()

        def __exit__(self, *exc: object) -> None:
            self.inner.release()

    closes = []
    close = offloader.Offloader._close_store
    monkeypatch.setattr(offloader.Offloader, "_close_store", lambda self: closes.append(1) or close(self))
    off = ssdtier.attach(build_model(GPT), offload_config(store_dir))
    off._lock = Gate()
    threads = [threading.Thread(target=off.detach) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert off._lock.arrived >= 2 and closes == [1] and off.store.closed
