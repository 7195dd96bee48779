"""The adaptive planner on synthetic timings (no I/O, no timing of our own)."""

from __future__ import annotations

import random

from ssdtier.plan import HostTier, LayerProfile, _run, make_plan

MB = 1_000_000


def uniform(n=8, bytes_=100 * MB, fwd=0.1):
    return [LayerProfile(i, bytes_, fwd, 2 * fwd) for i in range(n)]


def test_fast_disk_offloads_everything():
    # 100 MB per 0.1 s layer = 1 GB/s of writes needed; the disk does 5 GB/s. The last layer's
    # bytes are needed through its 0.2 s backward and read in 0.02 s.
    p = make_plan(uniform(), 5e9, 5e9)
    assert p.stall_free and p.keep_last == 0
    assert all(d.offload for d in p.layers)


def test_slow_disk_gets_fewer_layers_offloaded():
    slow = make_plan(uniform(), 0.4e9, 0.4e9)
    slower = make_plan(uniform(), 0.1e9, 0.1e9)
    # 0.4 GB/s: one writer at 0.25 s per layer, each starting with its layer's saves,
    # finishes three layers (at 0.75 s) inside a 0.8 s forward.
    assert slow.stall_free and slow.keep_last == 5
    assert [d.offload for d in slow.layers] == [True] * 3 + [False] * 5
    # At 100 MB/s not even one layer's write (1 s) fits in a 0.8 s forward.
    assert slower.keep_last == 8 and "too slow" in slower.reason
    assert all(d.reason == "kept: I/O cannot be hidden" for d in slower.layers)


def test_device_budget_is_respected():
    layers = uniform()
    p = make_plan(layers, 0.1e9, 0.1e9, device_budget=250 * MB)
    kept = sum(d.bytes for d in p.layers if not d.offload)
    assert kept <= 250 * MB and p.keep_last == 2
    assert not p.stall_free and "budget" in p.reason
    # A budget that allows what the disk needs changes nothing.
    assert make_plan(layers, 0.4e9, 0.4e9, device_budget=10**12).keep_last == 5
    # Zero budget: everything offloaded.
    assert make_plan(layers, 0.4e9, 0.4e9, device_budget=0).keep_last == 0
    # What follows the last block is kept first: 120 MB of it leaves room for one layer.
    assert make_plan(layers, 0.1e9, 0.1e9, device_budget=250 * MB, head=120 * MB).keep_last == 1


def test_min_keep_after_stalls():
    p = make_plan(uniform(), 5e9, 5e9, min_keep=3)
    assert p.keep_last == 3 and p.stall_free and "(at least 3 kept after stalls)" in p.reason


def test_reads_decide_when_writes_fit():
    # Writes are fast; reads take 0.25 s a layer against 0.2 s of backward each, so they
    # fall behind by 0.05 s a layer: two kept layers' backward (0.4 s) give them the head start.
    p = make_plan(uniform(), 50e9, 0.4e9)
    assert p.stall_free and p.keep_last == 2
    assert "keep the last" in p.table()


def test_late_reads_mark_the_layers_read_last():
    # Two layers may be kept (budget); reads take 0.33 s a layer against 0.2 s of backward
    # each: layers 5..3 are back in time, layer 2 and all read after it are late.
    p = make_plan(uniform(), 50e9, 0.3e9, device_budget=200 * MB)
    assert not p.stall_free and p.keep_last == 2
    stalls = [d.index for d in p.layers if d.reason == "offloaded by budget: its I/O may stall"]
    assert stalls == [0, 1, 2]


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
    # Writes start when layer 3's saves pass 300 MB (0.3 s) and end at 0.55 s.
    assert abs(p.write_finish_s - 0.55) < 1e-9
    # A fast disk takes the overflow: everything offloaded, 500 of the 800 MB spilled.
    fast = make_plan(uniform(), 5e9, 5e9, host=host)
    assert fast.keep_last == 0 and fast.spill_bytes == 500 * MB


def test_spill_writes_start_when_the_arena_passes_three_quarters():
    # 200 MB saved in 0.05 s into a 100 MB arena: the overflow can go only from 0.019 s (75 MB
    # saved), and at 2 GB/s out against 4 GB/s in the arena is full at 0.031 s: the forward
    # would wait, so the layer is kept.
    layers = [LayerProfile(0, 200 * MB, 0.05, 0.1), LayerProfile(1, 200 * MB, 0.1, 0.2)]
    assert make_plan(layers, 2e9, 2e9, host=HostTier(100 * MB, None)).keep_last == 2


def test_slow_copies_to_the_host_tier_keep_layers():
    # 100 MB per 0.1 s layer needs 1 GB/s of copies; at 0.5 GB/s four layers' copies end at
    # 0.8 s, with the forward, whatever the disk.
    host = HostTier(2000 * MB, 0.5e9)
    for bw in (5e9, 0.1e9):
        p = make_plan(uniform(), bw, bw, host=host)
        assert p.stall_free and p.keep_last == 4 and abs(p.copy_finish_s - p.forward_s) < 1e-9
    # Fast copies: everything goes; the last layer is copied back in 5 ms of its 0.2 s backward.
    assert make_plan(uniform(), 5e9, 5e9, host=HostTier(2000 * MB, 20e9)).keep_last == 0


def test_copies_in_flight_are_bounded_by_half_the_arena():
    # A 100 MB arena lets 50 MB be in flight: at 0.5 GB/s the first layer's copy is 50 MB
    # behind at its end, a second layer's would be 100 MB behind.
    p = make_plan(uniform(), 1e9, 1e9, host=HostTier(100 * MB, 0.5e9))
    assert p.keep_last == 7 and p.stall_free


def test_copies_in_flight_are_bounded_by_the_gpus_share_too():
    # A 2000 MB arena, but 50 MB of copies queued at most (the GPU's share): as a 100 MB arena.
    p = make_plan(uniform(), 1e9, 1e9, host=HostTier(2000 * MB, 0.5e9, queue=50 * MB))
    assert p.keep_last == 7 and p.stall_free
    assert make_plan(uniform(), 1e9, 1e9, host=HostTier(2000 * MB, 0.5e9)).keep_last == 4


def test_reads_of_spilled_bytes_wait_for_the_writes_still_going():
    # 800 MB arena, 0.2 GB/s disk: with nothing kept the writes of the last 200 MB run until
    # 1.6 s, 0.8 s into the backward, and the first layer's bytes come back late; keeping one
    # layer spills 100 MB, written by 1.1 s, in time.
    p = make_plan(uniform(), 0.2e9, 0.2e9, host=HostTier(800 * MB, None))
    assert p.keep_last == 1 and p.spill_bytes == 100 * MB


def test_a_layer_partly_spilled_reads_only_its_part():
    # 650 MB arena: with two layers kept, 112.5 MB spill (past 487.5 MB): layer 0 and 12.5 MB
    # of layer 1. At 0.15 GB/s that is in time only because layer 1 reads just its part.
    p = make_plan(uniform(), 0.15e9, 0.15e9, host=HostTier(650 * MB, None))
    assert p.keep_last == 2 and p.spill_bytes == 112_500_000


def test_a_transfer_must_start_by_its_layers_backward():
    # Layer 0 (a long backward) has 50 MB spilled, written until 0.65 s, 0.45 s into the
    # backward; its backward starts at 0.2 s. The read would end in time (0.455 s of 0.7 s)
    # but its first bytes are late, so layer 0 is offloaded alone, with nothing spilled.
    layers = [LayerProfile(0, 100 * MB, 0.1, 0.5), LayerProfile(1, 100 * MB, 0.1, 0.2)]
    p = make_plan(layers, 0.1e9, 10e9, host=HostTier(200 * MB, None))
    assert p.keep_last == 1 and p.spill_bytes == 0


def test_a_small_arena_waits_for_the_disk():
    # Once 100 MB arrive per 0.1 s layer into a 100 MB arena, the disk must take 1 GB/s:
    # at 0.4 GB/s only the first layer (25 MB of it spilled) goes.
    p = make_plan(uniform(), 0.4e9, 0.4e9, host=HostTier(100 * MB, None))
    assert p.stall_free and p.keep_last == 7 and p.spill_bytes == 25 * MB
    # Copies at 0.5 GB/s run with the first layer's saves, 50 MB behind at its end (the
    # bound); started at its end they would be 100 MB behind.
    assert make_plan(uniform(), 0.2e9, 0.2e9, host=HostTier(100 * MB, 0.5e9)).keep_last == 7


def _simulate_forward(layers, k, wbw, host, dt=5e-4):
    """A forward through the host tier in steps of ``dt``: saves arrive evenly through each
    offloaded block; each needs a free slot and, with a copy rate, room under half the arena
    in flight; the store writes the oldest bytes out once three quarters are held. Returns
    the seconds the saves waited, plus what the copies still lack at the forward's end."""
    cap, rate = host.capacity, host.copy_bytes_per_s
    soft = cap - cap // 4
    held = leaving = inflight = waited = 0.0

    def tick():
        nonlocal held, leaving, inflight
        w = min(leaving, wbw * dt)
        leaving, held = leaving - w, held - w
        if rate:
            inflight -= min(inflight, rate * dt)

    for x in layers[: len(layers) - k]:
        left, step = float(x.bytes), x.bytes / x.forward_s * dt
        while left > 1e-3:
            tick()
            s = min(step, left)
            if held + s > cap or (rate and inflight + s > cap // 2):
                waited += dt
                continue
            held, left = held + s, left - s
            inflight += s if rate else 0.0
            leaving += max(0.0, held - leaving - soft)
    for _ in range(round(sum(x.forward_s for x in layers[len(layers) - k :]) / dt)):
        tick()
    return waited + (inflight / rate if rate else 0.0)


def test_the_host_tier_model_agrees_with_a_step_simulation():
    # Whenever the plan's model says the forward never waits, a finer simulation agrees
    # (within a few steps of slack); 300 seeded random profiles.
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        n = rng.randint(2, 5)
        layers = [
            LayerProfile(i, rng.choice([50, 100, 200]) * MB, f, 2 * f)
            for i in range(n)
            for f in [rng.choice([0.05, 0.1, 0.2])]
        ]
        host = HostTier(rng.choice([100, 200, 400]) * MB, rng.choice([None, 0.5e9, 2e9]))
        wbw = rng.choice([0.2e9, 0.5e9, 2e9])
        for k in range(n):
            if _run(layers, k, wbw, wbw, host).forward_ok:
                checked += 1
                assert _simulate_forward(layers, k, wbw, host) <= 4 * 5e-4, (layers, k, wbw, host)
    assert checked > 100


def test_an_auto_device_budget_leaves_what_is_not_kept_activations_and_a_margin():
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    assert ab.next(0, 0, Memory(50 * g, 100 * g, 10 * g, 12 * g, 0)) is None  # no step seen yet
    # Step 1, sampled: 14 and 18 GiB allocated beside what was kept; its peak of 20 less the
    # most kept (2) says 18 too. Free and cached 60 GiB, less 5% of the GPU: 37 GiB to keep.
    ab.sample(15 * g, 1 * g)
    ab.sample(20 * g, 2 * g)
    assert ab.next(2 * g, 0, Memory(50 * g, 100 * g, 10 * g, 20 * g, 0)) == 37 * g
    # The loop resets the peak counters each step: the samples alone tell (15 GiB).
    ab.sample(40 * g, 25 * g)
    assert ab.next(25 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 0)) == 40 * g
    # Nothing new seen: as it was. Copies out queued at once hold 4 GiB more.
    assert ab.next(25 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 0)) == 40 * g
    assert ab.next(25 * g, 4 * g, Memory(20 * g, 100 * g, 40 * g, 11 * g, 0)) == 36 * g
    # An allocation was retried: 0.9 of what the last step kept, and the margin added to the rest.
    assert ab.next(30 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 1)) == 27 * g
    assert ab.next(27 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 1)) == 35 * g
    # Retried again after the cut: held where it is, not cut down to nothing step by step.
    assert ab.next(27 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 2)) == 27 * g
    # Retried after keeping more again: cut again.
    assert ab.next(33 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 3)) == int(33 * g * 0.9)
    # Each cut's margin stays when what is not kept is measured again: 60 - 5 - 15 - 2 x 5.
    ab.sample(40 * g, 25 * g)
    assert ab.next(25 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 3)) == 30 * g
    # A small GPU's margin is 1 GiB at least, and no room at all keeps nothing.
    small = AutoBudget()
    small.next(0, 0, Memory(4 * g, 8 * g, 1 * g, 1 * g, 0))
    small.sample(2 * g, 1 * g)
    assert small.next(1 * g, 0, Memory(4 * g, 8 * g, 2 * g, 2 * g, 0)) == 4 * g
    small.sample(9 * g, 1 * g)
    assert small.next(1 * g, 0, Memory(0, 8 * g, 2 * g, 9 * g, 0)) == 0


def test_an_auto_budget_shrinks_for_a_step_that_saves_more():
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    assert ab.grown(2.0) is None  # nothing seen yet
    ab.next(0, 0, Memory(50 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    ab.sample(30 * g, 14 * g)  # 16 GiB beside the kept activations, 10 of them before the step
    assert ab.next(14 * g, 0, Memory(50 * g, 100 * g, 10 * g, 30 * g, 0, 10 * g)) == 39 * g
    # Twice the activations: the 6 GiB made during the step double, the 10 before it do not.
    assert ab.grown(2.0) == 33 * g
    assert ab.grown(1.0) == 39 * g
    assert ab.grown(20.0) == 0


def test_the_gpu_memory_is_read_within_a_per_process_fraction(monkeypatch):
    import torch

    from ssdtier.offload.budget import Gpu, Memory

    gib = 1 << 30
    stats = {
        "reserved_bytes": {"all": {"current": 6 * gib}},
        "allocated_bytes": {"all": {"current": 3 * gib, "peak": 8 * gib}},
        "num_alloc_retries": 2,
    }
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda d: stats)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    gpu = Gpu(torch.device("cuda", 0))
    assert gpu.memory() == Memory(60 * gib, 80 * gib, 6 * gib, 8 * gib, 2, 3 * gib) and gpu.allocated() == 3 * gib
    # set_per_process_memory_fraction(0.25): 20 GiB allowed, 6 of them reserved already.
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 0.25)
    assert gpu.memory() == Memory(14 * gib, 20 * gib, 6 * gib, 8 * gib, 2, 3 * gib)
