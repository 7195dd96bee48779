"""What disk I/O costs the compute on this machine, whoever does it.

A fixed matmul loop (torch, ``--threads`` threads) is timed alone, then while
``fio`` moves ``RATE`` bytes per second each way (O_DIRECT, io_uring, 1 MiB
blocks) in ``--dir``. On a bare-metal machine with an NVMe SSD the ratio is
close to 1; on a VM whose virtual disk is emulated on the host's share of the
vCPUs it is not, and no offloading scheme can hide that part. ``/proc/stat``
shows where the CPU went meanwhile (steal = taken by the hypervisor).

    python benches/io_contention.py [--rates 100M,300M,500M] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _machine import machine_info

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1 : 1 + len(FIELDS)]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100M,300M,500M", help="fio rates per direction, comma-separated")
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1] / "target" / "bench-train")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", type=int, default=1024, help="matmul size")
    p.add_argument("--reps", type=int, default=60, help="matmuls per timing")
    args = p.parse_args(argv)
    fio = shutil.which("fio")
    if fio is None:
        print("io_contention: needs fio on PATH (apt install fio)", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    a = torch.randn(args.size, args.size)
    b = torch.randn(args.size, args.size)

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(args.reps):
            a @ b
        return time.perf_counter() - t0

    timed()
    info = machine_info(args.dir)
    print(f"machine: {info['hostname']}, {info['nproc']} CPUs ({info['cpu']}), kernel {info['kernel']}")
    print(f"dir: {args.dir} on {info['mount'].get('device')} ({info['mount'].get('fstype')})")
    print(f"compute: {args.reps} x ({args.size}x{args.size} @ {args.size}x{args.size}) fp32, {args.threads} threads")
    print("| fio rate each way | alone (s) | under fio (s) | ratio | CPU ticks during the timing: " + ", ".join(FIELDS))
    path = args.dir / "io-contention.tmp"
    for rate in args.rates.split(","):
        base = min(timed() for _ in range(3))
        cmd = [
            fio, "--name=contention", f"--filename={path}", "--size=1G", "--rw=rw", "--rwmixread=50", "--bs=1M",
            "--direct=1", "--ioengine=io_uring", "--iodepth=16", f"--rate={rate},{rate}", "--time_based",
            "--runtime=3600", "--output=/dev/null",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(3)  # file laid out, rate reached
            t0 = cpu_ticks()
            under = min(timed() for _ in range(3))
            t1 = cpu_ticks()
        finally:
            proc.terminate()
            proc.wait()
        ticks = ", ".join(f"{n} {y - x}" for n, x, y in zip(FIELDS, t0, t1, strict=True))
        print(f"| {rate} | {base:.3f} | {under:.3f} | {under / base:.3f} | {ticks}")
    path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
