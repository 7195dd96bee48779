"""`TieredStore`: tensors in, tensors out, through the host arena and NVMe files."""

from __future__ import annotations

import ctypes
import logging
import shutil
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from . import _native
from .config import Config, resolve_config
from .errors import ConfigError, InvalidUseError, SsdtierError, StoreClosedError, UnknownKeyError, warn, where
from .mounts import existing
from .paths import check_paths, remove_stale_links, space_problems
from .ram import available
from .sizes import GiB, format_size

__all__ = ["ByteStore", "StoreStats", "TieredStore"]

log = logging.getLogger("ssdtier")

# Notices that mean "this works, but not the fast way": warned about, not just logged.
_WARN_MARKERS = ("O_DIRECT", "O_TMPFILE", "io_uring is not available", "cannot register", "huge_pages")


@dataclass(frozen=True)
class StoreStats:
    """Traffic per tier and direction, space used, and time spent waiting on I/O.

    Byte counts of NVMe traffic include the padding of each entry to 4 KiB. "staged"
    transfers stream through a small staging buffer (tensors bigger than the arena);
    ``device_high_water`` is how far each file's space has reached (the file itself is
    grown a step ahead). ``quarantined_bytes`` are never reused because an I/O engine
    failed while the kernel held them; ``failure`` says why the store then refuses work.
    """

    host_bytes_in: int
    host_bytes_out: int
    host_puts: int
    host_gets: int
    nvme_bytes_written: int
    nvme_bytes_read: int
    nvme_write_ops: int
    nvme_read_ops: int
    staged_puts: int
    staged_gets: int
    zero_copy_puts: int
    evictions: int
    prefetches: int
    prefetch_skipped: int
    host_hits: int
    nvme_hits: int
    wait_seconds: float
    host_used: int
    host_capacity: int
    host_peak: int
    nvme_used: int
    nvme_capacity: int
    nvme_peak: int
    entries: int
    device_used: list[int]
    device_bytes_written: list[int]
    device_bytes_read: list[int]
    device_file_size: list[int]
    device_high_water: list[int]
    quarantined_bytes: int
    failure: str | None

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> StoreStats:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


# A step at least a device's capacity allocates all of it at once.
_PREALLOC_ALL = 1 << 62
SLOW_ARENA = 8 * GiB  # arenas this large take seconds to register: said before


def say_slow(text: str) -> None:
    """Before work that takes seconds: logged where the log shows it, else printed to stderr
    (a silent pause at attach looks like a hang)."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(text)
    else:
        print(text, file=sys.stderr, flush=True)


def _devices(cfg: Config) -> list[tuple[str, int]]:
    """(directory, capacity) per NVMe device; the default directory when none is configured."""
    paths = check_paths(cfg)
    if cfg.nvme:
        for msg, fatal in space_problems(cfg, paths):
            if fatal:
                raise ConfigError(msg)
            warn(msg)
        return [(p, n.capacity) for p, n in zip(paths, cfg.nvme, strict=True)]
    return [(paths[0], default_capacity(paths[0]))]


def default_capacity(path: str, ranks: int = 1) -> int:
    """A directory's capacity when none is given: never more than the file system has, 90% of
    what is free now, at most 64 GiB, shared by ``ranks`` processes."""
    free = shutil.disk_usage(existing(path)).free
    return max(min(64 * GiB, free * 9 // 10) // ranks >> 20 << 20, 1 << 20)


class ByteStore:
    """The store as keys and bytes: the native store, a uint8 view of its host arena, and the
    configuration it was made from. :class:`TieredStore` adds tensors on top of it; the
    offloader, which manages its tensors itself, uses it as it is.

    Args:
        config: as for :class:`TieredStore`.
        **overrides: config keys to override, e.g. ``host__capacity="64MiB"``.
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        cfg = resolve_config(config, **overrides)
        self.config = cfg = replace(cfg, host=cfg.host.sized())  # attach sizes "auto" for a GPU
        self._devices = _devices(cfg)
        if cfg.io.fixed_buffers and cfg.host.capacity >= SLOW_ARENA:
            # Registering it with io_uring faults in every page: about 0.3 s per GiB, on one thread.
            say_slow(f"ssdtier: mapping and registering a {format_size(cfg.host.capacity)} host arena...")
        for path, _ in self._devices:
            remove_stale_links(path)  # a store file that outlived a crash under cuFile
        t0 = time.perf_counter()
        self._native = self._open(cfg)
        for notice in self._native.take_notices():
            if any(m in notice for m in _WARN_MARKERS):
                warn(notice)  # at the user's line that made the store
            else:
                log.info("ssdtier: %s", notice)
        log.info(
            "ssdtier: %s backend, host arena %s, NVMe %s; ready in %.1f s",
            self._native.backend,
            format_size(cfg.host.capacity),
            ", ".join(f"{p} ({format_size(c)})" for p, c in self._devices),
            time.perf_counter() - t0,
        )
        n = self._native.arena_nbytes
        self._arena: torch.Tensor | None = None
        if n:
            buf = (ctypes.c_uint8 * n).from_address(self._native.arena_address)
            # Views of the arena keep the native store, and so the mapping, alive.
            buf._ssdtier_store = self._native  # type: ignore[attr-defined]
            self._arena = torch.frombuffer(buf, dtype=torch.uint8)
        self._closed = False

    def _open(self, cfg: Config) -> Any:
        try:
            return _native.Store(
                self._devices,
                cfg.host.capacity,
                backend="auto" if cfg.io.backend == "cufile" else cfg.io.backend,  # cufile: the offloader's
                queue_depth=cfg.io.queue_depth,
                block_size=cfg.io.block_size,
                direct=cfg.io.direct,
                fixed_buffers=cfg.io.fixed_buffers,
                threads=cfg.io.threads,
                eviction=cfg.policy.eviction,
                prealloc_step=_PREALLOC_ALL if cfg.io.preallocate == "all" else cfg.io.preallocate,
                throttle_bytes_per_sec=cfg.io.throttle or 0,
                huge_pages=cfg.host.huge_pages,
            )
        except InvalidUseError as e:
            if "cannot map a host arena" not in str(e):
                raise
            left = available()
            fits = ""
            if left is not None:
                fits = f"; {format_size(left.bytes)} is left ({left.bound}): at most {format_size(left.bytes * 3 // 4)}"
            raise ConfigError(
                f"{where(cfg.source, 'host.capacity')} = {format_size(cfg.host.capacity)}: {e}{fits}"
            ) from None

    # ---------------------------------------------------------------- properties

    @property
    def backend(self) -> str:
        """``"io_uring"`` or ``"posix"``: the engine in use."""
        return self._native.backend

    @property
    def direct(self) -> bool:
        """True when every NVMe file uses O_DIRECT."""
        return all(self._native.direct)

    @property
    def fixed_buffers(self) -> bool:
        """True when the arena is registered with io_uring as fixed buffers."""
        return self._native.fixed_buffers

    @property
    def arena(self) -> torch.Tensor | None:
        """The whole host arena as a uint8 tensor (for cudaHostRegister); None without one."""
        return self._arena

    @property
    def native(self) -> _native.Store:
        """The native store (``ssdtier._native.Store``): keys, arena offsets and tickets."""
        return self._native

    @property
    def devices(self) -> list[tuple[str, int]]:
        """(directory, capacity) of each NVMe device."""
        return list(self._devices)

    @property
    def closed(self) -> bool:
        return self._closed

    def slot(self, off: int, nbytes: int) -> torch.Tensor:
        """The arena's bytes ``[off, off + nbytes)`` as a uint8 tensor (an acquired or reserved slot)."""
        arena = self._arena
        if arena is None:
            raise StoreClosedError("the store is closed")  # by a close() that raced this call
        return arena[off : off + nbytes]

    def discard(self, key: int) -> None:
        """Forget ``key`` without waiting: its space comes back now, or when a transfer still
        in flight ends. Nothing happens if the store is closed or no longer has it."""
        if self._closed:
            return
        try:  # not contextlib.suppress: this runs for every saved activation
            self._native.discard(key)
        except SsdtierError:
            pass

    def flush(self) -> None:
        """Wait for every pending write; raises the first error of a write nobody waited on."""
        self._check_open()
        self._native.flush()

    def stats(self) -> StoreStats:
        """Counters of traffic and space; see :class:`StoreStats`."""
        return StoreStats._from_native(self._native.stats())

    def close(self) -> None:
        """Refuse new calls, wait for transfers in flight and release the files. Idempotent.
        A call that raced it gets its bytes or :class:`StoreClosedError`."""
        if self._closed:
            return
        self._closed = True
        try:
            self._native.close()
        finally:
            self._forget()

    def _forget(self) -> None:
        # Calls under way may still use the arena until the native store has drained.
        self._arena = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def __enter__(self) -> ByteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<ByteStore {self.backend} host={format_size(self.config.host.capacity)} {state}>"


class TieredStore(ByteStore):
    """A store of tensors over a pinned-host-memory tier and NVMe files.

    ``put`` copies a tensor into the host arena and returns at once; under arena
    pressure (or on ``evict``) the bytes go to NVMe, written with O_DIRECT
    through io_uring. ``get`` returns an equal tensor (same dtype, shape and
    device, contiguous), reading it back if needed.

    Args:
        config: a path to a TOML file, a dict, a :class:`~ssdtier.Config`, or
            None (``SSDTIER_CONFIG`` if set, else defaults: a 1 GiB arena and the
            directory from ``SSDTIER_DIR`` or ``~/.cache/ssdtier``).
        **overrides: config keys to override, e.g. ``host__capacity="64MiB"``.

    Raises:
        ConfigError: bad configuration (names the key and the source).
        OSError: a directory cannot be created or opened (``PermissionError``...).

    Example:
        >>> with ssdtier.TieredStore({"host": {"capacity": "64MiB"}}) as store:
        ...     key = store.put(torch.randn(1024, 1024))
        ...     store.evict(key)          # force it to NVMe
        ...     x = store.get(key)
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self._meta: dict[int, tuple[torch.Size, torch.dtype, torch.device]] = {}

    # ---------------------------------------------------------------- API

    def put(self, tensor: torch.Tensor) -> int:
        """Store a copy of ``tensor`` and return its key.

        Any dtype, shape and strides; the tensor may be on any device and is not
        kept. Returns once the bytes are in the host arena (or, for a tensor
        bigger than the arena, on NVMe).

        Raises:
            TypeError: not a plain strided tensor.
            OutOfSpaceError: the host arena and every NVMe device are full.
        """
        self._check_open()
        t = _plain(tensor)
        nbytes = t.numel() * t.element_size()
        # The raw bytes of a lazily conjugated or negated view are not its values: copy_ below
        # resolves them.
        if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            key = self._native.put_from(t.data_ptr(), nbytes, t)  # one copy, in Rust
            self._meta[key] = (t.shape, t.dtype, t.device)
            return key
        key, off = self._native.reserve(nbytes)
        try:
            if off is not None:
                self._slot(off, nbytes, t.dtype, t.shape).copy_(t)
                self._native.commit(key)
            elif nbytes:
                src = t.detach().to("cpu").contiguous()
                self._native.write_staged(key, src.data_ptr(), src)
        except BaseException:
            self._native.free(key)
            raise
        self._meta[key] = (t.shape, t.dtype, t.device)
        return key

    def get(self, key: int) -> torch.Tensor:
        """A new contiguous tensor equal to the one put under ``key`` (same dtype, shape, device)."""
        self._check_open()
        shape, dtype, device = self._entry(key)
        out = torch.empty(shape, dtype=dtype, device=device)
        nbytes = out.numel() * out.element_size()
        off = self._native.acquire(key)
        if off is not None:
            try:
                out.copy_(self._slot(off, nbytes, dtype, shape))
            finally:
                self._native.release(key)
        elif nbytes:
            host = out if out.device.type == "cpu" else torch.empty(shape, dtype=dtype)
            self._native.read_staged(key, host.data_ptr(), nbytes, host)
            if host is not out:
                out.copy_(host)
        return out

    def prefetch(self, key: int) -> _native.Ticket:
        """Start reading ``key`` back into the host arena; returns a ticket (``done()``, ``wait()``).

        Best effort: when the arena has no room that can be made without waiting, nothing is read.
        """
        self._check_open()
        self._entry(key)
        return self._native.prefetch(key)

    def evict(self, key: int) -> None:
        """Write ``key``'s bytes to NVMe (if not there yet) and release its arena slot. Blocks."""
        self._check_open()
        self._entry(key)
        self._native.evict(key)

    def free(self, key: int) -> None:
        """Forget ``key`` and give its space back."""
        self._check_open()
        self._entry(key)
        self._native.free(key)
        del self._meta[key]

    def location(self, key: int) -> tuple[bool, bool]:
        """(in the host arena, on NVMe) for ``key``."""
        self._check_open()
        self._entry(key)
        return self._native.location(key)

    def _forget(self) -> None:
        super()._forget()
        self._meta.clear()

    def __enter__(self) -> TieredStore:
        return self

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._meta)} entries"
        return f"<TieredStore {self.backend} host={format_size(self.config.host.capacity)} {state}>"

    # ---------------------------------------------------------------- helpers

    def _entry(self, key: int) -> tuple[torch.Size, torch.dtype, torch.device]:
        try:
            return self._meta[key]
        except KeyError:
            self._check_open()  # cleared by a close() that raced this call
            raise UnknownKeyError(f"unknown key {key!r} (freed already, or never put)") from None

    def _slot(self, off: int, nbytes: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        return self.slot(off, nbytes).view(dtype).view(shape)


def _plain(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_nested:
        raise TypeError(f"only strided tensors can be stored, got layout {tensor.layout}")
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise TypeError(f"tensor subclasses cannot be stored, got {type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise TypeError("meta tensors have no data to store")
    if tensor.is_quantized:
        raise TypeError("quantized tensors cannot be stored (their scale and zero point are not in their bytes)")
    if tensor._is_zerotensor():
        # No storage (its data pointer is 0): what is stored is its value, zeros.
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return tensor.detach()
