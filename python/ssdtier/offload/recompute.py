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
from torch.nn.parameter import is_lazy
from torch.utils.checkpoint import checkpoint

from ..errors import SsdtierError
from .forward import top_hooks
from .profile import Recomputable

if TYPE_CHECKING:
    from .forward import Fwd
    from .owner import RecomputeOwner


class Recompute:
    """A block's ``forward`` while ssdtier is attached. Outside what the plan recomputes (and
    under torch.compile, with no grad, or inside someone else's saved-tensor hooks, such as
    the user's own checkpointing) it calls the block's forward as it was."""

    __slots__ = ("__wrapped__", "block", "buffers", "fn", "off", "own", "seen", "tag")

    def __init__(self, off: RecomputeOwner, block: nn.Module, tag: int) -> None:
        self.off, self.block, self.tag = off, block, tag
        self.own = block.__dict__.get("forward")  # an instance forward of the user's, put back at detach
        self.fn = block.forward
        self.__wrapped__ = self.fn  # inspect.signature (transformers reads it) sees the block's
        self.seen = False  # called with gradients in a hooked forward: whether it changes its inputs is known
        self.buffers = Buffers()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if block.training and getattr(block, "gradient_checkpointing", False):
            return self.fn(*args, **kwargs)  # it checkpoints itself (transformers' layers, in forward)
        off = self.off
        f = off._tls.fwd
        if f.unhooked:  # a settled plan's forward: checkpointed as planned, its inputs kept by autograd
            if f.recompute(self.tag) and self._may(off, f) and not self._stateful(f, args, kwargs):
                fn, args = _positional(self.fn, args, kwargs)
                return checkpoint(_Again(fn, self.block, self.buffers), *args, use_reentrant=False)
            return self.fn(*args, **kwargs)
        hooked = bool(f.pushed and f.pushed[0]) and off.adaptive is not None
        if hooked and off.adaptive.profile.recomputable[self.tag - 1] is Recomputable.CACHE:
            self._unstick(args, kwargs)
        if not hooked or not f.recompute(self.tag) or not self._may(off, f) or self._stateful(f, args, kwargs):
            if not hooked or self.seen or not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return self.fn(*args, **kwargs)
            return self._watched(f, self.fn, args, kwargs)
        fn, args = _positional(self.fn, args, kwargs)
        timed = _Timed(fn, self.block, self.buffers, off, self.tag)
        if self.seen:
            return checkpoint(timed, *args, use_reentrant=False)
        # Its first call: its inputs saved as copies, a recomputation starts from them as they
        # were even if it changes them in place.
        with torch.autograd.graph.saved_tensors_hooks(self._copied, off._unpack):
            return self._watched(f, functools.partial(checkpoint, timed, use_reentrant=False), args, {})

    def _may(self, off: RecomputeOwner, f: Fwd) -> bool:
        ad = off.adaptive
        if ad is not None and ad.profile.recomputable[self.tag - 1] is Recomputable.INPUTS:
            return False  # whatever the actions say: it would start from its inputs' changes
        return _may_checkpoint(off, f)

    def _copied(self, t: torch.Tensor) -> Any:
        if type(t) is torch.Tensor and (t.device, t.untyped_storage().data_ptr()) not in self.off._params.ptrs:
            t = _copy(t)
        return self.off._pack(t)

    def _watched(self, f: Fwd, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``fn`` called with gradients, the block seen for the first time: whether it changes
        its inputs in place."""
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        before = [_version(t) for t in tensors]
        out = fn(*args, **kwargs)
        self.seen = True
        if any(_version(t) != v for t, v in zip(tensors, before, strict=True)):
            assert self.off.adaptive is not None
            self.off.adaptive.changes_inputs(f, self.tag, self.block)
        return out

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
            self.off.adaptive.profile.recomputable[self.tag - 1] = Recomputable.YES

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


def _positional(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """``fn`` and what checkpoint calls it with: tensors passed by keyword go positionally
    (it saves only those through the saved-tensor hooks, and keeps the RNG state of only
    their devices), the other keywords bound (checkpoint would take ``debug`` and the like
    as its own)."""
    if not kwargs:
        return fn, args
    names = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    rest = {k: v for k, v in kwargs.items() if k not in names}
    return _Keywords(fn, len(args), names, rest), (*args, *(kwargs[k] for k in names))


class _Keywords:
    """``fn`` called with its last positional arguments as the keywords they were, and the
    other keywords as given."""

    __slots__ = ("fn", "n", "names", "rest")

    def __init__(self, fn: Any, n: int, names: tuple[str, ...], rest: dict) -> None:
        self.fn, self.n, self.names, self.rest = fn, n, names, rest

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args[: self.n], **dict(zip(self.names, args[self.n :], strict=True)), **self.rest)


class Buffers:
    """What a block's recomputations have shown of its buffers."""

    __slots__ = ("changing", "seen")

    def __init__(self) -> None:
        self.seen = False  # a recomputed call's forward copied them all and saw which changed
        self.changing: set[tuple[int, str]] = set()  # (id of a module's buffer dict, name)


class _Again:
    """The block's forward as checkpoint calls it: the first call is the forward, the second
    the recomputation. The buffers the forward changed (batch norm's statistics, spectral
    norm's vectors, an average) are recomputed from as the forward found them, and the block's
    buffers put back as the recomputation found them: else it would compute with them, and
    change them, twice. Persistent buffers (state) are copied at every forward; the others
    (masks, tables) at the first, and then those seen to change."""

    __slots__ = ("added", "before", "block", "buffers", "calls", "fn", "lazy", "lost")

    def __init__(self, fn: Any, block: nn.Module, buffers: Buffers) -> None:
        self.fn, self.block, self.buffers, self.calls = fn, block, buffers, 0
        self.before: list[tuple[dict, str, torch.Tensor]] = []  # (a module's buffers, name, as found)
        self.added: list[tuple[dict, str]] = []  # buffers the forward registered
        self.lazy: list[tuple[dict, str]] = []  # ... or materialised
        self.lost: str | None = None  # a buffer changed in place, not copied

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args)
        return self.again(*args)

    def forward(self, *args: Any) -> Any:
        seen, changing = self.buffers.seen, self.buffers.changing
        found, names, clones = [], [], {}  # (one copy of a buffer that two modules hold)
        with torch.no_grad():
            for m in self.block.modules():
                d = m._buffers
                names.append((d, set(d)))
                for k, b in d.items():
                    if b is None:
                        continue
                    if is_lazy(b):
                        self.lazy.append((d, k))
                        continue
                    state = k not in m._non_persistent_buffers_set
                    copy = not seen or state or (id(d), k) in changing
                    if copy and id(b) not in clones:
                        clones[id(b)] = b.clone()
                    found.append((d, k, b, _version(b), clones[id(b)] if copy else None, state))
        out = self.fn(*args)
        for d, k, b, v, was, state in found:
            moved = d.get(k) is not b or _version(b) != v
            if moved:
                changing.add((id(d), k))
            if was is None and moved:
                if d.get(k) is not b and _version(b) == v:
                    was = b  # replaced, not changed: as the forward found it
                else:
                    self.lost = k
            # State is put back whatever its version says: ``.data`` and fused kernels (batch
            # norm's) change buffers without a new one.
            if was is not None and (moved or state):
                self.before.append((d, k, was))
        self.added = [(d, k) for d, had in names for k in d if k not in had]
        self.buffers.seen = True
        return out

    def again(self, *args: Any) -> Any:
        if self.lost is not None:
            raise SsdtierError(
                f"a recomputed {type(self.block).__name__} block changed its buffer {self.lost!r} in place, which "
                "its first recomputed call did not, so ssdtier had no copy to recompute it from and this backward "
                "cannot be exact; later forwards copy it"
            )
        dicts = {id(m._buffers): m._buffers for m in self.block.modules()}
        now = [(d, dict(d)) for d in dicts.values()]
        stats = [(d[k], d[k].clone()) for d, k in self.lazy if d.get(k) is not None]  # (as batch norm's)
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for d, k, was in self.before:
                if id(was) not in copies:
                    copies[id(was)] = was.clone()  # a second backward (retain_graph) recomputes again
                d[k] = copies[id(was)]
            for d, k in self.added:
                d.pop(k, None)
        try:
            return self.fn(*args)
        finally:
            for d, items in now:
                d.clear()
                d.update(items)
            with torch.no_grad():
                for b, was in stats:
                    b.copy_(was)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a storage of their own, its strides kept (an expanded mask stays
    small)."""
    st = t.untyped_storage()
    if st.nbytes() > 2 * t.numel() * t.element_size():
        return t.detach().clone()  # a small view of a large storage: its values alone
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(st.clone(), t.storage_offset(), t.size(), t.stride())


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: not changed in place outside inference mode
        return None


class _Timed(_Again):
    """... and the recomputation timed for the plan."""

    __slots__ = ("off", "tag")

    def __init__(self, fn: Any, block: nn.Module, buffers: Buffers, off: RecomputeOwner, tag: int) -> None:
        super().__init__(fn, block, buffers)
        self.off, self.tag = off, tag

    def again(self, *args: Any) -> Any:
        ad = self.off.adaptive
        if ad is None:
            return super().again(*args)
        token = ad.profile.recompute_begins(self.tag)
        t0 = time.perf_counter()
        try:
            return super().again(*args)
        finally:
            ad.profile.recompute_ends(self.tag, token, time.perf_counter() - t0)
