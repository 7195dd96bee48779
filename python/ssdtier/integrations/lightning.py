"""Lightning: ``Trainer(..., callbacks=[SsdtierCallback()])``."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from ..config import resolve_config
from ..offload import Offloader, OffloadStats, attach
from . import summary

__all__ = ["SsdtierCallback"]

log = logging.getLogger("ssdtier")


class SsdtierCallback(Callback):
    """Offloads the LightningModule's activations while it fits.

    Attaches at ``setup("fit")``, detaches at ``teardown``. Lightning calls
    ``training_step`` directly, not through the module's ``__call__``, so each step's
    forward runs in :meth:`~ssdtier.Offloader.scope` (from batch start to the backward).
    At each epoch's end :func:`ssdtier.integrations.summary`'s keys are logged with
    ``log_dict``, so they go to the Trainer's loggers.

    Args:
        config: as for :func:`ssdtier.attach`; checked now, not at ``fit()``.
        **overrides: as for :func:`ssdtier.attach`.

    Attributes:
        stats: the last fit's :class:`~ssdtier.OffloadStats`, after it ends.
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        self.config = resolve_config(config, **overrides)
        self.offloader: Offloader | None = None
        self.stats: OffloadStats | None = None
        self._step: AbstractContextManager | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.offloader is None:
            self.offloader = attach(pl_module, self.config)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.offloader is not None:
            self._end_step()
            self._step = self.offloader.scope()
            self._step.__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._end_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._end_step()  # a step that skipped its backward

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.offloader is not None:
            pl_module.log_dict(summary(self.offloader.stats()))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end_step()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._end_step()
        if self.offloader is not None:
            self.stats = self.offloader.stats()
            self.offloader.detach()
            self.offloader = None
            log.info("ssdtier: fit ended:\n%s", self.stats)

    def _end_step(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)
