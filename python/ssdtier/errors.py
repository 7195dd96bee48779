"""The ssdtier exception hierarchy.

Every error ssdtier raises derives from :class:`SsdtierError`. Errors that come
from the operating system also derive from the matching builtin class, so
``except FileNotFoundError`` and ``except OSError`` work as usual, and carry
``errno`` and ``filename``.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "SsdtierError",
    "ConfigError",
    "StoreClosedError",
    "SsdtierOSError",
    "SsdtierFileNotFoundError",
    "SsdtierPermissionError",
    "OutOfSpaceError",
]


class SsdtierError(Exception):
    """Base class of every error raised by ssdtier."""


class ConfigError(SsdtierError, ValueError):
    """A configuration file, dict or keyword override is invalid."""


class StoreClosedError(SsdtierError, RuntimeError):
    """The store was used after ``close()``."""


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
