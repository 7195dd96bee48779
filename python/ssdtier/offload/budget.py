"""``policy.device_budget = "auto"``: how many bytes of activations the GPU has room to keep,
measured before each step (docs/offloader.md#the-device-budget)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sizes import GiB

MARGIN_SHARE = 0.05  # of the memory this process may use, left for fragmentation and what varies
MARGIN_MIN = 1 * GiB
RETRY_CUT = 0.9  # after an allocation was retried (the GPU was full), keep this share of the last


@dataclass(frozen=True)
class Memory:
    """The GPU's memory as this process sees it."""

    free: int  # what this process may still reserve (cudaMemGetInfo's free, within its memory fraction)
    total: int  # what this process may use: the GPU's memory, or its per-process fraction of it
    reserved: int  # by this process's caching allocator
    allocated_peak: int  # the most allocated at once since the peak counters were last reset
    retries: int  # allocations retried after emptying the allocator's cache, so far

    @staticmethod
    def of(device: torch.device) -> Memory:
        free, total = torch.cuda.mem_get_info(device)
        st = torch.cuda.memory_stats(device)
        reserved = st.get("reserved_bytes.all.current", 0)
        # torch.cuda.set_per_process_memory_fraction: the allocator's limit, not the device's.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        if fraction < 1.0:
            total = int(total * fraction)
            free = max(0, min(free, total - reserved))
        return Memory(free, total, reserved, st.get("allocated_bytes.all.peak", 0), st.get("num_alloc_retries", 0))


class AutoBudget:
    """Before each step: the memory this process can have (free and its allocator's cache),
    less a margin, less what is not kept activations at the peak, less the sources whose
    copies out were queued at once in the last step (freed, yet reserved until copied).
    The part not kept is learned when a step sets a new peak: the peak less the most bytes
    kept in that step. Keeping d bytes more raises any moment of a step by at most d, so the
    next peak stays within reach. After a retried allocation (the GPU ran full), less than
    the last step kept."""

    def __init__(self) -> None:
        self.peak = -1  # the allocator's peak at the last look
        self.other: int | None = None  # bytes at the peak that are not kept activations
        self.retries: int | None = None

    def next(self, kept: int, queued: int, mem: Memory) -> int | None:
        """The budget for the step about to start, after a step that kept at most ``kept``
        bytes with at most ``queued`` bytes of copies out queued; None at the first look,
        before any step was seen."""
        first = self.retries is None
        retried = not first and mem.retries > (self.retries or 0)
        self.retries = mem.retries
        # A new peak (or the counters were reset since) is the last step's; an older one is
        # at least the last step's, so the first estimate errs toward keeping less.
        if not first and (mem.allocated_peak != self.peak or self.other is None):
            self.other = max(0, mem.allocated_peak - kept)
        self.peak = mem.allocated_peak
        if self.other is None:
            return None
        margin = max(int(mem.total * MARGIN_SHARE), MARGIN_MIN)
        budget = max(0, mem.free + mem.reserved - margin - self.other - queued)
        if retried:
            self.other += margin  # it was more than seen: room for it
            budget = min(budget, int(kept * RETRY_CUT))
        return budget
