"""Adaptive mode at run time: each block kept, offloaded or recomputed as planned, gradients
bit-identical to a run without ssdtier for every action, the device budget honoured from the
first forward and measured apart from what the plan holds (CPU; a fake GPU where needed)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch
from ssdtier.offload.adaptive import Adaptive
from ssdtier.offload.budget import Counters, Memory
from ssdtier.offload.profile import Recomputable
from ssdtier.offload.recompute import Recompute
from ssdtier.offload.settled import Settled
from ssdtier.offload.watch import Watch
from ssdtier.plan import Action

from .test_attach import CONFIGS, TINY, assert_same, offload_config, train, wait_copies

K, OF, R, RO = Action.KEEP, Action.OFFLOAD, Action.RECOMPUTE, Action.RECOMPUTE_OFFLOAD
GPT = GPTConfig(n_layers=4, **TINY)  # dropout 0.1: a recomputation must draw the same masks


def adaptive(store_dir, **policy):
    return offload_config(store_dir, mode="adaptive", **policy)


def forced(monkeypatch, acts):
    """Adaptive mode with ``acts`` in force from the first forward on, whatever it measures."""
    init = Adaptive.__init__

    def start(self, off):
        init(self, off)
        off.set_actions(tuple(acts))

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(Adaptive, "_adopt", lambda self, *a: None)


def unhooked_from_second(monkeypatch):
    """A settled plan's forwards, from the second on (with forced actions: no plan, no ceiling)."""
    seen = []
    monkeypatch.setattr(Settled, "skips", lambda self, ad, state: bool(seen.append(1)) or len(seen) > 1)
    monkeypatch.setattr(Settled, "woken", lambda self, args, stack=0: False)


def hooked(monkeypatch):
    """Every forward hooked: for tests of what each one measures and plans."""
    monkeypatch.setattr(Settled, "skips", lambda self, ad, state: False)


def steps(cfg, ssd=None, batches=(2, 2, 2), on_step=None, prepare=None):
    """The GPT from seed 0 trained on batches of the given sizes (seed 2), dropout from seed 1."""
    return train(cfg, ssd, sizes=batches, on_step=on_step, prepare=prepare)


# ------------------------------------------------------------------ each action, exactly


@pytest.mark.parametrize(
    "acts",
    [(K, K, K, K), (OF, OF, OF, OF), (R, R, R, R), (RO, RO, RO, RO), (OF, RO, R, K), (RO, OF, K, R)],
    ids=lambda a: "-".join(x.value for x in a),
)
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
def test_every_action_is_exact(store_dir, monkeypatch, acts, zero_copy):
    forced(monkeypatch, acts)
    got = steps(GPT, offload_config(store_dir, zero_copy=zero_copy, mode="adaptive"))
    assert_same(steps(GPT), got)
    s = got[2]
    assert s.layers_recomputed == sum(a.recomputes for a in acts)
    assert s.layers_kept == acts.count(K)
    if any(a.offloads for a in acts):
        assert s.tensors_offloaded > 0


def _compile_blocks(model, every=1):
    torch._dynamo.reset()
    for i, b in enumerate(model.blocks):
        if i % every == 0:
            model.blocks[i] = torch.compile(b, backend="aot_eager")


@pytest.mark.parametrize("every", [1, 2], ids=["all", "some"])
@pytest.mark.parametrize("acts", [(R, R, R, R), (RO, OF, K, R)], ids=lambda a: "-".join(x.value for x in a))
def test_every_action_is_exact_on_blocks_compiled_before_attaching(store_dir, monkeypatch, acts, every):
    """The compiled code recomputed whole, dropout's masks drawn again the same; blocks
    compiled and not are one stack."""
    forced(monkeypatch, acts)
    layers = []
    cfg = offload_config(store_dir, mode="adaptive")
    got = steps(GPT, cfg, prepare=lambda m: _compile_blocks(m, every), on_step=lambda off: layers.append(off.layers))
    assert_same(steps(GPT, prepare=lambda m: _compile_blocks(m, every)), got)
    assert got[2].layers_recomputed == sum(a.recomputes for a in acts)
    assert layers[-1] == (("blocks", 4, "GPTBlock"),)


def test_a_recomputed_block_hands_only_its_inputs_to_the_offloader(store_dir, monkeypatch):
    seen = {}

    def count(off):
        seen.setdefault("saved", list(off.adaptive.profile.saved))

    forced(monkeypatch, (K, R, K, K))
    steps(GPT, adaptive(store_dir), batches=(2,), on_step=count)
    saved = seen["saved"]  # by tag: 0 before the blocks, i + 1 in block i
    x = 2 * GPT.seq_len * GPT.d_model * 4  # a block's input: the fp32 residual stream
    assert saved[2] == x and saved[1] > 4 * x and saved[3] == saved[1]


def _frozen_below(store_dir, budget, n=2):
    """The GPT fine-tuned above its embeddings and first two blocks: the plans of ``n`` steps."""
    torch.manual_seed(0)
    model = build_model(GPT)
    for m in (model.tok_emb, model.pos_emb, *model.blocks[:2]):
        m.requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    plans = []
    with ssdtier.attach(model, adaptive(store_dir, device_budget=budget)) as off:
        for _ in range(n):
            batch_loss(model, make_batch(GPT, 2, gen)).backward()
            plans.append(off.plan())
    return plans


def test_a_block_never_measured_is_not_estimated_from_blocks_that_save_nothing(store_dir):
    # The first forward's guard recomputes the last block, so it is never measured; the frozen
    # blocks, which save nothing, say nothing of what it saves.
    whole = _frozen_below(store_dir, 1 << 30)[-1]
    x = whole.decisions[2].block.bytes
    assert [d.block.bytes for d in whole.decisions][:2] == [0, 0] and x > 0
    plan = _frozen_below(store_dir, int(1.5 * x))[1]  # from the first forward's measurements
    assert plan.decisions[3].block.bytes == x
    assert plan.actions[2:] != (K, K)


def test_the_users_own_checkpointing_is_not_wrapped_again(store_dir, monkeypatch):
    import ssdtier.offload.recompute as rc

    calls = []
    real = rc.checkpoint
    monkeypatch.setattr(rc, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = dataclasses.replace(GPT, checkpoint=True)  # every block under torch.utils.checkpoint
    forced(monkeypatch, (RO,) * 4)
    assert_same(steps(cfg), steps(cfg, adaptive(store_dir)))
    assert calls == []  # inside the user's checkpoint, its hooks serve: ours never ran
    forced(monkeypatch, (R,) * 4)
    assert_same(steps(GPT), steps(GPT, adaptive(store_dir)))
    assert len(calls) == 4 * 3


def test_bytes_are_counted_once_per_storage(store_dir, monkeypatch):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            h = self.lin(x)
            return h.sin() + h.cos()  # sin and cos both save h: one storage

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    forced(monkeypatch, (K, K))
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        model(torch.randn(64, 256, requires_grad=True)).sum().backward()
        saved = off.adaptive.profile.saved
    h = 64 * 256 * 4
    # Block 0: its input (saved by the Linear) and h; block 1: h (its input is block 0's output).
    assert saved[1] == 2 * h and saved[2] == 2 * h


def test_a_blocks_inputs_at_the_address_of_a_freed_storage_are_counted():
    # A recomputed block's inputs, offloaded, free their storage: a later block's inputs can
    # take its address (on the CPU they did, and a block measured 0 bytes at a new length).
    import weakref

    from ssdtier.offload.profile import input_bytes

    a, seen = torch.zeros(256), {}
    assert input_bytes((a, a[:10], torch.zeros(3, dtype=torch.long)), seen) == (1024, 0)  # a storage once
    assert input_bytes((a,), seen) == (0, 0)  # a tensor every block takes (a mask): one block's input
    m, per_block = torch.zeros(64), {}
    assert input_bytes((m[None],), per_block, 1024) == (256, 256)  # under 1024 bytes: kept if offloaded
    assert input_bytes((m[None],), per_block) == (0, 0)  # ... or a view of it made for each block
    gone = torch.zeros(1)
    seen[a.untyped_storage().data_ptr()] = weakref.ref(gone)
    del gone  # the tensor seen at this address is freed: what is there now is another one's
    assert input_bytes((a,), seen) == (1024, 0)


# ------------------------------------------------------------------ attach, detach, copies


def test_detach_puts_each_blocks_forward_back(store_dir):
    model = build_model(GPT)
    own = model.blocks[2].forward
    model.blocks[2].forward = own  # an instance forward of the user's: kept as it was
    before = [set(b.__dict__) for b in model.blocks]
    off = ssdtier.attach(model, adaptive(store_dir))
    assert all(isinstance(b.forward, Recompute) for b in model.blocks)
    off.detach()
    assert [set(b.__dict__) for b in model.blocks] == before and model.blocks[2].forward is own
    # Modes that never recompute leave the forwards alone.
    with ssdtier.attach(model, offload_config(store_dir)):
        assert not any(isinstance(b.forward, Recompute) for b in model.blocks)


def test_a_copy_of_a_model_that_recomputes_is_a_plain_model(store_dir, monkeypatch):
    forced(monkeypatch, (R, RO, K, OF))
    torch.manual_seed(0)
    model = build_model(GPT)
    batch = make_batch(GPT, 2, torch.Generator().manual_seed(2))
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        twin = copy.deepcopy(model)
        assert not any(isinstance(b.__dict__.get("forward"), Recompute) for b in twin.blocks)
        packs = off.stats().packs
        torch.manual_seed(1)
        batch_loss(twin, batch).backward()
        assert off.stats().packs == packs  # the copy does not go through the offloader
    torch.manual_seed(0)
    plain = build_model(GPT)
    torch.manual_seed(1)
    batch_loss(plain, batch).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), twin.parameters(), strict=True))


# ------------------------------------------------------------------ plans made at run time


def test_adaptive_mode_plans_from_what_it_measured_and_stays_exact(store_dir):
    cfg = adaptive(store_dir)
    cfg["io"]["throttle"] = "200MB"
    ref = train(CONFIGS["gpt"], micro=4)
    got = train(CONFIGS["gpt"], cfg, micro=4)
    assert_same(ref, got)
    p = got[2].plan
    assert p is not None and len(p.decisions) == 3 and p.device_budget is None
    assert p.table().startswith("ssdtier plan: ") and got[2].layers_kept == p.count(K)
    # Block 0 carries what is saved before it (the embeddings' indices): it goes with block 0.
    b = [d.block for d in p.decisions]
    assert b[0].bytes > b[1].bytes == b[2].bytes > b[1].inputs > 0
    assert all(x.forward_s > 0 and x.recompute_s > 0 for x in b)


def test_a_budget_below_what_offloading_hides_is_met_by_recomputing(store_dir, monkeypatch):
    # 1 kB/s: no block's bytes leave in time. With room for half of keep's peak, the plan
    # recomputes (with the inputs kept: they could not leave in time either).
    monkeypatch.setattr(Adaptive, "calibrate", lambda self: (1e3, 1e3))
    keep = steps(GPT, adaptive(store_dir, device_budget="1GiB"))[2].plan
    assert keep.actions == (K,) * 4
    budget = keep.outcome.peak // 2
    got = steps(GPT, adaptive(store_dir, device_budget=budget), batches=(2,) * 5)
    assert_same(steps(GPT, batches=(2,) * 5), got)
    p = got[2].plan
    assert p.fits and p.outcome.peak <= budget and p.count(OF) == p.count(RO) == 0
    assert p.count(R) >= 2 and got[2].layers_recomputed == p.count(R)


def test_the_first_forward_honours_the_budget_by_recomputing(store_dir):
    # Nothing is measured before the first forward: blocks are kept until the ones to come
    # would pass the budget, then recomputed with their inputs offloaded.
    # At batch 4 a block saves about 200 KB and keeping all takes about 830 KB.
    seen = []
    budget = 512 << 10
    ssd = adaptive(store_dir, device_budget=budget)
    got = steps(GPT, ssd, batches=(4,), on_step=lambda off: seen.append((off.adaptive.switched, off.res.kept_peak)))
    assert_same(steps(GPT, batches=(4,)), got)
    switched, kept = seen[0]
    assert switched >= 2 and kept <= budget


def test_a_growing_batch_falls_back_to_recomputing_not_out_of_memory(store_dir, caplog):
    # Planned at batch 2 with everything kept (about 420 KB); batch 8 saves four times as
    # much: the guard recomputes the blocks that would pass the budget in that very forward.
    switched, kept = [], []

    def look(off):
        switched.append(off.adaptive.switched)
        kept.append(off.res.kept_peak)
        off.res.kept_peak = off.res.kept

    budget = 1 << 20
    with caplog.at_level("INFO", logger="ssdtier"):
        got = steps(GPT, adaptive(store_dir, device_budget=budget), batches=(2, 2, 2, 8, 8), on_step=look)
    assert_same(steps(GPT, batches=(2, 2, 2, 8, 8)), got)
    assert switched[:3] == [0, 0, 0] and switched[3] > 0, switched
    assert max(kept) <= budget
    assert "would pass the device budget" in caplog.text
    assert got[-1].guard_recomputed == sum(switched)
    assert f"{sum(switched)} blocks recomputed past the plan" in str(got[-1])


def test_stats_name_the_plan(store_dir):
    s = train(CONFIGS["gpt"], adaptive(store_dir))[2]
    text = str(s)
    lines = text.splitlines()
    assert len(lines) == 4 + len(s.chosen), text  # with the plan's line, then what attach chose
    assert lines[3].startswith(f"adaptive plan: {s.plan.summary()}: ")
    d = s.as_dict()
    assert json.loads(json.dumps(d))["store"] == dataclasses.asdict(s.store)
    assert [x["action"] for x in d["plan"]["decisions"]] == [a.value for a in s.plan.actions]


def test_what_a_loop_logs_has_the_blocks_by_action(store_dir):
    from ssdtier.integrations import summary

    plain = summary(train(CONFIGS["gpt"], offload_config(store_dir))[2])
    assert "ssdtier/blocks_keep" not in plain and plain["ssdtier/offloaded_GiB"] > 0
    s = train(CONFIGS["gpt"], adaptive(store_dir, device_budget="3GiB"))[2]
    logged = summary(s)
    assert logged["ssdtier/blocks_keep"] == s.plan.count(K) == 3 and logged["ssdtier/device_budget_GiB"] == 3.0
    assert logged["ssdtier/blocks_recompute_offload"] == 0


def test_adaptive_calibration_is_not_counted_as_activation_traffic(store_dir):
    model = build_model(CONFIGS["gpt"])
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        s = off.stats()
        assert min(off.adaptive.bw) > 0  # measured
        assert s.bytes_written_nvme == s.bytes_read_nvme == s.store.host_peak == s.store.nvme_peak == 0


def test_device_budget_caps_what_is_kept_in_other_modes(store_dir):
    # mode "none" would keep everything; a zero budget forces all of it out.
    got = train(CONFIGS["gpt"], offload_config(store_dir, mode="none", device_budget=0))
    assert_same(train(CONFIGS["gpt"]), got)
    assert got[2].tensors_kept == 0 and got[2].tensors_offloaded > 0


def test_an_auto_device_budget_is_for_adaptive_mode_on_a_gpu(store_dir, warned):
    with pytest.raises(ssdtier.ConfigError, match="set policy.mode = 'adaptive' \\(it is 'all'\\)"):
        ssdtier.attach(build_model(CONFIGS["gpt"]), offload_config(store_dir, device_budget="auto"))
    got = train(CONFIGS["gpt"], adaptive(store_dir, device_budget="auto"), micro=4)
    assert_same(train(CONFIGS["gpt"], micro=4), got)
    assert warned("sizes the budget from GPU memory, and this GPT is not on a GPU: no budget")
    assert got[2].plan.device_budget is None


# ------------------------------------------------------------------ device_budget = "auto" on a fake GPU

GiB = 1 << 30


def fake_gpu(monkeypatch, memory, beside):
    """Adaptive mode on a stand-in GPU: ``memory()`` gives its Memory; what is allocated is
    ``beside`` (a function of the offloader) plus the activations the offloader holds."""
    init = Adaptive.__init__

    class FakeGpu:
        def __init__(self, off):
            self.off = off

        def memory(self):
            return memory()

        def allocated(self):
            return beside(self.off) + self.off.adaptive.held()

    def start(self, off):
        init(self, off)
        self.watch.gpu = FakeGpu(off)

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(Adaptive, "calibrate", lambda self: (1e3, 1e3))  # 1 kB/s: no block's I/O hides


def test_an_evaluation_without_gradients_does_not_cut_an_auto_budget(store_dir, monkeypatch):
    # An evaluation under no_grad between steps, at a larger batch, sets the allocator's peak:
    # it is not a training step's, and the next step's budget does not count it.
    gpu = {"peak": 1 * GiB}
    fake_gpu(monkeypatch, lambda: Memory(50 * GiB, 100 * GiB, 8 * GiB, gpu["peak"], 0, 2 * GiB), lambda off: 3 * GiB)
    forced(monkeypatch, (K,) * 4)  # no plan: every forward hooked, every step's budget looked at
    budgets = []

    def look(off):
        budgets.append(off._budget)
        if len(budgets) == 3:
            with torch.no_grad(), torch.random.fork_rng():  # the training's dropout as without it
                batch_loss(off.model, make_batch(GPT, 8, torch.Generator().manual_seed(3)))
            gpu["peak"] = 40 * GiB

    sizes = (2,) * 5
    got = steps(GPT, adaptive(store_dir, device_budget="auto"), batches=sizes, on_step=look)
    assert_same(steps(GPT, batches=sizes), got)
    assert budgets[1] is not None and budgets[1:] == [budgets[1]] * 4, [b / GiB for b in budgets[1:]]


def test_an_auto_device_budget_does_not_depend_on_the_plan(store_dir, monkeypatch):
    # 3 GiB beside the activations whatever the plan holds: every plan sees the same budget.
    budgets = {}
    for acts in ((K,) * 4, (OF, OF, R, K), (RO,) * 4):
        seen = []
        with monkeypatch.context() as m:
            fake_gpu(m, lambda: Memory(50 * GiB, 100 * GiB, 8 * GiB, 1 * GiB, 0), lambda off: 3 * GiB)
            forced(m, acts)
            ssd = adaptive(store_dir, device_budget="auto")
            got = steps(GPT, ssd, batches=(2,) * 4, on_step=lambda off, seen=seen: seen.append(off._budget))
        assert_same(steps(GPT, batches=(2,) * 4), got)
        budgets[acts] = seen[1:]
    # 58 GiB free and cached, less 5 (5%), less the 3 beside: 50 GiB, for every plan.
    assert all(b == [50 * GiB] * 3 for b in budgets.values()), budgets


def test_an_auto_device_budget_says_what_it_is_made_of(store_dir, monkeypatch, caplog):
    # What is allocated beside the activations grows by 1 MiB a block through the backward:
    # the most is seen past the blocks, in the backward of what runs before them. Said when
    # the budget moves.
    def beside(off):
        return 3 * GiB + len(off.adaptive.profile.marks) * (1 << 20)

    fake_gpu(monkeypatch, lambda: Memory(50 * GiB, 100 * GiB, 8 * GiB, 1 * GiB, 0, 2 * GiB), beside)
    with caplog.at_level("INFO", logger="ssdtier"):
        steps(GPT, adaptive(store_dir, device_budget="auto"), batches=(2,) * 4)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ssdtier: device budget")]
    assert said == [
        "ssdtier: device budget 25.5GiB: 50GiB free and 8GiB cached, less a margin of 5GiB and 0B of copies "
        "queued; less 2GiB allocated as the step began and nothing measured yet the last step added beside "
        "the activations held",
        "ssdtier: device budget 50.0GiB: 50GiB free and 8GiB cached, less a margin of 5GiB and 0B of copies "
        "queued; less 2GiB allocated as the step began and 1.0GiB the last step added beside the activations "
        "held (at the backward of what runs before the blocks)",
    ], said


def test_an_auto_device_budget_follows_the_memory_left(store_dir, monkeypatch):
    gpu = {"free": 0, "retries": 0}
    fake_gpu(monkeypatch, lambda: Memory(gpu["free"], 100 * GiB, 8 * GiB, 1 * GiB, gpu["retries"]), lambda off: 3 * GiB)
    budgets, kept = [], []

    def look(off):
        budgets.append(off._budget)
        kept.append(off.layers_kept)
        if len(budgets) == 3:
            gpu["free"] = 50 * GiB  # 50 GiB more

    got = steps(GPT, adaptive(store_dir, device_budget="auto"), batches=(2,) * 6, on_step=look)
    assert_same(steps(GPT, batches=(2,) * 6), got)
    # The first step: half of the 3 GiB of room (8 cached, less a margin of 5). Then 3 GiB
    # beside the activations leave nothing: every block recomputed, its inputs offloaded.
    assert budgets[:3] == [3 * GiB // 2, 0, 0] and kept[1:3] == [0, 0]
    # Room for all: kept (a step later where a busy machine's store waits filled the last
    # step's blocks, leaving it unmeasured).
    assert budgets[3] == 50 * GiB and kept[4:] == [4, 4] and kept[3] in (0, 4), kept


def test_an_auto_device_budget_shrinks_at_once_for_a_larger_batch(store_dir, monkeypatch, caplog):
    # 3 GiB allocated beside the activations, 2 of them before each step. A forward of twice
    # the batch makes twice the 1 GiB of the step's own: 1 GiB less to keep.
    fake_gpu(monkeypatch, lambda: Memory(50 * GiB, 100 * GiB, 8 * GiB, 1 * GiB, 0, 2 * GiB), lambda off: 3 * GiB)
    budgets = []
    with caplog.at_level("INFO", logger="ssdtier"):
        ssd = adaptive(store_dir, device_budget="auto")
        got = steps(GPT, ssd, batches=(2, 2, 2, 4, 4), on_step=lambda off: budgets.append(off._budget))
    assert_same(steps(GPT, batches=(2, 2, 2, 4, 4)), got)
    # 53 GiB of room (58 free and cached, less 5), less 3: 50 GiB; for batch 4, 53 - 2 - 2 x 1
    # from its first block on; the same batch again: as measured.
    assert budgets[1:3] == [50 * GiB] * 2 and 48.9 * GiB < budgets[3] < 49.1 * GiB and budgets[4] == 50 * GiB
    assert caplog.text.count("this forward saves 2.00x the last one's: device budget 49") == 1


def test_an_auto_device_budget_shrinks_for_inputs_longer_than_any_by_a_little(store_dir, monkeypatch, caplog):
    # Batches of 10, then 11 and 12: each under 1.1x the last, each larger than any before:
    # the budget is cut for each (what is allocated beside the activations grows with it).
    fake_gpu(monkeypatch, lambda: Memory(50 * GiB, 100 * GiB, 8 * GiB, 1 * GiB, 0, 2 * GiB), lambda off: 3 * GiB)
    sizes = (10, 10, 10, 11, 12, 12)
    with caplog.at_level("INFO", logger="ssdtier"):
        got = steps(GPT, adaptive(store_dir, device_budget="auto"), batches=sizes)
    assert_same(steps(GPT, batches=sizes), got)
    assert caplog.text.count("this forward saves 1.10x the last one's") == 1, caplog.text
    assert caplog.text.count("this forward saves 1.09x the last one's") == 1, caplog.text


class _Boom(torch.autograd.Function):
    """Raises in backward: a step whose backward fails midway (a caught out-of-memory error)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


@pytest.mark.parametrize("raised", [False, True], ids=["", "after-a-backward-raised"])
def test_a_backward_that_reaches_no_early_block_still_reads_the_counters_as_it_ends(store_dir, monkeypatch, raised):
    # The embedding and the first block frozen: the backward unpacks nothing there, yet the
    # step's peak is read as it ends (a loop that resets the counters would hide it); also
    # after a backward that raised, whose callback never ran.
    reads = []

    class Meter:
        def counters(self):
            return Counters(len(reads), 0)

        def reset_peak(self):
            pass

    init = Adaptive.__init__

    def start(self, off):
        init(self, off)
        self.watch.meter = Meter()

    def frozen(model):
        for m in (model.tok_emb, model.pos_emb, model.blocks[0]):
            m.requires_grad_(False)
        calls = []

        def boom(module, args, out):  # the second forward's backward raises at block 2
            calls.append(1)
            return _Boom.apply(out) if raised and len(calls) == 2 else out

        model.blocks[1].register_forward_hook(boom)

    def backward(loss):
        try:
            loss.backward()
        except RuntimeError as e:
            assert raised and "boom" in str(e)

    def look(off):
        reads.append(off.adaptive.watch.end)

    monkeypatch.setattr(Adaptive, "__init__", start)
    sizes = (2,) * 4
    got = train(
        GPT, adaptive(store_dir, device_budget="1GiB"), sizes=sizes, prepare=frozen, on_step=look, backward=backward
    )
    assert_same(train(GPT, sizes=sizes, prepare=frozen, backward=backward), got)
    assert all(end is not None for i, end in enumerate(reads) if not (raised and i == 1)), reads


def test_an_auto_device_budget_reads_the_allocator_a_bounded_number_of_times(store_dir, monkeypatch):
    """Each read of the allocator's counters costs tens of microseconds: a step reads them at
    the forward's end, at 8 blocks' backward and the first's, and at the head's tensors,
    however deep the model. What is allocated beside the activations grows through a
    backward (here 1 MiB a block, as gradients accumulate): the budget is what reading at
    every block gives."""
    import ssdtier.offload.adaptive as adaptive_mod

    reads, per_step, budgets = [0], [], []

    def beside(off):
        reads[0] += 1
        return 3 * GiB + len(off.adaptive.profile.marks) * (1 << 20)

    def look(off):
        per_step.append(reads[0])
        reads[0] = 0
        budgets.append(off._budget)

    fake_gpu(monkeypatch, lambda: Memory(50 * GiB, 100 * GiB, 8 * GiB, 1 * GiB, 0), beside)
    for n in (24, 48):
        cfg = GPTConfig(n_layers=n, **TINY)
        got = steps(cfg, adaptive(store_dir, device_budget="auto"), batches=(2,) * 3, on_step=look)
        assert_same(steps(cfg, batches=(2,) * 3), got)
    sparse = budgets[:]
    assert len(set(per_step)) == 1 and per_step[0] < 24, per_step  # was 34 and 58
    budgets.clear()
    monkeypatch.setattr(adaptive_mod, "SAMPLES", 1 << 20)  # every block read
    for n in (24, 48):
        steps(GPTConfig(n_layers=n, **TINY), adaptive(store_dir, device_budget="auto"), batches=(2,) * 3, on_step=look)
    # 50 GiB of room less what the backward had reached last (n blocks and what runs before
    # them: n + 1 MiB): the growth is seen whole.
    mib = 1 << 20
    assert sparse == budgets and budgets[1::3] == [50 * GiB - 25 * mib, 50 * GiB - 49 * mib], budgets


class _FakeTime:
    """The profile's clock in the test below: advanced by the blocks themselves."""

    t = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.t


class _Tick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        _FakeTime.t += fwd
        ctx.bwd = bwd
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _FakeTime.t += ctx.bwd
        return g, None, None


class _TickBlock(nn.Module):
    def __init__(self, bwd):
        super().__init__()
        self.fc, self.bwd = nn.Linear(64, 64), bwd

    def forward(self, x):
        # Its backward's first op unpacks (tanh's output): the layer is marked reached there.
        return torch.tanh(self.fc(_Tick.apply(x, 0.01, self.bwd)))


def test_each_blocks_backward_is_measured_not_assumed(store_dir, monkeypatch):
    # Forwards of 10 ms; backwards of 20 ms, and 100 ms for block 2 (on the test's clock).
    import ssdtier.offload.profile as profile

    monkeypatch.setattr(profile, "time", _FakeTime)
    forced(monkeypatch, (K,) * 4)
    model = nn.Sequential(*(_TickBlock(b) for b in (0.02, 0.02, 0.1, 0.02)))
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        model(torch.randn(8, 64, requires_grad=True)).sum().backward()
        blocks, head = off.adaptive.profile.blocks()
    assert [b.forward_s for b in blocks] == pytest.approx([0.01] * 4)
    assert [b.backward_s for b in blocks[1:]] == pytest.approx([0.02, 0.1, 0.02])
    assert blocks[0].backward_s == pytest.approx(0.02)  # nothing marks its end: the median share


class _TimedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fwd = nn.Linear(64, 64), 0.01

    def forward(self, x):
        return torch.tanh(self.fc(_Tick.apply(x, self.fwd, 0.02)))


def test_a_blocks_time_is_the_median_of_its_recent_steps(store_dir, monkeypatch):
    # On the H100 one step read a 6 ms block as 0 and another as 23 ms (the host's waits):
    # a plan solved from that step recomputes the "free" block. The median of the last three
    # steps with the same inputs is used; a larger batch starts afresh.
    import ssdtier.offload.profile as profile

    monkeypatch.setattr(profile, "time", _FakeTime)
    forced(monkeypatch, (K,) * 3)
    model = nn.Sequential(*(_TimedBlock() for _ in range(3)))
    seen = []
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        for batch, odd in ((8, 0.01), (8, 0.01), (8, 0.0001), (8, 0.05), (16, 0.03)):
            model[1].fwd = odd
            model(torch.randn(batch, 64, requires_grad=True)).sum().backward()
            blocks, _ = off.adaptive.profile.blocks()
            seen.append(round(blocks[1].forward_s, 6))
        assert [b.forward_s for b in blocks] == pytest.approx([0.01, 0.03, 0.01])
    assert seen == [0.01, 0.01, 0.01, 0.01, 0.03]


class _Ev:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_timings_the_gpu_has_not_finished_are_not_waited_for(store_dir, monkeypatch):
    """A host ahead of the GPU: reading the last step's CUDA events at the next forward would
    wait for its backward to end. Such steps are dropped, 3 in a row at most; the 4th waits.
    Each read step's peak is learned from its own counters, and a dropped step's waits are
    charged to no plan."""
    hooked(monkeypatch)
    from ssdtier.offload.profile import Profile

    p = Profile(2, torch.device("cuda"), lambda: 0.0, False)
    p.end_mark, p.marks = _Ev(True), [(2, _Ev(True), 0.0), (1, _Ev(False), 0.0)]
    assert not p.ready()
    p.marks[-1][1].done = True
    assert p.ready()

    done = iter([False, False, False, False, True, False, True, True])
    monkeypatch.setattr(Profile, "ready", lambda self: next(done))
    read, reads, learned, adopted = [], [], [], []
    blocks = Profile.blocks
    monkeypatch.setattr(Profile, "blocks", lambda self: read.append(len(reads)) or blocks(self))

    class Meter:  # the allocator's counters: the step's number
        def counters(self):
            return Counters(len(reads), len(reads))

        def reset_peak(self):
            pass

    init, adopt = Adaptive.__init__, Adaptive._adopt

    def start(self, off):
        init(self, off)
        self.watch.meter = Meter()

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(Watch, "learn", lambda self, b, h, start, end: learned.append((start[0], end[0])))
    monkeypatch.setattr(Adaptive, "_adopt", lambda self, *a: adopted.append(a[-1]) or adopt(self, *a))
    # A fixed budget: it learns the peak its model misses from the counters.
    got = steps(
        GPT, adaptive(store_dir, device_budget=1 << 30), batches=(2,) * 9, on_step=lambda off: reads.append(None)
    )
    assert_same(steps(GPT, batches=(2,) * 9), got)
    # Replans 2 to 9 (the first has nothing to read): the 4th unread step waits, then as ready.
    assert read == [4, 5, 7, 8], read
    # The last step's counters, as it began and in its backward; waits are not judged right
    # after dropped steps (theirs spill over).
    assert learned == [(3, 3), (4, 4), (6, 6), (7, 7)], learned
    assert adopted == [False, True, False, True], adopted


def test_an_auto_budget_reads_the_steps_peak_in_its_backward(store_dir, monkeypatch):
    hooked(monkeypatch)
    # A loop resets the allocator's peak counter before each step: the counters read as the
    # step began say 1 GiB, as its backward reached the first block 9 GiB. The budget of the
    # next step counts those 9, as a fixed budget learns from them.
    from ssdtier.offload.budget import AutoBudget

    gib = 1 << 30
    seen = []

    class Meter:  # the allocator's (peak, allocated): reset as each step begins
        backward = False

        def counters(self):
            return Counters(9 * gib, 2 * gib) if self.backward else Counters(1 * gib, 1 * gib)

    class FakeGpu:
        def memory(self):
            return Memory(50 * gib, 100 * gib, 8 * gib, 1 * gib, 0)

        def allocated(self):
            return 2 * gib

    init, next_budget = Adaptive.__init__, AutoBudget.next

    def start(self, off):
        init(self, off)
        self.watch.meter, self.watch.gpu = Meter(), FakeGpu()

    def recorded(self, held, queued, mem, step_peak=None, **kw):
        seen.append(step_peak)
        return next_budget(self, held, queued, mem, step_peak=step_peak, **kw)

    replan, reached = Adaptive.replan, Adaptive.backward_reached

    def in_forward(self, f):
        self.watch.meter.backward = False
        replan(self, f)

    def in_backward(self, tag, acts=None):
        self.watch.meter.backward = True
        reached(self, tag, acts)

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(Adaptive, "replan", in_forward)
    monkeypatch.setattr(Adaptive, "backward_reached", in_backward)
    monkeypatch.setattr(AutoBudget, "next", recorded)
    got = steps(GPT, adaptive(store_dir, device_budget="auto"), batches=(2,) * 4)
    assert_same(steps(GPT, batches=(2,) * 4), got)
    assert seen == [None] + [9 * gib] * 3, seen


def test_the_steps_peak_is_read_as_its_backward_ends(store_dir, monkeypatch):
    # The first block's backward (its tensors restored or recomputed) and the embedding's
    # come after the backward reaches that block: a peak there is the step's too.
    hooked(monkeypatch)
    gib = 1 << 30
    learned = []

    class Meter:  # (peak, allocated): 5 GiB until the embedding's gradient is made, then 7
        done = False

        def counters(self):
            return Counters(7 * gib if self.done else 5 * gib, gib)

        def reset_peak(self):
            pass

    meter = Meter()
    init = Adaptive.__init__

    def start(self, off):
        init(self, off)
        self.watch.meter = meter

    def prepare(model):
        def seen(grad):
            meter.done = True

        model.tok_emb.weight.register_hook(seen)

    replan = Adaptive.replan

    def in_forward(self, f):
        meter.done = False
        replan(self, f)

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(Adaptive, "replan", in_forward)
    monkeypatch.setattr(Watch, "learn", lambda self, b, h, start, end: learned.append(end[0]))
    got = steps(GPT, adaptive(store_dir, device_budget=1 << 30), batches=(2,) * 3, prepare=prepare)
    assert_same(steps(GPT, batches=(2,) * 3, prepare=prepare), got)
    assert learned and set(learned) == {7 * gib}, learned


def test_a_fixed_budget_learns_its_steps_peak_below_an_earlier_higher_one(store_dir, monkeypatch):
    # The counter holds 100 GiB from before attach (another phase, another model); each step
    # peaks at 9 GiB. Without a reset no step sets a new peak and the loss's memory stays 0.
    hooked(monkeypatch)
    gib = 1 << 30
    learned = []

    class Meter:  # (peak, allocated): 1 GiB allocated between steps
        peak = 100 * gib

        def counters(self):
            return Counters(self.peak, gib)

        def reset_peak(self):
            self.peak = gib

    meter = Meter()
    init, learn, reached = Adaptive.__init__, Watch.learn, Adaptive.backward_reached

    def start(self, off):
        init(self, off)
        self.watch.meter = meter

    def in_backward(self, tag, acts=None):
        meter.peak = max(meter.peak, 9 * gib)
        reached(self, tag, acts)

    def recorded(self, *a):
        learn(self, *a)
        learned.append(self.working)

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(Adaptive, "backward_reached", in_backward)
    monkeypatch.setattr(Watch, "learn", recorded)
    got = steps(GPT, adaptive(store_dir, device_budget=64 << 20), batches=(2,) * 4)
    assert_same(steps(GPT, batches=(2,) * 4), got)
    assert len(learned) == 3 and all(7 * gib < w < 8 * gib for w in learned), learned


def test_an_auto_budget_holds_while_it_grows_by_under_5_percent(store_dir, monkeypatch):
    hooked(monkeypatch)
    # The plan a budget was solved for stands while the budget only grows (the copies queued
    # and the samples move it a little each step); growth past 5% and any cut are taken.
    from types import SimpleNamespace

    from ssdtier.offload import offloader
    from ssdtier.offload.budget import AutoBudget

    mb = 1 << 20
    made = iter([None, 100 * mb, 102 * mb, 104 * mb, 106 * mb, 90 * mb])
    used, init, set_budget = [], Adaptive.__init__, offloader.Offloader.device_budget

    def start(self, off):
        init(self, off)
        self.watch.gpu = SimpleNamespace(memory=lambda: None, allocated=lambda: 0)  # the budgets are scripted

    monkeypatch.setattr(Adaptive, "__init__", start)
    monkeypatch.setattr(AutoBudget, "next", lambda self, *a, **k: next(made))
    monkeypatch.setattr(offloader.Offloader, "device_budget", lambda self, b: used.append(b) or set_budget(self, b))
    got = steps(GPT, adaptive(store_dir, device_budget="auto"), batches=(2,) * 6)
    assert_same(steps(GPT, batches=(2,) * 6), got)
    assert used == [None, 100 * mb, 100 * mb, 100 * mb, 106 * mb, 90 * mb], used


class _TickCopyBlock(_TickBlock):
    def forward(self, x):
        return torch.tanh(self.fc(_Tick.apply(x, 0.01, self.bwd)).clone())


def test_what_offloading_costs_past_its_waits_is_measured_per_byte(store_dir, monkeypatch):
    # Offloaded blocks take 60 ms a step, kept ones 30 (on the test's clock), for as many
    # bytes: offloading is charged 30 ms per block's bytes, and the offloaded blocks' own
    # time is what the kept ones take.
    import ssdtier.offload.profile as profile

    monkeypatch.setattr(profile, "time", _FakeTime)
    monkeypatch.setattr(Adaptive, "_forward_waits", lambda self: 0.0)
    monkeypatch.setattr(Adaptive, "_backward_waits", lambda self: 0.0)
    forced(monkeypatch, (K, OF, K, OF))
    model = nn.Sequential(*(_TickCopyBlock(b) for b in (0.02, 0.05, 0.02, 0.05)))
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        model(torch.randn(8, 64, requires_grad=True)).sum().backward()
        blocks, _ = off.adaptive.profile.blocks()
        per_byte = off.adaptive.profile.io_per_byte
    nbytes = blocks[2].bytes
    assert [b.bytes for b in blocks[1:]] == [nbytes] * 3
    assert per_byte * nbytes == pytest.approx(0.03)
    assert [b.offload_s for b in blocks[1:]] == pytest.approx([0.03] * 3)
    assert [b.forward_s + b.backward_s for b in blocks[1:]] == pytest.approx([0.03] * 3)


def test_a_fixed_budget_learns_the_peak_the_model_misses():
    # The allocator's counters against the model's peak for what the last forward ran: the
    # difference is added to every plan; a step that set no new peak only bounds it.
    from types import SimpleNamespace

    from ssdtier.plan import Block, Head, Transfers, simulate

    mb = 1 << 20
    blocks = [Block(i, 100 * mb, 10 * mb, 0.01, 0.02, 0.01) for i in range(4)]
    tr = Transfers(1e9, 1e9, 10e9, 10e9, 1 << 30)
    head = Head(30 * mb)
    model = simulate(blocks, [K] * 4, tr, head).peak
    me = SimpleNamespace(ad=SimpleNamespace(ran=[K] * 4, transfers=lambda: tr), working=0)
    base = 2 * GiB
    peak = base + model + 500 * mb
    Watch.learn(me, blocks, head, Counters(base, base), Counters(peak, base))  # a new peak
    assert me.working == 500 * mb
    # The same peak, from 300 MiB higher:
    Watch.learn(me, blocks, head, Counters(peak, base + 300 * mb), Counters(peak, base))
    assert me.working == 200 * mb
    Watch.learn(me, blocks, head, Counters(peak, base), Counters(base + mb, base + mb))  # reset within the step
    assert me.working == 200 * mb
    Watch.learn(me, blocks, head, Counters(peak, base), None)  # no backward reached the first block
    assert me.working == 200 * mb
    # A loop that resets the counters before each step (as benches do): the step's own peak.
    Watch.learn(me, blocks, head, Counters(base + mb, base), Counters(base + model + 700 * mb, base))
    assert me.working == 700 * mb


def test_the_guard_expects_the_sources_a_plan_leaves_leaving():
    # Block 0 offloaded, its copy still under way as block 1 starts: held as planned, the
    # guard lets the plan run; 10% more than planned is growth it must act on.
    from types import SimpleNamespace

    from ssdtier.plan import Block, Head, Transfers, solve

    mb = 1 << 20
    blocks = [Block(i, 100 * mb, 10 * mb, 0.01, 0.02, 0.01) for i in range(4)]
    tr = Transfers(1e9, 1e9, 5e9, 5e9, 1 << 30)
    plan = solve(blocks, tr, 320 * mb, Head())
    assert plan.fits and plan.actions[0] is not K and plan.outcome.before[1] > 0, plan.table()
    for held, switched in ((plan.outcome.before[1], 0), (int(plan.outcome.before[1] * 1.1) + 40 * mb, 1)):
        f = SimpleNamespace(acts=list(plan.actions), off_tag=[False] * 6)
        me = SimpleNamespace(
            off=SimpleNamespace(_budget=320 * mb, c={"guard_recomputed": 0}),
            held=lambda held=held: held,
            plan=plan,
            swell=1.0,
            switched=0,
            _saving=lambda acts, i: 1.0,
            profile=SimpleNamespace(recomputable=[Recomputable.YES] * 4, calls=[1] * 4),
        )
        me.limit = lambda me=me: Adaptive.limit(me)
        Adaptive.guard(me, f, 2)
        assert me.switched == switched, (held, plan.outcome.before, plan.outcome.forward_peak)
        assert me.off.c["guard_recomputed"] == switched


class _Views(nn.Module):
    """One stack run on two views of the input in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 64), nn.Linear(64, 1)
        mlp = lambda: nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())  # noqa: E731
        self.blocks = nn.ModuleList(mlp() for _ in range(4))

    def stack(self, h):
        for b in self.blocks:
            h = b(h)
        return h

    def forward(self, x):
        h = self.inp(x)
        return (self.out(self.stack(h)) * self.out(self.stack(h.flip(0)))).mean()


def test_the_guard_does_not_count_a_blocks_first_call_again_at_its_second(store_dir):
    # The plan has both calls' bytes in its one pass; projected from there at the second
    # call, the first pass's bytes were counted twice and every second call recomputed.
    def run(budget=None, steps=8):
        torch.manual_seed(0)
        model = _Views()
        gen = torch.Generator().manual_seed(2)
        off = ssdtier.attach(model, adaptive(store_dir, device_budget=budget)) if budget else None
        switched = []
        for _ in range(steps):
            model(torch.randn(128, 8, generator=gen)).backward()
            switched.append(off.c["guard_recomputed"] if off is not None else 0)
        plan = off.plan() if off is not None else None
        if off is not None:
            off.detach()
        return [p.grad for p in model.parameters()], switched, plan

    peak = run(1 << 30, 3)[2].outcome.peak
    want = run()
    got = run(int(0.7 * peak))
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))
    assert got[2].fits and got[1][1:] == [got[1][0]] * 7, got[1]  # the first forward's guard only


def test_the_guard_scales_by_what_this_forward_saved():
    # The first block takes the same inputs, yet blocks save 1.2x what the plan has them save
    # (attention's T x T scores grow faster than a block's inputs): held, the last block's
    # 100 MiB would fit; its 120 do not.
    from types import SimpleNamespace

    from ssdtier.plan import Block, Head, Transfers, solve

    mb = 1 << 20
    blocks = [Block(i, 100 * mb, 10 * mb, 0.01, 0.02, 0.01) for i in range(4)]
    plan = solve(blocks, Transfers(1e3, 1e3, host=0), 455 * mb, Head())
    assert plan.fits and plan.actions == (K,) * 4, plan.table()
    for saved, switched in ((100 * mb, 0), (120 * mb, 1)):
        f = SimpleNamespace(acts=list(plan.actions), off_tag=[False] * 6)
        me = SimpleNamespace(
            off=SimpleNamespace(_budget=455 * mb, c={"guard_recomputed": 0}),
            held=lambda saved=saved: 3 * saved,
            plan=plan,
            swell=1.0,
            since=1,
            switched=0,
            profile=SimpleNamespace(
                saved=[0, saved, saved, saved, 0, 0], recomputable=[Recomputable.YES] * 4, calls=[1] * 4
            ),
        )
        me._saving = lambda acts, i, me=me: Adaptive._saving(me, acts, i)
        me._backward_peak = lambda acts, i, me=me: Adaptive._backward_peak(me, acts, i)
        me.limit = lambda me=me: Adaptive.limit(me)
        Adaptive.guard(me, f, 4)
        assert me.switched == switched and f.acts[3] is (RO if switched else K), (saved, f.acts)


def test_a_plan_predicted_anew_says_whether_it_fits_now():
    # Chosen at longer inputs where nothing fitted, then predicted within the budget at
    # shorter ones: its reason still said "nothing fits" beside "within" (a hunt's stats()).
    from types import SimpleNamespace

    from ssdtier.plan import Block, Head, Transfers, simulate, solve

    mb, tr = 1 << 20, Transfers(1e3, 1e3, host=0)
    plan = solve([Block(i, 100 * mb, 10 * mb, 0.01, 0.02, 0.01) for i in range(4)], tr, 20 * mb, Head())
    assert not plan.fits and "nothing fits" in plan.reason and " past 20MiB" in plan.summary(), plan.table()
    short = [Block(i, 10 * mb, 1 * mb, 0.01, 0.02, 0.01) for i in range(4)]
    now = simulate(short, plan.actions, tr, Head(), 20 * mb)
    again = Adaptive._again(SimpleNamespace(plan=plan), now, short, tr, Head(), 20 * mb, 0.12)
    assert again.fits and "nothing fits" not in again.reason and " within 20MiB" in again.summary(), again.table()


def test_a_plan_stands_on_noisy_measurements_until_it_no_longer_serves(store_dir):
    # On the H100 a solve took 20-100 ms of the host at a forward's start, and timings that
    # moved past 5% solved again at every step. The plan in force now stands while, predicted
    # anew, it fits and is no slower than when solved; a budget it passes, a larger budget
    # (room for a faster plan) or RESOLVE steps solve again.
    import random

    from ssdtier.offload import adaptive as adaptive_mode
    from ssdtier.plan import Block, Head, Transfers

    mb = 1 << 20
    rng = random.Random(0)

    def measured(jitter=0.0):
        def moved(x):
            return x * (1 + rng.uniform(-jitter, jitter))

        return [Block(i, 100 * mb, 10 * mb, moved(0.01), moved(0.02), 0.01) for i in range(4)]

    head = Head(30 * mb, 0.005, 0.01)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        ad = off.adaptive
        ad.transfers = lambda: Transfers(1e9, 1e9, 10e9, 10e9, 1 << 30)  # not the store's measured speed
        ad._adopt(measured(), head, 250 * mb, False)
        plan = ad.plan
        assert ad.solving.count == 1 and plan.fits and plan.count(K) < 4, plan.table()
        for _ in range(10):  # 40% of noise: not the same inputs; solved again after 2, then 4 steps
            ad._adopt(measured(0.4), head, 250 * mb, False)
        assert ad.solving.count == 3 and ad.plan.actions == plan.actions
        assert ad.plan.decisions[0].block != plan.decisions[0].block  # predicted anew: the guard reads it
        ad._adopt(measured(), head, 240 * mb, False)  # a smaller budget it still fits
        assert ad.solving.count == 3
        ad._adopt(measured(), head, 120 * mb, False)  # one it passes: a kept block and the head
        assert ad.solving.count == 4 and ad.plan.fits and ad.plan.count(K) == 0, ad.plan.table()
        ad._adopt(measured(), head, 500 * mb, False)  # room for everything: a faster plan may fit
        assert ad.solving.count == 5
        for _ in range(adaptive_mode.RESOLVE + 1):  # from the fifth solve on, every RESOLVE steps
            ad._adopt(measured(0.4), head, 500 * mb, False)
        assert ad.solving.count == 6


def test_a_plan_stands_while_its_measurements_do():
    # A solve takes milliseconds at the start of a forward: measurements within 5% of those
    # the plan was solved from keep it; a budget, a learned peak or a block's bytes moved do not.
    # (A peak learned again, a few MiB off, is the same.)
    from ssdtier.offload.adaptive import same_inputs
    from ssdtier.plan import Block, Head, Transfers

    mb = 1 << 20
    blocks = [Block(i, 100 * mb, 10 * mb, 0.010, 0.020, 0.010, 0.001) for i in range(4)]
    tr, head = Transfers(1e9, 1e9, 10e9, 10e9, 1 << 30), Head(30 * mb, 0.005, 0.01)
    was = (blocks, tr, head, 300 * mb)
    noisy = [dataclasses.replace(b, forward_s=b.forward_s * 1.04, offload_s=0.0015) for b in blocks]
    assert same_inputs((noisy, tr, head, 300 * mb), was)
    assert not same_inputs((blocks, tr, head, 200 * mb), was)
    assert not same_inputs((blocks, tr, dataclasses.replace(head, working=10 * mb), 300 * mb), was)
    assert same_inputs((blocks, tr, dataclasses.replace(head, working=mb), 300 * mb), was)  # 1% of a block
    grown = [dataclasses.replace(b, bytes=120 * mb) if b.index == 2 else b for b in blocks]
    assert not same_inputs((grown, tr, head, 300 * mb), was)
    assert not same_inputs((blocks, dataclasses.replace(tr, per_byte_s=1e-9), head, 300 * mb), was)


class _NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(32, 32), nn.BatchNorm1d(32)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 1)
        self.blocks = nn.ModuleList(_NormBlock() for _ in range(4))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h).pow(2).mean()


def _norm_steps(ssd=None, n=4):
    torch.manual_seed(0)
    model = _NormNet()
    gen = torch.Generator().manual_seed(2)
    off = ssdtier.attach(model, ssd) if ssd is not None else None
    for _ in range(n):
        model(torch.randn(16, 8, generator=gen)).backward()
    unhooked = off.stats().forwards_unhooked if off is not None else 0
    if off is not None:
        off.detach()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, {n: p.grad for n, p in model.named_parameters()}, unhooked


@pytest.mark.parametrize("unhooked", [False, True])
def test_a_recomputed_block_updates_its_batch_norms_statistics_once(store_dir, monkeypatch, unhooked):
    forced(monkeypatch, (R, RO, K, K))
    if unhooked:
        unhooked_from_second(monkeypatch)
    want_state, want_grads, _ = _norm_steps()
    state, grads, ran = _norm_steps(adaptive(store_dir, min_tensor_bytes=1024))
    assert ran == (3 if unhooked else 0)
    for k in want_state:
        assert torch.equal(want_state[k], state[k]), k  # running_mean, running_var, num_batches_tracked
    for k in want_grads:
        assert torch.equal(want_grads[k], grads[k]), k


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(32, 128), nn.Linear(128, 32), nn.Dropout(0.1)

    def forward(self, hidden, mask):
        return hidden + self.drop(self.fc2(torch.relu(self.fc1(hidden)))) * mask


class _KeywordNet(nn.Module):
    """Blocks called with their inputs by keyword (as diffusers' are), one mask for all."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 1)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(4))

    def forward(self, x):
        h, mask = self.inp(x), torch.ones(64, 32, device=x.device)
        for b in self.blocks:
            h = b(hidden=h, mask=mask)
        return self.out(h).pow(2).mean()


def test_inputs_passed_by_keyword_leave_with_a_recomputed_block(store_dir, monkeypatch):
    # Checkpointing saves only positional inputs through the hooks (and keeps only their
    # devices' RNG): keyword tensors are passed positionally, and counted as the block's
    # inputs; the mask every block takes, once.
    forced(monkeypatch, (RO,) * 4)

    def run(ssd=None):
        torch.manual_seed(0)
        model = _KeywordNet()
        gen = torch.Generator().manual_seed(2)
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        losses = []
        for _ in range(2):
            loss = model(torch.randn(2, 64, 8, generator=gen))
            loss.backward()
            losses.append(loss.detach())
        inputs = list(off.adaptive.profile.inputs) if off is not None else None
        stats = off.stats() if off is not None else None
        if off is not None:
            off.detach()
        return (losses, {n: p.grad for n, p in model.named_parameters()}, stats), inputs

    got, inputs = run(adaptive(store_dir, min_tensor_bytes=1024))
    assert_same(run()[0], got)
    block_input, mask = 2 * 64 * 32 * 4, 64 * 32 * 4
    assert inputs == [block_input + mask] + [block_input] * 3, inputs
    assert got[2].bytes_offloaded >= 4 * block_input


def _loop(ssd, between):
    """The GPT trained 4 steps of batch 2, with ``between(model, step)`` before each step."""
    torch.manual_seed(0)
    model = build_model(GPT)
    gen = torch.Generator().manual_seed(2)
    data = [make_batch(GPT, 2, gen) for _ in range(4)]
    off = ssdtier.attach(model, ssd) if ssd is not None else None
    torch.manual_seed(1)
    plans = []
    for i, b in enumerate(data):
        between(model, i)
        batch_loss(model, b).backward()
        if off is not None and off.adaptive.plan is not None:
            plans.append([d.block.bytes for d in off.adaptive.plan.decisions])
    grads = [p.grad for p in model.parameters()]
    if off is not None:
        off.detach()
    return grads, plans


def test_a_forward_that_raised_is_not_planned_from(store_dir):
    # Block 2 raises in step 0's forward (caught, the step skipped): the next plan comes from
    # whole forwards, not one whose blocks 2 and 3 never ran (planned as saving 0 bytes).
    raised = []

    def between(model, step):
        if step == 0:
            raised.clear()  # each run raises once
            blk = model.blocks[2]

            def boom(*a, **k):
                raise RuntimeError("a bad batch")

            blk.register_forward_pre_hook(lambda m, a: boom() if not raised and not raised.append(1) else None)
            with pytest.raises(RuntimeError, match="a bad batch"):
                batch_loss(model, make_batch(GPT, 2, torch.Generator().manual_seed(9)))

    got, plans = _loop(adaptive(store_dir, device_budget=1 << 30), between)
    want, _ = _loop(None, between)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert plans and all(all(b > 0 for b in p) for p in plans), plans


def test_a_forward_no_backward_followed_is_not_planned_from(store_dir):
    # An evaluation with gradients on (no torch.no_grad), at batch 8 between steps of batch 2:
    # its blocks' bytes are not the training's, and no backward measured it.
    def between(model, step):
        if step == 2:
            batch_loss(model, make_batch(GPT, 8, torch.Generator().manual_seed(9)))

    budget = adaptive(store_dir, device_budget=1 << 30)
    got, plans = _loop(budget, between)
    _, plain = _loop(adaptive(store_dir, device_budget=1 << 30), lambda m, s: None)
    want, _ = _loop(None, between)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert plans == plain, (plans, plain)


def test_a_recomputed_blocks_bytes_follow_the_kept_ones_at_another_length(store_dir, monkeypatch):
    # Plain attention saves T x T scores: at twice the length a block saves more than twice
    # as much. A block kept at length 32 and recomputed at 64 is planned as saving what the
    # blocks kept at 64 save per input byte, not its bytes at 32 scaled by its inputs.
    cfg = GPTConfig(n_layers=4, **{**TINY, "seq_len": 64})
    forced(monkeypatch, (K,) * 4)
    torch.manual_seed(0)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(2)
    off = ssdtier.attach(model, adaptive(store_dir))
    for length, acts in ((32, (K,) * 4), (64, (K, R, K, K))):
        off.set_actions(acts)
        batch_loss(model, make_batch(dataclasses.replace(cfg, seq_len=length), 2, gen)).backward()
    blocks, _ = off.adaptive.profile.blocks()
    off.detach()
    assert blocks[1].bytes >= 0.95 * blocks[2].bytes, [b.bytes for b in blocks]


class _Attending(nn.Module):
    """A decoder block: its own input, and a context (an encoder's output) that every block
    saves, stored once as the first block's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.kv, self.b = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x)) + self.kv(context)))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Attending() for _ in range(4))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, context)
        return x.square().mean()


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_context_every_block_saves_is_read_ahead_of_the_last(store_dir, ahead):
    # Stored as the first block's, the context was in block 1's read-ahead group, which the
    # backward reaches last: with prefetch_layers = N, block 4 read it on demand.
    torch.manual_seed(0)
    model = _Decoder()
    want = copy.deepcopy(model)
    x, context = torch.randn(64, 64), torch.randn(64, 64)
    with ssdtier.attach(model, offload_config(store_dir, prefetch_layers=ahead, keep_last_layers=0)) as off:
        demand, ahead_now = [], [False]
        start, read = off.ahead.start, off._start_read

        def spy_start(forward, layer):
            ahead_now[0] = True
            start(forward, layer)
            ahead_now[0] = False

        def spy_read(e):
            if not ahead_now[0]:
                demand.append(e.nbytes)
            read(e)

        off.ahead.start, off._start_read = spy_start, spy_read
        loss = model(x, context * 1)  # (context * 1: a tensor made in the forward)
        wait_copies(off)  # every write done: each entry is read back, ahead or on demand
        loss.backward()
        s = off.stats()
    want(x, context * 1).backward()
    for p, q in zip(want.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert s.dedup_hits == 7 and s.bytes_read_nvme > 0
    assert demand == [], "the head's backward reads block 4's entries ahead, the context among them"


def test_a_context_every_block_saves_marks_each_block_reached_once(store_dir, monkeypatch):
    # Unpacked in the last block's backward, the context's entry (the first block's) marked
    # block 1 reached there: block 4 reached twice, taken for a second backward of the graph.
    forced(monkeypatch, (OF,) * 4)
    reached = []
    was = Adaptive.backward_reached
    monkeypatch.setattr(
        Adaptive, "backward_reached", lambda self, tag, acts=None: (reached.append(tag), was(self, tag, acts))
    )
    torch.manual_seed(0)
    model = _Decoder()
    want = copy.deepcopy(model)
    x, context = torch.randn(64, 64), torch.randn(64, 64)
    with ssdtier.attach(model, adaptive(store_dir)) as off:
        for _ in range(2):
            reached.clear()
            model(x, context * 1).backward()  # (context * 1: a tensor made in the forward)
            assert reached == [5, 4, 3, 2, 1], reached
        assert off.stats().dedup_hits == 2 * 7  # the context 3 times, each tanh output saved again
        # Two micro-batches share the context, stored as the first's: each backward marks its own.
        reached.clear()
        shared = context * 1
        first, second = model(x, shared), model(-x, shared)
        second.backward()
        first.backward()
        assert reached == [5, 4, 3, 2, 1] * 2, reached
    for _ in range(2):
        want(x, context * 1).backward()
    shared = context * 1
    first, second = want(x, shared), want(-x, shared)
    second.backward()
    first.backward()
    for p, q in zip(want.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_store_that_fails_its_measurement_is_planned_as_a_slow_disk(store_dir, monkeypatch, warned):
    from ssdtier.errors import OutOfSpaceError
    from ssdtier.offload.adaptive import UNMEASURED

    def full(*a):
        raise OutOfSpaceError(28, "no space for 8388608 bytes")

    monkeypatch.setattr(Adaptive, "_measure", staticmethod(full))
    with ssdtier.attach(build_model(GPT), adaptive(store_dir)) as off:
        assert off.adaptive.bw == (UNMEASURED, UNMEASURED)
    assert warned("could not measure the store's speed (")
