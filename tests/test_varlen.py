"""Adaptive mode with a sequence length that changes from step to step (dynamic padding): each
step's true activation peak, under the actions that ran, stays within its device budget.
Plain attention saves T x T scores: a block's bytes grow faster than its inputs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch
from ssdtier.offload.adaptive import LONGEST, SLACK
from ssdtier.plan import Action, Block, Head, Transfers, simulate

from .test_rok import adaptive
from .test_settled import _steady

CFG = GPTConfig(n_layers=4, d_model=32, n_heads=4, seq_len=256, vocab_size=64)  # plain attention
N = CFG.n_layers
LENGTHS = (64, 64, 64, 128, 64, 128, 96, 160)
INF = float("inf")


def count(L):
    """Per tag (0 before the blocks, i + 1 block i, N + 1 after), bytes a plain model saves at L; blocks' inputs."""
    torch.manual_seed(0)
    model = build_model(CFG)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, inputs, seen, tag = [0] * (N + 2), [0] * N, set(), [0]

    def pack(t):  # counted as ssdtier counts: a storage once, no parameter nor view of one
        ptr = t.untyped_storage().data_ptr()
        if ptr in params or ptr in seen or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        seen.add(ptr)
        saved[tag[0]] += t.untyped_storage().nbytes()
        return t

    def enter(i):  # block i's pre-hook: tags what it saves, counts its inputs (one fp32 tensor)
        def hook(module, args):
            tag[0], inputs[i] = i + 1, sum(a.untyped_storage().nbytes() for a in args)

        return hook

    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(enter(i))
    model.blocks[-1].register_forward_hook(lambda *a: tag.__setitem__(0, N + 1))
    batch = make_batch(dataclasses.replace(CFG, seq_len=L), 2, torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch_loss(model, batch)
    return saved, inputs


def peak(counts, acts, tr):
    """The simulated peak under acts at one length, nothing read ahead: with instant transfers, a lower bound."""
    saved, inputs = counts
    blocks = [Block(i, saved[i + 1] + (saved[0] if i == 0 else 0), inputs[i], 1e-3, 2e-3, 1e-3) for i in range(N)]
    return simulate(blocks, acts, tr, Head(saved[N + 1]), limit=0).peak


def run(store_dir, budget=None, lengths=LENGTHS, unhooked=None, prepare=None, on_step=None):
    """Trains on ``lengths``; per step (length, actions ran, budget at its start, profile.saved),
    grads, transfers. ``unhooked``: a list told per step whether it ran without hooks;
    ``on_step(offloader)`` after each."""
    torch.manual_seed(0)
    model = build_model(CFG)
    if prepare is not None:
        prepare(model)
    gen = torch.Generator().manual_seed(2)
    batches = [make_batch(dataclasses.replace(CFG, seq_len=L), 2, gen) for L in lengths]
    off = ssdtier.attach(model, adaptive(store_dir, device_budget=budget)) if budget else None
    torch.manual_seed(1)
    steps = []
    for L, b in zip(lengths, batches, strict=True):
        at_start = off._budget if off else None
        before = off.stats().forwards_unhooked if off else 0
        batch_loss(model, b).backward()
        if off:
            steps.append((L, list(off.adaptive.ran), at_start, list(off.adaptive.profile.saved)))
            if unhooked is not None:
                unhooked.append(off.stats().forwards_unhooked > before)
            if on_step is not None:
                on_step(off)
    tr = off.adaptive.transfers() if off else None
    if off:
        off.detach()
    return steps, {n: p.grad for n, p in model.named_parameters()}, tr


def code(acts):
    """Actions as letters: k keep, o offload, r recompute, R recompute with inputs offloaded."""
    return "".join({"keep": "k", "offload": "o", "recompute": "r"}.get(a.value, "R") for a in acts)


def test_a_varying_sequence_length_stays_within_the_budget(store_dir, monkeypatch):
    # A 1 kB/s disk and blocks timed alike: the plans keep and recompute, the same at every run.
    _steady(monkeypatch)
    counts = {L: count(L) for L in set(LENGTHS)}
    budget = int(1.05 * peak(counts[64], [Action.KEEP] * N, Transfers(INF, INF)))
    steps, grads, tr = run(store_dir, budget)
    _, want, _ = run(store_dir)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in grads)
    # The counts are ssdtier's: step 1 (length 64) kept blocks, each saving what the plain model did.
    L, ran, _, saved = steps[1]
    kept = [0, N + 1] + [i + 1 for i in range(N) if ran[i] is Action.KEEP]
    assert len(kept) > 2 and [saved[t] for t in kept] == [counts[L][0][t] for t in kept], (saved, counts[L])
    tr = dataclasses.replace(tr, write=INF, read=INF, out=None, back=None, host=0)  # bytes leave at once
    rows, over = [], []
    for i, (L, ran, b, _) in enumerate(steps):
        fits = peak(counts[L], [Action.RECOMPUTE_OFFLOAD] * N, tr) <= b  # some plan fits at L
        ratio = peak(counts[L], ran, tr) / b
        note = "" if fits else " (no plan fits)"
        rows.append(f"step {i} length {L:3d} ran {code(ran)}: true peak {ratio:.3f}x budget{note}")
        if fits and ratio > 1 + SLACK:
            over.append(i)
    print("\n".join(rows))
    assert not over, f"steps {over} pass the budget {budget} by more than {SLACK:.0%}:\n" + "\n".join(rows)


def test_how_bytes_grow_with_length_is_learned(store_dir):
    # Two lengths kept: plain attention's blocks save T x T scores, SDPA's do not. Until then
    # a longer sequence is taken to grow bytes as its square.
    for sdpa, low, high in ((False, 1.3, 2.0), (True, 1.0, 1.1)):
        cfg = dataclasses.replace(CFG, sdpa=sdpa, dropout=0.0)  # SDPA with dropout on a CPU saves its scores
        torch.manual_seed(0)
        model = build_model(cfg)
        off = ssdtier.attach(model, adaptive(store_dir, device_budget=1 << 30))
        seen = []
        for L in (64, 128):
            batch_loss(model, make_batch(dataclasses.replace(cfg, seq_len=L), 2)).backward()
            seen.append(off.adaptive.profile.exponent())
        batch_loss(model, make_batch(cfg, 2)).backward()  # its start reads the 128 step's measurements
        seen.append(off.adaptive.profile.exponent())
        off.detach()
        assert seen[0] == seen[1] == 2.0 and low <= seen[2] <= high, (sdpa, seen)


PADDED = (64, 96, 128, 64, 96, 128, 64, 64, 96, 160, 128, 96, 64, 160, 96, 128, 64, 96, 128, 64)


def test_dynamic_padding_runs_shorter_forwards_without_hooks(store_dir):
    # A budget that keeps every block at every length: once two hooked forwards ran the plan,
    # each forward no longer than the longest hooked one runs without hooks (but one in 16);
    # a longer one (160) is hooked, and becomes the ceiling.
    flags = []
    steps, grads, _ = run(store_dir, 1 << 30, PADDED, flags)
    _, want, _ = run(store_dir, lengths=PADDED)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in grads)
    assert all(code(ran) == "k" * N for _, ran, _, _ in steps)
    ceiling, seen = 0, []
    for L, unhooked in zip(PADDED, flags, strict=True):
        assert not unhooked or L <= ceiling, (L, ceiling, flags)
        if not unhooked:
            ceiling = max(ceiling, L)
        seen.append(unhooked)
    # Hooked: 1 (no plan), 2-5 (64, 96, 128 each a new ceiling, then one under it), 10 (160
    # passes 128, woken at its first block), 11 and 12 (after a new ceiling, two as planned).
    assert [i + 1 for i, u in enumerate(seen) if not u] == [1, 2, 3, 4, 5, 10, 11, 12], seen


def test_a_model_whose_saved_bytes_follow_its_data_stays_hooked_under_dynamic_padding(store_dir):
    # Its two hooked forwards at length 64 saved other bytes: only the ceiling's own inputs may
    # go without hooks since, and there too its forwards never save alike twice.
    from .test_settled import _varying

    flags = []
    _, grads, _ = run(store_dir, 1 << 30, PADDED, flags, prepare=_varying)
    _, want, _ = run(store_dir, lengths=PADDED, prepare=_varying)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in grads)
    assert not any(flags), flags


def test_dynamic_padding_without_hooks_stays_within_a_budget_that_recomputes(store_dir, monkeypatch):
    # As the test above, within the budget of the varying-length test: the plans keep and
    # recompute (as the step's timings have them: some settle). Every step, those without
    # hooks included, stays within its budget.
    _steady(monkeypatch)
    counts = {L: count(L) for L in set(PADDED)}
    budget = int(1.05 * peak(counts[64], [Action.KEEP] * N, Transfers(INF, INF)))
    flags = []
    steps, grads, tr = run(store_dir, budget, PADDED, flags)
    _, want, _ = run(store_dir, lengths=PADDED)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in grads)
    tr = dataclasses.replace(tr, write=INF, read=INF, out=None, back=None, host=0)
    rows, over = [], []
    for i, ((L, ran, b, _), unhooked) in enumerate(zip(steps, flags, strict=True)):
        fits = peak(counts[L], [Action.RECOMPUTE_OFFLOAD] * N, tr) <= b
        ratio = peak(counts[L], ran, tr) / b
        rows.append(f"step {i} length {L:3d} ran {code(ran)}{' unhooked' if unhooked else ''}: {ratio:.3f}x budget")
        if fits and ratio > 1 + SLACK:
            over.append(i)
    print("\n".join(rows))
    assert not over, f"steps {over} pass the budget {budget}:\n" + "\n".join(rows)


def test_inputs_that_crept_back_to_an_earlier_size_give_no_exponent():
    # Lengths 20, then 21, 22 ... 30 (each within 10% of the last: measured as one size), after
    # 30: the block's two measurements are both at 30. Bytes over inputs there is 0 / 0.
    from ssdtier.offload.profile import UNSEEN, Profile

    p = Profile(1, None, lambda: 0.0, True)
    p.other[0], p.full[0] = (3000, 30), (3000, 30)
    assert p._exponent(0) is None and p.exponent() == UNSEEN
    p.full[0] = (1600, 20)
    assert p._exponent(0) == pytest.approx(math.log(3000 / 1600) / math.log(1.5))


def test_a_plan_chosen_at_a_longer_forward_stands_through_shorter_ones(store_dir, monkeypatch):
    # A faster plan solved from a shorter forward would not fit the longer ones: each longer
    # forward after it would have its guard recompute blocks with their inputs offloaded. The
    # plan changes only after a forward at least as long as any it was chosen at.
    _steady(monkeypatch)
    budget = int(1.05 * peak(count(64), [Action.KEEP] * N, Transfers(INF, INF)))
    plans = []

    def look(off):
        plans.append(code(off.adaptive.plan.actions) if off.adaptive.plan else None)

    flags = []
    steps, grads, _ = run(store_dir, budget, PADDED, flags, on_step=look)
    _, want, _ = run(store_dir, lengths=PADDED)
    assert grads.keys() == want.keys() and all(torch.equal(grads[k], want[k]) for k in grads)
    rows = "\n".join(f"{L} ran {code(ran)}, plan {p}" for (L, ran, _, _), p in zip(steps, plans, strict=True))
    longest = 0
    for i, (L, ran, _, _) in enumerate(steps):
        if i >= 2 and plans[i] != plans[i - 1]:  # solved at step i's start from step i - 1's numbers
            assert PADDED[i - 1] >= longest, f"step {i}:\n{rows}"
        if i >= 3 and L < 128:  # under the plan chosen at 128: run as planned, the guard idle
            assert code(ran) == plans[i], f"step {i}:\n{rows}"
        if not flags[i]:
            longest = max(longest, L)


def test_a_plan_for_longer_inputs_gives_way_after_eight_shorter_forwards(store_dir, monkeypatch):
    # Only shorter forwards since: after 8 of them measured, the plan is solved for them.
    from ssdtier.offload import settled

    _steady(monkeypatch)
    monkeypatch.setattr(settled, "MEASURE", 2)  # every other forward hooked, not one in 16
    budget = int(1.05 * peak(count(64), [Action.KEEP] * N, Transfers(INF, INF)))
    lengths = (128,) * 3 + (64,) * 24
    plans, flags = [], []

    def look(off):
        plans.append(off.adaptive.plan and code(off.adaptive.plan.actions))

    run(store_dir, budget, lengths, flags, on_step=look)
    changed = [i for i in range(4, len(plans)) if plans[i] != plans[i - 1]]
    assert changed and plans[changed[0]].count("r") < plans[3].count("r"), plans
    hooked = sum(1 for f in flags[3 : changed[0]] if not f)  # shorter forwards measured before it
    assert hooked >= LONGEST, (hooked, flags, plans)


def test_a_block_recomputed_at_a_larger_batch_grows_as_its_siblings_did(store_dir, monkeypatch):
    # Blocks measured whole at batches 2 and 4 saved about twice as much at 4: the last block,
    # recomputed at 4, is estimated as they grew, not as attention's scores would (4x).
    from ssdtier.offload.adaptive import Adaptive
    from ssdtier.plan import Action

    from .test_rok import GPT, adaptive, forced, steps

    K = Action.KEEP
    forced(monkeypatch, (K,) * 4)
    seen = []
    monkeypatch.setattr(Adaptive, "_adopt", lambda self, blocks, *a: seen.append(blocks))

    def next_step(off):
        off.set_actions((K, K, K, Action.RECOMPUTE))

    steps(GPT, adaptive(store_dir), batches=(2, 4, 4), on_step=next_step)
    at2, at4 = seen[0], seen[1]
    assert at4[1].bytes == pytest.approx(2 * at2[1].bytes, rel=0.05)  # measured whole at both
    assert at4[3].bytes == pytest.approx(2 * at2[3].bytes, rel=0.05), (at2[3].bytes, at4[3].bytes)
