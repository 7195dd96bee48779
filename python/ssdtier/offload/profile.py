"""What each block does in a step, measured for the plan: its saved bytes (each storage
once), its inputs, its forward and backward times and, when recomputed, its recomputation's
time. On a GPU, CUDA events time the blocks (read at the next plan); on the CPU, the clock
less the time the step waited on the store."""

from __future__ import annotations

import enum
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..plan import Block, Head

BACKWARD = 2.0  # a block's backward against its forward until one is measured (SSDTrain's rule)
OFFLOAD_TENSOR_S = 15e-6  # the hooks' time per offloaded tensor on the CPU (benches/hook_profile.py)
RECENT = 3  # steps whose times of a block are taken together (their median): one odd step is noise
SAME_INPUTS = 0.1  # ... while its inputs stay this close (a batch or sequence changed: times did too)
UNSEEN = 2.0  # saved bytes ~ inputs ** this, for a longer sequence before two sizes were measured


class Recomputable(enum.Enum):
    """Whether a block may be recomputed."""

    YES = "recomputable"
    CACHE = "not while called with a key/value cache it updates"
    INPUTS = "never: it changes its inputs in place, where a recomputation would start"


def input_bytes(args: tuple, seen: dict[int, weakref.ref], below: int = 0) -> tuple[int, int]:
    """Bytes of the tensor arguments, each storage once (and none in ``seen``, which gets
    them): what a recomputation of the block holds (checkpointing saves them); and of those,
    storages under ``below`` bytes (kept, not offloaded). A storage freed since (an offloaded
    input) may lend its address to a later block's: not the same."""
    total = small = 0
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype.is_floating_point:
            st = a.untyped_storage()
            ptr = st.data_ptr()
            was = seen.get(ptr)
            t = was() if was is not None else None
            if t is None or t.untyped_storage().data_ptr() != ptr:
                seen[ptr] = weakref.ref(a if a._base is None else a._base)  # a view made per block dies
                n = st.nbytes()
                total += n
                small += n if n < below else 0
    return total, small


class _Clock:
    """Times spans on the host's clock, or with CUDA events on a GPU (read later)."""

    def __init__(self, device: torch.device | None, waited: Callable[[], float]) -> None:
        self.device = device
        self.waited = waited  # seconds the host has waited on transfers so far

    def mark(self) -> Any:
        """Now: the host's clock, or an event recorded on the current stream."""
        if self.device is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def done(self, mark: Any) -> bool:
        """Whether reading ``mark`` would not wait for the GPU."""
        return self.device is None or mark.query()

    def between(self, a: Any, b: Any) -> float:
        if self.device is None:
            return b - a
        b.synchronize()  # the last step's, done long ago unless the host ran far ahead
        return a.elapsed_time(b) / 1e3

    def start(self) -> tuple[Any, float]:
        return self.mark(), self.waited()

    def stop(self, token: tuple[Any, float]) -> tuple[Any, Any, float]:
        """A span to read later: (start, end, seconds the host waited meanwhile)."""
        return token[0], self.mark(), self.waited() - token[1]

    def seconds(self, span: tuple[Any, Any, float]) -> float:
        # While the host waited for copies out the GPU may have run dry: not the block's time.
        start, end, waited = span
        return max(self.between(start, end) - waited, 0.0)


class Profile:
    """The blocks' numbers: this forward's as they come, and each block's last measured."""

    def __init__(
        self,
        n: int,
        device: torch.device | None,
        waited: Callable[[], float],
        cpu_hooks: bool,
        back_waited: Callable[[], float] = lambda: 0.0,
        min_bytes: int = 0,
    ) -> None:
        self.n = n
        self.min_bytes = min_bytes  # smaller storages are kept, never offloaded (min_tensor_bytes)
        self.clock = _Clock(device, waited)
        self.back_waited = back_waited  # seconds the backward waited for reads so far
        self.cpu_hooks = cpu_hooks  # the hooks run on the thread that computes: their time counts
        self.open: dict[int, Any] = {}  # tag -> token of the span under way
        self.head_open: Any = None
        self.begin_forward()
        # Each block's last measurement (None: never): saved bytes when it was not recomputed,
        # and its inputs then, to scale it by.
        self.full: list[tuple[int, int] | None] = [None] * n
        self.full_small = [0] * n  # ... and its small tensors' bytes then
        self.other: list[tuple[int, int] | None] = [None] * n  # ... and one at other inputs before it
        self.recompute_s: list[float | None] = [None] * n
        self.backward_s: list[float | None] = [None] * n
        self.head_back: float | None = None
        # Each block's last few (seconds, inputs) forward and backward (see steady).
        self.fwd_recent: list[deque[tuple[float, int]]] = [deque(maxlen=RECENT) for _ in range(n)]
        self.back_recent: list[deque[tuple[float, int]]] = [deque(maxlen=RECENT) for _ in range(n)]
        self.rec_spans: list[tuple[int, Any]] = []
        self.rec_saved: list[tuple[int, int, int] | None] = [None] * n  # (bytes, small, inputs) made again
        self.recomputable = [Recomputable.YES] * n
        self.io_per_byte: float | None = None  # what offloading costs the step per byte, past its waits
        self.end_mark: Any = None  # the forward's end, where the backward's marks start from
        self.end_waited = 0.0
        self.marks: list[tuple[int, Any, float]] = []  # (tag, mark, waited) as the backward reaches each layer

    def begin_forward(self) -> None:
        n = self.n
        self.saved = [0] * (n + 2)  # bytes per tag, each storage once
        self.kept = [0] * (n + 2)  # kept tensors per tag: offloading them would cost the hooks' time
        self.small = [0] * (n + 2)  # bytes per tag below min_tensor_bytes: kept whatever the action
        self.inputs = [0] * n
        self.inputs_small = [0] * n  # ... of them, bytes in storages under min_bytes
        self.calls = [0] * n  # of each block (a stack run on two views: 2)
        self.inputs_seen: dict[int, weakref.ref] = {}  # a tensor every block takes (a mask) is one block's input
        self.spans: list[tuple[int, Any]] = []
        self.head_span: Any = None
        self.recomputed = [False] * n
        self.offloaded = [False] * n  # blocks whose saved tensors this forward offloaded whole
        self.sent = 0  # storages this forward offloaded
        self.ended = False
        self.recorded = False  # this forward's times are in fwd_recent

    # ---------------------------------------------------------------- forward

    def block_enter(self, tag: int, args: tuple) -> None:
        self.calls[tag - 1] += 1
        self.inputs[tag - 1], self.inputs_small[tag - 1] = input_bytes(args, self.inputs_seen, self.min_bytes)
        self.open[tag] = self.clock.start()

    def block_exit(self, tag: int) -> None:
        token = self.open.pop(tag, None)
        if token is not None:
            self.spans.append((tag, self.clock.stop(token)))
        if tag == self.n:
            self.head_open = self.clock.start()

    def forward_end(self) -> None:
        if self.head_open is not None:
            self.head_span = self.clock.stop(self.head_open)
            self.head_open = None
        self.ended = True
        self.end_mark, self.end_waited = self.clock.mark(), self.back_waited()
        self.marks = []

    def saved_bytes(self, tag: int, nbytes: int, offloaded: bool, small: bool = False) -> None:
        if small:
            self.small[tag] += nbytes
            return
        self.saved[tag] += nbytes
        if offloaded:
            self.sent += 1
        else:
            self.kept[tag] += 1

    def _exponent(self, i: int) -> float | None:
        """How block ``i``'s saved bytes grew with its inputs between its last two whole
        measurements at other inputs (bytes ~ inputs ** it, within [1, 2]); None: not seen."""
        a, b = self.other[i], self.full[i]
        if a is None or b is None or min(a + b) <= 0 or _like(a[1], b[1]):  # alike: no growth to read
            return None
        return min(max(math.log(b[0] / a[0]) / math.log(b[1] / a[1]), 1.0), 2.0)

    def exponent(self) -> float:
        """How saved bytes grow with a forward's inputs, from the blocks seen at two sizes:
        UNSEEN (as attention's scores would) until one was."""
        seen = [e for e in (self._exponent(i) for i in range(self.n)) if e is not None]
        return statistics.median(seen) if seen else UNSEEN

    def so_far(self, tag: int) -> tuple[int, float]:
        """The blocks this forward ran before block ``tag`` - 1 (in any order), and what one
        of them saved, small tensors included: on average over those run whole, if any (a
        recomputed one saves only its inputs)."""
        ran = [i for i, c in enumerate(self.calls) if c and i != tag - 1]
        whole = [i for i in ran if not self.recomputed[i]] or ran
        per = sum(self.saved[i + 1] + self.small[i + 1] for i in whole) / len(whole) if whole else 0.0
        return len(ran), per

    # ---------------------------------------------------------------- backward

    def backward_reached(self, tag: int) -> None:
        self.marks.append((tag, self.clock.mark(), self.back_waited()))

    def _backward_times(self, recomputed: list[bool]) -> None:
        """Each block's backward, from the marks: from reaching its layer to reaching the next
        one below, less the waits for reads and its recomputation; the head's, from the
        forward's end to the first block."""
        marks = [m for m in self.marks if 0 <= m[0] <= self.n]  # tag 0 ends block 0's span
        if self.end_mark is None or not marks:
            return
        spans = [(self.n + 1, self.end_mark, self.end_waited), *marks]
        for (tag, a, wa), (nxt, b, wb) in zip(spans, spans[1:], strict=False):
            if nxt >= tag:  # another backward of the same graph, or out of order: not a span
                continue
            secs = max(self.clock.between(a, b) - (wb - wa), 0.0)
            if tag == self.n + 1:
                self.head_back = secs
            elif nxt == tag - 1:
                rec = self.recompute_s[tag - 1] if recomputed[tag - 1] else None
                self.backward_s[tag - 1] = max(secs - (rec or 0.0), 0.0)
                self.back_recent[tag - 1].append((self.backward_s[tag - 1], self.inputs[tag - 1]))
        self.marks = []

    def _io_cost(self, fwd: list[float]) -> None:
        """What offloading costs a step past the waits for reads (the hooks, the I/O's share of
        the CPU and memory, restoring): the offloaded blocks' time per byte over the kept
        ones', in a forward that had both; averaged with the last estimate."""
        per: dict[bool, list[float]] = {True: [], False: []}
        for i in range(self.n):
            b, nbytes = self.backward_s[i], self.saved[i + 1]
            if b is not None and nbytes and not self.recomputed[i]:
                per[self.offloaded[i]].append((fwd[i + 1] + b) / nbytes)
        if per[True] and per[False]:
            got = max(statistics.median(per[True]) - statistics.median(per[False]), 0.0)
            self.io_per_byte = got if self.io_per_byte is None else (self.io_per_byte + got) / 2

    def recompute_begins(self, tag: int) -> Any:
        return self.clock.start()

    def recompute_ends(self, tag: int, token: Any, host_s: float, saved: tuple[int, int] | None = None) -> None:
        """``saved``: what the recomputation saved, (bytes, of which in small storages)."""
        self.rec_spans.append((tag, self.clock.stop(token)))
        if saved is not None and self.calls[tag - 1] == 1:  # (a block called twice saves both calls')
            self.rec_saved[tag - 1] = (saved[0], saved[1], self.inputs[tag - 1])

    # ---------------------------------------------------------------- at the next plan

    def ready(self) -> bool:
        """Whether the last step's spans are done on the GPU: its last marks (one stream's
        events end in order; the reads wait for any other)."""
        last = [self.end_mark, *(m[1] for m in self.marks[-1:]), *(s[1][1] for s in self.rec_spans[-1:])]
        return all(self.clock.done(m) for m in last if m is not None)

    def blocks(self) -> tuple[list[Block], Head] | None:
        """The blocks as the last forward measured them, with each recomputed block's bytes
        estimated from its last measurement (or the others' bytes per input byte); None if the
        forward saw no block."""
        n = self.n
        fwd = [0.0] * (n + 2)
        for tag, span in self.spans:
            fwd[tag] += self.clock.seconds(span)
        for tag, span in self.rec_spans:
            self.recompute_s[tag - 1] = self.clock.seconds(span)
        self.rec_spans.clear()
        if not self.ended or not any(fwd[1 : n + 1]):
            return None
        self._backward_times(self.recomputed)
        now = []  # bytes per input byte of the blocks this forward saved whole, or made again
        for i in range(n):
            again = self.rec_saved[i] if self.recomputed[i] else None
            if not self.recomputed[i] or again is not None:
                nbytes, small, inputs = again or (self.saved[i + 1], self.small[i + 1], self.inputs[i])
                last = self.full[i]
                if last is not None and not _like(last[1], inputs):
                    self.other[i] = last
                self.full[i], self.full_small[i] = (nbytes, inputs), small
                if inputs > 0 and nbytes + small > 0:
                    now.append(nbytes / inputs)
        self.rec_saved = [None] * n
        # Blocks that saved nothing at all (frozen) say nothing of what the others save.
        some = [
            (f, s)
            for f, s in zip(self.full, self.full_small, strict=True)
            if f is not None and f[1] > 0 and f[0] + s > 0
        ]
        ratios = [b / x for (b, x), _ in some]
        per_input = statistics.median(ratios) if ratios else 1.0
        per_input_now = statistics.median(now) if now else None
        smalls = [s / x for (_, x), s in some]
        small_per_input = statistics.median(smalls) if smalls else 0.0
        rec = [r / fwd[i + 1] for i, r in enumerate(self.recompute_s) if r is not None and fwd[i + 1] > 0]
        rec_share = statistics.median(rec) if rec else 1.0
        back = [b / fwd[i + 1] for i, b in enumerate(self.backward_s) if b is not None and fwd[i + 1] > 0]
        back_share = statistics.median(back) if back else BACKWARD
        self._io_cost(fwd)
        per_byte = self.io_per_byte
        blocks = []
        grows = self.exponent()
        for i in range(n):
            inputs = self.inputs[i]
            known = self.full[i]
            if known is None:
                nbytes, small = int(per_input * inputs), int(small_per_input * inputs)
            elif self.recomputed[i] and known[1] > 0:
                # Measured at another batch or length: attention's T x T scores grow faster
                # than inputs (as its siblings grew, UNSEEN until one was measured at two sizes).
                power = self._exponent(i) or (grows if inputs > known[1] else 1.0)
                scale = (inputs / known[1]) ** power
                nbytes, small = int(known[0] * scale), int(self.full_small[i] * scale)
                if per_input_now is not None and not _like(known[1], inputs):
                    nbytes = max(nbytes, int(per_input_now * inputs))
            else:
                nbytes, small = known[0], self.full_small[i]
            if i == 0:
                nbytes += self.saved[0]  # what is saved before the first block goes with it
            if fwd[i + 1] > 0 and not self.recorded:
                self.fwd_recent[i].append((fwd[i + 1], inputs))
            f = steady(self.fwd_recent[i], inputs, fwd[i + 1])
            r = self.recompute_s[i] if self.recompute_s[i] is not None else f * rec_share
            b = self.backward_s[i] if self.backward_s[i] is not None else f * back_share
            b = steady(self.back_recent[i], inputs, b)
            if per_byte is None:  # the hooks' time alone (an offloaded block's forward has it already)
                cost = self.kept[i + 1] * OFFLOAD_TENSOR_S if self.cpu_hooks else 0.0
            else:
                cost = per_byte * nbytes
                if self.offloaded[i] and f + b > 0:  # its own time, without what offloading added
                    keep = max(f + b - cost, 0.0) / (f + b)
                    f, b = f * keep, b * keep
            held_in = min(inputs, nbytes + small)
            small_in = min(self.inputs_small[i], held_in)
            blocks.append(
                Block(i, nbytes, held_in, f, b, r, cost, self.recomputable[i] is Recomputable.YES, small, small_in)
            )
        self.recorded = True
        head_s = self.clock.seconds(self.head_span) if self.head_span is not None else 0.0
        head_b = self.head_back if self.head_back is not None else BACKWARD * head_s
        # Small tensors are kept whatever the plan: after the last block with the head's, and
        # from before the first to the end of the backward.
        return blocks, Head(self.saved[n + 1] + self.small[n + 1], head_s, head_b, first=self.small[0])


def _like(x: int, inputs: int) -> bool:
    """Inputs this close are one batch and length (times and bytes measured at one serve the other)."""
    return abs(x - inputs) <= SAME_INPUTS * max(inputs, 1)


def steady(recent: deque[tuple[float, int]], inputs: int, last: float) -> float:
    """The median of a block's recent times taken with inputs like ``inputs`` (older ones
    dropped), or ``last`` if none: on a GPU one step's time can be off by the host's waits
    (a 6 ms block read as 0 or 23 ms on the H100), and a plan solved from it is too."""
    like = [(t, x) for t, x in recent if _like(x, inputs)]
    if len(like) < len(recent):
        recent.clear()
        recent.extend(like)
    return statistics.median(t for t, _ in like) if like else last
