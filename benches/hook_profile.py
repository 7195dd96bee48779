#!/usr/bin/env python3
"""Where ssdtier's per-tensor time goes, by a sampling profiler (py-spy).

The model of ``train_step.py --per-tensor-only`` (a deep stack of Linear+Tanh blocks,
every storage offloaded) trains under ``py-spy record --nonblocking``: first plain, then
with ssdtier. The steps' medians give ssdtier's time over plain; the samples taken during
ssdtier's steps split it by the ssdtier function that torch called (pack, unpack,
release, block hook, model hook) and by the innermost ssdtier function under it. What no
ssdtier frame holds (torch calling the hooks, handles freed, caches the hooks evicted)
is the rest: the difference between the measured time and the sum of the samples.

    python benches/hook_profile.py --dir /mnt/nvme/ssdtier [--arena-only]

Needs ``py-spy`` on PATH (``pip install py-spy``) and ptrace rights over a child process.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# What torch calls: the outermost ssdtier frame of a sample, by function name.
ENTRIES = {
    "Offloader._pack": "pack",
    "Offloader._unpack": "unpack",
    "Saved.__del__": "release",
    "Kept.__del__": "release",
    "BlockEnter.__call__": "block hook",
    "BlockExit.__call__": "block hook",
    "Hook.__call__": "model hook",
}
FRAME = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def child(args: argparse.Namespace) -> None:
    """Plain steps, then ssdtier's; writes the timings as JSON to ``--child``."""
    import torch
    from train_step import count_saved, tiny_stack

    import ssdtier

    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = tiny_stack(args.layers, args.width)
    x = torch.randn(args.batch, args.width)
    n_saved = count_saved(model, x)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(x).backward()
            out.append(time.perf_counter() - t0)
        return out

    def plain_steps(n: int) -> list[float]:
        return steps(n)

    def ssdtier_steps(n: int) -> list[float]:  # the profile's samples are picked by this name
        return steps(n)

    plain_steps(args.warmup)
    plain = plain_steps(args.steps)
    cfg = {
        "host": {"capacity": "256MiB"},
        "nvme": [{"path": args.dir, "capacity": "4GiB"}],
        "policy": {"min_tensor_bytes": 0, "keep_last_layers": 0},
        "io": {"zero_copy": args.mode == "zero-copy"},
    }
    with ssdtier.attach(model, cfg) as off:
        ssdtier_steps(args.warmup)
        before = off.stats()
        ssd = ssdtier_steps(args.steps)
        after = off.stats()
    Path(args.child).write_text(
        json.dumps(
            {
                "plain_s": statistics.median(plain),
                "ssdtier_s": statistics.median(ssd),
                "ssdtier_mean_s": statistics.fmean(ssd),
                "saved_per_step": n_saved,
                "offloaded_per_step": (after.tensors_offloaded - before.tensors_offloaded) / args.steps,
                "steps": args.steps,
                "torch": torch.__version__,
            }
        )
    )


def frames(stack: str) -> list[tuple[str, str]]:
    """(function, file) of each frame of a py-spy raw stack, outermost first."""
    out = []
    for f in stack.split(";"):
        m = FRAME.match(f.strip())
        if m:
            out.append((m["fn"], m["file"]))
    return out


def attribute(raw: str) -> tuple[int, collections.Counter, collections.Counter]:
    """Samples in ssdtier's steps; by entry; by (entry, innermost ssdtier function)."""
    total = 0
    by_entry: collections.Counter = collections.Counter()
    by_inner: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        fs = frames(stack)
        if not any(fn.endswith("ssdtier_steps") for fn, _ in fs):
            continue
        total += int(n)
        own = [fn for fn, file in fs if "ssdtier" in file and "hook_profile" not in file]
        if not own:
            continue
        entry = next((ENTRIES[fn] for fn in own if fn in ENTRIES), "other ssdtier")
        by_entry[entry] += int(n)
        by_inner[(entry, own[-1])] += int(n)
    return total, by_entry, by_inner


def report(t: dict[str, Any], total: int, by_entry: collections.Counter, by_inner: collections.Counter) -> str:
    per = t["ssdtier_mean_s"] / t["saved_per_step"] * 1e6  # us of a step per saved tensor
    extra = (t["ssdtier_s"] - t["plain_s"]) / t["saved_per_step"] * 1e6
    lines = [
        f"steps: plain {t['plain_s'] * 1e3:.2f} ms, ssdtier {t['ssdtier_s'] * 1e3:.2f} ms (medians of "
        f"{t['steps']}); {t['saved_per_step']} saved tensors and {t['offloaded_per_step']:.0f} offloaded "
        f"storages per step; {total} samples in ssdtier's steps",
        f"ssdtier over plain: {extra:.2f} us per saved tensor",
        "",
        "| where (the ssdtier function torch called) | us per saved tensor | share of the step |",
        "|---|---|---|",
    ]
    in_frames = 0.0
    for entry, n in by_entry.most_common():
        us = n / total * per
        in_frames += us
        lines.append(f"| {entry} | {us:.2f} | {n / total:.1%} |")
    lines.append(f"| outside any ssdtier frame (hook calls, handles freed, caches) | {extra - in_frames:.2f} | |")
    lines += ["", "| entry: innermost ssdtier function | us per saved tensor |", "|---|---|"]
    for (entry, fn), n in by_inner.most_common(25):
        lines.append(f"| {entry}: {fn} | {n / total * per:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="NVMe directory for the store (default: a temporary one)")
    p.add_argument("--mode", choices=("arena", "zero-copy", "both"), default="both")
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rate", type=int, default=2000, help="samples per second")
    p.add_argument("--out", default=None, help="also write the report here (Markdown)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # where the child writes its timings
    args = p.parse_args()
    if args.child is not None:
        child(args)
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(spy, os.X_OK):
        sys.exit("hook_profile: py-spy is not installed (pip install py-spy)")
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        store = args.dir or tmp
        for mode in ("arena", "zero-copy") if args.mode == "both" else (args.mode,):
            raw, timed = Path(tmp) / f"{mode}.txt", Path(tmp) / f"{mode}.json"
            cmd = [spy, "record", "--nonblocking", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--"]
            cmd += [sys.executable, __file__, "--child", str(timed), "--mode", mode, "--dir", store]
            cmd += ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            print(f"hook_profile: {mode} ...", file=sys.stderr, flush=True)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0 or not raw.exists() or not timed.exists():
                sys.exit(f"hook_profile: the profiled run failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
            timings = json.loads(timed.read_text())
            total, by_entry, by_inner = attribute(raw.read_text())
            if not total:
                sys.exit("hook_profile: py-spy took no samples in ssdtier's steps")
            parts.append(f"### {mode}\n\n" + report(timings, total, by_entry, by_inner))
    text = (
        f"hook_profile: {args.layers} x Linear({args.width})+Tanh, batch {args.batch}, torch "
        f"{timings['torch']} on 1 thread, py-spy at {args.rate} Hz (itself using CPU); {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}\n\n" + "\n\n".join(parts)
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
