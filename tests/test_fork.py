"""fork() while attached (DataLoader workers, multiprocessing): the child gets no copy of the
host arena and never touches the parent's store; the parent trains on, exactly."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import traceback

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ssdtier
from ssdtier.errors import InvalidUseError
from ssdtier.offload.offloader import attached
from ssdtier.store import ByteStore

from .conftest import store_config
from .test_attach import offload_config
from .test_lifecycle import _step, _twins

# Python 3.12 warns on fork() in a process with threads (the store's I/O threads): the child
# here only runs Python and ssdtier's own at-fork handling, which is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


def _in_child(check, timeout=120.0) -> int:
    """Fork; the child runs ``check`` and leaves at once. The child's exit code (a child that
    hangs, on a lock a thread of the parent held, say, is killed and fails)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            check()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the fork child hung for {timeout:.0f} s")


def private_bytes(pid: int) -> int:
    """Memory of process ``pid`` not shared with any other (a fork child's own copies)."""
    path = f"/proc/{pid}/smaps_rollup"
    if not os.path.exists(path):
        path = f"/proc/{pid}/smaps"  # the same lines per mapping (gVisor has no rollup)
    with open(path) as f:
        return sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("Private_Clean", "Private_Dirty")))


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_a_fork_child_leaves_the_parents_entries_alone_and_may_attach_again(store_dir):
    ref, model = _twins()
    x = torch.randn(32, 64)
    want_loss, want = _step(ref, x)
    off = ssdtier.attach(model, offload_config(store_dir, host="1MiB"))
    arena = off.store.arena.data_ptr()
    assert _mapped(arena)
    model.zero_grad()
    graph = [model(x)]  # its entries in the store, some writes in flight
    assert off.stats().tensors_offloaded > 0

    def child():
        torch.set_num_threads(1)  # OpenMP's pool does not survive fork (DataLoader workers do this)
        assert _mapped(id(graph)) and not _mapped(arena), "the arena was copied into the child"
        assert attached(model) is None
        with pytest.raises(InvalidUseError, match="fork"):
            off.store.flush()
        graph.clear()  # the parent's handles go: nothing of the store is touched
        gc.collect()
        loss, grads = _step(model, x)  # plain torch: the hooks are gone
        assert torch.equal(loss, want_loss) and len(grads) == len(want) and all(map(torch.equal, grads, want))
        with ssdtier.attach(model, offload_config(store_dir, host="1MiB")) as again:
            loss, grads = _step(model, x)
            assert again.stats().tensors_offloaded > 0
        assert torch.equal(loss, want_loss) and len(grads) == len(want) and all(map(torch.equal, grads, want))

    assert _in_child(child) == 0
    graph.pop().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want, strict=True))
    assert attached(model) is off and off.stats().bytes_read_nvme > 0
    off.detach()


def test_training_with_dataloader_workers_is_exact(store_dir):
    ref, model = _twins()
    data = TensorDataset(torch.randn(96, 64))

    def epoch(m, workers):
        ctx = "fork" if workers else None
        loader = DataLoader(data, batch_size=16, num_workers=workers, multiprocessing_context=ctx)
        m.zero_grad()
        first = m(data[:16][0])
        batches = iter(loader)  # the workers fork while entries are live and writes in flight
        first.backward()
        out = [first.detach()]
        for (xb,) in batches:
            loss = m(xb)
            loss.backward()
            out.append(loss.detach())
        return out, [p.grad.clone() for p in m.parameters()]

    want = [epoch(ref, 0) for _ in range(2)]
    with ssdtier.attach(model, offload_config(store_dir, host="1MiB")) as off:
        got = [epoch(model, 2) for _ in range(2)]
        assert off.stats().bytes_read_nvme > 0
    for (wl, wg), (gl, gg) in zip(want, got, strict=True):
        assert len(wl) == len(gl) == 7 and all(map(torch.equal, wl, gl)) and all(map(torch.equal, wg, gg))


def test_a_fork_child_gets_no_copy_of_a_pinned_arena(store_dir):
    # Pinned pages (io_uring fixed buffers here, cudaHostRegister on a GPU) are copied into
    # the child at the fork unless the mapping is left out of it.
    with ByteStore(store_config(store_dir, host="256MiB", fixed_buffers=True, zero_copy=False)) as store:
        if not store.fixed_buffers:
            pytest.skip("the arena could not be registered here (RLIMIT_MEMLOCK)")

        def child():
            assert private_bytes(os.getpid()) < 64 << 20

        assert _in_child(child) == 0
