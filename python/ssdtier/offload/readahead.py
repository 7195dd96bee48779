"""Reading ahead in backward: a layer's first unpack starts reading the layers below it, and
with ``prefetch_layers = "auto"`` the depth is tuned from what each backward saw."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from .control import StepControl

if TYPE_CHECKING:
    from .offloader import Offloader

log = logging.getLogger("ssdtier")

AHEAD_MAX = 4  # prefetch_layers = "auto" reads 1..AHEAD_MAX layers ahead


class Backward:
    """The backwards of one forward's graph. A layer's read-ahead starts once per backward;
    a backward that goes back up to a layer above the lowest one reached is another backward
    of the same graph (``retain_graph=True``). Every handle of the forward holds it."""

    __slots__ = ("done", "low", "round")

    def __init__(self) -> None:
        self.round = 0
        self.low: int | None = None
        self.done: dict[int, int] = {}  # layer -> the round its read-ahead started in

    def due(self, layer: int) -> bool:
        """Whether ``layer``'s read-ahead should start now (at an unpack of ``layer``)."""
        if self.low is not None and layer > self.low:
            self.round += 1
            self.low = None
        if self.done.get(layer) == self.round:
            return False
        self.done[layer] = self.round
        self.low = layer if self.low is None else min(self.low, layer)
        return True


class ReadAhead:
    """How many layers the backward reads ahead, and starting those reads."""

    def __init__(self, off: Offloader, prefetch_layers: int | str) -> None:
        self.off = off
        self.auto = prefetch_layers == "auto"
        self.depth = 2 if self.auto else int(prefetch_layers)
        self.ctl = StepControl(patience=2)
        self.stall0 = 0.0
        self.trig: dict[tuple[int, int], float] = {}  # (forward, layer): when its backward began
        self.reads: dict[tuple[int, int], list[tuple[float, Any]]] = {}  # read-aheads: (start, ticket)

    def start(self, forward: int, layer: int) -> None:
        """Entering a layer's backward: start reading the next layers' entries. Called with
        the offloader's lock held."""
        off = self.off
        now = time.perf_counter() if self.auto else 0.0
        if self.auto:
            self.trig.setdefault((forward, layer), now)
        for d in range(1, self.depth + 1):
            group = off._by_layer.get((forward, layer - d))
            # A copy: the allocations below may run a collection that releases entries of it.
            for entry in list(group or ()):
                if entry.refs == 0:
                    continue
                entry.wanted = True
                if entry.reading is None and entry.gpu is None and entry.src is None and entry.restored is None:
                    off._start_read(entry)
                    ticket = entry.reading[2]
                    if self.auto and ticket is not None:
                        self.reads.setdefault((forward, layer - d), []).append((now, ticket))
                    if entry.cuda:
                        off.cuda.stage_later(entry)
        off.cuda.stage_ready()

    def tune(self) -> None:
        """After a backward (``auto``): one layer more if it waited for a read the read-ahead
        started; one less once, for a few backwards in a row, every read would have finished a
        quarter of a layer's backward before it was needed even had it started one layer later."""
        off = self.off
        with off._lock:  # a backward on another thread may still be adding to them
            trig, reads = self.trig, self.reads
            self.trig, self.reads = {}, {}
        # Only a read-ahead that came late says more read-ahead would help (the first offloaded
        # layer of a backward with no kept layer above it is read on demand whatever the depth).
        stalled = off.res.stall_ahead > self.stall0
        self.stall0 = off.res.stall_ahead
        d = self.depth
        if stalled:
            self.ctl.stall()
            if d < AHEAD_MAX:
                self._set(d + 1, "the backward waited for a read")
            return
        if d <= 1:
            self.ctl.idle()
            return
        judged = False
        for (f, j), started in reads.items():
            # Its backward began at `use`; with one layer less its reads would have begun when
            # layer j + d - 1's did (`later`), not when they did.
            use, later = trig.get((f, j)), trig.get((f, j + d - 1))
            if use is None or later is None:
                continue
            ends = [t.seconds for _, t in started]
            done = max(s + (e if e is not None else math.inf) for (s, _), e in zip(started, ends, strict=True))
            shift = max(0.0, later - min(s for s, _ in started))
            spare = 0.25 * (use - later) / (d - 1)
            if done + shift > use - spare:
                self.ctl.tight()
                return
            judged = True
        if not judged:
            self.ctl.idle()
        elif self.ctl.quiet():
            self._set(d - 1, "every read would still have been in time")

    def _set(self, n: int, why: str) -> None:
        log.info("ssdtier: reading %d layer(s) ahead in backward, was %d: %s", n, self.depth, why)
        self.depth = n
