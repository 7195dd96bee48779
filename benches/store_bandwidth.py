#!/usr/bin/env python3
"""NVMe write/read bandwidth of ``ssdtier.TieredStore``, next to fio's on the same directory.

For each repeat it runs, in this order, so that both see the same disk conditions:

1. ssdtier write: ``put`` ``size/tensor`` uint8 CPU tensors (one source tensor,
   made before timing and reused), then ``flush()`` and ``evict`` every key, so
   that all bytes are on NVMe when the clock stops.
2. ssdtier read: ``get`` every key back in put order with ``--prefetch-ahead``
   prefetches in flight; each result is dropped at once.
3. fio write and fio read (``--ioengine=io_uring --direct=1``) of a file of the
   same size in the same directory, with the same block size and queue depth.

Bandwidths are MB/s (10^6 bytes per second) of tensor bytes moved; the store's
own NVMe byte counters are reported next to them. The goal line (ssdtier >= 0.9
of fio in both directions) is reporting only: the exit status is 0 unless
something failed.

Example::

    .venv/bin/python benches/store_bandwidth.py --size 2GiB --backend all --json /tmp/bw.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _machine import machine_info

from ssdtier.bench.disk import fio_flags
from ssdtier.bench.disk import run_fio as fio_job

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "target" / "bench-store"
FIO_FILE = "fio-bench.dat"
GOAL = 0.9
ALIGN = 4096


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fail(msg: str, code: int = 2) -> None:
    print(f"store_bandwidth: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def mb_s(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")


# ---------------------------------------------------------------- results


@dataclass
class Series:
    """Samples of one (engine, direction) across repeats."""

    mb_s: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    nvme_bytes: list[int] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)

    def add(self, nbytes: int, seconds: float, nvme_bytes: int, **extra: Any) -> float:
        bw = mb_s(nbytes, seconds)
        self.mb_s.append(bw)
        self.seconds.append(seconds)
        self.nvme_bytes.append(nvme_bytes)
        self.extra.append(extra)
        return bw

    def median(self) -> float | None:
        return statistics.median(self.mb_s) if self.mb_s else None

    def to_json(self) -> dict[str, Any]:
        return {
            "mb_s": self.mb_s,
            "seconds": self.seconds,
            "nvme_bytes": self.nvme_bytes,
            "median_mb_s": self.median(),
            "min_mb_s": min(self.mb_s) if self.mb_s else None,
            "max_mb_s": max(self.mb_s) if self.mb_s else None,
            "details": self.extra,
        }


# ---------------------------------------------------------------- ssdtier runs


def make_source(nbytes: int) -> Any:
    """A uint8 tensor of ``nbytes`` holding i % 251 (the first 8 bytes are overwritten per put)."""
    import torch

    pattern = torch.arange(251, dtype=torch.uint8)
    reps = -(-nbytes // 251)
    return pattern.repeat(reps)[:nbytes].clone()


def stamp(src: Any, i: int) -> None:
    """Write ``i`` into the first 8 bytes, so that each entry's content is distinct."""
    import torch

    src[:8].view(dtype=torch.int64).fill_(i)


def run_store(
    args: argparse.Namespace,
    backend: str,
    src: Any,
    count: int,
    write: Series,
    read: Series,
) -> dict[str, Any]:
    """One ssdtier write pass and one read pass on a fresh store; returns facts about the store."""
    import torch

    from ssdtier import TieredStore

    tensor = args.tensor
    total = count * tensor
    slot = -(-tensor // ALIGN) * ALIGN
    cfg = {
        "host": {"capacity": args.arena},
        "nvme": [{"path": str(args.dir), "capacity": count * slot + max(slot, 256 << 20)}],
        "io": {"backend": backend, "queue_depth": args.queue_depth, "block_size": args.block_size},
    }
    store = TieredStore(cfg)
    try:
        facts = {
            "backend": store.backend,
            "fixed_buffers": store.fixed_buffers,
            "direct": store.direct,
        }
        label = f"ssdtier({store.backend})"

        # ---- write: every byte on NVMe when the clock stops.
        before = store.stats()
        keys: list[int] = []
        t0 = time.perf_counter()
        for i in range(count):
            stamp(src, i)
            keys.append(store.put(src))
        store.flush()
        for k in keys:
            store.evict(k)
        t1 = time.perf_counter()
        after = store.stats()
        not_on_nvme = [k for k in keys if store.location(k) != (False, True)]
        if not_on_nvme:
            raise RuntimeError(
                f"{label}: {len(not_on_nvme)} of {count} entries are not (only) on NVMe after "
                f"flush() and evict(): e.g. key {not_on_nvme[0]} at {store.location(not_on_nvme[0])}"
            )
        written = after.nvme_bytes_written - before.nvme_bytes_written
        bw = write.add(
            total,
            t1 - t0,
            written,
            nvme_write_ops=after.nvme_write_ops - before.nvme_write_ops,
            staged_puts=after.staged_puts - before.staged_puts,
            evictions=after.evictions - before.evictions,
            wait_seconds=after.wait_seconds - before.wait_seconds,
        )
        log(
            f"  {label} write: {total / 2**30:.2f} GiB in {t1 - t0:.2f} s = {bw:.1f} MB/s "
            f"(nvme_bytes_written {written / 2**30:.2f} GiB)"
        )

        # ---- read: in put order, `ahead` prefetches in flight, results dropped.
        ahead = args.prefetch_ahead
        before = store.stats()
        t0 = time.perf_counter()
        for j in range(min(ahead, count)):
            store.prefetch(keys[j])
        for i in range(count):
            if ahead and i + ahead < count:
                store.prefetch(keys[i + ahead])
            store.get(keys[i])
        t1 = time.perf_counter()
        after = store.stats()
        got = after.nvme_bytes_read - before.nvme_bytes_read
        delta = {
            f: getattr(after, f) - getattr(before, f)
            for f in (
                "nvme_read_ops",
                "prefetches",
                "prefetch_skipped",
                "host_hits",
                "nvme_hits",
                "staged_gets",
                "evictions",
                "wait_seconds",
            )
        }
        bw = read.add(total, t1 - t0, got, **delta)
        log(
            f"  {label} read:  {total / 2**30:.2f} GiB in {t1 - t0:.2f} s = {bw:.1f} MB/s "
            f"(nvme_bytes_read {got / 2**30:.2f} GiB, prefetches {delta['prefetches']}, "
            f"skipped {delta['prefetch_skipped']})"
        )

        # ---- verify a sample, outside the timed regions.
        for i in sorted({0, count // 2, count - 1}):
            stamp(src, i)
            out = store.get(keys[i])
            if out.dtype != torch.uint8 or out.shape != src.shape or not torch.equal(out, src):
                bad = (out != src).nonzero()
                where = int(bad[0]) if bad.numel() else -1
                raise RuntimeError(
                    f"{label}: data read back for entry {i} (key {keys[i]}) differs from what was "
                    f"written (first difference at byte {where})"
                )
            del out
        return facts
    finally:
        store.close()


# ---------------------------------------------------------------- fio runs


def fio_version(fio: str) -> str:
    try:
        r = subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=30)
        return r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def run_fio(fio: str, args: argparse.Namespace, rw: str, total: int, fixedbufs: bool) -> dict[str, Any]:
    extra = ("--fixedbufs", "--registerfiles") if fixedbufs else ()
    return fio_job(fio, str(args.dir / FIO_FILE), rw, total, args.block_size, args.queue_depth, extra)


def fio_pass(fio: str, args: argparse.Namespace, total: int, fixedbufs: bool, write: Series, read: Series) -> None:
    tag = "fio+fixedbufs" if fixedbufs else "fio"
    try:
        for rw, series in (("write", write), ("read", read)):
            res = run_fio(fio, args, rw, total, fixedbufs)
            secs = res["runtime_ms"] / 1000
            series.mb_s.append(res["bw_bytes"] / 1e6)
            series.seconds.append(secs)
            series.nvme_bytes.append(res["io_bytes"])
            series.extra.append({"bw_bytes": res["bw_bytes"]})
            pad = " " if rw == "read" else ""
            log(
                f"  {tag} {rw}:{pad} {res['io_bytes'] / 2**30:.2f} GiB in {secs:.2f} s = "
                f"{res['bw_bytes'] / 1e6:.1f} MB/s"
            )
    finally:
        try:
            os.unlink(args.dir / FIO_FILE)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------- report


def fmt_bw(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def fmt_range(s: Series) -> str:
    if not s.mb_s:
        return "-"
    return f"{min(s.mb_s):.1f}..{max(s.mb_s):.1f}"


def render(
    report: dict[str, Any],
    store: dict[str, dict[str, Series]],
    fio: dict[str, Series] | None,
    fio_fixed: dict[str, Series] | None,
) -> str:
    m = report["machine"]
    p = report["params"]
    mnt = m["mount"]
    lines = [
        "ssdtier store bandwidth vs fio",
        f"machine:  {m['hostname']}, nproc {m['nproc']}, kernel {m['kernel']}, RAM {m['mem_total'] / 2**30:.1f} GiB",
        f"cpu:      {m['cpu']}",
        f"dir:      {p['dir']} on {mnt['device']} ({mnt['fstype']}, mounted at {mnt['mountpoint']}, {mnt['options']})",
        f"params:   size {p['size_text']} ({p['count']} x {p['tensor_text']} tensors), "
        f"arena {p['arena_text']}, block {p['block_size_text']}, queue depth {p['queue_depth']}, "
        f"prefetch ahead {p['prefetch_ahead']}, repeats {p['repeat']}",
    ]
    for name, facts in report["stores"].items():
        lines.append(
            f"ssdtier:  backend {facts['backend']} (asked: {name}), fixed buffers "
            f"{'on' if facts['fixed_buffers'] else 'off'}, O_DIRECT {'on' if facts['direct'] else 'off'}"
        )
    if report["fio"]["used"]:
        lines.append(f"fio:      {report['fio']['version']} {' '.join(report['fio']['flags'])}")
        if fio_fixed is not None:
            lines.append(f"fio+fb:   same plus {' '.join(report['fio']['fixedbufs_flags'])} (not in the ratio)")
    else:
        lines.append(f"fio:      not run ({report['fio']['why']}); ssdtier numbers only")
    lines.append("MB/s = 10^6 bytes/s of tensor bytes; median of the repeats, then min..max")
    lines.append("")

    header = ["engine", "dir", "ssdtier MB/s", "min..max", "fio MB/s", "min..max", "ratio", "goal"]
    rows = []
    for name, series in store.items():
        for d in ("write", "read"):
            s = series[d]
            f = fio[d] if fio else None
            ratio = s.median() / f.median() if f and f.median() and s.median() is not None else None
            goal = "-" if ratio is None else ("PASS" if ratio >= GOAL else "BELOW")
            rows.append(
                [
                    report["stores"][name]["backend"],
                    d,
                    fmt_bw(s.median()),
                    fmt_range(s),
                    fmt_bw(f.median()) if f else "-",
                    fmt_range(f) if f else "-",
                    "-" if ratio is None else f"{ratio:.2f}",
                    goal,
                ]
            )
    if fio_fixed is not None:
        for d in ("write", "read"):
            s = fio_fixed[d]
            f = fio[d] if fio else None
            ratio = s.median() / f.median() if f and f.median() and s.median() is not None else None
            rows.append(
                [
                    "fio+fb",
                    d,
                    fmt_bw(s.median()),
                    fmt_range(s),
                    fmt_bw(f.median()) if f else "-",
                    fmt_range(f) if f else "-",
                    "-" if ratio is None else f"{ratio:.2f}",
                    "(ref)",
                ]
            )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines.append("")

    for name, series in store.items():
        total = p["count"] * p["tensor"]
        w = series["write"].nvme_bytes
        r = series["read"].nvme_bytes
        if w:
            lines.append(
                f"{report['stores'][name]['backend']}: NVMe bytes per pass: written "
                f"{statistics.median(w) / 2**30:.2f} GiB, read {statistics.median(r) / 2**30:.2f} GiB "
                f"(tensor bytes {total / 2**30:.2f} GiB; read amplification "
                f"{statistics.median(r) / total:.2f}x)"
            )
    if fio is not None:
        verdicts = []
        for name, series in store.items():
            for d in ("write", "read"):
                sm, fm = series[d].median(), fio[d].median()
                ok = sm is not None and fm and sm / fm >= GOAL
                verdicts.append(f"{report['stores'][name]['backend']} {d} {'PASS' if ok else 'BELOW'}")
        lines.append(f"goal: >= {GOAL} of fio in both directions: " + ", ".join(verdicts))
    else:
        lines.append(f"goal: >= {GOAL} of fio in both directions: not judged (no fio numbers)")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(
            "Measure ssdtier's NVMe write and read bandwidth (TieredStore put+flush+evict, "
            "then prefetch+get) and fio's on the same directory, block size and queue depth; "
            "print both and the ratio. Sizes accept strings like 64MiB, 4GiB, 10GB."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="directory for the store's files and fio's file (not tmpfs)",
    )
    ap.add_argument("--size", default="4GiB", help="total bytes written and read per pass")
    ap.add_argument("--tensor", default="64MiB", help="size of each tensor put in the store")
    ap.add_argument(
        "--arena", default="256MiB", help="host arena of the store (small, so that bytes really go to NVMe)"
    )
    ap.add_argument("--block-size", default="1MiB", help="I/O block size (store and fio)")
    ap.add_argument("--queue-depth", type=int, default=64, help="I/O queue depth (store and fio)")
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "io_uring", "posix", "all"],
        help="store I/O engine; 'all' runs io_uring and posix",
    )
    ap.add_argument(
        "--prefetch-ahead",
        type=int,
        default=4,
        help="prefetches kept in flight while reading (0: plain gets)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="repeats; the median is reported, with min..max")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    ap.add_argument("--no-fio", action="store_true", help="do not run fio")
    ap.add_argument(
        "--fio-fixedbufs",
        action="store_true",
        help="also run fio with --fixedbufs --registerfiles (a reference row; the ratio stays against plain fio)",
    )
    ap.add_argument("--fio", default="fio", help="fio executable")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from ssdtier.errors import ConfigError
    from ssdtier.paths import is_tmpfs
    from ssdtier.sizes import format_size, parse_size

    try:
        size = parse_size(args.size, key="--size", source="command line")
        args.tensor = parse_size(args.tensor, key="--tensor", source="command line")
        args.arena = parse_size(args.arena, key="--arena", source="command line")
        args.block_size = parse_size(args.block_size, key="--block-size", source="command line")
    except ConfigError as e:
        fail(str(e))
    if args.tensor < ALIGN:
        fail(f"--tensor must be at least {ALIGN} bytes")
    if size < args.tensor:
        fail(f"--size ({format_size(size)}) is smaller than --tensor ({format_size(args.tensor)})")
    if args.block_size < ALIGN or args.block_size & (args.block_size - 1):
        fail("--block-size must be a power of two of at least 4KiB")
    if args.queue_depth < 1 or args.repeat < 1 or args.prefetch_ahead < 0:
        fail("--queue-depth and --repeat must be >= 1, --prefetch-ahead >= 0")
    count = size // args.tensor
    total = count * args.tensor
    if total != size:
        log(f"note: --size is not a multiple of --tensor; using {count} tensors = {total} bytes")

    args.dir = args.dir.expanduser().absolute()
    if is_tmpfs(args.dir):
        fail(
            f"{args.dir} is on tmpfs (RAM): it cannot measure a disk and does not support O_DIRECT; "
            "pass --dir on an SSD"
        )
    created_dir = not args.dir.exists()
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"cannot create {args.dir}: {e}")
    if (args.dir / FIO_FILE).exists():
        fail(f"{args.dir / FIO_FILE} exists already (another run in progress?); remove it first")
    free = shutil.disk_usage(args.dir).free
    need = total + total // 20 + (256 << 20)
    if free < need:
        fail(
            f"{args.dir} has {format_size(free)} free; this run needs about {format_size(need)} "
            "(one pass at a time); use a smaller --size"
        )

    fio = None
    why_no_fio = ""
    if args.no_fio:
        why_no_fio = "--no-fio"
    else:
        fio = shutil.which(args.fio)
        if fio is None:
            why_no_fio = f"'{args.fio}' is not on PATH; install fio (e.g. apt-get install fio)"
            log(f"fio: {why_no_fio}; reporting ssdtier's numbers only")

    backends = ["io_uring", "posix"] if args.backend == "all" else [args.backend]
    params = {
        "dir": str(args.dir),
        "size": total,
        "size_text": format_size(total),
        "count": count,
        "tensor": args.tensor,
        "tensor_text": format_size(args.tensor),
        "arena": args.arena,
        "arena_text": format_size(args.arena),
        "block_size": args.block_size,
        "block_size_text": format_size(args.block_size),
        "queue_depth": args.queue_depth,
        "prefetch_ahead": args.prefetch_ahead,
        "repeat": args.repeat,
        "backend": args.backend,
    }
    report: dict[str, Any] = {
        "machine": machine_info(args.dir),
        "params": params,
        "stores": {},
        "fio": {
            "used": fio is not None,
            "why": why_no_fio,
            "version": fio_version(fio) if fio else None,
            "flags": fio_flags(total, args.block_size, args.queue_depth),
            "fixedbufs_flags": ["--fixedbufs", "--registerfiles"],
        },
    }

    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), report["machine"]["nproc"])))
    src = make_source(args.tensor)
    store_series = {b: {"write": Series(), "read": Series()} for b in backends}
    fio_series = {"write": Series(), "read": Series()} if fio else None
    fio_fixed = {"write": Series(), "read": Series()} if fio and args.fio_fixedbufs else None

    status = 0
    t_start = time.perf_counter()
    try:
        for rep in range(args.repeat):
            log(f"repeat {rep + 1}/{args.repeat} ({time.perf_counter() - t_start:.0f} s elapsed)")
            for b in backends:
                s = store_series[b]
                facts = run_store(args, b, src, count, s["write"], s["read"])
                report["stores"][b] = facts
            if fio is not None and fio_series is not None:
                try:
                    fio_pass(fio, args, total, False, fio_series["write"], fio_series["read"])
                    if fio_fixed is not None:
                        fio_pass(fio, args, total, True, fio_fixed["write"], fio_fixed["read"])
                except RuntimeError as e:
                    log(f"fio failed; reporting ssdtier's numbers only:\n{e}")
                    report["fio"].update(used=False, why=f"fio failed: {str(e).splitlines()[0]}")
                    fio = None
                    fio_series = fio_fixed = None
                    status = 1
    except KeyboardInterrupt:
        log("interrupted")
        status = 130
    except Exception as e:  # report what was measured so far, then fail
        log(f"error: {type(e).__name__}: {e}")
        status = 1
    finally:
        try:
            os.unlink(args.dir / FIO_FILE)
        except FileNotFoundError:
            pass
        if created_dir:
            try:
                args.dir.rmdir()
            except OSError:
                pass

    if not report["stores"]:
        return status or 1
    text = render(report, store_series, fio_series, fio_fixed)
    print(text)
    if args.json:
        report["results"] = {
            "ssdtier": {b: {d: s.to_json() for d, s in v.items()} for b, v in store_series.items()},
            "fio": {d: s.to_json() for d, s in fio_series.items()} if fio_series else None,
            "fio_fixedbufs": {d: s.to_json() for d, s in fio_fixed.items()} if fio_fixed else None,
        }
        ratios = {}
        if fio_series:
            for b, v in store_series.items():
                for d, s in v.items():
                    sm, fm = s.median(), fio_series[d].median()
                    if sm is not None and fm:
                        ratios[f"{report['stores'][b]['backend']}.{d}"] = sm / fm
        report["ratio"] = ratios
        report["goal"] = {k: ("PASS" if r >= GOAL else "BELOW") for k, r in ratios.items()}
        report["status"] = status
        report["elapsed_s"] = time.perf_counter() - t_start
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
