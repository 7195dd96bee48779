"""Forwards without hooks. Once adaptive mode's plan moves nothing (each block kept, or
recomputed with its inputs kept) and has settled, a hooked forward with the same inputs
would only count what autograd keeps anyway: it runs without ssdtier's saved-tensor hooks,
at no cost per tensor, and checkpointing recomputes what the plan recomputes. One forward
in ``MEASURE`` is hooked still, and one whose first block takes other inputs is hooked from
that block on (docs/planner.md#a-settled-plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..plan import Action

if TYPE_CHECKING:
    from .adaptive import Adaptive

CALM = 2  # hooked forwards in a row that ran a plan moving nothing as planned, before any goes unhooked
MEASURE = 16  # of this many forwards, one at least is hooked: the plan keeps measuring
ROOM = 0.03  # of the budget: GPU room this much below the last hooked forward's start hooks the next


class Settled:
    """Whether the next forward may run without hooks, from the hooked forwards before it."""

    __slots__ = ("calm", "room", "run", "saved", "shapes")

    def __init__(self) -> None:
        self.calm = 0  # hooked forwards in a row that moved nothing as planned, saving alike
        self.saved: tuple[int, ...] = ()  # bytes the last hooked forward saved, per tag (blocks, before, after)
        self.run = 0  # forwards run without hooks since the last hooked one
        self.room: int | None = None  # GPU memory free or cached, less allocated, as that one began
        self.shapes: tuple = ()  # its first block's tensor arguments: (shape, dtype) each

    def hooked(self, ad: Adaptive, measured: bool, judged: bool = True) -> None:
        """A hooked forward begins, the plan in force checked against the last one's numbers
        (``measured``: they came in). Hooked forwards as planned that saved other bytes than
        the one before (a model whose memory follows its data, not its shapes) start the count
        again: no forward of theirs goes without the guard. One no backward followed is not
        ``judged``: it leaves the count as it was."""
        if judged:
            saved = tuple(ad.profile.saved)
            if not (measured and as_planned(ad)):
                self.calm = 0
            elif self.calm and saved != self.saved:
                self.calm = 1
            else:
                self.calm += 1
            self.saved = saved
        self.run = 0
        self.room = ad.auto.left() if ad.gpu is not None else None  # read by budget() just now

    def skips(self, ad: Adaptive) -> bool:
        """Whether the forward about to start runs without hooks: the hooked ones before it,
        the last included, moved nothing as planned."""
        if self.calm < CALM or self.run >= MEASURE - 1 or not as_planned(ad):
            return False
        if ad.gpu is not None:  # device_budget = "auto": less room than measured, measure again
            if not ad._timing():  # a CUDA graph being captured: its memory is not to be read now
                return False
            m = ad.gpu.memory()
            budget = ad.off._budget or 0
            if self.room is None or m.free + m.reserved - m.allocated < self.room - ROOM * budget:
                return False
            if m.retries > (ad.auto.retries or 0):  # the GPU ran full (its cache emptied: room as before)
                return False
        self.run += 1
        return True

    def woke(self) -> None:
        """A forward woken at its first block is hooked from there on: the next one is hooked
        too, to compare what it saved (its inputs changed) with the forwards before."""
        self.calm = min(self.calm, CALM - 1)

    def woken(self, args: tuple) -> bool:
        """At the first block of a forward without hooks: its inputs differ from those of the
        last hooked forward (a batch or sequence of another size), so it is hooked from here."""
        return shapes(args) != self.shapes


def shapes(args: tuple) -> tuple:
    """The tensor arguments' shapes and dtypes."""
    return tuple((a.shape, a.dtype) for a in args if isinstance(a, torch.Tensor))


def batch_grew(last: tuple, now: tuple) -> bool:
    """Only the first dimension of the inputs changed (a larger batch: each sample saves as
    much as before, where a longer sequence can save more per token)."""
    return len(last) == len(now) > 0 and all(
        a[1] == b[1] and len(a[0]) == len(b[0]) and a[0][1:] == b[0][1:] for a, b in zip(last, now, strict=True)
    )


def as_planned(ad: Adaptive) -> bool:
    """Whether the last hooked forward kept or recomputed each block (inputs kept) as the plan
    in force does, within its budget, with the inputs of the one before."""
    plan, prof = ad.plan, ad.profile
    return (
        plan is not None
        and plan.fits
        and all(a is Action.KEEP or a is Action.RECOMPUTE for a in plan.actions)
        and ad.ran == list(plan.actions)  # the guard switched nothing
        and ad.growth == 1.0
        and prof.sent == 0  # nothing offloaded for the budget
        and ad.settled.shapes != ()  # a larger batch shows in its first block's tensors
    )
