"""The adaptive planner on synthetic timings (no I/O, no timing of our own)."""

from __future__ import annotations

from ssdtier.plan import LayerProfile, make_plan

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
    # 0.4 GB/s: one writer at 0.25 s per layer finishes two layers inside a 0.8 s forward.
    assert (fast.keep_last, slow.keep_last) == (1, 6)
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
