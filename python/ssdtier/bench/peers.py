"""The other ways to save activation memory that the benches run beside ssdtier, where they
need more than a line: torchtune's activation offloading."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["torchtune_maker"]


def torchtune_maker() -> tuple[Callable[[Any], Any] | None, str]:
    """A function model -> torchtune's offloading context, and what it is; (None, why) when
    torchtune does not import (it needs torchao, and more)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("torchtune")
    except PackageNotFoundError:
        ver = "?"
    try:
        from torchtune import training

        how = ""
    except Exception as whole:  # any import-time failure of torchtune or its dependencies
        try:
            training = _torchtune_offloading_alone()
            how = " (its offloading module alone: the package imports datasets, pandas, pyarrow)"
        except Exception as e:
            why = whole if isinstance(e, ImportError) and "not installed" in str(e) else e
            return None, f"{type(why).__name__}: {(str(why).splitlines() or [''])[0][:200]}"
    make = getattr(training, "get_act_offloading_ctx_manager", None)
    if make is not None:
        # Its output head stays on the GPU, as torchtune's recipes have it: it looks for
        # ``model.output``, which our GPT (and transformers' models) call ``lm_head``.
        what = f"torchtune {ver}: get_act_offloading_ctx_manager(model, True), lm_head as its output{how}"
        return (lambda model: make(types.SimpleNamespace(output=model.lm_head), True)), what
    return (lambda model: training.OffloadActivations()), f"torchtune {ver}: OffloadActivations(){how}"


def _torchtune_offloading_alone() -> Any:
    """torchtune's ``training/_activation_offloading.py`` run by itself, with stand-ins for the
    two names it takes from torchtune (``modules.TiedLinear``, ``utils.get_logger``): the
    package's ``__init__`` imports its datasets, whose dependencies are too big to carry."""
    import importlib.util

    spec = importlib.util.find_spec("torchtune")  # finds it without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchtune is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "training" / "_activation_offloading.py"
    stubs = {name: types.ModuleType(name) for name in ("torchtune", "torchtune.modules", "torchtune.utils")}
    stubs["torchtune.modules"].TiedLinear = type("TiedLinear", (), {})  # our GPT has none
    stubs["torchtune.utils"].get_logger = lambda level=None: logging.getLogger("torchtune")
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        mspec = importlib.util.spec_from_file_location("torchtune_activation_offloading", path)
        if mspec is None or mspec.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return mod
