"""The offloader: the model's hooks, and pack and unpack, which classify each saved tensor,
hand its storage to a transport (cpu.py, cuda.py) and rebuild the view in backward."""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..config import Config, resolve_config
from ..effective import Machine, effective, local_ranks
from ..errors import OutOfSpaceError, SsdtierError, SsdtierOSError
from ..plan import Action, Plan
from ..ram import available
from ..sizes import format_size
from ..store import ByteStore
from . import cuda, shelf
from ._util import Once, autocast_cast, cuda_device, imported, warn
from .adaptive import Adaptive
from .cpu import CpuTransport
from .cuda import CudaTransport
from .cufile import CuFile, carries, open_cufile
from .entry import Distributed, Entry, Kept, Reading, Restored, Same, Saved, Writing, check_version, version_of
from .forward import (
    NO_OFFLOAD,
    BlockEnter,
    BlockExit,
    Fwd,
    Hook,
    ModelHook,
    PerThread,
    autocasting,
    drop_interrupted,
    forwards_under_way,
    pushed,
    saving_possible,
    top_hooks,
    unpush,
)
from .layers import excluded_modules, find_stacks, kind, search
from .readahead import Backward, ReadAhead
from .recompute import Recompute
from .registry import Entries, Params, StorageKey
from .stats import COUNTS, FirstForward, OffloadStats, Resident, WaitShare

log = logging.getLogger("ssdtier")

_STRIDED = torch.strided
GRAPHS_AFTER = 64  # backwards begun since a forward: past any pipeline schedule's depth


def type_dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    # By name first: importing torch.distributed for every subclass would cost more.
    return type(t).__name__ == "DTensor" and isinstance(t, type_dtensor())


def _described(stacks: list[tuple[str, list[nn.Module]]]) -> tuple[tuple[str, int, str], ...]:
    """(path, blocks, their class) per stack."""
    return tuple((p, len(bs), kind(bs[0]).__name__) for p, bs in stacks)


def _blocks_text(stacks: tuple[tuple[str, int, str], ...]) -> str:
    return ", ".join(f"{p or '(the model)'} ({n} {cls})" for p, n, cls in stacks) or "none"


def _say_unclear(
    model: nn.Module, stacks: list[tuple[str, list[nn.Module]]], left: list[tuple[str, list[nn.Module]]]
) -> None:
    """Warn where the blocks found may not be the model's: none at all, or repeated blocks
    left out for being fewer than half the largest stack's (what they save is then counted
    with their neighbours, kept as what follows the last block)."""
    name = type(model).__name__
    if not stacks:
        warn(
            f"found no repeated blocks in this {name} (no ModuleList, Sequential or ModuleDict of same-class "
            "modules, nor same-class blocks registered on one module): what it saves is one layer, so "
            "policy.keep_last_layers, the read-ahead by layer and adaptive mode's plan do nothing; name the "
            "blocks' container with policy.layers"
        )
        return
    if left:
        warn(
            f"blocks of this {name} found: {_blocks_text(_described(stacks))}; left out, as fewer than half as "
            f"many: {_blocks_text(_described(left))}. What those save is counted with the blocks "
            "around them; to plan them as blocks, list every stack in policy.layers"
        )


TRACED = (
    "torch.compile traced ssdtier's block hooks into its graph (the model compiled whole, or a block "
    "compiled in place with block.compile()): a graph hands its saved tensors to ssdtier only as it "
    "ends, so they cannot leave before the peak and its blocks are not told apart. Compile each block "
    "on its own before attaching, for i, b in enumerate(blocks): blocks[i] = torch.compile(b), and "
    "attach to the model uncompiled"
)


CREATE_GRAPH = (
    "a backward with create_graph=True (a gradient penalty) holds each activation it reads back "
    "in the graph it builds, until that graph's own backward: offloading frees no memory in such "
    "a step, and a device budget cannot hold there"
)


class Life(enum.Enum):
    """An offloader's lifetime: hooked; detached with entries that graphs still hold; its
    store closed (or shelved)."""

    ATTACHED = "attached"
    DETACHED = "detached"
    CLOSED = "closed"


def _on_cpu(model: nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers()))


class Offloader:
    """Offloads a model's saved activations; made by :func:`attach`.

    Use it as a context manager (detaches on exit) or call :meth:`detach`.
    """

    # Device types whose activations the CUDA transport copies to the arena on streams
    # (tests add "cpu" to run it on a fake GPU).
    _streamed = frozenset({"cuda"})

    def __init__(self, model: nn.Module, config: Config) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
        if attached(model) is not None:
            raise SsdtierError(
                f"ssdtier is already attached to this {type(model).__name__}: call detach() on the offloader "
                "attach() returned, or ssdtier.detach(model) if that is lost (a notebook cell run again)"
            )
        device = cuda_device(model)
        self.auto_on_cpu = config.policy.mode == "auto" and device is None  # said if CUDA tensors come
        tensors = itertools.chain(model.parameters(), model.buffers())
        streamed = any(t.device.type in self._streamed for t in tensors)
        # The arena's "auto" size: a share of the GPU's memory, unless cuFile carries its activations.
        gpu_memory = cuda.device_memory(device) if device is not None and not carries(config, device) else 0
        left = lambda: shelf.with_shelved(available())  # noqa: E731 - the shelved arena can be this one's
        machine = Machine(device is not None, _on_cpu(model), streamed, left, local_ranks(), gpu_memory)
        eff = effective(config, machine)
        config, self.choices = eff.config, eff.choices
        pol = config.policy
        offloads = pol.mode != "none" or pol.device_budget is not None
        # Pushed by the model's forward pre-hook, popped by its forward hook (always_call).
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._model = weakref.ref(model)  # the offloader's own cycles must not hold the model
        self.config = config
        self._lock = threading.RLock()
        self.cuda_ok = torch.cuda.is_available()
        self._min_bytes = pol.min_tensor_bytes
        self._dedup_on = pol.dedup
        self._budget: int | None = None if pol.device_budget == "auto" else pol.device_budget
        if pol.layers is None:
            found = search(model)
            stacks = found.found
            if pol.mode != "none":
                _say_unclear(model, stacks, found.left_out)
        else:
            stacks = find_stacks(model, pol.layers)
        self.layers_path = ", ".join(p for p, _ in stacks) if stacks else None
        self.layers = _described(stacks)  # what was found
        blocks = [b for _, bs in stacks for b in bs]
        self.n_layers = len(blocks)
        # "auto": with whole layers read ahead, the last block is kept (its backward starts
        # right after the forward, too soon to read it back). A byte window starts at the
        # forward's end with the sources of the writes still in flight, so on the CPU none is.
        auto_keep = 0 if pol.prefetch_layers == "auto" and _on_cpu(model) else 1
        keep = auto_keep if pol.keep_last_layers == "auto" else int(pol.keep_last_layers)
        self.actions: tuple[Action, ...] = ()
        self._off_tag: list[bool] = []
        self.keep_last(self.n_layers if pol.mode == "none" else min(self.n_layers, keep))
        if pol.mode == "none":
            self._off_tag[:] = [False] * len(self._off_tag)
        elif pol.mode == "adaptive" and self.n_layers:
            # Until measured: within a budget kept (the guard recomputes what would pass it),
            # else offloaded but the last blocks.
            first = 0 if pol.device_budget is not None else self.n_layers - self.layers_kept
            self.set_actions((Action.OFFLOAD,) * first + (Action.KEEP,) * (self.n_layers - first))
        self._tls = PerThread(self)
        self._last_fwd = Fwd(self)  # the forward that pushed the hooks last, on any thread
        self._forward = 0  # forwards begun, on any thread
        # Backwards seen to come earliest forward first while later ones wait (pipeline 1F1B):
        # then each forward is a group of the store's, the later ones evicted first.
        self._fifo = False
        self._begun = 0  # backwards begun, of any forward
        self._params = Params()
        self._params.refresh(model, 1)  # adaptive mode reads their state as the first forward begins
        # Kept tensors' storages: (device, pointer) -> one item per kept handle holding it
        self._kept_st: dict[StorageKey, list[None]] = {}
        self.entries = Entries()
        self._life = Life.ATTACHED
        self.c = dict.fromkeys(COUNTS, 0)
        self.res = Resident()
        self.once = Once()
        self.traced = False  # a block's hooks ran inside a graph torch.compile made
        # What the first forward held in memory, to say why if it offloaded nothing.
        self._first: FirstForward | None = None if pol.mode in ("none", "adaptive") else FirstForward()
        # Adaptive mode keeps what the I/O cannot hide by itself; with "all" a user is told.
        self._pace: WaitShare | None = WaitShare() if pol.mode == "all" else None
        self._handles: list[Any] = []
        self._recompute: list[Recompute] = []
        self.adaptive: Adaptive | None = None
        self._sample: Callable[[int], None] | None = None  # device_budget = "auto": GPU memory now
        # The store last: what fails before it leaves nothing open, what fails after closes it.
        shelved = shelf.take(config)  # inside reusing_stores(): the last detach's, if alike
        self.store = shelved.store if shelved is not None else ByteStore(config)
        if shelved is not None:
            log.info("ssdtier: reusing the store of a detached offloader: %r", self.store)
        self._native = self.store.native
        self.cuda = CudaTransport(self)
        self.cuda.pinned = shelved.pinned if shelved is not None else None  # unpinned by cuda.close()
        self._gds: CuFile | None = None
        try:
            self._gds = open_cufile(model, config, self._native)
            self.cpu = CpuTransport(self, self._gds)
            self.ahead = ReadAhead(self, pol.prefetch_layers)
            if device is not None and self._gds is None and offloads:
                self.cuda.prepare(device)
            if pol.mode == "adaptive" and self.n_layers:
                self.adaptive = Adaptive(self)
                if self.adaptive.watch.gpu is not None:
                    self._sample = self.adaptive.watch.sample_at
            imported()  # Dynamo imported by another thread while ssdtier's hooks were defined
            self._handles += [
                model.register_forward_pre_hook(ModelHook(self._enter)),
                model.register_forward_hook(ModelHook(self._exit), always_call=True),
            ]
            if self.adaptive is not None:
                self._recompute = [Recompute(self, block, i + 1) for i, block in enumerate(blocks)]
                for r in self._recompute:
                    r.install()
            starts = itertools.accumulate((len(bs) for _, bs in stacks[:-1]), initial=0)
            firsts = {start: k for k, start in enumerate(starts)}  # block index: the stack it begins
            for i, block in enumerate(blocks):
                enter = BlockEnter(self, i + 1, firsts.get(i))
                self._handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
                # A block's exit changes the tag only after the last block; elsewhere it is
                # needed only for the adaptive plan's timings (each hook costs ~1.5 us a call).
                if self.adaptive is not None or i + 1 == self.n_layers:
                    self._handles.append(block.register_forward_hook(BlockExit(self, i + 1), always_call=True))
            for mod in excluded_modules(model, pol.exclude):
                self._handles.append(mod.register_forward_pre_hook(Hook(self._exclude_enter)))
                self._handles.append(mod.register_forward_hook(Hook(self._exclude_exit), always_call=True))
            _ATTACHED[model] = weakref.ref(self)
            _LIVE.add(self)
        except BaseException:
            # Nothing left behind: no hook on the model, and the store closed.
            self._unhook()
            self._life = Life.CLOSED
            self.cuda.close()
            if self._gds is not None:
                self._gds.close()
            self.store.close()
            raise
        log.info(
            "ssdtier: attached to %s; layers %s (%d), keeping the last %d, prefetching %s ahead",
            type(model).__name__,
            self.layers_path,
            self.n_layers,
            self.layers_kept,
            pol.prefetch_layers,
        )

    def keep_last(self, keep: int) -> None:
        """Keep the last ``keep`` blocks in memory, and what follows them; offload the rest.
        Tags: 0 before the blocks, i + 1 in block i, n + 1 after them."""
        n = self.n_layers
        self.layers_kept = keep
        first_kept = n - keep + 1 if keep else n + 2
        self._set_tags([t < first_kept for t in range(n + 2)])

    def set_actions(self, actions: tuple[Action, ...]) -> None:
        """Each block's action from the next forward on (adaptive mode). What is saved before
        the first block goes with it; what follows the last block is kept."""
        self.actions = tuple(actions)
        self.layers_kept = sum(1 for a in actions if a is Action.KEEP)
        offloads = [a.offloads for a in actions]
        self._set_tags([offloads[0] if offloads else False, *offloads, False])

    def _set_tags(self, tags: list[bool]) -> None:
        self._off_tag[:] = tags  # in place: forwards of "all" and "none" share the list

    def device_budget(self, budget: int | None) -> None:
        """The most bytes of activations kept from now on (adaptive mode's, with "auto")."""
        self._budget = budget

    def room(self, ahead: bool = False) -> int | None:
        """Bytes of activations the device budget still has room for (adaptive mode): what
        sources writes in flight may hold, and reads ahead bring (``ahead``). Those are
        optional, so they stay within the budget itself, not a plan's that does not fit it
        (predicted at other inputs, perhaps)."""
        ad = self.adaptive
        limit = None if ad is None else self._budget if ahead else ad.limit()
        if ad is None or limit is None:
            return None
        # Reads ahead: beside a recomputation, and reads under way that will land on the GPU.
        coming = ad.remaking + self.cuda.pending_bytes() if ahead else 0
        return max(limit - ad.held() - coming, 0)

    def short(self, nbytes: int) -> int:
        """By how many bytes ``nbytes`` more held would pass the device budget (0: within it,
        or none): what waiting for copies or writes in flight must free."""
        room = self.room()
        return 0 if room is None else max(nbytes - room, 0)

    def landed(self) -> None:
        """Copies out that landed since the last unpack or save leave the bytes held."""
        if self.cuda.pending:
            with self._lock:
                self.cuda.poll()

    def store_wait(self) -> float:
        """Seconds the store has waited on transfers so far."""
        return self._native.wait_seconds

    def io_wait(self) -> float:
        """Seconds training waited for ssdtier's I/O so far, forward and backward: its
        threads, and the GPU for copies back."""
        return self.res.stall + self.res.held_back + self._native.wait_seconds + self.gpu_wait()

    def gpu_wait(self) -> float:
        """Seconds the GPU's compute stream waited for copies back (those it is done with)."""
        waits = self.cuda.waits
        if waits.pairs and not torch.cuda.is_current_stream_capturing():
            waits.collect()
        return waits.seconds

    def _check_pace(self, forward: int) -> None:
        got = self._pace.check(forward, time.perf_counter(), self.io_wait(), self.res.forward_wait, self.gpu_wait())
        if got is None:
            return
        self._pace = None  # said once
        share, fwd, bwd, gpu = got
        cuda = bool(self.cuda.streams)
        room = "copies to the host arena, or " if cuda else ""
        back = f" and copies back to the GPU ({gpu:.3f} s of it the GPU's wait)" if cuda else ""
        if gpu >= 0.5 * (fwd + bwd):
            # Mostly the GPU waiting on its link to host memory: the disk and the arena are not it.
            helps = (
                'the link to host memory is the limit: policy.mode = "adaptive" offloads only what it can '
                "move in time, a larger policy.keep_last_layers keeps more; a faster disk would not help"
            )
        else:
            helps = (
                'policy.mode = "adaptive" offloads only what the I/O can hide; a larger host.capacity or a '
                "faster [[nvme]] path helps too"
            )
        warn(
            f"the training loop spent {share:.0%} of its time over the last {WaitShare.EVERY} forwards waiting "
            f"for activations to move (per forward: {fwd:.3f} s in the forward, for {room}the store to make "
            f"room; {bwd:.3f} s in the backward, for reads{back}). {helps}"
        )

    def _check_graphs(self) -> None:
        """Graphs kept without a backward (a loss kept from an evaluation run with gradients)
        hold their activations on disk, where nothing else would show them growing."""
        with self._lock:
            forwards, nbytes = self.entries.abandoned(self._begun, GRAPHS_AFTER)
        if forwards:
            self.once.warn(
                "graphs",
                f"forwards whose graph had no backward while {GRAPHS_AFTER} or more backwards ran since: "
                f"{forwards}, holding {format_size(nbytes)} of activations in the store until their graphs go. "
                "Something keeps a tensor of theirs: a loss or output of a forward run with gradients (an "
                "evaluation without torch.no_grad()?) kept without .detach() or .item()",
            )

    # ---------------------------------------------------------------- hooks on modules

    def _enter(self, module: nn.Module, args: Any) -> None:
        f = self._tls.fwd
        if f.pushed and forwards_under_way(module) + f.scopes < 2:
            drop_interrupted(f, "did not finish")
        f.pushed.append(False)
        if len(f.pushed) > 1:
            return  # the model called inside its own forward: the outer call's hooks serve
        f.unhooked = False
        why = saving_possible()
        if why is not None:
            if why:
                self.once.warn("off", f"{why}: activations of such forwards of {type(module).__name__} stay in memory")
            if self.adaptive is not None:
                self.adaptive.watch.aside = True
            return
        ad = self.adaptive
        if ad is not None:
            f.state = ad.state()  # read here: a model may enter autocast inside its forward
            ad.switch(f.state)
        if ad is not None and ad.settled.skips(ad, f.state):
            f.base = ad.unhooked()
            f.unhooked = True  # the plan moves nothing and has settled: autograd keeps what it saves
            f.top = top_hooks()
            f.acts = list(self.actions)  # the plan in force: this thread's first forward may be unhooked
            self.c["forwards_unhooked"] += 1
            return
        self._start(f, module)

    def wake(self, f: Fwd) -> None:
        """Hook a forward that began without hooks, from its first block on (its tag kept)."""
        model, ad = self.model, self.adaptive
        assert ad is not None
        if model is None or top_hooks() != f.top:
            # Hooks pushed inside the model since (the user's checkpointing around the block)
            # would pop ours: this forward stays as it is, the next is hooked.
            ad.settled.calm = 0
            return
        f.unhooked = False
        self.c["forwards_unhooked"] -= 1
        tag, excluded = f.tag, f.excluded
        self._start(f, model)
        f.tag, f.excluded = tag, excluded
        ad.settled.woke()

    def _start(self, f: Fwd, module: nn.Module) -> None:
        """Push the saved-tensor hooks for the forward ``f`` of this thread."""
        self._params.refresh(module, self._forward + 1)  # before the plan, which reads their state
        if self.adaptive is not None:
            self.adaptive.replan(f)
        else:
            f.acts, f.off_tag = None, self._off_tag
        if self.ahead.auto and self.ahead.sweep is not None:
            self.ahead.tune()
        with self._lock:
            self._forward += 1
            f.forward = self._forward
            self.cuda.stage_off = False
        if self._pace is not None:
            self._check_pace(f.forward)
        f.wait0 = self._native.wait_seconds
        self._native.set_group(f.forward if self._fifo else 0)
        f.backward = Backward(self._begun, f.acts)
        if f.forward % 16 == 0 and "graphs" not in self.once.given:
            self._check_graphs()
        f.tag = f.excluded = 0
        f.autocast = autocasting(self.cuda_ok)
        self._hooks.__enter__()
        f.pushed[0] = True
        pushed().append(f)
        self._last_fwd = f

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        f = self._tls.fwd
        if not f.pushed:
            return  # its _enter did not run (a forward pre-hook before it raised)
        if not f.pushed.pop():
            if f.unhooked and not f.pushed and self.adaptive is not None:
                self.adaptive.unhooked_end(output)
            return
        self._hooks.__exit__(None, None, None)
        unpush(f)
        self.res.forward_wait += self._native.wait_seconds - f.wait0
        if self.adaptive is not None:
            self.adaptive.forward_end(f.backward)
        if self._sample is not None:
            self.adaptive.watch.sample()
        with self._lock:  # a backward, or a graph being freed, on another thread may poll too
            if self.ahead.auto and f.backward.seq and not (self._fifo and self.entries.waiting(f.forward, older=True)):
                # The backward comes next: its first entries are wanted now (a source whose
                # write is still in flight stays and serves it; the others are read back).
                self.ahead.advance(f.backward, -1)
            self.cuda.poll()
            self.cpu.poll()
        if self.traced:
            self.once.warn("traced", TRACED)
        if self._first is not None:
            first, self._first = self._first, None
            c = self.c
            if c["packs"] and not c["tensors_offloaded"] and not c["failed_writes"]:
                warn(first.why_nothing(module, self.config.policy, self.layers_kept))

    def _exclude_enter(self, module: nn.Module, args: Any) -> None:
        self._tls.fwd.excluded += 1

    def _exclude_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        f = self._tls.fwd
        f.excluded = max(f.excluded - 1, 0)  # 0 already if its enter ran before the forward's

    # ---------------------------------------------------------------- pack

    def _pack_subclass(self, t: torch.Tensor) -> Any:
        """A DTensor goes through its local tensor (tensor parallelism's activations); other
        subclasses (float8, NF4, ...) stay in memory, said once."""
        if self._life is not Life.ATTACHED:
            return Same(t)
        if _is_dtensor(t):
            local = self._pack(t._local_tensor)  # counted there
            return Same(t) if type(local) is Same else Distributed(local, t._spec)
        self.c["packs"] += 1
        if not isinstance(t, nn.Parameter) and not torch.compiler.is_compiling():
            self.once.warn(
                f"subclass {type(t).__name__}",
                f"saved tensors of type {type(t).__name__} stay in memory (ssdtier offloads plain "
                "tensors and DTensors)",
            )
        return Same(t)

    def _pack(self, t: torch.Tensor) -> Any:
        """Keep, pass through or offload a saved tensor; the handle autograd holds."""
        if type(t) is not torch.Tensor:
            return self._pack_subclass(t)
        c = self.c
        c["packs"] += 1
        if self._life is not Life.ATTACHED:
            return Same(t)  # hooks an interrupted forward left on another thread, after detach()
        base = t._base
        if base is not None and isinstance(base, nn.Parameter):
            return Same(t, False)  # a view of a parameter (weight.t()): the commonest case first
        if (
            t.layout is not _STRIDED
            or t.is_nested
            or t.is_quantized  # its scale and zero point live outside the bytes
            or t.is_neg()
            or t._is_zerotensor()  # no storage to read
        ):
            # Kept as they are. A negative bit (``x.conj().imag``) is a lazy view; unlike the
            # conjugate bit there is no public call to set it again on the restored view.
            return Same(t)
        dev = t.device
        if not (t.is_cpu or t.is_cuda):
            return Same(t)
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if (dev, ptr) in self._params.ptrs or getattr(t, "_is_param", False):
            # A parameter: by its storage as it was when the forward began, or by what it is (a
            # parameter whose storage is made inside the forward, as sharded data parallelism
            # does when it gathers one, has a new pointer).
            # ``t`` is a plain Tensor here (a Parameter was kept above, as a subclass), so it
            # is one only if marked so (``_is_param``, what ``isinstance(t, Parameter)`` checks).
            return Same(t)
        f = self._tls.fwd
        if not f.pushed:
            # Not this thread's forward: an autograd engine thread (its copy of the hooks packs
            # for a graph built in backward), or a backward building one after the forward.
            f = self._last_fwd
        if f.autocast and t.requires_grad and autocast_cast(t, base):
            return Same(t)  # autocast's cache holds it until the autocast region ends anyway
        nbytes = st.nbytes()
        tag = f.tag
        small = nbytes < self._min_bytes
        excluded = f.excluded or NO_OFFLOAD.depth  # asked for: the budget does not overrule it
        kept = (dev, ptr) in self._kept_st  # already (saved twice, or a view): offloading frees nothing
        keep = small or kept or not f.off_tag[tag]
        if keep and not (kept or small) and self._budget is not None and self.res.kept + nbytes > self._budget:
            keep = False  # over the device budget: offload even what the policy would keep (not small ones)
        elif keep and not (kept or small or excluded) and (dev, ptr) in self.entries.by_storage:
            hit = self._offloaded(t, st, (dev, ptr), f)  # offloaded already: keeping it would hold it twice
            if hit is not None:
                return hit
        if keep or excluded:
            if self._first is not None:
                self._first.held(nbytes, "small" if small else "excluded" if excluded else "layer")
            return self._keep(t, nbytes, f, (dev, ptr))
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            # A CUDA graph's memory is reused by its next replay, whatever the allocator knows.
            self.once.warn("graph", "activations saved while a CUDA graph is captured stay in memory")
            return self._keep(t, nbytes, f, (dev, ptr))
        with self._lock:
            if self._life is not Life.ATTACHED:
                return Same(t)  # detach() on another thread since the check above
            hit = self._same(t, st, (dev, ptr), f)
            if hit is not None:
                return hit
            if self.adaptive is not None:
                self.adaptive.saved(tag, nbytes, True)  # each storage once
            try:
                if dev.type in self._streamed and (self._gds is None or not nbytes):
                    whole = torch.empty(0, dtype=torch.uint8, device=dev).set_(st)
                    entry = self.cuda.offload(whole, nbytes, f)
                else:
                    entry = self.cpu.offload(st, nbytes, f)
            except OutOfSpaceError as e:
                c["failed_writes"] += 1
                self.once.warn("full", f"{e}; activations stay in memory until space frees up")
                return self._keep(t, nbytes, f, (dev, ptr))
            except SsdtierOSError as e:
                # A write to NVMe failed (an eviction from the arena, or a direct write): the
                # store lost nothing, and this tensor stays in memory.
                c["failed_writes"] += 1
                self._warn_write(e)
                return self._keep(t, nbytes, f, (dev, ptr))
            c["tensors_offloaded"] += 1
            c["bytes_offloaded"] += nbytes
            saved = Saved(self, entry, t, f)
            if self._dedup_on:
                entry.first = (weakref.ref(t), saved.probe, saved.size, saved.stride, saved.offset)
            self.entries.add(entry, (dev, ptr) if self._dedup_on else None, st, saved.version)
            if self.ahead.auto:
                b = entry.backward
                entry.pos = len(b.seq)
                b.seq.append(entry)
                b.cum += nbytes
        self.res.note(self._native.host_used)
        return saved

    def _offloaded(self, t: torch.Tensor, st: torch.UntypedStorage, key: tuple, f: Fwd) -> Saved | None:
        """A handle on the live entry of ``t``'s storage at its version, if one was offloaded."""
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # kept: a CUDA graph's memory is its own
        with self._lock:
            return self._same(t, st, key, f) if self._life is Life.ATTACHED else None

    def _same(self, t: torch.Tensor, st: torch.UntypedStorage, key: tuple, f: Fwd) -> Saved | None:
        """Under the lock: a handle on the live entry of ``t``'s storage at its version (dedup)."""
        hit = self.entries.same_storage(key, st, t._version)
        if hit is None:
            return None
        self.c["dedup_hits"] += 1
        if hit.forward == f.forward:  # (the head's tag past the blocks: read as the head's backward starts)
            self.entries.regroup(hit, min(f.tag, self.n_layers))
        return Saved(self, hit, t, f, hit.first)

    def _keep(self, t: torch.Tensor, nbytes: int, f: Fwd, key: tuple) -> Kept:
        if self.adaptive is not None and key not in self._kept_st:
            self.adaptive.saved(f.tag, nbytes, False, nbytes < self._min_bytes)  # each storage once
            self.cpu.hold_back(nbytes)
            self.cuda.hold_back(nbytes)
        self.c["tensors_kept"] += 1
        self.c["bytes_kept"] += nbytes
        kept = Kept(self, t, nbytes, f, key)
        self.res.note(self._native.host_used)
        return kept

    @staticmethod
    def _moved(e: Entry, src: torch.UntypedStorage, wrote: int) -> SsdtierError | None:
        """An error if the source storage was freed or resized while its bytes were being
        copied out (as sharded data parallelism does with a gathered parameter's storage after
        the forward): what was copied may not be what was saved. Whatever the storage holds at
        the unpack is what autograd without ssdtier would see, so the unpack is served from it.
        A storage freed and given new bytes at the same address is not seen here; parameters,
        the storages that this happens to, are recognised and kept in _pack."""
        if src.data_ptr() != wrote or src.nbytes() != e.nbytes:
            return SsdtierError(
                f"the storage of a saved tensor ({e.nbytes} bytes) was freed or resized while it was being copied out"
            )
        return None

    def _copy_lost(self, e: Entry, err: SsdtierError) -> None:
        """The store has no good copy of a live entry: its source stays and serves the unpack."""
        self.c["failed_writes"] += 1
        self._warn_write(err)
        key, e.key = e.key, None
        self._free_key(key)

    # ---------------------------------------------------------------- unpack

    def _unpack(self, h: Any) -> torch.Tensor:
        tp = type(h)
        if tp is not Saved:
            return self._unpack_other(h, tp)
        c = self.c
        c["unpacks"] += 1
        if torch.is_grad_enabled() and top_hooks() is None:  # (not a checkpoint's recomputation)
            self.once.warn("create_graph", CREATE_GRAPH)
        if h.probe._version != h.version:
            check_version(h, h.version, h.probe._version)
        e: Entry = h.entry
        with self._lock:
            if e.cuda:
                if self.cuda.h2d:
                    self.cuda.poll()  # unpins the slots copied to the GPU (frees released keys)
                self.cuda.stage_ready()
            if not h.unpacked:
                h.unpacked = True
                e.waiting -= 1
            b = h.backward
            if not b.done:
                self._backward_begins(h.forward)
            layer = h.layer
            if layer != b.last and b.due(layer):
                if self.adaptive is not None:
                    self.adaptive.backward_reached(layer, b)
                if self._sample is not None:
                    self._sample(layer)
                self.cpu.poll()  # writes done since the last block let their sources go
                if not self.ahead.auto:
                    self.ahead.start(h.forward, layer)
            if h.twin and e.view is not None:
                # The same tensor saved twice (one op's output, the next one's input): one
                # view serves both (autograd makes each its own shallow copy).
                out = e.view
                if not e.waiting:
                    e.view = None
                back = e.back
                if type(back) is Restored and back.made is not None:
                    # Another stream's unpack: wait for the copy, record the use.
                    self.cuda.use_on_current_stream(e.device, back.made, out.untyped_storage())
                c["forwarded"] += 1
                return out
            if e.pos >= 0 and self.ahead.auto:
                self.ahead.advance(e.backward, e.pos)  # (its position in the forward that made it)
            try:
                storage, pad = self._restore(e)
            except SsdtierOSError as err:
                c["failed_reads"] += 1
                raise type(err)(
                    err.errno,
                    f"a saved activation ({e.nbytes} bytes) could not be read back, so this backward "
                    f"cannot go on: {err.strerror}",
                    err.filename,
                ) from err
            e.hold = storage if e.waiting > 0 else None
        self.res.note(self._native.host_used)
        out = torch.empty(0, dtype=h.dtype, device=e.device)
        # The restored storage may start a few bytes (a multiple of 64) before the data.
        out.set_(storage, h.offset + pad // h.dtype.itemsize, h.size, h.stride)
        if h.conj:
            out = out.conj()
        if h.twin and e.waiting:
            e.view = out  # held like e.hold, until the entry's last handle is unpacked
        return out

    def _backward_begins(self, forward: int) -> None:
        """The first unpack of ``forward``'s backward: the forwards still waiting tell the
        schedule. Only newer ones: earliest first (1F1B); only older: latest first."""
        self._begun += 1
        older, newer = self.entries.waiting(forward, True), self.entries.waiting(forward, False)
        if older != newer and self._fifo != newer:
            self._fifo = newer
            log.info("ssdtier: backwards come %s forward first", "earliest" if newer else "latest")

    def _unpack_other(self, h: Any, tp: type) -> torch.Tensor:
        """A handle of a tensor that was not offloaded, or of a DTensor."""
        if tp is Kept:
            self.c["unpacks"] += 1
            t = h.tensor
            if t._version != h.version:
                check_version(t, h.version, t._version)
            self.c["forwarded"] += 1  # served from memory, with no read
            b = h.backward
            if not b.done:
                with self._lock:
                    self._backward_begins(h.forward)
            if self._sample is not None and (h.layer > self.n_layers or h.layer != b.last):
                self._sample(h.layer)  # each layer's first, and each of the head's
            if h.layer != b.last and b.due(h.layer):
                if self.adaptive is not None:
                    self.adaptive.backward_reached(h.layer, b)
                self.cpu.poll()
                with self._lock:
                    if self.ahead.auto:
                        self.ahead.advance(b, -1)
                    else:
                        self.ahead.start(h.forward, h.layer)
            return t
        if tp is Same:
            if h.version is not None:
                check_version(h.tensor, h.version, version_of(h.tensor))
            return h.tensor
        if tp is Distributed:
            return type_dtensor()(self._unpack(h.local), h.spec, requires_grad=False)
        raise TypeError(f"ssdtier cannot unpack a {tp.__name__}")

    def _restore(self, e: Entry) -> tuple[torch.UntypedStorage, int]:
        """The entry's storage, and where its data starts in it."""
        src = e.source()
        if src is not None:
            # Its write is still in flight (or failed, or done while wanted): the source serves.
            self.c["forwarded"] += 1
            return src, 0
        back = e.back
        if type(back) is Restored:
            st = back.ref()
            if st is not None:
                self.c["forwarded"] += 1
                if back.made is not None:
                    self.cuda.use_on_current_stream(e.device, back.made, st)
                return st, back.pad
        ahead = type(back) is Reading  # read ahead (else read now, on demand)
        if not ahead:
            self._start_read(e)
            back = e.back
        assert type(back) is Reading
        e.back = None
        if back.from_host:
            self.c["forwarded"] += 1
        ticket = back.ticket
        if ticket is not None:
            if not ticket.done():
                t0 = time.perf_counter()
                ticket.wait()
                waited = time.perf_counter() - t0
                self.res.stall += waited
                if ahead:
                    self.res.stall_ahead += waited
            else:
                ticket.wait()  # raises the read's error, if any
        made = back.made
        if back.st is None:
            st, made = self.cuda.restore(e, back.staged)
        else:
            st = back.st
            if made is not None:  # read by cuFile into memory of another stream
                self.cuda.use_on_current_stream(e.device, made, st)
        e.back = Restored(weakref.ref(st), back.pad, made)
        return st, back.pad

    def _start_read(self, e: Entry) -> None:
        """Begin bringing an entry back."""
        if e.cuda:  # no key: a pinned copy whose write failed serves it (cuda.Bouncing)
            self.cuda.start_read(e, e.key is not None and self._native.location(e.key)[0])
        else:
            self.cpu.start_read(e)

    # ---------------------------------------------------------------- release

    def _release(self, e: Entry) -> None:
        with self._lock:
            e.refs -= 1
            if e.refs:
                return
            back, e.back = e.back, None
            e.hold = e.view = e.first = None
            if type(back) is Reading and back.ticket is not None:
                # The buffer must outlive its read. A read that failed is of no concern here:
                # nobody will unpack this entry (raising would skip freeing it, from __del__).
                with contextlib.suppress(SsdtierError):
                    back.ticket.wait()
            self.entries.remove(e)
            if type(e.out) is Writing:
                # The store lets the key go when the write ends, and the source is dropped
                # when a poll sees it done: now, if it is (no backward may come to poll).
                key, e.key = e.key, None
                self._free_key(key)
                self.cpu.poll()
            else:
                self.drop_source(e)
                if e.cuda:
                    self.cuda.free_key(e)
                else:
                    self._free_key(e.key)
            if self._life is Life.DETACHED and self.entries.live == 0:
                self._close_store()

    def drop_source(self, e: Entry) -> None:
        """Let go of the source an entry holds, if any."""
        if e.source() is not None:
            e.out = None
            self.res.sources -= e.nbytes

    def _free_key(self, key: int | None) -> None:
        if key is not None:
            self.store.discard(key)

    def _warn_write(self, err: Exception) -> None:
        self.once.warn("write", f"writing an activation to NVMe failed ({err}); it stays in memory")

    # ---------------------------------------------------------------- public

    @property
    def uses_cufile(self) -> bool:
        """Whether CUDA activations move through cuFile (``io.backend``), not the host arena."""
        return self._gds is not None

    def plan(self) -> Plan | None:
        """The adaptive plan in force (per block: bytes, inputs, time, action and why;
        ``table()`` prints it); None before one is made."""
        return self.adaptive.plan if self.adaptive is not None else None

    def stats(self) -> OffloadStats:
        """Counters so far; see :class:`OffloadStats`."""
        st = self.store.stats()
        recomputed = sum(1 for a in self.actions if a.recomputes)
        return OffloadStats(
            bytes_written_nvme=st.nvme_bytes_written,
            bytes_read_nvme=st.nvme_bytes_read,
            peak_resident_bytes=self.res.peak,
            stall_seconds=self.res.stall,
            forward_wait_seconds=self.res.forward_wait,
            gpu_wait_seconds=self.gpu_wait(),
            layers_offloaded=self.n_layers - self.layers_kept - recomputed,
            layers_recomputed=recomputed,
            layers_kept=self.layers_kept,
            layers_found=_blocks_text(self.layers),
            prefetch_layers=self.ahead.depth,
            prefetch_bytes=self.ahead.window or 0,
            prefetch_auto=self.ahead.auto,
            plan=self.plan(),
            store=st,
            chosen=tuple(str(c) for c in self.choices),
            **self.c,
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Saved tensors made inside the block go through the offloader, as in a call of the
        model: for a training step that uses the model's parts without calling the model
        itself (a LightningModule's ``training_step``). Calls of the model inside are fine.

        Example:
            >>> with offload.scope():
            ...     loss = module.training_step(batch, 0)
            >>> loss.backward()
        """
        self._enter(self.model, ())
        f = self._tls.fwd
        f.scopes += 1
        try:
            yield
        finally:
            f.scopes -= 1
            self._exit(self.model, (), None)

    @property
    def model(self) -> nn.Module | None:
        """The model attached to (None once it is gone)."""
        return self._model()

    def _unregister(self) -> None:
        model = self.model
        if model is not None and attached(model) is self:
            del _ATTACHED[model]

    def detach(self) -> None:
        """Remove every hook and restore the module; the store closes once no graph holds an entry."""
        if self._life is not Life.ATTACHED:
            return
        self._unhook()
        self._unregister()
        if any(self._tls.fwd.pushed):
            drop_interrupted(self._tls.fwd, "was not finished at detach()")
        with self._lock:
            if self._life is not Life.ATTACHED:  # another thread's detach() came first
                return
            self._life = Life.DETACHED
            if self.entries.live == 0:
                self._close_store()

    def _in_fork_child(self) -> None:
        """After fork(), in the child (a DataLoader worker, say): the store's threads and rings
        and the CUDA context are the parent's. The model's hooks go, the handles left let go of
        nothing, and attach() works again here."""
        self._lock = threading.RLock()  # a thread of the parent may have held it
        self._life = Life.CLOSED
        self._release = _let_go_of_nothing
        self._unhook()
        self._unregister()
        self.cuda.forget_pin()

    def _unhook(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for r in self._recompute:
            r.remove()
        self._recompute.clear()
        self._params.forget()  # the model's parameters, held by their dicts

    def _close_store(self) -> None:
        """Close or shelve the store, once: a detach and the last entry's release may both ask."""
        if self._life is Life.CLOSED:
            return
        self._life = Life.CLOSED
        pinned = None
        shelving = self._gds is None and shelf.wanted()  # shelved below, its arena still pinned
        if shelving:
            pinned, self.cuda.pinned = self.cuda.pinned, None
        self.cuda.close()
        if self._gds is not None:
            self._gds.close()  # its transfers end first; its handles go before the files close
        if shelving and shelf.put(self.store, pinned):
            self.cpu.close()
            return
        if pinned is not None:
            pinned.close()
        try:
            self.store.close()  # waits for every write, so the sources still held can go
        except SsdtierOSError as err:
            # A write that failed earlier (warned of then); every entry is gone by now, so
            # nothing is lost, and the store is closed all the same.
            log.debug("ssdtier: closing the store: %s", err)
        self.cpu.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        model = self.model
        name = type(model).__name__ if model is not None else "gone"
        return f"<Offloader {name} layers={self.layers_path!r} store={self.store!r}>"


# Each model's offloader, weakly both ways: nothing of ssdtier's is stored in the model.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Offloader]] = weakref.WeakKeyDictionary()
# Every offloader still alive (detached ones too, while graphs hold their entries).
_LIVE: weakref.WeakSet[Offloader] = weakref.WeakSet()


def _let_go_of_nothing(e: Entry) -> None:
    pass


def _after_fork_in_child() -> None:
    for off in list(_LIVE):
        off._in_fork_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def attached(model: nn.Module) -> Offloader | None:
    """The offloader attached to ``model``, or None."""
    ref = _ATTACHED.get(model)
    return ref() if ref is not None else None


def detach(model: nn.Module) -> bool:
    """Detach the offloader attached to ``model``, if any: for when the handle ``attach``
    returned is lost (a notebook cell that attached, run again). True if one was attached.

    Example:
        >>> ssdtier.detach(model)
        >>> offload = ssdtier.attach(model)
    """
    off = attached(model)
    if off is None:
        return False
    off.detach()
    return True


def attach(model: nn.Module, config: Any = None, **overrides: Any) -> Offloader:
    """Offload ``model``'s saved activations through the tiered store.

    Args:
        model: the module whose forward saves activations.
        config: a TOML path, a dict, a :class:`Config`, or None (``SSDTIER_CONFIG`` if set, else defaults).
        **overrides: config keys, e.g. ``policy__prefetch_layers=3``.

    Returns:
        The :class:`Offloader`; use it as a context manager or call ``detach()``.

    Raises:
        TypeError: ``model`` is not a module.
        SsdtierError: already attached to this module.
        ConfigError: bad configuration.

    Example:
        >>> with ssdtier.attach(model, host__capacity="8GiB") as off:
        ...     loss = model(batch).loss
        ...     loss.backward()
        >>> print(off.stats())
    """
    return Offloader(model, resolve_config(config, **overrides))
