"""NVMe reads of a training step's spill, replayed through the store as the CUDA transport
drives it: forwards copy ``--entries`` activations into arena slots (reserve, commit); their
backwards take them back, each forward's in reverse and the forwards in order, asking for the
next ``window`` ones ahead (nearest first) before each use (acquire, release, free). The arena
holds ``--arena`` of them. ``--forwards N`` splits the step into N micro-batches whose
forwards all run before the first backward, as a pipeline schedule's (1F1B) warmup does.

At best the backward reads back once what did not fit: entries minus arena. More comes
from read-ahead evicting entries still needed, or evictions finishing after the backward
freed room; "on demand" counts entries that were not in the arena at their use (a stall
on a GPU). ``--throttle`` slows the disk so writes are still under way at the backward.
Policies: ``lifetime`` (each forward a group, as attach() makes them once it saw backwards
come earliest forward first), ``lifetime-1group`` (no groups: put order alone), ``lru``.

    python benches/spill_reads.py [--entries 64] [--forwards 1,4] [--arena 8,16,32] [--windows 1,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ssdtier.store import ByteStore

MiB = 1 << 20
POLICIES = ("lifetime", "lifetime-1group", "lru")


def step(
    dirname: str, entries: int, forwards: int, policy: str, arena: int, window: int, throttle: str | None
) -> tuple[int, int, int]:
    """One step: (entries written, entries read, entries read on demand)."""
    io = {"throttle": throttle} if throttle else {}
    evict = policy.split("-")[0]
    cfg = {
        "host": {"capacity": arena * MiB},
        "nvme": [{"path": dirname, "capacity": "4GiB"}],
        "io": io,
        "policy": {"eviction": evict},
    }
    with ByteStore(cfg) as s:
        n = s.native
        need: list[tuple[int, int]] = []  # (key, fill byte) in the order the backwards use them
        for f in range(forwards):
            if policy == "lifetime":
                n.set_group(f + 1)
            keys = []
            for i in range(f * entries // forwards, (f + 1) * entries // forwards):
                key, off = n.reserve(MiB)
                if off is None:
                    raise SystemExit(f"spill_reads: no slot for entry {i}: the arena is too small")
                s.slot(off, MiB).fill_(i % 251)
                n.commit(key)
                keys.append((key, i % 251))
            need += reversed(keys)
        on_demand = 0
        for p, (key, fill) in enumerate(need):
            for ahead, _ in need[p + 1 : p + 1 + window]:
                n.prefetch(ahead)
            on_demand += not n.location(key)[0]
            off = n.acquire(key)
            if off is None:  # no slot: read past the arena
                got = torch.empty(MiB, dtype=torch.uint8)
                n.read_staged(key, got.data_ptr(), MiB, got)
            else:
                got = s.slot(off, MiB)
            if got[0].item() != fill or got[-1].item() != fill:
                raise SystemExit(f"spill_reads: entry {p} in use order came back with other bytes")
            if off is not None:
                n.release(key)
            n.free(key)
        st = s.stats()
    return st.nvme_bytes_written // MiB, st.nvme_bytes_read // MiB, on_demand


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=64, help="activations of 1 MiB in a step")
    p.add_argument("--forwards", default="1,4", help="micro-batches whose forwards run before the first backward")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    p.add_argument("--arena", default="8,16,32", help="arena sizes, in entries")
    p.add_argument("--windows", default="1,4", help="entries read ahead")
    p.add_argument("--throttle", default="200MB", help="disk rate of the slow runs (bytes/s)")
    p.add_argument("--repeat", type=int, default=3, help="steps per cell; medians are shown")
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1] / "target" / "bench-spill")
    args = p.parse_args(argv)
    policies = args.policies.split(",")
    if unknown := set(policies) - set(POLICIES):
        p.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.entries} entries of 1 MiB a step; medians of {args.repeat} steps; least read = entries - arena")
    print("| forwards | policy | arena | window | disk | written | read | least | read / least | on demand |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for forwards in (int(x) for x in args.forwards.split(",")):
        for policy in policies if forwards > 1 else [x for x in policies if x != "lifetime-1group"]:
            for arena in (int(x) for x in args.arena.split(",")):
                for window in (int(x) for x in args.windows.split(",")):
                    for throttle in (None, args.throttle):
                        with tempfile.TemporaryDirectory(dir=args.dir) as d:
                            cell = (d, args.entries, forwards, policy, arena, window, throttle)
                            runs = [step(*cell) for _ in range(args.repeat)]
                        w, r, od = (statistics.median(x) for x in zip(*runs, strict=True))
                        least = args.entries - arena
                        row = f"{forwards} | {policy} | {arena} | {window} | {throttle or 'full'}"
                        print(f"| {row} | {w:g} | {r:g} | {least} | {r / least:.2f} | {od:g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
