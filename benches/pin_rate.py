"""How fast a host arena can be pinned: what `attach` waits for. On an H200 VM a 75.5 GiB arena
took 26 to 28 s to register with io_uring as fixed buffers (its first touch: every page
faulted in on one thread), then 3 s with cudaHostRegister. Each way maps a fresh region as the
store maps its arena (anonymous, private, MADV_DONTFORK), then pins it with cudaHostRegister
(with no CUDA: mlock):

- plain: the registration faults every page in itself;
- populate xN: MADV_POPULATE_WRITE over N threads first (pages faulted in parallel), then pins;
- huge, huge+populate xN: the same with MADV_HUGEPAGE (2 MiB pages where THP allows);
- store, store+huge (with --dir): a TieredStore opened with that arena (io_uring's fixed
  buffers fault it in: "populate" is the open), without and with ``host.huge_pages``, then pinned.

    python benches/pin_rate.py [--size 8GiB] [--threads 1,4,16] [--repeats 2] [--dir D] [--json OUT]

Ways are interleaved over repeats, each repeat starting at another; the median of each is reported, in GB/s (10^9 B/s).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import _machine

PROT_RW, MAP_PRIVATE_ANON = 0x3, 0x22
MADV_DONTFORK, MADV_HUGEPAGE, MADV_POPULATE_WRITE = 10, 14, 23

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class Pinner:
    """cudaHostRegister where CUDA is up, else mlock (the same page walk, without the driver)."""

    def __init__(self) -> None:
        import torch

        self.cudart = None
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")  # a context first, as at attach
            self.cudart = torch.cuda.cudart()
        self.name = "cudaHostRegister" if self.cudart is not None else "mlock"

    def pin(self, p: int, n: int) -> None:
        if self.cudart is None:
            _check(libc.mlock(p, n), "mlock")
            return
        from ssdtier.offload.cuda import _REGISTER_PORTABLE, _cuda_ok  # as the transport pins

        rc = self.cudart.cudaHostRegister(p, n, _REGISTER_PORTABLE)
        if not _cuda_ok(rc):
            raise RuntimeError(f"cudaHostRegister: {rc}")

    def unpin(self, p: int, n: int) -> None:
        if self.cudart is None:
            libc.munlock(p, n)
        else:
            self.cudart.cudaHostUnregister(p)


def populate(p: int, n: int, threads: int) -> None:
    """MADV_POPULATE_WRITE over ``threads`` page-aligned parts at once (ctypes lets go of the GIL)."""
    page = 1 << 21  # 2 MiB: a huge page never split between two threads
    step = -(-n // threads // page) * page
    errors: list[BaseException] = []

    def part(start: int) -> None:
        try:
            _check(libc.madvise(p + start, min(step, n - start), MADV_POPULATE_WRITE), "MADV_POPULATE_WRITE")
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=part, args=(s,)) for s in range(0, n, step)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def one(pinner: Pinner, n: int, huge: bool, threads: int) -> dict[str, float]:
    """Map, (populate,) pin, unpin, unmap: the seconds of each timed stage."""
    p = libc.mmap(None, n, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    try:
        _check(libc.madvise(p, n, MADV_DONTFORK), "MADV_DONTFORK")
        if huge:
            _check(libc.madvise(p, n, MADV_HUGEPAGE), "MADV_HUGEPAGE")
        t0 = t1 = time.perf_counter()
        if threads:
            populate(p, n, threads)
            t1 = time.perf_counter()
        pinner.pin(p, n)
        t2 = time.perf_counter()
        pinner.unpin(p, n)
        return {"populate_s": t1 - t0, "pin_s": t2 - t1, "total_s": t2 - t0}
    finally:
        libc.munmap(p, n)


def one_store(pinner: Pinner, n: int, huge: bool, directory: str) -> dict[str, float]:
    """Open a store with an ``n``-byte arena (huge pages or not), pin the arena, close it."""
    import ssdtier

    cfg = {"host": {"capacity": n, "huge_pages": huge}, "nvme": [{"path": directory, "capacity": "1GiB"}]}
    t0 = time.perf_counter()
    with ssdtier.TieredStore(cfg) as store:
        t1 = time.perf_counter()
        a = store.arena
        pinner.pin(a.data_ptr(), a.numel())
        t2 = time.perf_counter()
        pinner.unpin(a.data_ptr(), a.numel())
    return {"populate_s": t1 - t0, "pin_s": t2 - t1, "total_s": t2 - t0}


def medians(runs: dict[str, list[dict[str, float]]], n: int) -> dict[str, dict[str, float]]:
    """Each way's median seconds per stage, its rate and its speed-up over plain."""
    rows = {}
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        rows[name] = {**med, "gb_s": n / med["total_s"] / 1e9}
    base = rows["plain"]["total_s"] if "plain" in rows else float("nan")
    for r in rows.values():
        r["x_plain"] = base / r["total_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    from ssdtier.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8GiB", help="bytes pinned per try (default 8GiB)")
    cpus = os.cpu_count() or 1
    ap.add_argument("--threads", default=",".join(str(t) for t in sorted({1, max(1, cpus // 4), cpus})))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", help="also open a store with that arena here, without and with host.huge_pages")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    n = parse_size(args.size, key="--size", source="command line")
    threads = [int(t) for t in args.threads.split(",") if t]
    ways: list[tuple[bool, int | None]] = [(huge, t) for huge in (False, True) for t in (0, *threads)]
    if args.dir:
        ways += [(False, None), (True, None)]  # None: through a store
    pinner = Pinner()
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    print(f"== pin rate: {n / 2**30:.1f} GiB per try, pinned by {pinner.name}; THP: {thp} ==", flush=True)
    print(f"machine: {_machine.nproc()} CPUs, {_machine.mem_total() / 2**30:.0f} GiB RAM, {_machine.kernel()}")
    runs: dict[str, list[dict[str, float]]] = {}
    head: dict[str, Any] = {"size": n, "pinned_by": pinner.name, "thp": thp, "repeats": args.repeats}
    head.update(cpus=_machine.nproc(), kernel=_machine.kernel())
    for rep in range(args.repeats):
        # Each repeat starts at another way: what one way leaves (fragmented or whole huge
        # pages, memory the hypervisor backs already) must not always fall to the same next.
        shift = rep * len(ways) // args.repeats
        for huge, t in ways[shift:] + ways[:shift]:
            if t is None:
                name = "store+huge" if huge else "store"
                r = one_store(pinner, n, huge, args.dir)
            else:
                name = ("huge" if huge else "plain") + (f"+populate x{t}" if t else "")
                r = one(pinner, n, huge, t)
            runs.setdefault(name, []).append(r)
            print(
                f"  [{rep + 1}/{args.repeats}] {name:<24} populate {r['populate_s']:6.2f} s  "
                f"pin {r['pin_s']:6.2f} s  {n / r['total_s'] / 1e9:5.2f} GB/s",
                flush=True,
            )
            if args.json:  # after each try: a run cut short by its time limit still tells
                with open(args.json, "w") as f:
                    json.dump({**head, "rows": medians(runs, n), "runs": runs}, f, indent=1)
    rows = medians(runs, n)
    print("\n| way | populate s | pin s | GB/s | x plain |\n|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['populate_s']:.2f} | {r['pin_s']:.2f} | {r['gb_s']:.2f} | {r['x_plain']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
