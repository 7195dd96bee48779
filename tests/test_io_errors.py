"""I/O errors under attach(): a write that fails leaves the activation in memory with
exact gradients; a read that fails stops the backward with a clear error, leaks
nothing, and the next step is exact again.

The errors are real ones from the kernel, made by changing the store's open file
under it: truncating it to zero bytes (a read then gets end of file: EIO), or putting
a read-only file in its place with dup2 (a write then gets EBADF)."""

from __future__ import annotations

import errno
import gc
import os
import sys
from pathlib import Path

import pytest
import torch

import ssdtier
from ssdtier.bench.models import batch_loss, build_model, make_batch

from .test_attach import CONFIGS, offload_config, wait_copies

MODEL = CONFIGS["gpt"]
# (device, zero_copy): CPU storages written from their own pages or through the arena; CUDA
# ones always go through the arena (its twin runs only where CUDA is).
WAYS = [
    pytest.param("cpu", True, id="cpu-zero_copy"),
    pytest.param("cpu", False, id="cpu-arena"),
    pytest.param(
        "cuda", False, id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def store_fds(directory: Path) -> list[int]:
    """The descriptors of this process's open files in `directory` (the store's nameless files)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed since listed
        if target.startswith(str(directory) + os.sep):
            fds.append(int(name))
    return fds


def settle(off: ssdtier.Offloader) -> None:
    """Wait until every copy and write of the forward is done and seen done, evictions too."""
    wait_copies(off)
    off.store.flush()


def step(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout
    loss = batch_loss(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def deterministic():
    """cuBLAS and cuDNN pick deterministic kernels (a no-op on the CPU)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def unraisable(monkeypatch):
    """Exceptions raised where Python cannot propagate them (in __del__, from a graph being freed)."""
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


@pytest.mark.parametrize("backend", ["io_uring", "posix"])
@pytest.mark.parametrize(("device", "zero_copy"), WAYS)
def test_a_failed_read_stops_the_backward_clearly_and_leaks_nothing(
    store_dir, backend, device, zero_copy, deterministic, unraisable
):
    torch.manual_seed(0)
    model = build_model(MODEL).to(device)
    batch = make_batch(MODEL, 2, torch.Generator().manual_seed(2), device=device)
    torch.manual_seed(0)
    twin = build_model(MODEL).to(device)
    cfg = offload_config(store_dir, zero_copy=zero_copy)
    cfg["io"]["backend"] = backend
    off = ssdtier.attach(model, cfg)
    try:
        torch.manual_seed(1)
        loss = batch_loss(model, batch)
        settle(off)
        fds = store_fds(store_dir)
        assert fds
        for fd in fds:
            os.ftruncate(fd, 0)  # every offloaded byte is gone: reads hit end of file
        with pytest.raises(ssdtier.SsdtierOSError) as info:
            loss.backward()
        err = info.value
        assert err.errno == errno.EIO
        assert "could not be read back" in str(err) and "read of" in str(err)
        assert err.filename == str(store_dir)
        assert off.stats().failed_reads == 1
        del loss, info, err
        gc.collect()
        # The graph is gone: every entry with it, read ahead or not, and none raised on the way.
        assert off.store.stats().entries == 0
        assert off.entries.live == 0
        assert unraisable == []
        # The next step writes the file again from its start, and is exact.
        got = step(model, batch)
        assert off.stats().bytes_read_nvme > 0
    finally:
        off.detach()
    want = step(twin, batch)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("device", "zero_copy"), WAYS)
def test_failed_writes_keep_activations_in_memory_with_exact_gradients(
    store_dir, device, zero_copy, deterministic, warned, unraisable
):
    cfg = offload_config(store_dir, zero_copy=zero_copy)
    batch = make_batch(MODEL, 2, torch.Generator().manual_seed(2), device=device)

    def run(attach: bool):
        torch.manual_seed(0)
        model = build_model(MODEL).to(device)
        off = ssdtier.attach(model, cfg) if attach else None
        saved = []
        if off is not None:
            read_only = os.open(Path(__file__), os.O_RDONLY)
            for fd in store_fds(store_dir):
                saved.append((fd, os.dup(fd)))
                os.dup2(read_only, fd)  # writes to the store's file now fail with EBADF
            os.close(read_only)
        try:
            out = [step(model, batch) for _ in range(2)]
            stats = off.stats() if off else None
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            if off is not None:
                off.detach()  # the failed writes were dealt with: closing does not raise
        return out, stats

    want, _ = run(False)
    got, stats = run(True)
    for (la, ga), (lb, gb) in zip(want, got, strict=True):
        assert torch.equal(la, lb)
        for a, b in zip(ga, gb, strict=True):
            assert torch.equal(a, b)
    failed = warned("writing an activation to NVMe failed")
    assert len(failed) == 1 and "Bad file descriptor" in failed[0], failed
    assert stats.bytes_read_nvme == 0  # nothing was read from the broken file
    assert stats.failed_writes > 0 and stats.failed_reads == 0
    assert unraisable == []
