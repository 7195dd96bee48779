"""CUDA staging: device-to-host copies on the offload stream into the registered
arena, forwarding while a copy is in flight, and exact gradients. Skipped
without CUDA; run on a GPU machine."""

from __future__ import annotations

import pytest
import torch

import ssdtier
from ssdtier.models import GPTConfig, batch_loss, build_model, make_batch

from .test_attach import (
    TINY,
    _SlowBackward,
    _SlowBlock,
    assert_same,
    check_storage_freed_while_copied_out,
    offload_config,
)

# CUBLAS_WORKSPACE_CONFIG (needed for deterministic cuBLAS) is set in conftest.py, before CUDA starts.

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def train_cuda(cfg, ssd=None, micro=3, sleep_cycles=0):
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        model = build_model(cfg).cuda()
        gen = torch.Generator().manual_seed(2)
        batches = [make_batch(cfg, 2, gen, device="cuda") for _ in range(micro)]
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        torch.manual_seed(1)
        losses = []
        for b in batches:
            loss = batch_loss(model, b)
            if sleep_cycles:
                # Keep the compute stream busy so offload copies are still in flight at backward.
                torch.cuda._sleep(sleep_cycles)
            loss.backward()
            losses.append(loss.detach())
        torch.cuda.synchronize()
        grads = {n: p.grad for n, p in model.named_parameters()}
        stats = off.stats() if off else None
        if off:
            off.detach()
        return losses, grads, stats
    finally:
        torch.use_deterministic_algorithms(False)


CFG = GPTConfig(n_layers=3, **TINY)


def test_a_storage_freed_while_copied_out_is_served_as_autograd_would(store_dir, warned):
    check_storage_freed_while_copied_out(store_dir, warned, "cuda")


@pytest.mark.parametrize("host", ["64KiB", "64MiB"])
def test_exact_gradients_on_cuda(store_dir, host):
    ref = train_cuda(CFG)
    got = train_cuda(CFG, offload_config(store_dir, host=host))
    assert_same(ref, got)
    s = got[2]
    assert s.tensors_offloaded > 0
    if host == "64KiB":
        assert s.bytes_read_nvme > 0
    else:
        assert s.forwarded + s.copied_ahead > 0


def run_with_copies_pending(store_dir, block, evict):
    """Six ``block``s, trained with and without ssdtier: every copy to the arena is done
    before the backward (synchronize); with ``evict`` every entry is then on NVMe only. The
    GPU sleep keeps the compute stream busy, so the copies back to the GPU on the prefetch
    stream (which wait for the work queued before them) are still pending when the unpacks
    come. Asserts exact gradients; returns the offloader's stats."""
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        ref, model = (torch.nn.Sequential(*[block() for _ in range(6)]).cuda() for _ in range(2))
        model.load_state_dict(ref.state_dict())
        x = torch.randn(128, 64, device="cuda")
        with ssdtier.attach(model, offload_config(store_dir, host="64MiB")) as off:
            for m in (ref, model):
                loss = m(x).square().sum()
                torch.cuda.synchronize()
                if m is model:
                    off.cuda.poll()  # commits the copies to the arena, all done now
                    if evict:
                        for group in off._by_layer.values():
                            for e in group:
                                off.store._native.evict(e.key)
                torch.cuda._sleep(50_000_000)
                loss.backward()
            torch.cuda.synchronize()
            s = off.stats()
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    finally:
        torch.use_deterministic_algorithms(False)
    return s


@pytest.mark.parametrize("evict", [False, True])
def test_read_ahead_copies_on_the_prefetch_stream(store_dir, evict):
    # Each block's backward takes 30 ms on the host, so the read-ahead's reads are done before
    # their unpack and the entries are copied to the GPU on the prefetch stream ahead of it:
    # an unpack that did not make the compute stream wait for that copy would read garbage.
    s = run_with_copies_pending(store_dir, _SlowBlock, evict)
    # Two saved tensors per block; the last block's are read when its backward starts, the
    # next two blocks' are in the arena (or on their way) then: at least blocks 1..4 go ahead.
    assert s.tensors_offloaded == 12
    assert s.copied_ahead >= 8, s
    if evict:
        assert s.bytes_read_nvme > 0


class _TwoStreamBlock(torch.nn.Module):
    """Two halves of one activation used on two streams: ``h`` (saved by tanh) and its two
    column halves (saved by the matmuls, one of them run on a side stream) are one entry.
    In backward autograd runs each matmul's backward on its forward's stream, so the entry
    is unpacked on both streams."""

    side: dict[int, torch.cuda.Stream] = {}

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.a = torch.nn.Parameter(torch.randn(32, 32) / 8)
        self.b = torch.nn.Parameter(torch.randn(32, 32) / 8)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        main = torch.cuda.current_stream()
        side = self.side.setdefault(main.device.index, torch.cuda.Stream())
        side.wait_stream(main)
        left = h[:, :32] @ self.a
        with torch.cuda.stream(side):
            right = torch.sin(h[:, 32:]) @ self.b
        main.wait_stream(side)
        right.record_stream(main)
        return _SlowBackward.apply(torch.cat([left, right], 1))


@pytest.mark.parametrize("evict", [False, True])
def test_an_entry_unpacked_on_two_streams_is_waited_for_on_both(store_dir, evict):
    # The copies ahead are still pending when the unpacks come: whichever stream unpacks the
    # entry second must wait for the copy as well as the first, or it reads a block still
    # being filled.
    s = run_with_copies_pending(store_dir, _TwoStreamBlock, evict)
    assert s.dedup_hits > 0 and s.copied_ahead > 0, s


def test_races_widened_with_sleep(store_dir):
    ref = train_cuda(CFG, sleep_cycles=50_000_000)
    got = train_cuda(CFG, offload_config(store_dir), sleep_cycles=50_000_000)
    assert_same(ref, got)


def test_bf16_autocast_on_cuda(store_dir):
    def run(ssd):
        torch.manual_seed(0)
        model = build_model(CFG).cuda()
        batch = make_batch(CFG, 2, torch.Generator().manual_seed(2), device="cuda")
        off = ssdtier.attach(model, ssd) if ssd else None
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = batch_loss(model, batch)
        loss.backward()
        if off:
            off.detach()
        return [loss.detach()], {n: p.grad for n, p in model.named_parameters()}, None

    torch.use_deterministic_algorithms(True)
    try:
        assert_same(run(None), run(offload_config(store_dir)))
    finally:
        torch.use_deterministic_algorithms(False)


def test_store_round_trip_of_cuda_tensors(store_dir):
    from .conftest import store_config

    x = torch.randn(1000, 300, device="cuda")
    with ssdtier.TieredStore(store_config(store_dir, host="1MiB")) as store:
        k = store.put(x.t())
        store.evict(k)
        out = store.get(k)
        assert out.device == x.device and torch.equal(out, x.t())


def test_a_failed_arena_registration_is_a_warning_not_a_later_cuda_error(store_dir, warned):
    """The arena registered by someone else first: ssdtier's cudaHostRegister fails. That
    failure is left in the CUDA runtime for the thread's next error check, which torch makes
    after its next kernel: it is cleared, so training goes on (copies are synchronous)."""
    ref = train_cuda(CFG)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        model = build_model(CFG).cuda()
        gen = torch.Generator().manual_seed(2)
        batches = [make_batch(CFG, 2, gen, device="cuda") for _ in range(3)]
        off = ssdtier.attach(model, offload_config(store_dir))
        arena = off.store.arena
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 0)) == 0
        try:
            torch.manual_seed(1)
            losses = []
            for b in batches:
                loss = batch_loss(model, b)
                loss.backward()
                losses.append(loss.detach())
            torch.cuda.synchronize()
        finally:
            assert int(cudart.cudaHostUnregister(arena.data_ptr())) == 0
        grads = {n: p.grad for n, p in model.named_parameters()}
        stats = off.stats()
        off.detach()
    finally:
        torch.use_deterministic_algorithms(False)
    assert warned("cudaHostRegister of the host arena failed")
    assert stats.tensors_offloaded > 0
    assert_same(ref, (losses, grads, stats))
