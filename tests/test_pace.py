"""Time spent waiting for the I/O: counted per forward and backward, and said once when it is
a large share of the training loop's time."""

from __future__ import annotations

import pytest
import torch

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch
from ssdtier.offload.stats import WaitShare

from .conftest import store_config

CFG = GPTConfig(n_layers=3, vocab_size=64, seq_len=64, d_model=64, n_heads=2)
SLOW = "the I/O can hide"


@pytest.fixture(autouse=True)
def short_windows(monkeypatch):
    monkeypatch.setattr(WaitShare, "EVERY", 3)


def steps(ssd, n=6):
    torch.manual_seed(0)
    model = build_model(CFG)
    gen = torch.Generator().manual_seed(2)
    with ssdtier.attach(model, ssd) as off:
        for _ in range(n):
            batch_loss(model, make_batch(CFG, 4, gen)).backward()
        return off.stats()


def config(path, mode="all", throttle=None, host="256KiB"):
    # zero_copy off: CPU tensors go through the arena, whose room the store makes by writing out.
    io = {"throttle": throttle} if throttle else {}
    cfg = store_config(path, host=host, zero_copy=False, **io)
    cfg["policy"] = {"min_tensor_bytes": 0, "keep_last_layers": 0, "mode": mode}
    return cfg


def any_wait(monkeypatch):
    """Any wait is said: a busy machine's slower steps would make a real wait a smaller share."""
    monkeypatch.setattr(WaitShare, "SHARE", 1e-3)
    monkeypatch.setattr(WaitShare, "LEAST", 0.0)


def test_a_slow_disk_is_said_once_with_what_would_help(store_dir, warned, monkeypatch):
    any_wait(monkeypatch)
    s = steps(config(store_dir, throttle="20MB"))
    assert s.forward_wait_seconds > 0 and s.stall_seconds >= 0
    said = warned(SLOW)
    assert len(said) == 1, said
    assert 'policy.mode = "adaptive"' in said[0] and "host.capacity" in said[0]
    assert "of its time over the last 3 forwards" in said[0]


def test_a_gpu_waiting_on_its_link_is_told_the_disk_is_not_it(store_dir, warned, monkeypatch):
    # As on an H200 with everything offloaded: the host never waits, the GPU does.
    from ssdtier.offload.offloader import Offloader

    waited = iter(range(10_000))
    monkeypatch.setattr(Offloader, "gpu_wait", lambda self: 0.05 * next(waited))
    any_wait(monkeypatch)
    steps(config(store_dir, host="64MiB"))
    (said,) = warned("waiting for activations to move")
    assert "the link to host memory is the limit" in said and "a faster disk would not help" in said


def test_a_disk_that_keeps_up_is_not_said(store_dir, warned):
    s = steps(config(store_dir, host="64MiB"))
    assert s.bytes_offloaded > 0 and s.bytes_written_nvme == 0
    assert not warned(SLOW)


def test_adaptive_mode_is_not_told_what_it_does_itself(store_dir, warned):
    steps(config(store_dir, mode="adaptive", throttle="20MB"))
    assert not warned(SLOW)


def test_windows_start_at_the_second_forward_and_report_per_forward():
    w = WaitShare()
    assert w.check(1, 0.0, 0.0, 0.0) is None  # the first forward pins and allocates
    assert w.check(2, 10.0, 1.0, 0.5) is None  # opens the first window
    assert w.check(3, 11.0, 5.0, 0.5) is None  # inside it
    share, fwd, bwd, gpu = w.check(5, 13.0, 2.5, 1.1, 0.3)  # 1.5 s of 3 s waited: 0.6 s forward, 0.9 s backward
    assert share == pytest.approx(0.5) and fwd == pytest.approx(0.2) and bwd == pytest.approx(0.3)
    assert gpu == pytest.approx(0.1)
    assert w.check(8, 16.0, 2.6, 1.1) is None  # 0.1 s of 3 s
    assert w.check(11, 16.04, 2.62, 1.1) is None  # half of the time, but less than 10 ms a forward


def train_and_evaluate(ssd, keep_graphs: bool, steps=80):
    """Training steps, and every 10th an evaluation forward run with gradients, its loss kept
    (``keep_graphs``, a common slip) or detached."""
    torch.manual_seed(0)
    model = build_model(CFG)
    gen = torch.Generator().manual_seed(2)
    kept = []
    with ssdtier.attach(model, ssd) as off:
        for i in range(steps):
            batch_loss(model, make_batch(CFG, 2, gen)).backward()
            if i % 10 == 0:
                loss = batch_loss(model, make_batch(CFG, 2, gen))
                kept.append(loss if keep_graphs else loss.detach())
        return off.stats()


def test_graphs_kept_without_a_backward_are_said_once(store_dir, warned):
    s = train_and_evaluate(config(store_dir, host="64MiB"), keep_graphs=True)
    assert s.tensors_offloaded > 0
    said = warned("had no backward")
    assert len(said) == 1, said
    assert "torch.no_grad()" in said[0] and ".detach()" in said[0]


def test_evaluation_losses_kept_detached_are_not_said(store_dir, warned):
    train_and_evaluate(config(store_dir, host="64MiB"), keep_graphs=False)
    assert not warned("had no backward")


def test_adaptive_mode_keeps_more_blocks_when_the_gpu_waits(store_dir, monkeypatch):
    # The GPU's waits for copies back count as stalls (as on an H200, where the host never
    # waited): charged to the bytes moved, they make the next plans offload less. What
    # offloading costs past its waits is measured too (tests/test_rok.py): not here, where
    # this tiny model's hooks would decide it by the machine's speed.
    from ssdtier.offload.offloader import Offloader
    from ssdtier.offload.profile import Profile

    monkeypatch.setattr(Profile, "_io_cost", lambda self, fwd: None)

    def plans(gpu_waits):
        calls = iter(range(100_000))
        monkeypatch.setattr(Offloader, "gpu_wait", lambda self: (1.0 * next(calls)) if gpu_waits else 0.0)
        torch.manual_seed(0)
        model = build_model(GPTConfig(n_layers=4, vocab_size=64, seq_len=64, d_model=64, n_heads=2))
        gen = torch.Generator().manual_seed(2)
        kept = []
        with ssdtier.attach(model, config(store_dir, mode="adaptive", host="64MiB")) as off:
            for _ in range(5):
                batch_loss(model, make_batch(CFG, 4, gen)).backward()
                kept.append(off.plan().keep_last if off.plan() is not None else None)
        return kept

    quiet, waited = plans(False), plans(True)
    assert quiet[-1] <= 1, quiet  # the host tier keeps up: all offloaded but the last block
    assert waited[-1] >= 2 and waited[-1] > quiet[-1], (quiet, waited)
