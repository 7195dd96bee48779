"""Recomputing a block in backward (docs/planner.md#recompute). Each block's forward is
wrapped once at attach; a call that the plan recomputes runs through non-reentrant
``torch.utils.checkpoint``, which keeps the block's saved tensors for itself and hands its
inputs to the offloader's hooks, so those are kept or offloaded like any saved tensor."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy
from torch.utils.checkpoint import checkpoint

from ..errors import SsdtierError
from ._util import autocast_cast
from .forward import flat, opened, top_hooks
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
        self.buffers = Buffers(block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        if block.training and getattr(block, "gradient_checkpointing", False):
            return self.fn(*args, **kwargs)  # it checkpoints itself (transformers' layers, in forward)
        off = self.off
        f = off._tls.fwd
        if f.unhooked:  # a settled plan's forward: checkpointed as planned, its inputs kept by autograd
            if f.recompute(self.tag) and self._may(off, f) and not self._stateful(f, args, kwargs):
                fn, args = _positional(self.fn, args, kwargs)
                return checkpoint(_Again(fn, self.buffers), *args, use_reentrant=False)
            return self.fn(*args, **kwargs)
        ad = off.adaptive
        hooked = bool(f.pushed and f.pushed[0]) and ad is not None
        if ad is not None and hooked and ad.profile.recomputable[self.tag - 1] is Recomputable.CACHE:
            self._unstick(args, kwargs)
        if not hooked or not f.recompute(self.tag) or not self._may(off, f) or self._stateful(f, args, kwargs):
            if not hooked or self.seen or not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return self.fn(*args, **kwargs)
            return self._watched(f, self.fn, args, kwargs)
        fn, args = _positional(self.fn, args, kwargs)
        timed = _Timed(fn, self.buffers, off, self.tag)
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
        if not self.seen and any(is_lazy(p) for p in self.block.parameters()):
            return False  # made in its first forward, from the RNG dropout draws from next
        return _may_checkpoint(off, f)

    def _copied(self, t: torch.Tensor) -> Any:
        if type(t) is torch.Tensor and t.layout is torch.strided:
            st = (t.device, t.untyped_storage().data_ptr())
            if st not in self.off._params.ptrs:
                f = self.off._tls.fwd
                if f.copies[0] != f.forward:
                    f.copies = (f.forward, {})
                # One copy a forward of an input every block takes (a mask), while unchanged
                # and both held (weakly: an offloaded one leaves; a freed one's address is reused).
                key = (*st, t.storage_offset(), t.size(), t.stride(), t.dtype, _version(t))
                had = f.copies[1].get(key)
                copy = had[1]() if had is not None and had[0]() is t else None
                if copy is None:
                    copy = _copy(t)
                    f.copies[1][key] = (weakref.ref(t), weakref.ref(copy))
                t = copy
        return self.off._pack(t)

    def _watched(self, f: Fwd, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``fn`` called with gradients, the block seen for the first time: whether it changes
        its inputs in place."""
        tensors = [v for v in flat((*args, *kwargs.values())) if isinstance(v, torch.Tensor)]
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
    """``fn`` and what checkpoint calls it with: every tensor positionally, those passed by
    keyword or inside lists, tuples, dicts and dataclasses too (it saves only its positional
    tensors through the saved-tensor hooks, and keeps the RNG state of only their devices);
    the rest bound as given (checkpoint would take ``debug`` and the like as its own)."""
    if not kwargs and not any(opened(a) for a in args):
        return fn, args
    tensors: list[torch.Tensor] = []
    shape = _hollow((args, kwargs), tensors, set())
    return _Filled(fn, shape, args, kwargs), tuple(tensors)


class _Hole:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Node:
    """A container that held tensors: made again around what fills its holes."""

    __slots__ = ("items", "make")

    def __init__(self, make: Any, items: list) -> None:
        self.make, self.items = make, items


def _hollow(x: Any, tensors: list, seen: set[int]) -> Any:
    """``x`` with each tensor in it a hole numbered as it is appended to ``tensors``; the
    containers that hold none, or cannot be made again as they were, are left as they are
    (held, as checkpoint holds them), and none that do is held."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return _Hole(len(tensors) - 1)
    t = type(x)
    if not opened(x) or id(x) in seen:
        return x
    seen.add(id(x))
    n = len(tensors)
    if t is list or t is tuple or (issubclass(t, tuple) and hasattr(t, "_make")):  # (a named tuple)
        items = [_hollow(v, tensors, seen) for v in x]
        make: Any = t if t is list or t is tuple else t._make
        return _Node(make, items) if len(tensors) > n else x
    if isinstance(x, (tuple, list)) or (isinstance(x, dict) and dataclasses.is_dataclass(x)):
        return x  # another sequence, or a model output (its fields ordered as they are set)
    if isinstance(x, dict):
        keys = list(x)
        items = [_hollow(x[k], tensors, seen) for k in keys]
    else:  # a dataclass
        keys = [f.name for f in dataclasses.fields(x) if hasattr(x, f.name)]
        items = [_hollow(getattr(x, k), tensors, seen) for k in keys]
    if len(tensors) == n:
        return x
    if t is dict:
        return _Node(functools.partial(_dict, keys), items)
    # An ordered dict, a default dict, a dataclass: its type kept, emptied of tensors.
    like = _set(copy.copy(x), keys, [None if type(v) in (_Hole, _Node) else v for v in items])
    return _Node(functools.partial(_like, like, keys), items)


def _fill(x: Any, tensors: tuple) -> Any:
    if type(x) is _Hole:
        return tensors[x.i]
    if type(x) is _Node:
        return x.make([_fill(v, tensors) for v in x.items])
    return x


def _dict(keys: list, values: list) -> dict:
    return dict(zip(keys, values, strict=True))


def _like(like: Any, keys: list, values: list) -> Any:
    return _set(copy.copy(like), keys, values)


def _set(x: Any, keys: list, values: list) -> Any:
    for k, v in zip(keys, values, strict=True):
        if isinstance(x, dict):
            x[k] = v
        else:
            object.__setattr__(x, k, v)  # (frozen dataclasses too)
    return x


class _Filled:
    """``fn`` called with its arguments: in the forward as given (what it changes in them, an
    auxiliary loss appended, reaches the caller), in a recomputation made again around the
    tensors checkpoint hands it."""

    __slots__ = ("fn", "given", "shape")

    def __init__(self, fn: Any, shape: Any, args: tuple, kwargs: dict) -> None:
        self.fn, self.shape = fn, shape
        self.given: tuple[tuple, dict] | None = (args, kwargs)

    def __call__(self, *tensors: torch.Tensor) -> Any:
        given, self.given = self.given, None  # (held no longer than the forward)
        args, kwargs = given if given is not None else _fill(self.shape, tensors)
        return self.fn(*args, **kwargs)


class Buffers:
    """What a block's recomputed forwards have shown of its buffers, by (module path in the
    block, name): a submodule replaced keeps what was learned of its place."""

    __slots__ = ("block", "changing", "known")

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.known: set[tuple[str, str]] = set()  # seen through a forward, copied and compared
        self.changing: set[tuple[str, str]] = set()  # ... and changed by one

    def modules(self) -> list[tuple[str, nn.Module]]:
        return list(self.block.named_modules())  # (each call: about 1 us a module)


class _Again:
    """The block's forward as checkpoint calls it: the first call is the forward, the second
    the recomputation. The buffers the forward changed (batch norm's statistics, spectral
    norm's vectors, an average) are recomputed from as the forward found them, and the block's
    buffers put back as the recomputation found them: else it would compute with them, and
    change them, twice. A buffer is copied at its first forward, compared after it (``.data``
    and some kernels change one without a new version), and from then on if it changed."""

    __slots__ = ("added", "before", "buffers", "calls", "dicts", "fn", "lazy", "lost")

    def __init__(self, fn: Any, buffers: Buffers) -> None:
        self.fn, self.buffers, self.calls = fn, buffers, 0
        self.before: list[tuple[dict, str, torch.Tensor]] = []  # (a module's buffers, name, as found)
        self.added: list[tuple[dict, str]] = []  # buffers the forward registered
        self.lazy: list[torch.Tensor] = []  # ... or materialised, or TorchScript's: put back by value
        self.dicts: list[dict] = []
        self.lost: str | None = None  # a buffer changed in place, not copied

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args)
        return self.again(*args)

    def forward(self, *args: Any) -> Any:
        buffers = self.buffers
        known, changing = buffers.known, buffers.changing
        found, names, clones = [], [], {}  # (one copy of a buffer that two modules hold)
        with torch.no_grad():
            for path, m in buffers.modules():
                d = m._buffers
                if type(d) is not dict:  # TorchScript's: its buffers put back as batch norm's were
                    self.lazy += [b for b in d.values() if b is not None]
                    continue
                names.append((d, set(d)))
                norm = isinstance(m, _NormBase)  # its kernel updates the statistics without a new version
                for k, b in d.items():
                    if b is None:
                        continue
                    if is_lazy(b):
                        self.lazy.append(b)
                        continue
                    key = (path, k)
                    if (norm or key not in known or key in changing) and id(b) not in clones:
                        clones[id(b)] = b.clone()
                    found.append((d, k, key, b, _version(b), clones.get(id(b)), norm))
        out = self.fn(*args)
        for d, k, key, b, v, was, norm in found:
            moved = d.get(k) is not b or _version(b) != v
            if key not in known:
                known.add(key)
                moved = moved or was is None or not torch.equal(was, b)
            if moved:
                changing.add(key)
            elif not (norm or key in changing):
                continue
            if was is None:  # changed, not copied
                if d.get(k) is not b and _version(b) == v:
                    was = b  # replaced: as the forward found it
                else:
                    self.lost = k
                    continue
            self.before.append((d, k, was))
        self.added = [(d, k) for d, had in names for k in d if k not in had]
        self.dicts = [d for d, _ in names]
        return out

    def again(self, *args: Any) -> Any:
        if self.lost is not None:
            raise SsdtierError(
                f"a recomputed block changed its buffer {self.lost!r} in place, which its earlier recomputed "
                "calls did not, so ssdtier had no copy to recompute it from and this backward cannot be exact; "
                "later forwards copy it"
            )
        now = [(d, dict(d)) for d in self.dicts]
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            stats = [(b, b.clone()) for b in self.lazy]
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
    if st.nbytes() > 2 * t.numel() * t.element_size() or t.is_conj() or t.is_neg():
        return t.detach().clone()  # a small view of a large storage: its values alone (lazy bits resolved)
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

    def __init__(self, fn: Any, buffers: Buffers, off: RecomputeOwner, tag: int) -> None:
        super().__init__(fn, buffers)
        self.off, self.tag = off, tag

    def again(self, *args: Any) -> Any:
        ad = self.off.adaptive
        if ad is None:
            return super().again(*args)
        top = top_hooks()  # checkpoint's, which keep what the recomputation saves
        off = self.off
        tally = None if top is None else _Tally(top[0], off._params.ptrs, off.res.sizes(), ad.profile.min_bytes)
        token = ad.profile.recompute_begins(self.tag)
        t0 = time.perf_counter()
        counted = contextlib.nullcontext() if tally is None else torch.autograd.graph.saved_tensors_hooks(tally, top[1])
        try:
            with counted:
                return super().again(*args)
        finally:
            saved = None if tally is None else (tally.big, tally.small)
            ad.profile.recompute_ends(self.tag, token, time.perf_counter() - t0, saved)


class _Tally:
    """What a recomputation saves, each storage once and as a forward run whole counts it
    (parameters and autocast's casts of them aside), on its way to checkpoint's own hook: a
    block recomputed from its first forward on is measured nowhere else."""

    __slots__ = ("below", "big", "pack", "params", "restored", "seen", "small")

    def __init__(self, pack: Any, params: Any, restored: dict, below: int) -> None:
        self.pack, self.params, self.restored, self.below = pack, params, restored, below
        self.seen: set[tuple[torch.device, int]] = set()
        self.big = self.small = 0

    def __call__(self, t: torch.Tensor) -> Any:
        if type(t) is torch.Tensor and t.layout is torch.strided and not (t.is_nested or t.is_quantized):
            st = t.untyped_storage()
            key = (t.device, st.data_ptr())
            base = t._base
            if not (
                key in self.seen
                or key in self.params
                or isinstance(base, nn.Parameter)
                or getattr(t, "_is_param", False)
                or (t.requires_grad and autocast_cast(t, base))
            ):
                self.seen.add(key)
                n = self.restored.get(key) or st.nbytes()  # an input read back: its bytes, not its pages
                if n < self.below:
                    self.small += n
                else:
                    self.big += n
        return self.pack(t)
