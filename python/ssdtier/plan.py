"""The adaptive plan: which layers to offload so that I/O hides behind compute.

Pure functions over measured numbers, so the policy is tested on synthetic
timings. The model (as in SSDTrain): a layer's saved bytes are written while
the forward goes on and read back, in reverse order, while backward goes on.
Writes must finish inside the forward; a layer's reads must finish before its
backward starts. The last layers' backward comes first, leaving no time to
read, so the plan keeps the fewest last layers that make both hold, within the
device budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sizes import format_size

__all__ = ["LayerDecision", "LayerProfile", "Plan", "make_plan"]


@dataclass(frozen=True)
class LayerProfile:
    """What one block did in a profiled iteration."""

    index: int
    bytes: int
    forward_s: float
    backward_s: float


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
    write_finish_s: float
    forward_s: float
    stall_free: bool
    reason: str

    def table(self) -> str:
        rows = [
            f"ssdtier plan: keep the last {self.keep_last} of {len(self.layers)} layers; {self.reason}",
            f"  disk: write {self.write_bytes_per_s / 1e6:.0f} MB/s, read {self.read_bytes_per_s / 1e6:.0f} MB/s; "
            f"writes done at {self.write_finish_s:.3f} s of a {self.forward_s:.3f} s forward",
            "  layer      bytes   forward  backward  decision",
        ]
        for d in self.layers:
            rows.append(
                f"  {d.index:5d} {format_size(d.bytes):>10s} {d.forward_s * 1e3:7.1f}ms {d.backward_s * 1e3:7.1f}ms"
                f"  {'offload' if d.offload else 'keep'}: {d.reason}"
            )
        return "\n".join(rows)


def _check(layers: list[LayerProfile], k: int, wbw: float, rbw: float) -> tuple[bool, bool, float, int]:
    """(writes fit, reads fit, when the writes finish, first layer whose read is late or -1)."""
    n = len(layers)
    off = layers[: n - k]
    t = finish = 0.0
    for layer in off:
        t += layer.forward_s
        finish = max(finish, t) + layer.bytes / wbw
    forward = sum(layer.forward_s for layer in layers)
    writes_ok = finish <= forward
    # Backward visits layers n-1 .. 0; reads run back to back from its start.
    needed = sum(layer.backward_s for layer in layers[n - k :])
    done = 0.0
    late = -1
    for layer in reversed(off):
        done += layer.bytes / rbw
        if done > needed and late < 0:
            late = layer.index
        needed += layer.backward_s
    return writes_ok, late < 0, finish, late


def make_plan(
    layers: list[LayerProfile],
    write_bytes_per_s: float,
    read_bytes_per_s: float,
    device_budget: int | None = None,
    min_keep: int = 0,
) -> Plan:
    """Choose how many last layers to keep.

    Args:
        layers: the profile of each block, in forward order.
        write_bytes_per_s / read_bytes_per_s: the store's measured bandwidth.
        device_budget: the most bytes of kept activations allowed, or None.
        min_keep: keep at least this many (the re-planner raises it after stalls).

    Returns:
        The plan: the fewest kept last layers for which writes fit in the forward
        and reads in the backward; within the budget, even if that stalls.
    """
    n = len(layers)
    wbw = max(write_bytes_per_s, 1.0)
    rbw = max(read_bytes_per_s, 1.0)
    max_keep = n
    if device_budget is not None:
        kept = 0
        max_keep = 0
        for layer in reversed(layers):
            if kept + layer.bytes > device_budget:
                break
            kept += layer.bytes
            max_keep += 1
    lo = min(min_keep, max_keep)
    k = lo
    while k <= max_keep:
        w_ok, r_ok, finish, _ = _check(layers, k, wbw, rbw)
        if w_ok and r_ok:
            break
        k += 1
    stall_free = k <= max_keep
    if not stall_free:
        k = max_keep
    w_ok, r_ok, finish, late = _check(layers, k, wbw, rbw)
    if stall_free and k == n and n > 0:
        reason = "the disk is too slow to hide any layer's I/O: keeping all"
    elif stall_free:
        reason = "writes fit in the forward and reads in the backward"
        if k == lo and lo > 0:
            reason += f" (at least {lo} kept after stalls)"
    elif device_budget is not None and max_keep < n:
        reason = f"the device budget ({format_size(device_budget)}) allows keeping only {max_keep}; expect stalls"
    else:
        reason = "the disk is too slow to hide any layer's I/O: keeping all"
    decisions = []
    for layer in layers:
        if layer.index >= n - k:
            why = "its backward comes too soon to read it back" if stall_free else "kept: I/O cannot be hidden"
            if device_budget is not None and not stall_free and max_keep < n:
                why = "kept within the device budget"
            decisions.append(LayerDecision(layer.index, layer.bytes, layer.forward_s, layer.backward_s, False, why))
        else:
            why = "written during the forward, read back before its backward"
            if not w_ok or (not r_ok and layer.index >= late >= 0):
                why = "offloaded by budget: its I/O may stall"
            decisions.append(LayerDecision(layer.index, layer.bytes, layer.forward_s, layer.backward_s, True, why))
    return Plan(k, tuple(decisions), wbw, rbw, finish, sum(x.forward_s for x in layers), stall_free, reason)
