"""What a DataLoader's fork workers cost with ssdtier attached, beside the same without it.

Each run is a fresh process: a small model (for "ssdtier", attached with a host arena of
``--arena`` bytes registered as io_uring fixed buffers, which pins it as cudaHostRegister
does on a GPU), one training step, then a DataLoader with ``--workers`` fork workers. It
reports the time to the first batch and each worker's private memory (smaps_rollup: pages
the worker does not share with the parent). Medians of interleaved repeats.

    python benches/fork_cost.py [--arena 1GiB] [--workers 4] [--reps 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _machine import machine_info

MODES = ("plain", "ssdtier")


def private_bytes(pid: int) -> int:
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def run(mode: str, args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ssdtier

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(4)])
    off = None
    if mode == "ssdtier":
        off = ssdtier.attach(
            model,
            host__capacity=args.arena,
            nvme=[{"path": str(args.dir), "capacity": "4GiB"}],
            io__zero_copy=False,  # CPU tensors go through the arena, which stays registered
            io__fixed_buffers=True,
            policy__min_tensor_bytes=0,
        )
        assert off.store.fixed_buffers, "the arena could not be registered (RLIMIT_MEMLOCK?)"
    model(torch.randn(256, 512)).square().mean().backward()
    loader = DataLoader(TensorDataset(torch.randn(64, 512)), batch_size=8, num_workers=args.workers)
    t0 = time.perf_counter()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - t0
    private = [private_bytes(w.pid) for w in batches._workers]
    del batches
    if off is not None:
        off.detach()
    return {"first_batch_s": first, "worker_private_mb": statistics.median(private) / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arena", default="1GiB", help="ssdtier's host arena")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1] / "target" / "bench-fork")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(run(args.child, args)))
        return 0
    info = machine_info(args.dir)
    print(f"machine: {info['hostname']}, {info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}")
    print(f"{args.workers} fork workers; ssdtier's arena {args.arena}, pinned (io_uring fixed buffers)")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.reps):
        for m in MODES:
            cmd = [sys.executable, __file__, "--child", m, "--arena", args.arena, "--workers", str(args.workers)]
            out = subprocess.run([*cmd, "--dir", str(args.dir)], check=True, capture_output=True, text=True)
            runs[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = {k: statistics.median(r[k] for r in runs["plain"]) for k in runs["plain"][0]}
    print(f"{'mode':<8} {'first batch (s)':>16} {'ratio':>6} {'worker private (MB)':>20} {'ratio':>6}")
    for m in MODES:
        med = {k: statistics.median(r[k] for r in runs[m]) for k in base}
        print(
            f"{m:<8} {med['first_batch_s']:>16.3f} {med['first_batch_s'] / base['first_batch_s']:>6.2f} "
            f"{med['worker_private_mb']:>20.1f} {med['worker_private_mb'] / base['worker_private_mb']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
