"""``ssdtier bench disk [DIR]``: the store's NVMe write and read bandwidth, next to fio's on
the same directory with the same block size and queue depth (io_uring, O_DIRECT)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import time
from typing import Any

from .._cli import CLI
from ..config import Config
from ..errors import ConfigError, SsdtierError
from ..mounts import existing
from ..paths import check_paths, default_nvme_dir, space_problems
from ..sizes import format_size, parse_size
from ._report import Progress, emit, table

__all__ = ["cmd_disk", "fio_flags", "run_fio"]


def _store_pass(cfg: Config, count: int, tensor: int, bar: Progress) -> dict[str, Any]:
    """Write ``count`` tensors through the store until they are on NVMe, then read them back
    (two ahead); returns bytes per second each way and whether every byte came back."""
    import torch

    from ..store import TieredStore

    src = torch.arange(tensor, dtype=torch.int64).remainder(251).to(torch.uint8)
    stamp = src[:8].view(torch.int64)  # each entry's index, so that entries differ
    with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        keys = []
        for i in range(count):
            stamp.fill_(i)
            keys.append(store.put(src))
            bar.update(1, "store write")
        store.flush()
        for k in keys:
            store.evict(k)
        write = count * tensor / (time.perf_counter() - t0)
        intact = True
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            if i + 2 < count:
                store.prefetch(keys[i + 2])
            out = store.get(k)
            stamp.fill_(i)
            intact = intact and bool(torch.equal(out, src))
            bar.update(1, "store read")
        read = count * tensor / (time.perf_counter() - t0)
        return {"write": write, "read": read, "intact": intact, "backend": store.backend, "direct": store.direct}


def fio_flags(size: int, block: int, depth: int, extra: tuple[str, ...] = ()) -> list[str]:
    """What a fio job is asked for, as the store is: io_uring, O_DIRECT, same blocks and depth."""
    return [
        "--ioengine=io_uring", "--direct=1", f"--bs={block}", f"--iodepth={depth}", f"--size={size}",
        "--numjobs=1", "--end_fsync=0", *extra,
    ]  # fmt: skip


def run_fio(
    fio: str, path: str, rw: str, size: int, block: int, depth: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One fio job of ``rw`` (write or read) over ``size`` bytes of the file ``path``: its
    bandwidth, bytes moved, runtime and command."""
    cmd = [
        fio, f"--name=ssdtier-{rw}", f"--filename={path.replace(':', chr(92) + ':')}", f"--rw={rw}",
        *fio_flags(size, block, depth, extra), "--output-format=json", "--eta=never",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SsdtierError(f"fio failed ({' '.join(cmd)}): {(r.stderr or r.stdout).strip()[-500:]}")
    try:
        job = json.loads(r.stdout[r.stdout.find("{") :])["jobs"][0]
        if job.get("error"):
            raise SsdtierError(f"fio reported error {job['error']} ({' '.join(cmd)})")
        side = job[rw]
        return {
            "bw_bytes": float(side["bw_bytes"]),
            "io_bytes": side["io_bytes"],
            "runtime_ms": side["runtime"],
            "cmd": cmd,
        }
    except (ValueError, KeyError, IndexError) as e:
        raise SsdtierError(f"cannot read fio's output ({e}): {r.stdout[:500]!r}") from e


def _check_space(cfg: Config, paths: list[str], size: str) -> None:
    """Refused before a byte is written: the store's files past the free space would fill the
    disk, and the bench would fail there."""
    if space_problems(cfg, paths):
        free = shutil.disk_usage(existing(paths[0])).free
        raise ConfigError(
            f"{CLI}: --size {size} needs {format_size(cfg.nvme[0].capacity)} in {paths[0]} (with the store's "
            f"room), and its file system has {format_size(free)} free; give a smaller --size"
        )


def cmd_disk(args: argparse.Namespace) -> int:
    """The store against fio on one directory."""
    directory = os.path.abspath(args.dir or default_nvme_dir())
    size = parse_size(args.size, key="--size", source=CLI)
    tensor = parse_size(args.tensor, key="--tensor", source=CLI)
    block = parse_size(args.block_size, key="--block-size", source=CLI)
    if tensor < 8:  # each tensor carries its index in its first 8 bytes
        raise ConfigError(f"{CLI}: --tensor must be at least 8 bytes, got {args.tensor}")
    if size < tensor:
        raise ConfigError(f"{CLI}: --size ({args.size}) must hold at least one --tensor ({args.tensor})")
    count = size // tensor
    slot = -(-tensor // 4096) * 4096
    cfg = Config.from_dict(
        {
            "host": {"capacity": args.arena},
            "nvme": [{"path": directory, "capacity": count * slot + (256 << 20)}],
            "io": {"block_size": block, "queue_depth": args.queue_depth},
        },
        source=CLI,
    )
    _check_space(cfg, check_paths(cfg), args.size)
    fio = None if args.no_fio else shutil.which("fio")
    steps = 2 * count + (2 if fio else 0)
    with Progress(steps, "bench disk", unit="op") as bar:
        got = _store_pass(cfg, count, tensor, bar)
        theirs: dict[str, float] = {}
        if fio:
            os.makedirs(directory, exist_ok=True)
            try:
                for rw in ("write", "read"):
                    path = os.path.join(directory, ".ssdtier-bench-fio.dat")
                    theirs[rw] = run_fio(fio, path, rw, count * tensor, block, args.queue_depth)["bw_bytes"]
                    bar.update(1, f"fio {rw}")
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, ".ssdtier-bench-fio.dat"))
    rows = []
    for rw in ("write", "read"):
        other = theirs.get(rw)
        vs = [f"{other / 1e6:.0f}", f"{got[rw] / other:.2f}"] if other else ["-", "-"]
        rows.append([rw, f"{got[rw] / 1e6:.0f}", *vs])
    why = "" if fio else ("(--no-fio)" if args.no_fio else "(fio is not installed)")
    text = "\n".join(
        [
            f"{directory}: {format_size(count * tensor)} in {count} tensors of {format_size(tensor)}, "
            f"{got['backend']}, O_DIRECT {'on' if got['direct'] else 'off'}, blocks of {format_size(block)}, "
            f"queue depth {args.queue_depth}; fio: {'io_uring, O_DIRECT, same blocks and depth' if fio else why}",
            "",
            table(["direction", "ssdtier MB/s", "fio MB/s", "ssdtier / fio"], rows),
            "",
            f"data intact: {'yes' if got['intact'] else 'NO'}",
        ]
    )
    result = {"dir": directory, "bytes": count * tensor, "store": got, "fio": theirs or None}
    emit(result, text, args.json)
    return 0 if got["intact"] else 1
