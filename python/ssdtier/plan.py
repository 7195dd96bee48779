"""The ROK plan: per block, keep, offload or recompute, chosen from measured numbers.

Pure functions, tested on synthetic profiles. :func:`simulate` predicts one assignment's
step: when each block's bytes leave and come back, the stalls, and the most activation bytes
held at once. :func:`solve` searches assignments for the fastest within a device budget
(docs/planner.md has the model and the search).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .sizes import format_size

__all__ = ["Action", "Block", "Decision", "Head", "Outcome", "Plan", "Transfers", "simulate", "solve"]

EPS = 1e-9  # seconds: a transfer that ends as its window does fits (sums of floats round)
FREE = 0.03  # without a budget: offload while the predicted step stays within this share of keep's


class Action(enum.Enum):
    """What one block's saved activations do."""

    KEEP = "keep"
    OFFLOAD = "offload"  # to the host tier, spilling to NVMe; back before its backward
    RECOMPUTE = "recompute"  # dropped, its forward run again in backward; its inputs kept
    RECOMPUTE_OFFLOAD = "recompute+offload"  # recomputed, and its inputs offloaded

    @property
    def recomputes(self) -> bool:
        return self is Action.RECOMPUTE or self is Action.RECOMPUTE_OFFLOAD

    @property
    def offloads(self) -> bool:
        """Whether what the offloader sees of the block (all of it, or its inputs) leaves."""
        return self is Action.OFFLOAD or self is Action.RECOMPUTE_OFFLOAD


@dataclass(frozen=True)
class Block:
    """What one block did in a measured step."""

    index: int
    bytes: int  # saved, each storage once
    inputs: int  # what a recomputation holds: the block's inputs
    forward_s: float
    backward_s: float
    recompute_s: float  # its forward again, in backward
    offload_s: float = 0.0  # the hooks' time that the step pays when the block is offloaded
    recomputable: bool = True  # not when it updates a cache each call, or changes its inputs in place
    small: int = 0  # saved below policy.min_tensor_bytes: never moved, dropped only by recomputing
    inputs_small: int = 0  # of ``inputs``, those below it: kept even when the inputs are offloaded

    @property
    def whole(self) -> int:
        """Bytes the block holds kept (and in its backward, whatever its action)."""
        return self.bytes + self.small

    def held(self, a: Action) -> int:
        """Bytes the block holds on the device from its forward to its backward."""
        if a is Action.KEEP:
            return self.whole
        if a is Action.RECOMPUTE:
            return self.inputs
        return self.small if a is Action.OFFLOAD else self.inputs_small

    def moved(self, a: Action) -> int:
        if a is Action.OFFLOAD:
            return self.bytes
        return self.inputs - self.inputs_small if a is Action.RECOMPUTE_OFFLOAD else 0


@dataclass(frozen=True)
class Head:
    """What runs after the last block: its saved bytes (always kept, needed first) and times;
    ``working``: the step's measured peak beyond the model's (activation gradients, the
    loss's working memory), added to every plan's."""

    bytes: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    working: int = 0
    first: int = 0  # kept from before the first block to the end of the backward (small tensors)


@dataclass(frozen=True)
class Transfers:
    """How offloaded bytes leave the device and come back.

    ``out``/``back``: bytes per second between the device and the host tier (a GPU's link);
    None where there is no such copy (CPU tensors: written to NVMe from their own pages, or
    copied into the arena as part of the forward). ``host``: the arena between them and NVMe
    (0: straight to NVMe). ``queue``: the most bytes of copies out in flight before the
    forward waits (None: half the arena).
    """

    write: float  # NVMe, bytes per second
    read: float
    out: float | None = None
    back: float | None = None
    host: int = 0
    queue: int | None = None
    nvme: int | None = None  # NVMe capacity (None: enough)
    per_byte_s: float = 0.0  # waits measured past the model's, charged to each byte moved


@dataclass(frozen=True)
class Outcome:
    """A simulated step under one assignment."""

    peak: int  # most activation bytes held on the device at once
    forward_peak: int  # ... at the forward's end
    extra_s: float  # seconds over keeping everything
    forward_wait_s: float
    backward_wait_s: float
    recompute_s: float
    moved: int  # bytes offloaded
    spill: int  # of them, bytes written to NVMe
    copy_end_s: float  # when the last offloaded byte left the device
    late: tuple[int, ...]  # blocks whose bytes come back late
    fits_host: bool  # the host tier and NVMe hold what is offloaded
    before: tuple[int, ...] = ()  # bytes held as each block starts, sources still leaving included
    back: tuple[int, ...] = ()  # ... in each block's backward, with what is read ahead (peak's terms)


def _wait_for_queue(channel_free: float, t: float, rate: float, queue: int) -> float:
    """Seconds the forward waits at ``t`` until at most ``queue`` bytes are in flight."""
    return max(0.0, (channel_free - t) - queue / rate)


def simulate(
    blocks: Sequence[Block],
    actions: Sequence[Action],
    tr: Transfers,
    head: Head = Head(),
    limit: int | None = None,
) -> Outcome:
    """One step under ``actions``. Saves come evenly through a block's forward (a block's
    inputs at its start), one transfer after another at the channel's rate. Through a host
    tier the store writes the oldest bytes out once three quarters of it are held, and a copy
    waits for room. A source holds device memory until its bytes are out. In backward a
    block's bytes come back as early as the device has room for them within ``limit``, beside
    the most a recomputation at or below it remakes (None: the most the plan holds without
    them, and one block's more); spilled bytes are read
    from NVMe first, after the writes. The backward waits for bytes that are late."""
    n = len(blocks)
    cap = tr.host
    soft = cap - cap // 4
    queue = tr.queue if tr.queue is not None else cap // 2
    to_disk = tr.out is None and not cap  # CPU tensors written from their own pages
    rate = tr.write if to_disk else tr.out  # the channel that empties device memory
    t = link = disk = 0.0
    saved = spill = 0
    wait_f = hooks = 0.0
    moved = [0] * n
    spans: list[tuple[float, float, int, int]] = []  # (begin, end, bytes, block) of sources held
    done = [0.0] * n
    held = [b.held(a) for b, a in zip(blocks, actions, strict=True)]
    again = [a is Action.RECOMPUTE or a is Action.RECOMPUTE_OFFLOAD for a in actions]  # recomputed
    before, kept = [], head.first
    live = 0  # spans before it have ended: their ends come in order, as ``t`` does
    for i, (b, a) in enumerate(zip(blocks, actions, strict=True)):
        start = t
        while live < len(spans) and spans[live][1] <= t:
            live += 1
        before.append(kept + (_leaving(spans[live:], t) if live < len(spans) else 0))
        kept += held[i]
        t += b.forward_s
        o = b.moved(a)
        if not o:
            continue
        cost = b.offload_s + o * tr.per_byte_s
        hooks += cost
        t += cost
        moved[i] = o
        even = a is Action.OFFLOAD  # a recomputed block's inputs exist at its start
        if to_disk:
            begin = max(disk, start)
            end = begin + o / tr.write
            disk = end = max(end, t) if even else end
            spill += o
        else:
            begin = max(link, start) if tr.out is not None else start
            end = begin + o / tr.out if tr.out is not None else t
            if even:
                end = max(end, t)
            saved += o
            more = saved - soft - spill
            if more > 0:  # written out from when this block's bytes pass three quarters of the arena
                frac = min(1.0, max(0.0, (soft + spill - (saved - o)) / o))
                disk = max(disk, begin + (end - begin) * frac) + more / tr.write
                spill += more
            over = saved - (spill - max(0.0, disk - end) * tr.write) - cap
            if over > 0:  # the arena is full: the copy waits for the disk
                end += over / tr.write
            if tr.out is not None:
                link = end
        done[i] = end
        if rate is not None:  # a channel that empties device memory at its pace
            spans.append((begin, end, o, i))
            w = _wait_for_queue(end, t, rate, queue) if queue else 0.0
            if w > 0:
                t += w
                wait_f += w
    t_fwd = t + head.forward_s
    late_spans = [x for x in spans if x[1] > t_fwd]  # sources still held when the forward ends

    def leaving(t: float, skip: int = -1) -> int:
        return _leaving(late_spans, t, skip)

    if limit is not None:  # what the model does not see takes its share of the budget first
        limit -= head.working
    unfinished = leaving(t_fwd)
    peak = forward_peak = head.bytes + kept + int(unfinished)  # (kept: what the blocks hold, and head.first)
    # Backward: the spilled bytes are the first ones saved. NVMe reads them into the host
    # after the writes, in the order the backward needs them; copies back to the device (or,
    # without a link, the reads) start as soon as the device has room under ``limit``.
    on_disk = [0] * n
    left = spill
    for i in range(n):
        on_disk[i] = min(moved[i], left)
        left -= on_disk[i]
    remakes = [0] * n
    if limit is not None:
        remakes = list(itertools.accumulate((b.whole if r else 0 for b, r in zip(blocks, again, strict=True)), max))
    aside = [max(r - (b.whole if a else 0), 0) for r, b, a in zip(remakes, blocks, again, strict=True)]
    if limit is None:  # the most the plan holds anyway (at the forward's end, or a block made again), and a block ahead
        below, limit = kept, peak
        for j in range(n - 1, -1, -1):
            below -= held[j]
            limit = max(limit, below + max(blocks[j].whole, held[j]) + (blocks[j].inputs if again[j] else 0))
        limit += max(moved, default=0)
    order = [i for i in range(n - 1, -1, -1) if moved[i]]
    ready = [max(t_fwd, done[i]) for i in range(n)]
    if tr.back is not None:
        rd = t_fwd
        for i in order:
            if on_disk[i]:
                rd = max(rd, disk) + on_disk[i] / tr.read
                ready[i] = rd
    begins, arrive = [0.0] * n, [0.0] * n
    chan = t_fwd
    q, ahead = 0, 0  # restores started, and their bytes on the device for blocks not reached

    def start(i: int, at: float) -> None:
        nonlocal chan, q, ahead
        if done[i] > at:  # still leaving: its source serves, held until then (``leaving``)
            begins[i] = arrive[i] = at
            q += 1
            return
        if tr.back is not None:
            begins[i] = max(chan, ready[i], at)
            chan = arrive[i] = begins[i] + moved[i] / tr.back
        else:  # from the arena at once, from NVMe at its rate
            begins[i] = max(chan, (done[i] if to_disk else disk) if on_disk[i] else ready[i], at)
            chan = arrive[i] = begins[i] + on_disk[i] / tr.read
        q += 1
        ahead += moved[i]

    def fill(at: float, used: int) -> None:
        while q < len(order) and used + ahead + moved[order[q]] <= limit:
            start(order[q], at)

    below = kept
    if n:  # during the head's backward, with room for the last block's
        last = blocks[-1]
        first = below - held[-1] + max(last.whole, held[-1]) + (last.inputs if again[-1] else 0)
        fill(t_fwd, max(head.bytes + below + remakes[-1], first))
    t = t_fwd + head.backward_s
    wait_b = rec = 0.0
    late: list[int] = []
    back = [0] * n
    for j in range(n - 1, -1, -1):
        b, a = blocks[j], actions[j]
        below -= held[j]
        if moved[j]:
            if q < len(order) and order[q] == j:  # not started yet: now, room or not
                start(j, t)
            if done[j] <= begins[j]:
                ahead -= moved[j]
            if done[j] >= t:  # still leaving: its source serves, with no read
                lateness = 0.0
            elif a is Action.OFFLOAD:  # saves are needed through the backward, the last saved first
                lateness = max(begins[j] - t, arrive[j] - (t + b.backward_s))
            else:
                lateness = arrive[j] - t  # the inputs, before the recomputation
            if lateness > EPS:
                late.append(b.index)
                t += lateness
                wait_b += lateness
        working = max(b.whole, held[j]) + (b.inputs if again[j] else 0)
        gone = leaving(t, j) if late_spans else 0
        fill(t, below + working + gone + aside[j])
        back[j] = below + working + ahead + gone + head.working
        peak = max(peak, back[j] - head.working)
        t += b.backward_s
        if again[j]:
            t += b.recompute_s
            rec += b.recompute_s
    total = sum(moved)
    room = cap + (tr.nvme if tr.nvme is not None else total)
    copy_end = max((x[1] for x in spans), default=0.0)
    return Outcome(
        peak=peak + head.working,
        forward_peak=forward_peak,
        extra_s=wait_f + hooks + wait_b + rec,
        forward_wait_s=wait_f,
        backward_wait_s=wait_b,
        recompute_s=rec,
        moved=total,
        spill=spill,
        copy_end_s=copy_end,
        late=tuple(late),
        fits_host=total <= room,
        before=tuple(before),
        back=tuple(back),
    )


def _leaving(spans: Sequence[tuple[float, float, int, int]], t: float, skip: int = -1) -> int:
    """Bytes of sources whose copies out are under way at ``t``, as much as is left of each."""
    total = 0.0
    for b, end, o, i in spans:
        if end > t and i != skip:
            total += o if b >= t else o * min(1.0, (end - t) / max(end - b, EPS))
    return int(total)


@dataclass(frozen=True)
class Decision:
    """One block of a plan: its profile, its action and why."""

    block: Block
    action: Action
    reason: str


@dataclass(frozen=True)
class Plan:
    """An action per block, what the model predicts for it, and why."""

    decisions: tuple[Decision, ...]
    outcome: Outcome
    transfers: Transfers
    head: Head
    device_budget: int | None
    step_s: float  # keep's step, as measured: the sum of the blocks' and the head's times
    fits: bool  # the predicted peak is within the budget
    reason: str

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(d.action for d in self.decisions)

    def count(self, action: Action) -> int:
        return sum(1 for d in self.decisions if d.action is action)

    @property
    def keep_last(self) -> int:
        """The kept blocks at the end (what the keep-or-offload plans of before reported)."""
        k = 0
        for d in reversed(self.decisions):
            if d.action is not Action.KEEP:
                break
            k += 1
        return k

    @property
    def slowdown(self) -> float:
        """The predicted step over keep's."""
        return 1.0 + self.outcome.extra_s / self.step_s if self.step_s > 0 else 1.0

    def summary(self) -> str:
        parts = [f"{self.count(a)} {a.value}" for a in Action if self.count(a)]
        where = "within" if self.outcome.peak <= (self.device_budget or 0) else "past"
        budget = "" if self.device_budget is None else f" {where} {format_size(self.device_budget)}"
        return (
            f"{', '.join(parts) or 'no blocks'}; predicted peak {format_size(self.outcome.peak)}{budget}, "
            f"{self.slowdown:.3f}x keep's step"
        )

    def table(self) -> str:
        tr, o = self.transfers, self.outcome
        link = f"copies {tr.out / 1e9:.1f} GB/s out, {tr.back / 1e9:.1f} back; " if tr.out and tr.back else ""
        host = f"host tier {format_size(tr.host)}; " if tr.host else ""
        rows = [
            f"ssdtier plan: {self.summary()}; {self.reason}",
            f"  {link}{host}NVMe write {tr.write / 1e6:.0f} MB/s, read {tr.read / 1e6:.0f} MB/s; "
            f"moved {format_size(o.moved)} ({format_size(o.spill)} to NVMe); waits {o.forward_wait_s * 1e3:.1f} ms "
            f"forward, {o.backward_wait_s * 1e3:.1f} ms backward; recompute {o.recompute_s * 1e3:.1f} ms"
            + (f"; {format_size(self.head.bytes)} saved after the last block" if self.head.bytes else "")
            + (f"; {format_size(self.head.working)} of the peak measured past the model" if self.head.working else ""),
            "  block      bytes     inputs  forward  action",
        ]
        for d in self.decisions:
            b = d.block
            rows.append(
                f"  {b.index:5d} {format_size(b.bytes):>10s} {format_size(b.inputs):>10s} {b.forward_s * 1e3:6.1f}ms"
                f"  {d.action.value}: {d.reason}"
            )
        return "\n".join(rows)


SAME_PEAK = 0.01  # peaks this close are alike: fewer bytes moved decides


def _better(a: Outcome, b: Outcome | None) -> bool:
    """Faster, then lower, then fewer bytes moved."""
    if b is None:
        return True
    if abs(a.extra_s - b.extra_s) > EPS:
        return a.extra_s < b.extra_s
    if abs(a.peak - b.peak) > SAME_PEAK * max(a.peak, b.peak):
        return a.peak < b.peak
    return a.moved < b.moved


def _lower(a: Outcome, b: Outcome | None) -> bool:
    """Lower, then faster, then fewer bytes moved."""
    if b is None:
        return True
    if abs(a.peak - b.peak) > SAME_PEAK * max(a.peak, b.peak):
        return a.peak < b.peak
    if abs(a.extra_s - b.extra_s) > EPS:
        return a.extra_s < b.extra_s
    return a.moved < b.moved


def _assign(n: int, offload: int, recompute: Sequence[int], inputs_out: bool) -> list[Action]:
    acts = [Action.OFFLOAD] * offload + [Action.KEEP] * (n - offload)
    r = Action.RECOMPUTE_OFFLOAD if inputs_out else Action.RECOMPUTE
    for i in recompute:
        acts[i] = r
    return acts


def _search(
    blocks: Sequence[Block],
    tr: Transfers,
    head: Head,
    fits: Callable[[Outcome], bool],
    allowed_extra: float | None,
    limit: int | None = None,
) -> tuple[list[Action], Outcome] | None:
    """The fastest assignment that ``fits`` among: the first ``o`` blocks offloaded, then the
    ``r`` blocks that free the most per second of recomputation recomputed (inputs kept or
    offloaded), the rest kept. For each ``o`` the fewest ``r`` that fit (the peak falls as
    ``r`` grows, the time does not). With ``allowed_extra``: the lowest peak within it,
    offloading only."""
    n = len(blocks)
    best: tuple[list[Action], Outcome] | None = None
    if allowed_extra is not None:
        for o in range(n + 1):
            acts = _assign(n, o, (), False)
            got = simulate(blocks, acts, tr, head)
            if got.fits_host and got.extra_s <= allowed_extra + EPS and _lower(got, best[1] if best else None):
                best = (acts, got)
        return best
    for o in range(n + 1):
        if best is not None:  # offloading more only adds waits once the link is full
            plain = simulate(blocks, _assign(n, o, (), False), tr, head, limit)
            if plain.forward_wait_s + plain.backward_wait_s > best[1].extra_s + EPS:
                break
        rest = sorted((i for i in range(o, n) if blocks[i].recomputable), key=lambda i: (-_frees_per_s(blocks[i]), i))
        for inputs_out in (False, True):
            lo, hi = 0, len(rest)
            top = simulate(blocks, _assign(n, o, rest, inputs_out), tr, head, limit)
            if not fits(top):
                continue
            found = top
            while lo < hi:
                mid = (lo + hi) // 2
                got = simulate(blocks, _assign(n, o, rest[:mid], inputs_out), tr, head, limit)
                if fits(got):
                    hi, found = mid, got
                else:
                    lo = mid + 1
            if hi == len(rest):
                found = top
            if _better(found, best[1] if best else None):
                best = (_assign(n, o, rest[:hi], inputs_out), found)
    return best


def _frees_per_s(b: Block) -> float:
    return (b.whole - b.inputs) / max(b.recompute_s, EPS)


def solve(
    blocks: Sequence[Block],
    tr: Transfers,
    device_budget: int | None = None,
    head: Head = Head(),
    free: float = FREE,
) -> Plan:
    """The plan: with a budget, the fastest assignment whose predicted peak is within it (else
    the lowest-peak one, marked not fitting); without, the lowest peak that offloading alone
    reaches while the step stays within ``free`` of keep's.

    Args:
        blocks: each block's profile, in forward order.
        tr: the transfer rates and the host tier.
        device_budget: the most activation bytes to hold on the device at once, or None.
        head: what runs after the blocks.
        free: without a budget, the share of keep's step that offloading may cost.
    """
    n = len(blocks)
    step = sum(b.forward_s + b.backward_s for b in blocks) + head.forward_s + head.backward_s
    keep = [Action.KEEP] * n
    kept = simulate(blocks, keep, tr, head)
    if device_budget is None:
        found = _search(blocks, tr, head, lambda o: True, free * step)
        acts, got = found if found is not None else (keep, kept)
        reason = "no device budget: offloaded what the transfers hide"
        return _plan(blocks, acts, got, tr, head, None, step, True, reason)
    budget = device_budget
    if kept.peak <= budget:
        return _plan(blocks, keep, kept, tr, head, budget, step, True, "everything fits: kept")
    found = _search(blocks, tr, head, lambda o: o.fits_host and o.peak <= budget, None, budget)
    if found is None:
        acts = [Action.RECOMPUTE_OFFLOAD if b.recomputable else Action.OFFLOAD for b in blocks]
        found = (acts, simulate(blocks, acts, tr, head, budget))
    acts, got = _improve(blocks, found[0], found[1], tr, head, budget)
    if got.fits_host and got.peak <= budget:
        return _plan(blocks, acts, got, tr, head, budget, step, True, "the fastest mix within the budget")
    reason = f"nothing fits the budget: the least memory found ({format_size(got.peak)} predicted)"
    fixed = head.bytes + head.first + head.working  # no block's action moves these: a smaller loss would
    if fixed:
        working = f", {format_size(head.working)} of it working memory" if head.working else ""
        reason += f"; {format_size(fixed)} of it is the loss's and what follows the last block{working}"
    return _plan(blocks, acts, got, tr, head, budget, step, False, reason)


IMPROVE_MAX_BLOCKS = 64  # a round of single-block changes costs 3n simulations of n blocks


def _improve(
    blocks: Sequence[Block], acts: list[Action], got: Outcome, tr: Transfers, head: Head, budget: int
) -> tuple[list[Action], Outcome]:
    """Single-block changes while one helps, the best first: toward the budget, then toward
    speed. The structured search assumes alike blocks; unlike ones (a block that saves much
    for little compute, a large head) leave it short of the best."""
    if len(blocks) > IMPROVE_MAX_BLOCKS:
        return acts, got

    def over(o: Outcome) -> int:
        return max(0, o.peak - budget) if o.fits_host else 1 << 62

    def beats(o: Outcome, cur: Outcome) -> bool:
        if over(o) != over(cur):
            return over(o) < over(cur)
        return _better(o, cur)

    def tie(o: Outcome, cur: Outcome) -> bool:  # as fast and as low, fewer bytes moved
        return (
            over(o) == over(cur)
            and abs(o.extra_s - cur.extra_s) <= EPS
            and abs(o.peak - cur.peak) <= SAME_PEAK * max(o.peak, cur.peak)
            and o.moved < cur.moved
        )

    def trials(i: int) -> Iterator[tuple[Outcome, Action]]:
        for a in Action:
            if a is not acts[i] and (blocks[i].recomputable or not a.recomputes):
                trial = acts.copy()
                trial[i] = a
                yield simulate(blocks, trial, tr, head, budget), a

    acts = acts.copy()
    seen = {tuple(acts)}
    for _ in range(4 * len(blocks)):
        step: tuple[Outcome, int, Action] | None = None
        for i in range(len(blocks)):
            for o, a in trials(i):
                if beats(o, got) and (step is None or beats(o, step[0])):
                    step = (o, i, a)
        if step is None:
            break
        was, (got, i, acts[i]) = got, step
        if tuple(acts) in seen:  # the tolerances let changes come round again: a cycle, not progress
            break
        seen.add(tuple(acts))
        if tie(got, was):
            # Only fewer bytes moved: the other blocks' such changes are taken in one sweep,
            # not a scan of every block each (a long chain of them is common).
            for i in range(len(blocks)):
                best = min((x for x in trials(i) if tie(x[0], got)), key=lambda x: x[0].moved, default=None)
                if best is not None:
                    got, acts[i] = best
    return acts, got


def _plan(
    blocks: Sequence[Block],
    acts: Sequence[Action],
    got: Outcome,
    tr: Transfers,
    head: Head,
    budget: int | None,
    step: float,
    fits: bool,
    reason: str,
) -> Plan:
    late = set(got.late)
    decisions = []
    for b, a in zip(blocks, acts, strict=True):
        if a is Action.KEEP:
            why = "within the budget" if budget is not None else "its transfers would not hide"
        elif a is Action.OFFLOAD:
            why = "back late: the backward waits" if b.index in late else "its transfers hide behind compute"
        elif a is Action.RECOMPUTE:
            why = f"frees {format_size(b.whole - b.inputs)} for {b.recompute_s * 1e3:.1f} ms"
        else:
            frees = format_size(b.whole - b.inputs_small)
            why = f"frees {frees} for {b.recompute_s * 1e3:.1f} ms, its inputs offloaded"
        decisions.append(Decision(b, a, why))
    return Plan(tuple(decisions), got, tr, head, budget, step, fits, reason)
