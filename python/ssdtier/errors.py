"""The ssdtier exception hierarchy.

Every error ssdtier raises derives from :class:`SsdtierError`. Errors that come
from the operating system also derive from the matching builtin class, so
``except FileNotFoundError`` and ``except OSError`` work as usual, and carry
``errno`` and ``filename``.
"""

from __future__ import annotations

import errno as _errno
import os
import sys
import warnings
from typing import Any, NoReturn

__all__ = [
    "SsdtierError",
    "ConfigError",
    "StoreClosedError",
    "SsdtierOSError",
    "SsdtierFileNotFoundError",
    "SsdtierPermissionError",
    "OutOfSpaceError",
    "StoreFailedError",
    "UnknownKeyError",
    "EntryBusyError",
    "InvalidUseError",
    "SsdtierWarning",
]


class SsdtierError(Exception):
    """Base class of every error raised by ssdtier."""


class ConfigError(SsdtierError, ValueError):
    """A configuration file, dict or keyword override is invalid."""


class StoreClosedError(SsdtierError, RuntimeError):
    """The store was used after ``close()``."""


class UnknownKeyError(SsdtierError, KeyError):
    """A store key that was freed already, or never put."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class EntryBusyError(SsdtierError, RuntimeError):
    """A store entry is held by another call (acquired, or still being filled)."""


class InvalidUseError(SsdtierError, ValueError):
    """A store call made out of order or with a bad buffer (misaligned, null, no bytes)."""


class SsdtierWarning(UserWarning):
    """A fallback was taken (no O_DIRECT, no O_TMPFILE, no io_uring...): it works, maybe slower."""


def warn(msg: str) -> None:
    """What the user must see, shown at the user's line that led to it (the first frame
    outside ssdtier and torch); the rest is logged."""
    internal = tuple(
        os.path.dirname(m.__file__ or "") + os.sep for m in (sys.modules.get("ssdtier"), sys.modules.get("torch")) if m
    )
    level, f = 1, sys._getframe(0)
    while f is not None and f.f_code.co_filename.startswith(internal):
        level, f = level + 1, f.f_back
    warnings.warn(f"ssdtier: {msg}", SsdtierWarning, stacklevel=level)


class SsdtierOSError(SsdtierError, OSError):
    """An I/O error from the operating system (``errno`` is set)."""


class SsdtierFileNotFoundError(SsdtierOSError, FileNotFoundError):
    """A configured path does not exist."""


class SsdtierPermissionError(SsdtierOSError, PermissionError):
    """A configured path or file cannot be accessed."""


class OutOfSpaceError(SsdtierOSError):
    """No tier has room for the data (host arena and every NVMe device full).

    ``errno`` is ``ENOSPC``.
    """


class StoreFailedError(SsdtierOSError):
    """The store refuses new work after a failure (an I/O engine stopped with transfers in
    flight); ``errno`` is ``EIO``. Freeing and closing still work."""


def os_error(code: int, message: str, filename: str | None = None) -> SsdtierOSError:
    """Build the most specific ssdtier OS error for ``code`` (used by ``_native``)."""
    if code == _errno.ENOSPC:
        cls: type[SsdtierOSError] = OutOfSpaceError
    elif code == _errno.ENOENT:
        cls = SsdtierFileNotFoundError
    elif code in (_errno.EACCES, _errno.EPERM):
        cls = SsdtierPermissionError
    else:
        cls = SsdtierOSError
    if filename is None:
        return cls(code, message)
    return cls(code, message, filename)


def from_native(kind: str, message: str, errno: int | None, filename: str | None) -> Exception:
    """Map an error of the Rust core to its exception (called by ``_native``)."""
    if kind == "os" and errno is not None:
        return os_error(errno, message, filename)
    if kind == "key":
        return UnknownKeyError(message)
    if kind == "closed":
        return StoreClosedError(message)
    if kind == "failed":
        return StoreFailedError(_errno.EIO, message)
    if kind == "config":
        return ConfigError(message)
    if kind in ("invalid", "forked"):
        return InvalidUseError(message)
    if kind == "busy":
        return EntryBusyError(message)
    return SsdtierError(message)


def where(source: str | None, key: str) -> str:
    return f"{source}: {key}" if source else key


def bad_value(
    source: str | None,
    key: str,
    value: Any,
    expected: str,
    *,
    show_type: bool = False,
    hint: str = "",
) -> NoReturn:
    """Raise the ConfigError for a bad config value, naming its source and key."""
    got = repr(value)
    if show_type:
        got += f" of type {type(value).__name__}"
    raise ConfigError(f"{where(source, key)}: expected {expected}, got {got}{hint}")
