"""NVMe reads of a training step's spill, replayed through the store as the CUDA transport
drives it: a forward copies ``--entries`` activations into arena slots (reserve, commit);
a backward takes them in reverse, asking for the next ``window`` ones ahead (nearest first)
before each use (acquire, release, free). The arena holds ``--arena`` of them.

At best the backward reads back once what did not fit: entries minus arena. More comes
from read-ahead evicting entries still needed, or evictions finishing after the backward
freed room; "on demand" counts entries that were not in the arena at their use (a stall
on a GPU). ``--throttle`` slows the disk so writes are still under way at the backward.

    python benches/spill_reads.py [--entries 64] [--arena 8,16,32] [--windows 1,2,4,8]
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


def step(dirname: str, entries: int, arena: int, window: int, throttle: str | None) -> tuple[int, int, int]:
    """One forward and backward: (entries written, entries read, entries read on demand)."""
    io = {"throttle": throttle} if throttle else {}
    cfg = {"host": {"capacity": arena * MiB}, "nvme": [{"path": dirname, "capacity": "4GiB"}], "io": io}
    with ByteStore(cfg) as s:
        n = s.native
        keys = []
        for i in range(entries):
            key, off = n.reserve(MiB)
            if off is None:
                raise SystemExit(f"spill_reads: no slot for entry {i}: the arena is too small")
            s.slot(off, MiB).fill_(i % 251)
            n.commit(key)
            keys.append(key)
        on_demand = 0
        for i in reversed(range(entries)):
            for j in reversed(range(max(0, i - window), i)):
                n.prefetch(keys[j])
            on_demand += not n.location(keys[i])[0]
            off = n.acquire(keys[i])
            if off is None:  # no slot: read past the arena
                got = torch.empty(MiB, dtype=torch.uint8)
                n.read_staged(keys[i], got.data_ptr(), MiB, got)
            else:
                got = s.slot(off, MiB)
            if got[0].item() != i % 251 or got[-1].item() != i % 251:
                raise SystemExit(f"spill_reads: entry {i} came back with other bytes")
            if off is not None:
                n.release(keys[i])
            n.free(keys[i])
        st = s.stats()
    return st.nvme_bytes_written // MiB, st.nvme_bytes_read // MiB, on_demand


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=64, help="activations of 1 MiB in a step")
    p.add_argument("--arena", default="8,16,32", help="arena sizes, in entries")
    p.add_argument("--windows", default="1,2,4,8", help="entries read ahead")
    p.add_argument("--throttle", default="200MB", help="disk rate of the slow runs (bytes/s)")
    p.add_argument("--repeat", type=int, default=3, help="steps per cell; medians are shown")
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1] / "target" / "bench-spill")
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.entries} entries of 1 MiB; medians of {args.repeat} steps; ideal read = entries - arena")
    print("| arena | window | disk | written | read | ideal | read / ideal | on demand |")
    print("|---|---|---|---|---|---|---|---|")
    for arena in (int(x) for x in args.arena.split(",")):
        for window in (int(x) for x in args.windows.split(",")):
            for throttle in (None, args.throttle):
                with tempfile.TemporaryDirectory(dir=args.dir) as d:
                    runs = [step(d, args.entries, arena, window, throttle) for _ in range(args.repeat)]
                w, r, od = (statistics.median(x) for x in zip(*runs, strict=True))
                ideal = args.entries - arena
                disk = throttle or "full"
                print(f"| {arena} | {window} | {disk} | {w:g} | {r:g} | {ideal} | {r / ideal:.2f} | {od:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
