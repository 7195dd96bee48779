"""Lightning with SsdtierCallback: the same losses and bit-identical weights as without it."""

from __future__ import annotations

import pytest
import torch

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch

from .test_attach import offload_config

pl = pytest.importorskip("lightning.pytorch")

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=3)


class _Module(pl.LightningModule):
    """Its training_step uses the model's parts, not its own forward, as many do."""

    def __init__(self, call_self: bool):
        super().__init__()
        self.gpt = build_model(CFG)
        self.call_self = call_self
        self.losses: list[torch.Tensor] = []

    def forward(self, batch):
        return batch_loss(self.gpt, batch)

    def training_step(self, batch, batch_idx):
        loss = self(batch) if self.call_self else batch_loss(self.gpt, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(2)
        data = [make_batch(CFG, 2, gen) for _ in range(6)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def fit(tmp_path, call_self, callbacks):
    torch.manual_seed(0)
    module = _Module(call_self)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        default_root_dir=str(tmp_path),
        logger=pl.loggers.CSVLogger(str(tmp_path)),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module)
    return module, trainer


@pytest.mark.parametrize("call_self", [False, True], ids=["parts", "self"])
def test_lightning_callback_is_exact(store_dir, tmp_path, call_self):
    from ssdtier.integrations.lightning import SsdtierCallback

    want, _ = fit(tmp_path / "plain", call_self, [])
    cb = SsdtierCallback(offload_config(store_dir))
    got, trainer = fit(tmp_path / "ssdtier", call_self, [cb])
    assert len(got.losses) == 12 and all(torch.equal(a, b) for a, b in zip(want.losses, got.losses, strict=True))
    for p, q in zip(want.parameters(), got.parameters(), strict=True):
        assert torch.equal(p, q)
    assert cb.offloader is None and ssdtier.offload.attached(got) is None
    assert cb.stats.tensors_offloaded > 0 and cb.stats.bytes_read_nvme > 0
    assert trainer.callback_metrics["ssdtier/offloaded_GiB"] > 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
