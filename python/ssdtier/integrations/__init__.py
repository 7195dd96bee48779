"""Plugging ssdtier into the training loops people already run.

- ``ssdtier.integrations.hf.SsdtierCallback``: a Hugging Face ``Trainer`` callback
  (``pip install ssdtier[hf]``).
- ``ssdtier.integrations.lightning.SsdtierCallback``: a Lightning callback
  (``pip install ssdtier[lightning]``).
- accelerate needs no helper: ``ssdtier.attach(accelerator.unwrap_model(model))``, before
  or after ``Accelerator.prepare``.

Each callback attaches at the start of training and detaches at its end, and adds a short
summary to the loop's logs (the keys of :func:`summary`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ..plan import Action

__all__ = ["summary", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside the wrappers a loop may add (DataParallel's and DDP's ``module``,
    torch.compile's ``_orig_mod``): ssdtier attaches there, so that wrappers may change."""
    while True:
        if isinstance(model, (DataParallel, DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def summary(stats: Any) -> dict[str, float]:
    """What a loop logs of an offloader's :class:`~ssdtier.OffloadStats`, so far; with an
    adaptive plan, its blocks by action and its device budget."""
    out = {
        "ssdtier/offloaded_GiB": round(stats.bytes_offloaded / 2**30, 4),
        "ssdtier/peak_resident_GiB": round(stats.peak_resident_bytes / 2**30, 4),
        "ssdtier/stall_s": round(stats.stall_seconds, 4),
        "ssdtier/forward_wait_s": round(stats.forward_wait_seconds, 4),
        "ssdtier/gpu_wait_s": round(stats.gpu_wait_seconds, 4),
    }
    plan = stats.plan
    if plan is not None:
        for action in Action:
            out[f"ssdtier/blocks_{action.name.lower()}"] = float(plan.count(action))
        if plan.device_budget is not None:
            out["ssdtier/device_budget_GiB"] = round(plan.device_budget / 2**30, 4)
    return out
