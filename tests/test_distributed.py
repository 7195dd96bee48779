"""Sharded data parallelism with two processes on the CPU (gloo): FSDP2's ``fully_shard``
and the older ``FullyShardedDataParallel`` really shard here (one process does not: FSDP1
falls back to NO_SHARD), so the gathered parameters are freed after each block's forward
and gathered again in its backward. Both ranks share one NVMe directory, as ranks on one
node sharing a TOML file do. Each rank's gradient shards and losses must be the same as
the same run's without ssdtier."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .conftest import REPO
from .test_attach import CONFIGS, offload_config, train

WORLD = 2


def _run_ranks(wrapper: str, tmp_path, store_dir, world: int = WORLD, **extra: str) -> list[dict]:
    init = tmp_path / "pg"
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    path = os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, **extra}
    worker = str(REPO / "tests" / "dist_worker.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, wrapper, str(r), str(world), str(init), str(store_dir), str(outs[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r]}"
    return [torch.load(o, weights_only=False) for o in outs]


@pytest.mark.parametrize("wrapper", ["fsdp2", "fsdp1"])
def test_two_ranks_sharded(wrapper, tmp_path, store_dir):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if wrapper == "fsdp2" and not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    results = _run_ranks(wrapper, tmp_path, store_dir)
    # The unsharded model offloads this many tensors in the same two micro-batches: the
    # activations. The same count under sharding means no gathered parameter was offloaded.
    plain = train(CONFIGS["gpt"], offload_config(store_dir), micro=2)[2].tensors_offloaded
    for rank, res in enumerate(results):
        ref, got = res["ref"], res["got"]
        for a, b in zip(ref["losses"], got["losses"], strict=True):
            assert torch.equal(a, b), (rank, a, b)
        assert ref["grads"].keys() == got["grads"].keys()
        assert any(g is not None and g.numel() > 0 for g in got["grads"].values())
        for name, g in ref["grads"].items():
            if g is None:
                assert got["grads"][name] is None, (rank, name)
            else:
                assert torch.equal(g, got["grads"][name]), (rank, name)
        s = got["stats"]
        assert s["bytes_read_nvme"] > 0
        assert s["tensors_offloaded"] == plain, (rank, s)
        assert s["layers_path"].endswith("blocks"), s
    # The ranks trained on different data: the comparison above is not of one run with itself.
    assert not torch.equal(results[0]["ref"]["losses"][0], results[1]["ref"]["losses"][0])


def test_ranks_on_one_node_take_their_share_and_match_ddp(tmp_path, store_dir):
    """Four DDP ranks, as torchrun starts them (LOCAL_WORLD_SIZE=4), in one default directory:
    each takes a quarter of what one would, and its gradients are DDP's without ssdtier."""
    import torch.distributed as dist

    from ssdtier.sizes import GiB

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    results = _run_ranks("ddp", tmp_path, store_dir, 4, LOCAL_WORLD_SIZE="4", SSDTIER_DIR=str(store_dir))
    for rank, res in enumerate(results):
        ref, got = res["ref"], res["got"]
        assert all(torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"], strict=True)), rank
        assert all(torch.equal(g, got["grads"][n]) for n, g in ref["grads"].items()), rank
        s = got["stats"]
        assert s["local_ranks"] == 4 and s["bytes_read_nvme"] > 0, s
        # A quarter of the free space each (the arithmetic: test_effective.py, on a fixed disk).
        (capacity,) = s["nvme_capacity"]
        assert 0 < capacity <= 16 * GiB, capacity
        chosen = " | ".join(s["chosen"])
        assert "LOCAL_WORLD_SIZE" in chosen and "nvme[0].capacity" in chosen and "each of 4 ranks" in chosen, chosen
    # DDP averages the ranks' gradients: every rank holds the same ones.
    assert all(torch.equal(g, results[1]["got"]["grads"][n]) for n, g in results[0]["got"]["grads"].items())
