"""What the offloader looks saved tensors up in: its live entries (by storage, for dedup,
and by forward and layer, for the read-ahead), and the storages of the model's parameters."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .entry import Entry

StorageKey = tuple[torch.device, int]  # (device, data pointer)


class Entries:
    """The offloaded entries still held by a graph. Called with the offloader's lock held."""

    __slots__ = ("by_layer", "by_storage", "live")

    def __init__(self) -> None:
        # (device, pointer) -> (the storage, weakly; its version when saved; the entry)
        self.by_storage: dict[StorageKey, tuple[weakref.ref, int, Entry]] = {}
        # Entries by (forward, layer), in pack order (dicts used as ordered sets).
        self.by_layer: dict[tuple[int, int], dict[Entry, None]] = {}
        self.live = 0

    def same_storage(self, key: StorageKey, st: torch.UntypedStorage, version: int) -> Entry | None:
        """The live entry of this storage saved at this version, if any (dedup)."""
        hit = self.by_storage.get(key)
        if hit is not None and hit[0]() is st and hit[1] == version and hit[2].refs > 0:
            return hit[2]
        return None

    def add(self, e: Entry, key: StorageKey | None, st: torch.UntypedStorage, version: int) -> None:
        """``key`` None: not found by storage (dedup is off)."""
        if key is not None:
            e.dkey = key
            self.by_storage[key] = (weakref.ref(st), version, e)
        self.by_layer.setdefault((e.forward, e.layer), {})[e] = None
        self.live += 1

    def regroup(self, e: Entry, layer: int) -> None:
        """A later block of its forward saved ``e`` again: its backward needs it first, so that
        block's read-ahead group reads it (a context or rotary table each block saves)."""
        if layer <= e.layer:
            return
        self._ungroup(e)
        e.layer = layer
        self.by_layer.setdefault((e.forward, layer), {})[e] = None

    def remove(self, e: Entry) -> None:
        if e.dkey is not None:
            hit = self.by_storage.get(e.dkey)
            if hit is not None and hit[2] is e:
                del self.by_storage[e.dkey]
        self._ungroup(e)
        self.live -= 1

    def _ungroup(self, e: Entry) -> None:
        group = self.by_layer.get((e.forward, e.layer))
        if group is not None:
            group.pop(e, None)
            if not group:
                del self.by_layer[(e.forward, e.layer)]

    def of_layer(self, forward: int, layer: int) -> list[Entry]:
        """A copy: reading them may run a collection that releases some."""
        return list(self.by_layer.get((forward, layer), ()))

    def abandoned(self, begun: int, after: int) -> tuple[int, int]:
        """Forwards whose backward never began while ``after`` or more backwards of other
        forwards did (of ``begun`` so far): how many, and the bytes of their entries."""
        forwards, nbytes = set(), 0
        for (f, _), group in self.by_layer.items():
            b = next(iter(group)).backward
            if not b.done and begun - b.begun >= after:
                forwards.add(f)
                nbytes += sum(e.nbytes for e in group)
        return len(forwards), nbytes

    def waiting(self, forward: int, older: bool) -> bool:
        """Whether a forward older (or newer) than ``forward`` holds entries: its backward is
        still to come."""
        return any(f < forward if older else f > forward for f, _ in self.by_layer)


class Params:
    """The storages of the model's parameters and buffers as its forward begins."""

    __slots__ = ("dicts", "mods", "ptrs")

    def __init__(self) -> None:
        self.ptrs: set[StorageKey] = set()
        self.dicts: list[dict[str, Any]] = []  # the modules' parameter and buffer dicts
        self.mods: list[nn.Module] = []  # the modules, as found with them

    def refresh(self, model: nn.Module, forward: int) -> None:
        if forward % 64 == 1:
            # Walking the module tree costs about 1 ms per 20 modules: new submodules are
            # found every 64 forwards; the tensors in the dicts are read every forward
            # (`.to()`, `load_state_dict` and the like swap them).
            self.mods = list(model.modules())
            self.dicts = [d for m in self.mods for d in (m._parameters, m._buffers) if d]
        self.ptrs = storages_of([t for d in self.dicts for t in d.values() if t is not None])

    def forget(self) -> None:
        self.ptrs, self.dicts, self.mods = set(), [], []

    def grads(self) -> int:
        """Bytes of the parameters' gradients, each storage once (a DDP bucket: once)."""
        seen = {}
        for d in self.dicts:
            for t in d.values():
                g = t.grad if t is not None else None
                if g is not None:
                    st = g.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def state(self, cuda: bool) -> tuple:
        """What changes what a forward saves at the same inputs: modules training (dropout
        saves its masks), parameters that need gradients (layers unfrozen), autocast."""
        casts = ("cpu", "cuda") if cuda else ("cpu",)
        return (
            tuple(m.training for m in self.mods),
            tuple(t.requires_grad for d in self.dicts for t in d.values() if t is not None),
            tuple((torch.is_autocast_enabled(c), torch.get_autocast_dtype(c)) for c in casts),
        )


def storages_of(tensors: list[torch.Tensor]) -> set[StorageKey]:
    ptrs = set()
    for p in tensors:
        try:
            ptrs.add((p.device, p.untyped_storage().data_ptr()))
        except (RuntimeError, NotImplementedError, ValueError):  # (ValueError: a lazy module's)
            # No storage of its own (a sharded DTensor between FSDP's gathers, a meta
            # tensor): what it becomes in the forward is a Parameter, recognised in _pack.
            pass
    return ptrs
