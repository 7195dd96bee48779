"""attach(model): gradients bit-identical (torch.equal) to a twin model built
from the same seed and run without ssdtier, across model families, training
patterns and store configurations."""

from __future__ import annotations

import contextlib
import copy
import gc
import re
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ssdtier
from ssdtier.bench.models import BertConfig, GPTConfig, T5Config, batch_loss, build_model, make_batch
from ssdtier.offload.entry import Reading, Writing
from ssdtier.sizes import format_size

from .conftest import store_config

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4)
CONFIGS = {
    "gpt": GPTConfig(n_layers=3, **TINY),
    "bert": BertConfig(n_layers=3, **TINY),
    "t5": T5Config(n_encoder_layers=3, n_decoder_layers=2, **TINY),
}


def offload_config(path, host="64KiB", zero_copy=True, **policy):
    """Everything goes through NVMe: a tiny arena, no size floor, no kept layer.
    With `zero_copy` off, CPU tensors are copied into the arena as CUDA ones are."""
    cfg = store_config(path, host=host, zero_copy=zero_copy)
    cfg["policy"] = {"min_tensor_bytes": 0, "keep_last_layers": 0, "mode": "all", **policy}
    return cfg


def train(
    model_cfg,
    ssd_cfg=None,
    micro=3,
    batch=2,
    autocast=False,
    backward=None,
    wrap=None,
    sizes=None,
    on_step=None,
    prepare=None,
):
    """Build from seed 0, run `micro` micro-batches of gradient accumulation (or one of each
    of `sizes`) with seed 1 for dropout; returns losses, grads and the offloader's stats.
    `prepare(model)` runs before attaching (each block compiled, say), `wrap` (e.g.
    torch.compile) after; `on_step(offloader)` runs after each backward."""
    torch.manual_seed(0)
    model = build_model(model_cfg)
    if prepare is not None:
        prepare(model)
    gen = torch.Generator().manual_seed(2)
    batches = [make_batch(model_cfg, b, gen) for b in sizes or [batch] * micro]
    off = ssdtier.attach(model, ssd_cfg) if ssd_cfg is not None else None
    runner = wrap(model) if wrap is not None else model
    torch.manual_seed(1)
    losses = []
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for b in batches:
        with ctx:
            loss = batch_loss(runner, b)
        (backward or (lambda x: x.backward()))(loss)
        losses.append(loss.detach())
        if on_step is not None:
            on_step(off)
    grads = {n: p.grad for n, p in model.named_parameters()}
    stats = off.stats() if off else None
    if off:
        off.detach()
    return losses, grads, stats


def assert_same(a, b):
    la, ga, _ = a
    lb, gb, _ = b
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y), (x, y)
    assert ga.keys() == gb.keys()
    for name in ga:
        if ga[name] is None:
            assert gb[name] is None, name
        else:
            assert torch.equal(ga[name], gb[name]), name


def test_two_forwards_then_one_backward(store_dir):
    """Both forwards' windows start at their ends; the backward of the second comes first.
    The first one's sweep, begun but not unpacked when the second forward starts, is not
    taken for a finished backward."""
    ref_model = build_model(CONFIGS["gpt"])
    model = build_model(CONFIGS["gpt"])
    model.load_state_dict(ref_model.state_dict())
    gen = torch.Generator().manual_seed(3)
    a, b = make_batch(CONFIGS["gpt"], 2, gen), make_batch(CONFIGS["gpt"], 2, gen)
    torch.manual_seed(1)
    (batch_loss(ref_model, a) + batch_loss(ref_model, b)).backward()
    with ssdtier.attach(model, offload_config(store_dir, prefetch_layers="auto")) as off:
        for _ in range(3):
            model.zero_grad()
            torch.manual_seed(1)
            (batch_loss(model, a) + batch_loss(model, b)).backward()
            for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)
        s = off.stats()
    # Reads happen only for what the window does not hold at a forward's end: not asserted.
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0


def test_keep_last_layers_auto(store_dir):
    """ "auto" keeps no block on the CPU when the read-ahead is a byte window (it starts at the
    forward's end), and one with whole layers read ahead."""
    model = build_model(CONFIGS["gpt"])
    for prefetch, kept in (("auto", 0), (2, 1)):
        with ssdtier.attach(model, offload_config(store_dir, keep_last_layers="auto", prefetch_layers=prefetch)) as off:
            assert off.stats().layers_kept == kept


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_exact_gradients_through_nvme(store_dir, family, zero_copy):
    ref = train(CONFIGS[family])
    got = train(CONFIGS[family], offload_config(store_dir, zero_copy=zero_copy))
    assert_same(ref, got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0 and s.bytes_read_nvme > 0
    # Every stack of blocks is offloaded: T5's 3 encoder and 2 decoder blocks.
    assert s.layers_offloaded == (5 if family == "t5" else 3) and s.layers_kept == 0
    assert s.store.entries == 0, "every entry is freed once its graph is gone"


def test_an_encoder_decoder_offloads_both_stacks(store_dir):
    from ssdtier.offload import find_stacks

    model = build_model(CONFIGS["t5"])
    assert [p for p, _ in find_stacks(model)] == ["encoder_blocks", "decoder_blocks"]
    # Keeping one block, only the last decoder block (and what follows) stays.
    ref = train(CONFIGS["t5"])
    cfg = offload_config(store_dir, keep_last_layers=1)
    got = train(CONFIGS["t5"], cfg)
    assert_same(ref, got)
    s = got[2]
    assert (s.layers_offloaded, s.layers_kept) == (4, 1)
    # Before, every block after the largest stack was "after the layers" and kept: the whole decoder.
    decoder_only = train(CONFIGS["t5"], {**cfg, "policy": {**cfg["policy"], "layers": "encoder_blocks"}})[2]
    assert s.bytes_offloaded > decoder_only.bytes_offloaded
    assert s.bytes_kept < decoder_only.bytes_kept + s.bytes_offloaded - decoder_only.bytes_offloaded


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
@pytest.mark.parametrize("backend", ["io_uring", "posix"])
def test_both_backends(store_dir, backend, zero_copy):
    cfg = offload_config(store_dir, zero_copy=zero_copy)
    cfg["io"]["backend"] = backend
    assert_same(train(CONFIGS["gpt"]), train(CONFIGS["gpt"], cfg))


def test_large_arena_forwards_everything_without_reads(store_dir):
    got = train(CONFIGS["gpt"], offload_config(store_dir, host="64MiB", zero_copy=False))
    assert_same(train(CONFIGS["gpt"]), got)
    s = got[2]
    assert s.bytes_read_nvme == 0 and s.forwarded > 0 and s.stall_seconds == 0.0


def test_zero_copy_skips_the_arena_and_forwards_while_writing(store_dir):
    cfg = offload_config(store_dir, host="64MiB")
    # A slow disk: the writes (about 320 KB, so 1.2 s of them) outlast the forward and most of
    # the backward, so most unpacks are served from the sources still held; the first few
    # writes finish and are read back. (At 2 MB/s a loaded machine's slower forward let most
    # writes finish: half the unpacks were forwarded only about half the time.)
    cfg["io"]["throttle"] = "256KB"
    got = train(CONFIGS["gpt"], cfg, micro=1)
    assert_same(train(CONFIGS["gpt"], micro=1), got)
    s = got[2]
    assert s.store.host_peak == 0, "the arena was not used"
    assert s.store.zero_copy_puts == s.tensors_offloaded > 0
    assert s.forwarded >= s.tensors_offloaded // 2, (s.forwarded, s.tensors_offloaded)
    assert s.store.nvme_hits + s.forwarded >= s.tensors_offloaded
    # Written from their own pages: the first page's bytes before the data go too.
    assert s.bytes_written_nvme >= s.bytes_offloaded


def test_a_cpu_model_under_zero_copy_does_not_pin_the_arena(store_dir):
    model = build_model(CONFIGS["gpt"])
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        assert off.config.io.fixed_buffers is False and off.store.fixed_buffers is False
    with ssdtier.attach(model, offload_config(store_dir, zero_copy=False)) as off:
        assert off.config.io.fixed_buffers is True  # as configured (the kernel may still refuse)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
def test_nothing_is_held_once_the_graph_is_gone(store_dir, zero_copy):
    """After each backward the offloader's own bookkeeping is empty again: no entry, no
    layer group, no dedup record, no restored storage counted as resident, and the store
    has no key."""
    torch.manual_seed(0)
    model = build_model(CONFIGS["gpt"])
    gen = torch.Generator().manual_seed(2)
    with ssdtier.attach(model, offload_config(store_dir, zero_copy=zero_copy)) as off:
        for _ in range(3):
            batch_loss(model, make_batch(CONFIGS["gpt"], 2, gen)).backward()
            off.store.flush()
            off.cpu.poll()
            assert (
                off.entries.live == 0
                and not off.entries.by_layer
                and not off.cpu.writing
                and not off.entries.by_storage
            )
            assert off.res.restored == 0 and not off.res.tracked
            assert off.store.stats().entries == 0
        assert off.stats().peak_resident_bytes > 0


@pytest.mark.parametrize("prefetch", [None, 2])
def test_default_policy_keeps_small_tensors(store_dir, prefetch):
    """The default read-ahead is the byte window, which keeps no block on the CPU; with
    whole layers the last block is kept. The default mode, "auto", is "all" on the CPU."""
    cfg = store_config(store_dir)
    cfg["policy"] = {"min_tensor_bytes": "4KiB"} | ({"prefetch_layers": prefetch} if prefetch else {})
    got = train(GPTConfig(n_layers=4, **{**TINY, "d_model": 64}), cfg)
    assert_same(train(GPTConfig(n_layers=4, **{**TINY, "d_model": 64})), got)
    s = got[2]
    assert s.plan is None  # no adaptive plan
    kept = 0 if prefetch is None else 1
    assert s.layers_kept == kept and s.layers_offloaded == 4 - kept
    assert s.tensors_kept > 0 and s.tensors_offloaded > 0
    assert (s.prefetch_layers, s.prefetch_bytes > 0) == ((0, True) if prefetch is None else (2, False))


def test_bf16_autocast(store_dir):
    got = train(CONFIGS["gpt"], offload_config(store_dir), autocast=True)
    assert_same(train(CONFIGS["gpt"], autocast=True), got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0 and s.bytes_read_nvme > 0
    # Less than the float32 run offloads: the bfloat16 activations went through the store too.
    assert s.bytes_offloaded < train(CONFIGS["gpt"], offload_config(store_dir))[2].bytes_offloaded


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_checkpointing_inside(store_dir, family):
    cfg = CONFIGS[family].__class__(**{**CONFIGS[family].__dict__, "checkpoint": True})
    got = train(cfg, offload_config(store_dir))
    assert_same(train(cfg), got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0 and s.bytes_read_nvme > 0


def test_reentrant_checkpointing_inside(store_dir, monkeypatch):
    # The reentrant form runs each block's forward under no_grad and again inside the
    # backward, where the offloader's hooks are off: what it saves there stays in memory.
    import torch.utils.checkpoint

    import ssdtier.bench.models

    def run_block(config, i, block, *args):
        if config.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=True)
        return block(*args)

    monkeypatch.setattr(ssdtier.bench.models, "_run_block", run_block)
    cfg = CONFIGS["gpt"].__class__(**{**CONFIGS["gpt"].__dict__, "checkpoint": True})
    got = train(cfg, offload_config(store_dir))
    assert_same(train(cfg), got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0 and s.bytes_read_nvme > 0


def test_retain_graph_unpacks_twice(store_dir):
    def twice(loss):
        loss.backward(retain_graph=True)
        loss.backward()

    ref = train(CONFIGS["bert"], backward=twice, micro=1)
    got = train(CONFIGS["bert"], offload_config(store_dir), backward=twice, micro=1)
    assert_same(ref, got)
    assert got[2].unpacks > got[2].packs - got[2].tensors_kept


def seeded(ssd):
    """As train() sets up: the GPT from seed 0, attached to ``ssd`` (if any), batches from a
    generator of seed 2, dropout from seed 1: (model, generator, offloader or None)."""
    torch.manual_seed(0)
    model = build_model(CONFIGS["gpt"])
    gen = torch.Generator().manual_seed(2)
    off = ssdtier.attach(model, ssd) if ssd else None
    torch.manual_seed(1)
    return model, gen, off


def test_several_forwards_before_one_backward(store_dir):
    def run(ssd):
        model, gen, off = seeded(ssd)
        losses = [batch_loss(model, make_batch(CONFIGS["gpt"], 2, gen)) for _ in range(3)]
        stats = None
        if off:
            # The three forwards' entries are all held at once, each in its own layer groups,
            # and (every write done) the backward reads them back from NVMe.
            wait_copies(off)
            assert {f for f, _ in off.entries.by_layer} == {1, 2, 3}
            assert {layer for _, layer in off.entries.by_layer} >= {1, 2, 3}
        sum(losses).backward()
        if off:
            stats = off.stats()
            off.detach()
        return [x.detach() for x in losses], {n: p.grad for n, p in model.named_parameters()}, stats

    got = run(offload_config(store_dir))
    assert_same(run(None), got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_read_nvme > 0 and s.store.entries == 0


def test_double_backward(store_dir, warned):
    def run(ssd):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        off = ssdtier.attach(model, ssd) if ssd else None
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
        loss = model(x).square().mean()
        if off:
            wait_copies(off)  # every write done: the first backward reads the activations back
            assert not warned("create_graph")
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        penalty.backward()
        stats = None
        if off:
            stats = off.stats()
            off.detach()
        return [loss.detach(), penalty.detach()], {n: p.grad for n, p in model.named_parameters()}, stats

    got = run(offload_config(store_dir))
    assert_same(run(None), got)
    # The input and the hidden activations (the Tanh outputs) went to NVMe and came back for
    # the first backward, whose graph (create_graph) then uses them in the second.
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_read_nvme > 0
    assert len(warned("create_graph=True")) == 1  # what they cost said once


def test_a_graph_freed_without_a_backward_lets_its_written_sources_go(store_dir):
    # autograd.grad to an intermediate, a graph cut: no backward reaches these entries to poll.
    cfg = offload_config(store_dir)
    cfg["io"]["throttle"] = "20KB"  # 0.4 s an 8 KiB write: still in flight as the forward ends
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    with ssdtier.attach(model, cfg) as off:
        loss = model(torch.randn(32, 16)).square().mean()
        assert off.cpu.writing and off.res.sources > 0
        for e in list(off.cpu.writing):
            e.out.ticket.wait()  # done, not yet seen done
        del loss
        assert off.res.sources == 0 and not off.cpu.writing


def test_no_grad_and_inference_mode_offload_nothing(store_dir):
    torch.manual_seed(0)
    model = build_model(CONFIGS["gpt"])
    batch = make_batch(CONFIGS["gpt"], 2, torch.Generator().manual_seed(0))
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        with torch.no_grad():
            model(*batch)
        with torch.inference_mode():
            model(*batch)
        s = off.stats()
        assert (s.packs, s.tensors_offloaded, s.store.host_puts) == (0, 0, 0)


def test_parameters_and_weight_transposes_are_not_offloaded(store_dir):
    lin = nn.Linear(512, 512)  # 1 MiB weight; addmm saves weight.t()
    x = torch.randn(4, 512, requires_grad=True)
    with ssdtier.attach(lin, offload_config(store_dir)) as off:
        lin(x).sum().backward()
        s = off.stats()
    # Only the input (8 KiB) is offloaded; the weight and its transpose are recognised by storage.
    assert s.bytes_offloaded == x.numel() * 4
    assert s.tensors_offloaded == 1


class _GathersItsWeight(nn.Module):
    """Gives its weight new storage inside the forward, as sharded data parallelism does when
    it gathers a parameter: the pointer seen when the forward began is stale."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(512, 512)

    def forward(self, x):
        self.lin.weight.data = self.lin.weight.data.clone()
        return self.lin(x)


def test_a_parameter_given_new_storage_inside_the_forward_is_not_offloaded(store_dir):
    torch.manual_seed(0)
    ref, model = _GathersItsWeight(), _GathersItsWeight()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(4, 512)
    ref(x.clone().requires_grad_()).sum().backward()
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        model(x.clone().requires_grad_()).sum().backward()
        s = off.stats()
    assert s.tensors_offloaded == 1 and s.bytes_offloaded == x.numel() * 4, "only the input"
    assert torch.equal(ref.lin.weight.grad, model.lin.weight.grad)


def test_tied_embeddings_stay_tied_and_exact(store_dir):
    cfg = GPTConfig(n_layers=2, tie_embeddings=True, **TINY)
    torch.manual_seed(0)
    m = build_model(cfg)
    assert m.lm_head.weight is m.tok_emb.weight
    got = train(cfg, offload_config(store_dir))
    assert_same(train(cfg), got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0 and s.bytes_read_nvme > 0


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, fail=False):
        y = self.lin(x).tanh()
        if fail:
            raise RuntimeError("boom")
        return y


def test_forward_that_raises_leaves_no_hooks_on(store_dir):
    m = Boom()
    x = torch.randn(4, 8, requires_grad=True)
    with ssdtier.attach(m, offload_config(store_dir)) as off:
        with pytest.raises(RuntimeError, match="boom"):
            m(x, fail=True)
        packs = off.stats().packs
        # Outside the model's forward our hooks are off: this saves tensors, but not through ssdtier.
        (x * x).tanh().sum().backward()
        assert off.stats().packs == packs
        # And the next forward works as usual.
        m(x).sum().backward()
        assert off.stats().packs > packs


def test_detach_restores_the_module_and_attach_twice_is_an_error(store_dir):
    m = build_model(CONFIGS["gpt"])
    before = {
        name: (dict(mod._forward_pre_hooks), dict(mod._forward_hooks), set(mod.__dict__))
        for name, mod in m.named_modules()
    }
    off = ssdtier.attach(m, offload_config(store_dir))
    with pytest.raises(ssdtier.SsdtierError, match=r"already attached .* or ssdtier.detach\(model\) if that is lost"):
        ssdtier.attach(m, offload_config(store_dir))
    with pytest.raises(TypeError, match="attach\\(\\) needs a torch.nn.Module, got function"):
        ssdtier.attach(m.forward.__func__, offload_config(store_dir))
    off.detach()
    off.detach()  # idempotent
    after = {
        name: (dict(mod._forward_pre_hooks), dict(mod._forward_hooks), set(mod.__dict__))
        for name, mod in m.named_modules()
    }
    assert before == after
    ssdtier.attach(m, offload_config(store_dir)).detach()
    # The handle lost (a notebook cell run again): the module-level detach finds it.
    ssdtier.attach(m, offload_config(store_dir))
    assert ssdtier.detach(m) and not ssdtier.detach(m)
    ssdtier.attach(m, offload_config(store_dir)).detach()


LOAD_WITHOUT_SSDTIER = """
import sys, torch
sys.modules["ssdtier"] = None  # import ssdtier now fails
model, x, want = torch.load(sys.argv[1], weights_only=False)
model(x).square().sum().backward()
assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))
print("loaded and trained")
"""


def test_a_saved_attached_model_loads_without_ssdtier(store_dir, tmp_path):
    """torch.save(model) while attached keeps no trace of ssdtier that loading would need."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)))
    x = torch.randn(4, 16)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    path = tmp_path / "model.pt"
    with ssdtier.attach(model, offload_config(store_dir)):
        torch.save((model, x, want), path)
    r = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_SSDTIER, str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "loaded and trained" in r.stdout, r.stderr


def test_a_first_forward_that_offloads_nothing_says_why_once(store_dir, warned):
    """A small model under the default policy moves nothing: the user is told why, once."""

    def run(**policy):
        torch.manual_seed(0)
        m = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)))
        with ssdtier.attach(m, {**store_config(store_dir), "policy": policy}) as off:
            for _ in range(2):
                m(torch.randn(32, 64)).sum().backward()  # 6 saved tensors of 8 KiB a forward
            return off.stats().tensors_offloaded

    assert run() == 0  # the defaults: a 1 MiB floor
    (msg,) = warned("offloaded nothing")
    assert (
        "of its saved activations, 6 were smaller than policy.min_tensor_bytes (1MiB; the largest 8KiB: "
        'policy__min_tensor_bytes="8KiB" would offload it)'
    ) in msg
    assert run(min_tensor_bytes=0, keep_last_layers=3) == 0
    assert "6 were in the 3 kept last layer(s)" in warned("offloaded nothing")[1]
    assert run(min_tensor_bytes="8KiB") > 0
    assert len(warned("offloaded nothing")) == 2


def test_a_copy_of_an_attached_model_is_a_plain_model(store_dir, tmp_path):
    """copy.deepcopy (EMA, AveragedModel) and torch.save of an attached model work; the copy
    is not attached and shares nothing with the offloader; the original goes on offloading."""
    cfg = CONFIGS["gpt"]
    batch = make_batch(cfg, 2, torch.Generator().manual_seed(2))

    def grads_of(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = batch_loss(model, batch)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    def same(a, b):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    torch.manual_seed(0)
    model = build_model(cfg)
    want = grads_of(copy.deepcopy(model))  # before attaching: the plain model's gradients
    off = ssdtier.attach(model, offload_config(store_dir))
    try:
        twin = copy.deepcopy(model)
        ema = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the model too
        path = tmp_path / "model.pt"
        torch.save(model, path)
        loaded = torch.load(path, weights_only=False)
        packs = off.stats().packs
        for other in (twin, loaded):
            assert ssdtier.offload.attached(other) is None
            same(grads_of(other), want)
        with torch.no_grad():
            ema(*batch)
        assert off.stats().packs == packs  # none of them went through the offloader
        same(grads_of(model), want)
        assert off.stats().tensors_offloaded > 0
        with ssdtier.attach(twin, offload_config(store_dir)) as off2:  # a copy may be attached itself
            same(grads_of(twin), want)
            assert off2.stats().tensors_offloaded > 0
    finally:
        off.detach()


def test_out_of_space_keeps_activations_in_memory_with_exact_gradients(store_dir, warned):
    check_out_of_space(offload_config(store_dir, host="8KiB"), warned)


def check_out_of_space(cfg, warned):
    """A 16 KiB disk: what does not fit stays in memory, said once, gradients exact."""
    cfg["nvme"][0]["capacity"] = "16KiB"
    got = train(CONFIGS["gpt"], cfg)
    assert_same(train(CONFIGS["gpt"]), got)
    assert got[2].tensors_kept > 0 and got[2].failed_writes > 0
    assert len(warned("stay in memory")) == 1


class _Resizer(nn.Module):
    """Saves an activation, then frees its storage (``resize_(0)``) in the forward, as
    sharded data parallelism does with a gathered parameter; `refill` gives it bytes again
    before the backward, with other values, written through another tensor so autograd's
    version check does not see it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))
        self.saved: list[torch.Tensor] = []

    def forward(self, x):
        h = torch.tanh(x)  # tanh saves h, and the matmul saves it too
        y = h @ self.w
        self.saved.append(h)
        h.untyped_storage().resize_(0)
        return y

    def refill(self):
        for h in self.saved:
            st = h.untyped_storage()
            st.resize_(h.numel() * h.element_size())
            fresh = torch.empty(0, device=h.device).set_(st, 0, h.shape, h.stride())
            fresh.copy_(torch.full(h.shape, 0.5, device=h.device))
        self.saved.clear()


class _Resizers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Resizer() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def wait_copies(off) -> None:
    """Wait until every copy and write of the forward is done and seen done (polled)."""
    deadline = time.monotonic() + 30
    while (off.cpu.writing or off.cuda.pending) and time.monotonic() < deadline:
        off.cpu.poll()
        off.cuda.poll()
        time.sleep(0.001)
    assert not off.cpu.writing and not off.cuda.pending


def check_storage_freed_while_copied_out(store_dir, warned, device):
    """Without ssdtier, the backward reads whatever the storage holds then. A copy (a zero-copy
    write from a CPU storage, a device-to-host copy from a GPU one) of a storage that is freed
    before the copy is seen to be done may have copied other bytes: it is not used, and the
    unpack is served from the storage itself."""

    def run(cfg):
        torch.manual_seed(0)
        m = _Resizers().to(device)
        x = torch.randn(32, 64, device=device, requires_grad=True)
        off = ssdtier.attach(m, cfg) if cfg else None
        y = m(x)
        if off is not None:
            wait_copies(off)
        for b in m.blocks:
            b.refill()
        y.sum().backward()
        stats = off.stats() if off else None
        if off:
            off.detach()
        return [x.grad] + [p.grad for p in m.parameters()], stats

    ref, _ = run(None)
    got, stats = run(offload_config(store_dir, host="1MiB"))
    assert stats.tensors_offloaded >= 2 and stats.failed_writes >= 1
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert len(warned("freed or resized while it was being copied out")) == 1


def test_a_storage_freed_while_written_is_served_as_autograd_would(store_dir, warned):
    check_storage_freed_while_copied_out(store_dir, warned, "cpu")


class _InPlace(nn.Module):
    """Modifies, after the forward saved it, either an activation (`"activation"`) or, between
    the forward and the backward, a parameter (`"parameter"`, an optimizer step too early)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, what="activation"):
        y = self.lin(x).sigmoid()  # sigmoid saves its output
        z = y * 3
        if what == "activation":
            y.mul_(2)
        return z + y


@pytest.mark.parametrize("what", ["activation", "parameter"])
@pytest.mark.parametrize("mode", ["all", "none"])  # offloaded, or kept in memory
@pytest.mark.parametrize("settled", [False, True], ids=["in_flight", "read_back"])
def test_a_saved_tensor_modified_in_place_is_an_error_as_without_ssdtier(store_dir, what, mode, settled):
    """Autograd does not check saved tensors' versions through saved-tensor hooks: ssdtier
    does, so a saved tensor changed in place gives autograd's error, not a silent gradient
    (of the old or the new values, depending on whether the copy was still in memory)."""

    def run(cfg):
        torch.manual_seed(0)
        model = _InPlace()
        x = torch.randn(32, 64, requires_grad=True)  # so that the backward needs the weight
        off = ssdtier.attach(model, cfg) if cfg else None
        try:
            out = model(x, what)
            if what == "parameter":
                with torch.no_grad():
                    model.lin.weight.add_(1.0)
            if off is not None and settled:
                wait_copies(off)  # the write done: the backward reads the bytes back
            with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
                out.sum().backward()
            return str(info.value), off.stats() if off else None
        finally:
            if off is not None:
                off.detach()

    plain, _ = run(None)
    got, s = run(offload_config(store_dir, mode=mode))
    assert "checked by ssdtier" in got and "checked by ssdtier" not in plain
    # The same tensor (its shape), at the same versions, as autograd reports it without ssdtier.
    pattern = r"\[\S+ (\[[\d, ]+\])\].* is at version (\d+); expected version (\d+)"
    assert re.search(pattern, got).groups() == re.search(pattern, plain).groups()
    if mode == "all":
        assert s.tensors_offloaded > 0
    else:
        assert s.tensors_offloaded == 0 and s.tensors_kept > 0


def test_mode_none_keeps_everything(store_dir):
    got = train(CONFIGS["gpt"], offload_config(store_dir, mode="none"))
    assert_same(train(CONFIGS["gpt"]), got)
    assert got[2].tensors_offloaded == 0 and got[2].layers_kept == 3


def test_layers_found_and_overridden(store_dir):
    from ssdtier.offload import find_layers

    t5 = build_model(CONFIGS["t5"])
    assert find_layers(t5)[0] == "encoder_blocks"
    assert find_layers(t5, "decoder_blocks")[0] == "decoder_blocks"
    with pytest.raises(ssdtier.ConfigError, match="no submodule"):
        find_layers(t5, "nope")
    got = train(CONFIGS["t5"], offload_config(store_dir, layers="decoder_blocks"))
    assert got[2].layers_offloaded == 2


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(32, 32), nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x))


class _Registered(nn.Module):
    """Blocks kept in a plain list, each registered with add_module."""

    def __init__(self, n=6):
        super().__init__()
        self.blocks = [_Stage() for _ in range(n)]
        for i, b in enumerate(self.blocks):
            self.add_module(f"b{i}", b)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_are_found_in_stages_and_in_registered_lists(store_dir, warned):
    from ssdtier.offload import find_stacks

    # Stages of blocks, two deep: the 8 blocks, not the 2 stages.
    staged = nn.Sequential(nn.Sequential(*(_Stage() for _ in range(4))), nn.Sequential(*(_Stage() for _ in range(4))))
    ((path, blocks),) = find_stacks(staged)
    assert path == "" and len(blocks) == 8 and all(type(b) is _Stage for b in blocks)
    # A plain list of blocks registered one by one; and by its holder's path.
    reg = _Registered()
    assert [(p, len(b)) for p, b in find_stacks(reg)] == [("", 6)]
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    want = torch.autograd.grad(staged(x).square().sum(), list(staged.parameters()))
    with ssdtier.attach(staged, offload_config(store_dir, keep_last_layers=1)) as off:
        got = torch.autograd.grad(staged(x).square().sum(), list(staged.parameters()))
        s = off.stats()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert off.layers == (("", 8, "_Stage"),) and s.layers_kept == 1 and s.layers_offloaded == 7
    assert "of (the model) (8 _Stage)" in str(s)
    assert not warned("blocks")


class _TwoStacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList(_Stage() for _ in range(8))
        self.tail = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        for b in [*self.body, *self.tail]:
            x = b(x)
        return x


def test_blocks_left_out_or_none_found_are_said(store_dir, warned):
    with ssdtier.attach(_TwoStacks(), offload_config(store_dir)) as off:
        assert off.layers == (("body", 8, "_Stage"),)
    (msg,) = warned("left out")
    assert "found: body (8 _Stage); left out, as fewer than half as many: tail (3 Sequential)" in msg
    assert "policy.layers" in msg
    with ssdtier.attach(nn.Linear(4, 4), offload_config(store_dir)) as off:
        assert off.layers == () and "of none" in str(off.stats())
    assert len(warned("found no repeated blocks in this Linear")) == 1
    with ssdtier.attach(_TwoStacks(), offload_config(store_dir, layers=["body", "tail"])) as off:
        assert off.layers == (("body", 8, "_Stage"), ("tail", 3, "Sequential"))  # named: none left out
    assert len(warned("left out")) == 1


def test_one_module_listed_again_is_one_block_not_a_stack(store_dir, warned):
    from ssdtier.offload import find_stacks

    shared = _Stage()  # its weights shared, as ALBERT's layers are
    model = nn.Sequential(*[shared] * 4)
    assert find_stacks(model) == []
    with pytest.raises(ssdtier.ConfigError, match="names one module more than once"):
        find_stacks(model, "")
    with pytest.raises(ssdtier.ConfigError, match="names one module more than once"):
        find_stacks(_TwoStacks(), ("body", "body"))
    x = torch.randn(8, 32)
    want = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    with ssdtier.attach(model, offload_config(store_dir, mode="adaptive", device_budget="4KiB")) as off:
        got = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    assert off.layers == () and len(warned("found no repeated blocks")) == 1
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class _DictNet(nn.Module):
    """Blocks in a ModuleDict (as some models keep named stages)."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleDict({name: nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for name in "abc"})

    def forward(self, x):
        for stage in self.stages.values():
            x = stage(x)
        return x.square().mean()


def test_layers_in_a_module_dict_are_found(store_dir):
    torch.manual_seed(0)
    ref, model = _DictNet(), _DictNet()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(32, 64)
    ref(x).backward()
    with ssdtier.attach(model, offload_config(store_dir, keep_last_layers=1)) as off:
        model(x).backward()
        stats = off.stats()
    assert off.layers_path == "stages" and stats.layers_kept == 1
    # What the last stage and the loss save of their own (its output, twice) is kept; what the
    # first two save is offloaded (three storages, one saved twice), and the last stage's input,
    # the second's output, is served from its copy: kept as well, it would be held twice.
    assert stats.tensors_kept == 2 and stats.tensors_offloaded == 3 and stats.dedup_hits == 2
    assert stats.bytes_kept == 2 * 32 * 64 * 4
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Exclusions(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(64, 64)
        self.quiet = False  # the middle block runs under no_offload()

    def forward(self, x):
        x = self.blocks[0](x)
        with ssdtier.no_offload() if self.quiet else contextlib.nullcontext():
            x = self.blocks[1](x)
        return self.head(self.blocks[2](x)).square().mean()


@pytest.mark.parametrize(
    ("exclude", "quiet", "kept"),
    [(["blocks.1"], False, 3), ([], True, 3), (["blocks.*"], False, 7), (["blocks.?.1", "head"], False, 6)],
    ids=["by-name", "no_offload", "glob", "two-patterns"],
)
def test_excluded_modules_keep_their_saved_tensors(store_dir, exclude, quiet, kept):
    """What an excluded module (or a no_offload() block) saves stays in memory, even over the
    device budget; the rest is offloaded; gradients are exact."""
    torch.manual_seed(0)
    ref, model = _Exclusions(), _Exclusions()
    model.load_state_dict(ref.state_dict())
    model.quiet = quiet
    x = torch.randn(32, 64)
    ref(x).backward()
    with ssdtier.attach(model, offload_config(store_dir, exclude=exclude, device_budget=0)) as off:
        model(x).backward()
        stats = off.stats()
    # Each Linear saves its input, each Tanh its output (a Linear's input is the Tanh output before it):
    # one kept where excluded is kept where saved again, since offloading it would free nothing.
    assert stats.tensors_kept == kept and stats.tensors_offloaded > 0
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_an_exclusion_that_names_no_module_is_an_error(store_dir):
    model = _Exclusions()
    with pytest.raises(ssdtier.ConfigError, match=r"policy.exclude: 'blocks.9', 'tail' names no module of the _Excl"):
        ssdtier.attach(model, offload_config(store_dir, exclude=["blocks.0", "blocks.9", "tail"]))
    assert ssdtier.offload.attached(model) is None


# ------------------------------------------------------------------ views of one storage

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


@st.composite
def views(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    dtype = draw(st.sampled_from(DTYPES))
    n = 1
    for s in shape:
        n *= s
    ops = draw(st.lists(st.sampled_from(["t", "slice", "step", "select", "expand", "flat", "strided"]), max_size=3))
    return shape, dtype, ops, draw(st.integers(0, 2**31))


def apply(t, op, seed):
    if op == "t" and t.dim() >= 2:
        return t.transpose(0, -1)
    if op == "slice" and t.shape[0] > 1:
        return t[1:]
    if op == "step" and t.shape[-1] > 1:
        return t[..., ::2]
    if op == "select" and t.dim() >= 2:
        return t[seed % t.shape[0]]
    if op == "expand" and t.dim() >= 1:
        return t.unsqueeze(0).expand(2, *t.shape)
    if op == "flat" and t.is_contiguous():
        return t.view(-1)
    # Within the storage: an expanded tensor has more elements than its storage holds.
    room = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    if op == "strided" and room >= 2:
        return t.as_strided((room // 2,), (1,), t.storage_offset() + 1)
    return t


@pytest.mark.parametrize("path", ["zero_copy", "arena", "no_arena"])
@settings(max_examples=60, deadline=None)
@given(spec=views())
def test_unpack_of_pack_is_the_same_view(view_offloaders, path, spec):
    """For each path a storage takes: written to NVMe from its own pages (zero copy), copied
    into the host arena, or (no arena) copied straight to NVMe."""
    shape, dtype, ops, seed = spec
    gen = torch.Generator().manual_seed(seed)
    base = (
        torch.randint(0, 2, shape, generator=gen).to(dtype)
        if dtype == torch.bool
        else (torch.randn(shape, generator=gen).to(dtype))
    )
    v = base
    for op in ops:
        v = apply(v, op, seed)
    off = view_offloaders[path]
    written = off.stats().bytes_written_nvme
    hb = off._pack(base)
    out = hb.entry.out
    hv = off._pack(v)
    if path == "zero_copy":
        assert type(out) is Writing, "written from its own pages"
        assert hb.entry.lead % 64 == 0 and out.wrote == base.untyped_storage().data_ptr()
        out.ticket.wait()  # so that the unpack reads it back (not served from the source)
    else:
        assert out is None, "copied, not written from its own pages"
    off.cpu.poll()
    assert hb.entry.out is None
    loc = off.store._native.location(hb.entry.key)[0]  # in the arena?
    assert loc == (path == "arena")
    assert (off.stats().bytes_written_nvme > written) == (path != "arena")
    # The contract (as for save_on_cpu): equal values, dtype, shape, stride and device.
    # The storage offset may differ: restored storages start at a page-aligned address.
    ub, uv = off._unpack(hb), off._unpack(hv)
    for u, t in ((ub, base), (uv, v)):
        assert u.dtype == t.dtype and u.shape == t.shape and u.stride() == t.stride() and u.device == t.device
        assert torch.equal(u, t)
    # Both sit on one storage: one entry, restored once, and the views share it again.
    assert type(hb).__name__ == type(hv).__name__ == "Saved"
    assert hb.entry is hv.entry
    assert ub.untyped_storage().data_ptr() == uv.untyped_storage().data_ptr()
    assert uv.storage_offset() - ub.storage_offset() == v.storage_offset() - base.storage_offset()


@pytest.fixture(scope="module")
def view_offloaders():
    """One offloader per path for all hypothesis examples (fixtures are not reset between them)."""
    import shutil
    import tempfile

    from .conftest import STORE_ROOT

    STORE_ROOT.mkdir(parents=True, exist_ok=True)
    paths = [tempfile.mkdtemp(dir=STORE_ROOT) for _ in range(3)]
    offs = {
        "zero_copy": ssdtier.attach(nn.Identity(), offload_config(paths[0], host="256KiB")),
        "arena": ssdtier.attach(nn.Identity(), offload_config(paths[1], host="256KiB", zero_copy=False)),
        "no_arena": ssdtier.attach(nn.Identity(), offload_config(paths[2], host="0", zero_copy=False)),
    }
    yield offs
    for off in offs.values():
        off.detach()
    for path in paths:
        shutil.rmtree(path)


def test_every_mode_is_exact(store_dir):
    ref = train(CONFIGS["bert"])
    for mode in ("all", "none", "adaptive"):
        assert_same(ref, train(CONFIGS["bert"], offload_config(store_dir, mode=mode)))


def test_fused_attention_is_exact(store_dir):
    # scaled_dot_product_attention saves q, k, v (views of one projection), its output and
    # the softmax's log-sum-exp: each comes back as it was.
    cfg = GPTConfig(n_layers=3, sdpa=True, **TINY)
    got = train(cfg, offload_config(store_dir))
    assert_same(train(cfg), got)
    assert got[2].tensors_offloaded > 0 and got[2].dedup_hits > 0


class TwoUses(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        h = self.lin(x)
        return (h.sin() + h.cos()).sum()  # sin and cos both save h: one storage, two backward nodes


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
def test_shared_storage_is_read_back_once(store_dir, zero_copy):
    x = torch.randn(64, 256, requires_grad=True)
    m = TwoUses()
    ref_grad = torch.autograd.grad(m(x), x)[0]
    # Whole layers: the byte window would keep the sources it wants at the forward's end.
    with ssdtier.attach(m, offload_config(store_dir, host="0", zero_copy=zero_copy, prefetch_layers=2)) as off:
        out = m(x)
        off.store.flush()  # every write done: unpacks read from NVMe
        got = torch.autograd.grad(out, x)[0]
        s = off.stats()
    assert torch.equal(ref_grad, got)
    assert s.dedup_hits >= 1
    # Everything went to NVMe (no arena) and came back exactly once.
    assert s.bytes_read_nvme == s.bytes_written_nvme > 0


class _Read:
    """A finished read-ahead, as ReadAhead.tune sees its ticket."""

    def __init__(self, seconds):
        self.seconds = seconds


def test_min_window_replays_the_backward():
    """Ten 1 MB entries, unpacked 10, 20, ... 100 ms into the backward; reads one after
    another at 8 ms latency and 125 MB/s (16 ms alone, 8 ms behind another). A window of one
    entry starts each read 10 ms before it is needed: late. With two, the first reads (all
    started at once, late whatever the window) hold the third up 2 ms too long; with just
    over two, every read after them is in time."""
    from ssdtier.offload.readahead import min_window

    sizes, times = [1_000_000] * 10, [0.010 * (r + 1) for r in range(10)]
    w = min_window(sizes, times, 0.008, 125e6, 40_000_000, set())
    assert 2_000_000 < w <= 2_130_000, w
    assert min_window(sizes, times, 0.001, 200e6, 40_000_000, set()) == 1_000_000, "6 ms reads: one entry"
    assert min_window(sizes, times, 0.001, 10e6, 4_000_000, set()) == 4_000_000, "too slow: the most"
    assert min_window(sizes, times, 0.008, 125e6, 40_000_000, set(range(10))) == 1_000_000, "no reads"
    # Needed at once: late whatever the window, so it asks for none.
    assert min_window(sizes, [0.0] + times[1:], 0.001, 200e6, 40_000_000, set()) == 1_000_000


def test_auto_read_ahead_times_the_backward_without_its_waits(store_dir, monkeypatch):
    """A backward that waited for reads unpacked later than its own pace: the replay that sizes
    the window takes each unpack's time less the waits before it (else, after a stalled
    backward, the stretched timeline says a small window was enough)."""
    from types import SimpleNamespace

    from ssdtier.offload import readahead
    from ssdtier.offload.readahead import Backward

    with ssdtier.attach(build_model(CONFIGS["gpt"]), offload_config(store_dir, prefetch_layers="auto")) as off:
        b = Backward()
        b.seq = [SimpleNamespace(layer=j, nbytes=1000, refs=0, cuda=False) for j in range(3)]
        clock = iter([1.0, 1.5, 3.0])
        monkeypatch.setattr(readahead, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        with off._lock:
            off.ahead.advance(b, 2)  # the sweep starts (the reverse of the pack order)
            off.res.stall += 0.4
            off.ahead.advance(b, 1)
            off.res.stall += 1.0
            off.ahead.advance(b, 0)
        # approx: the subtractions of float seconds round in the last bit
        assert b.sweep.times == pytest.approx([0.0, 0.1, 0.6])


def test_auto_read_ahead_margin(store_dir):
    """prefetch_layers = "auto" after a made-up backward: the replayed window, doubled after a
    backward that waited more than 1% of its time for a read, halved back after three that
    did not; a fixed prefetch_layers is never tuned."""
    from types import SimpleNamespace

    from ssdtier.offload import readahead
    from ssdtier.offload.readahead import Backward, Sweep

    model = build_model(CONFIGS["gpt"])
    with ssdtier.attach(model, offload_config(store_dir, prefetch_layers="auto")) as off:
        ahead = off.ahead
        b = Backward()
        b.seq = [SimpleNamespace(layer=j // 5, nbytes=1_000_000, cuda=False) for j in range(10)]

        def backward(stall=0.0):
            s = Sweep(b, list(range(9, -1, -1)), 0.0, 0.0)
            s.times, s.seen = [0.010 * (r + 1) for r in range(10)], list(range(9, -1, -1))
            ahead.sweep = s
            ahead.reads = [(i * 0.008, _Read(0.008), 1_000_000) for i in range(4)]  # 125 MB/s
            off.res.stall_ahead += stall
            ahead.tune()
            return off.stats().prefetch_bytes

        assert off.stats().prefetch_bytes == 0 and off.stats().prefetch_layers == 0
        assert "read ahead: a byte window, not sized yet" in str(off.stats())
        one = backward()
        assert f"read ahead: {format_size(one)}" in str(off.stats())
        assert 2_000_000 < one <= 2_130_000
        assert backward(stall=0.0005) == one, "0.5 ms of a 100 ms backward is jitter"
        assert backward(stall=0.002) == 2 * one, "a stall doubles the margin"
        assert [backward() for _ in range(3)] == [2 * one, 2 * one, one], "three clean ones halve it"
        # Steady: the search (about 1 ms for 200 entries) runs every 8th backward; a stall
        # brings it back at once.
        searches = []
        real = readahead.min_window
        readahead.min_window = lambda *a: searches.append(1) or real(*a)
        try:
            assert all(backward() == one for _ in range(24))
            assert 3 <= len(searches) <= 6, len(searches)
            searches.clear()
            assert backward(stall=0.002) == 2 * one and searches == [1], "a stall searches again"
        finally:
            readahead.min_window = real
    with ssdtier.attach(model, offload_config(store_dir, prefetch_layers=3)) as off:
        assert off.stats().prefetch_layers == 3
        off.res.stall_ahead += 1.0
        off._enter(model, ())  # a fixed prefetch_layers is never tuned
        off._exit(model, (), None)
        assert off.stats().prefetch_layers == 3 and off.stats().prefetch_bytes == 0
        assert "read ahead: 3 layers" in str(off.stats())


class _Probe(torch.autograd.Function):
    """Saves its input (its block's activation) and, in backward, looks at which layers'
    entries have a read under way just before and just after unpacking it: the first unpack
    of its block's backward."""

    off = None
    seen: list = []

    @staticmethod
    def forward(ctx, h, layer):
        ctx.layer = layer
        ctx.save_for_backward(h)
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        off = _Probe.off
        if off is None:  # the twin without ssdtier
            return g, None

        def reading():
            return {e.layer for group in off.entries.by_layer.values() for e in group if type(e.back) is Reading}

        before = reading()
        ctx.saved_tensors  # noqa: B018 (the unpack)
        _Probe.seen.append((ctx.layer, before, reading()))
        return g, None


class _ProbedBlock(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.layer = layer

    def forward(self, x):
        # Two entries per block: the Linear's input and tanh's output (the probe saves it too).
        return _Probe.apply(torch.tanh(self.fc(x)), self.layer)


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_fixed_read_ahead_reads_exactly_the_next_layers(store_dir, ahead):
    """prefetch_layers = N: the first unpack of layer j's backward starts the reads of layers
    j - 1 .. j - N not started yet (all N of them in the top layer; below, only j - N, the
    others were started by the layers above), and of no layer further down."""
    n = 6
    torch.manual_seed(0)
    ref = nn.Sequential(*[_ProbedBlock(i + 1) for i in range(n)])
    model = nn.Sequential(*[_ProbedBlock(i + 1) for i in range(n)])
    model.load_state_dict(ref.state_dict())
    x = torch.randn(16, 32)
    _Probe.off, _Probe.seen = None, []
    ref(x).square().sum().backward()
    try:
        with ssdtier.attach(model, offload_config(store_dir, prefetch_layers=ahead)) as off:
            assert off.layers_path == "" and off.stats().prefetch_layers == ahead
            started = []  # (layer whose backward began, layers of the entries read since)
            read_ahead, start_read = off.ahead.start, off._start_read

            def spy_read_ahead(forward, layer):
                started.append((layer, []))
                read_ahead(forward, layer)

            def spy_start_read(e):
                started[-1][1].append(e.layer)
                start_read(e)

            off.ahead.start, off._start_read = spy_read_ahead, spy_start_read
            _Probe.off = off
            out = model(x).square().sum()
            wait_copies(off)  # every write done: nothing is served from its source
            out.backward()
            s = off.stats()
    finally:
        _Probe.off = None
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert s.tensors_offloaded == 2 * n and s.bytes_read_nvme > 0
    assert [j for j, _ in started] == list(range(n, 0, -1)), "each layer's backward starts it once"
    for j, layers in started:
        new = range(max(j - ahead, 1), j) if j == n else [j - ahead] if j > ahead else []
        # Both entries of each layer read ahead; the top layer's own two are read on demand.
        want = [k for k in new for _ in range(2)] + ([n, n] if j == n else [])
        assert sorted(layers) == sorted(want), (j, layers)
    assert [j for j, _, _ in _Probe.seen] == list(range(n, 0, -1))
    for j, before, after in _Probe.seen:
        assert after - {j} == set(range(max(j - ahead, 1), j)), (j, before, after)
        assert before - {j} == (set(range(max(j - ahead + 1, 1), j)) if j < n else set()), (j, before, after)
        assert (j in before) == (j < n), "read ahead by the layer above, except the top layer"


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        import time

        time.sleep(0.03)
        return g


def test_a_second_backward_reads_ahead_too(store_dir):
    """retain_graph=True: the second backward of a graph starts each layer's read-ahead as
    the first did (it used to read everything on demand)."""
    n = 6
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(n)])
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(n)])
    model.load_state_dict(ref.state_dict())
    x = torch.randn(16, 32)
    out = ref(x).square().sum()
    out.backward(retain_graph=True)
    out.backward()
    with ssdtier.attach(model, offload_config(store_dir, prefetch_layers=1)) as off:
        started: list[int] = []
        read_ahead = off.ahead.start

        def spy(forward, layer):
            started.append(layer)
            read_ahead(forward, layer)

        off.ahead.start = spy
        out = model(x).square().sum()
        wait_copies(off)
        out.backward(retain_graph=True)
        first, started[:] = list(started), []
        out.backward()
        assert started == first == list(range(n, 0, -1))
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _SlowBlock(nn.Module):
    """A block whose backward takes 30 ms (slept, or on the test's clock with `backward`)."""

    def __init__(self, backward=_SlowBackward):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.backward_fn = backward

    def forward(self, x):
        return self.backward_fn.apply(torch.tanh(self.fc(x)))


class _Clock:
    """The offloader's clock in the test below: advanced by the blocks' backwards only."""

    t = 0.0


class _TimedBackward(_SlowBackward):
    @staticmethod
    def backward(ctx, g):
        _Clock.t += 0.030  # each block's backward takes 30 ms on that clock
        return g


class _QuickTicket:
    """A real read's ticket that reports the read as taking 1 ms once it is done."""

    def __init__(self, ticket):
        self._ticket = ticket

    def done(self):
        return self._ticket.done()

    def wait(self):
        return self._ticket.wait()

    @property
    def seconds(self):
        return 0.001 if self._ticket.done() else None


def test_auto_read_ahead_window_is_under_a_layer_when_reads_are_quick(store_dir, monkeypatch):
    """Reads (real ones, from NVMe) that take 1 ms against blocks' backwards of 30 ms: the
    window is under one layer's bytes, and the backward never waits. The clock is the
    test's, so a busy disk or CPU cannot change the tuner's inputs (they did, in 2 of 10
    runs under disk and CPU load, with real sleeps and real read times)."""
    import types

    import ssdtier.offload.offloader
    import ssdtier.offload.readahead

    clock = types.SimpleNamespace(perf_counter=lambda: _Clock.t)
    for module in (ssdtier.offload.offloader, ssdtier.offload.readahead):
        monkeypatch.setattr(module, "time", clock)
    torch.manual_seed(0)
    ref, model = (nn.Sequential(*[_SlowBlock(_TimedBackward) for _ in range(6)]) for _ in range(2))
    model.load_state_dict(ref.state_dict())
    x = torch.randn(128, 64)
    with ssdtier.attach(model, offload_config(store_dir, host="64MiB", prefetch_layers="auto")) as off:
        start_read = off._start_read

        def quick_start_read(e):
            start_read(e)
            if e.back.ticket is not None:
                e.back.ticket = _QuickTicket(e.back.ticket)

        off._start_read = quick_start_read
        seen = []
        for _ in range(4):
            for m in (ref, model):
                m.zero_grad()
                loss = m(x).square().sum()
                if m is model:
                    wait_copies(off)  # every write done: every layer is read back from NVMe
                loss.backward()
            seen.append(off.stats().prefetch_bytes)
            for a, b in zip(ref.parameters(), model.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)
        s = off.stats()
        layer = s.bytes_offloaded / 4 / 5  # per step, 5 of 6 blocks offloaded
        # Tuned at the next forward; the first backward reads a quarter layer ahead.
        assert seen[0] == 0 and all(0 < w < layer for w in seen[1:]), (seen, layer)
        assert s.bytes_read_nvme > 0 and s.stall_seconds == 0.0


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_a_released_entry_holds_no_tensor(store_dir):
    """The byte window keeps the last backward's entries (its order is learned from them):
    once released they hold no tensor, not even an empty version probe. A small tensor kept
    per entry across steps, scattered among the activations, fragmented glibc's heap."""
    torch.manual_seed(0)
    model = build_model(CONFIGS["gpt"])
    batch = make_batch(CONFIGS["gpt"], 2, torch.Generator().manual_seed(2))
    batch_loss(model, batch).backward()
    plain = _live_tensors()
    with ssdtier.attach(model, offload_config(store_dir, host="64MiB", prefetch_layers="auto")) as off:
        for _ in range(2):
            batch_loss(model, batch).backward()
        held = _live_tensors()
        assert off.ahead.sweep is not None and off.stats().tensors_offloaded > 50
    assert held - plain <= 2, (held, plain)  # the arena's view, and none per entry


def test_auto_read_ahead_goes_up_when_reads_are_slow(store_dir):
    # 300 KB/s: reading a layer back takes far longer than its backward, so the backward waits
    # (at 1 MB/s, a backward slowed by a busy CPU hid the reads with a small window).
    cfg = offload_config(store_dir, zero_copy=False, prefetch_layers="auto")
    cfg["io"]["throttle"] = "300KB"
    got = train(CONFIGS["gpt"], cfg, micro=3)
    assert_same(train(CONFIGS["gpt"], micro=3), got)
    s = got[2]
    # The most, AHEAD_MAX layers' bytes: here more than half of what a step offloads.
    assert s.stall_seconds > 0 and s.prefetch_bytes > s.bytes_offloaded / 3 / 2, s.prefetch_bytes


class _TwoViews(nn.Module):
    """One stack run on two inputs in one forward (a siamese model's two views)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Stage() for _ in range(4))

    def stack(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        return (self.stack(x) * self.stack(x.flip(0))).square().mean()


def test_a_stack_run_twice_in_one_forward_is_read_as_one_backward(store_dir):
    # Its backward goes up the blocks twice in one call of autograd's engine: taken for a
    # retained graph's second backward, the sweep started again and learned half the order.
    torch.manual_seed(0)
    model = _TwoViews()
    x = torch.randn(64, 32)
    with ssdtier.attach(model, offload_config(store_dir, host="64MiB", prefetch_layers="auto")) as off:
        for _ in range(2):
            model(x).backward()
        n, _, order = off.ahead.learned
        assert off.ahead.sweep.round == 0
        loss = model(x)
        loss.backward(retain_graph=True)
        loss.backward()
        assert off.ahead.sweep.round == 1  # another call: another backward
    assert sorted(order) == list(range(n)) and order[0] == n - 1, order


class _ConjBlock(nn.Module):
    """Saves lazily conjugated and negated views: ``a.conj()`` (mul saves it) and
    ``a.conj().imag`` (a negative-bit view)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32, dtype=torch.complex64))

    def forward(self, a):
        c = a.conj()
        return (c * (a @ self.w)) + c.imag * a.real


class _ConjNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_ConjBlock() for _ in range(3))

    def forward(self, a):
        for b in self.blocks:
            a = b(a) / 8
        return a.abs().square().sum()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
def test_conjugate_and_negative_views_keep_their_values(store_dir, zero_copy):
    torch.manual_seed(0)
    ref = _ConjNet()
    model = _ConjNet()
    model.load_state_dict(ref.state_dict())
    a = torch.randn(64, 32, dtype=torch.complex64)
    ref(a.clone().requires_grad_()).backward()
    with ssdtier.attach(model, offload_config(store_dir, zero_copy=zero_copy)) as off:
        model(a.clone().requires_grad_()).backward()
        assert off.stats().tensors_offloaded > 0
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_unpack_of_a_conjugate_view_is_a_conjugate_view(store_dir):
    model = nn.Linear(2, 2)
    x = torch.randn(16, 16, dtype=torch.complex64)
    with ssdtier.attach(model, offload_config(store_dir, host="64MiB")) as off:
        off._last_fwd.forward, off._last_fwd.tag = 1, 1
        for t in (x.conj(), x.conj()[2:, ::3], x.conj().t()):
            h = off._pack(t)
            assert type(h).__name__ == "Saved", "offloaded"
            out = off._unpack(h)
            assert out.is_conj() and torch.equal(out, t) and out.stride() == t.stride()
            del h, out
        n = x.conj().imag
        h = off._pack(n)
        assert h.tensor is n and off._unpack(h) is n, "a negative-bit view is kept as it is"


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensor creation is deprecated
def test_quantized_and_zero_tensors_are_kept_as_they_are(store_dir):
    model = nn.Linear(2, 2)
    q = torch.quantize_per_tensor(torch.randn(64, 64), 0.1, 3, torch.qint8)
    z = torch._efficientzerotensor(64, 64)
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        off._last_fwd.forward, off._last_fwd.tag = 1, 1
        for t in (q, z):
            h = off._pack(t)
            assert h.tensor is t and off._unpack(h) is t
        assert off.stats().tensors_offloaded == 0


class _Tagged(torch.Tensor):
    """A tensor subclass that passes every op through ``__torch_function__`` (its results,
    and what autograd saves of them, are _Tagged too)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _Exotic(nn.Module):
    """Saves a sparse COO and a sparse CSR matrix (mm saves its sparse operand for the dense
    one's gradient), a strided and a jagged nested tensor (sin saves its input), and a tensor
    subclass, next to plain dense activations."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, coo, csr, nt, nj, sub):
        h = torch.tanh(self.w * 2)  # dense: offloaded
        a = torch.sparse.mm(coo, h)  # saves coo (which requires grad) and h
        b = torch.mm(csr, h)  # saves csr
        c = torch.nested.to_padded_tensor(nt.sin(), 0.0)
        d = nj.sin().values()
        e = (sub * sub).as_subclass(torch.Tensor)
        return a.square().sum() + b.square().sum() + c.sum() + d.sum() + e.sum()


def _exotic_inputs():
    gen = torch.Generator().manual_seed(4)
    i = torch.tensor([[0, 1, 2, 3, 5, 7], [1, 0, 3, 2, 9, 15]])
    coo = torch.sparse_coo_tensor(i, torch.randn(6, generator=gen), (8, 16)).coalesce()
    csr = coo.detach().to_sparse_csr()
    parts = [torch.randn(2, 3, generator=gen), torch.randn(4, 3, generator=gen)]
    return (
        coo.requires_grad_(),
        csr,
        torch.nested.nested_tensor(parts, requires_grad=True),
        torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True),
        torch.randn(4, 4, generator=gen).as_subclass(_Tagged).requires_grad_(),
    )


def _kind(t):
    if t.layout in (torch.sparse_coo, torch.sparse_csr, torch.jagged):
        return str(t.layout).removeprefix("torch.")
    if t.is_nested:
        return "nested"
    return "subclass" if type(t) is _Tagged else "dense"


def _exotic_grads(model, inputs):
    out = []
    for t in (model.w, *inputs):
        g = t.grad
        if g is None:
            out.append(None)
        elif g.is_nested:
            out.extend(g.unbind())
        else:
            out.append(g.to_dense() if g.layout != torch.strided else g)
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR and nested tensors are in beta
def test_sparse_nested_and_subclass_tensors_are_kept_as_they_are(store_dir, monkeypatch):
    from ssdtier.offload import Offloader

    torch.manual_seed(0)
    ref, model = _Exotic(), _Exotic()
    model.load_state_dict(ref.state_dict())
    ref_in, got_in = _exotic_inputs(), _exotic_inputs()
    ref_loss = ref(*ref_in)
    ref_loss.backward()
    packed, unpacked = [], []
    real_pack, real_unpack = Offloader._pack, Offloader._unpack

    def pack(self, t):
        h = real_pack(self, t)
        packed.append((_kind(t), t, h))
        return h

    def unpack(self, h):
        out = real_unpack(self, h)
        unpacked.append((h, out))
        return out

    # ssdtier's own pack and unpack, seen on their way (its hooks call them as usual).
    monkeypatch.setattr(Offloader, "_pack", pack)
    monkeypatch.setattr(Offloader, "_unpack", unpack)
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        loss = model(*got_in)
        wait_copies(off)
        loss.backward()
        s = off.stats()
        kinds = [k for k, _, _ in packed]
        assert {"sparse_coo", "sparse_csr", "nested", "jagged", "subclass", "dense"} <= set(kinds), kinds
        assert s.packs == len(packed)
        for kind, t, h in packed:
            if kind != "dense":
                # Held as it is; one with a grad_fn detached (no cycle through the graph).
                assert type(h).__name__ == "Same", kind
                assert h.tensor is t if t.grad_fn is None else h.tensor.grad_fn is None, kind
        # Every dense activation went through the store; none of the others did.
        assert s.tensors_offloaded + s.dedup_hits == kinds.count("dense") > 0
        assert s.bytes_read_nvme > 0
        # Unpacked as they were packed: the very tensor object held.
        exotic = {id(h): h.tensor for kind, t, h in packed if kind != "dense"}
        seen = [out for h, out in unpacked if id(h) in exotic]
        assert len(seen) >= len(exotic)
        assert all(out is exotic[id(h)] for h, out in unpacked if id(h) in exotic)
    assert torch.equal(ref_loss, loss)
    for a, b in zip(_exotic_grads(ref, ref_in), _exotic_grads(model, got_in), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(
    ("backend", "zero_copy"),
    [("aot_eager", True), ("aot_eager", False), ("inductor", True)],
    ids=["aot_eager-zero_copy", "aot_eager-arena", "inductor-zero_copy"],
)
def test_torch_compile(store_dir, backend, zero_copy):
    """Under torch.compile the compiled graph's saved tensors go through ssdtier too (AOTAutograd
    calls the hooks), with the same losses and gradients as the compiled model without it.
    aot_eager keeps eager's kernels; inductor fuses them (and builds C++ for the CPU)."""
    cfg = GPTConfig(n_layers=2, **TINY)

    def compiled(model):
        torch._dynamo.reset()
        return torch.compile(model, backend=backend)

    # Inductor's CPU kernels accumulate some gradients (the embedding's) with atomic adds in
    # parallel loops, so with several threads two runs of the same compiled model can differ
    # in the last bit, ssdtier or not (seen once in CI). One thread makes its order fixed.
    threads = torch.get_num_threads()
    if backend == "inductor":
        torch.set_num_threads(1)
    try:
        ref = train(cfg, micro=2, wrap=compiled)
        got = train(cfg, offload_config(store_dir, zero_copy=zero_copy), micro=2, wrap=compiled)
    finally:
        torch.set_num_threads(threads)
    assert_same(ref, got)
    assert got[2].tensors_offloaded > 0 and got[2].bytes_read_nvme > 0


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group, as DistributedDataParallel needs one."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
def test_distributed_data_parallel(store_dir):
    """Attached to the module that DistributedDataParallel wraps, or to the wrapper itself
    (its blocks are found under ``module.``): DDP's gradient hooks and buckets work on the
    gradients as usual, and they are the same as DDP's without ssdtier."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = CONFIGS["gpt"]
    ref = train(cfg, wrap=DDP)
    got = train(cfg, offload_config(store_dir), wrap=DDP)
    assert_same(ref, got)
    assert got[2].tensors_offloaded > 0 and got[2].bytes_read_nvme > 0

    torch.manual_seed(0)
    model = build_model(cfg)
    ddp = DDP(model)
    batch = make_batch(cfg, 2, torch.Generator().manual_seed(2))
    with ssdtier.attach(ddp, offload_config(store_dir)) as off:
        assert off.layers_path == "module.blocks"
        torch.manual_seed(1)
        loss = batch_loss(ddp, batch)
        loss.backward()
        assert off.stats().bytes_read_nvme > 0
    one = train(cfg, micro=1, wrap=DDP)  # the same first batch, seeds and model
    assert torch.equal(loss.detach(), one[0][0])
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, one[1][name]), name


@pytest.mark.usefixtures("process_group")
def test_fully_sharded_data_parallel(store_dir):
    """FSDP2 (``fully_shard`` per block and on the model), one process: its parameters are
    sharded DTensors between forwards (with no storage of their own to look up) and
    gathered into new Parameters in each forward; those are recognised and kept, the
    activations are offloaded, and the gradients are FSDP's own without ssdtier."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    from .dist_worker import run  # what each rank of test_distributed.py runs

    ref = run("fsdp2", 0, None)
    got = run("fsdp2", 0, offload_config(store_dir))
    assert_same((ref["losses"], ref["grads"], None), (got["losses"], got["grads"], None))
    plain = train(CONFIGS["gpt"], offload_config(store_dir), micro=2)[2]
    assert got["stats"]["tensors_offloaded"] == plain.tensors_offloaded > 0  # activations, and no parameter


class _DBlock(nn.Module):
    """A block computing on DTensors (as tensor parallelism's activations are)."""

    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.w = nn.Parameter(distribute_tensor(torch.randn(32, 32) / 6, mesh, [Replicate()]))

    def forward(self, x):
        return torch.tanh(x @ self.w)


@pytest.mark.usefixtures("process_group")
def test_dtensor_activations_go_through_their_local_tensor(store_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))

    def run(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(*[_DBlock(mesh) for _ in range(4)])
        x = DTensor.from_local(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)), mesh, [Replicate()])
        off = ssdtier.attach(model, cfg) if cfg else None
        out = model(x).to_local().square().sum()
        if off:
            wait_copies(off)
        out.backward()
        stats = off.stats() if off else None
        if off:
            off.detach()
        return out, [p.grad.to_local() for p in model.parameters()], stats

    ref, got = run(None), run(offload_config(store_dir))
    assert torch.equal(ref[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))
    s = got[2]
    # Each block saves its input and its output, DTensors both (the first input is kept: no grad).
    assert s.tensors_offloaded + s.dedup_hits >= 6 and s.bytes_read_nvme > 0


class _Tagged(torch.Tensor):
    """A tensor subclass ssdtier does not know (as float8 and NF4 tensors are to it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_an_unknown_subclass_stays_in_memory_said_once(store_dir, warned):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x)).as_subclass(_Tagged)
            return x.as_subclass(torch.Tensor).sum()

    model = Model()
    with ssdtier.attach(model, offload_config(store_dir)):
        for _ in range(2):
            model(torch.randn(4, 8)).backward()
    assert len(warned("saved tensors of type _Tagged stay in memory")) == 1


def test_autocast_weight_casts_are_not_offloaded(store_dir):
    """Autocast caches each weight's cast for its region: the cast stays in memory whatever
    ssdtier does, so writing it out would cost I/O and save nothing."""
    width, batch = 64, 8
    offloaded: list[int] = []

    def run(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])
        x = torch.randn(batch, width, requires_grad=True, generator=torch.Generator().manual_seed(1))
        off = ssdtier.attach(model, cfg) if cfg else None
        if off:
            real = off.cpu.offload
            off.cpu.offload = lambda st, nbytes, f: (offloaded.append(nbytes), real(st, nbytes, f))[1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().sum()
        loss.backward()
        grads = [p.grad for p in model.parameters()] + [x.grad]
        if off:
            off.detach()
        return loss, grads

    ref, got = run(None), run(offload_config(store_dir))
    assert torch.equal(ref[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))
    assert offloaded, "the activations went to the store"
    assert width * width * 2 not in offloaded, "a bf16 weight cast was offloaded"


def test_a_model_with_lazy_modules_attaches_before_its_first_forward(store_dir):
    # Attached first, initialised by a forward under no_grad: a lazy parameter has no storage yet.
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 16)
    with ssdtier.attach(model, offload_config(store_dir, mode="adaptive")):
        with torch.no_grad():
            model(x)
        model(x).sum().backward()
    assert model[0].weight.grad is not None
