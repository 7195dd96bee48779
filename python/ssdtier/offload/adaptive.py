"""Adaptive mode: measure the store and each layer's forward, then keep the last layers
whose activations the I/O could not move in time; keep measuring, keep fewer while the
disk keeps up and more when it does not."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import TYPE_CHECKING

import torch

from ..errors import SsdtierWarning
from ..plan import HostTier, LayerProfile, Plan, make_plan
from ..sizes import format_size
from ..store import TieredStore
from ._util import aligned_storage, cuda_device, warn
from .budget import AutoBudget, Gpu
from .control import StepControl

if TYPE_CHECKING:
    from .offloader import Offloader

log = logging.getLogger("ssdtier")

GROWTH = 1.1  # a forward's first block saving this much more than the last forward's: a larger batch


class Adaptive:
    """The profile of the iteration in progress, the store's bandwidth, and the plan."""

    def __init__(self, off: Offloader) -> None:
        self.off = off
        self.plan: Plan | None = None
        self.warm = False  # an iteration was profiled and not planned from (GPU only)
        self.min_keep = 0
        self.ctl = StepControl(patience=3)
        self.fwd: dict[int, float] = {}  # layer tag -> forward seconds
        self.bytes: dict[int, int] = {}  # layer tag -> bytes saved
        self.t0: dict[int, tuple[float, float]] = {}  # layer tag -> (start, store wait then)
        # On a GPU host clocks time kernel launches: CUDA events time the blocks, read at replan.
        self.device = cuda_device(off.model)  # None: on the CPU
        self.ev0: dict[int, tuple[torch.cuda.Event, float]] = {}  # layer tag -> (event at its start, waits then)
        self.marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event, float]] = []  # (tag, start, end, waited)
        self.wait0 = 0.0
        self.first_bytes = 0  # saved up to the end of the first block, in the last forward counted
        self.counting = True  # self.bytes holds this forward's alone
        self.bw = self.calibrate()
        self.host = self.host_tier()
        # device_budget = "auto": the GPU's memory, read before each step (None: a fixed budget).
        self.gpu: Gpu | None = None
        if off.config.policy.device_budget == "auto":
            if self.device is not None:
                self.gpu = Gpu(self.device)
            else:
                warn(
                    f"{off.config.source}: policy.device_budget = 'auto' sizes the budget from GPU memory, and "
                    f"this {type(off.model).__name__} is not on a GPU: no budget"
                )
        self.auto = AutoBudget()

    def calibrate(self) -> tuple[float, float]:
        """The store's write and read bandwidth, measured at attach on a few blocks, through a
        store of its own on the same directories: stats() counts activations only."""
        off = self.off
        chunk, n = 8 << 20, 4
        cfg = off.config.replace(
            host__capacity=min(off.config.host.capacity, 2 * chunk),
            nvme=[{"path": path, "capacity": n * chunk} for path, _ in off.store.devices],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SsdtierWarning)  # said already, by the main store
            store = TieredStore(cfg)
        with store:
            native = store.native
            src = torch.zeros(chunk, dtype=torch.uint8)
            t0 = time.perf_counter()
            keys = [store.put(src) for _ in range(n)]
            for k in keys:
                store.evict(k)
            write = n * chunk / max(time.perf_counter() - t0, 1e-9)
            bufs = [aligned_storage(chunk) for _ in keys]
            t0 = time.perf_counter()
            tickets = [
                native.read_into(k, b.data_ptr() + pad, b.nbytes() - pad, b)
                for k, (b, pad) in zip(keys, bufs, strict=True)
            ]
            for t in tickets:
                if t is not None:
                    t.wait()
            read = n * chunk / max(time.perf_counter() - t0, 1e-9)
        log.info("ssdtier: measured the store: write %.0f MB/s, read %.0f MB/s", write / 1e6, read / 1e6)
        return write, read

    def host_tier(self) -> HostTier | None:
        """The arena, where activations pass through it: the CUDA transport's copies, or CPU
        tensors with ``io.zero_copy`` off. cuFile and zero-copy writes go straight to NVMe."""
        off = self.off
        arena = off.store.arena
        if arena is None or not arena.numel():
            return None
        if self.device is not None:
            if off._gds is not None:
                return None
            return HostTier(arena.numel(), copy_bandwidth(self.device), off.cuda.bound)
        return None if off.config.io.zero_copy else HostTier(arena.numel(), None)

    def block_enter(self, tag: int) -> None:
        if self.device is not None:
            if self._timing():
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(self.device))
                self.ev0[tag] = (ev, self._forward_waits())
            return
        self.t0[tag] = (time.perf_counter(), self.off.store_wait())

    def _forward_waits(self) -> float:
        """Seconds the host has waited for copies out and the store so far."""
        return self.off.res.held_back + self.off.store_wait()

    def _timing(self) -> bool:
        """Events can time blocks: not while traced, nor inside a CUDA graph being captured."""
        capturing = self.device is not None and torch.cuda.is_current_stream_capturing()
        return not torch.compiler.is_compiling() and not capturing

    def block_exit(self, tag: int) -> None:
        if tag == 1 and self.gpu is not None and self.counting and self._timing():  # not traced
            self.counting = False
            self.grew()
        if self.device is not None:
            start = self.ev0.pop(tag, None)
            if start is not None and self._timing():
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(self.device))
                self.marks.append((tag, start[0], end, self._forward_waits() - start[1]))
            return
        start = self.t0.pop(tag, None)
        if start is not None:
            # Compute time: the time blocked on the store (a full arena) is not the layer's.
            spent = time.perf_counter() - start[0] - (self.off.store_wait() - start[1])
            self.fwd[tag] = self.fwd.get(tag, 0.0) + max(spent, 0.0)

    def forward_times(self) -> dict[int, float]:
        """Forward seconds per layer tag so far in this iteration (GPU events read now)."""
        for tag, start_ev, end, waited in self.marks:
            end.synchronize()  # the last forward's, done long ago unless the host ran far ahead
            # While the host waited for copies out the GPU may have run dry: not the block's time.
            secs = start_ev.elapsed_time(end) / 1e3 - waited
            self.fwd[tag] = self.fwd.get(tag, 0.0) + max(secs, 0.0)
        self.marks.clear()
        return self.fwd

    def saved(self, tag: int, nbytes: int) -> None:
        self.bytes[tag] = self.bytes.get(tag, 0) + nbytes

    def budget(self) -> int | None:
        """The device budget for the step about to start: the configured one, or with "auto"
        what the GPU has room for (None until the memory was read once)."""
        budget = self.off.config.policy.device_budget
        if budget != "auto":
            return budget
        if self.gpu is None:
            return None
        if self.device is not None and not self._timing():  # a CUDA graph being captured: not now
            return self.off._budget
        res, cuda = self.off.res, self.off.cuda
        # The next step's highs are counted from what is kept and queued now.
        kept, res.kept_peak = res.kept_peak, res.kept
        queued, cuda.inflight_peak = cuda.inflight_peak, cuda.inflight
        return self.auto.next(kept, queued, self.gpu.memory())

    def grew(self) -> None:
        """A forward that saved more by the end of its first block than the last one did (a
        larger batch, longer sequences) makes more of the rest too: its budget shrinks now,
        before the GPU runs full, rather than after the step."""
        now = self.bytes.get(0, 0) + self.bytes.get(1, 0)
        last, self.first_bytes = self.first_bytes, now
        budget = self.off._budget
        if not last or now <= GROWTH * last or budget is None:
            return
        grown = self.auto.grown(now / last)
        if grown is not None and grown < budget:
            log.info(
                "ssdtier: this forward saves %.2fx the last one's: device budget %s for it, not %s",
                now / last,
                format_size(grown),
                format_size(budget),
            )
            self.off.device_budget(grown)

    def sample(self) -> None:
        """device_budget = "auto": what is allocated now and is not kept activations (at the
        forward's end, and as the backward reaches each layer)."""
        if self.gpu is not None and (self.device is None or self._timing()):
            self.auto.sample(self.gpu.allocated(), self.off.res.kept)

    def replan(self) -> None:
        """At the start of an iteration: plan from the last one's profile, with stall feedback."""
        budget = self.budget()
        if not self.forward_times():
            return
        off = self.off
        if self.device is not None and not self.warm:
            # A GPU's first iteration loads kernels and tunes cuBLAS: its times would plan the
            # next steps wrong (on an H200, 12 of 24 blocks kept, then 17, 19, 22).
            self.warm = True
            off.device_budget(budget)
            self._next_iteration()
            return
        n = off.n_layers
        stall = off.io_wait() - self.wait0
        if self.plan is not None:
            if stall > 0.05 * 3 * sum(self.fwd.values()):
                # Backward (about 2x forward) or forward waited on I/O: keep one more layer.
                self.ctl.stall()
                self.min_keep = min(n, self.plan.keep_last + 1)
            elif self.ctl.quiet(can_lower=self.min_keep > 0):
                self.min_keep -= 1  # the disk kept up for a while: try offloading one more layer
        fwd, saved = self.fwd, self.bytes
        layers = [LayerProfile(i, saved.get(i + 1, 0), fwd.get(i + 1, 0.0), 2 * fwd.get(i + 1, 0.0)) for i in range(n)]
        if layers:  # what is saved before the first block goes whenever a block does: with block 0
            layers[0] = dataclasses.replace(layers[0], bytes=layers[0].bytes + saved.get(0, 0))
        head = saved.get(n + 1, 0)  # what follows the blocks is kept with them, and needed first
        plan = make_plan(layers, self.bw[0], self.bw[1], budget, self.min_keep, self.host, head)
        off.device_budget(budget)
        if self.plan is None or plan.keep_last != self.plan.keep_last:
            log.info("%s", plan.table())
        self.plan = plan
        off.keep_last(plan.keep_last)
        self._next_iteration()

    def _next_iteration(self) -> None:
        self.fwd.clear()
        self.bytes.clear()
        self.counting = True
        self.wait0 = self.off.io_wait()


def copy_bandwidth(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes per second between the GPU and pinned host memory, the slower way, timed with
    CUDA events after one copy each way to warm up."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    with torch.cuda.device(device):
        for dst, src in ((host, gpu), (gpu, host)):
            dst.copy_(src, non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(nbytes / max(start.elapsed_time(end) / 1e3, 1e-9))
    log.info("ssdtier: measured copies to and from the GPU: %.1f GB/s", min(rates) / 1e9)
    return min(rates)
