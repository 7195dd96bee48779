"""What each part of the offloader uses of it, one protocol per part: a part reads and tests
alone, and imports nothing of offloader.py. tests/test_shape.py holds each to its part."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import threading

    import torch
    from torch import nn

    from ..config import Config
    from ..errors import SsdtierError
    from ..plan import Action
    from ..store import ByteStore
    from ._util import Once
    from .adaptive import Adaptive
    from .cpu import CpuTransport
    from .cuda import CudaTransport
    from .cufile import CuFile
    from .entry import Entry
    from .forward import Fwd, PerThread
    from .registry import Entries, Params, StorageKey
    from .stats import Resident


class StatsOwner(Protocol):
    res: Resident


class EntryOwner(StatsOwner, Protocol):
    """The handles' (entry.py): kept storages counted once, offloaded entries released."""

    _kept_st: dict[StorageKey, list[None]]

    def _release(self, e: Entry) -> None: ...


class TransportOwner(StatsOwner, Protocol):
    """Both transports': the store, the counts, and a copy out that did not hold."""

    store: ByteStore
    c: dict[str, int]

    def _free_key(self, key: int | None) -> None: ...

    @staticmethod
    def _moved(e: Entry, src: torch.UntypedStorage, wrote: int) -> SsdtierError | None: ...

    def _copy_lost(self, e: Entry, err: SsdtierError) -> None: ...


class CudaOwner(TransportOwner, Protocol):
    auto_on_cpu: bool
    once: Once

    @property
    def uses_cufile(self) -> bool: ...

    def short(self, nbytes: int) -> int: ...


class CpuOwner(TransportOwner, Protocol):
    config: Config
    cuda: CudaTransport  # cuFile's reads allocate as its copies ahead do
    _lock: threading.RLock

    def drop_source(self, e: Entry) -> None: ...

    def short(self, nbytes: int) -> int: ...


class ReadAheadOwner(StatsOwner, Protocol):
    entries: Entries
    cpu: CpuTransport
    cuda: CudaTransport
    _lock: threading.RLock

    def room(self, ahead: bool = False) -> int | None: ...

    def _start_read(self, e: Entry) -> None: ...


class HookOwner(Protocol):
    """What runs inside the model's forward needs: this thread's forward, the plan, and
    whether the saved-tensor hooks on top are this offloader's."""

    _tls: PerThread
    adaptive: Adaptive | None

    def _pack(self, t: torch.Tensor) -> Any: ...


class RecomputeOwner(HookOwner, Protocol):
    _params: Params
    res: Resident

    def _unpack(self, h: Any) -> torch.Tensor: ...


class LayersOwner(Protocol):
    model: nn.Module
    n_layers: int
    _off_tag: list[bool]


class ForwardOwner(HookOwner, LayersOwner, Protocol):
    _hooks: torch.autograd.graph.saved_tensors_hooks
    cpu: CpuTransport
    cuda_ok: bool
    traced: bool

    def wake(self, f: Fwd) -> None: ...


class AdaptiveOwner(StatsOwner, LayersOwner, Protocol):
    config: Config
    c: dict[str, int]  # counters of stats()
    store: ByteStore
    cpu: CpuTransport
    cuda: CudaTransport
    actions: tuple[Action, ...]
    _budget: int | None
    _gds: CuFile | None
    _params: Params
    cuda_ok: bool
    once: Once

    def set_actions(self, actions: tuple[Action, ...]) -> None: ...

    def device_budget(self, budget: int | None) -> None: ...

    def landed(self) -> None: ...

    def store_wait(self) -> float: ...

    def io_wait(self) -> float: ...
