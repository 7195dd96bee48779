"""Adaptive mode: measure the blocks, the store and the link, plan keep, offload or recompute
per block (plan.py), and keep measuring: the plan changes when the numbers say it pays, the
waits the model did not predict are charged to the bytes moved, and a forward that grows
past its plan recomputes the rest
(docs/planner.md)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import OutOfSpaceError, SsdtierOSError, SsdtierWarning
from ..plan import Action, Decision, Head, Outcome, Plan, Transfers, simulate, solve
from ..sizes import format_size
from ..store import TieredStore
from ._util import aligned_storage, cuda_device, warn
from .control import StepControl
from .profile import Profile, Recomputable
from .settled import STATES, Ceiling, Settled, batch_grew, shapes, within
from .watch import Watch

if TYPE_CHECKING:
    from .forward import Fwd
    from .owner import AdaptiveOwner
    from .readahead import Backward

log = logging.getLogger("ssdtier")

GROWTH = 1.1  # a first block taking this much more input than the last forward's: a larger batch
SWITCH = 0.02  # a new plan replaces the one in force when it is predicted this share of a step faster
STALL = 0.05  # waits past the predicted by this share of a step are charged to the bytes moved
SAME = 0.05  # measurements this close to those the plan was solved from: it stands (a solve takes ms)
RESOLVE = 32  # steps a plan stands on measurements that moved before it is solved again (at most)
FIRST_FREE = 0.25  # of the budget, left before anything is measured for what no block saves
SLACK = 0.03  # of the budget: held bytes past the plan's by less are the copies' timing, not growth
CALIBRATE = (8 << 20, 8)  # the store measured on 8 writes and reads of 8 MiB
UNMEASURED = 50e6  # bytes/s the plan takes for a store it could not measure: a slow disk
LONGEST = 8  # hooked forwards, all smaller, that a plan chosen at larger inputs stands through
UNREAD = 3  # steps whose GPU timings are dropped, not waited for, before the host waits for one
SAMPLES = 8  # blocks whose backward reads the allocator's counters, at most (each read: tens of us)


class Adaptive:
    """The plan in force and the measurements it comes from; the device budget is ``watch``'s."""

    def __init__(self, off: AdaptiveOwner) -> None:
        self.off = off
        self.device = cuda_device(off.model)  # None: on the CPU
        self.profile = Profile(
            off.n_layers,
            self.device,
            self._forward_waits,
            self.device is None,
            self._backward_waits,
            off.config.policy.min_tensor_bytes,
        )
        self.plan: Plan | None = None
        self.warm = False  # an iteration was profiled and not planned from (GPU only)
        self.unread = 0  # steps in a row whose timings the GPU had not finished at the next forward
        self.per_byte = 0.0  # seconds per byte moved that the model did not predict (halved when quiet)
        self.ctl = StepControl(patience=3)
        self.wait0 = 0.0
        self.inputs_last = 0  # the first block's input bytes in the last forward
        self.per_last = 0.0  # ... and what one of its blocks saved (Profile.so_far)
        self.growth = 1.0  # this forward's first block's inputs over the last one's (a larger batch)
        self.swell = 1.0  # ... and what its blocks may save over the last one's (longer: more than that)
        self.since = 1  # the blocks _saving weighs start here (a later stack's: its first)
        self.switched = 0  # blocks the guard recomputed in this forward
        self.remaking = 0  # bytes the backward's current block holds recomputed (``_remade``)
        # A plan that could settle, on a GPU with a budget: allocated less held() as each block
        # began, less that as the forward began (gradients, an earlier forward's activations).
        # And held() then, since the forward began: what a forward without hooks is held to.
        self.beside: list[tuple[int, int] | None] | None = None
        self.beside0 = (0, 0)
        write, read = self.calibrate()
        ranks = off.config.io.local_ranks
        if isinstance(ranks, int) and ranks > 1:  # measured alone; in training the ranks share the disks
            write, read = write / ranks, read / ranks
            log.info("ssdtier: the plan takes a %dth of the store's bandwidth: %d ranks on this node", ranks, ranks)
        self.bw = (write, read)
        self.link = copy_bandwidth(self.device) if self.device is not None and off._gds is None else None
        self.stride = -(-off.n_layers // SAMPLES)  # every stride-th block reads the allocator (Watch.sample_at, trip)
        self.watch = Watch(self)
        self.ran: list[Action] | None = None  # the last forward's actions, the guard's included
        self.solving = Solving()
        self.settled = Settled()  # whether forwards may run without hooks
        self.state_in: tuple | None = None  # the state (Params.state) whose plan is in force
        self.parked: dict[tuple, Slot] = {}  # ... other states' plans (a GAN's steps alternate two)
        self.replan_s = 0.0  # host seconds spent planning at forwards' starts
        self.cache_said = False  # the warning that blocks updating a key/value cache run whole

    def calibrate(self) -> tuple[float, float]:
        """The store's write and read bandwidth, measured at attach through a store of its own
        on the same directories: stats() counts activations only."""
        off = self.off
        chunk, n = CALIBRATE
        # Within the capacity the user gave and half the space free: a disk nearly full
        # is measured on fewer writes.
        room = min(min(cap, shutil.disk_usage(path).free // 2) for path, cap in off.store.devices)
        n = min(n, room // chunk)
        if n < 2:
            warn(
                f"measuring the store's speed needs {format_size(2 * chunk)} of capacity and "
                f"{format_size(4 * chunk)} free in each directory: the plan takes the disk for "
                f"{UNMEASURED / 1e6:.0f} MB/s, so it moves little there"
            )
            return UNMEASURED, UNMEASURED
        cfg = off.config.replace(
            host__capacity=min(off.config.host.capacity, 2 * chunk),
            nvme=[{"path": path, "capacity": n * chunk} for path, _ in off.store.devices],
        )
        try:
            return self._measure(cfg, chunk, n)
        except (OutOfSpaceError, SsdtierOSError) as err:  # the disk filled meanwhile, or failed
            warn(f"could not measure the store's speed ({err}): the plan takes {UNMEASURED / 1e6:.0f} MB/s")
            return UNMEASURED, UNMEASURED

    @staticmethod
    def _measure(cfg: Any, chunk: int, n: int) -> tuple[float, float]:
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

    def transfers(self) -> Transfers:
        """How offloaded bytes move here: over the link through the arena (CUDA), straight to
        NVMe (cuFile, or CPU tensors written from their own pages), or through the arena on
        the thread that saves (CPU tensors with ``io.zero_copy`` off)."""
        off = self.off
        write, read = self.bw
        nvme = sum(cap for _, cap in off.store.devices)
        arena = off.store.arena
        host = arena.numel() if arena is not None else 0
        if self.link is not None:
            return Transfers(write, read, self.link, self.link, host, off.cuda.bound or None, nvme)
        if self.device is not None or off.config.io.zero_copy:
            return Transfers(write, read, nvme=nvme)
        return Transfers(write, read, host=host, nvme=nvme)

    # ---------------------------------------------------------------- the forward, block by block

    def _forward_waits(self) -> float:
        """Seconds the host has waited for copies out and the store so far."""
        return self.off.res.held_back + self.off.store_wait()

    def _backward_waits(self) -> float:
        """Seconds the backward has waited for reads so far (on a GPU, events time the GPU)."""
        return self.off.res.stall if self.device is None else 0.0

    def grads(self) -> int:
        return self.off._params.grads()

    def state(self) -> tuple:
        """What changes what a forward saves at the same inputs (``Params.state``)."""
        return self.off._params.state(self.off.cuda_ok)

    def _timing(self) -> bool:
        """Events can time blocks: not while traced, nor inside a CUDA graph being captured."""
        capturing = self.device is not None and torch.cuda.is_current_stream_capturing()
        return not torch.compiler.is_compiling() and not capturing

    def block_enter(self, f: Fwd, tag: int, args: tuple, stack: int | None = None) -> None:
        """Before block ``tag`` - 1, which begins stack ``stack`` (else None), with ``args``."""
        if not self._timing():
            return
        self.profile.block_enter(tag, args)
        meter = self.watch.meter
        if self.beside is not None and meter is not None and (tag - 1) % self.stride == 0:  # for trip()
            held, (aside, held0) = self.held(), self.beside0
            self.beside[tag - 1] = (meter.counters().allocated - held - aside, held - held0)
        if stack:  # a decoder's first block: its inputs are part of the forward's too
            self.settled.seen(stack, args)
            self.since = tag - 1  # its own blocks: a shorter source must not hide a longer target
        if tag == 1:
            last, self.settled.shapes = self.settled.shapes, shapes(args)
            now = self.profile.inputs[0]
            self.growth = now / self.inputs_last if now and self.inputs_last else 1.0
            more = self.growth > 1.0 and not batch_grew(last, self.settled.shapes)
            self.swell = self.growth ** self.profile.exponent() if more else self.growth
            f.backward.swell = max(1.0, self.swell)  # what its recomputations may hold over the plan's
            # Or past the largest inputs a budget was measured after, by any share (creeping lengths).
            if self.watch.gpu is not None and (self.growth > GROWTH or now > self.watch.inputs_top > 0):
                self.watch.grew(self.growth, now)
        self.guard(f, tag)
        act = f.acts[tag - 1] if f.acts is not None else None
        self.profile.recomputed[tag - 1] = act is not None and act.recomputes
        self.profile.offloaded[tag - 1] = act is Action.OFFLOAD

    def block_exit(self, tag: int) -> None:
        if not self._timing():
            return
        self.profile.block_exit(tag)

    def backward_reached(self, tag: int, b: Backward) -> None:
        """The backward's first unpack of layer ``tag`` (once per layer and backward ``b``)."""
        own, self.remaking = self._remade(tag - 1, b)
        if own:  # writes and copies out still under way make room for it first, as in the forward
            self.off.cpu.hold_back(own, backward=True)
            self.off.cuda.hold_back(own, backward=True)
        if self._timing():
            self.profile.backward_reached(tag)
            self.watch.reached(tag)

    def _remade(self, i: int, b: Backward) -> tuple[int, int]:
        """What recomputations will hold beside ``held()``: block ``i``'s own, and the most one
        at or below it holds (reads ahead started now are held through those below too). As
        planned, scaled by the forward's swell; before any plan, what the blocks run whole saved."""
        ran, plan = b.acts or [], self.plan
        below = [j for j in range(min(i + 1, len(ran))) if ran[j].recomputes]
        if not below:
            return 0, 0
        if plan is None or len(plan.decisions) < len(ran):
            per = int(self._per_block(below[-1] + 1)[1])
            return per if below[-1] == i else 0, per
        sizes = {j: int(plan.decisions[j].block.whole * b.swell) for j in below}
        return sizes.get(i, 0), max(sizes.values())

    def _per_block(self, tag: int) -> tuple[int, float]:
        """``Profile.so_far``; with no block run whole yet in this forward, what one of the last
        forward's saved, grown as this one's inputs (two forwards before the first backward)."""
        prof = self.profile
        done, per = prof.so_far(tag)
        whole = (j for j, (c, r) in enumerate(zip(prof.calls, prof.recomputed, strict=True)) if c and not r)
        if all(j == tag - 1 for j in whole):
            per = max(per, self.per_last * max(1.0, self.swell))
        return done, per

    def forward_end(self, b: Backward) -> None:
        """Before the reads ahead of the backward ``b`` start."""
        self.remaking = self._remade(self.off.n_layers, b)[1]
        if self._timing():
            self.profile.forward_end()

    def saved(self, tag: int, nbytes: int, offloaded: bool, small: bool = False) -> None:
        self.profile.saved_bytes(tag, nbytes, offloaded, small)

    def held(self) -> int:
        """Activation bytes on the device now that the offloader knows of: kept, restored or
        read ahead, and sources not yet copied out."""
        # Copies that landed after the last save or unpack polled (the backward's last, or
        # a forward's blocks after the offloaded ones) are not held.
        self.off.landed()
        res = self.off.res
        return res.kept + res.sources + res.restored + self.off.cuda.inflight + self.settled.pending.bytes

    def limit(self) -> int | None:
        """The device budget held to: a plan that does not fit it holds the least it could."""
        budget, plan = self.off._budget, self.plan
        if budget is not None and plan is not None and not plan.fits:
            return max(budget, plan.outcome.peak)
        return budget

    def guard(self, f: Fwd, tag: int) -> None:
        """Before block ``tag`` - 1 runs: if, scaled by what this forward saved so far against
        the plan's, the rest would pass the budget, the block is recomputed with its inputs
        offloaded (the least it can hold), never left to run the GPU out of memory."""
        budget = self.limit()
        acts = f.acts
        i = tag - 1
        least = Action.OFFLOAD if self.profile.recomputable[i] is not Recomputable.YES else Action.RECOMPUTE_OFFLOAD
        if budget is None or acts is None or acts[i] is least:
            return
        now = self.held()
        # Called again (two views): the plan's one pass has every call's bytes, the first
        # pass's among those held, so with a plan only what is held now is news.
        again = self.profile.calls[i] > 1
        if self.plan is not None:
            growth = 1.0 if again else max(1.0, self.swell, self._saving(acts, i))
            out = self.plan.outcome
            coming = 0.0 if again else growth * max(out.forward_peak - out.before[i], 0)
            if growth > 1.0:  # the backward's peak grows too
                now = max(now, int(growth * self._backward_peak(acts, i)) - int(coming))
            budget += int(SLACK * budget)
        else:  # no plan yet: the blocks to come saving what the ones so far did, kept
            prof, own = self.profile, 0.0
            done, per = self._per_block(tag)
            if again and not prof.recomputed[i]:  # this call saves what the earlier ones did
                own = (prof.saved[tag] + prof.small[tag]) / (prof.calls[i] - 1)
            if not (done or again or per):
                return
            coming = own + per * (len(acts) - done - again)
            # Room for what no block saves (the loss's memory, gradients): measured, or a guess.
            budget -= self.watch.working or int(FIRST_FREE * budget)
        if now + coming <= budget:
            return
        acts[i] = least
        f.off_tag[tag] = True
        self.switched += 1
        self.off.c["guard_recomputed"] += least.recomputes
        if self.switched == 1:
            log.info(
                "ssdtier: this forward would pass the device budget (%s held, %s to come, budget %s): "
                "recomputing from block %d on",
                format_size(now),
                format_size(int(coming)),
                format_size(budget),
                i,
            )

    def _backward_peak(self, acts: list[Action], i: int) -> int:
        """The plan's peak with blocks before ``i`` as this forward ran them: those the guard
        switched hold less, but what they moved may be read back from the forward's end on,
        and a recomputation holds its inputs beside what it remakes."""
        assert self.plan is not None
        plan = self.plan
        out, ds = plan.outcome, plan.decisions
        if len(out.back) != len(ds):
            return out.peak
        freed, low = 0, 0  # freed: by the switched blocks below, in the backward of those above
        for j in range(i):
            b, was, now = ds[j].block, ds[j].action, acts[j]
            low = max(low, out.back[j] - freed + (b.inputs if now.recomputes and not was.recomputes else 0))
            # What a switch moves may be read back early; what the plan moved, its model reads back.
            freed += b.held(was) - b.held(now) - max(b.moved(now) - b.moved(was), 0)
        return max(max([out.forward_peak + plan.head.working, *out.back[i:]]) - freed, low)

    def trip(self, f: Fwd, tag: int) -> None:
        """Before block ``tag`` - 1 of a forward without hooks (GPU, with a budget): what was
        allocated since it began, past what the last calm hooked forward allocated beside its
        activations by then, it holds. If that and the plan's rest pass the budget (a state no
        input shows: the user's checkpointing off), the rest recomputes and the next is hooked."""
        beside, budget, plan, acts, i = self.settled.beside, self.off._budget, self.plan, f.acts, tag - 1
        if f.base is None or beside is None or beside[i] is None or budget is None or plan is None or acts is None:
            return
        meter = self.watch.meter
        if meter is None or not self._timing():
            return
        aside, held = beside[i]
        now, out = meter.counters().allocated - f.base - aside, plan.outcome
        growth = now / held if held > SLACK * budget else 1.0  # saving more so far: the rest will too
        coming = max(growth, 1.0) * max(out.forward_peak - out.before[i], 0)
        if growth > 1.0:  # the backward's peak grows too
            now = max(now, int(growth * out.peak - coming))
        if now + coming <= budget + int(SLACK * budget):
            return
        if not self._recompute_rest(f, i):
            return
        log.info(
            "ssdtier: a forward without hooks would pass the device budget (%s held, %s to come, budget %s): "
            "recomputing from block %d on",
            format_size(now),
            format_size(int(coming)),
            format_size(budget),
            i,
        )

    def beyond(self, f: Fwd, tag: int) -> None:
        """Block ``tag`` - 1 of a forward without hooks begins a later stack (a decoder) with
        inputs past the ceiling's (longer labels): with a budget the rest recomputes, the
        least it can hold; the next forward is hooked."""
        self.settled.calm = 0
        if self.off._budget is None or f.acts is None:
            return
        if self._recompute_rest(f, tag - 1):
            log.info("ssdtier: a forward without hooks took larger inputs at block %d: recomputing from it", tag - 1)

    def stateful(self, f: Fwd, tag: int, block: object, cache: object) -> None:
        """Block ``tag`` - 1, to be recomputed, was called with ``cache``, which it updates: it
        runs whole, its saved tensors offloaded (kept by autograd without hooks), and plans no
        longer recompute it."""
        i, prof = tag - 1, self.profile
        if not self.cache_said:
            self.cache_said = True
            warn(
                f"{type(block).__name__} blocks are called with a key/value cache ({type(cache).__name__}), which "
                "each call updates: recomputed in backward they would update it twice, so ssdtier keeps or "
                "offloads them while it is passed. transformers builds one in training unless use_cache=False is "
                "passed, or set on each config (ssdtier.integrations.hf.without_cache(model), as under its "
                "gradient checkpointing)"
            )
        if prof.recomputable[i] is Recomputable.YES:
            prof.recomputable[i] = Recomputable.CACHE
        if f.unhooked:  # autograd keeps what it saves: the next forward is hooked, and planned anew
            self.settled.calm = 0
            return
        assert f.acts is not None
        self._unguard(f, i)
        f.acts[i], f.off_tag[tag] = Action.OFFLOAD, True
        prof.recomputed[i], prof.offloaded[i] = False, True

    def changes_inputs(self, f: Fwd, tag: int, block: object) -> None:
        """Block ``tag`` - 1 changed its inputs in place: plans no longer recompute it, nor its
        next calls in this forward."""
        i = tag - 1
        self.profile.recomputable[i] = Recomputable.INPUTS
        if f.acts is not None and f.acts[i].recomputes:
            self._unguard(f, i)
            f.acts[i], f.off_tag[tag] = Action.OFFLOAD, True
        self.off.once.warn(
            f"inputs {type(block).__name__}",
            f"a {type(block).__name__} block changes its inputs in place, so a recomputation would start from "
            "those changes (torch.utils.checkpoint refuses such blocks too): ssdtier keeps or offloads it",
        )

    def _unguard(self, f: Fwd, i: int) -> None:
        """Block ``i``, which the guard had recomputed, cannot be: it is no longer counted."""
        assert f.acts is not None
        if f.acts[i].recomputes and not self.off.actions[i].recomputes:
            self.off.c["guard_recomputed"] -= 1

    def _recompute_rest(self, f: Fwd, i: int) -> int:
        """Blocks ``i`` on of a forward without hooks that were to be kept recompute instead:
        how many."""
        assert f.acts is not None
        f.base, self.settled.calm = None, 0
        switched = [
            j
            for j in range(i, len(f.acts))
            if f.acts[j] is Action.KEEP and self.profile.recomputable[j] is Recomputable.YES
        ]
        for j in switched:
            f.acts[j] = Action.RECOMPUTE
        self.off.c["guard_recomputed"] += len(switched)
        return len(switched)

    def _saving(self, acts: list[Action], i: int) -> float:
        """What the stack's blocks before ``i`` (from 1: block 0's bytes hold what runs before
        it) saved in this forward against what the plan has them save: attention's T x T
        scores grow faster than the first block's inputs."""
        assert self.plan is not None
        want = got = 0
        saved = self.profile.saved
        for j in range(max(self.since, 1), i):
            b = self.plan.decisions[j].block
            want += b.inputs - b.inputs_small if acts[j].recomputes else b.bytes  # (small: not in saved)
            got += saved[j + 1]
        return got / want if want else 1.0

    # ---------------------------------------------------------------- the plan

    def replan(self, f: Fwd) -> None:
        """At the start of a forward: plan from the last one's measurements, with stall
        feedback; then the actions of this forward (``f.acts``, ``f.off_tag``)."""
        t0 = time.perf_counter()
        if self.settled.state:
            self.switch(self.settled.state)  # the plan the last hooked forward ran, measured now
        self.off.landed()  # the step begins with what its last one left in flight, not more
        watch = self.watch
        budget = watch.budget()
        self.off.device_budget(budget)
        measured = None
        # After dropped steps, their waits spill into this one's.
        feedback = self.unread == 0
        # A forward no backward followed (an evaluation with gradients, or one of several
        # before a backward, or one that raised) is not planned from.
        alone = self.profile.ended and not self.profile.marks
        if self.profile.ended and not alone:
            if self.profile.ready() or self.unread >= UNREAD:
                measured = self.profile.blocks()
                self.unread = 0
            else:  # the host runs ahead of the GPU: a later step's timings, not a wait for these
                self.unread += 1
        if measured is not None and watch.fixed:  # memory is right from the first step
            watch.learn(measured[0], measured[1], watch.mark, watch.end)
        if measured is not None and self.device is not None and not self.warm:
            # A GPU's first iteration loads kernels and tunes cuBLAS: its times would plan the
            # next steps wrong (on an H200, 12 of 24 blocks kept, then 17, 19, 22).
            self.warm = True
            measured = None
        if measured is not None:
            self._adopt(measured[0], measured[1], budget, feedback)
        self.settled.hooked(self, f.state, measured is not None, judged=not alone)
        self.switch(f.state)
        moves = any(a.offloads for a in self.off.actions)
        calm = watch.meter is not None and budget is not None and not moves
        self.beside = [None] * self.off.n_layers if calm else None
        mark = watch.begin()
        if self.beside is not None and mark is not None:
            held = self.held()
            self.beside0 = (mark.allocated - held, held)
        if self.profile.ended and self.profile.inputs:
            self.inputs_last = self.profile.inputs[0]
            self.per_last = self.profile.so_far(self.off.n_layers + 1)[1]
        self.wait0 = self.off.io_wait()
        self.profile.begin_forward()
        self.growth = self.swell = 1.0
        self.since = 1
        self.switched = self.remaking = 0
        f.acts = self.ran = list(self.off.actions)
        f.off_tag = list(self.off._off_tag)
        self.replan_s += time.perf_counter() - t0

    def unhooked_end(self, output: Any) -> None:
        """A forward without hooks ended: on the CPU with a budget, what it holds is counted
        until its backward begins (``Pending``)."""
        if self.watch.meter is None and self.off._budget and self.plan is not None:
            self.settled.pending.add(output, self.plan.outcome.forward_peak)

    def switch(self, state: tuple) -> None:
        """Put ``state``'s plan and ceiling in force: a forward in another state (layers frozen,
        autocast) saves other bytes, and is planned from its own measurements."""
        if state == self.state_in:
            return
        st = self.settled
        if self.state_in is not None:
            parked = Slot(self.plan, self.solving, self.ran, st.ceiling, st.calm, st.beside)
            self.parked[self.state_in] = parked
        self.state_in = state
        slot = self.parked.pop(state, None)
        while len(self.parked) >= STATES:
            del self.parked[next(iter(self.parked))]  # the longest parked
        if slot is None:  # planned from its own forwards; till then the actions in force run
            slot = Slot(None, Solving(), None, None, 0, None)
        self.plan, self.solving, self.ran, st.ceiling, st.calm, st.beside = slot
        if self.plan is not None:
            self.off.set_actions(self.plan.actions)

    def unhooked(self) -> int | None:
        """A forward runs without hooks before the last hooked one's backward (several
        forwards, one backward): that step's peak holds activations no model counted. What is
        allocated as it begins, for ``trip``."""
        watch = self.watch
        if watch.end is None:
            watch.mark = None
        return self.settled.start if self.settled.beside is not None and watch.meter is not None else None

    def _adopt(self, blocks: list, head: Head, budget: int | None, feedback: bool = True) -> None:
        off = self.off
        step = sum(b.forward_s + b.backward_s for b in blocks) + head.forward_s + head.backward_s
        if self.plan is not None and feedback:
            waited = off.io_wait() - self.wait0
            predicted = self.plan.outcome.forward_wait_s + self.plan.outcome.backward_wait_s
            moved = self.plan.outcome.moved
            if waited > predicted + STALL * step and moved:
                self.ctl.stall()
                self.per_byte += (waited - predicted) / moved
            elif self.ctl.quiet(can_lower=self.per_byte > 0):
                self.per_byte /= 2
        tr = dataclasses.replace(self.transfers(), per_byte_s=self.per_byte)
        head = dataclasses.replace(head, working=self.watch.working)
        plan, inputs, solving = self.plan, (blocks, tr, head, budget), self.solving
        # Measured at smaller inputs than the plan was chosen at (dynamic padding): a faster
        # plan for these would not fit those, so the plan stands while it fits, for a while.
        at, longest = self.settled.shapes, solving.longest
        smaller = budget is not None and at != longest and within(at, longest) and not self.settled.varies
        shorter = smaller and solving.since_longest < LONGEST
        solving.since_longest = solving.since_longest + 1 if shorter else 0
        if not shorter:
            solving.longest = at
        expired = smaller and not shorter  # solved now for these inputs, not left to stand
        acts = plan.actions if plan is not None else ()
        if any(a.recomputes and not b.recomputable for b, a in zip(blocks, acts, strict=False)):
            plan = None  # it recomputes a block found to update a cache since: solved again
        if plan is not None and solving.inputs is not None and same_inputs(solving.inputs, inputs):
            return
        now = None
        if plan is not None and len(plan.decisions) == len(blocks):
            now = simulate(blocks, plan.actions, tr, head, budget)
            if (shorter and now.peak <= budget) or (not expired and solving.stands(now, budget, step)):
                self._use(self._again(now, *inputs, step))
                return
        new = solving.solve(inputs)
        if plan is not None and now is not None:
            fits = budget is None or now.peak <= budget
            better = new.outcome.extra_s < now.extra_s - SWITCH * step
            lower = budget is None and new.outcome.peak < now.peak * (1 - SWITCH) and new.outcome.extra_s <= now.extra_s
            if fits and not better and not lower:
                new = self._again(now, *inputs, step)
        if plan is None or new.actions != plan.actions:
            log.info("%s", new.table())
        if budget is not None and not new.fits:
            self.off.once.warn(
                "fits",
                f"no plan holds this model's activations within the device budget ({format_size(budget)}): "
                f"{new.reason}. Steps like this one pass it: a smaller micro-batch or a larger budget fits",
            )
        solving.plan = new
        self._use(new)

    def _again(self, now: Outcome, blocks: list, tr: Transfers, head: Head, budget: int | None, step: float) -> Plan:
        """The plan in force, predicted anew."""
        plan = self.plan
        assert plan is not None
        decisions = tuple(Decision(b, d.action, d.reason) for d, b in zip(plan.decisions, blocks, strict=True))
        fits = budget is None or now.peak <= budget
        reason = plan.reason
        if fits != plan.fits:  # "nothing fits" said of other inputs
            reason = f"the plan in force, {'within the budget' if fits else 'past it'} at these inputs"
        return Plan(decisions, now, tr, head, budget, step, fits, reason)

    def _use(self, plan: Plan) -> None:
        self.plan = plan
        self.off.set_actions(plan.actions)


class Slot(NamedTuple):
    """A state's plan and ceiling, parked while forwards run in another."""

    plan: Plan | None
    solving: Solving
    ran: list[Action] | None
    ceiling: Ceiling | None
    calm: int
    beside: list | None


class Solving:
    """When the plan in force is solved again: what it was solved from, the plan then (as
    predicted), and the steps it has stood since on measurements that moved."""

    def __init__(self) -> None:
        self.inputs: tuple | None = None  # (blocks, transfers, head, budget)
        self.longest: tuple = ()  # the first block's inputs of the largest forward the plan was chosen at
        self.since_longest = 0  # forwards measured since, all smaller
        self.plan: Plan | None = None
        self.stood = 0
        self.count = 0  # solves so far

    def solve(self, inputs: tuple) -> Plan:
        self.inputs, self.plan, self.stood = inputs, None, 0
        self.count += 1
        blocks, tr, head, budget = inputs
        return solve(blocks, tr, budget, head)

    def stands(self, now: Outcome, budget: int | None, step: float) -> bool:
        """Whether the plan in force, predicted anew as ``now``, is kept unsolved: it fits (or,
        solved as the least memory found, holds no more), is no slower than when solved, the
        budget did not grow (room for a faster plan), and it was solved within 2, 4, 8...
        steps by the solves so far, up to ``RESOLVE``: the first measurements, taken as plans
        change, are the least sure. Each step it stands counts."""
        at, was = self.plan, self.inputs[3] if self.inputs is not None else None
        if at is None or self.stood >= min(RESOLVE, 2**self.count) or (budget is None) != (was is None):
            return False
        if budget is not None and was is not None:
            limit = budget if at.fits else max(budget, int(at.outcome.peak * (1 + SAME)))
            if now.peak > limit or budget > was * (1 + SAME):
                return False
        if not now.fits_host or now.extra_s > at.outcome.extra_s + SWITCH * step:
            return False
        self.stood += 1
        return True


def same_inputs(a: tuple, b: tuple) -> bool:
    """Whether two (blocks, transfers, head, budget) would give the same plan: the same budget
    and transfers, each measurement and the learned peak within ``SAME`` of the other (or of
    the blocks' mean bytes, or a block's forward and backward time: small ones are noise),
    waits charged within ``SAME`` of a step."""
    (blocks, tr, head, budget), (blocks2, tr2, head2, budget2) = a, b
    if budget != budget2 or len(blocks) != len(blocks2):
        return False
    if any(x.recomputable != y.recomputable for x, y in zip(blocks, blocks2, strict=True)):
        return False
    if dataclasses.replace(tr, per_byte_s=0.0) != dataclasses.replace(tr2, per_byte_s=0.0):
        return False
    step = sum(x.forward_s + x.backward_s for x in blocks2)
    if abs(tr.per_byte_s - tr2.per_byte_s) * sum(x.bytes for x in blocks2) > SAME * step:
        return False

    def near(x: float, y: float, scale: float) -> bool:
        return abs(x - y) <= SAME * max(abs(y), scale)

    pairs = [(x, y) for x, y in zip(blocks, blocks2, strict=True)] + [(head, head2)]
    per_block = step / max(len(blocks2), 1)
    for name in ("bytes", "inputs", "small", "inputs_small", "forward_s", "backward_s", "recompute_s", "offload_s"):
        present = [(getattr(x, name), getattr(y, name)) for x, y in pairs if hasattr(x, name)]
        scale = per_block if name.endswith("_s") else sum(abs(y) for _, y in present) / max(len(present), 1)
        if not all(near(x, y, scale) for x, y in present):
            return False
    # Learned again each step where a loop resets the peak counter: it moves by a few MiB.
    return near(head.working, head2.working, sum(x.bytes for x in blocks2) / max(len(blocks2), 1))


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
