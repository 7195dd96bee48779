"""device_budget = "auto": the GPU memory read and the budget made of it (no GPU needed)."""

from __future__ import annotations

import pytest


def test_an_auto_device_budget_leaves_what_is_not_held_activations_and_a_margin():
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
    # The retry's margin stays while retries come: 60 - 5 - 15 - 5 ...
    ab.sample(40 * g, 25 * g)
    assert ab.next(25 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 3)) == 35 * g
    # ... and goes after eight steps without one.
    for _ in range(AutoBudget.QUIET - 2):
        ab.sample(40 * g, 25 * g)
        assert ab.next(25 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 3)) == 35 * g
    ab.sample(40 * g, 25 * g)
    assert ab.next(25 * g, 0, Memory(20 * g, 100 * g, 40 * g, 11 * g, 3)) == 40 * g
    # A small GPU's margin is 1 GiB at least, and no room at all keeps nothing.
    small = AutoBudget()
    small.next(0, 0, Memory(4 * g, 8 * g, 1 * g, 1 * g, 0))
    small.sample(2 * g, 1 * g)
    assert small.next(1 * g, 0, Memory(4 * g, 8 * g, 2 * g, 2 * g, 0)) == 4 * g
    small.sample(9 * g, 1 * g)
    assert small.next(1 * g, 0, Memory(0, 8 * g, 2 * g, 9 * g, 0)) == 0


def test_an_auto_budget_counts_a_steps_peak_read_in_its_backward():
    # A loop that resets the peak counters before each step (as plan_trace does) leaves the
    # next look only the reset: the samples between blocks miss the loss's backward (its
    # gradient of the logits, 3.9 GiB at batch 16 on the H100). The peak read as the
    # backward reached the first block has it.
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(60 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    ab.sample(30 * g, 14 * g)  # 16 GiB beside the activations, 10 of them before the step
    reset = Memory(50 * g, 100 * g, 20 * g, 10 * g, 0, 10 * g)  # the counter reset: 10 GiB
    assert ab.next(14 * g, 0, reset) == (70 - 5 - 10 - 6) * g
    ab.sample(30 * g, 14 * g)
    assert ab.next(14 * g, 0, reset, step_peak=34 * g) == (70 - 5 - 10 - 10) * g
    assert "the step's peak counter" in ab.explain()


def test_after_forwards_without_hooks_the_peak_counter_is_not_read_nor_a_budget_raised():
    # Forwards without hooks held activations nothing counted: a peak counter they may have
    # set (a longer step under the ceiling, after a loop reset the counters) is not the last
    # hooked step's, and its samples alone would forget what the counter showed before.
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(60 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    ab.sample(20 * g, 4 * g)  # 16 GiB beside the activations, 10 before the step; the peak: 26
    assert ab.next(4 * g, 0, Memory(50 * g, 100 * g, 20 * g, 36 * g, 0, 10 * g)) == (70 - 5 - 10 - 22) * g
    ab.sample(16 * g, 4 * g)  # 12 GiB sampled; a peak of 50 GiB, of an unhooked step's
    peak = Memory(50 * g, 100 * g, 20 * g, 50 * g, 0, 10 * g)
    assert ab.next(4 * g, 0, peak, unhooked=True) == (70 - 5 - 10 - 22) * g  # as it was
    assert ab.next(4 * g, 0, peak) == (70 - 5 - 10 - 22) * g  # no new peak since: as it was
    ab.sample(40 * g, 4 * g)  # samples that saw more raise what is set beside the activations
    assert ab.next(4 * g, 0, peak, unhooked=True) == (70 - 5 - 10 - 26) * g


def test_an_auto_budget_counts_what_was_allocated_after_the_step_it_measured():
    # The optimizer's state appears after the first step (20 GiB for AdamW): the 6 GiB the
    # step added beside its activations come on top of it, not in place of it.
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(60 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    ab.sample(30 * g, 14 * g)
    assert ab.next(14 * g, 0, Memory(30 * g, 100 * g, 30 * g, 30 * g, 0, 30 * g)) == (60 - 5 - 30 - 6) * g
    # A process capped to a little memory leaves a fifth of it, not a whole GiB.
    small = AutoBudget()
    small.next(0, 0, Memory(450 << 20, 600 << 20, 150 << 20, 150 << 20, 0, 100 << 20))
    small.sample(200 << 20, 50 << 20)
    assert small.next(50 << 20, 0, Memory(450 << 20, 600 << 20, 150 << 20, 200 << 20, 0, 100 << 20)) == (
        (600 - 120 - 100 - 50) << 20
    )


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


def test_the_margin_is_at_least_what_the_allocator_reserved_past_its_peak():
    # H200 run 4: ssdtier's rows reserved up to 9 GiB past their allocated peak at batch 8 (a
    # second stream's pool, fragmentation), more than the 5% margin at larger batches: a
    # budget that fills the GPU to its margin ran into retried allocations. The margin takes
    # the most seen, capped at a quarter of the memory, and keeps it.
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(50 * g, 100 * g, 10 * g, 12 * g, 0))
    ab.sample(20 * g, 2 * g)
    assert ab.next(2 * g, 0, Memory(50 * g, 100 * g, 10 * g, 20 * g, 0, 0, 23 * g)) == 37 * g  # 3 past: the 5 stand
    ab.sample(20 * g, 2 * g)
    assert ab.next(2 * g, 0, Memory(50 * g, 100 * g, 10 * g, 20 * g, 0, 0, 32 * g)) == 30 * g  # 12 past
    assert "a margin of 12GiB (what the allocator reserved past its peak)" in ab.explain()
    ab.sample(20 * g, 2 * g)
    assert ab.next(2 * g, 0, Memory(50 * g, 100 * g, 10 * g, 20 * g, 0, 0, 21 * g)) == 30 * g  # kept
    ab.sample(20 * g, 2 * g)
    assert ab.next(2 * g, 0, Memory(50 * g, 100 * g, 10 * g, 20 * g, 0, 0, 90 * g)) == 17 * g  # a quarter at most


def test_a_loop_that_resets_the_peak_counters_does_not_make_the_cache_a_margin():
    # Reset before each step, the counters at its start set the whole cache (the last step's
    # activations) against what outlives a step: the margin reads them as the step's backward
    # ended instead, where both peaks are the step's.
    from ssdtier.offload.budget import AutoBudget, Counters, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(50 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    reset = Memory(40 * g, 100 * g, 60 * g, 10 * g, 0, 10 * g, 60 * g)  # peak = allocated, cache 60
    ab.sample(20 * g, 2 * g)
    ab.next(40 * g, 0, reset, step_peak=58 * g, end=Counters(58 * g, 12 * g, 62 * g))
    assert ab.parts[2] == 5 * g  # 4 past the peak in the step: the 5% stand
    ab.sample(20 * g, 2 * g)
    ab.next(40 * g, 0, reset, step_peak=58 * g, end=Counters(58 * g, 12 * g, 70 * g))
    assert ab.parts[2] == 12 * g
    # Not reset since the backward's end: the counters now count too (the optimizer's step).
    ab.sample(20 * g, 2 * g)
    ab.next(40 * g, 0, Memory(40 * g, 100 * g, 60 * g, 58 * g, 0, 10 * g, 73 * g), end=Counters(58 * g, 12 * g, 70 * g))
    assert ab.parts[2] == 15 * g


def test_a_step_that_sets_no_new_peak_does_not_forget_what_the_last_peak_showed():
    # The loss's backward makes the logits' gradient (9.8 GiB at batch 40 on the H200) between
    # two samples: only a peak counter sees it. An identical step after it passes no peak, and
    # its samples alone would raise the budget by those bytes.
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(60 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    ab.sample(30 * g, 14 * g)  # 6 GiB beside the activations, 10 before the step; the peak: 40
    step = Memory(50 * g, 100 * g, 20 * g, 40 * g, 0, 10 * g)
    assert ab.next(14 * g, 0, step) == (70 - 5 - 10 - 16) * g
    for _ in range(3):
        ab.sample(30 * g, 14 * g)
        assert ab.next(14 * g, 0, step) == (70 - 5 - 10 - 16) * g
    # A step that held more activations under the same peak made less beside them: bounded.
    ab.sample(34 * g, 22 * g)
    assert ab.next(22 * g, 0, step) == (70 - 5 - 10 - 8) * g
    ab.sample(30 * g, 14 * g)
    assert ab.next(14 * g, 0, step) == (70 - 5 - 10 - 8) * g
    # The loop reset the counters after a step (a memory log): the peak as its backward ended bounds it.
    from ssdtier.offload.budget import Counters

    reset = Memory(50 * g, 100 * g, 20 * g, 24 * g, 0, 10 * g)
    ab.sample(30 * g, 14 * g)
    assert ab.next(14 * g, 0, reset, end=Counters(40 * g, 30 * g, 42 * g)) == (70 - 5 - 10 - 8) * g


def test_a_larger_forward_is_cut_from_the_step_that_made_the_most():
    # Under dynamic padding the last hooked step may be short (one in 16 is measured) while
    # what is made beside the activations was learned at a long one, and not lowered since by
    # unhooked steps. A forward at that long one's inputs needs no cut.
    from ssdtier.offload.budget import AutoBudget, Memory

    g = 1 << 30
    ab = AutoBudget()
    ab.next(0, 0, Memory(60 * g, 100 * g, 10 * g, 12 * g, 0, 10 * g))
    ab.sample(30 * g, 14 * g)  # 6 GiB beside the activations at inputs of 400 bytes
    mem = Memory(50 * g, 100 * g, 10 * g, 30 * g, 0, 10 * g)
    assert ab.next(14 * g, 0, mem, inputs=400) == 39 * g
    ab.sample(20 * g, 7 * g)  # a short step, after unhooked ones: 3 GiB, not lowered
    assert ab.next(7 * g, 0, mem, unhooked=True, inputs=100) == 39 * g
    assert ab.grown(4.0, 400) == 39 * g  # four times the last hooked step, as long as the one that made 6
    assert ab.grown(4.0, 800) == 33 * g
    assert ab.grown(4.0) == 21 * g  # inputs not known: the ratio as given


MiB, G = 1 << 20, 1 << 30


def logits(batch: int) -> int:
    return 125 * batch * MiB


def gradient(batch: int) -> int:  # the logits', in fp32
    return 251 * batch * MiB


class _Loop:
    """A training loop driving AutoBudget as adaptive does, on a toy allocator with the H200's
    numbers: 139 GiB to use (of 140), 21 allocated between steps, 3.39 GiB of activations per
    sample of batch (24 blocks); logits (4.9 GiB at batch 40) from a forward's end to its
    backward, their fp32 gradient (9.8) between two samples. The allocator reserves ``over``
    past what is allocated; ``reset``: the loop resets the peak counters before each step."""

    def __init__(self, over: float = 6, reset: bool = False) -> None:
        from ssdtier.offload.budget import AutoBudget

        self.auto, self.over, self.reset = AutoBudget(), int(over * G), reset
        self.now = self.peak = self.reserved = self.top = 21 * G
        self.held = self.held_peak = self.worst = self.batch = 0
        self.mark = self.end = None
        self.alone = False  # the last forward had no backward yet
        self.budgets: list[int] = []

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)
        self.reserved = max(self.reserved, self.now + self.over)
        self.top, self.worst = max(self.top, self.reserved), max(self.worst, self.now + self.over)

    def memory(self):
        from ssdtier.offload.budget import Memory

        return Memory(139 * G - self.reserved, 140 * G, self.reserved, self.peak, 0, self.now, self.top)

    def counters(self):
        from ssdtier.offload.budget import Counters

        return Counters(self.peak, self.now, self.top)

    def sample(self, ended: bool = False) -> None:
        self.held_peak = max(self.held_peak, self.held)
        self.auto.sample(self.now, self.held, ended=ended)

    def forward(self, batch: int) -> tuple[int, int]:
        held, self.held_peak = self.held_peak, self.held
        mark, end = self.mark, self.end
        step_peak = end.peak if mark is not None and end is not None and end.peak > mark.peak else None
        memory, batch_was = self.memory(), self.batch
        got = self.auto.next(held, 0, memory, step_peak, end, inputs=batch_was, alone=self.alone, holding=self.held)
        budget = self.auto.first() if got is None else got
        if self.batch and batch > self.batch:  # adaptive's grew()
            budget = min(budget, self.auto.grown(batch / self.batch, batch))
        self.batch = batch
        self.budgets.append(budget)
        self.mark, self.end = self.counters(), None
        kept = max(0, min(budget - self.held, 3471 * batch * MiB))  # the guard counts what is held
        self.alloc(kept + logits(batch))
        self.held += kept
        self.sample(ended=True)
        self.alone = True
        return kept, batch

    def backward(self, *forwards: tuple[int, int]) -> None:
        for kept, batch in reversed(forwards):
            self.alloc(gradient(batch))  # only the peak counter sees it
            self.now -= gradient(batch)
            self.sample()
            self.now -= kept + logits(batch)
            self.held -= kept
            self.sample()
        self.end, self.alone = self.counters(), False

    def step(self, *batches: int) -> None:
        if self.reset:
            self.peak, self.top = self.now, self.reserved
        self.backward(*[self.forward(b) for b in batches])


def test_several_forwards_before_one_backward_share_the_budget_of_their_cycle():
    # Gradient accumulation: at the second forward's look forward 1's activations are allocated
    # and held both. Learned from there, the next budget left out the logits' gradient and both
    # forwards' logits (simulated on the H200: 116 GiB for 97 of room, a peak of 152 of 139).
    for reset in (False, True):
        two = _Loop(reset=reset)
        for _ in range(4):
            two.step(40, 40)
        assert two.auto.made >= 2 * logits(40) + gradient(40)
        assert two.worst <= 139 * G  # what was allocated and what the allocator reserved past it
        assert two.budgets[2:] == [two.budgets[2]] * 6  # the cycle's budget at each of its forwards
    # Two forwards of 20 hold what one of 40 would, and make less beside: no less room for them.
    one, half = _Loop(), _Loop()
    for _ in range(4):
        one.step(40)
        half.step(20, 20)
    assert one.worst <= 139 * G and half.worst <= 139 * G
    assert one.budgets[-1] <= half.budgets[-1] <= one.budgets[-1] + 5 * G
    # The GPU ran full in forward 1: the second keeps no more than is held.
    from ssdtier.offload.budget import Memory

    m = half.memory()
    half.forward(20)
    retried = Memory(m.free, m.total, m.reserved, m.allocated_peak, 1, half.now, m.reserved_peak)
    assert half.auto.next(half.held, 0, retried, alone=True) == half.held


def test_an_evaluation_forward_with_gradients_learns_nothing_from_its_look():
    # Reset before each training step, the look after an evaluation run with gradients (no
    # backward) saw a reset peak and only that forward's samples: 4.9 GiB made, not 14.7.
    loop = _Loop(reset=True)
    for _ in range(3):
        loop.step(40)
    kept, batch = loop.forward(40)
    loop.now -= kept + logits(batch)  # the graph dropped
    loop.held -= kept
    for _ in range(2):
        loop.step(40)
    assert loop.auto.made >= logits(40) + gradient(40)
    assert loop.budgets[2:] == [loop.budgets[2]] * 4 and loop.worst <= 139 * G


def test_a_smaller_step_after_a_reset_does_not_make_the_idle_cache_a_margin():
    # Reset before each step, the reserved peak starts at the whole cache: a partial batch of
    # 12 after batches of 40 read 72 GiB past its peak, kept as a 35 GiB margin for good.
    loop = _Loop(reset=True)
    for b in (40, 40, 12, 40, 40):
        loop.step(b)
        assert loop.auto.parts[2] == int(140 * G * 0.05) and loop.worst <= 139 * G
    # An allocator that reserves 10 GiB past what is allocated: the margin is that.
    loop = _Loop(over=10, reset=True)
    for b in (40, 40, 12, 40, 40):
        loop.step(b)
    assert loop.auto.parts[2] == 10 * G and loop.worst <= 139 * G


def test_a_cut_after_a_retry_stands_at_the_cycles_later_forwards():
    from ssdtier.offload.budget import AutoBudget, Memory

    ab = AutoBudget()
    ab.next(0, 0, Memory(100 * G, 140 * G, 30 * G, 30 * G, 0, 21 * G, 30 * G))
    ab.sample(30 * G, 4 * G)
    assert ab.next(4 * G, 0, Memory(100 * G, 140 * G, 30 * G, 30 * G, 0, 21 * G, 30 * G)) == 97 * G  # 123 - 21 - 5
    cut = ab.next(50 * G, 0, Memory(100 * G, 140 * G, 30 * G, 30 * G, 1, 21 * G, 30 * G))
    assert cut == 45 * G  # the GPU ran full: 0.9 of what the step held
    # The cycle's second forward, no retry since: the cut holds, and usable() is memory now.
    alone = Memory(60 * G, 140 * G, 70 * G, 70 * G, 1, 61 * G, 70 * G)
    assert ab.next(40 * G, 0, alone, alone=True) == cut
    assert ab.usable() == 60 * G + 70 * G


def test_a_reserve_that_did_not_grow_is_no_overhead_without_the_backwards_counters():
    from ssdtier.offload.budget import AutoBudget, Memory

    ab = AutoBudget()
    ab.next(0, 0, Memory(50 * G, 140 * G, 80 * G, 75 * G, 0, 21 * G, 80 * G))
    assert ab.parts[2] == 7 * G  # 5 GiB past the peak: the 5% margin
    # The counters reset, then a smaller step: the cache of 80 GiB was there before it.
    ab.next(0, 0, Memory(50 * G, 140 * G, 80 * G, 40 * G, 0, 21 * G, 80 * G))
    assert ab.parts[2] == 7 * G
    # A step that grew the reserve 12 GiB past its peak: that is the margin.
    ab.next(0, 0, Memory(40 * G, 140 * G, 90 * G, 78 * G, 0, 21 * G, 90 * G))
    assert ab.parts[2] == 12 * G


@pytest.mark.parametrize("reset", [False, True])
def test_more_forwards_per_backward_than_measured_leave_room_for_their_outputs(reset):
    # Accumulation rises from 1 to 3 forwards per backward: each leaves its logits (2.4 GiB at
    # batch 20) beside its activations, which the budget measured on one forward did not hold.
    # The looks before forwards 2 and 3 see them, and foresee one forward more (before: 142.9
    # GiB of 139 in the first such cycle).
    for first in (((20,),) * 3, ((20, 20, 20),) * 3 + ((20,),) * 2):
        loop = _Loop(reset=reset)
        for b in first:
            loop.step(*b)
        for _ in range(3):
            loop.worst = 0
            loop.step(20, 20, 20)
            assert loop.worst <= 139 * G, (first, loop.worst / G)
        assert loop.budgets[-3:] == [loop.budgets[-1]] * 3  # steady: the cycle's budget at each forward


@pytest.mark.parametrize("reset", [False, True])
def test_an_evaluation_loop_with_gradients_is_not_taken_for_forwards_to_come(reset):
    # 50 forwards with gradients and no backward, each loss kept until the next: the cycle's
    # count of forwards, taken as what accumulation will run, had cut the budget to 0.
    loop = _Loop(reset=reset)
    for _ in range(4):
        loop.step(20, 20)
    before = loop.budgets[-1]
    last = None
    for _ in range(50):
        kept, batch = loop.forward(64)
        if last is not None:  # the last loss dropped
            loop.now -= last[0] + logits(last[1])
            loop.held -= last[0]
        last = (kept, batch)
    loop.now -= last[0] + logits(last[1])
    loop.held -= last[0]
    for _ in range(3):
        loop.step(20, 20)
    assert min(loop.budgets[-4:]) >= before - 8 * G, [b / G for b in loop.budgets[-4:]]
    # Two losses of batch 64 alive at once, after a budget measured at 20 (143.8 GiB before).
    assert loop.worst <= 141 * G, loop.worst / G
