"""ssdtier.bench.models: tiny GPT / BERT / T5 train, are bit-reproducible on CPU (with and
without activation checkpointing, which must not change the gradients), tie their
heads, name their block lists as documented and run under bf16 autocast."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ssdtier.bench import models
from ssdtier.bench.models import (
    GPT,
    BertConfig,
    BertEncoder,
    BertLayer,
    GPTBlock,
    GPTConfig,
    T5Config,
    T5DecoderBlock,
    T5EncoderBlock,
    T5Model,
    batch_loss,
    bert_batch,
    build_model,
    gpt_batch,
    make_batch,
    t5_batch,
)

FAMILIES = ["gpt", "bert", "t5"]
BATCH = 3


def tiny_config(family: str, **overrides: object) -> models.ModelConfig:
    if family == "gpt":
        return GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=4, **overrides)
    if family == "bert":
        return BertConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=4, **overrides)
    if family == "t5":
        return T5Config(
            vocab_size=97,
            seq_len=16,
            tgt_len=12,
            d_model=32,
            n_encoder_layers=3,
            n_decoder_layers=2,
            n_heads=4,
            **overrides,
        )
    raise AssertionError(family)


def build(family: str, seed: int = 0, **overrides: object) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(tiny_config(family, **overrides)).train()


def batch_for(model: nn.Module, seed: int = 1234) -> tuple[torch.Tensor, ...]:
    return make_batch(model.config, BATCH, torch.Generator().manual_seed(seed))


def run_step(model: nn.Module, batch: tuple[torch.Tensor, ...], seed: int = 7):
    """Forward + backward from a fixed global seed; returns (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = batch_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_grads_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] is not None and b[name] is not None, name
        assert torch.equal(a[name], b[name]), f"grad of {name} differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_train_step(family: str) -> None:
    model = build(family)
    batch = batch_for(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss, grads = run_step(model, batch)
    assert math.isfinite(loss.item())
    # Random tokens: the initial loss is near log(vocab).
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 1.0
    for name, g in grads.items():
        assert g is not None, f"{name} got no gradient"
        assert torch.isfinite(g).all(), name
        assert g.abs().sum() > 0, f"{name} got an all-zero gradient"
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("family", FAMILIES)
def test_twins_are_bit_identical(family: str, checkpoint: bool) -> None:
    a = build(family, checkpoint=checkpoint)
    b = build(family, checkpoint=checkpoint)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    batch = batch_for(a)
    loss_a, grads_a = run_step(a, batch)
    loss_b, grads_b = run_step(b, batch)
    assert torch.equal(loss_a, loss_b)
    assert_grads_equal(grads_a, grads_b)
    # Running the same model again is also bit-identical.
    loss_a2, grads_a2 = run_step(a, batch)
    assert torch.equal(loss_a, loss_a2)
    assert_grads_equal(grads_a, grads_a2)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_matches_plain(family: str) -> None:
    plain = build(family, checkpoint=False)
    ckpt = build(family, checkpoint=True)
    batch = batch_for(plain)
    loss_p, grads_p = run_step(plain, batch)
    rng_after_plain = torch.get_rng_state()
    loss_c, grads_c = run_step(ckpt, batch)
    # Recomputation must not disturb the global RNG stream either.
    assert torch.equal(rng_after_plain, torch.get_rng_state())
    assert torch.equal(loss_p, loss_c)
    assert_grads_equal(grads_p, grads_c)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_saves_fewer_tensors(family: str) -> None:
    def count_saved(model: nn.Module) -> int:
        n = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal n
            n += 1
            return t

        batch = batch_for(model)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = batch_loss(model, batch)
        loss.backward()
        return n

    plain, ckpt = count_saved(build(family)), count_saved(build(family, checkpoint=True))
    assert 0 < ckpt < plain


CHECKPOINTING = {
    "every 2": {"checkpoint_every": 2},
    "selective": {"checkpoint_every": 1, "selective": True},
    "selective every 2": {"checkpoint_every": 2, "selective": True},
}


@pytest.mark.parametrize("how", CHECKPOINTING)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_kth_and_selective_checkpointing_match_plain(family: str, how: str) -> None:
    plain, ckpt = build(family), build(family, **CHECKPOINTING[how])
    batch = batch_for(plain)
    loss_p, grads_p = run_step(plain, batch)
    loss_c, grads_c = run_step(ckpt, batch)
    assert torch.equal(loss_p, loss_c)
    assert_grads_equal(grads_p, grads_c)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kth_block_checkpointed_saves_between_none_and_all(family: str) -> None:
    def count_saved(model: nn.Module) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = batch_loss(model, batch_for(model))
        loss.backward()
        return len(saved)

    every = [count_saved(build(family, checkpoint_every=k)) for k in (0, 2, 1)]
    assert every[0] > every[1] > every[2] > 0
    assert count_saved(build(family, checkpoint=True)) == every[2]  # checkpoint=True: every block
    with pytest.raises(ValueError, match="checkpoint_every"):
        tiny_config(family, checkpoint_every=-1)


def test_selective_checkpointing_keeps_matmuls_and_recomputes_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    seen: dict[str, set[str]] = {"save": set(), "recompute": set()}
    policy = models._sac_policy

    def spy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        got = policy(ctx, op, *args, **kwargs)
        seen["save" if got is CheckpointPolicy.MUST_SAVE else "recompute"].add(str(op))
        return got

    monkeypatch.setattr(models, "_sac_policy", spy)
    model = build("gpt", checkpoint_every=1, selective=True)
    batch_loss(model, batch_for(model)).backward()
    assert {"aten.mm.default", "aten.bmm.default"} & seen["save"], seen
    assert any("gelu" in op for op in seen["recompute"]) and not any("mm" in op for op in seen["recompute"])


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_is_active_in_train_mode(family: str) -> None:
    model = build(family, dropout=0.1)
    batch = batch_for(model)
    torch.manual_seed(1)
    l1 = batch_loss(model, batch)
    torch.manual_seed(2)
    l2 = batch_loss(model, batch)
    assert not torch.equal(l1, l2)
    model.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        e1 = batch_loss(model, batch)
        torch.manual_seed(2)
        e2 = batch_loss(model, batch)
    assert torch.equal(e1, e2)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_sdpa(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("scaled_dot_product_attention must not be used")

    monkeypatch.setattr(F, "scaled_dot_product_attention", boom)
    model = build(family)
    batch_loss(model, batch_for(model)).backward()


def test_gpt_with_sdpa_matches_plain_attention() -> None:
    # One fused kernel instead of matmul, softmax, matmul: the same function up to rounding
    # (the softmax is computed another way), causal, and it saves no T x T scores.
    torch.manual_seed(0)
    plain = build_model(GPTConfig(n_layers=2, dropout=0.0))
    fused = build_model(GPTConfig(n_layers=2, dropout=0.0, sdpa=True))
    fused.load_state_dict(plain.state_dict())
    idx, tgt = gpt_batch(plain.config, 2, torch.Generator().manual_seed(0))
    a, b = plain(idx, tgt)[1], fused(idx, tgt)[1]
    torch.testing.assert_close(a, b)
    t = plain.config.seq_len
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        fused(idx, tgt)
    assert not any(s[-2:] == (t, t) for s in saved)
    assert not hasattr(fused.blocks[0].attn, "causal_mask")  # is_causal needs no T x T mask
    logits = fused(idx[:, :5])[0]
    idx2 = idx[:, :5].clone()
    idx2[:, 4] = (idx2[:, 4] + 1) % plain.config.vocab_size
    assert torch.equal(logits[:, :4], fused(idx2)[0][:, :4])


def test_tied_heads() -> None:
    gpt = build("gpt")
    assert gpt.lm_head.weight is gpt.tok_emb.weight
    assert gpt.lm_head.bias is None
    bert = build("bert")
    assert bert.lm_head.weight is bert.tok_emb.weight
    t5 = build("t5")
    assert t5.lm_head.weight is t5.shared.weight

    untied = build("gpt", tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied = sum(p.numel() for p in gpt.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 97 * 32
    assert gpt.flops_per_token() > 6 * n_tied


def test_block_lists() -> None:
    cases = [
        (build("gpt"), {"blocks": (GPTBlock, 2)}),
        (build("bert"), {"layers": (BertLayer, 2)}),
        (build("t5"), {"encoder_blocks": (T5EncoderBlock, 3), "decoder_blocks": (T5DecoderBlock, 2)}),
    ]
    for model, expected in cases:
        lists = {n: m for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
        assert set(lists) == set(expected)
        for name, (cls, n) in expected.items():
            lst = getattr(model, name)
            assert isinstance(lst, nn.ModuleList) and len(lst) == n
            assert all(type(b) is cls for b in lst)
    # With the default config the T5 encoder is the largest ModuleList.
    cfg = T5Config()
    assert (cfg.n_encoder_layers, cfg.n_decoder_layers) == (3, 2)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast(family: str, checkpoint: bool) -> None:
    model = build(family, checkpoint=checkpoint)
    batch = batch_for(model)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*batch)
        loss = out[1] if isinstance(out, tuple) else out
    if family == "gpt":
        assert out[0].dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_checkpoint_matches_plain(family: str) -> None:
    results = []
    for checkpoint in (False, True):
        model = build(family, checkpoint=checkpoint)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(run_step(model, batch_for(model)))
    (loss_p, grads_p), (loss_c, grads_c) = results
    assert torch.equal(loss_p, loss_c)
    assert_grads_equal(grads_p, grads_c)


def test_gpt_forward_without_targets_and_short_sequences() -> None:
    model = build("gpt").eval()
    idx, _ = gpt_batch(model.config, 2, torch.Generator().manual_seed(0))
    logits, loss = model(idx[:, :5])
    assert loss is None and logits.shape == (2, 5, 97)
    # Causality: a later token does not change earlier logits.
    idx2 = idx[:, :5].clone()
    idx2[:, 4] = (idx2[:, 4] + 1) % 97
    logits2, _ = model(idx2)
    assert torch.equal(logits[:, :4], logits2[:, :4])
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_batches() -> None:
    g = GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_heads=4)
    idx, tgt = gpt_batch(g, 4, torch.Generator().manual_seed(3))
    assert idx.shape == tgt.shape == (4, 16) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], tgt[:, :-1])
    again = gpt_batch(g, 4, torch.Generator().manual_seed(3))
    assert torch.equal(idx, again[0]) and torch.equal(tgt, again[1])

    b = BertConfig(vocab_size=97, seq_len=32, d_model=32, n_heads=4)
    idx, labels = bert_batch(b, 64, torch.Generator().manual_seed(3))
    chosen = labels != -100
    assert chosen.any(dim=1).all()
    assert 0.10 < chosen.float().mean().item() < 0.22
    assert (idx[chosen] == b.mask_token_id).all()
    assert (idx[~chosen] < b.mask_token_id).all() and (labels[chosen] < b.mask_token_id).all()

    t = T5Config(vocab_size=97, seq_len=16, tgt_len=8, d_model=32, n_heads=4)
    src, tgt_in, tgt_out = t5_batch(t, 2, torch.Generator().manual_seed(3))
    assert src.shape == (2, 16) and tgt_in.shape == tgt_out.shape == (2, 8)
    assert (tgt_in[:, 0] == 0).all() and torch.equal(tgt_in[:, 1:], tgt_out[:, :-1])

    with pytest.raises(TypeError):
        make_batch(object(), 2, None)  # type: ignore[arg-type]


def test_defaults_and_validation() -> None:
    assert GPTConfig().d_ff == 4 * 128 and GPTConfig().dropout == 0.1 and GPTConfig().tie_embeddings
    assert T5Config(seq_len=8).tgt_len == 8
    assert isinstance(build_model(GPTConfig(n_layers=1)), GPT)
    assert isinstance(build_model(BertConfig(n_layers=1)), BertEncoder)
    assert isinstance(build_model(T5Config(n_encoder_layers=1, n_decoder_layers=1)), T5Model)
    with pytest.raises(ValueError):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError):
        BertConfig(dropout=1.0)
    with pytest.raises(ValueError):
        T5Config(n_decoder_layers=0)
    assert set(models.__all__) <= set(dir(models))
