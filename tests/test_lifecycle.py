"""When the model's forward does not run as a plain training step: another thread, a forward
interrupted by KeyboardInterrupt, saved-tensor hooks disabled, a torch.func transform, a
failed attach, buffers swapped by `.to()`. ssdtier's saved-tensor hooks are per thread (as
torch's are) and none may be left behind; gradients stay exact."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import ssdtier
from ssdtier.errors import SsdtierError

from .test_attach import offload_config


class _Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * x


class _Net(nn.Module):
    def __init__(self, n=3, d=64):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.stop: BaseException | None = None  # raised inside the forward when set

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 1 and self.stop is not None:
                raise self.stop
        return x.square().mean()


def _twins(n=3):
    torch.manual_seed(0)
    ref, model = _Net(n), _Net(n)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def _step(m, x):
    m.zero_grad()
    loss = m(x)
    loss.backward()
    return loss.detach(), _grads(m)


def _same(a, b):
    assert torch.equal(a[0], b[0])
    for p, q in zip(a[1], b[1], strict=True):
        assert torch.equal(p, q)


def _no_hooks_left():
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is None


X = torch.randn(128, 64)


def test_a_forward_interrupted_by_keyboard_interrupt_leaves_no_hooks(store_dir, warned):
    """torch runs always_call forward hooks only for an Exception: after a KeyboardInterrupt
    the hooks pushed by the pre-hook are still on. The next forward of the model removes them
    (with a warning), and so does detach(): autograd outside the model is never packed by a
    closed offloader."""
    ref, model = _twins()
    off = ssdtier.attach(model, offload_config(store_dir))
    model.stop = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        model(X)
    model.stop = None
    assert not _no_hooks_left(), "torch left the hooks on, as expected"
    for _ in range(2):
        before = off.stats().tensors_offloaded
        _same(_step(ref, X), _step(model, X))
        assert off.stats().tensors_offloaded > before
        assert _no_hooks_left()
    assert len(warned("did not finish")) == 1

    model.stop = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        model(X)
    off.detach()
    assert _no_hooks_left()
    assert warned("was not finished at detach()")
    a = torch.randn(300, 300, requires_grad=True)
    a.sin().sum().backward()  # packed by nobody now (it raised "the store is closed" before)
    assert torch.equal(a.grad, a.detach().cos())


def test_a_forward_pre_hook_that_raises_does_not_turn_offloading_off(store_dir):
    """A user's pre-hook registered before attach() raises: ssdtier's pre-hook does not run,
    its always_call forward hook does. The next forwards offload as before."""
    ref, model = _twins()
    fail = [True]

    def reject(module, args):
        if fail[0]:
            fail[0] = False
            raise ValueError("a bad batch")

    model.register_forward_pre_hook(reject)
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        with pytest.raises(ValueError, match="a bad batch"):
            model(X)
        assert _no_hooks_left()
        for _ in range(2):
            before = off.stats().tensors_offloaded
            _same(_step(ref, X), _step(model, X))
            assert off.stats().tensors_offloaded > before


def test_with_saved_tensor_hooks_disabled_nothing_is_offloaded_and_a_warning_says_why(store_dir, warned):
    ref, model = _twins()
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        for _ in range(2):
            with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region"):
                _same(_step(ref, X), _step(model, X))
        assert off.stats().tensors_offloaded == 0
        assert len(warned("disable_saved_tensors_hooks")) == 1, "warned once"
        _same(_step(ref, X), _step(model, X))
        assert off.stats().tensors_offloaded > 0


def test_torch_func_transforms_run_as_without_ssdtier(store_dir, warned):
    """torch.func refuses saved-tensor hooks: under a transform ssdtier pushes none."""
    ref, model = _twins()

    def per_sample_grads(m):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, x):
            return torch.func.functional_call(m, p, (x.unsqueeze(0),))

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, X[:8])

    want = per_sample_grads(ref)
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        got = per_sample_grads(model)
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k
        assert warned("torch.func")
        _same(_step(ref, X), _step(model, X))
        assert off.stats().tensors_offloaded > 0


def test_an_eval_thread_beside_the_training_thread(store_dir):
    """Saved-tensor hooks are per thread: a no_grad forward of the same model on another
    thread, while the training thread is inside its forward or backward, must neither pop
    the training thread's hooks nor change the layer its packs are tagged with."""
    ref, model = _twins(4)
    stop = threading.Event()
    errors = []

    def evaluate():
        try:
            while not stop.is_set():
                with torch.no_grad():
                    model(X)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    with ssdtier.attach(model, offload_config(store_dir)) as off:
        _same(_step(ref, X), _step(model, X))
        per_step = off.stats().tensors_offloaded
        assert per_step > 0
        t = threading.Thread(target=evaluate)
        t.start()
        try:
            for _ in range(20):
                before = off.stats().tensors_offloaded
                _same(_step(ref, X), _step(model, X))
                assert off.stats().tensors_offloaded - before == per_step
        finally:
            stop.set()
            t.join()
        assert not errors, errors
        assert not off.entries.by_layer or all(e.layer > 0 for g in off.entries.by_layer.values() for e in g)


def test_two_training_threads(store_dir):
    check_two_training_threads(offload_config(store_dir))


def check_two_training_threads(cfg):
    """Two threads each run forward and backward of one attached model (as DataParallel's
    replicas do, sharing its hooks): each gets the gradients of a run without ssdtier."""
    ref, model = _twins(4)
    xs = [torch.randn(128, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def grads(m, x):
        return torch.autograd.grad(m(x), list(m.parameters()))

    want = [grads(ref, x) for x in xs]
    got: list = [None, None]
    errors = []
    barrier = threading.Barrier(2)

    def run(i):
        try:
            barrier.wait()
            for _ in range(10):
                g = grads(model, xs[i])
                assert all(torch.equal(a, b) for a, b in zip(want[i], g, strict=True))
            got[i] = g
        except BaseException as e:
            errors.append(e)

    with ssdtier.attach(model, cfg) as off:
        grads(model, xs[0])
        per_step = off.stats().tensors_offloaded
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert off.stats().tensors_offloaded == (1 + 2 * 10) * per_step
        assert off.entries.live == 0
    assert _no_hooks_left()


class _Scaled(nn.Module):
    """Saves a buffer: ``x * scale`` keeps ``scale`` for the gradient of ``x``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64)])
        self.register_buffer("scale", torch.rand(128, 64))

    def forward(self, x):
        return (self.blocks[0](x) * self.scale).sum()


def test_buffers_swapped_by_to_are_still_recognised(store_dir):
    """`.to(dtype)` puts new tensors in the modules' buffer dicts: looked up every forward,
    they are still recognised as buffers, not offloaded as activations."""
    model = _Scaled()
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        model(torch.randn(128, 64)).backward()
        first = off.stats().tensors_offloaded
        model.double()
        model(torch.randn(128, 64, dtype=torch.float64)).backward()
        assert off.stats().tensors_offloaded == 2 * first  # the same tensors, the buffer not among them
        scale = model.scale
        assert all(e.nbytes != scale.untyped_storage().nbytes() for g in off.entries.by_layer.values() for e in g)


@pytest.mark.parametrize("mode", ["all", "adaptive"])
def test_a_detached_model_is_freed_when_the_user_lets_go_of_it(store_dir, mode):
    # The offloader's parts refer to it (a cycle the collector would break only later):
    # they must not hold the model, whose GPU memory a next run needs now.
    import gc
    import weakref

    from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=4, dropout=0.0)
    model = build_model(cfg)
    data = make_batch(cfg, 2, torch.Generator().manual_seed(1), device="cpu")
    policy = {"mode": mode} if mode == "adaptive" else {}
    off = ssdtier.attach(model, offload_config(store_dir, **policy))
    for _ in range(3):
        batch_loss(model, data).backward()
    off.detach()
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()
    assert off.model is None and "gone" in repr(off)


def test_a_failed_attach_leaves_nothing_behind(store_dir):
    """attach() fails half-way (here a block refuses its hook, after the model's and another
    block's were added): the model has no hook of ssdtier's, so it trains as before and can
    be attached again."""
    ref, model = _twins()
    hooks = [(m._forward_pre_hooks.copy(), m._forward_hooks.copy()) for m in model.modules()]

    def refuse(*args, **kwargs):
        raise SsdtierError("no hook here")

    model.blocks[1].register_forward_hook = refuse
    with pytest.raises(SsdtierError, match="no hook here"):
        ssdtier.attach(model, offload_config(store_dir, mode="adaptive"))
    del model.blocks[1].register_forward_hook
    assert [(m._forward_pre_hooks, m._forward_hooks) for m in model.modules()] == hooks
    assert ssdtier.offload.attached(model) is None
    _same(_step(ref, X), _step(model, X))
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        _same(_step(ref, X), _step(model, X))
        assert off.stats().tensors_offloaded > 0


def test_kept_tensors_sharing_a_storage_are_counted_once(store_dir):
    """peak_resident_bytes counts a storage once, however many kept tensors share it, and
    every unpack of a kept tensor is served from memory (counted as forwarded)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(256, 1024, bias=False)])

        def forward(self, x):
            h = self.blocks[0](x)  # 1 MiB, saved by sin and by cos
            return (h.sin() + h.cos()).sum()

    model = Twice()
    x = torch.randn(256, 256)  # saved by the Linear: 256 KiB
    with ssdtier.attach(model, offload_config(store_dir, mode="none")) as off:
        model(x).backward()
        s = off.stats()
    assert s.tensors_offloaded == 0 and s.tensors_kept == 3
    assert s.peak_resident_bytes == (256 + 1024) * 256 * 4
    assert s.forwarded == s.unpacks == 3


class _Outer(nn.Module):
    """An attached model whose forward calls another attached model (its submodule)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.inner = _Net(3)

    def forward(self, x):
        return self.inner(self.blocks[1](self.blocks[0](x)))


def test_nested_attached_models_interrupted_inside_leave_no_hooks(store_dir, warned):
    """The inner model's forward is interrupted: both models' hooks are left on (the inner's
    on top). The outer's next forward removes both."""
    torch.manual_seed(0)
    ref, model = _Outer(), _Outer()
    model.load_state_dict(ref.state_dict())
    outer = ssdtier.attach(model, offload_config(store_dir))
    inner = ssdtier.attach(model.inner, offload_config(store_dir))
    model.inner.stop = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        model(X)
    model.inner.stop = None
    _same(_step(ref, X), _step(model, X))
    assert _no_hooks_left()
    assert warned("2 of the saved-tensor hooks left on were removed")
    assert inner.stats().tensors_offloaded > 0 and outer.stats().tensors_offloaded > 0
    inner.detach()
    outer.detach()
    a = torch.randn(300, 300, requires_grad=True)
    a.sin().sum().backward()
    assert _no_hooks_left() and torch.equal(a.grad, a.detach().cos())


class _Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x, again=True):
        x = self.blocks[0](x)
        if not again:
            return x
        x = self(x, again=False)  # the model called inside its own forward
        return self.blocks[1](x).square().mean()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_model_called_inside_its_own_forward(store_dir, compiled, warned):
    """The inner call finds the outer call's hooks on: it is not taken for an interrupted
    forward (no warning), and the hooks come off once, at the outer call's end."""
    torch.manual_seed(0)
    ref, model = _Recursive(), _Recursive()
    model.load_state_dict(ref.state_dict())
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        run = torch.compile(model, backend="eager") if compiled else model
        counts = []
        for _ in range(2):
            want = torch.autograd.grad(ref(X), list(ref.parameters()))
            got = torch.autograd.grad(run(X), list(model.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            assert _no_hooks_left()
            counts.append(off.stats().tensors_offloaded)
        # The same every step (so nothing of the inner call's was lost to a wrong "interrupted").
        assert counts[0] > 0 and counts[1] == 2 * counts[0]
    assert not warned("did not finish")


def test_torch_compile_traces_the_hooks_without_a_graph_break(store_dir, recwarn):
    """torch.compile traces the model's hooks: what they call must be traceable (a call it
    cannot trace breaks the graph and warns)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    ref, model = _twins(4)
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        run = torch.compile(model, backend=backend)
        for _ in range(3):
            _same(_step(ref, X), _step(run, X))
        assert off.stats().tensors_offloaded > 0
    assert len(graphs) == 1
    assert not [w for w in recwarn if "Dynamo" in str(w.message)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(store_dir, backend):
    """fullgraph=True refuses any graph break: the model's hooks (which push saved-tensor
    hooks, something Dynamo cannot trace) run outside the compiled frame, as save_on_cpu's
    context does, and the compiled graph's saved tensors still go through ssdtier."""
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # inductor's CPU reductions: a fixed order, so twins match bitwise
    try:
        ref, model = _twins(4)
        compiled_ref = torch.compile(ref, fullgraph=True, backend=backend)
        with ssdtier.attach(model, offload_config(store_dir)) as off:
            run = torch.compile(model, fullgraph=True, backend=backend)
            for _ in range(2):
                _same(_step(compiled_ref, X), _step(run, X))
            assert off.stats().tensors_offloaded > 0 and off.stats().bytes_read_nvme > 0
        assert _no_hooks_left()
    finally:
        torch.set_num_threads(threads)


def test_scope_offloads_a_step_that_does_not_call_the_model(store_dir, warned):
    """A step that runs the model's blocks itself (as a LightningModule's training_step may)
    gets nothing offloaded by the model's hooks; inside offload.scope() it does, and a call
    of the model inside the scope is not taken for an interrupted forward."""
    ref, model = _twins()

    def parts(m, x):
        for b in m.blocks:
            x = b(x)
        return x.square().mean()

    with ssdtier.attach(model, offload_config(store_dir)) as off:
        for use_model in (False, True):
            before = off.stats().tensors_offloaded
            ref.zero_grad()
            want = parts(ref, X)
            want.backward()
            model.zero_grad()
            with off.scope():
                loss = model(X) if use_model else parts(model, X)
            assert _no_hooks_left()
            loss.backward()
            _same((want.detach(), _grads(ref)), (loss.detach(), _grads(model)))
            assert off.stats().tensors_offloaded > before
    assert not warned("did not finish")


@pytest.mark.parametrize("keep_last_layers", [0, 1])
def test_a_graph_dropped_without_backward_frees_what_it_saved(store_dir, keep_last_layers):
    """An evaluation loss computed with gradients on and dropped: its graph goes at once, as
    without ssdtier. A handle holding an op's own output (tanh's) with its grad_fn would be a
    cycle through autograd's graph that gc cannot free."""
    model = _Net(4)
    cfg = offload_config(store_dir, host="1MiB", keep_last_layers=keep_last_layers)
    with ssdtier.attach(model, cfg) as off:
        loss = model(torch.randn(256, 64))
        assert off.entries.live > 0 and (off.res.kept > 0) == (keep_last_layers > 0)
        del loss
        assert off.entries.live == 0 and off.res.kept == 0
        assert off.store.stats().entries == 0


class _Block(torch.nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def _compiled_run(store_dir, how):
    """Gradients and stats of 4 blocks compiled ``how`` (None: eager), keeping the last block."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(4)])
    if how == "blocks":  # each block its own graph, as torchtitan compiles, before attaching
        for i in range(4):
            model[i] = torch.compile(model[i], backend="aot_eager", fullgraph=True)
    cfg = offload_config(store_dir, keep_last_layers=1)
    with ssdtier.attach(model, cfg) as off:
        run = torch.compile(model, backend="aot_eager") if how == "whole" else model
        x = torch.randn(8, 16, 64)
        for _ in range(2):
            run(x).sum().backward()
        return [p.grad for p in model.parameters()], off.stats()


def test_blocks_compiled_before_attaching_are_blocks_as_in_eager(store_dir, warned):
    eager, _ = _compiled_run(store_dir, None)
    blocks, c = _compiled_run(store_dir, "blocks")
    assert all(torch.equal(a, b) for a, b in zip(eager, blocks, strict=True))
    # The last block kept, the three others offloaded: each block's saved tensors told apart.
    assert c.tensors_offloaded == 3 * c.tensors_kept > 0, c
    assert not warned("traced ssdtier's block hooks")


def test_a_whole_compiled_model_is_told_to_compile_each_block(store_dir, warned):
    eager, _ = _compiled_run(store_dir, None)
    whole, _ = _compiled_run(store_dir, "whole")
    assert all(torch.equal(a, b) for a, b in zip(eager, whole, strict=True))
    said = warned("traced ssdtier's block hooks")
    assert len(said) == 1 and "blocks[i] = torch.compile(b)" in said[0]


def test_fullgraph_where_the_hooks_are_inside_names_ssdtier_and_the_way_out(store_dir):
    import inspect

    if "reason" not in inspect.signature(torch.compiler.disable).parameters:
        pytest.skip("torch < 2.8: torch.compiler.disable takes no reason to show")
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    with ssdtier.attach(model, offload_config(store_dir)):
        run = torch.compile(model, fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="ssdtier's model hooks") as e:
            run(torch.randn(2, 8, requires_grad=True))
    assert "compile each block before attaching" in str(e.value)


ATTACH_THEN_COMPILE = """
import json, sys, torch, ssdtier
cfg = json.loads(sys.argv[1])
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x)) * x
        return x.square().mean()
torch.manual_seed(0)
model = Net()
x = torch.randn(32, 64)
def grads(run):
    model.zero_grad(set_to_none=True)
    run(x).backward()
    return [p.grad.clone() for p in model.parameters()]
want = grads(model)
with ssdtier.attach(model, cfg) as off:
    assert torch.equal(grads(model)[0], want[0])
    loaded = [m for m in ("torch._dynamo", "sympy") if m in sys.modules]
    assert not loaded, loaded
    if sys.argv[2] == "probe":  # a lookup that loads nothing, as a library checking for Dynamo does
        import importlib.util
        assert importlib.util.find_spec("torch._dynamo") is not None and "torch._dynamo" not in sys.modules
    run = torch.compile(model, fullgraph=True, backend="eager")
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(grads(run), want, strict=True))
    assert off.stats().tensors_offloaded > 0
print("compiled after attaching")
"""


@pytest.mark.parametrize("probe", ["probe", "no probe"])
def test_attach_imports_no_dynamo_and_compiling_after_attach_works(store_dir, probe):
    """Attaching imports no torch._dynamo (sympy, triton: seconds and 160 MiB); a model
    compiled after attaching, with fullgraph=True, still runs ssdtier's hooks outside the
    graph, also after a lookup of Dynamo's spec. A fresh interpreter: this one has imported
    Dynamo."""
    cfg = json.dumps(offload_config(store_dir))
    argv = [sys.executable, "-c", ATTACH_THEN_COMPILE, cfg, probe]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled after attaching" in r.stdout, r.stderr[-3000:]
