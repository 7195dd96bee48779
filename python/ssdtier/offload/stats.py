"""What the offloader counts: traffic, what it holds, and why a first forward moved nothing."""

from __future__ import annotations

import enum
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..config import PolicyConfig
from ..plan import Plan
from ..sizes import format_size
from ..store import StoreStats

COUNTS = (
    "tensors_offloaded",
    "bytes_offloaded",
    "dedup_hits",
    "forwarded",
    "copied_ahead",
    "failed_writes",
    "failed_reads",
    "writes_skipped",
    "tensors_kept",
    "bytes_kept",
    "packs",
    "unpacks",
    "forwards_unhooked",
    "guard_recomputed",
)


@dataclass(frozen=True)
class OffloadStats:
    """What the offloader did so far.

    ``bytes_written_nvme`` and ``bytes_read_nvme`` are the disk's bytes: each entry
    rounded up to whole blocks (4 KiB with ``O_DIRECT``), so small ones move more than
    ``bytes_offloaded``. ``forwarded`` counts the unpacks served from memory with no NVMe read (a
    write still in flight, the host arena, a kept tensor). ``peak_resident_bytes``
    is the most bytes of saved activations that ssdtier held in device or process
    memory at once: kept tensors (each storage once), the host arena in use,
    GPU tensors whose copy is in flight, CPU tensors whose write is in flight,
    and restored storages. ``prefetch_layers`` is how many layers the
    backward reads ahead (0 with ``policy.prefetch_layers = "auto"``, which
    ``prefetch_auto`` says); ``prefetch_bytes`` is the byte window ``"auto"`` has reached
    (0 until a backward's reads have sized it, and with whole layers). ``copied_ahead`` counts, on CUDA, the read-ahead
    entries copied to the GPU on the prefetch stream before their unpack (the
    others are copied on the compute stream when unpacked). ``failed_writes``
    counts the activations whose copy to the store failed (no space, an I/O
    error, or a storage freed while it was copied out), which stayed in memory;
    ``failed_reads`` the reads that failed in backward (each raised).
    ``writes_skipped`` counts the cuFile writes dropped before they started because the
    backward wanted their entry first (its source served it). ``stall_seconds`` is the time
    the backward waited for reads; ``forward_wait_seconds`` the time forwards waited for room:
    for copies in flight to the host arena (CUDA), or for the store to write some of it out.
    ``gpu_wait_seconds`` (CUDA) is the time the GPU's compute stream waited for copies back to
    it, or made them itself, timed by CUDA events: the host, running ahead, does not wait then.
    ``chosen`` says each value attach gave the configuration for this model and machine that
    the user's did not (``policy.mode = "auto"`` resolved, an arena cut to what can be pinned),
    and why. ``forwards_unhooked`` counts the forwards adaptive mode ran without its hooks, its
    plan moving nothing and settled (docs/planner.md#a-settled-plan): nothing of theirs is in
    the other counts. ``guard_recomputed`` counts the blocks adaptive mode recomputed past its
    plan, all forwards together: each of those forwards would have passed the device budget.
    """

    tensors_offloaded: int
    bytes_offloaded: int
    bytes_written_nvme: int
    bytes_read_nvme: int
    dedup_hits: int
    forwarded: int
    copied_ahead: int
    failed_writes: int
    failed_reads: int
    writes_skipped: int
    peak_resident_bytes: int
    stall_seconds: float
    forward_wait_seconds: float
    gpu_wait_seconds: float
    layers_offloaded: int
    layers_recomputed: int
    layers_kept: int
    layers_found: str  # the stacks of blocks found: path (count class), ...; "none"
    prefetch_layers: int
    prefetch_bytes: int
    prefetch_auto: bool
    tensors_kept: int
    bytes_kept: int
    packs: int
    unpacks: int
    forwards_unhooked: int
    guard_recomputed: int
    plan: Plan | None
    store: StoreStats
    chosen: tuple[str, ...] = ()  # what attach made of the config for this model and machine, and why

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain data: dicts, lists, tuples, numbers, strings (``json.dumps``
        takes it; the plan's actions by their value)."""
        return asdict(self, dict_factory=lambda items: {k: _plain(v) for k, v in items})

    def __str__(self) -> str:
        lines = [
            f"offloaded {format_size(self.bytes_offloaded)} in {self.tensors_offloaded} tensors "
            f"({self.dedup_hits} more shared a storage); kept {format_size(self.bytes_kept)} in "
            f"{self.tensors_kept} tensors",
            f"NVMe: wrote {format_size(self.bytes_written_nvme)}, read {format_size(self.bytes_read_nvme)}; "
            f"{self.forwarded} of {self.unpacks} unpacks served from memory",
            f"peak resident {format_size(self.peak_resident_bytes)}; backward stalled {self.stall_seconds:.3f} s, "
            f"forward waited {self.forward_wait_seconds:.3f} s; "
            + (f"the GPU waited {self.gpu_wait_seconds:.3f} s for copies back; " if self.gpu_wait_seconds else "")
            + f"layers {self.layers_offloaded} offloaded, "
            + (f"{self.layers_recomputed} recomputed, " if self.layers_recomputed else "")
            + f"{self.layers_kept} kept of {self.layers_found}; read ahead: "
            + (
                format_size(self.prefetch_bytes)
                if self.prefetch_bytes
                else "a byte window, not sized yet"
                if self.prefetch_auto
                else f"{self.prefetch_layers} layers"
            ),
        ]
        if self.forwards_unhooked:
            lines.append(f"{self.forwards_unhooked} forwards ran without hooks: the plan moved nothing")
        if self.guard_recomputed:
            lines.append(f"{self.guard_recomputed} blocks recomputed past the plan: their forwards passed the budget")
        if self.writes_skipped:
            lines.append(f"{self.writes_skipped} writes not needed: the backward came first")
        if self.failed_writes or self.failed_reads:
            lines.append(f"failed: {self.failed_writes} writes (kept in memory), {self.failed_reads} reads")
        if self.plan is not None:
            lines.append(f"adaptive plan: {self.plan.summary()}: {self.plan.reason}")
        lines += [f"chosen: {c}" for c in self.chosen]
        return "\n".join(lines)


def _plain(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


class Resident:
    """Bytes of saved activations the offloader holds in memory, by where, and the peak."""

    __slots__ = (
        "forward_wait",
        "held_back",
        "kept",
        "kept_peak",
        "peak",
        "restored",
        "sources",
        "stall",
        "stall_ahead",
        "tracked",
    )

    def __init__(self) -> None:
        self.kept = 0  # kept tensors, each storage once
        self.kept_peak = 0  # the most kept at once (who reads it may reset it)
        self.sources = 0  # sources held: writes from their own memory in flight, or serving unpacks
        self.restored = 0  # restored or read-ahead storages still alive
        self.peak = 0
        self.stall = 0.0  # seconds the backward waited for reads
        self.stall_ahead = 0.0  # the part of it spent on reads the read-ahead had started
        self.held_back = 0.0  # seconds the forward waited for copies or writes in flight (back-pressure)
        self.forward_wait = 0.0  # seconds forwards waited: held back, or for the store (a full arena)
        self.tracked: dict[int, tuple[weakref.ref, int]] = {}  # id(ref) -> (ref, bytes), see track

    def track(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """Count restored or read-ahead bytes as resident until their storage is freed."""
        self.restored += nbytes
        # A weak reference with a callback (much cheaper than weakref.finalize); the
        # callback runs only while the reference lives, so it is held here until then.
        ref = weakref.ref(st, self._forget)
        self.tracked[id(ref)] = (ref, nbytes)

    def sizes(self) -> dict[tuple[torch.device, int], int]:
        """The restored storages alive, by (device, address): their entries' bytes, without
        the page a read's alignment adds."""
        out = {}
        for ref, n in list(self.tracked.values()):
            st = ref()
            if st is not None:
                out[(st.device, st.data_ptr())] = n
        return out

    def _forget(self, ref: weakref.ref) -> None:
        self.restored -= self.tracked.pop(id(ref))[1]

    def waited(self, seconds: float, backward: bool) -> None:
        """Back-pressure: the forward held back, or the backward stalled, for copies or writes out."""
        if backward:
            self.stall += seconds
        else:
            self.held_back += seconds
            self.forward_wait += seconds

    def note(self, host_used: int) -> None:
        now = self.kept + self.sources + self.restored + host_used
        if now > self.peak:
            self.peak = now


class FirstForward:
    """Why the first forward held its saved activations in memory (when it offloaded none,
    a user is told why once: a small model with the defaults moves nothing)."""

    __slots__ = ("excluded", "largest", "layer", "small")

    def __init__(self) -> None:
        self.small = self.layer = self.excluded = self.largest = 0

    def held(self, nbytes: int, why: str) -> None:
        setattr(self, why, getattr(self, why) + 1)
        if why == "small":
            self.largest = max(self.largest, nbytes)

    def why_nothing(self, model: nn.Module, pol: PolicyConfig, kept: int) -> str:
        parts = []
        if self.small:
            floor = 1 << max(self.largest.bit_length() - 1, 0)  # offloads the largest of them
            parts.append(
                f"{self.small} were smaller than policy.min_tensor_bytes ({format_size(pol.min_tensor_bytes)}; "
                f'the largest {format_size(self.largest)}: policy__min_tensor_bytes="{format_size(floor)}" '
                "would offload it)"
            )
        if self.layer:
            parts.append(f"{self.layer} were in the {kept} kept last layer(s) (policy.keep_last_layers)")
        if self.excluded:
            parts.append(f"{self.excluded} were in excluded modules (policy.exclude or no_offload())")
        why = " and ".join(parts) or "it saved none but parameters, buffers and tensors ssdtier leaves alone"
        return f"the first forward of {type(model).__name__} offloaded nothing: of its saved activations, {why}"


class WaitShare:
    """The share of the training loop's time spent waiting for ssdtier's I/O, over windows of
    ``EVERY`` forwards (from the second on: the first one pins and allocates)."""

    EVERY = 16
    SHARE = 0.25  # past this share, a user is told once ...
    LEAST = 0.01  # ... if forwards waited this many seconds each (a tiny model's 1 ms is no news)

    __slots__ = ("forward0", "gpu0", "t0", "total0")

    def __init__(self) -> None:
        self.t0 = 0.0
        self.forward0 = self.total0 = self.gpu0 = 0.0

    def check(
        self, forward: int, now: float, waited: float, fwd_waited: float, gpu_waited: float = 0.0
    ) -> tuple[float, float, float, float] | None:
        """At forward number ``forward``'s start, with the waits so far (all, the forwards',
        the GPU's for copies back): (share, forward seconds, backward seconds, of them the
        GPU's) per forward of the window just ended, once its share passes SHARE; else None."""
        if forward < 2 or (forward - 2) % self.EVERY:
            return None
        t0, total0, forward0, gpu0 = self.t0, self.total0, self.forward0, self.gpu0
        self.t0, self.total0, self.forward0, self.gpu0 = now, waited, fwd_waited, gpu_waited
        if forward == 2:
            return None
        share = min((waited - total0) / max(now - t0, 1e-9), 1.0)
        each = (waited - total0) / self.EVERY
        if share < self.SHARE or each < self.LEAST:
            return None
        fwd = (fwd_waited - forward0) / self.EVERY
        return share, fwd, max(each - fwd, 0.0), (gpu_waited - gpu0) / self.EVERY
