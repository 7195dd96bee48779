"""Hugging Face models (tiny, random, built from configs: nothing is downloaded), the
Trainer with SsdtierCallback, and accelerate: the same losses and bit-identical gradients
and weights as without ssdtier."""

from __future__ import annotations

import pytest
import torch

import ssdtier

from .test_attach import offload_config

transformers = pytest.importorskip("transformers")

SEQ = 16


def llama(**kw):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, **kw
    )
    return transformers.LlamaForCausalLM(cfg)


def mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(cfg)


def t5():
    cfg = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=3,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
    )
    return transformers.T5ForConditionalGeneration(cfg)


MODELS = {"llama": llama, "mixtral": mixtral, "t5": t5, "llama-checkpointing": llama}


def batches(n=3, batch=2):
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (batch, SEQ), generator=gen) for _ in range(n)]


def loss_of(model, ids):
    if model.config.is_encoder_decoder:
        return model(input_ids=ids, decoder_input_ids=ids.flip(1), labels=ids).loss
    return model(input_ids=ids, labels=ids).loss


def train(name, cfg=None, prepare=None, data=None, loss_fn=loss_of):
    """Three accumulated micro-batches from seed 0 (``prepare(model)`` before attaching), or
    ``loss_fn(model, item)`` for each item of ``data``; returns losses, grads and stats."""
    torch.manual_seed(0)
    model = MODELS[name]()
    if name.endswith("checkpointing"):
        from ssdtier.integrations.hf import checkpointing

        checkpointing(model)
    if prepare is not None:
        prepare(model)
    model.train()
    off = ssdtier.attach(model, cfg) if cfg is not None else None
    losses = []
    for item in batches() if data is None else data:
        loss = loss_fn(model, item)
        loss.backward()
        losses.append(loss.detach())
    stats = off.stats() if off is not None else None
    if off is not None:
        off.detach()
    return losses, [p.grad for p in model.parameters()], stats


def same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    for x, y in zip(a[1], b[1], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def test_dynamic_padding_runs_shorter_batches_without_hooks(store_dir):
    # A collator padding each batch to its longest sequence, with an attention mask: once two
    # hooked forwards ran the all-keep plan, each batch no longer than the longest hooked one
    # runs without hooks (the layers take hidden states, a 4-D mask, positions by keyword).
    lengths = (16, 12, 16, 8, 12, 16, 10, 8, 12, 14, 16, 9)
    gen = torch.Generator().manual_seed(2)
    data = []
    for n in lengths:
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, n - 3 :] = 0  # the second sample is shorter: padded
        data.append((torch.randint(0, 64, (2, n), generator=gen), mask))

    def padded(model, item):
        ids, mask = item
        return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    got = train("llama", offload_config(store_dir, mode="adaptive", device_budget="1GiB"), data=data, loss_fn=padded)
    same(train("llama", data=data, loss_fn=padded), got)
    assert got[2].forwards_unhooked == len(lengths) - 3, got[2]  # hooked: 1 (no plan), 2 and 3


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_models_exact_through_nvme(store_dir, name):
    got = train(name, offload_config(store_dir))
    same(train(name), got)
    assert got[2].tensors_offloaded > 0 and got[2].bytes_read_nvme > 0
    # model.layers found (not a block's experts), or T5's encoder.block and decoder.block.
    assert got[2].layers_offloaded == (5 if name == "t5" else 3)


@pytest.mark.parametrize("reentrant", [False, True])
def test_layers_that_checkpoint_themselves_are_not_checkpointed_again(store_dir, monkeypatch, reentrant):
    # transformers 5 checkpoints a layer inside its forward: a plan that recomputes it runs
    # it as it is, its own checkpoint serving (reentrant, a second would run it 3 times a step).
    import ssdtier.offload.recompute as rc

    from .test_rok import RO, forced

    calls, runs = [], []
    real = rc.checkpoint
    monkeypatch.setattr(rc, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    forced(monkeypatch, (RO,) * 3)

    def prepare(model):
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.model.layers[1].mlp.register_forward_hook(lambda *a: runs.append(1))

    want = train("llama", prepare=prepare)
    plain, runs[:] = len(runs), []
    same(want, train("llama", offload_config(store_dir, mode="adaptive"), prepare))
    assert calls == [] and len(runs) == plain, (len(calls), len(runs), plain)


# ------------------------------------------------------------------ Trainer


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n=32):
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_trainer(tmp_path, callbacks):
    from ssdtier.integrations.hf import SsdtierCallback  # noqa: F401  (imports with transformers)

    torch.manual_seed(0)
    model = llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Ids(), callbacks=callbacks)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, [p.detach().clone() for p in model.parameters()], trainer


def test_trainer_with_the_callback_is_exact(store_dir, tmp_path):
    from ssdtier.integrations.hf import SsdtierCallback

    want, weights, _ = run_trainer(tmp_path / "plain", None)
    cb = SsdtierCallback(offload_config(store_dir))
    got, got_weights, trainer = run_trainer(tmp_path / "ssdtier", [cb])
    assert len(got) == 8 and got == want
    assert all(torch.equal(a, b) for a, b in zip(weights, got_weights, strict=True))
    assert cb.offloader is None and cb.stats.tensors_offloaded > 0  # detached at train end
    assert ssdtier.offload.attached(trainer.model) is None
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert logged[-1]["ssdtier/offloaded_GiB"] > 0 and "ssdtier/stall_s" in logged[-1]
    assert "ssdtier/forward_wait_s" in logged[-1]


def test_the_callback_checks_its_config_at_once():
    from ssdtier.integrations.hf import SsdtierCallback

    with pytest.raises(ssdtier.ConfigError, match="policy__prefetch_layers"):
        SsdtierCallback(policy__prefetch_layer=1)


# ------------------------------------------------------------------ accelerate


@pytest.mark.parametrize("when", ["before", "after"])
def test_accelerate_prepare(store_dir, when):
    """Attached to the model before Accelerator.prepare, or to accelerator.unwrap_model()
    after it; gradient accumulation through accelerator.accumulate."""
    accelerate = pytest.importorskip("accelerate")

    def run(cfg):
        torch.manual_seed(0)
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        off = ssdtier.attach(model, cfg) if cfg is not None and when == "before" else None
        model, opt = acc.prepare(model, opt)
        if cfg is not None and when == "after":
            off = ssdtier.attach(acc.unwrap_model(model), cfg)
        losses = []
        for ids in batches(4):
            with acc.accumulate(model):
                loss = loss_of(model, ids)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        stats = off.stats() if off is not None else None
        if off is not None:
            off.detach()
        return losses, [p.detach() for p in acc.unwrap_model(model).parameters()], stats

    got = run(offload_config(store_dir))
    same(run(None), got)
    assert got[2].tensors_offloaded > 0


def _padded_batches():
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 64, (2, SEQ), generator=gen), torch.ones(2, SEQ, dtype=torch.long)) for _ in range(4)]
    for _, mask in data:
        mask[1, SEQ - 5 :] = 0  # the second sample padded
    return data


def _padded(model, item):
    ids, mask = item
    kw = {"decoder_input_ids": ids.flip(1)} if model.config.is_encoder_decoder else {}
    return model(input_ids=ids, attention_mask=mask, labels=ids, **kw).loss


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_blocks_that_update_a_cache_run_whole_and_without_one_recompute(store_dir, monkeypatch, name):
    # transformers builds a key/value cache in training (use_cache on by default) that each
    # decoder block updates: recomputed, a block saw its own keys (T5 raised CheckpointError,
    # Llama with padding a size mismatch). Such blocks run whole, offloaded, with a warning;
    # without the cache (without_cache, as under transformers' checkpointing) they recompute.
    from ssdtier.integrations.hf import without_cache

    from .test_settled import _steady

    _steady(monkeypatch)  # offloading costly: the plans recompute what they can
    cfg, data = offload_config(store_dir, mode="adaptive", device_budget="8KiB"), _padded_batches()
    with pytest.warns(ssdtier.SsdtierWarning, match="without_cache"):
        got = train(name, cfg, data=data, loss_fn=_padded)
    same(train(name, data=data, loss_fn=_padded), got)
    assert got[2].bytes_offloaded > 0, got[2]
    # The first forward's guard chose recomputation before the cache was seen: not counted.
    assert name != "llama" or got[2].guard_recomputed == 0, got[2]
    cached = got[2].plan.actions

    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*key/value cache", ssdtier.SsdtierWarning)
        got = train(name, cfg, prepare=without_cache, data=data, loss_fn=_padded)
    same(train(name, prepare=without_cache, data=data, loss_fn=_padded), got)
    assert sum(a.recomputes for a in got[2].plan.actions) > sum(a.recomputes for a in cached), (cached, got[2])
