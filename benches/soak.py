#!/usr/bin/env python3
"""Soak: many training steps of a small attached GPT; what the process holds must stay flat.

Every ``--every`` steps, after the step (forward + backward + AdamW step), the worker
samples: VmRSS and Threads from ``/proc/self/status``, open fds (``/proc/self/fd``),
the store's ``entries``, ``host_used``, ``nvme_used`` and file size, the offloader's
traffic counters (per interval) and the sizes of its own books (entries by layer, dedup
table, writes in flight, tracked storages...).

Verdict, over the samples of the last half against the first sample after ``--warmup``:
RSS at most ``(1 + --rss-tolerance)`` times it; fds, threads, entries, arena and NVMe
bytes in use, file size and the offloader's books exactly equal. Exit status 1 when not
flat.

``--zero-copy both`` (the default) runs ``io.zero_copy = true`` and ``false`` one after
the other, each in a fresh process so neither inherits the other's heap.

Example::

    .venv/bin/python benches/soak.py --steps 1000
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _machine import cpu_model, hostname, kernel, mem_total, mount_of, nproc

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "target" / "bench-soak"
# Keys that must not change at all once warm.
EXACT = ("fds", "threads", "entries", "host_used", "nvme_used", "file_size", "books")
# The offloader's containers: each is emptied or bounded per step, or it leaks.
BOOKS = (
    "_kept_st",
    "entries.by_storage",
    "entries.by_layer",
    "res.tracked",
    "cpu.writing",
    "cuda.pending",
    "cuda.h2d",
    "cuda.free_later",
    "cuda.staging",
    "ahead.reads",
    "adaptive.profile.open",
    "adaptive.profile.spans",
    "adaptive.profile.rec_spans",
)


def book_size(off: object, path: str) -> int:
    """len() of the container at a dotted path of the offloader (0 where a part is None)."""
    obj = off
    for name in path.split("."):
        obj = getattr(obj, name)  # a name that is gone is this list's error, not a 0
        if obj is None:
            return 0
    return len(obj)  # type: ignore[arg-type]


TRAFFIC = ("tensors_offloaded", "bytes_written_nvme", "bytes_read_nvme", "failed_writes", "failed_reads")


def proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                out[key] = int(value.split()[0])
    return out


def sample(step: int, off: Any, seconds: float) -> dict[str, Any]:
    # Writes of the step's last entries may still be under way: transient, not a leak.
    off.store.flush()
    off.cpu.poll()
    st = off.stats()
    status = proc_status()
    return {
        "step": step,
        "s": seconds,
        "rss": status["VmRSS"] * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": status["Threads"],
        "entries": st.store.entries,
        "host_used": st.store.host_used,
        "nvme_used": st.store.nvme_used,
        "file_size": sum(st.store.device_file_size),
        "books": sum(book_size(off, name) for name in BOOKS),
        **{k: getattr(st, k) for k in TRAFFIC},
    }


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def row(s: dict[str, Any], prev: dict[str, Any] | None) -> str:
    # Traffic per interval: totals only grow.
    d = {k: s[k] - (prev[k] if prev else 0) for k in TRAFFIC}
    return (
        f"| {s['step']:>5} | {s['s']:>6.1f} | {mb(s['rss']):>7} | {s['fds']:>3} | {s['threads']:>7} "
        f"| {s['entries']:>7} | {s['host_used']:>9} | {s['nvme_used']:>9} | {mb(s['file_size']):>9} "
        f"| {s['books']:>5} | {d['tensors_offloaded']:>9} | {mb(d['bytes_written_nvme']):>9} "
        f"| {mb(d['bytes_read_nvme']):>8} | {s['failed_writes'] + s['failed_reads']:>6} |"
    )


HEADER = (
    "|  step |      s | RSS MB  | fds | threads | entries | host_used | nvme_used | file MB   | books "
    "| offloaded | written MB | read MB | failed |\n"
    "|------:|-------:|--------:|----:|--------:|--------:|----------:|----------:|----------:|------:"
    "|----------:|----------:|---------:|-------:|"
)


def slope(samples: list[dict[str, Any]], key: str) -> float:
    """Growth of ``key`` per step, fitted over the samples: a leak of a few kB per step shows
    here long before it passes the tolerance."""
    xs, ys = [s["step"] for s in samples], [s[key] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def verdict(samples: list[dict[str, Any]], steps: int, warmup: int, tol: float) -> tuple[bool, list[str]]:
    ref = next(s for s in samples if s["step"] >= warmup)
    late = [s for s in samples if s["step"] > steps // 2]
    lines, flat = [], True
    top = max(s["rss"] for s in late)
    ok = top <= ref["rss"] * (1 + tol)
    flat &= ok
    lines.append(
        f"RSS: after warm-up (step {ref['step']}) {mb(ref['rss'])} MB, last half max {mb(top)} MB "
        f"({top / ref['rss'] - 1:+.2%}, tolerance {tol:.0%}), least-squares slope over the last half "
        f"{slope(late, 'rss') / 1e3:+.1f} kB/step: {'flat' if ok else 'GROWS'}"
    )
    for key in EXACT:
        seen = sorted({s[key] for s in late})
        ok = seen == [ref[key]]
        flat &= ok
        lines.append(f"{key}: after warm-up {ref[key]}, last half {seen}: {'flat' if ok else 'CHANGES'}")
    fails = samples[-1]["failed_writes"] + samples[-1]["failed_reads"]
    flat &= fails == 0
    lines.append(f"failed writes + reads: {fails}")
    return flat, lines


def worker(args: argparse.Namespace) -> int:
    import torch

    import ssdtier
    from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch

    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    off = ssdtier.attach(
        model,
        {
            "host": {"capacity": args.arena},
            "nvme": [{"path": str(directory), "capacity": "4GiB"}],
            "io": {"zero_copy": args.zero_copy == "on"},
            "policy": {"min_tensor_bytes": args.min_tensor_bytes, "keep_last_layers": 0, "prefetch_layers": 2},
        },
    )
    gen = torch.Generator().manual_seed(args.seed + 1)
    print(
        f"\n== io.zero_copy = {args.zero_copy == 'on'}: backend {off.store.backend}, arena {args.arena}, "
        f"min_tensor_bytes {args.min_tensor_bytes}, keep_last_layers 0 ==",
        flush=True,
    )
    print(HEADER, flush=True)
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    loss = torch.tensor(0.0)
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=False)
        # A fresh batch each step, as training does.
        loss = batch_loss(model, make_batch(cfg, args.batch, gen))
        loss.backward()
        opt.step()
        if step == 1 or step % args.every == 0:
            samples.append(sample(step, off, time.perf_counter() - t0))
            print(row(samples[-1], samples[-2] if len(samples) > 1 else None), flush=True)
    wall = time.perf_counter() - t0
    st = off.stats()
    off.detach()
    print(
        f"{args.steps} steps in {wall:.0f} s ({wall / args.steps * 1e3:.0f} ms/step); last loss {loss.item():.4f}; "
        f"offloaded {st.tensors_offloaded:,} tensors, {mb(st.bytes_offloaded)} MB; NVMe written "
        f"{mb(st.bytes_written_nvme)} MB, read {mb(st.bytes_read_nvme)} MB; peak arena use "
        f"{mb(st.store.host_peak)} MB, peak NVMe use {mb(st.store.nvme_peak)} MB"
    )
    flat, lines = verdict(samples, args.steps, args.warmup, args.rss_tolerance)
    for line in lines:
        print("  " + line)
    print(f"verdict (io.zero_copy = {args.zero_copy == 'on'}): {'FLAT' if flat else 'NOT FLAT'}", flush=True)
    return 0 if flat else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="sample every K steps")
    p.add_argument("--warmup", type=int, default=100, help="the reference sample is the first at or after this step")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--zero-copy", choices=("both", "on", "off"), default="both", help="io.zero_copy")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="NVMe directory (a real file system)")
    p.add_argument("--arena", default="4MiB", help="host arena: small, so activations go to NVMe")
    p.add_argument("--min-tensor-bytes", default="16KiB")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps < 2 * args.warmup or args.steps < 2 * args.every:
        p.error("--steps must be at least twice --warmup and --every")
    if args.zero_copy != "both":
        return worker(args)

    import torch

    mount = mount_of(args.dir if os.path.exists(args.dir) else REPO)
    print("== ssdtier soak ==")
    print(f"command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    print(
        f"machine: {hostname()}, {nproc()} CPUs ({cpu_model()}), {mem_total() / 2**30:.1f} GiB RAM, "
        f"kernel {kernel()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(f"--dir: {args.dir} on {mount['device']} ({mount['fstype']})")
    print(
        f"model: GPT vocab {args.vocab}, seq {args.seq}, d_model {args.d_model}, layers {args.layers}, "
        f"heads {args.heads}; batch {args.batch}; AdamW; {args.steps} steps, sampled every {args.every} after the step"
    )
    code = 0
    for mode in ("on", "off"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--zero-copy", mode]
        code |= subprocess.run(cmd).returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
