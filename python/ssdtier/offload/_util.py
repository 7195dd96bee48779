"""Small helpers shared by the offloader's parts."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from ..errors import warn

PAGE = 4096


def cuda_device(model: torch.nn.Module) -> torch.device | None:
    """The GPU the model's first CUDA parameter or buffer is on, if any."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next((t.device for t in tensors if t.is_cuda), None)


# Dynamo's error under fullgraph=True quotes it (torch >= 2.8).
COMPILED = (
    "ssdtier's model hooks push saved-tensor hooks, which torch.compile cannot trace, so they run "
    "outside the graph; with fullgraph=True compile each block before attaching "
    "(for i, b in enumerate(blocks): blocks[i] = torch.compile(b, fullgraph=True)), or leave fullgraph off"
)


def eager(fn: Any) -> Any:
    """``fn`` run as Python, never traced by torch.compile."""
    disable = torch.compiler.disable
    try:
        return disable(fn, reason=COMPILED)
    except TypeError:  # torch < 2.8: no reason
        return disable(fn)


class Once:
    """Warnings given once per offloader, by name."""

    __slots__ = ("given",)

    def __init__(self) -> None:
        self.given: set[str] = set()

    def warn(self, name: str, msg: str) -> None:
        if name not in self.given:
            self.given.add(name)
            warn(msg)


def on_device(device: torch.device | None) -> Any:
    """``device`` current, for a CUDA call made outside torch's own device guards; a no-op
    for None or a CPU device."""
    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()


def host_event() -> Any:
    """A CUDA event the host may wait on: a wait sleeps instead of spinning a core."""
    return torch.cuda.Event(blocking=True)


def aligned_storage(nbytes: int) -> tuple[torch.UntypedStorage, int]:
    """A CPU storage with room for ``nbytes`` rounded up to whole pages (O_DIRECT moves whole
    pages) from its first page boundary, and that boundary's offset in it. An ordinary torch
    allocation, so its memory is reused like any other."""
    st = torch.UntypedStorage(-(-nbytes // PAGE) * PAGE + PAGE)
    return st, -st.data_ptr() % PAGE
