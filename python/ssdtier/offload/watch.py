"""Adaptive mode's view of GPU memory: the device budget before each step ("auto"), and what
the allocator's counters say a step held past its plan (a fixed budget learns it)
(docs/planner.md#the-device-budget)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..plan import Head, simulate
from ..sizes import format_size
from ._util import warn
from .budget import AutoBudget, Counters, Gpu

if TYPE_CHECKING:
    from .adaptive import Adaptive

log = logging.getLogger("ssdtier")

SAY = 0.1  # an auto budget this share away from the one last logged is logged, with its parts
HOLD = 0.05  # an auto budget grown by less than this share: the last one stands (plan noise)


class Watch:
    """The allocator's counters around each step and the device budget made from them."""

    def __init__(self, ad: Adaptive) -> None:
        self.ad = ad
        off, device = ad.off, ad.device
        budget = off.config.policy.device_budget
        self.gpu: Gpu | None = None  # "auto" on a GPU: the memory the budget is made from
        if budget == "auto":
            if device is not None:
                self.gpu = Gpu(device)
                # The budget reads the allocator's peak counters: a higher peak of an earlier
                # phase (another model, a larger batch), or its cache, would hide this training's.
                torch.cuda.empty_cache()
                self.gpu.reset_peak()
                log.info("ssdtier: reset %s's peak memory counter: device_budget = 'auto' reads it", device)
            else:
                warn(
                    f"{off.config.source}: policy.device_budget = 'auto' sizes the budget from GPU memory, and "
                    f"this {type(off.model).__name__} is not on a GPU: no budget"
                )
        self.auto = AutoBudget()
        # A fixed budget bounds the step's whole peak: what the model misses is measured from
        # the allocator's counters (an auto budget reads them too).
        self.fixed = isinstance(budget, int)
        self.meter = Gpu(device) if device is not None else None
        self.working = 0  # bytes of the step's peak the model did not predict (Head.working)
        self.counting = False  # the peak counter was reset for this training (a fixed budget)
        self.mark: Counters | None = None  # the allocator's counters as the step began
        self.end: Counters | None = None  # ... as its backward ended (or reached the first block)
        self.ending = False  # a backward under way will read them as it ends
        self.held_peak = 0  # the most held() seen since the last budget
        self.inputs_top = 0  # the most first-block input bytes an auto budget was measured after
        self.said: int | None = None  # the auto budget last logged, with what it was made of
        self.last: int | None = None  # the auto budget of the last step
        self.aside = False  # a forward that saved nothing (no grad: an evaluation) ran since the last budget

    def budget(self) -> int | None:
        """The device budget for the step about to start: the configured one, or with "auto"
        what the GPU has room for (at the first step, half of what it has free)."""
        ad = self.ad
        budget = ad.off.config.policy.device_budget
        if budget != "auto":
            return budget
        if self.gpu is None:
            return None
        if ad.device is not None and not ad._timing():  # a CUDA graph being captured: not now
            return ad.off._budget
        cuda, prof = ad.off.cuda, ad.profile
        # The next step's highs are counted from what is held and queued now.
        held, self.held_peak = self.held_peak, ad.held()
        queued, cuda.inflight_peak = cuda.inflight_peak, cuda.inflight
        # The step's own peak, read in its backward: a loop may reset the counters before the next.
        mark, end = self.mark, self.end
        step_peak = end.peak if mark is not None and end is not None and end.peak > mark.peak else None
        # The allocator's peak since the last look may be an unhooked forward's or an evaluation's.
        unhooked, self.aside = ad.settled.run > 0 or self.aside, False
        inputs = prof.inputs[0] if prof.inputs else 0  # the last forward's, as yet
        self.inputs_top = max(self.inputs_top, inputs)
        alone = prof.ended and not prof.marks  # no backward since the last forward
        mem, now = self.gpu.memory(), self.held_peak  # (held now: the next step's highs start from it)
        got = self.auto.next(
            held, queued, mem, step_peak=step_peak, end=end, unhooked=unhooked, inputs=inputs, alone=alone, holding=now
        )
        got = self.auto.first() if got is None else got
        if alone and got is not None and ad.off._budget is not None:  # a larger batch's cut (grew) stands too
            got = min(got, ad.off._budget)
        last = self.last  # not a larger batch's cut of it (grew)
        if got is not None and last is not None and last < got <= last * (1 + HOLD):
            got = last  # a budget that grew by under 5% (copies queued, samples): the plan stands
        self.last = got
        said = self.said
        if got is not None and (said is None or abs(got - said) > SAY * max(said, 1)):
            self.said = got
            log.info("ssdtier: device budget %s: %s", format_size(got), self.auto.explain())
        return got

    def grew(self, growth: float, inputs: int) -> None:
        """A forward whose first block takes ``growth`` times the last one's input bytes (a
        larger batch, longer sequences) makes more of everything: its budget shrinks now,
        before the GPU runs full, rather than after the step."""
        off = self.ad.off
        budget = off._budget
        grown = self.auto.grown(growth, inputs) if budget is not None else None
        if grown is not None and grown < budget:
            log.info(
                "ssdtier: this forward saves %.2fx the last one's: device budget %s for it, not %s",
                growth,
                format_size(grown),
                format_size(budget),
            )
            off.device_budget(grown)

    def sample(self, layer: int = -1) -> None:
        """device_budget = "auto": what is allocated now and is not activations the offloader
        holds (at the forward's end, and as the backward reaches each layer)."""
        ad = self.ad
        if self.gpu is not None and (ad.device is None or ad._timing()):
            held = ad.held()
            self.held_peak = max(self.held_peak, held)
            where = f"block {layer}'s backward"
            if layer > ad.off.n_layers:
                where = "the head's backward"
            elif layer < 1:
                where = "the forward's end" if layer < 0 else "the backward of what runs before the blocks"
            self.auto.sample(self.gpu.allocated(), held, where, ended=layer < 0)

    def sample_at(self, layer: int) -> None:
        """As the backward reaches ``layer``: a sample at every few blocks, the first block,
        what runs before it, and each of the head's tensors (its gradients are large). What
        is allocated beside the activations grows through a backward: little is missed."""
        if layer > self.ad.off.n_layers or layer == 1 or layer % self.ad.stride == 0:
            self.sample(layer)

    def begin(self) -> Counters | None:
        """A hooked step begins: the counters as it does (a fixed budget's first resets the
        peak: one from before attach would hide every step's)."""
        ad = self.ad
        if self.meter is not None and self.fixed and not self.counting and ad._timing():
            self.meter.reset_peak()
            self.counting = True
            log.info("ssdtier: reset the peak memory counter: a fixed device_budget learns from it")
        self.mark = self.meter.counters() if self.meter is not None else None
        self.end, self.ending = None, False  # (a backward that raised never ran its callback)
        return self.mark

    def reached(self, tag: int) -> None:
        """The backward reached layer ``tag``: the step's peak is read at the first block and as
        the backward ends, whatever it reaches (not frozen blocks)."""
        if self.meter is None:
            return
        if tag <= 1:  # the step's peak is behind: read before a loop resets it
            self.end = self.meter.counters()
        if not self.ending:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
                self.ending = True
            except RuntimeError:  # not inside a backward (a callback is refused there)
                pass

    def _backward_end(self) -> None:
        assert self.meter is not None  # queued only with one
        self.ending = False
        self.end = self.meter.counters()
        self.ad.settled.began = self.end.allocated - self.ad.grads()

    def learn(self, blocks: list, head: Head, start: Counters | None, end: Counters | None) -> None:
        """A fixed budget on a GPU: the last step's peak (the allocator's counters as it began
        and as its backward ended) against the model's for what it ran; the difference is
        ``Head.working`` from now on. A step that set no new peak only bounds it from above;
        counters reset within the step say nothing."""
        ran = self.ad.ran
        if start is None or end is None or ran is None or len(ran) != len(blocks):
            return
        peak0, base, peak = start.peak, start.allocated, end.peak
        if peak < peak0:  # the loop reset the counters within the step: nothing to learn
            return
        predicted = simulate(blocks, ran, self.ad.transfers(), head).peak
        if peak > peak0:
            self.working = max(0, peak - base - predicted)
        else:
            self.working = min(self.working, max(0, peak0 - base - predicted))
