"""ssdtier: offload PyTorch training activations to pinned host memory and NVMe SSDs.

Importing ssdtier is cheap: it does not import torch, open a file, start an
I/O ring or initialise CUDA. Those happen when a store is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import Config, load_config
from .errors import (
    ConfigError,
    EntryBusyError,
    InvalidUseError,
    OutOfSpaceError,
    SsdtierError,
    SsdtierOSError,
    SsdtierWarning,
    StoreClosedError,
    StoreFailedError,
    UnknownKeyError,
)

if TYPE_CHECKING:
    from .offload import Offloader, OffloadStats, attach, detach, no_offload, reusing_stores
    from .store import StoreStats, TieredStore

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "EntryBusyError",
    "InvalidUseError",
    "OffloadStats",
    "Offloader",
    "OutOfSpaceError",
    "SsdtierError",
    "SsdtierOSError",
    "SsdtierWarning",
    "StoreClosedError",
    "StoreFailedError",
    "StoreStats",
    "TieredStore",
    "UnknownKeyError",
    "attach",
    "detach",
    "load_config",
    "no_offload",
    "reusing_stores",
]

_LAZY = {
    "TieredStore": "store",
    "StoreStats": "store",
    "attach": "offload",
    "detach": "offload",
    "Offloader": "offload",
    "OffloadStats": "offload",
    "no_offload": "offload",
    "reusing_stores": "offload",
}


def __getattr__(name: str) -> Any:
    # torch and the native module load on first use, not at import.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'ssdtier' has no attribute {name!r}")
