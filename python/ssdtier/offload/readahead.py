"""Reading ahead in backward: a layer's first unpack starts reading the layers below it, or
with ``prefetch_layers = "auto"`` each unpack keeps a byte window of reads under way below it,
sized after each backward from what it measured (docs/how-it-works.md)."""

from __future__ import annotations

import bisect
import collections
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from .control import StepControl
from .entry import Entry, Held, Reading, Writing

if TYPE_CHECKING:
    from .owner import ReadAheadOwner

log = logging.getLogger("ssdtier")

AHEAD_MAX = 4  # prefetch_layers = "auto" reads at most AHEAD_MAX layers' bytes ahead ...
AHEAD_MIN_CAP = 16 << 20  # ... or this many, if more


class Backward:
    """The backwards of one forward's graph. A layer's read-ahead starts once per backward;
    a backward (another call of autograd's engine) that goes back up to a layer above the
    lowest one reached is another backward of the same graph (``retain_graph=True``); in one
    call, the blocks run again (a stack run on two inputs). Every handle of the forward holds it.

    With a byte window (``prefetch_layers = "auto"``) it also holds the forward's entries in
    pack order (``seq``, ``Entry.pos``) and the sweep of the backward under way."""

    __slots__ = ("acts", "begun", "cum", "done", "last", "low", "round", "seq", "swell", "sweep", "task")

    def __init__(self, begun: int = 0, acts: list | None = None) -> None:
        self.begun = begun  # backwards of any forward begun before this forward
        self.acts = acts  # the forward's actions (adaptive mode; the guard's included)
        self.swell = 1.0  # ... and what its blocks may save over the plan's (Adaptive.swell)
        self.round = 0
        self.low: int | None = None
        # The layer of the last call of due(): called again with it, due() is False and
        # changes nothing, so callers skip the call.
        self.last = -1
        self.done: dict[int, int] = {}  # layer -> the round its read-ahead started in
        self.seq: list[Any] = []
        self.cum = 0  # bytes in seq
        self.sweep: Sweep | None = None
        self.task = -1  # the engine's graph task of the last call of due()

    def due(self, layer: int) -> bool:
        """Whether ``layer``'s read-ahead should start now (at an unpack of ``layer``)."""
        self.last = layer
        task = torch._C._current_graph_task_id()
        if self.low is not None and layer > self.low and task != self.task:
            self.round += 1
            self.low = None
        self.task = task
        if self.done.get(layer) == self.round:
            return False
        self.done[layer] = self.round
        self.low = layer if self.low is None else min(self.low, layer)
        return True


class Sweep:
    """One backward's way through a forward's entries (``"auto"``): the order it unpacks them
    in (the last backward's, if the forward packed as many entries of as many bytes, else
    the reverse of the pack order), how far along it is and has started reads, and when it
    first reached each rank."""

    __slots__ = (
        "arena_cap",
        "at",
        "cum",
        "guessed",
        "held",
        "largest",
        "layer_max",
        "now",
        "order",
        "rank",
        "read_to",
        "round",
        "seen",
        "seq",
        "stall0",
        "t0",
        "times",
        "unstaged",
    )

    def __init__(self, b: Backward, order: list[int], now: float, stall: float, guessed: bool = False) -> None:
        self.seq, self.order, self.round = b.seq, order, b.round
        self.guessed = guessed  # the reverse pack order, nothing learned: its stalls teach nothing
        self.rank = [0] * len(order)
        self.cum = [0]  # cum[r]: bytes of the entries before rank r
        layers: dict[int, int] = {}
        for r, p in enumerate(order):
            e = b.seq[p]
            self.rank[p] = r
            self.cum.append(self.cum[-1] + e.nbytes)
            layers[e.layer] = layers.get(e.layer, 0) + e.nbytes
        self.layer_max = max(layers.values(), default=0)  # the largest layer's bytes
        self.largest = max((b.seq[p].nbytes for p in order), default=0)  # the largest entry's
        self.at = -1  # the furthest rank unpacked (-1: none yet, the kept layers above them)
        self.now = -1  # the rank unpacked last: a storage blocks share jumps ``at`` ahead of it
        self.read_to = -1  # the furthest rank whose read was started
        self.seen: list[int] = []  # positions, in the order of their first unpack
        self.held: set[int] = set()  # ranks served from their source, with no read
        self.t0, self.stall0 = now, stall
        self.arena_cap = 0  # the most read ahead into the host arena (0: no bound)
        self.unstaged: collections.deque[int] = collections.deque()  # ranks read into the arena alone
        self.times: list[float | None] = [None] * len(order)  # seconds into the sweep less its waits, by rank


def _unstaged(e: Entry) -> bool:
    """A CUDA entry read (or being read) into the arena, not to be copied to the GPU ahead."""
    back = e.back
    return e.cuda and type(back) is Reading and not back.queued


class ReadAhead:
    """How far the backward reads ahead, and starting those reads: whole layers
    (``prefetch_layers = N``), or a byte window (``"auto"``) sized after each backward from
    its pace and the time reads took."""

    def __init__(self, off: ReadAheadOwner, prefetch_layers: int | str) -> None:
        self.off = off
        self.auto = prefetch_layers == "auto"
        self.depth = 0 if self.auto else int(prefetch_layers)  # whole layers read ahead
        self.ctl = StepControl(patience=3)
        self.stall0 = 0.0
        # auto: the window in bytes (None until a backward was measured: _first_window), a
        # margin on it that stalls double, and the reads the window started this backward.
        self.window: int | None = None
        self.margin = 1.0
        self.reads: list[tuple[float, Any, int]] = []  # (start, ticket, bytes)
        # Backwards in a row with no stall and the same margin: from 3 on, the search
        # (about 1 ms for 200 entries) runs only every 8th backward.
        self.calm = 0
        self.sweep: Sweep | None = None  # the sweep under way
        self.learned: tuple[int, int, list[int]] | None = None  # (entries, bytes, order) of the last

    def start(self, forward: int, layer: int) -> None:
        """Entering a layer's backward: start reading the next layers' entries. Called with
        the offloader's lock held."""
        off = self.off
        room, reading = off.room(ahead=True), 0  # within the device budget, but for a first read below
        for d in range(1, self.depth + 1):
            for entry in off.entries.of_layer(forward, layer - d):
                fresh = entry.back is None
                source = type(entry.out) in (Writing, Held)  # wanted, held to serve with no read
                brings = entry.refs and (fresh or _unstaged(entry)) and not source
                over = brings and reading + entry.nbytes > room if room is not None else False
                if (over or (source and room == 0)) and (reading or d > 1):
                    if over and fresh and entry.cuda:
                        self._want(entry, stage=False)  # from NVMe into the arena: host memory
                    continue  # the unpack reads it, or copies it to the GPU
                reading += entry.nbytes if brings else 0
                self._want(entry)
        off.cuda.stage_ready()

    def _want(self, entry: Entry, stage: bool = True) -> bool:
        """Have ``entry`` read back, unless it is in memory; False if its source is (its
        write still in flight, or done and not yet let go): it serves with no read. A CUDA
        entry is copied on to the GPU ahead too, if ``stage``."""
        if entry.refs == 0:
            return True
        entry.wanted = True
        out = entry.out
        if type(out) is Writing:
            self.off.cpu.skip_write(entry)
            return False
        if type(out) is Held:
            return False
        if entry.back is None:
            if not entry.cuda and entry.device.type in self.off.cpu.gds_types:  # cuFile: into GPU memory
                if self.off.cuda.stage_off:
                    return True  # out of GPU memory: the unpack reads it
                try:
                    self.off._start_read(entry)
                except torch.cuda.OutOfMemoryError:
                    self.off.cuda.stage_off = True  # until the next forward, as the arena's copies ahead
                    return True
            else:
                self.off._start_read(entry)
            ticket = entry.back.ticket
            if self.auto and ticket is not None:  # an NVMe read: tune() learns from it
                self.reads.append((time.perf_counter(), ticket, entry.nbytes))
        if entry.cuda and stage:  # read now, or into the arena alone before, for want of room
            self.off.cuda.stage_later(entry)
        return True

    def advance(self, b: Backward, pos: int) -> None:
        """auto: the backward unpacks entry ``pos`` of its forward (-1: a kept tensor): start
        the reads of the entries after it in the sweep's order that are within the window.
        Called with the offloader's lock held."""
        s = b.sweep
        now = time.perf_counter()
        if s is None or s.round != b.round:  # the first backward, or another of a retained graph
            learned = self._order(b)
            order = learned or list(range(len(b.seq) - 1, -1, -1))
            s = b.sweep = Sweep(b, order, now, self.off.res.stall, guessed=not learned)
            if any(e.cuda for e in b.seq):
                # Read into the arena, where the entries the backward needs first stay.
                s.arena_cap = self.off.cuda.bound
        self.sweep = s
        if 0 <= pos < len(s.rank):
            r = s.rank[pos]
            if s.times[r] is None:
                # The backward's own pace: its waits for reads are what the window should remove.
                s.times[r] = now - s.t0 - (self.off.res.stall - s.stall0)
                s.seen.append(pos)
            s.at, s.now = max(s.at, r), r
        window = self.window if self.window is not None else self._first_window(s)
        if s.arena_cap:
            window = min(window, s.arena_cap)
        room = self.off.room(ahead=True)
        if room is not None and not s.arena_cap:  # the device budget holds what is read ahead too
            window = min(window, room)
        order, cum, nxt = s.order, s.cum, s.at + 1
        used = self._stage_unstaged(s, room) if room is not None and s.unstaged else 0
        j = start = s.read_to + 1
        while j < len(order) and (j <= nxt or cum[j] - cum[nxt] < window):
            entry = s.seq[order[j]]
            # Within the budget, but for the entry needed next: entries passed over (a storage
            # blocks share, unpacked first, jumps a guessed order) and the window's last too.
            # Past it, a CUDA entry is still read from NVMe into the host arena.
            needed = j == start == s.now + 1 and not used
            past = room is not None and not needed and (bool(s.unstaged) or cum[j + 1] - cum[start] > room - used)
            if past and not entry.cuda:
                break
            if not self._want(entry, stage=not past):
                s.held.add(j)
            elif past:
                s.unstaged.append(j)
            j += 1
        s.read_to = j - 1
        if self.off.cuda.staging:
            self.off.cuda.stage_ready()

    def _stage_unstaged(self, s: Sweep, room: int) -> int:
        """Copy to the GPU ahead, nearest first, the entries read into the arena alone that
        now fit in ``room`` (the one needed next in any case); returns their bytes."""
        used = 0
        while s.unstaged and not self.off.cuda.stage_off:  # (out of GPU memory: kept for later)
            r = s.unstaged[0]
            e = s.seq[s.order[r]]
            if e.refs and _unstaged(e):
                if used + e.nbytes > room and (used or r != s.now + 1):
                    break
                self.off.cuda.stage_later(e)
                used += e.nbytes
            s.unstaged.popleft()
        return used

    def _order(self, b: Backward) -> list[int]:
        """The order the last backward unpacked in, if the forward looks the same; else []."""
        learned = self.learned
        if learned is not None and learned[0] == len(b.seq) and learned[1] == b.cum:
            return learned[2]
        return []

    @staticmethod
    def _first_window(s: Sweep) -> int:
        """Before any backward was measured: a quarter of the largest layer's bytes (at least
        its largest entry); a first backward that stalls on it doubles the margin."""
        return max(s.layer_max // 4, s.largest)

    def tune(self) -> None:
        """After a backward (``auto``): the smallest window with which, replayed on that
        backward's timeline (when it first unpacked each entry) with the reads' measured
        latency and bandwidth, every read would have been done in time; times a margin that
        doubles when the backward waited for a read the window started and halves back after
        three backwards that did not."""
        off = self.off
        with off._lock:  # a backward on another thread may still be adding to them
            if self.sweep is None or not self.sweep.seen:
                # None unpacked yet (begun at its forward's end, and another forward came
                # first, as with two forwards before one backward): nothing to learn yet.
                return
            reads, self.reads = self.reads, []
            s, self.sweep = self.sweep, None
            s.round = -1  # measured once; an unpack after this starts a new sweep
            # The order to read in next time: as this backward unpacked them.
            seen = dict.fromkeys(s.seen)
            order = [*seen, *(p for p in range(len(s.seq) - 1, -1, -1) if p not in seen)]
            self.learned = (len(s.seq), sum(e.nbytes for e in s.seq), order)
        # A wait for a read the window started, of more than 1% of the backward: a few
        # milliseconds of a disk's jitter do not double the memory read ahead.
        span = max((t for t in s.times if t is not None), default=0.0)
        stalled = off.res.stall_ahead - self.stall0 > 0.01 * span and not s.guessed
        self.stall0 = off.res.stall_ahead
        margin = self.margin
        if stalled:
            self.ctl.stall()
            self.margin = min(self.margin * 2, 64.0)
        elif self.margin > 1.0 and self.ctl.quiet():
            self.margin = max(1.0, self.margin / 2)
        self.calm = 0 if stalled or self.margin != margin else self.calm + 1
        if self.calm > 3 and self.calm % 8:
            return
        # 0 s: a read ahead the store skipped (no room in the arena); the unpack reads it.
        done = [(t0, t0 + t.seconds, n) for t0, t, n in reads if t.seconds]
        if len(done) < 2:
            return
        # Tiny blocks: their backward is shorter than a read's latency, so blocks are no measure.
        most = max(AHEAD_MAX * s.layer_max, AHEAD_MIN_CAP)
        if s.arena_cap:
            most = min(most, max(s.arena_cap, s.largest))
        latency = min(t1 - t0 for t0, t1, _ in done)  # the others include waiting behind earlier reads
        bandwidth = sum(n for _, _, n in done) / _busy(done)
        sizes = [s.seq[p].nbytes for p in s.order]
        need = min_window(sizes, s.times, latency, bandwidth, most, s.held)
        self._set(
            min(max(round(need * self.margin), s.largest), most),
            f"reads {latency * 1e3:.2f} ms latency, {bandwidth / 1e6:.0f} MB/s; margin {self.margin:g}",
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


def min_window(
    sizes: list[int], times: list[float | None], latency: float, bandwidth: float, most: int, held: set[int]
) -> int:
    """The smallest window (bytes, at most ``most``) with which reads of entries of ``sizes``,
    unpacked ``times`` seconds into the backward (None: not unpacked), one after another at
    ``latency`` and ``bandwidth``, would all be done by then. Ranks in ``held`` need no read;
    a read late even if started at once is late whatever the window."""
    n = len(sizes)
    cum = [0]
    for x in sizes:
        cum.append(cum[-1] + x)
    # When the backward first reached rank r or beyond (reads are started from there).
    reach, low = [math.inf] * n, math.inf
    for r in range(n - 1, -1, -1):
        low = low if times[r] is None else min(low, times[r])
        reach[r] = low

    def late(w: int) -> bool:
        free = 0.0  # when the disk is free for the next read
        for j in range(n):
            # Read j starts when the backward reaches the first rank k - 1 with cum[j] - cum[k] < w.
            if j in held:
                continue
            k = bisect.bisect_right(cum, cum[j] - w)
            start = reach[k - 1] if k > 0 else 0.0
            free = max(start + latency, free) + sizes[j] / bandwidth
            if k > 0 and times[j] is not None and free > times[j]:
                return True
        return False

    lo, hi = max(sizes, default=0), most
    if not late(lo):
        return lo
    if late(hi):
        return hi
    while hi - lo > max(lo // 16, 1):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if not late(mid) else (mid, hi)
    return hi
