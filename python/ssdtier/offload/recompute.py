"""Recomputing a block in backward (docs/planner.md#recompute). Each block's forward is
wrapped once at attach; a call that the plan recomputes runs through non-reentrant
``torch.utils.checkpoint``, which keeps the block's saved tensors for itself and hands its
inputs to the offloader's hooks, so those are kept or offloaded like any saved tensor."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from .forward import top_hooks

if TYPE_CHECKING:
    from .forward import Fwd
    from .owner import RecomputeOwner


class Recompute:
    """A block's ``forward`` while ssdtier is attached. Outside what the plan recomputes (and
    under torch.compile, with no grad, or inside someone else's saved-tensor hooks, such as
    the user's own checkpointing) it calls the block's forward as it was."""

    __slots__ = ("__wrapped__", "block", "fn", "norms", "off", "own", "tag")

    def __init__(self, off: RecomputeOwner, block: nn.Module, tag: int) -> None:
        self.off, self.block, self.tag = off, block, tag
        self.own = block.__dict__.get("forward")  # an instance forward of the user's, put back at detach
        self.fn = block.forward
        self.__wrapped__ = self.fn  # inspect.signature (transformers reads it) sees the block's
        self.norms = tuple(m for m in block.modules() if isinstance(m, _NormBase))  # running statistics

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if block.training and getattr(block, "gradient_checkpointing", False):
            return self.fn(*args, **kwargs)  # it checkpoints itself (transformers' layers, in forward)
        off = self.off
        f = off._tls.fwd
        if f.unhooked:  # a settled plan's forward: checkpointed as planned, its inputs kept by autograd
            if f.recompute(self.tag) and _may_checkpoint(off, f) and not self._stateful(f, args, kwargs):
                fn, args, kwargs = _positional(self.fn, args, kwargs)
                fn = _Again(fn, self.norms) if self.norms else fn
                return checkpoint(fn, *args, use_reentrant=False, **kwargs)
            return self.fn(*args, **kwargs)
        if f.pushed and f.pushed[0] and off.adaptive is not None and off.adaptive.profile.stateful[self.tag - 1]:
            self._unstick(args, kwargs)
        if not f.pushed or not f.pushed[0] or not f.recompute(self.tag) or not _may_checkpoint(off, f):
            return self.fn(*args, **kwargs)
        if self._stateful(f, args, kwargs):
            return self.fn(*args, **kwargs)
        fn, args, kwargs = _positional(self.fn, args, kwargs)
        return checkpoint(_Timed(fn, self.norms, off, self.tag), *args, use_reentrant=False, **kwargs)

    def _stateful(self, f: Fwd, args: tuple, kwargs: dict) -> bool:
        """Called with a key/value cache (transformers' ``use_cache``), which each call updates:
        run again in backward it would update it twice, so the block runs whole."""
        cache = _cache_in(args, kwargs)
        if cache is None or self.off.adaptive is None:
            return False
        self.off.adaptive.stateful(f, self.tag, self.block, cache)
        return True

    def _unstick(self, args: tuple, kwargs: dict) -> None:
        """A block found to update a cache, called with gradients and none: recomputable again."""
        assert self.off.adaptive is not None
        if torch.is_grad_enabled() and _cache_in(args, kwargs) is None:
            self.off.adaptive.profile.stateful[self.tag - 1] = False

    def install(self) -> None:
        self.block.forward = self  # type: ignore[method-assign]

    def remove(self) -> None:
        """Put the block's forward back as it was."""
        if self.block.__dict__.get("forward") is self:
            if self.own is not None:
                self.block.forward = self.own  # type: ignore[method-assign]
            else:
                del self.block.forward

    def __reduce__(self) -> tuple:
        # A copy of the model (deepcopy, torch.save) gets the block's own forward, not ssdtier.
        return (
            (functools.partial, (type(self.block).forward, self.block)) if self.own is None else self.own.__reduce__()
        )


def _may_checkpoint(off: RecomputeOwner, f: Fwd) -> bool:
    """Gradients on, not traced, and the saved-tensor hooks on top are the forward's: ours, or
    in a forward without hooks those as it began. Inside the user's checkpoint, theirs serve."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    top = top_hooks()
    if f.unhooked:
        return top == f.top
    return top is not None and top[0] == off._pack


def _cache_in(args: tuple, kwargs: dict) -> Any:
    """The first argument that is a key/value cache (transformers' ``Cache``, by its methods)."""
    return next(
        (v for v in (*args, *kwargs.values()) if hasattr(type(v), "get_seq_length") and hasattr(type(v), "update")),
        None,
    )


def _positional(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Tensors passed by keyword, passed to checkpoint positionally: it saves only those
    through the saved-tensor hooks (so they leave with the inputs), and keeps the RNG state
    of only their devices (dropout on a GPU)."""
    names = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    if not names:
        return fn, args, kwargs
    rest = {k: v for k, v in kwargs.items() if k not in names}
    return _Keywords(fn, len(args), names), (*args, *(kwargs[k] for k in names)), rest


class _Keywords:
    """``fn`` called with its last positional arguments as the keywords they were."""

    __slots__ = ("fn", "n", "names")

    def __init__(self, fn: Any, n: int, names: tuple[str, ...]) -> None:
        self.fn, self.n, self.names = fn, n, names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args[: self.n], **dict(zip(self.names, args[self.n :], strict=True)), **kwargs)


class _Again:
    """The block's forward as checkpoint calls it: the first call is the forward, the second
    the recomputation, which leaves the running statistics of the block's batch norms as it
    found them (else a step would update them twice)."""

    __slots__ = ("calls", "fn", "norms")

    def __init__(self, fn: Any, norms: tuple[_NormBase, ...]) -> None:
        self.fn, self.norms, self.calls = fn, norms, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.fn(*args, **kwargs)
        return self.again(*args, **kwargs)

    def again(self, *args: Any, **kwargs: Any) -> Any:
        stats = [(b, b.clone()) for m in self.norms if m.training and m.track_running_stats for b in m.buffers()]
        try:
            return self.fn(*args, **kwargs)
        finally:
            with torch.no_grad():
                for b, was in stats:
                    b.copy_(was)


class _Timed(_Again):
    """... and the recomputation timed for the plan."""

    __slots__ = ("off", "tag")

    def __init__(self, fn: Any, norms: tuple[_NormBase, ...], off: RecomputeOwner, tag: int) -> None:
        super().__init__(fn, norms)
        self.off, self.tag = off, tag

    def again(self, *args: Any, **kwargs: Any) -> Any:
        ad = self.off.adaptive
        if ad is None:
            return super().again(*args, **kwargs)
        token = ad.profile.recompute_begins(self.tag)
        t0 = time.perf_counter()
        try:
            return super().again(*args, **kwargs)
        finally:
            ad.profile.recompute_ends(self.tag, token, time.perf_counter() - t0)
