"""ssdtier bench: the benchmarks an installed ssdtier can run.

- ``disk [DIR]``: the store's NVMe bandwidth against fio's on the same directory.
- ``train``: keep, ssdtier, checkpoint and save_on_cpu side by side on one model.
- ``rok``: the judge: every way to save activation memory on one model, the ROK curve
  (``rok.csv``, ``rok.png``), who is fastest at each memory level, and with ``--fit`` the
  largest micro-batch of each.

Each shows progress on stderr (tqdm's bar where it is installed), then a table, or JSON
with ``--json``. Speed is only ever compared within one run, on one machine.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._cli import Help, positive

__all__ = ["add_parser"]


def _disk(args: argparse.Namespace) -> int:
    from .disk import cmd_disk

    return cmd_disk(args)


def _train(args: argparse.Namespace) -> int:
    from .train_cli import cmd_train

    return cmd_train(args)


def _rok(args: argparse.Namespace) -> int:
    from .rok import cmd_rok

    return cmd_rok(args)


def add_parser(sub: Any) -> None:
    """Add ``bench`` and its commands to the ``ssdtier`` command's subparsers."""
    from .train_cli import add_workload_arguments

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
    add_workload_arguments(p, "a small model (4 blocks, width 128, seq 256), 3 rounds: about 2 minutes on a CPU")
    p = command("rok", _rok, "every way to save activation memory side by side: the ROK curve and who dominates")
    add_workload_arguments(p, "a small model (4 blocks, width 128, seq 256), 3 rounds: about 7 minutes on 2 CPU cores")
    _rok_arguments(p)


def _floats(text: str) -> list[float]:
    try:
        got = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not got or any(x <= 0 for x in got):
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return got


def _seconds(text: str) -> float:
    try:
        got = float(text)
    except ValueError:
        got = float("nan")
    if not got > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return got


def _ints(text: str) -> list[int]:
    got = _floats(text)
    if any(x != int(x) for x in got):
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}")
    return [int(x) for x in got]


def _modes(text: str, fit: bool = False) -> list[str]:
    from .rok import FAMILIES, FIT_FAMILIES

    known = FIT_FAMILIES if fit else FAMILIES
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(known)}"
        )
    return names


def _fit_modes(text: str) -> list[str]:
    return _modes(text, fit=True)


def _rok_arguments(p: argparse.ArgumentParser) -> None:
    from .rok import FAMILIES, FRACTIONS

    g = p.add_argument_group("modes")
    g.add_argument("--modes", type=_modes, default=list(FAMILIES),
                   help=f"comma-separated subset of {','.join(FAMILIES)} (keep always runs, first)")  # fmt: skip
    g.add_argument("--fractions", type=_floats, default=list(FRACTIONS),
                   help="ssdtier's policy.device_budget, as shares of keep's measured peak")  # fmt: skip
    g.add_argument("--budget", action="append", metavar="SIZE", help="also ssdtier at this device_budget (repeat it)")
    g.add_argument("--keep-last", type=int, action="append", metavar="N",
                   help="also ssdtier at policy.keep_last_layers = N (repeat it)")  # fmt: skip
    g.add_argument("--checkpoint-every", type=_ints, default=[2, 4],
                   help="also checkpoint every k-th block, for each k below the block count")  # fmt: skip
    g.add_argument("--compile-budgets", type=_floats, default=[0.5],
                   help="torch.compile's activation_memory_budget, one setting each")  # fmt: skip
    g.add_argument("--ssdtier-compile", type=_floats, metavar="BUDGETS",
                   help="also ssdtier at each --fractions on blocks compiled under each of these "
                   "activation_memory_budgets (compile runs at each too)")  # fmt: skip
    g.add_argument("--out", default="ssdtier-rok", help="directory for rok.csv, rok.png and rok.json")
    g.add_argument("--budget-s", type=_seconds, help="settings not started within this many seconds are skipped "
                   "(with --fit, the side-by-side run gets half)")  # fmt: skip
    g = p.add_argument_group("--fit: the largest micro-batch of each mode")
    g.add_argument("--fit", action="store_true", help="search each mode's largest micro-batch, and its largest at "
                   "<= --fit-limits x keep's time per sample")  # fmt: skip
    g.add_argument("--fit-modes", type=_fit_modes, help="the modes searched (default: --modes; ssdtier-compile: "
                   "ssdtier on the blocks --ssdtier-compile compiles, apart from eager ssdtier)")  # fmt: skip
    g.add_argument("--memory-cap", metavar="SIZE", help="a probe fits when its peak activation memory is <= SIZE "
                   "(needed on the CPU, where nothing runs out of memory)")  # fmt: skip
    g.add_argument("--fit-max-batch", type=positive, default=64, help="largest batch tried")
    g.add_argument("--fit-batches", type=_ints, metavar="B,B...", help="the modes after keep probe these batches "
                   "(those past keep's largest) instead of searching; keep is searched")  # fmt: skip
    g.add_argument("--fit-steps", type=positive, default=2, help="measured steps per probe (after --warmup's, "
                   "at least one, and more while ssdtier's plan moves)")  # fmt: skip
    g.add_argument("--fit-limits", type=_floats, default=[1.05, 1.10], help="time per sample allowed, x keep's")
    g.add_argument("--fit-slow", type=float, default=8.0, help="a mode past this x keep's time per sample tries no "
                   "larger batch")  # fmt: skip
