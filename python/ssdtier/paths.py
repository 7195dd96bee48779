"""Spill directories: the default one, tmpfs detection, and checking that each can be used."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, warn
from .mounts import Medium, existing, local_ssds, where
from .sizes import format_size

if TYPE_CHECKING:
    from .config import Config

__all__ = ["RAMFS_MAGIC", "TMPFS_MAGIC", "check_paths", "default_nvme_dir", "is_tmpfs", "space_problems"]

TMPFS_MAGIC = 0x01021994
RAMFS_MAGIC = 0x858458F6


def default_nvme_dir() -> str:
    """Return the default spill directory (no filesystem access).

    ``$SSDTIER_DIR`` if set, else ``$XDG_CACHE_HOME/ssdtier`` (when that is an
    absolute path), else ``~/.cache/ssdtier``.
    """
    explicit = os.environ.get("SSDTIER_DIR")
    if explicit:
        return os.path.expanduser(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "ssdtier")
    return os.path.join(os.path.expanduser("~"), ".cache", "ssdtier")


@lru_cache(maxsize=1)
def _statfs() -> tuple[Any, Any] | None:
    import ctypes

    class StatFs(ctypes.Structure):
        # struct statfs of glibc/musl on Linux (LP64 and ILP32): f_type first.
        _fields_ = [
            ("f_type", ctypes.c_long),
            ("f_bsize", ctypes.c_long),
            ("f_blocks", ctypes.c_ulong),
            ("f_bfree", ctypes.c_ulong),
            ("f_bavail", ctypes.c_ulong),
            ("f_files", ctypes.c_ulong),
            ("f_ffree", ctypes.c_ulong),
            ("f_fsid", ctypes.c_int * 2),
            ("f_namelen", ctypes.c_long),
            ("f_frsize", ctypes.c_long),
            ("f_flags", ctypes.c_long),
            ("f_spare", ctypes.c_long * 4),
            ("_slack", ctypes.c_char * 64),  # room in case a libc's struct is larger
        ]

    try:
        func = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_char_p, ctypes.POINTER(StatFs)]
    func.restype = ctypes.c_int
    return func, StatFs


def is_tmpfs(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (or its nearest existing ancestor) is on tmpfs or ramfs.

    Spill files there would use RAM, not disk. Returns False on any failure
    and on non-Linux systems.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        found = _statfs()
        if found is None:
            return False
        func, struct_type = found
        p = os.path.abspath(os.path.expanduser(os.fsdecode(os.fspath(path))))
        while not os.path.exists(p):
            parent = os.path.dirname(p)
            if parent == p:
                return False
            p = parent
        buf = struct_type()
        import ctypes

        if func(os.fsencode(p), ctypes.byref(buf)) != 0:
            return False
        return (buf.f_type & 0xFFFFFFFF) in (TMPFS_MAGIC, RAMFS_MAGIC)
    except (OSError, ValueError, TypeError):
        return False


def space_problems(config: Config, paths: list[str]) -> list[tuple[str, bool]]:
    """The NVMe capacities their file systems cannot hold now: (message, fatal) per file
    system. With ``io.preallocate = "all"`` the whole capacity is taken at open: fatal;
    else the writes past the free space fail later (the activations stay in memory)."""
    by_fs: dict[int, tuple[str, int, list[str]]] = {}
    for i, (path, n) in enumerate(zip(paths, config.nvme, strict=True)):
        probe = existing(path)
        dev = os.stat(probe).st_dev
        where_, cap, keys = by_fs.get(dev, (probe, 0, []))
        by_fs[dev] = (where_, cap + n.capacity, [*keys, f"nvme[{i}].capacity"])
    out = []
    for probe, cap, keys in by_fs.values():
        free = shutil.disk_usage(probe).free
        if cap <= free:
            continue
        fatal = config.io.preallocate == "all"
        then = (
            'io.preallocate = "all" takes it all at open'
            if fatal
            else "writes past the free space will fail, and those activations stay in memory"
        )
        out.append(
            (
                f"{config.source}: {' + '.join(keys)} = {format_size(cap)}, and the file system of {probe} has "
                f"{format_size(free)} free: {then}; give at most {format_size(free * 9 // 10)}",
                fatal,
            )
        )
    return out


def check_paths(config: Config, default_dir: str | None = None) -> list[str]:
    """Check that every NVMe directory can be used; returns the absolute paths.

    Checked by doing, as root passes any permission check: a file is made (and removed) in a
    directory that exists, a directory (and removed) in the nearest existing ancestor of one
    that does not. With ``io.direct`` on it must not be on tmpfs, which refuses ``O_DIRECT``.
    Nothing is left behind.

    Raises:
        ConfigError: naming the source, the key and the path.
    """
    if config.nvme:
        paths = [(f"nvme[{i}].path", n.path) for i, n in enumerate(config.nvme)]
    else:
        paths = [("SSDTIER_DIR (the default directory)", default_dir or default_nvme_dir())]
    out = []
    for key, path in paths:
        path = os.path.abspath(os.path.expanduser(path))
        probe = path
        while not os.path.lexists(probe):
            probe = os.path.dirname(probe)
        label = f"{config.source}: {key} = {path!r}"
        if not os.path.isdir(probe):
            raise ConfigError(f"{label}: {probe} is not a directory")
        try:
            if probe == path:
                tempfile.TemporaryFile(dir=path).close()
            else:
                os.rmdir(tempfile.mkdtemp(prefix=".ssdtier-probe-", dir=probe))
        except OSError as e:
            what = "cannot hold a file" if probe == path else f"cannot be created in {probe}"
            raise ConfigError(f"{label}: the directory {what} ({e.strerror or e})") from None
        if is_tmpfs(probe):
            if config.io.direct:
                raise ConfigError(
                    f"{label}: the directory is on tmpfs, which does not support O_DIRECT; "
                    "use a directory on an SSD, or set io.direct = false"
                )
            warn(f"{label}: the directory is on tmpfs, whose files are memory: spilling there frees none")
        _warn_if_remote(label, probe)
        out.append(path)
    return out


_WARNED: set[str] = set()


def _warn_if_remote(label: str, probe: str) -> None:
    """Said once per directory: a network file system takes each step's activations across
    the network, and the checks above pass on it."""
    w = where(probe)
    if w.medium is not Medium.NETWORK or w.path in _WARNED:
        return
    _WARNED.add(w.path)
    ssds = ", ".join(f"{s.path} ({format_size(s.free or 0)} free)" for s in local_ssds())
    warn(
        f"{label} is on {w.describe()}: every step's activations would cross the network. "
        f"Point it at a local SSD{': here ' + ssds if ssds else ''}"
    )


# A store file named while cuFile has it registered (it opens files again by path), then the
# pid: offload/cufile.py gives the names, a process that died with them leaves them.
CUFILE_LINK_PREFIX = ".ssdtier-cufile-"


def remove_stale_links(folder: str) -> None:
    """Remove the names a process that is gone gave its store files in ``folder``."""
    with contextlib.suppress(OSError), os.scandir(folder) as it:
        for entry in it:
            if not entry.name.startswith(CUFILE_LINK_PREFIX):
                continue
            pid = entry.name[len(CUFILE_LINK_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # someone else's process: alive
    return True
