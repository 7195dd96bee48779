"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[SsdtierCallback()])``."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from ..config import resolve_config
from ..offload import Offloader, OffloadStats, attach
from . import summary, unwrap

__all__ = ["SsdtierCallback", "checkpointing", "without_cache"]

log = logging.getLogger("ssdtier")


class SsdtierCallback(TrainerCallback):
    """Offloads the Trainer's model's activations during each ``train()``.

    Attaches at train begin (to the model inside DDP's or torch.compile's wrapper), detaches
    at train end, and adds :func:`ssdtier.integrations.summary`'s keys to every log: they are
    in ``trainer.state.log_history`` and seen by the callbacks after this one.

    Args:
        config: as for :func:`ssdtier.attach`; checked now, not at ``train()``.
        **overrides: as for :func:`ssdtier.attach` (``policy__min_tensor_bytes="64KiB"``).

    Attributes:
        stats: the last training run's :class:`~ssdtier.OffloadStats`, after it ends.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[SsdtierCallback()])
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        self.config = resolve_config(config, **overrides)
        self.offloader: Offloader | None = None
        self.stats: OffloadStats | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._detach()  # a run that raised skipped its on_train_end
        self.offloader = attach(unwrap(model), self.config)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if self.offloader is None or logs is None:
            return
        now = summary(self.offloader.stats())
        logs.update(now)
        if state.log_history:
            state.log_history[-1].update(now)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    def _detach(self) -> None:
        if self.offloader is not None:
            self.stats = self.offloader.stats()
            self.offloader.detach()
            self.offloader = None
            log.info("ssdtier: training ended:\n%s", self.stats)


def checkpointing(model: Any, context_fn: Any = None) -> None:
    """Recompute the model's layers in backward (non-reentrant ``torch.utils.checkpoint``),
    by the name this transformers version has for it; ``context_fn`` is checkpoint's (a
    selective policy: ``ssdtier.bench.models.selective_checkpoint_context``)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def without_cache(model: Any) -> None:
    """Build no key/value cache in forwards that do not ask for one (``use_cache = False`` in
    every config of the model: T5's stacks hold their own), as transformers does under its
    gradient checkpointing. Each decoder block updates the cache, so while one is built
    ssdtier cannot recompute those blocks. The loss can differ from a run with the cache in
    the last bits (other memory layouts)."""
    for cfg in {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}.values():
        if getattr(cfg, "use_cache", None) is True:
            cfg.use_cache = False
