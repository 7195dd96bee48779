"""A block recomputed in backward computes what it computed in the forward, whatever its
forward does besides: buffers it changes, keywords checkpointing has names for, inputs it
changes in place (CPU)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

import ssdtier
from ssdtier.offload import forward, recompute
from ssdtier.offload.profile import Recomputable

from .test_rok import OF, RO, K, R, adaptive, forced, unhooked_from_second

N = 4


class _Ema(nn.Module):
    """A running average its forward updates, then computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(32))

    def forward(self, x):
        with torch.no_grad():
            self.avg.mul_(0.5).add_(x.mean(dim=0), alpha=0.5)
        return x * self.avg


class _BufferBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Spectral norm's power iteration updates its vectors (buffers) before each use.
        self.fc = nn.utils.spectral_norm(nn.Linear(32, 32))
        self.ema, self.drop = _Ema(), nn.Dropout(0.1)

    def forward(self, x, scale=1.0, debug=False, preserve_rng_state=True):
        y = x + self.drop(torch.tanh(self.ema(self.fc(x)))) * scale
        # Keywords checkpoint takes for itself: the block's, all the same.
        return y * 0.5 if debug and not preserve_rng_state else y


class _Net(nn.Module):
    def __init__(self, block=_BufferBlock) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 1)
        self.blocks = nn.ModuleList(block() for _ in range(N))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, scale=2.0, debug=True, preserve_rng_state=False) if isinstance(b, _BufferBlock) else b(h)
        return self.out(h).pow(2).mean()


def _steps(ssd=None, block=_BufferBlock, n=4, net=None, wrap=None):
    """``n`` steps of ``net`` (``_Net``) of ``block``s, called through ``wrap(model)`` if given."""
    torch.manual_seed(0)
    model = (net or _Net)(block)
    gen = torch.Generator().manual_seed(2)
    off = ssdtier.attach(model, ssd) if ssd is not None else None
    call = wrap(model) if wrap is not None else model
    torch.manual_seed(1)
    losses = []
    for _ in range(n):
        loss = call(torch.randn(16, 8, generator=gen))
        loss.backward()
        losses.append(loss.detach())
    stats = off.stats() if off is not None else None
    may = list(off.adaptive.profile.recomputable) if off is not None else None
    if off is not None:
        off.detach()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, state, {k: p.grad for k, p in model.named_parameters()}, stats, may


def _assert_same(want, got):
    for a, b in zip(want[0], got[0], strict=True):
        assert torch.equal(a, b), (a, b)
    for i in (1, 2):
        assert want[i].keys() == got[i].keys()
        for k in want[i]:
            assert torch.equal(want[i][k], got[i][k]), k


@pytest.mark.parametrize("unhooked", [False, True])
def test_a_recomputed_block_changes_its_buffers_once_and_computes_with_them_once(store_dir, monkeypatch, unhooked):
    # Recomputed, spectral norm would iterate twice and the average move twice, each used so.
    forced(monkeypatch, (R, RO, K, OF))
    if unhooked:
        unhooked_from_second(monkeypatch)
    want = _steps()
    got = _steps(adaptive(store_dir))
    assert got[3].forwards_unhooked == (3 if unhooked else 0)
    _assert_same(want, got)
    assert "blocks.0.fc.weight_u" in got[1] and "blocks.1.ema.avg" in got[1]


def test_a_recomputed_block_twice_backward_through_a_retained_graph_is_exact(store_dir, monkeypatch):
    forced(monkeypatch, (R,) * N)

    def run(ssd=None):
        torch.manual_seed(0)
        model = _Net()
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        loss = model(torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
        loss.backward(retain_graph=True)
        loss.backward()  # recomputes each block again, from the buffers as the forward found them
        if off is not None:
            off.detach()
        return [loss.detach()], dict(model.state_dict()), {k: p.grad for k, p in model.named_parameters()}

    _assert_same(run(), run(adaptive(store_dir)))


class _LazyNorm(nn.Module):
    """A batch norm whose statistics come to be in its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(32, 32), nn.LazyBatchNorm1d()

    def forward(self, x):
        return x + torch.tanh(self.bn(self.fc(x)))


class _Shared(nn.Module):
    """The block and its average hold one buffer: what one changes, the other reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ema = nn.Linear(32, 32), _Ema()
        self.register_buffer("seen", self.ema.avg)

    def forward(self, x):
        return x + torch.tanh(self.ema(self.fc(x)) + self.seen)


class _Replaced(nn.Module):
    """Replaces its average rather than change it, and drops a buffer after first use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.register_buffer("avg", torch.zeros(32))
        self.register_buffer("warm", torch.full((32,), 2.0), persistent=False)

    def forward(self, x):
        y = self.fc(x)
        if hasattr(self, "warm"):
            y = y * self.warm
            del self.warm
        self.avg = 0.5 * self.avg + 0.5 * y.detach().mean(dim=0)
        return x + torch.tanh(y * self.avg)


class _Hidden(nn.Module):
    """Changes a buffer through ``.data`` (no new version), and holds a scripted batch norm
    (its buffers are TorchScript's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(32, 32), torch.jit.script(nn.BatchNorm1d(32))
        self.register_buffer("avg", torch.zeros(32), persistent=False)

    def forward(self, x):
        y = self.bn(self.fc(x))
        self.avg.data.mul_(0.5).add_(y.detach().mean(dim=0), alpha=0.5)
        return x + torch.tanh(y * self.avg)


class _LazyDrop(nn.Module):
    """Its weights made in its first forward, from the RNG its dropout draws from next."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.LazyLinear(32), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("block", [_LazyNorm, _Shared, _Replaced, _Hidden, _LazyDrop], ids=lambda b: b.__name__)
def test_a_recomputed_blocks_buffers_made_shared_or_replaced_are_exact(store_dir, monkeypatch, block):
    forced(monkeypatch, (R, RO, K, R))
    _assert_same(_steps(block=block, n=3), _steps(adaptive(store_dir), block=block, n=3))


class _Sometimes(nn.Module):
    """Changes a buffer that is not state (not in its state dict) only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.now = nn.Linear(32, 32), False
        self.register_buffer("scale", torch.ones(32), persistent=False)

    def forward(self, x):
        if self.now:
            self.scale.mul_(0.5)
        return x + torch.tanh(self.fc(x) * self.scale)


def test_a_buffer_changed_in_place_uncopied_fails_the_backward_not_the_gradients(store_dir, monkeypatch):
    forced(monkeypatch, (R,) * N)

    def run(ssd=None):
        torch.manual_seed(0)
        model = _Net(_Sometimes)
        gen = torch.Generator().manual_seed(2)
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        grads = []
        for step in range(3):
            for b in model.blocks:
                b.now = step > 0
            loss = model(torch.randn(16, 8, generator=gen))
            try:
                loss.backward()
            except ssdtier.SsdtierError as e:
                assert "changed its buffer 'scale' in place" in str(e) and step == 1
                model.zero_grad()
                continue
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        if off is not None:
            off.detach()
        return grads

    want, got = run(), run(adaptive(store_dir))
    assert len(got) == 2  # the step with no copy raised; the next copied it
    for a, b in zip([want[0], want[2]], got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_model_compiled_whole_in_one_graph_runs_its_blocks_as_they_are(store_dir):
    # Traced, a block is not recomputed, nor watched for changes to its inputs (no guard on
    # their versions, no graph break).
    def run(ssd=None):
        torch._dynamo.reset()
        return _steps(ssd, _LazyNorm, 3, wrap=lambda m: torch.compile(m, backend="eager", fullgraph=True))

    _assert_same(run(), run(adaptive(store_dir, device_budget="4KiB")))


class _InPlace(nn.Module):
    """Scales its input in place before anything saved it: legal, unless recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x.mul_(0.9)
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_a_block_that_changes_its_inputs_is_recomputed_exactly_once_then_kept(store_dir, monkeypatch, warned):
    forced(monkeypatch, (RO, R, K, R))
    want = _steps(block=_InPlace, n=1)
    got = _steps(adaptive(store_dir), block=_InPlace, n=1)
    _assert_same(want, got)  # its first call saved copies of its inputs
    assert got[4] == [Recomputable.INPUTS] * N
    assert len(warned("changes its inputs in place")) == 1


class _Looped(_Net):
    """Each block called twice a forward."""

    def forward(self, x):
        h = self.inp(x)
        for b in [*self.blocks, *self.blocks]:
            h = b(h)
        return self.out(h).pow(2).mean()


def test_a_block_found_to_change_its_inputs_is_not_recomputed_whatever_the_actions(store_dir, monkeypatch):
    forced(monkeypatch, (R,) * N)  # every forward's actions, its second call of each block's too

    _assert_same(_steps(block=_InPlace, n=2, net=_Looped), _steps(adaptive(store_dir), _InPlace, 2, _Looped))


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x, mask, z):
        return x + torch.tanh(self.fc(x) * mask + (z * z.conj()).real)


class _MaskNet(_Net):
    """One mask for every block, and a conjugate view (a lazy bit its copy must keep)."""

    def __init__(self, block=_Masked) -> None:
        super().__init__(block)

    def forward(self, x):
        h = self.inp(x)
        mask = (x[:, :1] > 0).float().expand(-1, 32).contiguous()
        z = (h * 1j).conj()
        for b in self.blocks:
            h = b(h, mask, z)
        return self.out(h).pow(2).mean()


def test_a_first_recomputed_call_copies_each_input_once_a_forward(store_dir, monkeypatch):
    forced(monkeypatch, (R,) * N)
    copied = []
    copy = recompute._copy
    monkeypatch.setattr(recompute, "_copy", lambda t: copied.append(t.dtype) or copy(t))
    want = _steps(block=_Masked, n=2, net=_MaskNet)
    got = _steps(adaptive(store_dir), _Masked, 2, _MaskNet)
    _assert_same(want, got)
    # Each block's input at its first call, the mask and the conjugate view once.
    assert copied == [torch.float32, torch.float32, torch.complex64] + [torch.float32] * (N - 1), copied


def test_a_plan_never_recomputes_a_block_that_changes_its_inputs(store_dir, warned):
    # The first forward's guard would recompute, to hold the budget; each block, found changing
    # its inputs as it runs, is offloaded instead (and not counted); then the plan offloads.
    want = _steps(block=_InPlace, n=5)
    got = _steps(adaptive(store_dir, device_budget="8KiB"), block=_InPlace, n=5)
    _assert_same(want, got)
    assert got[3].guard_recomputed == 0 and got[3].bytes_offloaded > 0
    assert got[3].plan is not None and not any(a.recomputes for a in got[3].plan.actions)
    assert got[4] == [Recomputable.INPUTS] * N
    assert len(warned("changes its inputs in place")) == 1


@dataclasses.dataclass(frozen=True)
class _State:
    h: torch.Tensor
    step: int = 0


_Pair = collections.namedtuple("_Pair", "h step")

_BOXES = {
    "tensor": (lambda h: h, lambda x: x),
    "list": (lambda h: [h, 0], lambda x: x[0]),
    "dict": (lambda h: {"h": h, "step": 0}, lambda x: x["h"]),
    "namedtuple": (lambda h: _Pair(h, 0), lambda x: x.h),
    "ordered": (lambda h: collections.OrderedDict(step=0, h=h), lambda x: x["h"]),
    "dataclass": (lambda h: _State(h), lambda x: x.h),
}


class _Boxed(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.box, self.unbox = _BOXES[kind]
        self.fc, self.drop = nn.Linear(32, 32), nn.Dropout(0.1)

    def forward(self, x):
        h = self.unbox(x)
        return self.box(h + self.drop(torch.tanh(self.fc(h))))


class _BoxNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 1)
        self.box, self.unbox = _BOXES[kind]
        self.blocks = nn.ModuleList(_Boxed(kind) for _ in range(N))

    def forward(self, x):
        h = self.box(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.out(self.unbox(h)).pow(2).mean()


@pytest.mark.parametrize("kind", ["list", "dict", "namedtuple", "ordered", "dataclass"])
def test_a_recomputed_blocks_inputs_in_a_container_are_offloaded_as_tensors_are(store_dir, monkeypatch, kind):
    # Checkpoint hands only the tensors it is called with to the saved-tensor hooks: those in
    # a container it would hold itself, never offloaded, and a dataclass's were measured as 0.
    forced(monkeypatch, (RO,) * N)
    plain = _steps(adaptive(store_dir), kind, net=_BoxNet)
    _assert_same(_steps(None, kind, net=_BoxNet), plain)
    tensor = _steps(adaptive(store_dir), "tensor", net=_BoxNet)
    assert plain[3].tensors_offloaded == tensor[3].tensors_offloaded > 0
    h = torch.ones(2)
    assert any(t is h for t in forward._inputs((_BOXES[kind][0](h),), {}))


class _Aux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x, losses):
        y = torch.tanh(self.fc(x))
        losses.append(y.square().mean())  # an auxiliary loss, collected in a list passed in
        return x + y


class _AuxNet(_Net):
    def forward(self, x):
        h, losses = self.inp(x), []
        for b in self.blocks:
            h = b(h, losses)
        assert len(losses) == N
        return self.out(h).pow(2).mean() + sum(losses)


@pytest.mark.parametrize("acts", [(R,) * N, (RO,) * N], ids=["recompute", "recompute+offload"])
def test_what_a_recomputed_block_adds_to_a_container_it_is_passed_reaches_the_caller_once(store_dir, monkeypatch, acts):
    forced(monkeypatch, acts)
    _assert_same(_steps(None, net=_AuxNet, block=_Aux), _steps(adaptive(store_dir), net=_AuxNet, block=_Aux))


def test_a_model_output_passed_to_a_recomputed_block_is_passed_as_it_is(store_dir, monkeypatch):
    # transformers' outputs order their fields as they are set: held by checkpoint, not made again.
    outputs = pytest.importorskip("transformers.utils")

    @dataclasses.dataclass
    class Out(outputs.ModelOutput):
        h: torch.Tensor | None = None
        step: int | None = None

    _BOXES["model_output"] = (lambda h: Out(h=h, step=0), lambda x: x[0])
    try:
        forced(monkeypatch, (RO,) * N)
        _assert_same(
            _steps(None, "model_output", net=_BoxNet), _steps(adaptive(store_dir), "model_output", net=_BoxNet)
        )
    finally:
        del _BOXES["model_output"]


@dataclasses.dataclass
class _Linked:
    h: torch.Tensor
    parent: _Linked | None = None
    size: int = dataclasses.field(init=False)


def test_inputs_are_measured_through_dataclasses_with_cycles_and_unset_fields():
    h = torch.ones(2)
    a = _Linked(h)
    a.parent = a
    assert [t for t in forward._inputs((a,), {}) if isinstance(t, torch.Tensor)] == [h]
