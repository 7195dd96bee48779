"""``policy.device_budget = "auto"``: how many bytes of activations the GPU has room to keep,
measured before each step (docs/planner.md#the-device-budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..sizes import GiB, format_size

MARGIN_SHARE = 0.05  # of the memory this process may use, left for fragmentation and what varies
MARGIN_MIN = 1 * GiB  # ... but at most MARGIN_CAP of it: a process capped to little memory
MARGIN_CAP = 0.2
RETRY_CUT = 0.9  # after an allocation was retried (the GPU was full), keep this share of the last
OVERHEAD_CAP = 0.25  # of the memory: the most the allocator's reserve past its peak may take as margin


@dataclass(frozen=True)
class Memory:
    """The GPU's memory as this process sees it."""

    free: int  # what this process may still reserve (cudaMemGetInfo's free, within its memory fraction)
    total: int  # what this process may use: the GPU's memory, or its per-process fraction of it
    reserved: int  # by this process's caching allocator
    allocated_peak: int  # the most allocated at once since the peak counters were last reset
    retries: int  # allocations retried after emptying the allocator's cache, so far
    allocated: int = 0  # now: before a step, what outlives it (parameters, optimizer state)
    reserved_peak: int = 0  # the most reserved at once, counted since the same reset


class Counters(NamedTuple):
    """The allocator's counters at one moment (peaks since they were last reset)."""

    peak: int  # allocated
    allocated: int
    reserved_peak: int = 0


class Gpu:
    """Reads one GPU's memory (tests give adaptive mode a stand-in)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def memory(self) -> Memory:
        free, total = torch.cuda.mem_get_info(self.device)
        st = torch.cuda.memory_stats_as_nested_dict(self.device)
        reserved = _stat(st, "reserved_bytes", "current")
        # torch.cuda.set_per_process_memory_fraction: the allocator's limit, not the device's.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(self.device)
        if fraction < 1.0:
            total = int(total * fraction)
            free = max(0, min(free, total - reserved))
        peak, now = _stat(st, "allocated_bytes", "peak"), _stat(st, "allocated_bytes", "current")
        top = _stat(st, "reserved_bytes", "peak")
        return Memory(free, total, reserved, peak, st.get("num_alloc_retries", 0), now, top)

    def allocated(self) -> int:
        return self.counters()[1]

    def reset_peak(self) -> None:
        """A higher peak of an earlier phase (another model, a larger batch) would hide the
        training's own: the counters start again from what is allocated now."""
        torch.cuda.reset_peak_memory_stats(self.device)

    def counters(self) -> Counters:
        st = torch.cuda.memory_stats_as_nested_dict(self.device)
        peak, now = _stat(st, "allocated_bytes", "peak"), _stat(st, "allocated_bytes", "current")
        return Counters(peak, now, _stat(st, "reserved_bytes", "peak"))


def _stat(st: dict, name: str, which: str) -> int:
    """One of the allocator's counters, all pools together (0 before CUDA has started)."""
    return st.get(name, {}).get("all", {}).get(which, 0)


class AutoBudget:
    """Before each step: the memory this process can have (free and its allocator's cache),
    less a margin, what is allocated now (parameters, optimizer state), the most the last
    step made beside the activations held (sampled, and from the peak counters), and the
    copies out queued at once. After a retried allocation, less than the last step held.
    ``grown(r)``: for a step that saves r times more (docs/planner.md#the-device-budget)."""

    QUIET = 8

    def __init__(self) -> None:
        self.peak = -1  # the allocator's peak counter at the last look
        self.made: int | None = None  # the most bytes a step added at once that were not held activations
        self.made_inputs = 0  # ... that step's first block's input bytes (0: not known)
        self.made_left = 0  # ... what its forwards left allocated beside their activations (logits)
        self.made_ran = 1  # ... its forwards
        self.left = 0  # ... in the cycle under way, so far
        self.ran = 1  # ... its forwards begun so far
        self.sampled: int | None = None  # ... in the step under way, from the samples
        self.where = ""  # the sample that set ``sampled``: its layer, or the forward's end
        self.made_at = ""  # ... that set ``made``: a sample's, or the peak counter
        self.retries: int | None = None
        self.cut: int | None = None  # what the last step held when a retry cut the budget
        self.extra = 0  # a margin more after a retry: the GPU ran full with what was seen
        self.overhead = 0  # the most reserved past the allocated peak (fragmentation, other pools)
        self.reserved = 0  # at the last look not ``alone``: a reserve not grown past it shows no overhead
        self.overhead_won = False  # ... and the margin is that, not a share of the memory
        self.quiet = 0  # steps since the last retry
        self.room: int | None = None  # at the last look: the memory for activations and the rest
        # At the last look not ``alone``: allocated before the step (an optimizer's state appears after the first).
        self.base = 0
        self.parts = (0, 0, 0, 0)  # at the last look: free, cached, margin, queued
        self.cycle: int | None = None  # the budget that look gave: ``alone`` ones give no more
        self.pending_unhooked = False  # passed at ``alone`` looks since that one, for the next
        self.pending_queued = 0

    def sample(self, allocated: int, held: int, where: str = "", ended: bool = False) -> None:
        """Allocated beside the ``held`` activations at ``where``; ``ended``: a forward's end."""
        other = allocated - held
        if ended:
            self.left = max(self.left, other - self.base)
        if self.sampled is None or other > self.sampled:
            self.sampled, self.where = other, where

    def first(self) -> int | None:
        """Before any step was measured: half of what is neither in use nor the margin."""
        if self.room is None:
            return None
        return max(0, self.room - self.base) // 2

    def next(
        self,
        held: int,
        queued: int,
        mem: Memory,
        step_peak: int | None = None,
        end: Counters | None = None,
        unhooked: bool = False,
        inputs: int = 0,
        *,
        alone: bool = False,
        holding: int | None = None,
    ) -> int | None:
        """The budget for the step about to start, after a step that held at most ``held``
        bytes of activations with at most ``queued`` bytes of copies out queued and, if it set
        a new one, reached the allocator's peak ``step_peak``; ``end``: the counters as its
        backward ended. ``unhooked``: steps without hooks ran since, so the allocator's peak
        may be theirs (held nothing counted): not read, and what was learned is not lowered.
        ``inputs``: the last step's first block's input bytes. None at the first look, before
        any step was seen. ``alone``: the last hooked forward had no backward yet (one of several
        before one backward, an evaluation's with gradients): see ``_alone``. ``holding``: the
        activations held now, if not ``held``."""
        if alone and self.retries is not None:
            return self._alone(held, held if holding is None else holding, queued, mem, unhooked)
        unhooked, self.pending_unhooked = unhooked or self.pending_unhooked, False
        queued, self.pending_queued = max(queued, self.pending_queued), 0
        first = self.retries is None
        retried = not first and mem.retries > (self.retries or 0)
        self.retries = mem.retries
        seen = [] if self.sampled is None else [(self.sampled, self.where)]
        new_peak = not first and not unhooked and mem.allocated_peak > self.peak  # set in the last step
        if new_peak:
            seen.append((mem.allocated_peak - held, "the peak counter"))
        if not first and step_peak is not None:  # ... where a loop resets the counter before each step
            seen.append((step_peak - held, "the step's peak counter"))
        same_peak = mem.allocated_peak == self.peak
        self.peak, self.sampled, left, self.left, ran, self.ran = mem.allocated_peak, None, self.left, 0, self.ran, 1
        if seen:
            most, at = max(seen)
            made = max(0, most) - self.base
            if self.made is not None and not new_peak and step_peak is None and (same_peak or end is not None):
                # Samples alone miss what is made between them (the loss's backward): a peak
                # counter not passed (as the backward ended, if reset since) only bounds it.
                top = max(mem.allocated_peak, end.peak if end is not None else 0)
                made = max(made, min(self.made, top - held - self.base))
            if not unhooked or self.made is None or made > self.made:
                if made != self.made:  # (kept by the bound: still the step's that made it)
                    self.made_inputs, self.made_left, self.made_ran = inputs, left, ran
                self.made, self.made_at = made, at
        margin = max(int(mem.total * MARGIN_SHARE), min(MARGIN_MIN, int(mem.total * MARGIN_CAP)))
        # Past the peak as the step's backward ended, and now unless a loop reset the counters
        # since (now would set the whole cache against what is allocated between steps). Only
        # where the reserve grew: a cache a smaller step left idle after a reset is no overhead.
        pasts = [end.reserved_peak - end.peak] if end is not None and end.reserved_peak > self.reserved else []
        if (end is None or mem.allocated_peak >= end.peak) and mem.reserved_peak > self.reserved:
            pasts.append(mem.reserved_peak - mem.allocated_peak)
        if pasts:  # never less: a plan that frees it might not hold
            self.overhead = max(self.overhead, min(max(pasts), int(mem.total * OVERHEAD_CAP)))
        self.reserved = mem.reserved
        self.overhead_won = self.overhead > margin
        margin = max(margin, self.overhead)
        self.quiet = 0 if retried else self.quiet + 1
        if self.quiet >= self.QUIET:
            self.extra, self.cut = 0, None
        self.room, self.base = mem.free + mem.reserved - margin - self.extra - queued, mem.allocated
        self.parts = (mem.free, mem.reserved, margin + self.extra, queued)
        if self.made is None or first:
            self.cycle = None
            return None
        budget = max(0, self.room - self.base - max(self.made, 0))
        if retried and self.cut is not None and held <= self.cut:
            budget = min(budget, held)  # retried after a cut too: keeping less is not the cure
        elif retried:
            self.extra = margin
            self.cut = held
            budget = min(budget, int(held * RETRY_CUT))
        self.cycle = budget
        return budget

    def _alone(self, held: int, holding: int, queued: int, mem: Memory, unhooked: bool) -> int | None:
        """A look after a forward no backward followed: allocated now are its activations, which
        ``holding`` counts too, and the samples and peak go on to the backward. The budget is the
        cycle's from its start (the guard counts what is held against it), less what the
        forwards so far left beside their activations (outputs, logits) and the one beginning
        will, past what the cycle that measured ``made`` left; past as many forwards as that
        one ran, one more foreseen."""
        done, left = self.ran, mem.allocated - self.base - holding  # (not a dropped graph's, as samples are)
        self.left = max(self.left, left)
        left += max(left, 0) // done * (2 if done >= self.made_ran else 1)
        self.ran += 1
        self.pending_unhooked = self.pending_unhooked or unhooked
        self.pending_queued = max(self.pending_queued, queued)
        margin, queued = self.parts[2], max(self.parts[3], queued)
        self.room = mem.free + mem.reserved - margin - queued
        self.parts = (mem.free, mem.reserved, margin, queued)
        if self.made is None:
            return None
        budget = max(0, self.room - self.base - max(self.made, 0) - max(0, left - self.made_left))
        if self.cycle is not None:  # a retry's cut stands through the cycle
            budget = min(budget, self.cycle)
        if mem.retries > (self.retries or 0):  # the GPU ran full in this forward: no more kept
            budget = min(budget, held)  # (the cut and its margin come at the cycle's end)
        return budget

    def usable(self) -> int:
        """At the last look: memory free or cached."""
        return self.parts[0] + self.parts[1]

    def explain(self) -> str:
        """What the last budget was made of, for the log."""
        if self.room is None:
            return "not measured yet"
        free, reserved, margin, queued = (format_size(x) for x in self.parts)
        made = "nothing measured yet" if self.made is None else format_size(max(self.made, 0))
        at = f" (at {self.made_at})" if self.made is not None and self.made_at else ""
        why = " (what the allocator reserved past its peak)" if self.overhead_won else ""
        return (
            f"{free} free and {reserved} cached, less a margin of {margin}{why} and {queued} of copies queued; "
            f"less {format_size(self.base)} allocated as the step began and {made} the last step added "
            f"beside the activations held{at}"
        )

    def grown(self, ratio: float, inputs: int = 0) -> int | None:
        """The budget for a step that saves ``ratio`` times what the last one did: what was not
        kept activations grows as much, but for what was allocated before the step. With its
        first block's ``inputs``, the ratio is to those of the step that made the most."""
        if self.room is None or self.made is None:
            return None
        if inputs and self.made_inputs:
            ratio = inputs / self.made_inputs
        return max(0, self.room - self.base - int(max(self.made, 0) * ratio))
