"""One rank of a sharded data-parallel run, started by tests/test_distributed.py (its
`run` is also called in-process by the one-process FSDP2 test in tests/test_attach.py).

    python tests/dist_worker.py WRAPPER RANK WORLD INIT_FILE STORE_DIR OUT

Runs the same two micro-batches twice in one process group, without ssdtier and with
it (every activation through NVMe, in a directory that all ranks share), and saves
both runs' losses, this rank's gradient shards and the offloader's counts to OUT.
WRAPPER is ``fsdp2`` (``fully_shard``), ``fsdp1`` (``FullyShardedDataParallel``) or ``ddp``
(``DistributedDataParallel``, in the default directory that LOCAL_WORLD_SIZE ranks share).
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

import ssdtier
from ssdtier.bench.models import GPTBlock, GPTConfig, batch_loss, build_model, make_batch

CFG = GPTConfig(n_layers=3, vocab_size=64, seq_len=16, d_model=32, n_heads=4)


def shard(wrapper: str, model: torch.nn.Module) -> torch.nn.Module:
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP1's deprecation notice
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({GPTBlock}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.device("cpu"),
            use_orig_params=False,
        )


def local(g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return None
    to_local = getattr(g, "to_local", None)  # a DTensor shard under FSDP2
    return (to_local() if to_local else g).detach().clone()


def run(wrapper: str, rank: int, ssd: dict | None) -> dict:
    torch.manual_seed(0)
    model = shard(wrapper, build_model(CFG))
    gen = torch.Generator().manual_seed(2 + rank)  # each rank trains on its own data
    batches = [make_batch(CFG, 2, gen) for _ in range(2)]
    off = ssdtier.attach(model, ssd) if ssd is not None else None
    torch.manual_seed(1 + rank)  # and its own dropout masks
    losses = []
    for b in batches:
        loss = batch_loss(model, b)
        loss.backward()
        losses.append(loss.detach())
    out = {
        "losses": losses,
        "grads": {n: local(p.grad) for n, p in model.named_parameters()},
    }
    if off is not None:
        s = off.stats()
        out["stats"] = {
            "tensors_offloaded": s.tensors_offloaded,
            "bytes_read_nvme": s.bytes_read_nvme,
            "layers_path": off.layers_path,
            "local_ranks": off.config.io.local_ranks,
            "nvme_capacity": [n.capacity for n in off.config.nvme],
            "chosen": list(s.chosen),
        }
        off.detach()
    return out


def main() -> None:
    wrapper, rank, world, init_file, store_dir, out = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ssd = {
            "host": {"capacity": "64KiB"},  # a tiny arena: everything goes to NVMe
            "nvme": [{"path": store_dir, "capacity": "1GiB"}],
            "io": {"block_size": "256KiB", "queue_depth": 16},
            "policy": {"min_tensor_bytes": 0, "keep_last_layers": 0},
        }
        if wrapper == "ddp":  # the default directory ($SSDTIER_DIR), shared as LOCAL_WORLD_SIZE says
            del ssd["nvme"]
        ref = run(wrapper, rank, None)
        got = run(wrapper, rank, ssd)
        torch.save({"ref": ref, "got": got}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
