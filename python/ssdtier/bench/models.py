"""Small self-contained transformer models used to exercise activation offloading.

Three families, written in plain PyTorch with ordinary ops so that autograd saves
many ordinary tensors (views and transposes included):

* :class:`GPT`: decoder-only, pre-LayerNorm, causal attention; blocks in ``blocks``.
* :class:`BertEncoder`: bidirectional post-LayerNorm encoder with an MLM head;
  blocks in ``layers``.
* :class:`T5Model`: encoder-decoder with hand-written RMSNorm; blocks in
  ``encoder_blocks`` and ``decoder_blocks``.

Construction is deterministic given ``torch.manual_seed``. Dropout masks come from
the global RNG, and every op used is deterministic on CPU, so a forward and backward
pass repeated with the same seeds is bit-identical. With ``checkpoint=True`` (or
``checkpoint_every=1``) every block is run through non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, which restores the RNG state on recomputation,
so gradients equal those without it; ``checkpoint_every=k`` checkpoints blocks 0, k, 2k...
With ``selective=True`` a checkpointed block keeps its matmul and attention outputs and
recomputes only the cheap ops between them (:func:`selective_checkpoint_context`).

``gpt_batch``, ``bert_batch`` and ``t5_batch`` (or :func:`make_batch`) make random
batches whose tuples unpack straight into the model's ``forward``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _checkpoint

__all__ = [
    "BertConfig",
    "BertEncoder",
    "BertLayer",
    "GPT",
    "GPTBlock",
    "GPTConfig",
    "MLP",
    "ModelConfig",
    "MultiHeadAttention",
    "RMSNorm",
    "T5Config",
    "T5DecoderBlock",
    "T5EncoderBlock",
    "T5Model",
    "batch_loss",
    "bert_batch",
    "build_model",
    "gpt_batch",
    "make_batch",
    "selective_checkpoint_context",
    "t5_batch",
]

IGNORE_INDEX = -100


def _check_common(vocab_size: int, seq_len: int, d_model: int, n_heads: int, dropout: float) -> None:
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if d_model < 1 or n_heads < 1 or d_model % n_heads != 0:
        raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


def _check_checkpoint_every(every: int) -> None:
    if every < 0:
        raise ValueError(f"checkpoint_every must be >= 0 (0: none, 1: every block), got {every}")


@dataclass
class _StackConfig:
    """Fields shared by the single-stack models (GPT, BERT). ``d_ff=None`` means ``4 * d_model``."""

    vocab_size: int = 512
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.1
    tie_embeddings: bool = True
    checkpoint: bool = False  # the same as checkpoint_every=1
    checkpoint_every: int = 0  # 0: no block checkpointed; k: blocks 0, k, 2k...
    selective: bool = False  # checkpointed blocks keep matmul and attention outputs

    def __post_init__(self) -> None:
        _check_common(self.vocab_size, self.seq_len, self.d_model, self.n_heads, self.dropout)
        _check_checkpoint_every(self.checkpoint_every)
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model


@dataclass
class GPTConfig(_StackConfig):
    """Configuration of :class:`GPT`. ``d_ff=None`` means ``4 * d_model``. ``sdpa=True``
    attends with ``F.scaled_dot_product_attention`` (a fused kernel on a GPU, flash or
    cuDNN, which saves no T x T scores) instead of plain ops."""

    sdpa: bool = False


@dataclass
class BertConfig(_StackConfig):
    """Configuration of :class:`BertEncoder`. Token id ``vocab_size - 1`` is [MASK]."""

    n_segments: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_segments < 1:
            raise ValueError(f"n_segments must be >= 1, got {self.n_segments}")

    @property
    def mask_token_id(self) -> int:
        """Id of the [MASK] token (the last one in the vocabulary)."""
        return self.vocab_size - 1


@dataclass
class T5Config:
    """Configuration of :class:`T5Model`. ``seq_len`` is the source length;
    ``tgt_len=None`` means ``seq_len``; ``d_ff=None`` means ``4 * d_model``."""

    vocab_size: int = 512
    seq_len: int = 64
    tgt_len: int | None = None
    d_model: int = 128
    n_encoder_layers: int = 3
    n_decoder_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.1
    tie_embeddings: bool = True
    checkpoint: bool = False  # the same as checkpoint_every=1
    checkpoint_every: int = 0  # 0: no block checkpointed; k: blocks 0, k, 2k... of each stack
    selective: bool = False  # checkpointed blocks keep matmul and attention outputs

    def __post_init__(self) -> None:
        _check_common(self.vocab_size, self.seq_len, self.d_model, self.n_heads, self.dropout)
        _check_checkpoint_every(self.checkpoint_every)
        if self.n_encoder_layers < 1 or self.n_decoder_layers < 1:
            raise ValueError("n_encoder_layers and n_decoder_layers must be >= 1")
        if self.tgt_len is None:
            self.tgt_len = self.seq_len
        if self.tgt_len < 1:
            raise ValueError(f"tgt_len must be >= 1, got {self.tgt_len}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model


ModelConfig = GPTConfig | BertConfig | T5Config


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * inv).type_as(x) * self.weight


class MultiHeadAttention(nn.Module):
    """Multi-head attention from plain ops: matmul, masked_fill, softmax, dropout; or with
    ``sdpa=True`` one ``F.scaled_dot_product_attention`` call.

    Self-attention (fused ``qkv`` projection) unless ``cross=True``, in which case
    queries come from ``x`` (``q``) and keys/values from ``context`` (``kv``).
    ``max_len`` bounds the query/key lengths of the causal mask.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        *,
        causal: bool,
        max_len: int,
        cross: bool = False,
        bias: bool = True,
        sdpa: bool = False,
    ) -> None:
        super().__init__()
        self.sdpa = sdpa
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.causal = causal
        self.cross = cross
        if cross:
            self.q = nn.Linear(d_model, d_model, bias=bias)
            self.kv = nn.Linear(d_model, 2 * d_model, bias=bias)
        else:
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        if causal and not sdpa:  # SDPA's is_causal needs none (at 16k tokens it would be 256 MiB a block)
            mask = torch.ones(max_len, max_len, dtype=torch.bool).tril()
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs a context tensor")
            q = self.q(x)
            k, v = self.kv(context).split(c, dim=2)
        else:
            q, k, v = self.qkv(x).split(c, dim=2)
        s = k.shape[1]
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        if self.sdpa:  # GPT's self-attention: square, so is_causal is its causal mask
            p = self.attn_drop.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
            return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            att = att.masked_fill(~self.causal_mask[:t, :s], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Two-layer feed-forward network with GELU (or ReLU) and output dropout."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, *, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.act = nn.GELU() if act == "gelu" else nn.ReLU()
        self.out = nn.Linear(d_ff, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.out(self.act(self.fc(x))))


def _init_weights(module: nn.Module, std: float = 0.02) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, (nn.LayerNorm, RMSNorm)):
        nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


# What selective checkpointing keeps: the outputs of the ops that cost the most FLOPs per
# byte saved (matmuls, fused attention). The pointwise ops between them are recomputed.
_SAVED_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
)  # fmt: skip


@functools.cache
def _saved_ops() -> frozenset[object]:
    return frozenset(getattr(torch.ops.aten, name).default for name in _SAVED_OPS if hasattr(torch.ops.aten, name))


def _sac_policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> tuple[object, object]:
    """``context_fn`` of a non-reentrant :func:`torch.utils.checkpoint.checkpoint` that keeps
    the outputs of matmuls and attention and recomputes the rest (selective activation
    checkpointing, as torchtitan's op-level policy does)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_sac_policy)


def _run_block(config: ModelConfig, i: int, block: nn.Module, *args: Tensor) -> Tensor:
    """Block ``i`` of its stack, checkpointed as ``config`` says."""
    every = 1 if config.checkpoint else config.checkpoint_every
    if every and i % every == 0 and torch.is_grad_enabled():
        if config.selective:
            return _checkpoint(block, *args, use_reentrant=False, context_fn=selective_checkpoint_context)
        return _checkpoint(block, *args, use_reentrant=False)
    return block(*args)


def _check_len(name: str, t: int, limit: int) -> None:
    if t > limit:
        raise ValueError(f"{name} length {t} exceeds the configured maximum {limit}")


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


# ---------------------------------------------------------------------------
# GPT
# ---------------------------------------------------------------------------


class GPTBlock(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention then GELU MLP, with residuals."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.dropout, causal=True, max_len=cfg.seq_len, sdpa=cfg.sdpa
        )
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model; blocks in ``self.blocks``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(_init_weights)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is None unless ``targets`` is given."""
        _, t = idx.shape
        _check_len("sequence", t, self.config.seq_len)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = _run_block(self.config, i, block, x)
        logits = self.lm_head(self.ln_f(x))
        loss = _lm_loss(logits, targets) if targets is not None else None
        return logits, loss

    def num_params(self) -> int:
        """Number of distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Approximate training FLOPs per token: 6 * params plus the attention term."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layers * c.d_model * c.seq_len


# ---------------------------------------------------------------------------
# BERT
# ---------------------------------------------------------------------------


class BertLayer(nn.Module):
    """Post-LayerNorm bidirectional encoder layer."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.dropout, causal=False, max_len=cfg.seq_len)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class BertEncoder(nn.Module):
    """BERT-style masked language model; layers in ``self.layers``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.seg_emb = nn.Embedding(config.n_segments, config.d_model)
        self.emb_ln = nn.LayerNorm(config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))
        self.mlm_dense = nn.Linear(config.d_model, config.d_model)
        self.mlm_act = nn.GELU()
        self.mlm_ln = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=True)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(_init_weights)

    def forward(self, idx: Tensor, labels: Tensor, segment_ids: Tensor | None = None) -> Tensor:
        """Return the MLM cross-entropy over positions whose label is not -100.

        Without ``segment_ids`` the first half of each sequence is segment 0 and
        the second half segment ``n_segments - 1`` (sentence A / sentence B).
        """
        _, t = idx.shape
        _check_len("sequence", t, self.config.seq_len)
        pos = torch.arange(t, device=idx.device)
        if segment_ids is None:
            segment_ids = torch.where(pos < (t + 1) // 2, 0, self.config.n_segments - 1)
        x = self.tok_emb(idx) + self.pos_emb(pos) + self.seg_emb(segment_ids)
        x = self.drop(self.emb_ln(x))
        for i, layer in enumerate(self.layers):
            x = _run_block(self.config, i, layer, x)
        h = self.mlm_ln(self.mlm_act(self.mlm_dense(x)))
        return _lm_loss(self.lm_head(h), labels)


# ---------------------------------------------------------------------------
# T5
# ---------------------------------------------------------------------------


class T5EncoderBlock(nn.Module):
    """Pre-RMSNorm bidirectional encoder block (bias-free linears, ReLU MLP)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.dropout, causal=False, max_len=cfg.seq_len, bias=False
        )
        self.norm2 = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.dropout, act="relu", bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class T5DecoderBlock(nn.Module):
    """Pre-RMSNorm decoder block: causal self-attention, cross-attention, ReLU MLP."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        assert cfg.tgt_len is not None
        max_len = max(cfg.seq_len, cfg.tgt_len)
        self.norm1 = RMSNorm(cfg.d_model)
        self.self_attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.dropout, causal=True, max_len=cfg.tgt_len, bias=False
        )
        self.norm2 = RMSNorm(cfg.d_model)
        self.cross_attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.dropout, causal=False, max_len=max_len, cross=True, bias=False
        )
        self.norm3 = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.dropout, act="relu", bias=False)

    def forward(self, x: Tensor, enc: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), enc)
        return x + self.mlp(self.norm3(x))


class T5Model(nn.Module):
    """Encoder-decoder model with a shared embedding and tied head.

    Blocks are in ``self.encoder_blocks`` and ``self.decoder_blocks``. Positions
    use simple learned embeddings (no relative position bias).
    """

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        assert config.tgt_len is not None
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.enc_pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.dec_pos_emb = nn.Embedding(config.tgt_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.encoder_blocks = nn.ModuleList(T5EncoderBlock(config) for _ in range(config.n_encoder_layers))
        self.enc_norm = RMSNorm(config.d_model)
        self.decoder_blocks = nn.ModuleList(T5DecoderBlock(config) for _ in range(config.n_decoder_layers))
        self.dec_norm = RMSNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.shared.weight
        self.apply(_init_weights)

    def encode(self, src: Tensor) -> Tensor:
        """Run the encoder; returns the normalised encoder output."""
        _, s = src.shape
        _check_len("source", s, self.config.seq_len)
        x = self.drop(self.shared(src) + self.enc_pos_emb(torch.arange(s, device=src.device)))
        for i, block in enumerate(self.encoder_blocks):
            x = _run_block(self.config, i, block, x)
        return self.drop(self.enc_norm(x))

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        """Return the cross-entropy of predicting ``tgt_out`` from ``src`` and ``tgt_in``."""
        enc = self.encode(src)
        _, t = tgt_in.shape
        assert self.config.tgt_len is not None
        _check_len("target", t, self.config.tgt_len)
        x = self.drop(self.shared(tgt_in) + self.dec_pos_emb(torch.arange(t, device=tgt_in.device)))
        for i, block in enumerate(self.decoder_blocks):
            x = _run_block(self.config, i, block, x, enc)
        x = self.drop(self.dec_norm(x))
        if self.config.tie_embeddings:
            x = x * (self.config.d_model**-0.5)
        return _lm_loss(self.lm_head(x), tgt_out)


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------


def _gen_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def _randint(high: int, shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
    return torch.randint(0, high, shape, generator=generator, device=_gen_device(generator))


def _to(t: Tensor, device: torch.device | str | None) -> Tensor:
    return t if device is None else t.to(device)


def gpt_batch(
    config: GPTConfig,
    batch_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Random ``(idx, targets)`` of shape ``(batch_size, seq_len)``; targets are idx shifted by one."""
    tokens = _randint(config.vocab_size, (batch_size, config.seq_len + 1), generator)
    return _to(tokens[:, :-1].contiguous(), device), _to(tokens[:, 1:].contiguous(), device)


def bert_batch(
    config: BertConfig,
    batch_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    mask_prob: float = 0.15,
) -> tuple[Tensor, Tensor]:
    """Random ``(idx, labels)``: about ``mask_prob`` of positions (at least one per row)
    are replaced by [MASK] in ``idx`` and carry their original id in ``labels``; the
    other labels are -100."""
    shape = (batch_size, config.seq_len)
    dev = _gen_device(generator)
    tokens = _randint(config.mask_token_id, shape, generator)  # ids below [MASK]
    chosen = torch.rand(shape, generator=generator, device=dev) < mask_prob
    forced = _randint(config.seq_len, (batch_size,), generator)
    chosen[torch.arange(batch_size, device=dev), forced] = True
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE_INDEX))
    idx = tokens.masked_fill(chosen, config.mask_token_id)
    return _to(idx, device), _to(labels, device)


def t5_batch(
    config: T5Config,
    batch_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``(src, tgt_in, tgt_out)``; ``tgt_in`` is ``tgt_out`` shifted right after token 0."""
    assert config.tgt_len is not None
    src = _randint(config.vocab_size, (batch_size, config.seq_len), generator)
    tgt_out = _randint(config.vocab_size, (batch_size, config.tgt_len), generator)
    tgt_in = torch.cat([torch.zeros_like(tgt_out[:, :1]), tgt_out[:, :-1]], dim=1)
    return _to(src, device), _to(tgt_in, device), _to(tgt_out, device)


def make_batch(
    config: ModelConfig,
    batch_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, ...]:
    """Random batch for any config; unpack it into the model: ``model(*batch)``."""
    if isinstance(config, GPTConfig):
        return gpt_batch(config, batch_size, generator, device)
    if isinstance(config, BertConfig):
        return bert_batch(config, batch_size, generator, device)
    if isinstance(config, T5Config):
        return t5_batch(config, batch_size, generator, device)
    raise TypeError(f"unknown model config type {type(config).__name__}")


def batch_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    """Run ``model(*batch)`` and return the scalar loss, for any of the three families."""
    out = model(*batch)
    if isinstance(out, tuple):  # GPT returns (logits, loss)
        out = out[1]
    if out is None:
        raise ValueError("the batch has no targets, so the model returned no loss")
    return out


def build_model(config: ModelConfig) -> nn.Module:
    """Construct the model that matches ``config``."""
    if isinstance(config, GPTConfig):
        return GPT(config)
    if isinstance(config, BertConfig):
        return BertEncoder(config)
    if isinstance(config, T5Config):
        return T5Model(config)
    raise TypeError(f"unknown model config type {type(config).__name__}")
