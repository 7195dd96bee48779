"""Forwards without hooks. Once adaptive mode's plan moves nothing (each block kept, or
recomputed with its inputs kept) and has settled, a hooked forward with the same inputs
would only count what autograd keeps anyway: it runs without ssdtier's saved-tensor hooks,
at no cost per tensor, and checkpointing recomputes what the plan recomputes. One forward
in ``MEASURE`` is hooked still, and one whose first block takes larger inputs than a hooked
forward ran the plan with (the ceiling) is hooked from that block on: under dynamic padding
the shorter forwards run without hooks (docs/planner.md#a-settled-plan)."""

from __future__ import annotations

import operator
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..plan import Action
from ._util import run_eagerly
from .forward import flat

if TYPE_CHECKING:
    from .adaptive import Adaptive

CALM = 2  # hooked forwards in a row that ran a plan moving nothing as planned, before any goes unhooked
MEASURE = 16  # of this many forwards, one at least is hooked: the plan keeps measuring
ROOM = 0.03  # of the budget: this much less GPU room, or more allocated, than measured hooks the next
KNOWN = 64  # (inputs, actions) whose saved bytes are remembered, to find a model whose bytes follow its data
STATES = 8  # states (Params.state) whose plans and ceilings are kept: a GAN's steps alternate two


class Ceiling(NamedTuple):
    """The largest inputs a hooked forward ran the plan with, what it saved per block, and the
    budget and working memory that plan fitted."""

    inputs: tuple  # the first block's tensor arguments: (shape, dtype) each
    saved: tuple[int, ...]
    budget: int | None
    working: int
    state: tuple = ()  # Params.state(): training, parameters needing gradients, autocast
    rest: tuple = ()  # the later stacks' first blocks' tensor arguments (a decoder's), per stack

    def holds(self, ad: Adaptive) -> bool:
        """The budget is not less (but for ``ROOM``), nor the working memory learned more."""
        budget = ad.off._budget
        if budget is None:
            return True
        return self.budget is not None and budget >= self.budget * (1 - ROOM) and ad.watch.working <= self.working


class Settled:
    """Whether the next forward may run without hooks, from the hooked forwards before it."""

    __slots__ = (
        "began",
        "beside",
        "calm",
        "ceiling",
        "known",
        "pending",
        "rest",
        "room",
        "run",
        "shapes",
        "start",
        "state",
        "varies",
    )

    def __init__(self) -> None:
        self.calm = 0  # hooked forwards in a row that moved nothing as planned, within the ceiling
        self.ceiling: Ceiling | None = None  # ... in the state whose plan is in force (Adaptive.switch)
        self.known: dict[tuple, tuple[int, ...]] = {}  # bytes hooked forwards saved, by (inputs, actions)
        self.varies = False  # ... not alike at the same ones: only the ceiling's own inputs go unhooked
        self.run = 0  # forwards run without hooks since the last hooked one
        self.room: int | None = None  # GPU memory free or cached as that one began ("auto")
        self.began: int | None = None  # ... allocated, gradients aside, as the last hooked backward ended
        self.start: int | None = None  # allocated as the forward skips() let go unhooked began (a GPU)
        self.shapes: tuple = ()  # the last hooked forward's first block's tensor arguments
        self.rest: tuple = ()  # ... and the later stacks' first blocks', per stack
        self.beside: list[tuple[int, int] | None] | None = None  # ... Adaptive.beside, if calm
        self.state: tuple = ()  # ... Params.state() as it began
        self.pending = Pending()  # forwards without hooks on the CPU whose graphs hold what they saved

    def hooked(self, ad: Adaptive, state: tuple, measured: bool, judged: bool = True) -> None:
        """A hooked forward begins in ``state`` (``Params.state``, as the model was entered),
        the plan in force checked against the last one's numbers (``measured``: they came in).
        One no backward followed is not ``judged``: it leaves the count as it was."""
        if judged:
            self.calm = self._judge(ad, measured)
            self.beside = ad.beside if self.calm else None
        self.state, self.rest = state, ()
        self.run = 0
        self.room = ad.watch.auto.usable() if ad.watch.gpu is not None else None  # read by watch.budget() just now

    def _judge(self, ad: Adaptive, measured: bool) -> int:
        """The calm count after the last hooked forward. One as planned at the ceiling's inputs
        saving alike, or at smaller ones saving no more on any block, counts; larger or other
        inputs, a budget less than the ceiling's, or bytes that follow the data (a model whose
        memory is not its shapes') make it the new ceiling and start the count again."""
        c = self.ceiling if self.ceiling is not None and self.ceiling.state == self.state else None
        if not (measured and as_planned(ad)):
            self.ceiling = None
            return 0
        # The blocks' bytes: the head's count storages it shares with what ran before the first
        # block (the batch's targets and inputs), which a forward woken at that block did unhooked.
        saved, now, rest = tuple(ad.profile.saved[1 : ad.off.n_layers + 1]), self.shapes, self.rest
        key = (now, rest, tuple(ad.ran or ()), self.state)
        was = self.known.get(key)
        if was is None and len(self.known) < KNOWN:
            self.known[key] = saved
        self.varies = self.varies or (was is not None and was != saved)
        if c is not None and (now, rest, saved) == (c.inputs, c.rest, c.saved):  # the plan fits at these inputs
            self.ceiling = c._replace(budget=ad.off._budget, working=ad.watch.working)
            return self.calm + 1
        if c is not None and c.holds(ad):
            smaller = not self.varies and (now, rest) != (c.inputs, c.rest) and within(now, c.inputs)
            smaller = smaller and all(_within(r, _part(c.rest, k)) for k, r in enumerate(rest, 1))
            if smaller and all(s <= m for s, m in zip(saved, c.saved, strict=True)):
                return self.calm + 1
            self.varies = self.varies or smaller  # smaller inputs saving more: not the shapes' bytes
        # The plan is predicted to fit the budget now from this forward's numbers (as_planned).
        self.ceiling = Ceiling(now, saved, ad.off._budget, ad.watch.working, self.state, rest)
        return 1

    def skips(self, ad: Adaptive, state: tuple) -> bool:
        """Whether the forward about to start in ``state`` runs without hooks: the hooked ones
        before it, the last included, moved nothing as planned, in that state."""
        c = self.ceiling
        if c is None or c.state != state or self.calm < CALM or self.run >= MEASURE - 1:
            return False
        if not as_planned(ad, last=state == self.state):  # (another state's forward since: judged)
            return False
        budget, self.start = ad.off._budget or 0, None
        if budget and ad.watch.meter is None and self.pending.count:  # no allocator to see them: the guard counts
            return False
        if ad.watch.gpu is not None or (ad.watch.meter is not None and budget):  # on a GPU with a budget
            if not ad._timing():  # a CUDA graph being captured: its memory is not to be read now
                return False
            if ad.watch.gpu is not None:  # "auto": less memory than measured (another process), a retry
                m = ad.watch.gpu.memory()
                if self.room is None or m.free + m.reserved < self.room - ROOM * budget:
                    return False
                if m.retries > (ad.watch.auto.retries or 0):  # the GPU ran full (its cache emptied: room as before)
                    return False
                allocated = m.allocated
            else:
                allocated = ad.watch.meter.counters().allocated
            # More allocated than as the last hooked backward ended: earlier forwards' activations.
            # Gradients aside: zero_grad frees them between, and would hide as much of those.
            more = self.began is None or allocated - ad.grads() > self.began + ROOM * budget
            if ad.watch.meter is not None and more:
                return False
            self.start = allocated
        self.run += 1
        return True

    def woke(self) -> None:
        """A forward woken at its first block is hooked from there on: the next one is hooked
        too, to compare what it saved (its inputs changed) with the forwards before."""
        self.calm = min(self.calm, CALM - 1)

    def woken(self, args: tuple, stack: int = 0) -> bool:
        """At stack ``stack``'s first block of a forward without hooks: its inputs pass the
        ceiling's there (a larger batch, a longer sequence, another dtype)."""
        c = self.ceiling
        if c is None:
            return True
        top = _part(c.rest, stack) if stack else c.inputs
        if top == ():  # the ceiling's forward did not run that stack
            return True
        now = shapes(args)
        return now != top if self.varies else not _within(now, top)

    def seen(self, stack: int, args: tuple) -> None:
        """A hooked forward enters later stack ``stack``: its first call's arguments are kept."""
        rest = self.rest + ((),) * (stack - len(self.rest))
        if rest[stack - 1] == ():
            self.rest = (*rest[: stack - 1], shapes(args), *rest[stack:])


class Pending:
    """Forwards without hooks on the CPU, with a budget, that no backward has reached yet nor
    their graphs freed: no allocator counts what autograd keeps for them, so the next forward
    is hooked and its guard counts what their plan holds at a forward's end."""

    __slots__ = ("bytes", "count", "lock")

    def __init__(self) -> None:
        self.count = self.bytes = 0
        self.lock = threading.Lock()  # a backward or a graph freed on another thread lets go

    def add(self, output: Any, nbytes: int) -> None:
        nodes = {id(t.grad_fn): t.grad_fn for t in flat((output,)) if isinstance(t, torch.Tensor) and t.grad_fn}
        if not nodes:
            return  # nothing to differentiate: the graph is gone already
        with self.lock:
            self.count, self.bytes = self.count + 1, self.bytes + nbytes
        done = _Done(self, nbytes)
        for node in nodes.values():  # the loss may come from any output
            node.register_prehook(done)  # a backward through it begins
            node.metadata.setdefault("ssdtier.pending", []).append(done)  # ... or the graph is freed


class _Done:
    __slots__ = ("nbytes", "pending")

    def __init__(self, pending: Pending, nbytes: int) -> None:
        self.pending: Pending | None = pending
        self.nbytes = nbytes

    def __call__(self, grad_outputs: Any) -> None:
        if grad_outputs is not None and _keeps_graph():
            return  # retain_graph=True: the graph holds its tensors still
        p, self.pending = self.pending, None
        if p is not None:
            with p.lock:
                p.count, p.bytes = p.count - 1, p.bytes - self.nbytes

    def __del__(self) -> None:
        self(None)


run_eagerly(_Done, "__call__")  # compiled autograd would trace it, and warn at the call below
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: False)


def shapes(args: tuple) -> tuple:
    """The tensor arguments' shapes and dtypes; an int argument (a ``max_seqlen``) as a size
    that only a longer sequence changes, a flag as a value to match. Floats (a rate that a
    schedule moves each step) size nothing."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.shape, a.dtype))
        elif isinstance(a, bool):
            out.append(((), a))
        elif isinstance(a, int):
            out.append(((1, a), int))
    return tuple(out)


def _pairs(now: tuple, other: tuple) -> list[tuple] | None:
    """The tensor arguments paired, if alike in number, rank and dtype; else None."""
    pairs = list(zip(now, other, strict=False))
    if not (len(now) == len(other) > 0) or any(a[1] != b[1] or len(a[0]) != len(b[0]) for a, b in pairs):
        return None
    return pairs


def within(now: tuple, ceiling: tuple) -> bool:
    """Each tensor argument of ``now`` no larger in any dimension than the ceiling's, alike in
    number, rank and dtype: a forward that saves no more, under the same plan. Floating-point
    ones as large as the ceiling's need the others alike too (offsets of packed sequences:
    fewer, longer sequences in as many tokens can save more)."""
    pairs = _pairs(now, ceiling)
    if pairs is None or not all(all(map(operator.le, a[0], b[0])) for a, b in pairs):
        return False
    return now == ceiling or any(a[0] != b[0] for a, b in pairs if _floating(a[1]))


def _part(rest: tuple, stack: int) -> tuple:
    """Stack ``stack``'s first block's arguments in ``rest``; () if it did not run."""
    return rest[stack - 1] if stack <= len(rest) else ()


def _within(now: tuple, ceiling: tuple) -> bool:
    """As ``within``; a stack not run (``now`` empty) saves nothing."""
    return now == ceiling or now == () or within(now, ceiling)


def _floating(kind: object) -> bool:
    return isinstance(kind, torch.dtype) and kind.is_floating_point


def batch_grew(last: tuple, now: tuple) -> bool:
    """Only the first dimension of the inputs changed (a larger batch: each sample saves as
    much as before, where a longer sequence can save more per token)."""
    pairs = _pairs(now, last)
    return pairs is not None and all(a[0][1:] == b[0][1:] for a, b in pairs)


def as_planned(ad: Adaptive, last: bool = True) -> bool:
    """Whether the last hooked forward in the state of the plan in force kept or recomputed
    each block (inputs kept) as that plan does, within its budget (the guard, scaled for
    larger inputs, switched nothing). ``last``: that forward was the last hooked one."""
    plan, prof = ad.plan, ad.profile
    return (
        plan is not None
        and plan.fits
        and all(a is Action.KEEP or a is Action.RECOMPUTE for a in plan.actions)
        and ad.ran == list(plan.actions)  # the guard switched nothing
        and (prof.sent == 0 or not last)  # nothing offloaded for the budget
        and ad.settled.shapes != ()  # a larger batch shows in its first block's tensors
    )
