"""``ssdtier bench rok``: the ROK curve (recompute, offload, keep), as SSDTrain draws it.

One point per setting: how much ssdtier keeps in memory is swept (``keep_last_layers``
from none to all but one block, and any ``--budget``), next to keeping everything, full
recomputation (``checkpoint``) and ``save_on_cpu``. ``rok.csv`` and ``rok.png``
(activation memory against step time) go to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ._report import emit
from .train import Mode, Setting, Workload, ratios, render, run, workload_of

__all__ = ["cmd_rok", "settings_of"]

COLUMNS = [
    "setting",
    "mode",
    "keep_last",
    "budget",
    "peak_bytes",
    "memory_vs_keep",
    "median_step_s",
    "time_vs_keep",
    "tokens_per_s",
    "losses_equal_keep",
]


def settings_of(w: Workload, budgets: list[str]) -> list[Setting]:
    n = w.layers
    keeps = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    return [
        Setting(Mode.KEEP),
        Setting(Mode.CHECKPOINT),
        Setting(Mode.SAVE_ON_CPU),
        *(Setting(Mode.SSDTIER, keep_last=k) for k in keeps),
        *(Setting(Mode.SSDTIER, budget=b) for b in budgets),
    ]


def write_csv(path: Path, results: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        out.writeheader()
        out.writerows(results)


def plot(path: Path, results: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = [r["peak_bytes"] / 2**20 for r in results]
    sweep = [(m, r) for m, r in zip(mib, results, strict=True) if r["mode"] == Mode.SSDTIER.value]
    ax.plot([m for m, _ in sweep], [r["median_step_s"] for _, r in sweep], "o-", label="ssdtier")
    for m, r in sweep:
        ax.annotate(r["setting"].removeprefix("ssdtier "), (m, r["median_step_s"]), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    for mode, marker in ((Mode.KEEP, "s"), (Mode.CHECKPOINT, "^"), (Mode.SAVE_ON_CPU, "D")):
        for m, r in zip(mib, results, strict=True):
            if r["mode"] == mode.value:
                ax.plot([m], [r["median_step_s"]], marker, markersize=9, label=mode.value)
    ax.set_xlabel("peak activation memory (MiB)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_rok(args: argparse.Namespace) -> int:
    """Sweep what ssdtier keeps; write rok.csv and rok.png."""
    w = workload_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run(settings_of(w, args.budget or []), w, "bench rok")
    ratios(results)
    write_csv(out / "rok.csv", results)
    text = render(results, w)
    files = [out / "rok.csv"]
    try:
        plot(out / "rok.png", results, text.splitlines()[0])
        files.append(out / "rok.png")
    except ImportError:
        text += "\n(no rok.png: matplotlib is not installed; pip install 'ssdtier[plot]')"
    text += "\nwrote " + ", ".join(map(str, files))
    emit({"workload": asdict(w), "results": results, "files": list(map(str, files))}, text, args.json)
    return 0
