"""Configuration objects, their validation and TOML loading.

A configuration has four parts, mirroring the TOML tables of a config file::

    [host]            # pinned host-memory tier
    capacity = "8GiB"

    [[nvme]]          # one table per NVMe directory (optional)
    path = "/mnt/nvme0/ssdtier"
    capacity = "256GiB"

    [io]
    backend = "io_uring"

    [policy]
    prefetch_layers = 3

Importing this module is cheap: it does not import torch and does not touch the
filesystem.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar

from .errors import ConfigError, bad_value, warn, where
from .sizes import GiB, KiB, MiB, TiB, exact_size, format_size, parse_value

ARENA_OFF_GPU = 1 * GiB  # host.capacity "auto" where the arena is not pinned for a GPU

__all__ = [
    "Config",
    "HostConfig",
    "IoConfig",
    "NvmeConfig",
    "PolicyConfig",
    "load_config",
    "resolve_config",
]

# ---------------------------------------------------------------------------
# Field checkers
# ---------------------------------------------------------------------------

# (source, key prefix) of the table being built; set by from_dict() so that the
# dataclasses' own validation can name the file and e.g. "nvme[1]".
_LOCATION: ContextVar[tuple[str | None, str | None]] = ContextVar("ssdtier_config_location", default=(None, None))


@contextmanager
def _located(source: str | None, prefix: str | None) -> Iterator[None]:
    token = _LOCATION.set((source, prefix))
    try:
        yield
    finally:
        _LOCATION.reset(token)


_Checker = Callable[[Any, str, "str | None"], Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_range(lo: int, hi: int | None = None) -> _Checker:
    expected = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"

    def check(value: Any, key: str, source: str | None) -> int:
        if not _is_int(value):
            bad_value(source, key, value, expected, show_type=True)
        if value < lo or (hi is not None and value > hi):
            bad_value(source, key, value, expected)
        return value

    return check


def _size_range(
    lo: int,
    hi: int | None = None,
    *,
    power_of_two: bool = False,
    optional: bool = False,
) -> _Checker:
    if hi is not None:
        expected = f"a size between {format_size(lo)} and {format_size(hi)}"
    else:
        expected = f"a size >= {format_size(lo)}"
    if power_of_two:
        expected = "a power-of-two " + expected[2:]

    def check(value: Any, key: str, source: str | None) -> int | None:
        if value is None and optional:
            return None
        n = parse_value(value, key, source)
        bad = n < lo or (hi is not None and n > hi)
        if power_of_two and n & (n - 1):
            bad = True
        if bad:
            hint = "" if _is_int(value) else f" ({n} bytes)"
            bad_value(source, key, value, expected, hint=hint)
        return n

    return check


_ANY_SIZE = _size_range(0)


def _preallocate(value: Any, key: str, source: str | None) -> int | str:
    if value == "all" and isinstance(value, str):
        return value
    return _ANY_SIZE(value, key, source)  # type: ignore[return-value]


def _host_capacity(value: Any, key: str, source: str | None) -> int | str:
    if value == "auto" and isinstance(value, str):
        return value
    try:
        return _size_range(0, TiB)(value, key, source)  # type: ignore[return-value]
    except ConfigError:
        if isinstance(value, str) and not value.strip()[:1].isdigit():  # a word: "atuo"
            bad_value(source, key, value, "'auto' or a size such as '8GiB'")
        raise


def _device_budget(value: Any, key: str, source: str | None) -> int | str | None:
    if value == "auto" and isinstance(value, str):
        return value
    try:
        return _size_range(0, optional=True)(value, key, source)
    except ConfigError:
        bad_value(source, key, value, "'auto' or a size such as '20GiB'", show_type=not isinstance(value, str))


def _bool(value: Any, key: str, source: str | None) -> bool:
    if not isinstance(value, bool):
        bad_value(source, key, value, "true or false (a boolean)", show_type=True)
    return value


def _choice(*options: str) -> _Checker:
    expected = "one of " + ", ".join(repr(o) for o in options)

    def check(value: Any, key: str, source: str | None) -> str:
        if not isinstance(value, str):
            bad_value(source, key, value, expected, show_type=True)
        if value not in options:
            close = difflib.get_close_matches(value, options, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            bad_value(source, key, value, expected, hint=hint)
        return value

    return check


def _path(value: Any, key: str, source: str | None) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        is_str = isinstance(value, str)
        bad_value(source, key, value, "a non-empty path string", show_type=not is_str)
    return os.path.expanduser(value)


def _keep_last_layers(value: Any, key: str, source: str | None) -> int | str:
    if value == "auto" and isinstance(value, str):
        return value
    if not _is_int(value) or value < 0:
        bad_value(
            source,
            key,
            value,
            "'auto' or an integer >= 0",
            show_type=not _is_int(value),
        )
    return value


def _auto_or_int(lo: int, hi: int) -> _Checker:
    def check(value: Any, key: str, source: str | None) -> int | str:
        if value == "auto" and isinstance(value, str):
            return value
        if not _is_int(value) or not lo <= value <= hi:
            bad_value(source, key, value, f"'auto' or an integer in {lo}..{hi}", show_type=not _is_int(value))
        return value

    return check


_MODULE_PATH_RE = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*", re.ASCII)


def _module_paths(value: Any, key: str, source: str | None) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    expected = "a dotted module path such as 'model.layers', a list of them, or no value"
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) for p in paths):
        bad_value(source, key, value, expected, show_type=not isinstance(value, (list, tuple)))
    for p in paths:
        if not _MODULE_PATH_RE.fullmatch(p):
            bad_value(source, key, value, expected)
    return value if isinstance(value, str) else tuple(paths)


_PATTERN_RE = re.compile(r"[A-Za-z0-9_.*?\[\]!-]+", re.ASCII)


def _module_patterns(value: Any, key: str, source: str | None) -> tuple[str, ...]:
    expected = "a list of module names or glob patterns, such as ['lm_head', 'model.layers.*.mlp']"
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        bad_value(source, key, value, expected, show_type=True)
    for item in value:
        if not isinstance(item, str) or not _PATTERN_RE.fullmatch(item):
            bad_value(source, key, value, expected, hint=f" (bad item {item!r})")
    return tuple(value)


def _key(check: _Checker, default: Any = MISSING, *, size: bool = False) -> Any:
    """A config key: its checker and whether it is a size (printed as one) are stated here,
    beside its default, and nowhere else."""
    return field(default=default, metadata={"check": check, "size": size})


class _Problems:
    """Every problem of a config, so that a file's are reported at once, not one per run."""

    def __init__(self, source: str | None) -> None:
        self.source, self.messages = source, []

    @contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as e:
            self.messages += getattr(e, "problems", [str(e)])

    def add(self, message: str) -> None:
        self.messages.append(message)

    def raise_any(self) -> None:
        msgs = self.messages
        if len(msgs) == 1:
            raise ConfigError(msgs[0])
        if msgs:
            head = f"{self.source}: " if self.source else ""
            lines = [m.removeprefix(head) for m in msgs]
            err = ConfigError(f"{head}{len(msgs)} problems:\n" + "\n".join(f"  {m}" for m in lines))
            err.problems = msgs  # type: ignore[attr-defined]
            raise err


def _validate(obj: Any) -> None:
    """Check and normalise every field of a table dataclass in place."""
    source, prefix = _LOCATION.get()
    prefix = prefix or obj._TABLE
    problems = _Problems(source)
    for name, check in _TABLE_FIELDS[obj._TABLE].items():
        with problems.check():
            object.__setattr__(obj, name, check(getattr(obj, name), f"{prefix}.{name}", source))
    problems.raise_any()


def _suggest(word: str, options: tuple[str, ...] | list[str], sep: str = ".") -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f"; did you mean {close[0].replace('.', sep)!r}?" if close else ""


def _suggest_qualified(name: str, sep: str = ".") -> str:
    """Suggest ``table.key`` (or ``table__key``, the keyword form) for a bare key name."""
    owners = [t for t, keys in _TABLE_FIELDS.items() if name in keys]
    if len(owners) == 1:
        return f"; did you mean '{owners[0]}{sep}{name}' (key {name!r} of [{owners[0]}])?"
    return _suggest(name, _ALL_KEYS, sep)


# ---------------------------------------------------------------------------
# Dataclasses
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HostConfig:
    """Pinned host-memory tier.

    Attributes:
        capacity: Bytes of pinned host memory (0 disables the host tier, so
            everything goes straight to NVMe); at most 1 TiB. Size strings such
            as ``"8GiB"`` are accepted and stored as ints. ``"auto"``: for a model on a
            GPU a quarter of its memory, cut to what can be pinned; else (or where cuFile
            carries the activations) 1 GiB.
        huge_pages: Map the arena in transparent huge pages: faster to fault in and pin
            where the kernel has them free, slower where it must compact memory first.
    """

    _TABLE: ClassVar[str] = "host"

    capacity: int | str = _key(_host_capacity, "auto", size=True)
    huge_pages: bool = _key(_bool, False)

    def __post_init__(self) -> None:
        _validate(self)

    def sized(self, auto: int = ARENA_OFF_GPU) -> HostConfig:
        """This table with ``capacity = "auto"`` made ``auto`` bytes."""
        return self if self.capacity != "auto" else replace(self, capacity=auto)


@dataclass(frozen=True)
class NvmeConfig:
    """One NVMe directory that holds spill files.

    Attributes:
        path: Directory for spill files (``~`` is expanded; in a TOML file, a relative path
            is relative to the file).
        capacity: Maximum bytes to use in that directory (> 0).
    """

    _TABLE: ClassVar[str] = "nvme"

    path: str = _key(_path)
    capacity: int = _key(_size_range(1), 64 * GiB, size=True)

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class IoConfig:
    """I/O engine settings.

    Attributes:
        backend: ``"auto"``, ``"io_uring"``, ``"posix"`` or ``"cufile"``. ``"cufile"``
            moves CUDA activations between GPU memory and NVMe with cuFile (GPUDirect
            Storage, or its compatibility mode; without cuFile: the host arena, said once);
            ``"auto"`` does so only where GPUDirect Storage is usable. The store's own
            transfers use io_uring (``"auto"``: posix where io_uring is refused).
        queue_depth: Submission queue depth, 1..4096.
        block_size: I/O block size, a power of two from 4 KiB to 64 MiB.
        direct: Use ``O_DIRECT``.
        fixed_buffers: Register host buffers with io_uring.
        threads: Worker threads of the posix backend, 1..64.
        throttle: Cap each directory's bandwidth at this many bytes per
            second (a size; for benchmarks that imitate a slow disk), or None.
        zero_copy: Write activations that live in CPU memory to NVMe straight
            from their pages, without a copy into the host arena; they are
            held until written, and ``host.capacity`` bounds the bytes held so.
            Off: they are copied into the arena, as CUDA tensors are.
        preallocate: Grow each NVMe file this much ahead of its use (a size; 0: never), or
            ``"all"`` to allocate the whole capacity at once. Writes inside the allocated
            part do not extend the file, which file systems serialise; a full file
            system shows when space is taken, before any write.
        local_ranks: The training processes on this node that share its memory and disks,
            or ``"auto"``: what the launcher says (torchrun's and accelerate's
            ``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``, Open MPI's), else 1. Each takes
            its share of the memory that can be pinned for the arena, of the free space
            when no ``[[nvme]]`` table is given, and of the store's measured bandwidth in
            the plan.
    """

    _TABLE: ClassVar[str] = "io"

    backend: str = _key(_choice("auto", "io_uring", "posix", "cufile"), "auto")
    queue_depth: int = _key(_int_range(1, 4096), 64)
    block_size: int = _key(_size_range(4 * KiB, 64 * MiB, power_of_two=True), 1 * MiB, size=True)
    direct: bool = _key(_bool, True)
    fixed_buffers: bool = _key(_bool, True)
    threads: int = _key(_int_range(1, 64), 4)
    throttle: int | None = _key(_size_range(0, optional=True), None, size=True)
    zero_copy: bool = _key(_bool, True)
    preallocate: int | str = _key(_preallocate, 256 * MiB, size=True)
    local_ranks: int | str = _key(_auto_or_int(1, 1024), "auto")

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True)
class PolicyConfig:
    """Which activations are offloaded, and when they come back.

    Attributes:
        min_tensor_bytes: Smaller tensors stay on the device.
        keep_last_layers: How many final layers stay on device, or ``"auto"``: none on the CPU
            with ``prefetch_layers = "auto"`` (its window starts at the forward's end), else one.
        prefetch_layers: ``"auto"``: a window of bytes read ahead during backward, set after
            each backward from its pace and the reads' latency and bandwidth; or whole layers,
            0..64.
        eviction: ``"lifetime"``, ``"lru"`` or ``"fifo"``.
        dedup: Store tensors that share storage only once.
        layers: Dotted path of the ModuleList, Sequential or ModuleDict holding the layers
            (``"model.layers"``), a list of them (``["encoder.block", "decoder.block"]``,
            in forward order), or None to detect every stack of repeated blocks.
        mode: ``"auto"`` (adaptive on a GPU, with ``device_budget = "auto"`` unless one is
            given; on the CPU adaptive with a budget, else all), ``"all"``, ``"adaptive"``
            (keep, offload or recompute per block, docs/planner.md) or ``"none"``.
        device_budget: Most bytes of activations held in memory (adaptive mode plans
            within it; in the other modes, beyond it even what the policy would keep is
            offloaded), None, or ``"auto"`` (adaptive mode on a GPU: what the GPU has room
            for, measured each step).
        exclude: Modules whose saved tensors stay in memory, by qualified name
            (``"lm_head"``) or glob pattern (``"model.layers.*.mlp"``); each must match one.
    """

    _TABLE: ClassVar[str] = "policy"

    min_tensor_bytes: int = _key(_size_range(0), 1 * MiB, size=True)
    keep_last_layers: int | str = _key(_keep_last_layers, "auto")
    prefetch_layers: int | str = _key(_auto_or_int(0, 64), "auto")
    eviction: str = _key(_choice("lifetime", "lru", "fifo"), "lifetime")
    dedup: bool = _key(_bool, True)
    layers: str | tuple[str, ...] | None = _key(_module_paths, None)
    mode: str = _key(_choice("auto", "all", "adaptive", "none"), "auto")
    device_budget: int | str | None = _key(_device_budget, None, size=True)
    exclude: tuple[str, ...] = _key(_module_patterns, ())

    def __post_init__(self) -> None:
        _validate(self)
        if self.device_budget == "auto" and self.mode not in ("adaptive", "auto"):
            source, prefix = _LOCATION.get()
            raise ConfigError(
                f"{where(source, f'{prefix or self._TABLE}.device_budget')}: 'auto' sizes adaptive mode's plan "
                f"from GPU memory; set policy.mode = 'adaptive' (it is {self.mode!r}) or give a size"
            )

    def resolved(self, on_gpu: bool) -> PolicyConfig:
        """``mode = "auto"`` made concrete for a model on a GPU or not (docs/configuration.md)."""
        if self.mode != "auto":
            return self
        if on_gpu:
            budget = "auto" if self.device_budget is None else self.device_budget
            return replace(self, mode="adaptive", device_budget=budget)
        # On the CPU a budget asks for the planner; without one, every block is offloaded.
        return replace(self, mode="adaptive" if self.device_budget is not None else "all")


_TABLE_CLASSES: dict[str, type] = {
    "host": HostConfig,
    "nvme": NvmeConfig,
    "io": IoConfig,
    "policy": PolicyConfig,
}
# The schema, read off the dataclasses: each table's keys and their checkers, and the sizes.
_TABLE_FIELDS: dict[str, dict[str, _Checker]] = {
    t: {f.name: f.metadata["check"] for f in fields(cls)} for t, cls in _TABLE_CLASSES.items()
}
_SIZE_KEYS = {(t, f.name) for t, cls in _TABLE_CLASSES.items() for f in fields(cls) if f.metadata["size"]}
_TABLES = tuple(_TABLE_FIELDS)
_ALL_KEYS = tuple(f"{t}.{k}" for t, keys in _TABLE_FIELDS.items() for k in keys)
_OVERRIDE_KEYS = tuple(k for k in _ALL_KEYS if not k.startswith("nvme."))


def _table_dict(obj: Any, *, human: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _TABLE_FIELDS[obj._TABLE]:
        value = getattr(obj, name)
        if human and isinstance(value, int) and (obj._TABLE, name) in _SIZE_KEYS:
            value = exact_size(value)
        elif human and isinstance(value, tuple):
            value = list(value)
        out[name] = value
    return out


def _build_table(cls: type, data: Any, source: str | None, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        bad_value(source, prefix, data, "a table", show_type=True)
    table = cls._TABLE  # type: ignore[attr-defined]
    allowed = list(_TABLE_FIELDS[table])
    problems = _Problems(source)
    for key in data:
        if not isinstance(key, str) or key not in _TABLE_FIELDS[table]:
            hint = _suggest(key, allowed) if isinstance(key, str) else ""
            problems.add(
                f"{where(source, f'{prefix}.{key}')}: unknown key{hint or '.'} "
                f"Allowed keys in [{table}]: {', '.join(allowed)}"
            )
    if table == "nvme" and "path" not in data:
        problems.add(f"{where(source, prefix)}: missing required key 'path' (the directory for spill files)")
    else:
        with problems.check(), _located(source, prefix):
            built = cls(**{k: v for k, v in data.items() if k in allowed})
    problems.raise_any()
    slow = data.get("throttle") if table == "io" else None
    # 200 meant as MB/s would crawl without a word.
    if isinstance(slow, int) and not isinstance(slow, bool) and 0 < slow < MiB:
        at = where(source, f"{prefix}.throttle")
        warn(f'{at} = {slow} caps the disk at {slow} bytes per second; write "{slow}MB" for MB/s')
    return built


@dataclass(frozen=True)
class Config:
    """A complete ssdtier configuration.

    Attributes:
        host: The pinned host-memory tier.
        nvme: NVMe directories; empty means one directory at
            :func:`default_nvme_dir`.
        io: I/O engine settings.
        policy: Offload policy.
        source: Where the configuration came from (not compared).
    """

    host: HostConfig = field(default_factory=HostConfig)
    nvme: tuple[NvmeConfig, ...] = ()
    io: IoConfig = field(default_factory=IoConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    source: str = field(default="<defaults>", compare=False)

    def __post_init__(self) -> None:
        source, _ = _LOCATION.get()
        for name in ("host", "io", "policy"):
            cls = _TABLE_CLASSES[name]
            value = getattr(self, name)
            if not isinstance(value, cls):
                bad_value(source, name, value, f"a {cls.__name__}", show_type=True)
        nvme = self.nvme
        if isinstance(nvme, NvmeConfig):
            nvme = (nvme,)
        if not isinstance(nvme, (tuple, list)):
            bad_value(source, "nvme", nvme, "a tuple of NvmeConfig", show_type=True)
        seen: dict[str, int] = {}
        for i, entry in enumerate(nvme):
            if not isinstance(entry, NvmeConfig):
                bad_value(source, f"nvme[{i}]", entry, "an NvmeConfig", show_type=True)
            norm = os.path.normpath(entry.path)
            if norm in seen:
                bad_value(
                    source,
                    f"nvme[{i}].path",
                    entry.path,
                    "a directory not already listed",
                    hint=f" (same as nvme[{seen[norm]}].path)",
                )
            seen[norm] = i
        object.__setattr__(self, "nvme", tuple(nvme))
        if not isinstance(self.source, str):
            raise ConfigError(f"source: expected a str, got {self.source!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>") -> Config:
        """Build a Config from the TOML structure (tables host, nvme, io, policy).

        Args:
            d: Mapping of table name to table. ``nvme`` is a list of tables
                (a single table is accepted too). Sizes may be ints or strings.
            source: Where ``d`` came from, named in error messages.

        Raises:
            ConfigError: Unknown table or key, wrong type or value out of range.
        """
        if not isinstance(d, Mapping):
            bad_value(source, "<config>", d, "a mapping of tables", show_type=True)
        problems = _Problems(source)
        for name, value in d.items():
            if isinstance(name, str) and name in _TABLE_FIELDS:
                continue
            hint = ""
            if isinstance(name, str):
                hint = _suggest(name, _TABLES) or _suggest_qualified(name)
            is_table = isinstance(value, Mapping) or (
                isinstance(value, list) and value and isinstance(value[0], Mapping)
            )
            what = f"unknown table [{name}]" if is_table else f"unknown top-level key {name!r}"
            problems.add(f"{source}: {what}{hint or '.'} Allowed tables: {', '.join(_TABLES)}")
        nvme_data = d.get("nvme", [])
        if isinstance(nvme_data, (Mapping, NvmeConfig)):
            nvme_data = [nvme_data]
        if not isinstance(nvme_data, (list, tuple)):
            with problems.check():
                bad_value(source, "nvme", nvme_data, "an array of tables ([[nvme]])", show_type=True)
            nvme_data = []
        tables: dict[str, Any] = {}
        for name, data in (("host", d.get("host", {})), ("io", d.get("io", {})), ("policy", d.get("policy", {}))):
            with problems.check():
                tables[name] = _build_table(_TABLE_CLASSES[name], data, source, name)
        nvme = []
        for i, entry in enumerate(nvme_data):
            with problems.check():
                nvme.append(_build_table(NvmeConfig, entry, source, f"nvme[{i}]"))
        problems.raise_any()
        with _located(source, None):
            return cls(nvme=tuple(nvme), source=source, **tables)

    def to_dict(self) -> dict[str, Any]:
        """Return the configuration as plain dicts (sizes as strings).

        The result round-trips through :meth:`from_dict`. Unset optional keys
        are None.
        """
        return {
            "host": _table_dict(self.host, human=True),
            "nvme": [_table_dict(n, human=True) for n in self.nvme],
            "io": _table_dict(self.io, human=True),
            "policy": _table_dict(self.policy, human=True),
        }

    def to_toml(self) -> str:
        """Return the effective configuration as TOML text (loadable again)."""
        source = self.source.replace("\n", " ").replace("\r", " ")
        lines = [f"# ssdtier effective configuration (source: {source})", ""]
        data = self.to_dict()
        lines += _toml_table("[host]", data["host"])
        if data["nvme"]:
            for entry in data["nvme"]:
                lines += _toml_table("[[nvme]]", entry)
        else:
            lines += [
                "# No [[nvme]] tables: spill files go to the default directory",
                "# ($SSDTIER_DIR, else $XDG_CACHE_HOME/ssdtier or ~/.cache/ssdtier).",
                "",
            ]
        lines += _toml_table("[io]", data["io"])
        lines += _toml_table("[policy]", data["policy"])
        return "\n".join(lines).rstrip("\n") + "\n"

    def replace(self, overrides: Mapping[str, Any] | None = None, /, **kwargs: Any) -> Config:
        """Return a copy with some settings changed.

        Keys are ``"table.key"`` or ``"table__key"`` (``policy__prefetch_layers=3``,
        ``**{"host.capacity": "64MiB"}``), or a table name with a mapping
        (``host={"capacity": "64MiB"}``) or a table object. ``nvme`` is
        replaced as a whole (a list of tables). Errors name ``<overrides>``.

        Raises:
            ConfigError: Unknown key or invalid value.
        """
        # A bare key given as a keyword is suggested in keyword form (policy__mode), else dotted.
        items = [(k, v, False) for k, v in (overrides or {}).items()] + [(k, v, True) for k, v in kwargs.items()]
        if not items:
            return self
        src = "<overrides>"
        data: dict[str, Any] = {
            "host": _table_dict(self.host, human=False),
            "nvme": [_table_dict(n, human=False) for n in self.nvme],
            "io": _table_dict(self.io, human=False),
            "policy": _table_dict(self.policy, human=False),
        }
        if data["io"]["throttle"] is not None:  # checked already: not a user's bare number
            data["io"]["throttle"] = exact_size(data["io"]["throttle"])
        problems = _Problems(src)
        for key, value, keyword in items:
            if not isinstance(key, str):
                problems.add(f"{src}: override keys must be strings, got {key!r}")
                continue
            sep = "__" if "__" in key or (keyword and "." not in key) else "."
            parts = key.split("__") if "__" in key else key.split(".")
            if len(parts) == 1:
                if key not in _TABLE_FIELDS:
                    hint = _suggest(key, _TABLES) or _suggest_qualified(key, sep)
                    problems.add(
                        f"{src}: unknown key {key!r}{hint or '.'} Allowed keys: "
                        f"{', '.join(k.replace('.', sep) for k in _OVERRIDE_KEYS)}, or a table: {', '.join(_TABLES)}"
                    )
                elif key == "nvme":
                    data["nvme"] = value
                elif isinstance(value, _TABLE_CLASSES[key]):
                    data[key] = _table_dict(value, human=False)
                elif isinstance(value, Mapping):
                    data[key] = {**data[key], **value}
                else:
                    cls_name = _TABLE_CLASSES[key].__name__
                    with problems.check():
                        bad_value(src, key, value, f"a mapping or a {cls_name}", show_type=True)
                continue
            dotted = ".".join(parts)
            if parts[0] == "nvme" and len(parts) == 2 and parts[1] in _TABLE_FIELDS["nvme"]:
                problems.add(
                    f"{src}: cannot override {dotted!r}: nvme is a list of tables; "
                    "replace it as a whole, e.g. nvme=[{'path': ..., 'capacity': ...}]"
                )
            elif len(parts) != 2 or dotted not in _OVERRIDE_KEYS:
                problems.add(
                    f"{src}: unknown key {key!r}{_suggest(dotted, _OVERRIDE_KEYS, sep) or '.'} "
                    f"Allowed keys: {', '.join(k.replace('.', sep) for k in _OVERRIDE_KEYS)}"
                )
            else:
                data[parts[0]][parts[1]] = value
        cfg = None
        with problems.check():
            cfg = Config.from_dict(data, source=src)
        problems.raise_any()
        assert cfg is not None
        with _located(src, None):
            return Config(
                host=cfg.host,
                nvme=cfg.nvme,
                io=cfg.io,
                policy=cfg.policy,
                source=f"{self.source} + {src}",
            )


# ---------------------------------------------------------------------------
# TOML writing
# ---------------------------------------------------------------------------

_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n"}
_TOML_ESCAPES.update({"\f": "\\f", "\r": "\\r"})


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch in _TOML_ESCAPES:
                out.append(_TOML_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04X}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_table(header: str, table: Mapping[str, Any]) -> list[str]:
    lines = [header]
    for key, value in table.items():
        if value is None:
            lines.append(f"# {key} is not set")
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    lines.append("")
    return lines


# ---------------------------------------------------------------------------
# Loading and resolving
# ---------------------------------------------------------------------------


def _toml_module(path: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: loading TOML needs Python 3.11+ or `pip install tomli`") from None
    return tomllib


def load_config(path: str | os.PathLike[str]) -> Config:
    """Load a TOML config file.

    Args:
        path: The file to read.

    Returns:
        The Config, with ``source`` set to the path.

    Raises:
        ConfigError: The file is missing or unreadable, is not valid TOML, or
            holds an invalid configuration. Every message names the file.
    """
    name = os.fsdecode(os.fspath(path))
    toml = _toml_module(name)
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise ConfigError(f"{name}: config file not found") from e
    except OSError as e:
        raise ConfigError(f"{name}: cannot read config file: {e.strerror or e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: config file is not valid UTF-8: {e}") from e
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as e:
        raise ConfigError(f"{name}: invalid TOML: {e}") from e
    _relative_to(data.get("nvme"), os.path.dirname(os.path.abspath(name)))
    return Config.from_dict(data, source=name)


def _relative_to(nvme: Any, base: str) -> None:
    """A relative ``[[nvme]].path`` in a file means relative to the file, not to the current
    directory of whoever loads it."""
    for table in nvme if isinstance(nvme, list) else [nvme]:
        if isinstance(table, dict) and isinstance(table.get("path"), str) and table["path"]:
            path = os.path.expanduser(table["path"])
            if not os.path.isabs(path):
                table["path"] = os.path.join(base, path)


def resolve_config(config: Any = None, **overrides: Any) -> Config:
    """Turn what a user passed as ``config`` into a Config.

    Args:
        config: None (then the file named by ``$SSDTIER_CONFIG`` if set, else
            the defaults), a path (str or PathLike) to a TOML file, a Mapping
            in the TOML structure, or a Config (returned as is).
        **overrides: Applied with :meth:`Config.replace`.

    Raises:
        ConfigError: The configuration is invalid.
        TypeError: ``config`` has an unsupported type.
    """
    if config is None:
        env = os.environ.get("SSDTIER_CONFIG")
        if env:
            try:
                cfg = load_config(env)
            except ConfigError as e:
                raise ConfigError(f"{e} (path taken from $SSDTIER_CONFIG)") from e
        else:
            cfg = Config()
    elif isinstance(config, Config):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = Config.from_dict(config)
    elif isinstance(config, (str, os.PathLike)):
        cfg = load_config(config)
    else:
        raise TypeError(
            "config must be None, a path (str or os.PathLike) to a TOML file, "
            f"a mapping or an ssdtier Config, not {type(config).__name__}"
        )
    return cfg.replace(**overrides) if overrides else cfg
