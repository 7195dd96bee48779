"""Small helpers shared by the offloader's parts."""

from __future__ import annotations

import contextlib
import importlib.abc
import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..errors import warn

PAGE = 4096


def cuda_device(model: torch.nn.Module) -> torch.device | None:
    """The GPU the model's first CUDA parameter or buffer is on, if any."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next((t.device for t in tensors if t.is_cuda), None)


def autocast_cast(t: torch.Tensor, base: torch.Tensor | None) -> bool:
    """Whether ``t`` is (a view of) a cast of a leaf, such as a weight, as autocast caches."""
    fn = (base if base is not None else t).grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    leaf = fn.next_functions[0][0]
    return leaf is not None and type(leaf).__name__ == "AccumulateGrad"


# Dynamo's error under fullgraph=True quotes it (torch >= 2.8).
COMPILED = (
    "ssdtier's model hooks push saved-tensor hooks, which torch.compile cannot trace, so they run "
    "outside the graph; with fullgraph=True compile each block before attaching "
    "(for i, b in enumerate(blocks): blocks[i] = torch.compile(b, fullgraph=True)), or leave fullgraph off"
)


def run_eagerly(cls: type, name: str) -> None:
    """Make the method ``cls.name`` run as Python, never traced by torch.compile. Dynamo
    (sympy, triton: seconds and 160 MiB) is imported by nothing here: the method is marked
    when something else has imported it, before anything can compile."""
    fn = cls.__dict__[name]

    def mark() -> None:
        setattr(cls, name, torch.compiler.disable(fn, reason=COMPILED))

    _OnImport.then("torch._dynamo", mark)


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls back once a module has been imported: its loader, found by the other finders, runs
    the callbacks after the module's own code. A lookup that loads nothing (a probe) leaves
    them waiting for the import."""

    pending: ClassVar[dict[str, list[Callable[[], None]]]] = {}
    lock = threading.Lock()

    @classmethod
    def then(cls, module: str, fn: Callable[[], None]) -> None:
        with cls.lock:
            if not cls.pending:
                sys.meta_path.insert(0, cls())
            cls.pending.setdefault(module, []).append(fn)
        cls.flush()  # imported meanwhile, by another thread

    @classmethod
    def flush(cls) -> None:
        """Run the callbacks of the modules imported already."""
        with cls.lock:
            ran = [(m, cls.pending.pop(m)) for m in list(cls.pending) if m in sys.modules]
            if ran and not cls.pending:
                for f in [f for f in sys.meta_path if isinstance(f, cls)]:
                    sys.meta_path.remove(f)
        for module, fns in ran:
            for fn in fns:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - never fail the user's import
                    warn(f"after {module} was imported: {type(e).__name__}: {e}")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.pending:
            return None
        spec = next((s for f in sys.meta_path if f is not self and (s := _spec(f, name, path, target))), None)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            if spec is not None:  # a legacy loader: nothing to run after
                warn(f"ssdtier could not follow the import of {name}: torch.compile may trace its hooks")
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.flush()

        spec.loader.exec_module = exec_module
        return spec


def imported() -> None:
    """Run what waits for modules that are imported by now."""
    if _OnImport.pending:
        _OnImport.flush()


def _spec(finder: Any, name: str, path: Any, target: Any) -> Any:
    find = getattr(finder, "find_spec", None)
    return find(name, path, target) if find is not None else None


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
