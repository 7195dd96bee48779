"""ssdtier bench: the benchmarks an installed ssdtier can run.

- ``disk [DIR]``: the store's NVMe bandwidth against fio's on the same directory.
- ``train``: keep, ssdtier, checkpoint and save_on_cpu side by side on one model.
- ``rok``: the recompute-offload-keep curve, as ``rok.csv`` and ``rok.png``.

Each shows progress on stderr (tqdm's bar where it is installed), then a table, or JSON
with ``--json``. Speed is only ever compared within one run, on one machine.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._cli import Help

__all__ = ["add_parser"]


def _disk(args: argparse.Namespace) -> int:
    from .disk import cmd_disk

    return cmd_disk(args)


def _train(args: argparse.Namespace) -> int:
    from .train import cmd_train

    return cmd_train(args)


def _rok(args: argparse.Namespace) -> int:
    from .rok import cmd_rok

    return cmd_rok(args)


def add_parser(sub: Any) -> None:
    """Add ``bench`` and its commands to the ``ssdtier`` command's subparsers."""
    from .train import add_workload_arguments

    bench = sub.add_parser(
        "bench", help="benchmarks: disk, train, rok", description=__doc__.split("\n\n")[0], formatter_class=Help
    )
    cmds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    def command(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=Help)
        p.set_defaults(func=func)
        return p

    p = command("disk", _disk, "the store's NVMe write and read bandwidth against fio's in one directory")
    p.add_argument("dir", nargs="?", help="the directory (default: SSDTIER_DIR, else ~/.cache/ssdtier)")
    p.add_argument("--size", default="1GiB", help="bytes written and read back")
    p.add_argument("--tensor", default="32MiB", help="bytes per tensor")
    p.add_argument("--arena", default="128MiB", help="host arena (host.capacity)")
    p.add_argument("--block-size", default="1MiB", help="I/O block size (io.block_size and fio's --bs)")
    p.add_argument("--queue-depth", type=int, default=64, help="io.queue_depth and fio's --iodepth")
    p.add_argument("--no-fio", action="store_true", help="the store only")
    p.add_argument("--json", action="store_true", help="print the results as JSON, not as a table")
    p = command("train", _train, "keep, ssdtier, checkpoint and save_on_cpu side by side on one model")
    add_workload_arguments(p, "a small model (4 blocks, width 128): about a minute on a laptop's CPU")
    p = command("rok", _rok, "the recompute-offload-keep curve: rok.csv and rok.png")
    add_workload_arguments(p, "a small model (4 blocks, width 128): about a minute on a laptop's CPU")
    p.add_argument("--budget", action="append", metavar="SIZE", help="also ssdtier at this device_budget (repeat it)")
    p.add_argument("--out", default="ssdtier-rok", help="directory for rok.csv and rok.png")
