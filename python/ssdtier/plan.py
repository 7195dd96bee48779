"""The adaptive plan: which layers to offload so that I/O hides behind compute.

Pure functions over measured numbers, so the policy is tested on synthetic timings.
docs/offloader.md#the-adaptive-plan has the model; in short (as in SSDTrain): a
layer's saved bytes leave while the forward goes on and come back, in reverse order,
while the backward goes on. The last layers' backward comes first, leaving no time to
read, so the plan keeps the fewest last layers for which nothing waits, within the
device budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sizes import format_size

__all__ = ["HostTier", "LayerDecision", "LayerProfile", "Plan", "make_plan"]


@dataclass(frozen=True)
class LayerProfile:
    """What one block did in a profiled iteration."""

    index: int
    bytes: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class HostTier:
    """The arena that takes each saved tensor first (the CUDA transport, or CPU tensors with
    ``io.zero_copy`` off); the store writes its oldest bytes to NVMe as it fills."""

    capacity: int
    # Copies between the device and the arena; None where they are part of the measured
    # forward and backward (CPU tensors are copied on the thread that saves them).
    copy_bytes_per_s: float | None
    # The most bytes of copies in flight (the CUDA transport's bound): half the arena if None.
    queue: int | None = None


@dataclass(frozen=True)
class LayerDecision:
    index: int
    bytes: int
    forward_s: float
    backward_s: float
    offload: bool
    reason: str


@dataclass(frozen=True)
class Plan:
    """The decision and why, per layer."""

    keep_last: int
    layers: tuple[LayerDecision, ...]
    write_bytes_per_s: float
    read_bytes_per_s: float
    write_finish_s: float  # when the NVMe writes end (they may run into the backward with a host tier)
    forward_s: float
    stall_free: bool
    reason: str
    host: HostTier | None = None
    copy_finish_s: float = 0.0  # when the last copy to the host tier ends
    spill_bytes: int = 0  # the offloaded bytes that go to NVMe
    device_budget: int | None = None

    def table(self) -> str:
        disk = f"write {self.write_bytes_per_s / 1e6:.0f} MB/s, read {self.read_bytes_per_s / 1e6:.0f} MB/s"
        if self.host is None:
            where = f"  disk: {disk}; writes done at {self.write_finish_s:.3f} s of a {self.forward_s:.3f} s forward"
        else:
            rate, fwd = self.host.copy_bytes_per_s, f"a {self.forward_s:.3f} s forward"
            if rate:
                fwd = f"copies at {rate / 1e9:.1f} GB/s done at {self.copy_finish_s:.3f} s of {fwd}"
            nvme = f"nothing to NVMe ({disk})"
            if self.spill_bytes:
                nvme = f"{format_size(self.spill_bytes)} to NVMe ({disk}), written by {self.write_finish_s:.3f} s"
            where = f"  host tier {format_size(self.host.capacity)}; {fwd}; {nvme}"
        budget = "" if self.device_budget is None else f" (device budget {format_size(self.device_budget)})"
        rows = [
            f"ssdtier plan: keep the last {self.keep_last} of {len(self.layers)} layers{budget}; {self.reason}",
            where,
            "  layer      bytes   forward  backward  decision",
        ]
        for d in self.layers:
            rows.append(
                f"  {d.index:5d} {format_size(d.bytes):>10s} {d.forward_s * 1e3:7.1f}ms {d.backward_s * 1e3:7.1f}ms"
                f"  {'offload' if d.offload else 'keep'}: {d.reason}"
            )
        return "\n".join(rows)


@dataclass(frozen=True)
class _Run:
    """One candidate's timeline: the offloaded layers' bytes through the tiers."""

    forward_ok: bool  # nothing in the forward waits, and device memory is freed by its end
    late: int  # the first layer (in backward order) whose bytes come back late, or -1
    write_finish: float
    copy_finish: float
    spill: int

    @property
    def reads_ok(self) -> bool:
        return self.late < 0


EPS = 1e-9  # seconds: a transfer that ends as its window does fits (sums of floats round)


def _run(layers: list[LayerProfile], k: int, wbw: float, rbw: float, host: HostTier | None) -> _Run:
    """A layer's bytes are saved evenly through its forward and needed evenly through its
    backward; a transfer runs at its rate from when its first byte can go, and must start
    by the layer's backward and end with it. Without a host tier every byte is written to
    NVMe, its source held until then. With one, a copy lands in the arena and the store
    writes the oldest bytes out once it is three quarters full (it keeps a quarter free or
    leaving): the forward waits when a copy finds no room or the host tier's queue bound is
    in flight, and the last bytes saved come back from memory."""
    n = len(layers)
    off = layers[: n - k]
    forward = sum(x.forward_s for x in layers)
    rate = host.copy_bytes_per_s if host is not None else None
    cap = host.capacity if host is not None else 0
    queue = cap // 2 if host is None or host.queue is None else host.queue
    soft = cap - cap // 4
    t = write_finish = copy_finish = 0.0
    saved = spill = 0
    room_ok = True
    for x in off:
        start, t = t, t + x.forward_s
        saved += x.bytes
        if host is None:
            write_finish = max(max(write_finish, start) + x.bytes / wbw, t)
            continue
        copy_finish = max(max(copy_finish, start) + (x.bytes / rate if rate else 0.0), t)
        if rate:
            room_ok &= (copy_finish - t) * rate <= queue  # the transport's bound on copies in flight
        more = saved - soft - spill
        if more > 0:  # written out from when this layer's saves pass three quarters of the arena
            begin = start + x.forward_s * (soft + spill - (saved - x.bytes)) / x.bytes
            write_finish = max(max(write_finish, begin) + more / wbw, t)
            spill += more
        room_ok &= saved - (spill - max(0.0, write_finish - t) * wbw) <= cap  # held: saved less written
    if host is None:
        forward_ok, spill, copy_finish = write_finish <= forward + EPS, saved, write_finish
    else:
        forward_ok = room_ok and copy_finish <= forward + EPS
    # Backward visits layers n-1 .. 0; the first `spill` bytes saved come from NVMe (after
    # the writes still going), then every layer crosses back to the device.
    needed = sum(x.backward_s for x in layers[n - k :])
    read = max(0.0, write_finish - forward) if host is not None else 0.0
    back = 0.0
    late = -1
    for x in reversed(off):
        saved -= x.bytes
        on_disk = min(x.bytes, max(0, spill - saved))
        begin = end = 0.0
        if on_disk:
            begin, read = read, read + on_disk / rbw
            end = read
        if rate:  # the copy to the device follows the read, or starts when the last one is done
            begin = max(begin, back)
            back = end = max(begin + x.bytes / rate, end)
        if (begin > needed + EPS or end > needed + x.backward_s + EPS) and late < 0:
            late = x.index
        needed += x.backward_s
    return _Run(forward_ok, late, write_finish, copy_finish, spill)


def make_plan(
    layers: list[LayerProfile],
    write_bytes_per_s: float,
    read_bytes_per_s: float,
    device_budget: int | None = None,
    min_keep: int = 0,
    host: HostTier | None = None,
    head: int = 0,
) -> Plan:
    """Choose how many last layers to keep.

    Args:
        layers: the profile of each block, in forward order.
        write_bytes_per_s / read_bytes_per_s: the store's measured NVMe bandwidth.
        device_budget: the most bytes of kept activations allowed, or None.
        min_keep: keep at least this many (the re-planner raises it after stalls).
        host: the host tier the bytes go through first, or None (straight to NVMe).
        head: bytes kept with the last layers, ahead of them in the budget: what is saved
            after the last block, which the backward needs first.

    Returns:
        The plan: the fewest kept last layers for which the forward never waits and the
        reads are done before each layer's backward; within the budget, even if that stalls.
    """
    n = len(layers)
    wbw = max(write_bytes_per_s, 1.0)
    rbw = max(read_bytes_per_s, 1.0)
    max_keep = n
    if device_budget is not None:
        kept = head
        max_keep = 0
        for layer in reversed(layers):
            if kept + layer.bytes > device_budget:
                break
            kept += layer.bytes
            max_keep += 1
    lo = min(min_keep, max_keep)
    k = lo
    r = _run(layers, k, wbw, rbw, host)
    while not (r.forward_ok and r.reads_ok) and k < max_keep:
        k += 1
        r = _run(layers, k, wbw, rbw, host)
    stall_free = r.forward_ok and r.reads_ok
    # Keeping all always fits: only a device budget below that leaves stalls.
    if not stall_free:
        reason = f"the device budget ({format_size(device_budget or 0)}) allows keeping only {max_keep}; expect stalls"
    elif k == n and n > 0:
        too_slow = "the disk is too slow" if host is None else "the copies and the disk are too slow"
        reason = f"{too_slow} to hide any layer's I/O: keeping all"
    else:
        reason = "writes fit in the forward and reads in the backward"
        if host is not None:
            reason = "the host tier and the disk keep up with the forward and the backward"
        if k == lo and lo > 0:
            reason += f" (at least {lo} kept after stalls)"
    decisions = []
    for layer in layers:
        if layer.index >= n - k:
            why = "its backward comes too soon to read it back" if k < n else "kept: I/O cannot be hidden"
            if not stall_free:
                why = "kept within the device budget"
            decisions.append(LayerDecision(layer.index, layer.bytes, layer.forward_s, layer.backward_s, False, why))
        else:
            why = "saved during the forward, back as its backward needs it"
            if not r.forward_ok or (not r.reads_ok and layer.index <= r.late):
                why = "offloaded by budget: its I/O may stall"
            decisions.append(LayerDecision(layer.index, layer.bytes, layer.forward_s, layer.backward_s, True, why))
    forward = sum(x.forward_s for x in layers)
    return Plan(
        k,
        tuple(decisions),
        wbw,
        rbw,
        r.write_finish,
        forward,
        stall_free,
        reason,
        host,
        r.copy_finish,
        r.spill,
        device_budget,
    )
