"""The forward's lifecycle: saved-tensor hooks pushed for a model's forward and popped after
it, per thread (as PyTorch keeps them), through interrupts, recursion, ``torch.func`` and
``torch.compile``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._util import run_eagerly, warn
from .readahead import Backward

if TYPE_CHECKING:
    from ..plan import Action
    from .owner import ForwardOwner


class Hook:
    """A module hook of the offloader. A copy of the model (``copy.deepcopy``, as EMA and
    ``AveragedModel`` make; ``torch.save(model)``) is not attached: its copies of these hooks
    are ``sys.audit`` calls that do nothing, so the copy shares nothing with the offloader and
    loads where ssdtier is not installed."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __reduce__(self) -> tuple:
        return (functools.partial, (sys.audit, "ssdtier.detached_hook"))


class ModelHook(Hook):
    """The model's own hooks, which push and pop the saved-tensor hooks: Dynamo cannot trace
    that, so under torch.compile they run outside the compiled frame (as a ``save_on_cpu``
    around the call would), and ``fullgraph=True`` works."""

    __slots__ = ()
    __call__ = Hook.__call__


run_eagerly(ModelHook, "__call__")


class BlockEnter(Hook):
    """Tags what the forward saves from here on with the block's layer number. One frame
    per call (no closure): it runs for every block of every forward. ``stack``: the index of
    the stack of blocks this one begins (an encoder's 0, a decoder's 1), else None."""

    __slots__ = ("off", "stack", "tag")

    def __init__(self, off: ForwardOwner, tag: int, stack: int | None = None) -> None:
        self.off, self.tag, self.stack = off, tag, stack

    def __call__(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        off = self.off
        f = off._tls.fwd
        if f.unhooked:  # a settled plan's forward: autograd keeps what it saves
            # Not past the forward's end (a reentrant checkpoint runs the block again in backward).
            if not f.pushed:
                return
            ad = off.adaptive
            if self.stack is None or not ad.settled.woken(_inputs(args, kwargs), self.stack):
                ad.trip(f, self.tag)
            elif self.stack:  # a later stack's inputs pass the ceiling: too late to hook
                ad.beyond(f, self.tag)
            else:
                off.wake(f)
            if f.unhooked:
                return
        f.tag = self.tag
        f.autocast = autocasting(off.cuda_ok)  # a block may run its own autocast region
        if torch.compiler.is_compiling():
            off.traced = True  # said once at the forward's end: the block is inside a compiled graph
        elif off.cpu.writing:
            off.cpu.poll()  # writes done since the last block let their sources go
        if off.adaptive is not None and f.pushed and f.pushed[0]:
            off.adaptive.block_enter(f, self.tag, _inputs(args, kwargs), self.stack)


class BlockExit(BlockEnter):
    """After the last block the tag is n + 1 (what follows the blocks); the adaptive plan
    times each block."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any = None) -> None:
        off = self.off
        f = off._tls.fwd
        if f.unhooked:
            return
        if self.tag == off.n_layers:
            f.tag = self.tag + 1
        if off.adaptive is not None and f.pushed and f.pushed[0]:
            off.adaptive.block_exit(self.tag)


_NESTED = (list, tuple, dict)
_ARGS = (torch.Tensor, int, *_NESTED)


def _inputs(args: tuple, kwargs: Any) -> tuple:
    """A block's arguments, those passed by keyword too (a recomputation holds their tensors;
    numbers size them), with tensors in a list (a cross-attention context) opened."""
    if kwargs:
        args = (*args, *(v for v in kwargs.values() if isinstance(v, _ARGS) or opened(v)))
    return flat(args) if any(opened(a) for a in args) else args


def opened(x: Any) -> bool:
    """Whether ``flat`` opens ``x``: a list, tuple, dict or dataclass."""
    return isinstance(x, _NESTED) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def flat(args: tuple | list, seen: set[int] | None = None) -> tuple:
    """The arguments with lists, tuples, dicts (a model output) and dataclasses opened, to
    any depth, each once."""
    seen = set() if seen is None else seen
    out: list = []
    for a in args:
        if not opened(a):
            out.append(a)
        elif id(a) not in seen:
            seen.add(id(a))
            if isinstance(a, dict):
                out.extend(flat(tuple(a.values()), seen))
            elif isinstance(a, (list, tuple)):
                out.extend(flat(a, seen))
            else:  # a dataclass (its fields left unset too)
                out.extend(flat(tuple(getattr(a, f.name, None) for f in dataclasses.fields(a)), seen))
    return tuple(out)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocasting(cuda: bool) -> bool:
    """Autocast with its cache is on here (asked outside an op: inside one it reads as off)."""
    if not _any_autocast():  # one call instead of two for the common case
        return False
    on = torch.is_autocast_enabled("cpu") or (cuda and torch.is_autocast_enabled("cuda"))
    return on and torch.is_autocast_cache_enabled()


class Fwd:
    """One thread's forward of one attached model. Saved-tensor hooks are per thread, so
    whether they were pushed, and the layer that packs are tagged with, are per thread too.
    A plain object: autograd's engine threads get a copy of the hooks (not of this state)
    and pack with the state of the last forward that pushed them."""

    __slots__ = (
        "acts",
        "autocast",
        "backward",
        "base",
        "copies",
        "excluded",
        "forward",
        "off",
        "off_tag",
        "pushed",
        "scopes",
        "tag",
        "state",
        "top",
        "unhooked",
        "wait0",
    )

    def __init__(self, off: ForwardOwner) -> None:
        self.off = off
        self.acts: list[Action] | None = None  # adaptive mode: each block's action in this forward
        self.off_tag: list[bool] = off._off_tag  # by tag: whether what is saved there is offloaded
        self.backward = Backward()  # a new one per forward: its graph's backwards
        self.pushed: list[bool] = []  # calls of the model under way on this thread: hooks pushed?
        self.forward = 0  # the number of this thread's outermost forward
        self.tag = 0  # the layer that forward is in
        self.excluded = 0  # calls of policy.exclude's modules that forward is in
        self.scopes = 0  # Offloader.scope() blocks under way (each counts as a call of the model)
        self.autocast = False  # autocast, with its cache, was on when the forward or its block began
        self.wait0 = 0.0  # the store's wait seconds when that forward began
        self.unhooked = False  # that forward runs without the hooks (adaptive mode: a settled plan)
        self.top: Any = None  # ... and the saved-tensor hooks on top as it began
        self.base: int | None = None  # ... GPU memory allocated as it began (None: not watched, or tripped)
        self.state: tuple = ()  # adaptive mode: the model's state as that forward began (Params.state)
        self.copies: tuple[int, dict] = (0, {})  # (forward, inputs copied for blocks seen first: recompute.py)

    def recompute(self, tag: int) -> bool:
        acts = self.acts
        return acts is not None and acts[tag - 1].recomputes


class PerThread(threading.local):
    def __init__(self, off: ForwardOwner) -> None:
        self.fwd = Fwd(off)


# Per thread: the forwards (of any attached model) whose hooks are pushed, in push order.
_PUSHED = threading.local()


def pushed() -> list[Fwd]:
    stack = getattr(_PUSHED, "stack", None)
    if stack is None:
        stack = _PUSHED.stack = []
    return stack


def unpush(f: Fwd) -> None:
    stack = pushed()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is f:
            del stack[i]
            break


def saving_possible() -> str | None:
    """Why saved-tensor hooks cannot or need not be pushed now, or None if they can."""
    if not torch.is_grad_enabled():
        return ""  # no_grad, inference_mode: nothing is saved
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is not None and active():
        return "a torch.func transform is active, and those do not support saved-tensor hooks"
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if enabled is not None and not enabled():
        return "saved-tensor hooks are disabled here (torch.autograd.graph.disable_saved_tensors_hooks)"
    return None


def top_hooks() -> Any:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def forwards_under_way(module: nn.Module) -> int:
    """How many calls of ``module`` are on this thread's Python stack (asked only when the
    model is entered with its hooks still pushed: a call inside its own forward, or a
    forward that was interrupted)."""
    n = 0
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_call_impl" and f.f_locals.get("self") is module:
            n += 1
        f = f.f_back
    return n


def drop_interrupted(f: Fwd, what: str) -> None:
    """Pop the hooks that an interrupted forward left pushed on this thread (KeyboardInterrupt,
    not an Exception, skips the forward hooks that pop them), with those of the attached
    models called inside it, which were interrupted too."""
    stack = pushed()
    inner = next((i for i, g in enumerate(stack) if g is f), len(stack))
    left = stack[inner:]
    popped = 0
    for g in reversed(left):
        top = top_hooks()
        if top is None or top[0] != g.off._pack:
            break  # not ssdtier's on top: whoever pushed it pops it
        g.off._hooks.__exit__(None, None, None)
        popped += 1
    for g in left:
        g.pushed.clear()
    del stack[inner:]
    f.pushed.clear()
    warn(
        f"a forward of {type(f.off.model).__name__} on this thread {what} (interrupted, as by "
        f"KeyboardInterrupt, which skips forward hooks); {popped} of the saved-tensor hooks left on "
        f"were removed{'' if popped == len(left) else ' (others were pushed above them and stay)'}"
    )


class _NoOffload(threading.local):
    depth = 0  # no_offload() blocks this thread is in


NO_OFFLOAD = _NoOffload()


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Saved tensors made inside the block (on this thread) stay in memory, for every attached
    model: for a region of a forward that is cheap to keep and costly to move.

    Example:
        >>> with ssdtier.no_offload():
        ...     logits = self.lm_head(h)
    """
    NO_OFFLOAD.depth += 1
    try:
        yield
    finally:
        NO_OFFLOAD.depth -= 1
