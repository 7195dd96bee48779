"""The adaptive planner on synthetic timings (no I/O, no timing of our own)."""

from __future__ import annotations

from ssdtier.plan import HostTier, LayerProfile, make_plan

MB = 1_000_000


def uniform(n=8, bytes_=100 * MB, fwd=0.1):
    return [LayerProfile(i, bytes_, fwd, 2 * fwd) for i in range(n)]


def test_fast_disk_offloads_all_but_the_last():
    # 100 MB per 0.1 s layer = 1 GB/s of writes needed; the disk does 5 GB/s.
    p = make_plan(uniform(), 5e9, 5e9)
    assert p.stall_free
    assert p.keep_last == 1
    assert [d.offload for d in p.layers] == [True] * 7 + [False]


def test_slow_disk_gets_fewer_layers_offloaded():
    fast = make_plan(uniform(), 5e9, 5e9)
    slow = make_plan(uniform(), 0.4e9, 0.4e9)
    slower = make_plan(uniform(), 0.1e9, 0.1e9)
    # 0.4 GB/s: one writer at 0.25 s per layer, each starting with its layer's saves,
    # finishes three layers (at 0.75 s) inside a 0.8 s forward.
    assert (fast.keep_last, slow.keep_last) == (1, 5)
    assert slow.stall_free
    # At 100 MB/s not even one layer's write (1 s) fits in a 0.8 s forward.
    assert slower.keep_last == 8 and "too slow" in slower.reason


def test_device_budget_is_respected():
    layers = uniform()
    p = make_plan(layers, 0.1e9, 0.1e9, device_budget=250 * MB)
    kept = sum(d.bytes for d in p.layers if not d.offload)
    assert kept <= 250 * MB and p.keep_last == 2
    assert not p.stall_free and "budget" in p.reason
    # A budget that allows what the disk needs changes nothing.
    assert make_plan(layers, 5e9, 5e9, device_budget=10**12).keep_last == 1
    # Zero budget: everything offloaded.
    assert make_plan(layers, 5e9, 5e9, device_budget=0).keep_last == 0


def test_min_keep_after_stalls():
    p = make_plan(uniform(), 5e9, 5e9, min_keep=3)
    assert p.keep_last == 3 and p.stall_free


def test_reads_decide_when_writes_fit():
    # Writes are fast; reads slow: the first layers (read last) have time, the last do not.
    # 0.4 GB/s: 0.25 s to read a layer against 0.2 s of backward per layer.
    p = make_plan(uniform(), 50e9, 0.4e9)
    assert p.stall_free and p.keep_last == 3
    assert "keep the last" in p.table()


def test_a_host_tier_that_holds_everything_offloads_everything():
    # 800 MB saved; an arena of 2 GB never spills, so even a 100 MB/s disk hides it all,
    # where straight to NVMe it would keep every layer.
    p = make_plan(uniform(), 0.1e9, 0.1e9, host=HostTier(2000 * MB, None))
    assert p.stall_free and p.keep_last == 0 and p.spill_bytes == 0
    assert make_plan(uniform(), 0.1e9, 0.1e9).keep_last == 8
    assert "host tier" in p.table() and "nothing to NVMe" in p.table()


def test_the_host_tier_spills_the_first_layers_saved():
    # Arena 400 MB: the store writes out what passes 300 MB (three quarters). Those are the
    # first layers' bytes, read last, so a disk that keeps 5 layers straight (0.4 GB/s)
    # keeps 4 here, with one layer's bytes spilled.
    host = HostTier(400 * MB, None)
    p = make_plan(uniform(), 0.4e9, 0.4e9, host=host)
    assert p.stall_free and p.keep_last == 4 and p.spill_bytes == 100 * MB
    # A fast disk takes the overflow: everything offloaded, 500 of the 800 MB spilled.
    fast = make_plan(uniform(), 5e9, 5e9, host=host)
    assert fast.keep_last == 0 and fast.spill_bytes == 500 * MB


def test_slow_copies_to_the_host_tier_keep_layers():
    # 100 MB per 0.1 s layer needs 1 GB/s of copies; at 0.5 GB/s three layers' copies end by
    # 0.7 s, inside the 0.8 s forward, whatever the disk.
    host = HostTier(2000 * MB, 0.5e9)
    for bw in (5e9, 0.1e9):
        p = make_plan(uniform(), bw, bw, host=host)
        assert p.stall_free and p.keep_last == 5 and p.copy_finish_s <= p.forward_s
    # Fast copies: only the last layer is kept, since copying it back takes time too.
    assert make_plan(uniform(), 5e9, 5e9, host=HostTier(2000 * MB, 20e9)).keep_last == 1


def test_a_small_arena_waits_for_the_disk():
    # Once 100 MB arrive per 0.1 s layer into a 100 MB arena, the disk must take 1 GB/s:
    # at 0.4 GB/s only the first layer (25 MB of it spilled) goes.
    p = make_plan(uniform(), 0.4e9, 0.4e9, host=HostTier(100 * MB, None))
    assert p.stall_free and p.keep_last == 7 and p.spill_bytes == 25 * MB


def test_late_reads_mark_the_layers_read_last():
    # Two layers may be kept (budget); reads take 0.33 s a layer against 0.2 s of backward
    # each: layer 5 is back in time, layer 4 and all read after it are late.
    p = make_plan(uniform(), 50e9, 0.3e9, device_budget=200 * MB)
    assert not p.stall_free and p.keep_last == 2
    stalls = [d.index for d in p.layers if d.reason == "offloaded by budget: its I/O may stall"]
    assert stalls == [0, 1, 2, 3, 4]
