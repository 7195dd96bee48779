"""What autograd holds for each saved tensor (the handles pack returns), and the offloaded
storage behind it."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .forward import Fwd
    from .owner import EntryOwner

_EMPTY: dict[torch.device, torch.Tensor] = {}


def version_probe(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor that shares ``t``'s version counter (and nothing else): its
    ``_version`` tells whether ``t``, or any view of its base, was modified in place."""
    probe = t.detach()  # shares the version counter, and for now the storage
    empty = _EMPTY.get(t.device)
    if empty is None:
        empty = _EMPTY[t.device] = torch.empty(0, device=t.device)
    # Swaps the storage for an empty one, keeping the counter and not bumping it (set_() would).
    probe.data = empty
    return probe


def check_version(t: torch.Tensor | Saved, version: int, now: int) -> None:
    """Autograd checks that a saved tensor was not modified in place before its backward,
    but not for tensors saved through saved-tensor hooks; ssdtier does it for them."""
    if now != version:
        shape = list(t.size) if isinstance(t, Saved) else list(t.shape)
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.dtype} {shape}] is at version {now}; expected version {version} instead "
            "(checked by ssdtier, as autograd does without saved-tensor hooks). Hint: enable anomaly "
            "detection with torch.autograd.set_detect_anomaly(True) to find the operation that "
            "failed to compute its gradient."
        )


# Types whose ``_version`` is read directly (no ``__torch_function__`` of their own).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, read past a subclass's ``__torch_function__``; None if it has none."""
    if type(t) in _PLAIN:
        return t._version
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return t._version
    except Exception:  # a subclass or tensor without a version counter: not checked
        return None


def without_history(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached if it has a grad_fn. A handle holding an op's own output (a ReLU's, an
    attention's) with its grad_fn is a cycle through autograd's graph that Python's gc cannot
    see: a graph dropped without a backward would never be freed. Autograd gives the unpacked
    tensor its grad_fn back."""
    return t if t.grad_fn is None else t.detach()


class Same:
    """A saved tensor handed back to autograd as it is (a parameter, a subclass): only its
    version at save time is added, to check it at the unpack."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, cut: bool = True) -> None:
        # ``cut=False``: a view of a parameter, which is never the output of the op saving it.
        self.tensor, self.version = without_history(tensor) if cut else tensor, version_of(tensor)


class Kept:
    """A saved tensor held as it is (small, or in a kept layer)."""

    __slots__ = (
        "__weakref__",
        "backward",
        "forward",
        "held",
        "key",
        "layer",
        "nbytes",
        "off",
        "tensor",
        "version",
    )

    def __init__(self, off: EntryOwner, tensor: torch.Tensor, nbytes: int, fwd: Fwd, key: tuple) -> None:
        self.off, self.tensor, self.nbytes = off, without_history(tensor), nbytes
        self.version = tensor._version
        # Its unpack in backward starts the read-ahead of the layers below, as an entry's does:
        # the kept last layers come first in backward, and the first offloaded ones must be on the way.
        self.forward, self.layer, self.backward = fwd.forward, fwd.tag, fwd.backward
        # Its storage, (device, pointer), is counted as resident once however many kept tensors
        # share it (a live storage is known by its pointer): the list has one item per holder.
        # No lock: list and dict calls are atomic, and one storage is packed by one thread.
        self.key, self.held = key, off._kept_st.setdefault(key, [])
        self.held.append(None)
        if len(self.held) == 1:
            res = off.res
            res.kept += nbytes
            if res.kept > res.kept_peak:
                res.kept_peak = res.kept

    def __del__(self) -> None:
        held = self.held
        held.pop()
        if not held:
            off = self.off
            if off._kept_st.get(self.key) is held:
                del off._kept_st[self.key]
            off.res.kept -= self.nbytes


# An entry's way out: ``Entry.out`` is one of these, or None once only the store holds it.


class Copying:
    """CUDA: its copy into an arena slot, in flight. The source was dropped at once (the
    allocator keeps its block until the offload stream is done with it); ``src`` is a weak
    reference to its storage, to see at landing whether it was freed or resized."""

    __slots__ = ("event", "slot", "src", "wrote")

    def __init__(self, event: Any, slot: int, src: weakref.ref, wrote: int) -> None:
        # ``event``: when the slot may be committed: the copy into it, and any copy out of it
        # made before it landed (each such copy waits for the previous event).
        self.event, self.slot, self.src, self.wrote = event, slot, src, wrote


class Bouncing:
    """CUDA: too large for a free arena slot, so copied to pinned host bytes of its own
    (``buf``) on the offload stream, then written from them to NVMe on a thread (``write``,
    None until the copy lands). ``buf`` serves reads until then, and for good if the write
    failed. ``event``, ``src`` and ``wrote`` as :class:`Copying`'s."""

    __slots__ = ("buf", "event", "src", "write", "wrote")

    def __init__(self, event: Any, buf: torch.Tensor, src: weakref.ref, wrote: int) -> None:
        self.event, self.buf, self.src, self.wrote = event, buf, src, wrote
        self.write: Any = None  # a concurrent.futures.Future of the NVMe write


class Writing:
    """Written to NVMe from its source's own memory (zero copy, cuFile): the source is held
    until the write is done. ``wrote``: the source's data pointer when the write was issued."""

    __slots__ = ("src", "ticket", "wrote")

    def __init__(self, src: torch.UntypedStorage, ticket: Any, wrote: int) -> None:
        self.src, self.ticket, self.wrote = src, ticket, wrote


class Held:
    """Its source is held and serves the unpack, with no read: the read-ahead wanted it when
    its write ended, or the store has no copy (``Entry.key`` None: the write failed, or a
    cuFile write not yet begun was called off)."""

    __slots__ = ("src",)

    def __init__(self, src: torch.UntypedStorage) -> None:
        self.src = src


# Its way back: ``Entry.back`` is one of these, or None while nothing is under way.


class Reading:
    """A read under way: into ``st`` (None: into the arena, for the CUDA transport), the data
    ``pad`` bytes into it; ``ticket`` None once done; ``from_host`` served from the arena."""

    __slots__ = ("from_host", "made", "pad", "queued", "st", "staged", "ticket")

    def __init__(
        self, st: torch.UntypedStorage | None, pad: int, ticket: Any, from_host: bool, made: Made | None = None
    ) -> None:
        self.st, self.pad, self.ticket, self.from_host = st, pad, ticket, from_host
        self.made = made  # cuFile: how ``st`` was made on the GPU
        # CUDA: copied to the GPU ahead of its unpack: (GPU bytes, event of the copy on the
        # prefetch stream, the stream whose pool the bytes are from).
        self.staged: tuple[torch.Tensor, Any, Any] | None = None
        self.queued = False  # CUDA: to be copied to the GPU ahead (else at its unpack)


class Made:
    """How a restored CUDA storage was made: the event of its copy, the stream its block was
    allocated for, and the streams that have waited for the event. An unpack on another
    stream waits for the copy too, and records its use."""

    __slots__ = ("allocated", "event", "waited")

    def __init__(self, event: Any, allocated: Any, waited: list[Any]) -> None:
        self.event, self.allocated, self.waited = event, allocated, waited


class Restored:
    """Read back: the storage (weakly, while an unpacked view uses it) and where its data starts."""

    __slots__ = ("made", "pad", "ref")

    def __init__(self, ref: weakref.ref, pad: int, made: Made | None) -> None:
        self.ref, self.pad, self.made = ref, pad, made


class Entry:
    """One offloaded storage: where its bytes are going (``out``) and coming back (``back``)."""

    __slots__ = (
        "back",
        "backward",
        "cuda",
        "device",
        "dkey",
        "first",
        "forward",
        "hold",
        "key",
        "layer",
        "lead",
        "nbytes",
        "out",
        "pos",
        "refs",
        "view",
        "waiting",
        "wanted",
    )

    def __init__(self, key: int, nbytes: int, device: torch.device, cuda: bool, fwd: Fwd) -> None:
        self.key: int | None = key  # None once the store has no copy (a failed write)
        self.nbytes, self.device, self.cuda = nbytes, device, cuda
        self.out: Copying | Bouncing | Writing | Held | None = None
        self.back: Reading | Restored | None = None
        self.dkey: tuple[torch.device, int] | None = None  # its key in the dedup map
        # Its forward, the forward's backwards (which start each layer's read-ahead once), and
        # the layer whose read-ahead group holds it: the latest block of its forward that saved it.
        self.forward, self.layer, self.backward = fwd.forward, fwd.tag, fwd.backward
        self.refs = 0
        # Handles not unpacked yet: while some are, the restored storage is held, so a
        # storage shared by several saved tensors is read back once.
        self.waiting = 0
        self.hold: torch.UntypedStorage | None = None
        self.lead = 0  # bytes of the first page before the data (a direct write covers whole pages)
        # The read-ahead reached it: its bytes should be in memory (a source still held stays).
        self.wanted = False
        # The tensor first saved (weakly) and its version probe, for the dedup hits that save
        # the same tensor again; the view rebuilt for such handles, while it lives.
        self.first: tuple | None = None  # (tensor ref, probe, size, stride, offset)
        self.view: torch.Tensor | None = None
        self.pos = -1  # its place in its forward's pack order (read-ahead by bytes)

    def source(self) -> torch.UntypedStorage | None:
        """The source storage held in memory (a write from it in flight, or serving the unpack)."""
        out = self.out
        return out.src if type(out) is Writing or type(out) is Held else None


class Saved:
    """What autograd holds for an offloaded tensor: its entry and how to rebuild the view."""

    __slots__ = (
        "backward",
        "conj",
        "dtype",
        "entry",
        "forward",
        "layer",
        "off",
        "offset",
        "probe",
        "size",
        "stride",
        "twin",
        "unpacked",
        "version",
    )

    def __init__(self, off: EntryOwner, entry: Entry, t: torch.Tensor, fwd: Fwd, first: tuple | None = None) -> None:
        # Counted before anything is allocated: an allocation may run a garbage collection that
        # releases the entry's other handles, and with this one counted the entry stays.
        entry.refs += 1
        entry.waiting += 1
        self.off, self.entry = off, entry
        # The forward and block that saved it, whose backward unpacks it: the entry's (the first
        # to save the storage) may be others (a context saved by each block, or each micro-batch).
        self.forward, self.layer, self.backward = fwd.forward, fwd.tag, fwd.backward
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.shape, t.stride()
        self.version = t._version
        # The entry's first tensor saved again, as it was (same version counter; ``resize_``
        # can change a view without bumping its version): one view serves both.
        same = first is not None and first[0]() is t
        self.twin = first is None or (
            same and first[2] == self.size and first[3] == self.stride and first[4] == self.offset
        )
        self.probe = first[1] if same else version_probe(t)
        # A lazily conjugated view (``x.conj()`` of a complex tensor) holds the unconjugated
        # bytes: they are what is stored, and the view gets its conjugate bit back on unpack.
        self.conj = t.is_conj()
        self.unpacked = False

    def __del__(self) -> None:
        if not self.unpacked:
            self.entry.waiting -= 1
        self.off._release(self.entry)


class Distributed:
    """An offloaded DTensor: the handle of its local tensor and how to wrap it again."""

    __slots__ = ("local", "spec")

    def __init__(self, local: Any, spec: Any) -> None:
        self.local, self.spec = local, spec
