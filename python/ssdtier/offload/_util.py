"""Small helpers shared by the offloader's parts."""

from __future__ import annotations

import itertools
import os
import sys
import warnings

import torch

from ..errors import SsdtierWarning

PAGE = 4096


def cuda_device(model: torch.nn.Module) -> torch.device | None:
    """The GPU the model's first CUDA parameter or buffer is on, if any."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next((t.device for t in tensors if t.is_cuda), None)


# Run as Python, never traced by torch.compile.
eager = getattr(getattr(torch, "compiler", None), "disable", None) or (lambda fn: fn)

_INTERNAL = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (sys.modules["ssdtier"], torch))


def warn(msg: str) -> None:
    """What the user must see (activations left in memory, hooks removed), shown at the user's
    line that led to it (a forward, a backward); the rest is logged."""
    level, f = 1, sys._getframe(0)
    while f is not None and f.f_code.co_filename.startswith(_INTERNAL):
        level, f = level + 1, f.f_back
    warnings.warn(f"ssdtier: {msg}", SsdtierWarning, stacklevel=level)


class Once:
    """Warnings given once per offloader, by name."""

    __slots__ = ("given",)

    def __init__(self) -> None:
        self.given: set[str] = set()

    def warn(self, name: str, msg: str) -> None:
        if name not in self.given:
            self.given.add(name)
            warn(msg)


def aligned_storage(nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """A CPU storage with room for ``nbytes`` rounded up to whole pages (O_DIRECT moves whole
    pages) from its first page boundary, and that boundary's offset in it. An ordinary torch
    allocation, so its memory is reused like any other."""
    st = torch.UntypedStorage(-(-nbytes // PAGE) * PAGE + PAGE)
    return st, -st.data_ptr() % PAGE
