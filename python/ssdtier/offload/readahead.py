"""Reading ahead in backward: a layer's first unpack starts reading the layers below it, or
with ``prefetch_layers = "auto"`` each unpack keeps a byte window of reads under way below it,
sized after each backward from what it measured (docs/how-it-works.md)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from .control import StepControl

if TYPE_CHECKING:
    from .offloader import Offloader

log = logging.getLogger("ssdtier")

AHEAD_MAX = 4  # prefetch_layers = "auto" reads at most AHEAD_MAX layers' bytes ahead


class Backward:
    """The backwards of one forward's graph. A layer's read-ahead starts once per backward;
    a backward that goes back up to a layer above the lowest one reached is another backward
    of the same graph (``retain_graph=True``). Every handle of the forward holds it.

    With a byte window (``prefetch_layers = "auto"``) it also holds the forward's entries in
    pack order (``seq``; ``Entry.pos`` and ``Entry.cum0``, the bytes packed before it) and
    where the backward's sweep down them is: reads started down to ``read_to``."""

    __slots__ = ("cum", "done", "first", "last", "low", "read_to", "round", "seq")

    def __init__(self) -> None:
        self.round = 0
        self.low: int | None = None
        self.done: dict[int, int] = {}  # layer -> the round its read-ahead started in
        self.seq: list[Any] = []
        self.cum = 0
        self.read_to = 0
        # (time, bytes packed before `at`) at the sweep's start, and at its latest unpack
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] = (0.0, 0)

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
    """How far the backward reads ahead, and starting those reads: whole layers
    (``prefetch_layers = N``), or a byte window (``"auto"``) sized after each backward from
    its pace and the time reads took."""

    def __init__(self, off: Offloader, prefetch_layers: int | str) -> None:
        self.off = off
        self.auto = prefetch_layers == "auto"
        self.depth = AHEAD_MAX if self.auto else int(prefetch_layers)
        self.ctl = StepControl(patience=3)
        self.stall0 = 0.0
        # auto: the window in bytes (None until a backward was measured: _first_window),
        # a margin on it that stalls double, and this backward's sweep: (start, ticket) per read.
        self.window: int | None = None
        self.margin = 1.0
        self.reads: list[tuple[float, Any, int]] = []  # (start, ticket, bytes)
        self.pace: list[tuple[float, int, float, int]] = []  # per sweep: (t0, bytes0, t1, bytes1)
        self.sweep: Backward | None = None  # the sweep under way

    def start(self, forward: int, layer: int) -> None:
        """Entering a layer's backward: start reading the next layers' entries. Called with
        the offloader's lock held."""
        off = self.off
        for d in range(1, self.depth + 1):
            group = off._by_layer.get((forward, layer - d))
            # A copy: the allocations below may run a collection that releases entries of it.
            for entry in list(group or ()):
                self._want(entry)
        off.cuda.stage_ready()

    def _want(self, entry: Any) -> None:
        if entry.refs == 0:
            return
        entry.wanted = True
        if entry.reading is None and entry.gpu is None and entry.src is None and entry.restored is None:
            self.off._start_read(entry)
            if entry.cuda:
                self.off.cuda.stage_later(entry)
            elif self.auto and entry.reading[2] is not None:
                self.reads.append((time.perf_counter(), entry.reading[2], entry.nbytes))

    def advance(self, b: Backward, pos: int) -> None:
        """auto: the backward is at entry ``pos`` of its forward (``len(b.seq)``: above them
        all, in the kept layers): start the reads of the entries below it that are within
        the window. Called with the offloader's lock held."""
        seq = b.seq
        at = seq[pos].cum0 if pos < len(seq) else b.cum
        now = time.perf_counter()
        if b.first is None or at - b.last[1] > b.cum // 2:
            # A new sweep: the first backward, or another one of a retained graph, which
            # starts again from the top (within one, the order is only roughly the reverse).
            if b.first is not None:
                self.pace.append((*b.first, *b.last))
            b.first, b.last, b.read_to = (now, at), (now, at), pos
        else:
            b.last = (now, min(at, b.last[1]))
        self.sweep = b
        window = self.window if self.window is not None else self._first_window(b)
        low = b.read_to
        while low > 0 and at - seq[low - 1].cum0 <= window:
            low -= 1
            self._want(seq[low])
        if low == pos > 0:
            low -= 1  # the next entry at least, whatever the window
            self._want(seq[low])
        b.read_to = low
        self.off.cuda.stage_ready()

    def _first_window(self, b: Backward) -> int:
        """Before any backward was measured: a quarter of the largest layer's bytes (at least
        its largest entry); a first backward that stalls on it doubles the margin."""
        sizes: dict[int, int] = {}
        for e in b.seq:
            sizes[e.layer] = sizes.get(e.layer, 0) + e.nbytes
        return max(max(sizes.values(), default=0) // 4, max((e.nbytes for e in b.seq), default=0))

    def tune(self) -> None:
        """After a backward (``auto``): the window the backward's pace needs, given the reads'
        latency and bandwidth (a read started ``w`` bytes ahead is done in time if
        ``w / pace >= latency + w / bandwidth``), twice over, times a margin that doubles
        when the backward waited for a read the window started and halves back after three
        backwards that did not. Reads slower than the backward: the most, AHEAD_MAX layers."""
        off = self.off
        with off._lock:  # a backward on another thread may still be adding to them
            reads, self.reads = self.reads, []
            pace, self.pace = self.pace, []
            b, self.sweep = self.sweep, None
            if b is not None and b.first is not None:
                pace.append((*b.first, *b.last))
                b.first = None  # measured once; its next unpack starts a new sweep
        stalled = off.res.stall_ahead > self.stall0
        self.stall0 = off.res.stall_ahead
        if stalled:
            self.ctl.stall()
            self.margin = min(self.margin * 2, 64.0)
        elif self.margin > 1.0 and self.ctl.quiet():
            self.margin = max(1.0, self.margin / 2)
        done = [(t0, t0 + t.seconds, n) for t0, t, n in reads if t.seconds is not None]
        pace = [(t1 - t0, b0 - b1) for t0, b0, t1, b1 in pace if t1 > t0 and b0 > b1]
        if len(done) < 2 or not pace or b is None:
            return
        layers: dict[int, int] = {}
        for e in b.seq:
            layers[e.layer] = layers.get(e.layer, 0) + e.nbytes
        most = AHEAD_MAX * max(layers.values())
        largest = max(e.nbytes for e in b.seq)
        speed = sum(n for _, n in pace) / sum(t for t, _ in pace)  # bytes per second of backward
        latency = min(t1 - t0 for t0, t1, _ in done)  # the others include waiting behind earlier reads
        bandwidth = sum(n for _, _, n in done) / _busy(done)
        if bandwidth <= 1.1 * speed:
            want = most
        else:
            want = round(2 * self.margin * speed * latency / (1 - speed / bandwidth))
        self._set(
            min(max(want, largest), most),
            f"backward at {speed / 1e6:.0f} MB/s; reads {latency * 1e3:.2f} ms latency, {bandwidth / 1e6:.0f} MB/s",
        )

    def _set(self, n: int, why: str) -> None:
        if self.window is None or abs(n - self.window) > 0.1 * self.window:
            log.info("ssdtier: reading %.1f MiB ahead in backward: %s", n / 2**20, why)
        self.window = n


def _busy(spans: list[tuple[float, float, int]]) -> float:
    """Seconds in which at least one of the spans (start, end, _) was under way."""
    total, end = 0.0, -math.inf
    for t0, t1, _ in sorted(spans):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return max(total, 1e-9)
