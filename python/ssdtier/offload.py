"""`attach(model)`: saved activations go through the tiered store.

The saved-tensor hooks are active during the model's forward only. Each saved
tensor is classified once, at pack time:

- parameters and buffers (recognised by storage, so ``weight.t()`` is too),
  tensors that are not plain strided tensors (quantized and zero tensors
  included), lazily negated views, tensors on devices other than CPU/CUDA:
  returned as they are;
- tensors smaller than ``policy.min_tensor_bytes`` and tensors of kept layers:
  held as they are (counted as resident);
- everything else: its *storage* goes to the store once (two saved tensors on
  one storage are one entry), and unpack rebuilds the view with its offset,
  size, stride and conjugate bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import functools
import itertools
import logging
import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .config import Config, PolicyConfig, format_size, resolve_config
from .errors import ConfigError, OutOfSpaceError, SsdtierError, SsdtierOSError, SsdtierWarning
from .plan import LayerProfile, Plan, make_plan
from .store import StoreStats, TieredStore

__all__ = ["OffloadStats", "Offloader", "attach", "attached", "find_layers", "no_offload"]

log = logging.getLogger("ssdtier")

_AHEAD_MAX = 4  # prefetch_layers = "auto" reads 1.._AHEAD_MAX layers ahead
_PAGE = 4096

# Run as Python, never traced by torch.compile.
_eager = getattr(getattr(torch, "compiler", None), "disable", None) or (lambda fn: fn)


_INTERNAL = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (sys.modules[__package__], torch))


def _warn(msg: str) -> None:
    """What the user must see (activations left in memory, hooks removed), shown at the user's
    line that led to it (a forward, a backward); the rest is logged."""
    level, f = 1, sys._getframe(0)
    while f is not None and f.f_code.co_filename.startswith(_INTERNAL):
        level, f = level + 1, f.f_back
    warnings.warn(f"ssdtier: {msg}", SsdtierWarning, stacklevel=level)


def _aligned_storage(nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """A CPU storage with room for ``nbytes`` rounded up to whole pages (O_DIRECT moves whole
    pages) from its first page boundary, and that boundary's offset in it. An ordinary torch
    allocation, so its memory is reused like any other."""
    st = torch.UntypedStorage(-(-nbytes // _PAGE) * _PAGE + _PAGE)
    return st, -st.data_ptr() % _PAGE


def _on_cpu(model: nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in itertools.chain(model.parameters(), model.buffers()))


def _cuda_ok(rc: Any) -> bool:
    return int(rc[0] if isinstance(rc, tuple) else rc) == 0


def _clear_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error to the thread's next cudaGetLastError, which
    torch calls after its next kernel launch: that kernel would then fail with our error. Clear
    it in the libcudart that torch loaded (torch does not expose cudaGetLastError)."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
        if libs:
            return
        err: object = "no libcudart.so is loaded (a static build?)"
    except OSError as e:
        err = e
    _warn(f"could not clear the CUDA error ({err}); torch may report it at its next kernel")


class _Hook:
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


class _ModelHook(_Hook):
    """The model's own hooks, which push and pop the saved-tensor hooks: Dynamo cannot trace
    that, so under torch.compile they run outside the compiled frame (as a ``save_on_cpu``
    around the call would), and ``fullgraph=True`` works."""

    __slots__ = ()
    __call__ = _eager(_Hook.__call__)


def _storage_objects_preserved() -> bool:
    t = torch.empty(1)
    return t.untyped_storage() is t.untyped_storage()


@dataclass(frozen=True)
class OffloadStats:
    """What the offloader did so far.

    ``forwarded`` counts the unpacks served from memory with no NVMe read (a
    write still in flight, the host arena, a kept tensor). ``peak_resident_bytes``
    is the most bytes of saved activations that ssdtier held in device or process
    memory at once: kept tensors (each storage once), the host arena in use,
    GPU tensors whose copy is in flight, CPU tensors whose write is in flight,
    and restored storages. ``prefetch_layers`` is how many layers the
    backward reads ahead now (with ``policy.prefetch_layers = "auto"``, what the
    tuning has reached). ``copied_ahead`` counts, on CUDA, the read-ahead
    entries copied to the GPU on the prefetch stream before their unpack (the
    others are copied on the compute stream when unpacked). ``failed_writes``
    counts the activations whose copy to the store failed (no space, an I/O
    error, or a storage freed while it was copied out), which stayed in memory;
    ``failed_reads`` the reads that failed in backward (each raised).
    """

    tensors_offloaded: int
    bytes_offloaded: int
    bytes_written_nvme: int
    bytes_read_nvme: int
    dedup_hits: int
    forwarded: int
    copied_ahead: int
    failed_writes: int
    failed_reads: int
    peak_resident_bytes: int
    stall_seconds: float
    layers_offloaded: int
    layers_kept: int
    prefetch_layers: int
    tensors_kept: int
    bytes_kept: int
    packs: int
    unpacks: int
    plan: Plan | None
    store: StoreStats

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain data: dicts, lists, tuples, numbers (``json.dumps`` takes it)."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [
            f"offloaded {format_size(self.bytes_offloaded)} in {self.tensors_offloaded} tensors "
            f"({self.dedup_hits} more shared a storage); kept {format_size(self.bytes_kept)} in "
            f"{self.tensors_kept} tensors",
            f"NVMe: wrote {format_size(self.bytes_written_nvme)}, read {format_size(self.bytes_read_nvme)}; "
            f"{self.forwarded} of {self.unpacks} unpacks served from memory",
            f"peak resident {format_size(self.peak_resident_bytes)}; backward stalled {self.stall_seconds:.3f} s; "
            f"layers {self.layers_offloaded} offloaded, {self.layers_kept} kept, {self.prefetch_layers} read ahead",
        ]
        if self.failed_writes or self.failed_reads:
            lines.append(f"failed: {self.failed_writes} writes (kept in memory), {self.failed_reads} reads")
        if self.plan is not None:
            lines.append(f"adaptive plan: keep the last {self.plan.keep_last}: {self.plan.reason}")
        return "\n".join(lines)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _children(mod: nn.Module) -> list[nn.Module]:
    return list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)


def find_layers(model: nn.Module, path: str | None = None) -> tuple[str, list[nn.Module]] | None:
    """The model's repeated blocks: the largest ModuleList, Sequential or ModuleDict whose
    children share one class (a ModuleDict's in insertion order, the order of its forward).

    Args:
        model: the model.
        path: a dotted path (``"transformer.h"``) that names the container instead.

    Returns:
        (path, blocks), or None when the model has no such container.
    """
    if path is not None:
        try:
            mod = model.get_submodule(path)
        except AttributeError as e:
            raise ConfigError(f"policy.layers = {path!r}: the model has no submodule {path!r}") from e
        if not isinstance(mod, _CONTAINERS) or len(mod) == 0:
            raise ConfigError(
                f"policy.layers = {path!r} is a {type(mod).__name__}, not a non-empty ModuleList, "
                "Sequential or ModuleDict"
            )
        return path, _children(mod)
    best: tuple[str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, _CONTAINERS) and len(mod) >= 2:
            blocks = _children(mod)
            if len({type(m) for m in blocks}) == 1 and (best is None or len(blocks) > len(best[1])):
                best = (name, blocks)
    return best


def _version_probe(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor that shares ``t``'s version counter (and nothing else): its
    ``_version`` tells whether ``t``, or any view of its base, was modified in place."""
    probe = t.detach()  # shares the version counter, and for now the storage
    with torch.autograd._unsafe_preserve_version_counter(probe):
        probe.set_()  # lets go of the storage; the counter is left as it was
    return probe


def _check_version(t: torch.Tensor | _Saved, version: int, now: int) -> None:
    """Autograd checks that a saved tensor was not modified in place before its backward,
    but not for tensors saved through saved-tensor hooks; ssdtier does it for them."""
    if now != version:
        shape = list(t.size) if isinstance(t, _Saved) else list(t.shape)
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.dtype} {shape}] is at version {now}; expected version {version} instead "
            "(checked by ssdtier, as autograd does without saved-tensor hooks). Hint: enable anomaly "
            "detection with torch.autograd.set_detect_anomaly(True) to find the operation that "
            "failed to compute its gradient."
        )


def _version_of(t: torch.Tensor) -> int | None:
    """``t._version``, read past a subclass's ``__torch_function__``; None if it has none."""
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return t._version
    except Exception:  # a subclass or tensor without a version counter: not checked
        return None


class _Same:
    """A saved tensor handed back to autograd as it is (a parameter, a subclass): only its
    version at save time is added, to check it at the unpack."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, _version_of(tensor)


class _Fwd:
    """One thread's forward of one attached model. Saved-tensor hooks are per thread, so
    whether they were pushed, and the layer that packs are tagged with, are per thread too.
    A plain object: autograd's engine threads get a copy of the hooks (not of this state)
    and pack with the state of the last forward that pushed them."""

    __slots__ = ("excluded", "forward", "off", "pushed", "scopes", "tag")

    def __init__(self, off: Offloader) -> None:
        self.off = off
        self.pushed: list[bool] = []  # calls of the model under way on this thread: hooks pushed?
        self.forward = 0  # the number of this thread's outermost forward
        self.tag = 0  # the layer that forward is in
        self.excluded = 0  # calls of policy.exclude's modules that forward is in
        self.scopes = 0  # Offloader.scope() blocks under way (each counts as a call of the model)


class _PerThread(threading.local):
    def __init__(self, off: Offloader) -> None:
        self.fwd = _Fwd(off)


# Per thread: the forwards (of any attached model) whose hooks are pushed, in push order.
_PUSHED = threading.local()


def _pushed() -> list[_Fwd]:
    stack = getattr(_PUSHED, "stack", None)
    if stack is None:
        stack = _PUSHED.stack = []
    return stack


def _saving_possible() -> str | None:
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


def _top_hooks() -> Any:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _forwards_under_way(module: nn.Module) -> int:
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


def _drop_interrupted(f: _Fwd, what: str) -> None:
    """Pop the hooks that an interrupted forward left pushed on this thread (KeyboardInterrupt,
    not an Exception, skips the forward hooks that pop them), with those of the attached
    models called inside it, which were interrupted too."""
    stack = _pushed()
    inner = next((i for i, g in enumerate(stack) if g is f), len(stack))
    left = stack[inner:]
    popped = 0
    for g in reversed(left):
        top = _top_hooks()
        if top is None or top[0] != g.off._pack:
            break  # not ssdtier's on top: whoever pushed it pops it
        g.off._hooks.__exit__(None, None, None)
        popped += 1
    for g in left:
        g.pushed.clear()
    del stack[inner:]
    f.pushed.clear()
    _warn(
        f"a forward of {type(f.off.model).__name__} on this thread {what} (interrupted, as by "
        f"KeyboardInterrupt, which skips forward hooks); {popped} of the saved-tensor hooks left on "
        f"were removed{'' if popped == len(left) else ' (others were pushed above them and stay)'}"
    )


class _Kept:
    """A saved tensor held as it is (small, or in a kept layer)."""

    __slots__ = ("__weakref__", "forward", "held", "key", "layer", "nbytes", "off", "tensor", "triggered", "version")

    def __init__(self, off: Offloader, tensor: torch.Tensor, nbytes: int, fwd: _Fwd, key: tuple) -> None:
        self.off, self.tensor, self.nbytes = off, tensor, nbytes
        self.version = tensor._version
        # Its unpack in backward starts the read-ahead of the layers below, as an entry's does:
        # the kept last layers come first in backward, and the first offloaded ones must be on the way.
        self.forward, self.layer, self.triggered = fwd.forward, fwd.tag, False
        # Its storage, (device, pointer), is counted as resident once however many kept tensors
        # share it (a live storage is known by its pointer): the list has one item per holder.
        # No lock: list and dict calls are atomic, and one storage is packed by one thread.
        self.key, self.held = key, off._kept_st.setdefault(key, [])
        self.held.append(None)
        if len(self.held) == 1:
            off._resident_kept += nbytes

    def __del__(self) -> None:
        held = self.held
        held.pop()
        if not held:
            off = self.off
            if off._kept_st.get(self.key) is held:
                del off._kept_st[self.key]
            off._resident_kept -= self.nbytes


class _Entry:
    """One offloaded storage."""

    __slots__ = (
        "cuda",
        "device",
        "dkey",
        "event",
        "forward",
        "gpu",
        "key",
        "layer",
        "lead",
        "made",
        "nbytes",
        "refs",
        "hold",
        "pad",
        "reading",
        "restored",
        "src",
        "staged",
        "ticket",
        "triggered",
        "waiting",
        "wanted",
        "wrote",
    )

    def __init__(self, key: int, nbytes: int, device: torch.device, cuda: bool, forward: int, layer: int) -> None:
        self.key: int | None = key  # None once the store has no copy (a failed write)
        self.nbytes, self.device, self.cuda = nbytes, device, cuda
        self.dkey: tuple[torch.device, int] | None = None  # its key in the dedup map
        self.forward, self.layer = forward, layer
        self.refs = 0
        # Handles not unpacked yet: while some are, the restored storage is held, so a
        # storage shared by several saved tensors is read back once.
        self.waiting = 0
        self.hold: torch.UntypedStorage | None = None
        self.pad = 0  # byte offset of the data in the restored storage
        self.gpu: torch.Tensor | None = None  # CUDA: the source, held until its copy is done
        # CPU, zero copy: the source storage, held until its write from its own pages is
        # done (for good if the write failed), the write's ticket, and the bytes of the first
        # page before the data (the write covers whole pages).
        self.src: torch.UntypedStorage | None = None
        self.ticket: Any = None
        self.lead = 0
        self.wrote = 0  # the source's data pointer when its write was issued
        self.event: Any = None
        # The restored storage, while some unpacked view still uses it.
        self.restored: weakref.ref | None = None
        # A read under way: (buffer storage or None, offset of the data in it, ticket or None,
        # served from the host arena).
        self.reading: tuple[torch.UntypedStorage | None, int, Any, bool] | None = None
        # CUDA: copied to the GPU ahead of its unpack: (GPU bytes, event of the copy on the
        # prefetch stream, the compute stream it was allocated on).
        self.staged: tuple[torch.Tensor, Any, Any] | None = None
        # CUDA: how the restored storage was made: (event of its copy, the stream its block was
        # allocated for, the streams that have waited for that event). An unpack on another
        # stream (a forward that used several) waits for the copy too, and records its use.
        self.made: tuple[Any, Any, list[Any]] | None = None
        # Its unpack started the read-ahead of the layers below (once per entry).
        self.triggered = False
        # The read-ahead reached it: its bytes should be in memory (a source still held stays).
        self.wanted = False


class _FirstForward:
    """Why the first forward held its saved activations in memory (when it offloaded none,
    a user is told why once: a small model with the defaults moves nothing)."""

    __slots__ = ("excluded", "largest", "layer", "small")

    def __init__(self) -> None:
        self.small = self.layer = self.excluded = self.largest = 0

    def held(self, nbytes: int, why: str) -> None:
        setattr(self, why, getattr(self, why) + 1)
        if why == "small":
            self.largest = max(self.largest, nbytes)

    def why_nothing(self, model: nn.Module, pol: PolicyConfig, kept: int) -> str:
        parts = []
        if self.small:
            floor = 1 << max(self.largest.bit_length() - 1, 0)  # offloads the largest of them
            parts.append(
                f"{self.small} were smaller than policy.min_tensor_bytes ({format_size(pol.min_tensor_bytes)}; "
                f'the largest {format_size(self.largest)}: policy__min_tensor_bytes="{format_size(floor)}" '
                "would offload it)"
            )
        if self.layer:
            parts.append(f"{self.layer} were in the {kept} kept last layer(s) (policy.keep_last_layers)")
        if self.excluded:
            parts.append(f"{self.excluded} were in excluded modules (policy.exclude or no_offload())")
        why = " and ".join(parts) or "it saved none but parameters, buffers and tensors ssdtier leaves alone"
        return f"the first forward of {type(model).__name__} offloaded nothing: of its saved activations, {why}"


class _Saved:
    """What autograd holds for an offloaded tensor: its entry and how to rebuild the view."""

    __slots__ = ("conj", "dtype", "entry", "off", "offset", "probe", "size", "stride", "unpacked", "version")

    def __init__(self, off: Offloader, entry: _Entry, t: torch.Tensor) -> None:
        self.off, self.entry = off, entry
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.shape, t.stride()
        # Counted first: the allocations below may run a garbage collection that releases the
        # entry's other handles, and with this one counted the entry stays.
        entry.refs += 1
        entry.waiting += 1
        self.version, self.probe = t._version, _version_probe(t)
        # A lazily conjugated view (``x.conj()`` of a complex tensor) holds the unconjugated
        # bytes: they are what is stored, and the view gets its conjugate bit back on unpack.
        self.conj = t.is_conj()
        self.unpacked = False

    def __del__(self) -> None:
        if not self.unpacked:
            self.entry.waiting -= 1
        self.off._release(self.entry)


class Offloader:
    """Offloads a model's saved activations; made by :func:`attach`.

    Use it as a context manager (detaches on exit) or call :meth:`detach`.
    """

    def __init__(self, model: nn.Module, config: Config) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
        if attached(model) is not None:
            raise SsdtierError(f"ssdtier is already attached to this {type(model).__name__}; detach() it first")
        pol = config.policy
        # Pushed by the model's forward pre-hook, popped by its forward hook (always_call).
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.model = model
        if config.io.zero_copy and config.io.fixed_buffers and _on_cpu(model):
            # A CPU model's activations go to NVMe from their own pages: the arena only takes
            # the rare storage that cannot (not 64-byte aligned). Registering it with io_uring
            # would pin all of it; unregistered, it costs memory only where it is used.
            config = config.replace(io__fixed_buffers=False)
        self.config = config
        self.store = TieredStore(config)
        self._lock = threading.RLock()
        self._dedup_ok = pol.dedup and _storage_objects_preserved()
        found = find_layers(model, pol.layers)
        self.layers_path = found[0] if found else None
        n = len(found[1]) if found else 0
        self._n_layers = n
        # "auto" keeps the last block: its backward starts right after the forward,
        # leaving no time to write its activations out and read them back.
        keep = min(n, 1 if pol.keep_last_layers == "auto" else int(pol.keep_last_layers))
        if pol.mode == "none":
            keep = n
        self._layers_kept = keep
        # Tags: 0 before the blocks, i + 1 in block i, n + 1 after them. Tags from
        # _keep_from on are kept: the last `keep` blocks and what follows them.
        self._keep_from = n - keep + 1 if keep else n + 2
        if pol.mode == "none":
            self._keep_from = 0
        self._tls = _PerThread(self)
        self._last_fwd = _Fwd(self)  # the forward that pushed the hooks last, on any thread
        self._forward = 0  # forwards begun, on any thread
        self._param_ptrs: set[tuple[torch.device, int]] = set()
        # The parameter and buffer dicts of the model's modules (`.to()` swaps the tensors in them).
        self._param_dicts: list[dict[str, Any]] = []
        # Kept tensors' storages: (device, pointer) -> one item per kept handle holding it
        self._kept_st: dict[tuple[torch.device, int], list[None]] = {}
        self._dedup: dict[tuple[torch.device, int], tuple[weakref.ref, int, _Entry]] = {}
        # Entries by (forward, layer), in pack order (dicts used as ordered sets).
        self._by_layer: dict[tuple[int, int], dict[_Entry, None]] = {}
        self._pending: deque[_Entry] = deque()  # CUDA copies to the arena in flight, in order
        self._writing: deque[_Entry] = deque()  # CPU writes from the tensors' own pages in flight, in order
        self._h2d: deque[tuple[Any, int]] = deque()  # (event, key): slots pinned until their copy to the GPU is done
        self._free_later: set[int] = set()  # keys of released entries freed once their _h2d copies are done
        self._staging: list[_Entry] = []  # CUDA read-aheads not copied to the GPU yet
        self._stage_off = False  # no copies ahead until the next forward (out of GPU memory)
        self._cuda: dict[torch.device, tuple[Any, Any]] = {}  # (offload stream, prefetch stream)
        self._registered = False
        self._closed = False
        self._live = 0
        self._resident_kept = 0
        self._resident_gpu = 0
        self._resident_writing = 0
        self._resident_restored = 0
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}  # id(ref) -> (ref, bytes), see _track
        self._peak = 0
        self._counts = dict.fromkeys(
            (
                "tensors_offloaded",
                "bytes_offloaded",
                "dedup_hits",
                "forwarded",
                "copied_ahead",
                "failed_writes",
                "failed_reads",
                "tensors_kept",
                "bytes_kept",
                "packs",
                "unpacks",
            ),
            0,
        )
        self._stall = 0.0
        self._stall_ahead = 0.0  # the part of it spent on reads started by the read-ahead
        # Layers read ahead in backward: as configured, or ("auto") tuned after each backward
        # from what the last one saw (_tune_ahead).
        self._ahead_auto = pol.prefetch_layers == "auto"
        self._ahead = 2 if self._ahead_auto else int(pol.prefetch_layers)
        self._ahead_clean = 0  # backwards in a row where one layer less would have done
        self._ahead_patience = 2  # ... needed before taking one away
        self._ahead_lowered = False
        self._ahead_stall0 = 0.0
        self._trig: dict[tuple[int, int], float] = {}  # (forward, layer): when its backward began
        self._reads: dict[tuple[int, int], list[tuple[float, Any]]] = {}  # read-aheads: (start, ticket)
        self._handles: list[Any] = []
        # What the first forward held in memory, to say why if it offloaded nothing.
        self._first: _FirstForward | None = None if pol.mode == "none" else _FirstForward()
        # Adaptive mode: profile of the iteration in progress, and the plan.
        self._adaptive = pol.mode == "adaptive" and n > 0
        self._budget = pol.device_budget
        self._plan: Plan | None = None
        self._min_keep = 0
        self._clean_iters = 0
        self._patience = 3  # clean iterations before trying to offload one more layer
        self._retrying = False
        self._prof_fwd: dict[int, float] = {}
        self._prof_bytes: dict[int, int] = {}
        self._prof_t0: dict[int, tuple[float, float]] = {}
        self._iter_stall0 = 0.0
        self._iter_wait0 = 0.0
        self._bw: tuple[float, float] | None = None
        try:
            if self._adaptive:
                self._bw = self._calibrate()
            self._handles += [
                model.register_forward_pre_hook(_ModelHook(self._enter)),
                model.register_forward_hook(_ModelHook(self._exit), always_call=True),
            ]
            if found:
                for i, block in enumerate(found[1]):
                    self._handles.append(block.register_forward_pre_hook(_Hook(self._block_enter(i + 1))))
                    self._handles.append(block.register_forward_hook(_Hook(self._block_exit(i + 1)), always_call=True))
            for mod in _excluded_modules(model, pol.exclude):
                self._handles.append(mod.register_forward_pre_hook(_Hook(self._exclude_enter)))
                self._handles.append(mod.register_forward_hook(_Hook(self._exclude_exit), always_call=True))
            _ATTACHED[model] = weakref.ref(self)
        except BaseException:
            # Nothing left behind: no hook on the model, and the store closed.
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._closed = True
            self.store.close()
            raise
        log.info(
            "ssdtier: attached to %s; layers %s (%d), keeping the last %d, prefetching %s ahead",
            type(model).__name__,
            self.layers_path,
            n,
            keep,
            pol.prefetch_layers,
        )

    # ---------------------------------------------------------------- hooks on modules

    def _enter(self, module: nn.Module, args: Any) -> None:
        f = self._tls.fwd
        if f.pushed and _forwards_under_way(module) + f.scopes < 2:
            _drop_interrupted(f, "did not finish")
        f.pushed.append(False)
        if len(f.pushed) > 1:
            return  # the model called inside its own forward: the outer call's hooks serve
        why = _saving_possible()
        if why is not None:
            if why and not getattr(self, "_warned_off", False):
                self._warned_off = True
                _warn(f"{why}: activations of such forwards of {type(module).__name__} stay in memory")
            return
        if self._adaptive:
            self._replan()
        if self._ahead_auto and self._trig:
            self._tune_ahead()
        with self._lock:
            self._forward += 1
            f.forward = self._forward
            self._stage_off = False
        if f.forward % 64 == 1:
            # Walking the module tree costs about 1 ms per 20 modules: the list of modules'
            # parameter and buffer dicts is refreshed every 64 forwards (new submodules), the
            # tensors in them looked up every forward (`.to()`, `load_state_dict` and the
            # like may have swapped them).
            self._param_dicts = [d for m in module.modules() for d in (m._parameters, m._buffers) if d]
        self._param_ptrs = self._storages_of([t for d in self._param_dicts for t in d.values() if t is not None])
        f.tag = f.excluded = 0
        self._hooks.__enter__()
        f.pushed[-1] = True
        _pushed().append(f)
        self._last_fwd = f

    @staticmethod
    def _storages_of(tensors: list[torch.Tensor]) -> set[tuple[torch.device, int]]:
        ptrs = set()
        for p in tensors:
            try:
                ptrs.add((p.device, p.untyped_storage().data_ptr()))
            except (RuntimeError, NotImplementedError):
                # No storage of its own (a sharded DTensor between FSDP's gathers, a meta
                # tensor): what such a parameter becomes in the forward is a Parameter, and
                # is recognised as one in _pack.
                pass
        return ptrs

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        f = self._tls.fwd
        if not f.pushed:
            return  # its _enter did not run (a forward pre-hook before it raised)
        if f.pushed.pop():
            self._hooks.__exit__(None, None, None)
            stack = _pushed()
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is f:
                    del stack[i]
                    break
            with self._lock:  # a backward, or a graph being freed, on another thread may poll too
                self._poll_pending()
                self._poll_writes()
            if self._first is not None:
                first, self._first = self._first, None
                c = self._counts
                if c["packs"] and not c["tensors_offloaded"] and not c["failed_writes"]:
                    _warn(first.why_nothing(module, self.config.policy, self._layers_kept))

    def _block_enter(self, tag: int):
        def hook(module: nn.Module, args: Any) -> None:
            f = self._tls.fwd
            f.tag = tag
            if self._adaptive and f.pushed and f.pushed[0]:
                self._prof_t0[tag] = (time.perf_counter(), self._store_wait())

        return hook

    def _block_exit(self, tag: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            f = self._tls.fwd
            f.tag = self._n_layers + 1 if tag == self._n_layers else tag
            start = self._prof_t0.pop(tag, None) if self._adaptive and f.pushed and f.pushed[0] else None
            if start is not None:
                # Compute time: the time blocked on the store (a full arena) is not the layer's.
                spent = time.perf_counter() - start[0] - (self._store_wait() - start[1])
                self._prof_fwd[tag] = self._prof_fwd.get(tag, 0.0) + max(spent, 0.0)

        return hook

    def _exclude_enter(self, module: nn.Module, args: Any) -> None:
        self._tls.fwd.excluded += 1

    def _exclude_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        f = self._tls.fwd
        f.excluded = max(f.excluded - 1, 0)  # 0 already if its enter ran before the forward's

    def _store_wait(self) -> float:
        return self.store._native.wait_seconds

    # ---------------------------------------------------------------- pack / unpack

    def _pack(self, t: torch.Tensor) -> Any:
        if self._closed:
            return _Same(t)  # hooks an interrupted forward left on another thread, after detach()
        c = self._counts
        c["packs"] += 1
        self._poll_writes()
        if (
            type(t) is not torch.Tensor
            or t.layout != torch.strided
            or t.is_nested
            or t.is_quantized  # its scale and zero point live outside the bytes
            or t.is_neg()
            or t._is_zerotensor()  # no storage to read
        ):
            # Kept as they are. A negative bit (``x.conj().imag``) is a lazy view; unlike the
            # conjugate bit there is no public call to set it again on the restored view.
            return _Same(t)
        dev = t.device
        if not (t.is_cpu or t.is_cuda):
            return _Same(t)
        st = t.untyped_storage()
        ptr = st.data_ptr()
        base = t._base
        if (
            (dev, ptr) in self._param_ptrs
            or (base is not None and (type(base) is nn.Parameter or isinstance(base, nn.Parameter)))
            or getattr(t, "_is_param", False)
        ):
            # A parameter, or a view of one (weight.t()): by its storage as it was when the
            # forward began, or by what it is (a parameter whose storage is made inside the
            # forward, as sharded data parallelism does when it gathers one, has a new pointer).
            # ``t`` is a plain Tensor here (a Parameter was kept above, as a subclass), so it
            # is one only if marked so (``_is_param``, what ``isinstance(t, Parameter)`` checks).
            return _Same(t)
        nbytes = st.nbytes()
        f = self._tls.fwd
        if not f.pushed:
            # Not this thread's forward: an autograd engine thread (its copy of the hooks packs
            # for a graph built in backward), or a backward building one after the forward.
            f = self._last_fwd
        tag = f.tag
        if self._adaptive and nbytes >= self.config.policy.min_tensor_bytes:
            self._prof_bytes[tag] = self._prof_bytes.get(tag, 0) + nbytes
        small = nbytes < self.config.policy.min_tensor_bytes
        excluded = f.excluded or _NO_OFFLOAD.depth  # asked for: the budget does not overrule it
        keep = small or tag >= self._keep_from
        if keep and self._budget is not None and self._resident_kept + nbytes > self._budget:
            keep = False  # over the device budget: offload even what the policy would keep
        if keep or excluded:
            if self._first is not None:
                self._first.held(nbytes, "small" if small else "excluded" if excluded else "layer")
            return self._keep(t, nbytes, f, (dev, ptr))
        with self._lock:
            if self._closed:
                return _Same(t)  # detach() on another thread since the check above
            if self._dedup_ok:
                hit = self._dedup.get((dev, ptr))
                if hit is not None and hit[0]() is st and hit[1] == t._version and hit[2].refs > 0:
                    c["dedup_hits"] += 1
                    return _Saved(self, hit[2], t)
            try:
                entry = self._offload(t, st, nbytes, f)
            except OutOfSpaceError as e:
                c["failed_writes"] += 1
                self._warn_full(e)
                return self._keep(t, nbytes, f, (dev, ptr))
            except SsdtierOSError as e:
                # A write to NVMe failed (an eviction from the arena, or a direct write): the
                # store lost nothing, and this tensor stays in memory.
                c["failed_writes"] += 1
                self._warn_write(e)
                return self._keep(t, nbytes, f, (dev, ptr))
            c["tensors_offloaded"] += 1
            c["bytes_offloaded"] += nbytes
            if self._dedup_ok:
                entry.dkey = (dev, ptr)
                self._dedup[entry.dkey] = (weakref.ref(st), t._version, entry)
            self._by_layer.setdefault((entry.forward, entry.layer), {})[entry] = None
            saved = _Saved(self, entry, t)
            self._live += 1
        self._note_peak()
        return saved

    def _keep(self, t: torch.Tensor, nbytes: int, f: _Fwd, key: tuple) -> _Kept:
        self._counts["tensors_kept"] += 1
        self._counts["bytes_kept"] += nbytes
        kept = _Kept(self, t, nbytes, f, key)
        self._note_peak()
        return kept

    def _offload(self, t: torch.Tensor, st: torch.UntypedStorage, nbytes: int, f: _Fwd) -> _Entry:
        if t.is_cuda:
            return self._offload_cuda(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st), nbytes, f)
        ptr = st.data_ptr()
        lead = ptr % _PAGE
        # The restored view starts `lead` bytes into its page as the original did; a
        # multiple of 64 keeps every dtype's views aligned (torch allocates at 64).
        if self.config.io.zero_copy and lead % 64 == 0:
            return self._offload_cpu(st, ptr, nbytes, lead, f)
        key = self.store._native.put_from(ptr, nbytes, st)  # a copy into the arena (or to NVMe)
        return _Entry(key, nbytes, t.device, False, f.forward, f.tag)

    def _offload_cpu(self, st: torch.UntypedStorage, ptr: int, nbytes: int, lead: int, f: _Fwd) -> _Entry:
        """Write a CPU storage to NVMe from its own pages (no copy); it is held until written."""
        key, ticket = self.store._native.write_from(ptr - lead, lead + nbytes, st)
        e = _Entry(key, nbytes, st.device, False, f.forward, f.tag)
        e.lead, e.src, e.ticket, e.wrote = lead, st, ticket, ptr
        self._resident_writing += nbytes
        self._writing.append(e)
        return e

    def _poll_writes(self) -> None:
        """Drop the sources of CPU writes that are done."""
        if self._writing:
            with self._lock:  # another thread's pack or unpack may poll too
                while self._writing and self._writing[0].ticket.done():
                    self._end_write(self._writing.popleft())

    def _end_write(self, e: _Entry) -> None:
        ticket, e.ticket = e.ticket, None
        failed: SsdtierError | None = None
        try:
            ticket.wait()
        except SsdtierError as err:
            failed = err
        if failed is None and e.refs:
            failed = self._moved(e, e.src)
        if e.refs == 0:  # released while writing: nobody needs it, its key goes now
            self._drop_src(e)
            self._free_key(e.key)
        elif failed is not None:
            self._copy_lost(e, failed)  # the source stays in memory and serves the unpack
        elif not e.wanted:
            self._drop_src(e)
        # Else the backward is about to use it: it stays and serves the unpack, with no read.

    @staticmethod
    def _moved(e: _Entry, src: torch.UntypedStorage) -> SsdtierError | None:
        """An error if the source storage was freed or resized while its bytes were being
        copied out (as sharded data parallelism does with a gathered parameter's storage after
        the forward): what was copied may not be what was saved. Whatever the storage holds at
        the unpack is what autograd without ssdtier would see, so the unpack is served from it.
        A storage freed and given new bytes at the same address is not seen here; parameters,
        the storages that this happens to, are recognised and kept in _pack."""
        if src.data_ptr() != e.wrote or src.nbytes() != e.nbytes:
            return SsdtierError(
                f"the storage of a saved tensor ({e.nbytes} bytes) was freed or resized while it was being copied out"
            )
        return None

    def _copy_lost(self, e: _Entry, err: SsdtierError) -> None:
        """The store has no good copy of a live entry: its source stays and serves the unpack."""
        self._counts["failed_writes"] += 1
        self._warn_write(err)
        key, e.key = e.key, None
        self._free_key(key)

    def _drop_src(self, e: _Entry) -> None:
        if e.src is not None:
            e.src = None
            self._resident_writing -= e.nbytes

    def _unpack(self, h: Any) -> torch.Tensor:
        if type(h) is _Same:
            if h.version is not None:
                _check_version(h.tensor, h.version, _version_of(h.tensor))
            return h.tensor
        self._counts["unpacks"] += 1
        self._poll_writes()
        if isinstance(h, _Kept):
            _check_version(h.tensor, h.version, h.tensor._version)
            self._counts["forwarded"] += 1  # served from memory, with no read
            if not h.triggered:
                h.triggered = True
                with self._lock:
                    self._read_ahead(h.forward, h.layer)
            return h.tensor
        _check_version(h, h.version, h.probe._version)
        e: _Entry = h.entry
        with self._lock:
            if self._h2d:
                self._poll_pending()  # unpins the slots copied to the GPU (frees released keys)
            if self._staging:
                self._stage_ready()
            if not h.unpacked:
                h.unpacked = True
                e.waiting -= 1
            if not e.triggered:
                for entry in self._by_layer.get((e.forward, e.layer), ()):
                    entry.triggered = True
                self._read_ahead(e.forward, e.layer)
            try:
                storage = self._restore(e)
            except SsdtierOSError as err:
                self._counts["failed_reads"] += 1
                raise type(err)(
                    err.errno,
                    f"a saved activation ({e.nbytes} bytes) could not be read back, so this backward "
                    f"cannot go on: {err.strerror}",
                    err.filename,
                ) from err
            e.hold = storage if e.waiting > 0 else None
        self._note_peak()
        out = torch.empty(0, dtype=h.dtype, device=e.device)
        # The restored storage may start a few bytes (a multiple of 64) before the data.
        out.set_(storage, h.offset + e.pad // h.dtype.itemsize, h.size, h.stride)
        return out.conj() if h.conj else out

    def _restore(self, e: _Entry) -> torch.UntypedStorage:
        src = e.gpu.untyped_storage() if e.gpu is not None else e.src
        if src is not None:
            # Its copy or write is still in flight (or failed): served from the source.
            self._counts["forwarded"] += 1
            e.pad = 0
            return src
        st = e.restored() if e.restored is not None else None
        if st is not None:
            self._counts["forwarded"] += 1
            if e.made is not None:
                self._use_on_current_stream(e, st)
            return st
        ahead = e.reading is not None  # read ahead (else read now, on demand)
        if not ahead:
            self._start_read(e)
        st, pad, ticket, from_host = e.reading
        e.reading = None
        if from_host:
            self._counts["forwarded"] += 1
        if ticket is not None and not ticket.done():
            t0 = time.perf_counter()
            ticket.wait()
            waited = time.perf_counter() - t0
            self._stall += waited
            if ahead:
                self._stall_ahead += waited
        elif ticket is not None:
            ticket.wait()  # raises the read's error, if any
        if st is None:  # CUDA
            staged, e.staged = e.staged, None
            if staged is not None:
                # Copied ahead on the prefetch stream: the compute stream waits for that copy.
                e.made = (staged[1], staged[2], [])
                st = staged[0].untyped_storage()  # tracked since it was staged
                self._use_on_current_stream(e, st)
            else:  # through a pinned slot, on the compute stream
                self._poll_pending()
                out, ev = self._restore_cuda(e)
                st = out.untyped_storage()
                self._track(st, e.nbytes)
                current = torch.cuda.current_stream(e.device)
                if ev is None:
                    ev = torch.cuda.Event()
                    ev.record(current)
                e.made = (ev, current, [current])
        e.restored = weakref.ref(st)
        e.pad = pad
        return st

    def _use_on_current_stream(self, e: _Entry, st: torch.UntypedStorage) -> None:
        """CUDA: before the current stream uses a restored storage, it waits for the copy
        that made it, and a block allocated for another stream is recorded as used here too,
        so the allocator does not reuse it before this stream is done with it."""
        assert e.made is not None
        ev, allocated, waited = e.made
        current = torch.cuda.current_stream(e.device)
        if current in waited:
            return
        current.wait_event(ev)
        waited.append(current)
        if current != allocated:
            torch.empty(0, dtype=torch.uint8, device=e.device).set_(st).record_stream(current)

    def _track(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """Count restored or read-ahead bytes as resident until their storage is freed."""
        self._resident_restored += nbytes
        # A weak reference with a callback (much cheaper than weakref.finalize); the
        # callback only runs while the reference lives, so it is held here until then.
        ref = weakref.ref(st, self._forget_restored)
        self._tracked[id(ref)] = (ref, nbytes)

    def _forget_restored(self, ref: weakref.ref) -> None:
        self._resident_restored -= self._tracked.pop(id(ref))[1]

    def _start_read(self, e: _Entry) -> None:
        """Begin bringing an entry back. On CPU the bytes go from NVMe straight into
        the page-aligned buffer that becomes the restored storage; the arena is not
        used, so read-ahead never evicts what is about to be needed."""
        native = self.store._native
        from_host = native.location(e.key)[0]
        if not e.cuda:
            # The entry starts `lead` bytes before the data (a zero-copy write covers whole pages).
            st, pad = _aligned_storage(e.lead + e.nbytes)
            self._track(st, e.nbytes)
            ticket = native.read_into(e.key, st.data_ptr() + pad, st.nbytes() - pad, st)
            e.reading = (st, pad + e.lead, ticket, from_host)
        else:
            e.reading = (None, 0, None if from_host else native.prefetch(e.key), from_host)

    def _read_ahead(self, forward: int, layer: int) -> None:
        """Entering a layer's backward: start reading the next layers' entries."""
        auto = self._ahead_auto
        now = time.perf_counter() if auto else 0.0
        if auto:
            self._trig.setdefault((forward, layer), now)
        for d in range(1, self._ahead + 1):
            for entry in self._by_layer.get((forward, layer - d), ()):
                entry.wanted = True
                if entry.reading is None and entry.gpu is None and entry.src is None and entry.restored is None:
                    self._start_read(entry)
                    ticket = entry.reading[2]  # set by _start_read
                    if auto and ticket is not None:
                        self._reads.setdefault((forward, layer - d), []).append((now, ticket))
                    if entry.cuda and not self._stage_off:
                        self._staging.append(entry)
        if self._staging:
            self._stage_ready()

    def _tune_ahead(self) -> None:
        """After a backward (``prefetch_layers = "auto"``): one layer more of read-ahead if it
        waited for a read the read-ahead started; one less once, for ``_ahead_patience``
        backwards in a row, every read would have finished a quarter of a layer's backward
        before it was needed even had it started one layer later. A step back up right after
        a step down doubles that patience."""
        with self._lock:  # a backward on another thread may still be adding to them
            trig, reads = self._trig, self._reads
            self._trig, self._reads = {}, {}
        # Only a read-ahead that came late says more read-ahead would help (the first offloaded
        # layer of a backward with no kept layer above it is read on demand whatever the depth).
        stalled = self._stall_ahead > self._ahead_stall0
        self._ahead_stall0 = self._stall_ahead
        d = self._ahead
        if stalled:
            self._ahead_clean = 0
            if self._ahead_lowered:
                self._ahead_patience = min(self._ahead_patience * 2, 64)
            self._ahead_lowered = False
            if d < _AHEAD_MAX:
                self._set_ahead(d + 1, "the backward waited for a read")
            return
        self._ahead_lowered = False
        if d <= 1:
            return
        judged = False
        for (f, j), started in reads.items():
            # Its backward began at `use`; with one layer less its reads would have begun when
            # layer j + d - 1's did (`later`), not when they did.
            use, later = trig.get((f, j)), trig.get((f, j + d - 1))
            if use is None or later is None:
                continue
            ends = [t.seconds for _, t in started]
            done = max(s + (e if e is not None else math.inf) for (s, _), e in zip(started, ends, strict=True))
            shift = max(0.0, later - min(s for s, _ in started))
            spare = 0.25 * (use - later) / (d - 1)
            if done + shift > use - spare:
                self._ahead_clean = 0
                return
            judged = True
        if judged:
            self._ahead_clean += 1
            if self._ahead_clean >= self._ahead_patience:
                self._ahead_clean = 0
                self._ahead_lowered = True
                self._set_ahead(d - 1, "every read would still have been in time")

    def _set_ahead(self, n: int, why: str) -> None:
        log.info("ssdtier: reading %d layer(s) ahead in backward, was %d: %s", n, self._ahead, why)
        self._ahead = n

    def _release(self, e: _Entry) -> None:
        with self._lock:
            e.refs -= 1
            if e.refs:
                return
            if e.event is not None:
                # A copy into its arena slot is in flight: the slot must not be reused under it.
                e.event.synchronize()
                self._pending.remove(e)
                e.event = None
                self._resident_gpu -= e.nbytes
            elif e.gpu is not None:  # its copy was lost (_poll_pending): the source served it
                self._resident_gpu -= e.nbytes
            if e.staged is not None:
                # Copied ahead and never unpacked: its block goes back to the compute stream's
                # pool, so that stream must not reuse it before the copy into it is done.
                e.staged[2].wait_event(e.staged[1])
                e.staged = None
            e.gpu = None
            e.restored = None
            e.made = None
            e.hold = None
            if e.reading is not None and e.reading[2] is not None:
                # The buffer must outlive its read. A read that failed is of no concern here:
                # nobody will unpack this entry (raising would skip freeing it, from __del__).
                with contextlib.suppress(SsdtierError):
                    e.reading[2].wait()
            e.reading = None
            if e.dkey is not None:
                hit = self._dedup.get(e.dkey)
                if hit is not None and hit[2] is e:
                    del self._dedup[e.dkey]
            group = self._by_layer.get((e.forward, e.layer))
            if group is not None:
                group.pop(e, None)
                if not group:
                    del self._by_layer[(e.forward, e.layer)]
            self._live -= 1
            if e.ticket is None:
                self._drop_src(e)
                if e.key is not None and any(k == e.key for _, k in self._h2d):
                    # A copy out of its arena slot is still running: the slot stays pinned,
                    # and the key is freed once that copy is done (_poll_pending).
                    self._free_later.add(e.key)
                else:
                    self._free_key(e.key)
            # Else its write is in flight: the source is held and the key freed when it is done.
            if self._h2d:
                self._poll_pending()  # so deferred keys go soon after the backward, not next forward
            if self._closed and self._live == 0:
                self._close_store()

    # ---------------------------------------------------------------- CUDA staging

    def _streams(self, device: torch.device) -> tuple[Any, Any]:
        """The device's offload stream (copies to the arena) and prefetch stream (copies back)."""
        s = self._cuda.get(device)
        if s is None:
            if not self._registered and self.store.arena is not None:
                self._register_arena()
            s = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self._cuda[device] = s
        return s

    def _register_arena(self) -> None:
        arena = self.store.arena
        assert arena is not None
        rc = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
        self._registered = _cuda_ok(rc)
        if not self._registered:
            _clear_cuda_error()
            _warn(f"cudaHostRegister of the host arena failed ({rc}); copies will be synchronous")

    def _offload_cuda(self, whole: torch.Tensor, nbytes: int, f: _Fwd) -> _Entry:
        native = self.store._native
        stream = self._streams(whole.device)[0]
        self._poll_pending()  # committed slots can be evicted to make room
        key, off = native.reserve(nbytes)
        entry = _Entry(key, nbytes, whole.device, True, f.forward, f.tag)
        try:
            if off is None:
                # Bigger than the arena: a synchronous copy, streamed to NVMe. The host copy is
                # held by name: its bytes must outlive the write.
                if nbytes:
                    host = whole.cpu()
                    native.write_staged(key, host.data_ptr(), host)
                return entry
            entry.wrote = whole.data_ptr()
            slot = self.store._slot(off, nbytes, torch.uint8, torch.Size([nbytes]))
            stream.wait_stream(torch.cuda.current_stream(whole.device))
            with torch.cuda.stream(stream):
                slot.copy_(whole, non_blocking=True)
                entry.event = torch.cuda.Event()
                entry.event.record(stream)
        except BaseException:
            if off is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()  # a copy into the slot may be queued: it ends first
            native.free(key)
            raise
        # Hold the source until the copy is done: its memory is not reused before.
        entry.gpu = whole
        self._resident_gpu += nbytes
        self._pending.append(entry)
        self._poll_pending()
        return entry

    def _poll_pending(self) -> None:
        """Commit the arena slots whose device-to-host copy is complete (dropping their GPU
        sources), and unpin the slots whose host-to-device copy is complete."""
        native = self.store._native
        while self._h2d and self._h2d[0][0].query():
            key = self._h2d.popleft()[1]
            native.release(key)
            if key in self._free_later and all(k != key for _, k in self._h2d):
                self._free_later.discard(key)
                self._free_key(key)
        while self._pending and self._pending[0].event.query():
            e = self._pending.popleft()
            e.event = None
            failed = self._moved(e, e.gpu.untyped_storage()) if e.refs else None
            if not e.refs:
                continue  # released meanwhile (a collection in _moved): its key is freed already
            if failed is not None:
                self._copy_lost(e, failed)  # e.gpu stays (resident) and serves the unpack
                continue
            native.commit(e.key)
            self._resident_gpu -= e.nbytes
            e.gpu = None

    def _stage_ready(self) -> None:
        """Copy to the GPU, on the prefetch stream, the read-ahead entries now in the arena."""
        waiting = []
        for e in self._staging:
            if self._stage_off:
                break  # out of GPU memory (_stage_cuda): the rest are copied at their unpack
            reading = e.reading
            if reading is None or e.key is None or e.staged is not None:
                continue  # unpacked, released, or failed meanwhile
            if reading[2] is not None and not reading[2].done():
                waiting.append(e)
                continue
            self._stage_cuda(e)
        self._staging = waiting

    def _stage_cuda(self, e: _Entry) -> None:
        native = self.store._native
        assert e.key is not None
        if not native.location(e.key)[0]:
            return  # not in the arena (no room for the read, or it failed): the unpack reads it
        compute = torch.cuda.current_stream(e.device)
        prefetch = self._streams(e.device)[1]
        off = native.acquire(e.key)
        if off is None:
            return
        try:
            out, ev = self._copy_from_slot(e, off, prefetch)
        except torch.cuda.OutOfMemoryError:
            # Reading ahead is a bet: the unpack copies it on demand (the slot was released). Each
            # failed allocation empties the allocator's cache, so no more copies ahead until the
            # next forward.
            self._stage_off = True
            return
        e.staged = (out, ev, compute)
        self._track(out.untyped_storage(), e.nbytes)
        self._counts["copied_ahead"] += 1

    def _copy_from_slot(self, e: _Entry, off: int, stream: Any) -> tuple[torch.Tensor, Any]:
        """Copy an entry's acquired arena slot to new GPU bytes (allocated for the current
        stream) on ``stream``; returns them and the copy's event. The slot stays pinned until
        the copy has read it (_poll_pending unpins it); on failure it is released at once."""
        try:
            out = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
            current = torch.cuda.current_stream(e.device)
            if stream != current:
                # The block is allocated for the current stream, which uses it: the copy waits for
                # the work queued there, which may still use the block's previous tenant, and which
                # includes the fill of new memory that deterministic mode adds to torch.empty.
                stream.wait_stream(current)
            with torch.cuda.stream(stream):
                out.copy_(self.store._slot(off, e.nbytes, torch.uint8, torch.Size([e.nbytes])), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
        except BaseException:
            self.store._native.release(e.key)
            raise
        self._h2d.append((ev, e.key))
        return out, ev

    def _restore_cuda(self, e: _Entry) -> tuple[torch.Tensor, Any]:
        """Copy an entry back to the GPU on the current stream; returns it and the copy's
        event (None: a synchronous copy from pageable memory)."""
        native = self.store._native
        # Not in the arena (no read-ahead brought it, or it was skipped for want of room):
        # acquire() or read_staged() reads it now, and the backward waits; count it as stall.
        resident = native.location(e.key)[0]
        t0 = time.perf_counter()
        off = native.acquire(e.key)
        if off is None:
            host = torch.empty(e.nbytes, dtype=torch.uint8)
            native.read_staged(e.key, host.data_ptr(), e.nbytes, host)
            self._stall += time.perf_counter() - t0
            return host.to(e.device), None
        if not resident:
            self._stall += time.perf_counter() - t0
        return self._copy_from_slot(e, off, torch.cuda.current_stream(e.device))

    # ---------------------------------------------------------------- adaptive plan

    def _calibrate(self) -> tuple[float, float]:
        """The store's write and read bandwidth, measured at attach on a few blocks, through a
        store of its own on the same directories: stats() counts activations only."""
        chunk = 8 << 20
        n = 4
        cfg = self.config.replace(
            host__capacity=min(self.config.host.capacity, 2 * chunk),
            nvme=[{"path": path, "capacity": n * chunk} for path, _ in self.store._devices],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SsdtierWarning)  # said already, by the main store
            store = TieredStore(cfg)
        with store:
            native = store._native
            src = torch.zeros(chunk, dtype=torch.uint8)
            t0 = time.perf_counter()
            keys = [store.put(src) for _ in range(n)]
            for k in keys:
                store.evict(k)
            write = n * chunk / max(time.perf_counter() - t0, 1e-9)
            bufs = [_aligned_storage(chunk) for _ in keys]
            t0 = time.perf_counter()
            tickets = [
                native.read_into(k, b.data_ptr() + pad, b.nbytes() - pad, b)
                for k, (b, pad) in zip(keys, bufs, strict=True)
            ]
            for t in tickets:
                t.wait()
            read = n * chunk / max(time.perf_counter() - t0, 1e-9)
        log.info("ssdtier: measured the store: write %.0f MB/s, read %.0f MB/s", write / 1e6, read / 1e6)
        return write, read

    def _replan(self) -> None:
        """At the start of an iteration: plan from the last one's profile, with stall feedback."""
        if not self._prof_fwd:
            return
        stall = self._stall - self._iter_stall0 + (self._store_wait() - self._iter_wait0)
        fwd_total = sum(self._prof_fwd.values())
        if self._plan is not None:
            if stall > 0.05 * 3 * fwd_total:
                # Backward (about 2x forward) or forward waited on I/O: keep one more layer.
                if self._retrying:
                    # Offloading one more layer failed again: wait twice as long before the next try.
                    self._patience = min(self._patience * 2, 64)
                self._min_keep = min(self._n_layers, self._plan.keep_last + 1)
                self._clean_iters = 0
                self._retrying = False
            else:
                self._clean_iters += 1
                self._retrying = False
                if self._clean_iters >= self._patience and self._min_keep > 0:
                    # The disk kept up for a while: try offloading one more layer.
                    self._min_keep -= 1
                    self._clean_iters = 0
                    self._retrying = True
        layers = [
            LayerProfile(
                i,
                self._prof_bytes.get(i + 1, 0),
                self._prof_fwd.get(i + 1, 0.0),
                2 * self._prof_fwd.get(i + 1, 0.0),
            )
            for i in range(self._n_layers)
        ]
        assert self._bw is not None
        plan = make_plan(layers, self._bw[0], self._bw[1], self._budget, self._min_keep)
        if self._plan is None or plan.keep_last != self._plan.keep_last:
            log.info("%s", plan.table())
        self._plan = plan
        self._layers_kept = plan.keep_last
        n = self._n_layers
        self._keep_from = n - plan.keep_last + 1 if plan.keep_last else n + 2
        self._prof_fwd.clear()
        self._prof_bytes.clear()
        self._iter_stall0 = self._stall
        self._iter_wait0 = self._store_wait()

    def plan(self) -> Plan | None:
        """The adaptive plan in force (per layer: bytes, time, decision and why); None before one is made."""
        return self._plan

    # ---------------------------------------------------------------- misc

    def _free_key(self, key: int | None) -> None:
        store = self.store
        if key is None or store._closed:
            return
        store._meta.pop(key, None)
        try:
            store._native.free(key)
        except SsdtierError:
            pass

    def _note_peak(self) -> None:
        resident = (
            self._resident_kept
            + self._resident_gpu
            + self._resident_writing
            + self._resident_restored
            + self.store._native.host_used
        )
        if resident > self._peak:
            self._peak = resident

    def _warn_write(self, err: Exception) -> None:
        if not getattr(self, "_warned_write", False):
            self._warned_write = True
            _warn(f"writing an activation to NVMe failed ({err}); it stays in memory")

    def _warn_full(self, e: Exception) -> None:
        if not getattr(self, "_warned_full", False):
            self._warned_full = True
            _warn(f"{e}; activations stay in memory until space frees up")

    def stats(self) -> OffloadStats:
        """Counters so far; see :class:`OffloadStats`."""
        st = self.store.stats()
        return OffloadStats(
            bytes_written_nvme=st.nvme_bytes_written,
            bytes_read_nvme=st.nvme_bytes_read,
            peak_resident_bytes=self._peak,
            stall_seconds=self._stall,
            layers_offloaded=self._n_layers - self._layers_kept,
            layers_kept=self._layers_kept,
            prefetch_layers=self._ahead,
            plan=self._plan,
            store=st,
            **self._counts,
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

    def detach(self) -> None:
        """Remove every hook and restore the module; the store closes once no graph holds an entry."""
        if self._closed:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if attached(self.model) is self:
            del _ATTACHED[self.model]
        if any(self._tls.fwd.pushed):
            _drop_interrupted(self._tls.fwd, "was not finished at detach()")
        self._closed = True
        with self._lock:
            if self._live == 0:
                self._close_store()

    def _close_store(self) -> None:
        for ev, _ in self._h2d:  # copies out of the arena still running (their keys freed later)
            ev.synchronize()
        self._h2d.clear()
        self._free_later.clear()
        if self._registered and self.store.arena is not None:
            rc = torch.cuda.cudart().cudaHostUnregister(self.store.arena.data_ptr())
            if not _cuda_ok(rc):
                _clear_cuda_error()
                _warn(f"cudaHostUnregister of the host arena failed ({rc})")
            self._registered = False
        try:
            self.store.close()  # waits for every write, so the sources still held can go
        except SsdtierOSError as err:
            # A write that failed earlier (warned of then); every entry is gone by now, so
            # nothing is lost, and the store is closed all the same.
            log.debug("ssdtier: closing the store: %s", err)
        for e in self._writing:
            e.ticket = None
            self._drop_src(e)
        self._writing.clear()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"<Offloader {type(self.model).__name__} layers={self.layers_path!r} store={self.store!r}>"


class _NoOffload(threading.local):
    depth = 0  # no_offload() blocks this thread is in


_NO_OFFLOAD = _NoOffload()


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """Saved tensors made inside the block (on this thread) stay in memory, for every attached
    model: for a region of a forward that is cheap to keep and costly to move.

    Example:
        >>> with ssdtier.no_offload():
        ...     logits = self.lm_head(h)
    """
    _NO_OFFLOAD.depth += 1
    try:
        yield
    finally:
        _NO_OFFLOAD.depth -= 1


def _excluded_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[nn.Module]:
    """The modules that ``policy.exclude`` names (by qualified name or glob pattern)."""
    if not patterns:
        return []
    names = dict(model.named_modules(remove_duplicate=False))
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ConfigError(
            f"policy.exclude: {', '.join(map(repr, unmatched))} names no module of the "
            f"{type(model).__name__} (qualified names such as {next(iter(n for n in names if n), '?')!r})"
        )
    found = {id(m): m for n, m in names.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    return list(found.values())


# Each model's offloader, weakly both ways: nothing of ssdtier's is stored in the model.
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Offloader]] = weakref.WeakKeyDictionary()


def attached(model: nn.Module) -> Offloader | None:
    """The offloader attached to ``model``, or None."""
    ref = _ATTACHED.get(model)
    return ref() if ref is not None else None


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
