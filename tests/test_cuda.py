"""CUDA staging: device-to-host copies on the offload stream into the registered
arena, forwarding while a copy is in flight, and exact gradients. Skipped
without CUDA; run on a GPU machine."""

from __future__ import annotations

import gc

import pytest
import torch

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch
from ssdtier.offload.cuda import CudaTransport

from .test_attach import (
    TINY,
    _SlowBackward,
    _SlowBlock,
    assert_same,
    check_storage_freed_while_copied_out,
    offload_config,
)
from .test_fork import private_bytes

# CUBLAS_WORKSPACE_CONFIG (needed for deterministic cuBLAS) is set in conftest.py, before CUDA starts.

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def train_cuda(cfg, ssd=None, micro=3, sleep_cycles=0, shard=None, wrap=None, batch=2, sizes=None, on_step=None):
    """As test_attach.train, on the GPU; ``shard`` is applied to the model before attaching,
    ``wrap`` (torch.compile) after; ``sizes``: each step's batch, instead of ``micro`` x ``batch``;
    ``on_step(off)`` after each step's backward."""
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        model = build_model(cfg).cuda()
        if shard is not None:
            model = shard(model)
        gen = torch.Generator().manual_seed(2)
        batches = [make_batch(cfg, b, gen, device="cuda") for b in sizes or [batch] * micro]
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        runner = wrap(model) if wrap is not None else model
        torch.manual_seed(1)
        losses = []
        grads = {}
        for i, b in enumerate(batches):
            if wrap is not None:  # CUDA graphs (reduce-overhead): the last step's outputs are done with
                torch.compiler.cudagraph_mark_step_begin()
            loss = batch_loss(runner, b)
            if sleep_cycles:
                # Keep the compute stream busy so offload copies are still in flight at backward.
                torch.cuda._sleep(sleep_cycles)
            loss.backward()
            losses.append(loss.detach().clone())  # a CUDA graph's output is overwritten by its next replay
            if on_step is not None and off is not None:
                on_step(off)
            if wrap is not None:
                # Each step's gradients, not a sum: a .grad that is a CUDA graph's output would
                # be overwritten by the next replay (seen with reduce-overhead on an H200).
                for n, p in model.named_parameters():
                    grads[i, n] = None if p.grad is None else _local(p.grad).clone()
                model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if wrap is None:
            grads = {n: _local(p.grad) for n, p in model.named_parameters()}
        stats = off.stats() if off else None
        if off:
            off.detach()
        return losses, grads, stats
    finally:
        torch.use_deterministic_algorithms(False)


def _local(g):
    to_local = getattr(g, "to_local", None)  # a DTensor shard under FSDP2
    return to_local() if to_local is not None else g


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
    stream may still be pending when the unpacks come. The unpack must wait for them.
    Asserts exact gradients; returns the offloader's stats."""
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        ref, model = (torch.nn.Sequential(*[block() for _ in range(6)]).cuda() for _ in range(2))
        model.load_state_dict(ref.state_dict())
        x = torch.randn(128, 64, device="cuda")
        with ssdtier.attach(model, offload_config(store_dir, host="64MiB", prefetch_layers=2)) as off:
            for m in (ref, model):
                loss = m(x).square().sum()
                torch.cuda.synchronize()
                if m is model:
                    off.cuda.poll()  # commits the copies to the arena, all done now
                    if evict:
                        for group in off.entries.by_layer.values():
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


def test_fused_attention_on_cuda(store_dir):
    # The bench's model: scaled_dot_product_attention (memory-efficient in fp32) saves q, k,
    # v, its output, the log-sum-exp and its RNG state (CPU scalars with dropout).
    cfg = GPTConfig(n_layers=3, sdpa=True, **TINY)
    got = train_cuda(cfg, offload_config(store_dir, host="64MiB"))
    assert_same(train_cuda(cfg), got)
    assert got[2].tensors_offloaded > 0


def test_races_widened_with_sleep(store_dir):
    ref = train_cuda(CFG, sleep_cycles=50_000_000)
    got = train_cuda(CFG, offload_config(store_dir), sleep_cycles=50_000_000)
    assert_same(ref, got)


@pytest.mark.parametrize("sdpa", [False, True])
def test_bf16_autocast_on_cuda(store_dir, sdpa):
    # sdpa: flash attention (deterministic mode rules out cuDNN's), the bench's kernels.
    cfg = GPTConfig(n_layers=3, sdpa=sdpa, **TINY)

    def run(ssd):
        torch.manual_seed(0)
        model = build_model(cfg).cuda()
        batch = make_batch(cfg, 2, torch.Generator().manual_seed(2), device="cuda")
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


def test_a_failed_arena_registration_is_a_warning_not_a_later_cuda_error(store_dir, warned, monkeypatch):
    """The arena registered by someone else first: ssdtier's cudaHostRegister fails. That
    failure is left in the CUDA runtime for the thread's next error check, which torch makes
    after its next kernel: it is cleared, so training goes on (copies are synchronous)."""
    from ssdtier.offload import cuda

    ref = train_cuda(CFG)
    cudart = torch.cuda.cudart()
    taken = []
    real = cuda.Pinned.__init__

    def registered_first(self, arena, device):
        assert int(cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 0)) == 0
        taken.append(arena)
        real(self, arena, device)

    monkeypatch.setattr(cuda.Pinned, "__init__", registered_first)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        model = build_model(CFG).cuda()
        gen = torch.Generator().manual_seed(2)
        batches = [make_batch(CFG, 2, gen, device="cuda") for _ in range(3)]
        off = ssdtier.attach(model, offload_config(store_dir))
        assert taken and not off.cuda.registered
        try:
            torch.manual_seed(1)
            losses = []
            for b in batches:
                loss = batch_loss(model, b)
                loss.backward()
                losses.append(loss.detach())
            torch.cuda.synchronize()
        finally:
            assert int(cudart.cudaHostUnregister(taken[0].data_ptr())) == 0
        grads = {n: p.grad for n, p in model.named_parameters()}
        stats = off.stats()
        off.detach()
    finally:
        torch.use_deterministic_algorithms(False)
    assert warned("cudaHostRegister of the host arena failed")
    assert stats.tensors_offloaded > 0
    assert_same(ref, (losses, grads, stats))


class _Wide(torch.nn.Module):
    """Saves one new storage per block: its ReLU's output (the next block's input)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(1024, 1024)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _busy_forward(cfg, n=8, batch=4096, sleep_cycles=200_000_000, keep_graph=True, reserved=None):
    """A forward launched while the GPU is busy (a sleep on the compute stream), as the host
    runs ahead in training: every copy to the arena is still queued at its end. Returns
    the forward's peak allocation above the start, the copies pending at its end, the
    gradients (after the backward), the stats and the offloader's transport calls; the
    forward's peak reservation above the start goes into ``reserved["peak"]``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Wide() for _ in range(n)]).cuda()
    x = torch.randn(batch, 1024, device="cuda")
    with torch.no_grad():
        model(x)  # loads the kernels first (lazily loaded, they take the host past the sleep)
    off = ssdtier.attach(model, cfg) if cfg is not None else None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda._sleep(sleep_cycles)
    y = model(x)
    peak = torch.cuda.max_memory_allocated() - base
    if reserved is not None:
        reserved["peak"] = torch.cuda.max_memory_reserved() - base_reserved
    pending = len(off.cuda.pending) if off is not None else 0
    if keep_graph:
        y.square().sum().backward()
    else:
        del y  # the graph goes while its copies to the arena are in flight
    torch.cuda.synchronize()
    grads = [p.grad for p in model.parameters()]
    stats = off.stats() if off is not None else None
    if off is not None:
        off.cuda.poll()
        live = off.store.stats().entries
        off.detach()
        stats = (stats, live)
    return peak, pending, grads, stats


def test_sources_leave_gpu_memory_while_their_copies_are_queued(store_dir):
    """The forward's peak allocation is keep's minus the offloaded bytes whose storage only
    autograd held, although no copy to the arena has run when the forward ends: ssdtier does
    not hold a source until its copy is seen done (the allocator alone keeps the block, as
    reserved, until the copy has run)."""
    block = 4096 * 1024 * 4
    keep_peak, _, ref, _ = _busy_forward(None)
    cfg = offload_config(store_dir, host="512MiB", keep_last_layers=1)
    peak, pending, got, (stats, _) = _busy_forward(cfg)
    assert pending >= 6, pending  # the copies were queued behind the sleep
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    # Offloaded: the input (the test holds it), blocks 1..7's outputs (block 7's is also
    # saved by the kept block 8, so it stays). One block of slack for the block in use.
    assert stats.bytes_offloaded == 8 * block, stats
    assert keep_peak - peak >= stats.bytes_offloaded - 3 * block, (keep_peak, peak)


def test_copies_queued_reserve_no_more_gpu_memory_than_their_bound(store_dir, monkeypatch):
    """A queued copy's source is freed at once but stays reserved until copied: the queue's
    bound (a share of the GPU's memory, here 2 blocks) caps what the forward reserves over
    what it allocates. Half the arena (16 blocks) would let all 7 queue."""
    from ssdtier.offload import cuda as transport

    block = 4096 * 1024 * 4
    monkeypatch.setattr(transport, "QUEUE_MIN", 0)
    monkeypatch.setattr(transport, "device_memory", lambda device: int(2 * block / transport.QUEUE_SHARE))
    _, _, ref, _ = _busy_forward(None)
    cfg = offload_config(store_dir, host="512MiB", keep_last_layers=1)
    got_reserved = {}
    peak, pending, got, (stats, _) = _busy_forward(cfg, reserved=got_reserved)
    assert pending <= 2 and stats.bytes_offloaded == 8 * block
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    # The bound, and two blocks of slack: a Linear's output before its ReLU, freed and cached.
    assert got_reserved["peak"] - peak <= 4 * block, (got_reserved, peak)


def test_a_graph_freed_while_its_copies_are_queued_frees_their_slots_after(store_dir):
    # A released entry's slot may be filled by a read as soon as it is free: not before its
    # copy into it has run.
    cfg = offload_config(store_dir, host="512MiB", keep_last_layers=1)
    _, pending, _, (_, live) = _busy_forward(cfg, keep_graph=False)
    assert pending >= 6
    assert live == 0


def test_unpacks_before_the_copies_landed_copy_from_the_slots_being_filled(store_dir, monkeypatch):
    """No kept block and a busy GPU: the backward's first unpacks come before their copies to
    the arena have run; they are copied back from those slots after the copies, in stream order."""
    _, _, ref, _ = _busy_forward(None)
    cfg = offload_config(store_dir, host="512MiB", keep_last_layers=0)
    calls = []
    real = CudaTransport._copy_landing

    def counted(self, e, stream):
        calls.append(e.nbytes)
        return real(self, e, stream)

    monkeypatch.setattr(CudaTransport, "_copy_landing", counted)
    _, pending, got, _ = _busy_forward(cfg)
    assert pending >= 7 and calls
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def test_a_small_arena_holds_the_forward_back_not_a_copy_per_tensor(store_dir, warned, monkeypatch):
    """Copies in flight are bounded (half the arena): the forward waits for the oldest,
    instead of a synchronous copy per tensor once the arena is full of slots being filled."""
    _, _, ref, _ = _busy_forward(None, n=6, batch=1024)
    waits = []
    real = CudaTransport._wait_oldest

    def counted(self):
        waits.append(len(self.pending))
        return real(self)

    monkeypatch.setattr(CudaTransport, "_wait_oldest", counted)
    cfg = offload_config(store_dir, host="12MiB", keep_last_layers=0)  # 4 MiB per block
    _, _, got, (stats, live) = _busy_forward(cfg, n=6, batch=1024)
    assert waits and live == 0
    assert not warned("copied synchronously")
    assert stats.bytes_written_nvme > 0
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def test_activations_larger_than_the_arena_leave_without_holding_the_host_back(store_dir, warned):
    """Each 4 MiB tensor is larger than a 1 MiB arena: it is copied to a pinned buffer of its
    own, queued behind the sleep, and written from there, so the forward ends with copies
    still queued, and the gradients are keep's."""
    _, _, ref, _ = _busy_forward(None, n=6, batch=1024)
    cfg = offload_config(store_dir, host="1MiB", keep_last_layers=0)
    _, pending, got, _ = _busy_forward(cfg, n=6, batch=1024)  # the writes may still run: no counts
    assert pending > 0
    assert warned("through a pinned copy of its own") and not warned("copied synchronously")
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def test_fp16_with_grad_scaler(store_dir):
    def run(ssd):
        torch.manual_seed(0)
        model = build_model(CFG).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        gen = torch.Generator().manual_seed(2)
        batches = [make_batch(CFG, 2, gen, device="cuda") for _ in range(3)]
        off = ssdtier.attach(model, ssd) if ssd else None
        torch.manual_seed(1)
        losses = []
        for b in batches:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = batch_loss(model, b)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
        if off:
            off.detach()
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, None

    torch.use_deterministic_algorithms(True)
    try:
        assert_same(run(None), run(offload_config(store_dir, host="64MiB")))
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_on_cuda(store_dir, mode):
    """Inductor's CUDA kernels; with reduce-overhead, CUDA graphs, whose memory their next
    replay reuses whatever the allocator knows."""

    def compiled(model):
        torch._dynamo.reset()
        return torch.compile(model, mode=mode)

    ref = train_cuda(CFG, wrap=compiled)
    got = train_cuda(CFG, offload_config(store_dir, host="64MiB"), wrap=compiled)
    assert_same(ref, got)
    assert got[2].tensors_offloaded > 0


def test_torch_compile_cuda_graphs_with_copies_held_back(store_dir, monkeypatch):
    """reduce-overhead: a CUDA graph's replays write its memory whatever the allocator knows,
    so a saved tensor's memory is not kept for its copy out by record_stream. Each copy out
    waits behind a sleep on its stream (10 ms or more: the whole step's copies land long
    after its forward); the backward waits for them before any later replay, so gradients
    stay exact. 4 blocks of width 512, a 1 GiB arena: copies into slots, not write-through."""
    offload = CudaTransport.offload

    def held_back(self, whole, nbytes, f):
        with torch.cuda.stream(self._streams(whole.device)[0]):
            torch.cuda._sleep(20_000_000)
        return offload(self, whole, nbytes, f)

    def compiled(model):
        torch._dynamo.reset()
        return torch.compile(model, mode="reduce-overhead")

    cfg = GPTConfig(n_layers=4, vocab_size=512, seq_len=256, d_model=512, n_heads=8)
    ref = train_cuda(cfg, wrap=compiled, batch=8, micro=4)
    monkeypatch.setattr(CudaTransport, "offload", held_back)
    got = train_cuda(cfg, offload_config(store_dir, host="1GiB"), wrap=compiled, batch=8, micro=4)
    assert_same(ref, got)
    assert got[2].tensors_offloaded > 0


def test_a_step_captured_by_hand_stays_exact(store_dir, warned):
    """A forward and backward captured with torch.cuda.graph after eager warm-up steps on a
    side stream (offloaded: their copies may still be in flight): nothing is queried during
    the capture, what the captured forward saves stays in memory, and a replay gives the
    gradients it gives without ssdtier. (make_graphed_callables refuses modules with hooks.)"""

    def run(ssd):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_Wide() for _ in range(4)]).cuda()
        x = torch.randn(64, 1024, device="cuda")
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
            # A forward whose copies queue behind a busy GPU, its graph dropped: they are
            # still pending (not polled) when the capture starts.
            torch.cuda._sleep(100_000_000)
            model(x)
        torch.cuda.current_stream().wait_stream(side)
        assert off is None or off.cuda.pending
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x).square().sum().backward()
        graph.replay()
        torch.cuda.synchronize()
        grads = [p.grad.clone() for p in model.parameters()]
        stats = off.stats() if off is not None else None
        if off is not None:
            off.detach()
        return grads, stats

    ref, _ = run(None)
    got, stats = run(offload_config(store_dir, host="64MiB"))
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert stats.tensors_offloaded > 0  # in the warm-up steps
    assert warned("activations saved while a CUDA graph is captured stay in memory")


def test_fsdp2_on_nccl_one_rank(store_dir, tmp_path):
    """FSDP2 gathers each block's parameters into new storages in its forward and frees them
    after: they are recognised as parameters and never offloaded."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    from torch.distributed.fsdp import fully_shard

    def shard(model):
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ref = train_cuda(CFG, micro=2, shard=shard)
        got = train_cuda(CFG, offload_config(store_dir, host="64MiB"), micro=2, shard=shard)
        plain = train_cuda(CFG, offload_config(store_dir, host="64MiB"), micro=2)
    finally:
        dist.destroy_process_group()
    assert_same(ref, got)
    assert got[2].tensors_offloaded == plain[2].tensors_offloaded > 0


class _SleepyBlock(torch.nn.Module):
    def __init__(self, cycles):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.cycles = cycles

    def forward(self, x):
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("budget", ["auto", 8 << 20])
def test_a_device_budget_is_not_hidden_by_an_earlier_peak(store_dir, budget):
    # A 2 GiB tensor made and freed before attaching: the peak counter the budget reads is
    # reset, so the steps' own peaks are seen (auto: the H100 run's out of memory at batch
    # 16; fixed: H200 run 4's budgets passed by the loss's memory).
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    del big
    high = torch.cuda.max_memory_allocated()
    ssd = offload_config(store_dir, host="64MiB", mode="adaptive", device_budget=budget)
    got = train_cuda(CFG, ssd)
    assert_same(train_cuda(CFG), got)
    assert torch.cuda.max_memory_allocated() < high and got[2].plan is not None
    if budget == "auto":  # its cache emptied too: what it reserved is not this training's overhead
        assert torch.cuda.max_memory_reserved() < high


@pytest.mark.parametrize("default", [False, True], ids=["adaptive-auto", "default-policy"])
def test_an_auto_device_budget_fits_a_batch_keep_cannot(store_dir, default):
    # A process allowed 450 MiB more than it holds (a per-process memory fraction): keep's
    # 1 GiB of activations (8 blocks of 124 MiB) do not fit; adaptive mode with device_budget
    # = "auto" (on a GPU, the default policy) offloads what does not, with keep's gradients.
    cfg = GPTConfig(n_layers=8, vocab_size=256, seq_len=256, d_model=256, n_heads=4)
    ref = train_cuda(cfg, batch=16)
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (450 << 20)) / total)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            train_cuda(cfg, batch=16)
        gc.collect()
        torch.cuda.empty_cache()
        ssd = offload_config(store_dir, host="256MiB", mode="adaptive", device_budget="auto")
        if default:
            del ssd["policy"]["mode"], ssd["policy"]["device_budget"]
        got = train_cuda(cfg, ssd, batch=16)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert_same(ref, got)
    plan = got[2].plan
    assert plan is not None and 0 <= plan.device_budget < 450 << 20 and plan.fits, plan.table()


def test_the_default_policy_follows_a_growing_batch_exactly(store_dir):
    ssd = offload_config(store_dir, host="64MiB")
    del ssd["policy"]["mode"]  # the default: adaptive with device_budget = "auto" on a GPU
    sizes = (2, 2, 2, 4, 4, 2)
    seen = []  # each step's budget, the one measured at its start, and what that room leaves a doubled batch

    def look(o):
        ad = o.adaptive
        seen.append((o._budget, ad.watch.last, ad.watch.auto.grown(2.0, ad.profile.inputs[0])))

    got = train_cuda(CFG, ssd, sizes=sizes, on_step=look)
    assert_same(train_cuda(CFG, sizes=sizes), got)
    assert got[2].plan is not None and got[2].plan.device_budget is not None
    # The first larger batch runs within what its room leaves it: cut for it at its first
    # block, or already below (a budget that held while it grew by under 5% can be).
    budget, measured, grown = seen[3]
    assert None not in seen[3] and budget == min(measured, grown), seen


def test_adaptive_times_blocks_on_the_gpu_not_the_host(store_dir):
    # A block that keeps the GPU busy for ~50 ms is launched in microseconds: host clocks
    # would time its launch.
    model = torch.nn.Sequential(*[_SleepyBlock(100_000_000 if i == 2 else 0) for i in range(4)]).cuda()
    x = torch.randn(256, 64, device="cuda")
    model(x).sum().backward()  # cuBLAS set up and kernels loaded, not timed in block 1
    with ssdtier.attach(model, offload_config(store_dir, host="64MiB", mode="adaptive")) as off:
        model(x).sum().backward()
        blocks, _ = off.adaptive.profile.blocks()
        tr = off.adaptive.transfers()
    times = [b.forward_s for b in blocks]
    assert times[2] > 0.02, times
    assert all(t < times[2] / 5 for i, t in enumerate(times) if i != 2), times
    # The arena is the plan's host tier, the link's rate measured (PCIe: GB/s, not MB/s),
    # unless cuFile takes the activations straight to NVMe.
    if off._gds is None:
        assert tr.host >= 64 << 20 and tr.out > 1e9 and tr.back > 1e9, tr
    else:
        assert tr.host == 0 and tr.out is None


@pytest.mark.parametrize(
    "acts",
    [("recompute",) * 4, ("recompute+offload",) * 4, ("offload", "recompute+offload", "recompute", "keep")],
    ids=["recompute", "recompute+offload", "mixed"],
)
def test_every_action_is_exact_on_cuda(store_dir, monkeypatch, acts):
    # Dropout's masks drawn again in the recomputation, on the GPU's generator.
    from ssdtier.plan import Action

    from .test_rok import forced

    forced(monkeypatch, tuple(Action(a) for a in acts))
    cfg = GPTConfig(n_layers=4, **TINY)
    got = train_cuda(cfg, offload_config(store_dir, host="64MiB", mode="adaptive"))
    assert_same(train_cuda(cfg), got)
    assert got[2].layers_recomputed == sum(a.startswith("recompute") for a in acts)


def test_a_block_taking_its_input_by_keyword_recomputes_dropout_exactly_on_cuda(store_dir, monkeypatch):
    # Checkpointing keeps the RNG state of the devices of positional tensors only: a block's
    # keyword tensors are passed positionally, so its dropout draws the same masks again.
    from .test_rok import RO, _KeywordNet, adaptive, forced

    forced(monkeypatch, (RO,) * 4)

    def run(ssd=None):
        torch.manual_seed(0)
        model = _KeywordNet().cuda()
        gen = torch.Generator().manual_seed(2)
        off = ssdtier.attach(model, ssd) if ssd is not None else None
        losses = []
        for _ in range(2):
            loss = model(torch.randn(2, 64, 8, generator=gen).cuda())
            loss.backward()
            losses.append(loss.detach())
        if off is not None:
            off.detach()
        return losses, {n: p.grad for n, p in model.named_parameters()}

    want, got = run(), run(adaptive(store_dir, min_tensor_bytes=1024))
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))
    assert all(torch.equal(want[1][n], got[1][n]) for n in want[1])


def test_the_arena_is_pinned_at_attach(store_dir):
    model = build_model(CFG).cuda()
    with ssdtier.attach(model, offload_config(store_dir, host="64MiB")) as off:
        assert off.cuda.registered or off.uses_cufile  # before the first forward (cuFile: no arena use)


def test_a_reused_store_keeps_its_arena_pinned_and_trains_exactly(store_dir):
    ref = train_cuda(CFG)
    ssd = offload_config(store_dir, host="64MiB")
    ssd["io"]["backend"] = "io_uring"  # the arena's path: cuFile, where it works, has none
    arenas = []
    with ssdtier.reusing_stores():
        for _ in range(2):
            got = train_cuda(CFG, ssd, on_step=lambda off: arenas.append((off.store, off.cuda.pinned)))
            assert_same(ref, got)
            assert got[2].tensors_offloaded > 0
        (store, pinned), last = arenas[0], arenas[-1]
        assert last == (store, pinned) and pinned.arena is not None  # pinned once, still
    assert store.closed and pinned.arena is None


def test_an_auto_arena_is_sized_from_the_models_gpu(store_dir, monkeypatch):
    from ssdtier import effective

    monkeypatch.setattr(effective, "GPU_ARENA_SHARE", 1 / 64)  # the plumbing, not 1/4's seconds of pinning
    model = build_model(CFG).cuda()
    cfg = offload_config(store_dir, host="auto")
    cfg["io"]["backend"] = "io_uring"  # not cuFile, which would leave the arena at 1 GiB
    with ssdtier.attach(model, cfg) as off:
        total = torch.cuda.get_device_properties(0).total_memory
        assert off.config.host.capacity <= total // 64 >> 20 << 20
        assert any(c.startswith("host.capacity = ") and "'auto' on a GPU" in c for c in off.stats().chosen)
        assert off.cuda.registered or off.uses_cufile


def test_dataloader_fork_workers_get_no_copy_of_the_pinned_arena(store_dir):
    # cudaHostRegister pins the arena: a fork would copy all of it into every worker.
    from torch.utils.data import DataLoader, TensorDataset

    ref = train_cuda(CFG, micro=1)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        model = build_model(CFG).cuda()
        batch = make_batch(CFG, 2, torch.Generator().manual_seed(2), device="cuda")
        with ssdtier.attach(model, offload_config(store_dir, host="256MiB")) as off:
            if not off.cuda.registered:
                pytest.skip("the arena is not registered (cuFile, or registration failed)")
            torch.manual_seed(1)
            loss = batch_loss(model, batch)  # copies to the arena in flight at the fork
            data = TensorDataset(torch.arange(8))
            workers = iter(DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork"))
            first = next(workers)[0].tolist()
            private = [private_bytes(w.pid) for w in workers._workers]
            rest = [x for (b,) in workers for x in b.tolist()]
            loss.backward()
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    assert first + rest == list(range(8))
    assert max(private) < 128 << 20, private
    assert torch.equal(loss.detach(), ref[0][0])
    assert all(torch.equal(p.grad, ref[1][n]) for n, p in model.named_parameters())


def test_the_arena_is_unregistered_when_an_offloader_is_collected_undetached(store_dir):
    import gc

    model = build_model(CFG).cuda()
    off = ssdtier.attach(model, offload_config(store_dir, host="64MiB"))
    batch_loss(model, make_batch(CFG, 2, torch.Generator().manual_seed(2), device="cuda")).backward()
    assert off.cuda.registered
    arena = off.store.arena  # keeps the mapping alive, so it can be registered again below
    del model, off
    gc.collect()
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), 0)) == 0  # not registered twice
    assert int(cudart.cudaHostUnregister(arena.data_ptr())) == 0


def _gds_or_skip(where):
    """cuFile's state for a file in ``where``, or a skip where it is unavailable or refuses
    one (a disk with no udev data, as in some VMs: then not the store's fault)."""
    from ssdtier.gds import probe

    where.mkdir(parents=True, exist_ok=True)
    gds = probe(where=str(where))
    if gds.state.name == "UNAVAILABLE":
        pytest.skip(f"cuFile is {gds}")
    return gds


@pytest.mark.parametrize("host", ["64KiB", "64MiB"])
def test_exact_gradients_through_cufile_on_cuda(store_dir, host):
    """GPU memory to NVMe and back with cuFile (GDS or its compatibility mode), the arena
    unused; with the writes drained before backward, every entry is read back by cuFile."""
    _gds_or_skip(store_dir)
    ref = train_cuda(CFG)
    cfg = offload_config(store_dir, host=host)
    cfg["io"]["backend"] = "cufile"
    got = train_cuda(CFG, cfg)
    assert_same(ref, got)
    s = got[2]
    assert s.tensors_offloaded > 0 and s.bytes_written_nvme > 0 and s.failed_writes == 0
    assert s.store.host_bytes_in == 0  # nothing went through the arena


def test_cufile_reads_back_what_the_backward_needs_on_cuda(store_dir):
    from .test_attach import wait_copies

    _gds_or_skip(store_dir)
    torch.use_deterministic_algorithms(True)  # as train_cuda: embedding's backward is not, else
    try:
        _cufile_reads_back(store_dir, wait_copies)
    finally:
        torch.use_deterministic_algorithms(False)


def _cufile_reads_back(store_dir, wait_copies):
    torch.manual_seed(0)
    model = build_model(CFG).cuda()
    batch = make_batch(CFG, 2, torch.Generator().manual_seed(2), device="cuda")
    ref_model = build_model(CFG).cuda()
    ref_model.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    batch_loss(ref_model, batch).backward()
    cfg = offload_config(store_dir)
    cfg["io"]["backend"] = "cufile"
    with ssdtier.attach(model, cfg) as off:
        assert off.cpu.gds is not None
        torch.manual_seed(1)
        loss = batch_loss(model, batch)
        torch.cuda.synchronize()
        wait_copies(off)  # every source let go: the backward reads all back
        loss.backward()
        st = off.stats()
    assert st.bytes_read_nvme > 0 and st.failed_reads == 0
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, (1 << 20) + 3])
def test_cufile_round_trip_of_unaligned_sizes_on_cuda(store_dir, nbytes, monkeypatch):
    """GPU bytes through cuFile over two striped files and back, sizes not whole pages: the
    last block ends mid-page on an O_DIRECT file."""
    import importlib

    from ssdtier.offload import cufile
    from ssdtier.store import ByteStore

    _gds_or_skip(store_dir)
    monkeypatch.setenv("CUFILE_LOGFILE_PATH", str(store_dir / "cufile.log"))  # if it opens here
    store = ByteStore(
        {
            "host": {"capacity": "64KiB"},
            "nvme": [{"path": str(store_dir / d), "capacity": "64MiB"} for d in ("a", "b")],
            "io": {"block_size": "4KiB"},
        }
    )
    dev = torch.device("cuda", torch.cuda.current_device())
    io = cufile.CuFile(store.native, 2, dev, importlib.import_module(cufile.MODULE))
    try:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        ready = torch.cuda.Event(blocking=True)
        ready.record()
        key = store.native.reserve_unslotted(nbytes)
        io.write(key, src.data_ptr(), nbytes, ready).wait()
        out = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        io.read(key, out.data_ptr(), nbytes, None).wait()
        assert torch.equal(out, src)
        store.discard(key)
    finally:
        io.close()
        store.close()
