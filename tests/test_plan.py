"""The ROK planner on synthetic profiles: what it predicts and what it chooses (no I/O, no timing)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from ssdtier.plan import Action, Block, Head, Outcome, Transfers, simulate, solve
from ssdtier.sizes import format_size

MB = 1_000_000
GiB = 1 << 30
K, OF, R, RO = Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD


def uniform(n=8, bytes_=100 * MB, inputs=10 * MB, fwd=0.1):
    return [Block(i, bytes_, inputs, fwd, 2 * fwd, fwd) for i in range(n)]


def disk(rate=1e9, read=None, **kw):
    """CPU tensors written straight to NVMe from their own pages."""
    return Transfers(write=rate, read=read or rate, **kw)


def gpu(link, host=100 * GiB, write=2e9, read=2e9, **kw):
    return Transfers(write=write, read=read, out=link, back=link, host=host, **kw)


# ------------------------------------------------------------------ simulate


def test_keeping_everything_holds_every_block_and_costs_nothing():
    got = simulate(uniform(), [K] * 8, disk(), Head(30 * MB, 0.05, 0.1))
    assert got.peak == 830 * MB and got.extra_s == 0 and got.moved == 0


def test_an_offload_that_hides_frees_its_bytes_at_no_cost():
    # 100 MB per 0.1 s block against 5 GB/s: each write ends 20 ms into the next block.
    got = simulate(uniform(), [OF] * 4 + [K] * 4, disk(5e9))
    assert got.extra_s == 0 and got.late == () and got.moved == 400 * MB
    # The four kept blocks, and the last offloaded one read back ahead while they are.
    assert got.peak == 500 * MB
    # Within the forward's peak, the read waits for the room that the kept blocks leave.
    assert simulate(uniform(), [OF] * 4 + [K] * 4, disk(5e9), limit=400 * MB).peak == 400 * MB


def test_copies_still_going_at_the_forwards_end_are_held_then():
    # 100 MB at 0.1 GB/s: block 0's write runs to 1.0 s, 0.2 s past a 0.8 s forward: a fifth
    # of it is still on the device at the peak.
    got = simulate(uniform(), [OF] + [K] * 7, disk(0.1e9), limit=720 * MB)
    assert got.peak == 720 * MB and got.copy_end_s == pytest.approx(1.0)


def test_what_is_held_as_each_block_starts_counts_the_sources_still_leaving():
    # Block 0's 100 MB leave at 0.5 GB/s, 0.2 s: half of them are still held as block 1
    # starts, none as block 2 does; blocks 1 and 2 are kept.
    got = simulate(uniform(4), [OF, K, K, K], disk(0.5e9))
    assert got.before == (0, 50 * MB, 100 * MB, 200 * MB)


def test_tensors_too_small_to_offload_stay_unless_the_block_is_recomputed():
    # Each block: 100 MB offloadable, 30 MB in tensors under min_tensor_bytes; of its 10 MB of
    # inputs, 4 MB in such tensors. Offloaded, a block holds its 30 MB; recomputed with its
    # inputs offloaded, the 4 MB; the guard reads these as held, so the plan must too.
    blocks = [dataclasses.replace(b, small=30 * MB, inputs_small=4 * MB) for b in uniform(4)]
    b = blocks[0]
    assert [b.held(a) for a in (K, OF, R, RO)] == [130 * MB, 30 * MB, 10 * MB, 4 * MB]
    assert [b.moved(a) for a in (K, OF, R, RO)] == [0, 100 * MB, 0, 6 * MB]
    got = simulate(blocks, [OF, OF, K, RO], disk(5e9))
    assert got.before[1:] == (30 * MB, 60 * MB, 190 * MB) and got.forward_peak == 194 * MB
    # Kept, a block holds all of it: a budget of 4 kept blocks' offloadable bytes is not enough.
    p = solve(blocks, disk(1e3), 400 * MB)  # (a disk too slow to hide anything)
    assert p.fits and p.count(K) < 4 and p.outcome.peak <= 400 * MB, p.table()


def test_the_peak_measured_past_the_model_is_added_to_every_plan():
    head = Head(30 * MB, 0.05, 0.1)
    plain = simulate(uniform(), [K] * 8, disk(), head)
    worked = simulate(uniform(), [K] * 8, disk(), Head(30 * MB, 0.05, 0.1, working=200 * MB))
    assert worked.peak == plain.peak + 200 * MB
    # A budget that keeping everything meets only without it: with it, some blocks go.
    assert solve(uniform(), disk(), plain.peak, head).actions == (K,) * 8
    p = solve(uniform(), disk(), plain.peak, Head(30 * MB, 0.05, 0.1, working=200 * MB))
    assert p.fits and p.outcome.peak <= plain.peak and p.count(K) < 8, p.table()
    assert "190.7MiB of the peak measured past the model" in p.table(), p.table()
    assert f"{format_size(30 * MB)} saved after the last block" in p.table()


def test_recomputation_costs_a_forward_and_holds_the_inputs():
    got = simulate(uniform(), [R] * 8, disk(5e9))
    assert got.extra_s == pytest.approx(0.8) and got.recompute_s == pytest.approx(0.8)
    # Block 7's backward: seven inputs below, its own inputs and its 100 MB made again.
    assert got.peak == 180 * MB
    # Inputs offloaded: one block made again, its inputs and the next block's, read ahead.
    # The last block's inputs are needed as the forward ends: read back in 2 ms.
    off = simulate(uniform(), [RO] * 8, disk(5e9))
    assert off.moved == 80 * MB and off.peak == 120 * MB and off.extra_s == pytest.approx(0.802)


def test_bytes_back_late_make_the_backward_wait():
    # Block 0 offloaded, read at 50 MB/s (2 s). Room for it opens when block 6's backward
    # starts (1.0 s: 500 MB below, 100 MB of block 6 and 100 MB back fit the 700 MB peak);
    # it is back at 3.0 s, 0.6 s after block 0's 0.2 s backward window ends at 2.4 s.
    got = simulate(uniform(), [OF] + [K] * 7, disk(5e9, read=0.05e9), limit=700 * MB)
    assert got.late == (0,) and got.backward_wait_s == pytest.approx(0.6)
    # A higher limit lets the read start at the forward's end (0.8 s): back at 2.8 s.
    more = simulate(uniform(), [OF] + [K] * 7, disk(5e9, read=0.05e9), limit=800 * MB)
    assert more.backward_wait_s == pytest.approx(0.4) and more.peak == 800 * MB


def test_the_host_tier_spills_the_first_bytes_saved():
    # A 400 MB arena: the store writes out what passes 300 MB, at the disk's pace.
    got = simulate(uniform(), [OF] * 8, gpu(20e9, host=400 * MB, write=5e9, read=5e9))
    assert got.spill == 500 * MB and got.extra_s == pytest.approx(0.0, abs=1e-6)


def test_copies_queued_past_the_bound_make_the_forward_wait():
    # 0.5 GB/s link: each 100 MB block leaves in 0.2 s, twice its forward; 50 MB may queue.
    got = simulate(uniform(), [OF] * 8, gpu(0.5e9, queue=50 * MB))
    assert got.forward_wait_s > 0.5
    assert simulate(uniform(), [OF] * 8, gpu(0.5e9)).forward_wait_s == 0  # 50 GiB may queue


def test_the_hooks_cost_of_each_offloaded_block_is_paid():
    blocks = [Block(i, 100 * MB, 10 * MB, 0.1, 0.2, 0.1, offload_s=0.01) for i in range(8)]
    assert simulate(blocks, [OF] * 8, disk(5e9)).extra_s == pytest.approx(0.08)
    assert simulate(blocks, [K] * 8, disk(5e9)).extra_s == 0


def test_more_than_the_tiers_hold_does_not_fit():
    assert not simulate(uniform(), [OF] * 8, disk(5e9, nvme=500 * MB)).fits_host
    assert simulate(uniform(), [OF] * 4 + [K] * 4, disk(5e9, nvme=500 * MB)).fits_host


# ------------------------------------------------------------------ solve


def test_everything_is_kept_when_it_fits():
    p = solve(uniform(), disk(), device_budget=2 * GiB)
    assert p.actions == (K,) * 8 and p.fits and p.slowdown == 1.0


def test_without_a_budget_offloading_goes_as_far_as_it_hides():
    # 5 GB/s: all but the last block, whose write would still hold it at the peak; one
    # block is read back ahead while it is.
    fast = solve(uniform(), disk(5e9))
    assert fast.actions == (OF,) * 7 + (K,) and fast.outcome.peak == 200 * MB
    # 0.4 GB/s: a write takes 0.25 s a block. Three end inside the 0.8 s forward; the fourth
    # ends 0.2 s after it (80 MB still held at the peak, not 100); a fifth would come back late.
    slow = solve(uniform(), disk(0.4e9), free=0.0)
    assert slow.actions == (OF,) * 4 + (K,) * 4 and slow.outcome.extra_s == 0
    # 10 MB/s: nothing hides; nothing is recomputed without a budget asking for it.
    assert solve(uniform(), disk(10e6)).actions == (K,) * 8


def test_where_offloading_cannot_hide_the_budget_is_met_by_recomputation():
    # 0.1 GB/s: a block takes 1 s to leave (the forward is 0.8 s). 450 MB of 800 allowed:
    # block 0 offloaded (20 MB of it still leaving at the peak), three recomputed.
    p = solve(uniform(), gpu(0.1e9), device_budget=450 * MB)
    assert p.fits and p.outcome.peak <= 450 * MB
    assert p.actions == (OF, R, R, R, K, K, K, K) and p.outcome.extra_s == pytest.approx(0.3)
    assert p.slowdown == pytest.approx(1 + 0.3 / p.step_s)


def test_reads_ahead_leave_room_for_a_recomputation_below():
    # As at run time: reads started above a recomputed block are held through it, so they
    # leave room for what it remakes. Filled to the limit above, the 300 MB block made again
    # peaked at 510 MB, past any of these limits: a plan that fits was taken for one that did not.
    blocks = [*uniform(2), Block(2, 300 * MB, 10 * MB, 0.1, 0.2, 0.1), Block(3, 50 * MB, 10 * MB, 0.1, 0.2, 0.1)]
    for limit in (400 * MB, 500 * MB):
        o = simulate(blocks, [OF, OF, R, K], gpu(1e9), Head(20 * MB, 0.01, 0.02), limit)
        assert o.peak <= limit and o.extra_s == pytest.approx(0.1), (limit, o)


def test_a_block_that_updates_a_cache_is_never_recomputed():
    # Blocks 1 to 3 were called with a key/value cache: the plan keeps or offloads them, at
    # any budget, and recomputes the others.
    blocks = [dataclasses.replace(b, recomputable=b.index not in (1, 2, 3)) for b in uniform()]
    for budget in (450 * MB, 150 * MB, 1):
        p = solve(blocks, gpu(0.2e9), device_budget=budget)
        assert not any(p.actions[i].recomputes for i in (1, 2, 3)), (budget, p.table())
        assert any(a.recomputes for a in p.actions), p.table()


def test_below_checkpointing_the_inputs_leave_too():
    # Everything recomputed with its inputs kept holds 70 MB of inputs and one block's 110;
    # 0.2 GB/s carries the inputs (50 ms each) but not whole blocks (0.5 s).
    assert simulate(uniform(), [R] * 8, gpu(0.2e9)).peak == 180 * MB
    p = solve(uniform(), gpu(0.2e9), device_budget=150 * MB)
    assert p.fits and p.outcome.peak <= 150 * MB and RO in p.actions


def test_a_budget_nothing_meets_gives_the_least_memory_and_says_so():
    p = solve(uniform(), disk(5e9), device_budget=50 * MB, head=Head(60 * MB))
    assert not p.fits and "nothing fits" in p.reason
    # What no block's action moves is named: here the head's saved 60 MB.
    assert f"{format_size(60 * MB)} of it is the loss's" in p.reason, p.reason
    # Every block offloaded holds one block back at a time: less than recomputing any.
    assert p.actions == (OF,) * 8 and p.outcome.peak == 100 * MB


def test_unlike_blocks_recompute_where_it_frees_most_per_second():
    # Block 1 saves as much in a third of the time: recomputing it frees as much for less.
    blocks = uniform(4)
    blocks[1] = Block(1, 100 * MB, 10 * MB, 0.1, 0.2, 0.033)
    p = solve(blocks, gpu(1e6), device_budget=320 * MB)
    assert p.actions == (K, R, K, K)


def h200(batch, link=55e9, host=100 * GiB, queue=None):
    """The 1.3B GPT of the H200's run 3 (shared/rok-model.md), per micro-batch: 24 blocks of
    0.1406 GiB a sample (inputs 0.0156), 0.43 ms a sample of forward, recomputed for 0.28
    (checkpointing's measured cost), a head of 0.77 GiB, keep's 34.7 ms a sample in all;
    116.2 GiB for activations."""
    f = 0.43e-3 * batch
    blocks = [
        Block(i, int(0.1406 * GiB * batch), int(0.0156 * GiB * batch), f, 2 * f, 0.28e-3 * batch) for i in range(24)
    ]
    rest = 34.7e-3 * batch - 24 * 3 * f
    head = Head(int(0.77 * GiB * batch), rest / 3, 2 * rest / 3)
    tr = Transfers(write=2e9, read=1.5e9, out=link, back=link, host=host, queue=queue)
    return solve(blocks, tr, int(116.2 * GiB), head)


def test_the_h200_model_offloads_first_recomputes_the_middle_and_keeps_the_last():
    p = h200(40)
    assert p.fits and p.slowdown <= 1.05
    first = {a: [i for i, x in enumerate(p.actions) if x is a] for a in Action}
    offloaded, recomputed = first[OF], first[R] + first[RO]
    assert offloaded and recomputed and first[K]
    assert offloaded[0] == 0 and offloaded[0] < min(recomputed)
    assert max(offloaded + recomputed) < min(first[K])


def test_the_h200_model_predicts_the_batches_of_the_rok_arithmetic():
    # shared/rok-model.md: keep fits 28; whole-block actions reach ~38-39 at <= 1.05x keep's
    # time per sample and ~50-52 at <= 1.10x (with the recomputed blocks' inputs kept);
    # offloading those inputs too reaches a little further. Checkpointing fits 101-102.
    def largest(limit):
        return max(b for b in range(28, 200) if (p := h200(b)).fits and p.slowdown <= limit)

    assert h200(28).actions == (K,) * 24 and not h200(29).actions == (K,) * 24
    assert 38 <= largest(1.05) <= 42
    assert 50 <= largest(1.10) <= 58
    assert largest(1.19) >= 1.15 * 102  # at checkpointing's time per sample


def test_the_runtimes_defaults_on_an_h200_reach_the_targets():
    # With the arena ("auto": a quarter of the GPU) and the bound on copies queued that the
    # CUDA transport has on an H200, 1.4x keep's batch (28) runs within 1.05x keep's time per
    # sample, 1.8x within 1.10x. A queue of 1/32 of the GPU holds the forward back too long.
    from ssdtier.offload.cuda import QUEUE_SHARE

    gpu = 140 * GiB

    def plan(batch, share=QUEUE_SHARE):
        return h200(batch, host=gpu // 4, queue=int(gpu * share))

    assert plan(40).fits and plan(40).slowdown <= 1.05
    assert plan(51).fits and plan(51).slowdown <= 1.10
    assert plan(40, 1 / 32).slowdown > 1.05 and plan(51, 1 / 32).slowdown > 1.10
    # At checkpointing's time per sample (41.4 / 34.7 ms) 1.1x its batch (102); at 120 the
    # search starts from every block recomputed with its inputs offloaded, far too slow
    # (17.8 s over keep's step), and single-block changes must find the way back.
    assert plan(112).slowdown <= 41.4 / 34.7 and plan(120).slowdown < 1.2


def test_the_h100_model_reaches_the_targets_its_runtime_missed():
    # The same GPT from the H100's run 3 (benches/results/h100/): 0.425 ms a sample per
    # block's forward, recomputed for 0.325 (checkpointing's 1.21x), keep's 37.5 ms a sample,
    # 55 GiB for activations (keep fits 13), 54.8 GB/s, the runtime's arena and queue. The
    # model reaches 19 within 1.05x and 25 within 1.10x (targets 18.2, 23.4). At batch 16 it
    # plans 5 blocks offloaded at 1.01x; the runtime ran such a plan (17 kept, 5 offloaded, 2
    # recomputed) at 1.41x: the gap is the runtime's.
    def plan(batch):
        f = 0.425e-3 * batch
        blocks = [
            Block(i, int(0.1406 * GiB * batch), int(0.0156 * GiB * batch), f, 2 * f, 0.325e-3 * batch)
            for i in range(24)
        ]
        rest = 37.5e-3 * batch - 24 * 3 * f
        head = Head(int(0.77 * GiB * batch), rest / 3, 2 * rest / 3)
        tr = Transfers(write=1.4e9, read=1.4e9, out=54.8e9, back=54.8e9, host=int(19.8 * GiB), queue=int(4.95 * GiB))
        return solve(blocks, tr, 55 * GiB, head)

    assert plan(13).actions == (K,) * 24
    assert plan(19).fits and plan(19).slowdown <= 1.05
    assert plan(25).fits and plan(25).slowdown <= 1.10
    p = plan(16)
    assert p.slowdown <= 1.02 and p.count(OF) == 5 and p.count(K) >= 17


def test_the_plan_explains_itself():
    p = h200(40)
    text = p.table()
    assert text.splitlines()[0].startswith("ssdtier plan: ") and "copies 55.0 GB/s out" in text
    rows = text.splitlines()[3:]
    assert len(rows) == 24 and all(f"  {a.value}: " in r for r, a in zip(rows, p.actions, strict=True))
    assert f"{p.count(OF)} offload" in p.summary() and "x keep's step" in p.summary()


def test_waits_charged_to_the_bytes_moved_offload_less():
    # 10 ms per MB moved, measured past the model: offloading a block costs 1 s.
    charged = disk(5e9, per_byte_s=1e-8)
    assert simulate(uniform(), [OF] * 8, charged).extra_s == pytest.approx(8.0)
    assert solve(uniform(), charged).actions == (K,) * 8
    p = solve(uniform(), charged, device_budget=450 * MB)
    assert p.count(OF) == 0 and p.count(R) == 4


def test_the_search_is_close_to_exhaustive_on_small_random_profiles():
    # Every assignment of 2-5 unlike blocks tried: when one fits, the plan fits, and it is as
    # fast within 1% of the step in most profiles, within 15% in all (seeded).
    rng = random.Random(3)
    gaps = []
    for _ in range(150):
        n = rng.randint(2, 5)
        blocks = []
        for i in range(n):
            f = rng.choice([0.05, 0.1, 0.2])
            blocks.append(
                Block(
                    i,
                    rng.choice([50, 100, 200]) * MB,
                    rng.choice([5, 10, 25]) * MB,
                    f,
                    2 * f,
                    f * rng.choice([0.6, 1.0]),
                )
            )
        if rng.random() < 0.5:
            tr = gpu(rng.choice([0.5e9, 2e9]), host=rng.choice([100, 400, 2000]) * MB, write=rng.choice([0.2e9, 1e9]))
        else:
            tr = disk(rng.choice([0.2e9, 1e9, 3e9]), read=rng.choice([0.2e9, 1e9, 3e9]))
        head = Head(rng.choice([0, 20, 100]) * MB, 0.05, 0.1)
        budget = int(simulate(blocks, [K] * n, tr, head).peak * rng.choice([0.3, 0.5, 0.7, 0.9]))
        p = solve(blocks, tr, budget, head)
        best = None
        for acts in itertools.product(Action, repeat=n):
            o = simulate(blocks, acts, tr, head, budget)
            if o.fits_host and o.peak <= budget and (best is None or o.extra_s < best):
                best = o.extra_s
        if best is None:
            assert not p.fits
            continue
        assert p.fits and p.outcome.peak <= budget
        gaps.append((p.outcome.extra_s - best) / p.step_s)
    assert len(gaps) > 80 and max(gaps) <= 0.15
    assert sum(g <= 0.01 for g in gaps) >= 0.85 * len(gaps)


def test_changes_that_come_round_again_end_the_improvement(monkeypatch):
    # "Better" compares within tolerances, so it is not transitive: keep -> offload (as fast
    # within EPS, fewer bytes moved) -> recompute (the same) -> keep (faster by more than EPS
    # than recompute). Such a cycle ran 4n rounds of 3n simulations; it ends where it began.
    import ssdtier.plan as plan_mod

    def outcome(extra, moved):
        return Outcome(100, 100, extra, 0.0, 0.0, 0.0, moved, 0, 0.0, (), True)

    table = {K: outcome(0.0, 10), OF: outcome(0.5e-9, 5), R: outcome(1.5e-9, 2), RO: outcome(1.0, 0)}
    calls = []
    monkeypatch.setattr(plan_mod, "simulate", lambda blocks, acts, *a: calls.append(acts[0]) or table[acts[0]])
    acts, _ = plan_mod._improve([Block(0, 100, 10, 0.01, 0.02, 0.01)], [K], table[K], Transfers(1e9, 1e9), Head(), 1000)
    assert acts == [K] and len(calls) == 9, calls  # a round, its sweep of ties, a round back
