"""``ssdtier bench train``'s command line: the workload's options and presets, and rounds of
every setting combined by their medians."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from typing import Any

from .._cli import CLI, positive
from ..errors import ConfigError
from ._report import emit
from .lockstep import run_lockstep
from .summary import losses_compared, ratios, render
from .train import Mode, Setting, Workload, check_hf, run

__all__ = ["PRESETS", "add_workload_arguments", "cmd_train", "combine", "repeats_of", "run_rounds", "workload_of"]


PRESETS: dict[str, dict[str, Any]] = {
    # What a run is without a preset; an option given on the command line wins over any.
    "default": {
        "layers": 8, "d_model": 256, "heads": 8, "seq": 256, "batch": 8, "vocab": 1024, "steps": 5, "warmup": 2,
        "attention": "plain", "dtype": "fp32", "dropout": 0.1, "min_tensor_bytes": "64KiB",
    },
    # Small, yet its activations (~180 MiB) are well above what a process's RSS moves by
    # itself, so that memory saved shows on a CPU (3 rounds: about 7 minutes on 2 cores).
    "quick": {"layers": 4, "d_model": 128, "heads": 4, "seq": 256, "batch": 8, "vocab": 512, "steps": 3, "warmup": 1},
    # For a GPU: wide blocks (more FLOPs per byte saved), and long sequences (SDPA: no T x T
    # scores); too slow for a CPU.
    "wide": {
        "layers": 8, "d_model": 4096, "heads": 32, "seq": 2048, "batch": 8, "vocab": 32000,
        "attention": "sdpa", "dtype": "bf16", "dropout": 0.0, "min_tensor_bytes": "1MiB",
    },
    "long": {
        "layers": 8, "d_model": 2048, "heads": 16, "seq": 16384, "batch": 1, "vocab": 32000,
        "attention": "sdpa", "dtype": "bf16", "dropout": 0.0, "min_tensor_bytes": "1MiB",
    },
}  # fmt: skip


def add_workload_arguments(p: argparse.ArgumentParser, quick_note: str) -> None:
    d = PRESETS["default"]
    p.add_argument("--hf", metavar="MODEL_TYPE", help="a transformers model type (llama, gpt2, t5...), random weights")
    p.add_argument("--layers", type=positive, help=f"blocks (default {d['layers']})")
    p.add_argument("--d-model", type=positive, help=f"model width (default {d['d_model']})")
    p.add_argument("--heads", type=positive, help=f"attention heads (default {d['heads']})")
    p.add_argument("--seq", type=positive, help=f"sequence length (default {d['seq']})")
    p.add_argument("--batch", type=positive, help=f"batch size (default {d['batch']})")
    p.add_argument("--vocab", type=positive, help=f"vocabulary size (default {d['vocab']})")
    p.add_argument("--steps", type=positive, help=f"measured steps per setting (default {d['steps']})")
    p.add_argument("--warmup", type=positive, help="steps per setting before the measured ones, at least 1: the "
                   f"first step's one-time allocations stay out of the peak (default {d['warmup']})")  # fmt: skip
    p.add_argument("--attention", choices=("plain", "sdpa"), help="the GPT's attention: plain ops (saves T x T "
                   "scores) or scaled_dot_product_attention (default plain)")  # fmt: skip
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="fp32, or the forward under bf16 autocast (default fp32)")
    p.add_argument("--dropout", type=float, help=f"dropout (default {d['dropout']})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to train")
    p.add_argument("--threads", type=positive, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--dir", help="NVMe directory (default: SSDTIER_DIR, else ~/.cache/ssdtier)")
    p.add_argument("--arena", default="auto", help="ssdtier's host arena (host.capacity); auto: 64MiB on the CPU, "
                   "the package's default on CUDA")  # fmt: skip
    p.add_argument("--min-tensor-bytes", help=f"ssdtier's policy.min_tensor_bytes (default {d['min_tensor_bytes']})")
    p.add_argument("--throttle", metavar="RATE", help="ssdtier's io.throttle (bytes/s per directory): a disk that "
                   "hides only part of the activations, as a GPU's link does")  # fmt: skip
    presets = p.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true", help=quick_note)
    presets.add_argument("--wide", action="store_true", help="8 blocks of width 4096, seq 2048, bf16, SDPA (a GPU's)")
    presets.add_argument("--long", action="store_true", help="8 blocks of width 2048, seq 16384, bf16, SDPA (a GPU's)")
    p.add_argument("--repeats", type=positive, help="rounds of every setting, interleaved; each setting's time "
                   "and peak are the medians of its rounds (default: 3 with --quick, else 1)")  # fmt: skip
    p.add_argument("--lockstep", action="store_true", help="CPU: every setting's process alive at once, each "
                   "taking one step in turn, so that a machine's drift slows them alike (needs the memory of "
                   "all at once)")  # fmt: skip
    p.add_argument("--paired", action="store_true", help="CPU: each setting's process also trains keep's twin, "
                   "a step of each in turn; its time x keep is the median of the steps' ratios")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the results as JSON, not as a table")


def workload_of(args: argparse.Namespace) -> Workload:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{CLI}: --device cuda, but torch sees no CUDA device")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    preset = next((name for name in ("quick", "wide", "long") if getattr(args, name, False)), None)
    v = {**PRESETS["default"], **PRESETS.get(preset or "", {})}
    for key in v:
        if getattr(args, key, None) is not None:
            v[key] = getattr(args, key)
    if device == "cuda" and getattr(args, "lockstep", False):
        raise ConfigError(f"{CLI}: --lockstep runs each setting in a process of its own: CPU only")
    if device == "cuda" and getattr(args, "paired", False):
        raise ConfigError(f"{CLI}: --paired trains a twin in each setting's process: CPU only")
    if v["d_model"] % v["heads"]:
        raise ConfigError(f"{CLI}: --d-model ({v['d_model']}) must be a multiple of --heads ({v['heads']})")
    if not 0 <= v["dropout"] < 1:
        raise ConfigError(f"{CLI}: --dropout must be in [0, 1), got {v['dropout']:g}")
    if args.hf is not None:
        check_hf(args.hf)  # here once, not in each setting's worker
    return Workload(
        args.hf,
        v["layers"],
        v["d_model"],
        v["heads"],
        v["seq"],
        v["batch"],
        v["vocab"],
        v["steps"],
        v["warmup"],
        device,
        args.dir,
        args.arena,
        v["min_tensor_bytes"],
        args.threads,
        sdpa=v["attention"] == "sdpa",
        dtype=v["dtype"],
        dropout=v["dropout"],
        throttle=getattr(args, "throttle", None),
        paired=getattr(args, "paired", False),
    )


TRAIN_MODES = (Mode.KEEP, Mode.SSDTIER, Mode.CHECKPOINT, Mode.SAVE_ON_CPU)


def combine(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per setting from rounds of the same settings: the median of the rounds'
    median steps and of their peaks; a failed round fails the setting, a round skipped (out
    of time) is left out. On a shared machine a setting's speed drifts between minutes:
    medians of interleaved rounds compare fairly."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for runs in zip(*rounds, strict=True):
        ran = [x for x in runs if x.get("status") == "ok"]
        bad = next((x for x in runs if x.get("status") not in ("ok", "skipped")), None)
        if bad is not None or not ran:
            out.append(dict(bad or runs[0]))
            continue
        r = dict(ran[0])
        r["round_step_s"] = [x["median_step_s"] for x in ran]
        r["round_peak_bytes"] = [x["peak_bytes"] for x in ran]
        r["median_step_s"] = statistics.median(r["round_step_s"])
        r["peak_bytes"] = int(statistics.median(r["round_peak_bytes"]))
        r["s_per_sample"] = r["median_step_s"] / r["batch"]
        r["tokens_per_s"] = r["tokens_per_s"] * ran[0]["median_step_s"] / r["median_step_s"]
        r["losses_equal_rounds"] = all(x.get("losses") == ran[0].get("losses") for x in ran)
        if all("paired_ratio" in x for x in ran):
            r["round_paired_ratio"] = [x["paired_ratio"] for x in ran]
            r["paired_ratio"] = statistics.median(r["round_paired_ratio"])
        out.append(r)
    return out


def repeats_of(args: argparse.Namespace) -> int:
    """``--repeats``, else 3 rounds for ``--quick`` (a newcomer's first numbers: one round of a
    small model drifts 1.5x between minutes) and 1 otherwise."""
    if args.repeats is not None:
        return args.repeats
    return 3 if getattr(args, "quick", False) else 1


def run_rounds(
    settings: list[Setting],
    w: Workload,
    desc: str,
    repeats: int,
    deadline: float | None = None,
    lockstep: bool = False,
) -> list[dict[str, Any]]:
    """``repeats`` interleaved rounds of every setting, combined by their medians. Every other
    round runs them in reverse: a machine that drifts within a round, or a setting that slows
    the next (its disk writes flushed after it), then favours no place in the order. Each
    round's shares of keep's peak are those of the first round's keep. ``lockstep``: each
    round's settings step in turn (lockstep.py)."""
    runner = run_lockstep if lockstep else run
    first = runner(settings, w, desc, deadline)
    rounds = [first]
    for k in range(1, repeats):
        order = settings[::-1] if k % 2 else settings
        got = runner(order, w, f"{desc} (round {k + 1} of {repeats})", deadline, first)
        rounds.append(got[::-1] if k % 2 else got)
    return combine(rounds)


def cmd_train(args: argparse.Namespace) -> int:
    """Keep, ssdtier, checkpoint and save_on_cpu on one model, side by side."""
    w = workload_of(args)
    results = run_rounds([Setting(m) for m in TRAIN_MODES], w, "bench train", repeats_of(args), None, args.lockstep)
    ratios(results, losses_compared(w))
    emit({"workload": asdict(w), "results": results}, render(results, w), args.json)
    ssd = [r for r in results if r["mode"] == Mode.SSDTIER.value]
    return 0 if all(r.get("losses_equal_keep") is not False and r["status"] == "ok" for r in ssd) else 1
