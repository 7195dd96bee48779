"""``ssdtier bench rok``: the judge. The ROK curve (recompute, offload, keep: activation
memory against time per sample) of every way to save activation memory, side by side in
one run on one model:

- keep; checkpointing every block and every k-th (``--checkpoint-every``); selective
  checkpointing (``sac``: matmul and attention outputs kept, the rest recomputed);
  ``save_on_cpu``; torchtune's ``OffloadActivations`` (CUDA, where it imports);
  ``torch.compile`` per block under torch's activation memory budget (``--compile-budgets``);
- ssdtier at device budgets of ``--fractions`` x keep's measured peak (and any ``--budget``),
  its default policy otherwise; with ``--ssdtier-compile``, also on blocks compiled under
  those partitioner budgets.

``rok.csv``, ``rok.png`` and ``rok.json`` go to ``--out``. The dominance table says, at each
share of keep's memory, the fastest other mode that fits there and how ssdtier's fastest
point that fits compares (the target: within 1.03x). ``--fit`` adds the largest micro-batch
of each mode at <= 1.05x and 1.10x keep's time per sample (``ssdtier.bench.fit``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .._cli import CLI
from ..errors import ConfigError
from ..sizes import format_size, parse_size
from ._report import Progress, emit, jsonable, table
from .fit import fit_all, within_mode
from .summary import describe, losses_compared, on_compile, pace, ratios, render
from .train import Mode, Setting, Skipped, Workload, failed, in_a_line, out_of_time, resolve, run_one, skip_reason
from .train_cli import repeats_of, run_rounds, workload_of

__all__ = ["DOMINANCE_FRACTIONS", "FRACTIONS", "TARGET", "cmd_rok", "dominance", "fit_settings", "settings_of"]

# ssdtier's device budgets, x keep's peak: just under each share the dominance table asks
# about, since a budget bounds the activations held while a peak counts all memory.
FRACTIONS = (1.0, 0.75, 0.55, 0.35, 0.2)
DOMINANCE_FRACTIONS = (0.8, 0.6, 0.4, 0.25)
TARGET = 1.03  # ssdtier's time over the fastest other mode that fits as little memory
FAMILIES = tuple(m.value for m in Mode)
COMPILED = "ssdtier-compile"  # --fit-modes: ssdtier on the blocks --ssdtier-compile compiles, apart from eager's
FIT_FAMILIES = (*FAMILIES, COMPILED)

COLUMNS = [
    "setting", "mode", "status", "error", "batch", "every", "memory_budget", "keep_last", "fraction", "budget",
    "peak_bytes", "memory_vs_keep", "reserved_bytes", "median_step_s", "s_per_sample", "time_vs_keep",
    "paired_ratio", "tokens_per_s", "losses_equal_keep", "plan_keep", "plan_offload", "plan_recompute",
    "plan_recompute_offload",
]  # fmt: skip


def settings_of(
    w: Workload,
    modes: tuple[str, ...] = FAMILIES,
    fractions: tuple[float, ...] = FRACTIONS,
    budgets: tuple[str, ...] = (),
    every: tuple[int, ...] = (2, 4),
    compile_budgets: tuple[float, ...] = (0.5,),
    keep_last: tuple[int, ...] = (),
    ssdtier_compile: tuple[float, ...] = (),
) -> list[Setting]:
    """The run's settings: keep first (every ratio is to keep's, and the budgets are shares of
    its peak), then ssdtier's (what the run is for, should --budget-s cut it short), then the
    rest. ``ssdtier_compile``: also ssdtier at each fraction on blocks compiled under each of
    these activation memory budgets (and compile alone at each, to compare losses with)."""
    out = [Setting(Mode.KEEP)]
    if "ssdtier" in modes:
        out += [Setting(Mode.SSDTIER, fraction=f) for f in fractions]
        out += [Setting(Mode.SSDTIER, budget=b) for b in budgets]
        out += [Setting(Mode.SSDTIER, keep_last=k) for k in keep_last]
        out += [Setting(Mode.SSDTIER, fraction=f, memory_budget=b) for b in ssdtier_compile for f in fractions]
    if "ssdtier" in modes and ssdtier_compile:
        had = compile_budgets if "compile" in modes else ()
        compile_budgets = tuple(dict.fromkeys((*had, *ssdtier_compile)))
        modes = (*modes, "compile")
    if "checkpoint" in modes:
        out += [Setting(Mode.CHECKPOINT), *(Setting(Mode.CHECKPOINT, every=k) for k in every if 1 < k < w.layers)]
    if "sac" in modes:
        out.append(Setting(Mode.SAC))
    if "save_on_cpu" in modes:
        out.append(Setting(Mode.SAVE_ON_CPU))
    if "torchtune" in modes:
        out.append(Setting(Mode.TORCHTUNE))
    if "compile" in modes:
        out += [Setting(Mode.COMPILE, memory_budget=b) for b in compile_budgets]
    return out


def dominance(
    results: list[dict[str, Any]],
    fractions: tuple[float, ...] = DOMINANCE_FRACTIONS,
    target: float = TARGET,
    memory: str = "peak_bytes",
) -> list[dict[str, Any]]:
    """At each share of keep's peak: the fastest non-ssdtier setting whose peak fits in it, the
    fastest ssdtier setting that does, and ssdtier's time per sample over the other's.
    ``memory``: the peak compared, allocated (``peak_bytes``) or ``reserved_bytes`` (CUDA).

    ``met``: ssdtier is within ``target`` of the other (or fits where no other does); False
    where another fits and ssdtier does not; None where nothing fits."""
    ok = [r for r in results if r.get("status") == "ok" and memory in r]
    keep = next((r for r in ok if r["mode"] == Mode.KEEP.value), None)
    if keep is None:
        return []
    # Others that did not run (no time, an error) might have been faster: no "yes" without them.
    unrun = [
        r["setting"] for r in results if r["mode"] != Mode.SSDTIER.value and (r["status"] == "error" or out_of_time(r))
    ]
    in_run = any(r["mode"] == Mode.SSDTIER.value for r in results)  # --modes without it: nothing to judge
    rows = []
    for f in fractions:
        limit = f * keep[memory]
        fits = [r for r in ok if r[memory] <= limit]
        other = min((r for r in fits if r["mode"] != Mode.SSDTIER.value), key=lambda r: pace(r, keep), default=None)
        # ssdtier's rows whose losses differ from those of the run without it do not count.
        exact = [r for r in fits if r["mode"] == Mode.SSDTIER.value and r.get("losses_equal_keep") is not False]
        ours = min(exact, key=lambda r: pace(r, keep), default=None)
        row: dict[str, Any] = {"fraction": f, "limit_bytes": int(limit), "other": None, "ssdtier": None, "ratio": None}
        for key, r in (("other", other), ("ssdtier", ours)):
            if r is not None:
                row[key] = r["setting"]
                row[f"{key}_time_vs_keep"] = pace(r, keep)
                row[f"{key}_memory_vs_keep"] = r[memory] / max(keep[memory], 1)
        if other is not None and ours is not None:
            row["ratio"] = pace(ours, keep) / pace(other, keep)
            row["met"] = row["ratio"] <= target
        else:
            row["met"] = None if ours is None and other is None else ours is not None
        if row["met"] and unrun:
            row["met"], row["unrun"] = None, unrun
        if not in_run:
            row["met"], row["no_ssdtier"] = None, True
        rows.append(row)
    return rows


def render_dominance(rows: list[dict[str, Any]], target: float = TARGET, memory: str = "peak") -> str:
    if not rows:
        return "dominance: keep did not run, so there is nothing to compare with"
    head = ["memory <= x keep", "fastest other", "time x keep", "ssdtier's fastest", "time x keep", "ssdtier / other"]
    head.append(f"<= {target:g}")
    body = []
    for d in rows:
        met = {None: "-", True: "yes", False: "NO"}[d["met"]]
        body.append(
            [
                f"{d['fraction']:.2f}",
                d["other"] or "(none fits)",
                f"{d['other_time_vs_keep']:.2f}" if d["other"] else "-",
                d["ssdtier"] or ("(not in the run)" if d.get("no_ssdtier") else "(none fits)"),
                f"{d['ssdtier_time_vs_keep']:.2f}" if d["ssdtier"] else "-",
                f"{d['ratio']:.3f}" if d["ratio"] is not None else "-",
                met,
            ]
        )
    unrun = next((d["unrun"] for d in rows if d.get("unrun")), None)
    note = f"\n'-' where ssdtier led: not compared with {', '.join(unrun)}, which did not run" if unrun else ""
    title = f"dominance: at each share of keep's {memory}, the fastest setting that fits in it\n"
    return title + table(head, body) + note


def csv_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        row = dict(r)
        for k, v in (r.get("plan") or {}).items():
            row["plan_" + k.replace("+", "_")] = v
        rows.append(row)
    return rows


def write_csv(path: Path, results: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        out.writeheader()
        out.writerows(csv_rows(results))


MARKERS = {"keep": "s", "checkpoint": "^", "sac": "v", "save_on_cpu": "D", "torchtune": "P", "compile": "X",
           "ssdtier": "o", "ssdtier on compile": "*"}  # fmt: skip


def family_of(r: dict[str, Any]) -> str:
    """A result's curve in the plot: its mode, ssdtier on compiled blocks apart from eager's."""
    return "ssdtier on compile" if on_compile(r) else r["mode"]


def plot(path: Path, results: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    from matplotlib import pyplot as plt

    ok = [r for r in results if r.get("status") == "ok"]
    keep = next((r for r in ok if r["mode"] == Mode.KEEP.value), None)
    # Paired: keep's time per sample times each setting's paired ratio.
    ms = (lambda r: pace(r, keep) * keep["s_per_sample"] * 1e3) if keep else (lambda r: r["s_per_sample"] * 1e3)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, marker in MARKERS.items():
        pts = sorted(((r["peak_bytes"] / 2**20, ms(r), r) for r in ok if family_of(r) == name), key=lambda p: p[:2])
        if not pts:
            continue
        style = marker + ("-" if len(pts) > 1 else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, markersize=8, label=name)
        for x, y, r in pts:
            if len(pts) > 1:
                ax.annotate(r["setting"].removeprefix(name).strip() or "all", (x, y), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")  # fmt: skip
    if keep is not None:
        for f in DOMINANCE_FRACTIONS:
            ax.axvline(f * keep["peak_bytes"] / 2**20, color="grey", alpha=0.25, linestyle=":")
    ax.set_xlabel("peak activation memory (MiB)")
    ax.set_ylabel("time per sample (ms)")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fit_settings(
    settings: list[Setting], cap: int | None, families: tuple[str, ...] = FIT_FAMILIES
) -> dict[str, Setting]:
    """The modes ``--fit`` searches, by name: the run's of ``families`` (keep always), but
    ssdtier once (``ssdtier-compile``: once on blocks compiled at each budget of
    ``--ssdtier-compile``), at a device budget of the memory cap (none: its default, on a GPU
    what the GPU has room for)."""
    out: dict[str, Setting] = {}
    for s in settings:
        family = COMPILED if s.mode is Mode.SSDTIER and s.memory_budget is not None else s.mode.value
        if s.mode is not Mode.KEEP and family not in families:
            continue
        if s.mode is Mode.SSDTIER:
            s = Setting(Mode.SSDTIER, budget=cap, memory_budget=s.memory_budget)
        out.setdefault(s.label, s)
    return out


def run_fit(
    settings: list[Setting],
    w: Workload,
    args: argparse.Namespace,
    results: list[dict[str, Any]],
    deadline: float | None,
    on_mode: Callable[[dict[str, Any]], None] = lambda fit: None,
) -> dict[str, Any]:
    """``--fit``: each mode's probes (on the CPU each in a fresh process); ``on_mode`` gets
    the answer so far as each mode ends."""
    cap = parse_size(args.memory_cap, key="--memory-cap", source=CLI) if args.memory_cap else None
    compiled = (COMPILED,) if "ssdtier" in args.modes and args.ssdtier_compile else ()
    modes = fit_settings(settings, cap, tuple(args.fit_modes or (*args.modes, *compiled)))
    probe_w = replace(w, warmup=max(w.warmup, 1), steps=args.fit_steps, paired=False)  # ratios across batches

    def run_at(label: str, b: int) -> dict[str, Any]:
        s, wb = modes[label], replace(probe_w, batch=b)
        try:
            reason = skip_reason(s, wb)
            if reason is not None:
                raise Skipped(reason)
            s, wb = resolve(s, wb, [])
            with Progress(wb.warmup + wb.steps, f"bench rok --fit: {label} at batch {b}", unit="step") as bar:
                r = run_one(s, wb, bar.update)  # a probe on a GPU can take minutes: not silent
        except Skipped as e:
            r = failed(s, wb, "skipped", str(e))
        print(f"bench rok --fit: {label} at batch {b}: {in_a_line(r)}", file=sys.stderr, flush=True)
        return r

    # A mode that did not run beside keep (not here, or it failed) is not searched; keep, the
    # reference, always is, and one the side-by-side run had no time for is too.
    said = {
        r["setting"]: r
        for r in results
        if r["status"] != "ok" and r["mode"] not in (Mode.SSDTIER.value, Mode.KEEP.value) and not out_of_time(r)
    }
    searched = [m for m in modes if m not in said]
    out: dict[str, Any] = {"cap": cap, "limits": list(args.fit_limits), "steps": args.fit_steps, "modes": {}}
    if args.fit_batches:
        out["batches"] = sorted(set(args.fit_batches))

    def done(mode: str, r: dict[str, Any]) -> None:
        out["modes"][mode] = r
        on_mode(out)

    fit_all(searched, run_at, args.fit_max_batch, args.fit_limits, cap, args.fit_slow, deadline, on_mode=done,
            batches=out.get("batches"))  # fmt: skip
    for m, r in said.items():
        out["modes"][m] = {"mode": m, "status": r["status"], "error": f"in the side-by-side run: {r.get('error', '')}"}
    return out


def render_fit(fit: dict[str, Any]) -> str:
    modes, limits = fit["modes"], fit["limits"]
    keep = next(iter(modes.values()), {})
    ref = None if keep.get("cut") else (keep.get("at_largest") or {}).get("s_per_sample")
    bound = f"peak activation memory <= {format_size(fit['cap'])}" if fit["cap"] else "no out of memory"
    how = "1, 2, 4... then bisection"
    if fit.get("batches"):
        how = f"keep searched, then batches {', '.join(map(str, fit['batches']))} past its largest"
    lines = [
        f"fit: the largest micro-batch of each mode ({bound}): {how}, {fit['steps']} "
        f"measured step(s) a probe; keep's time per sample at its largest batch: "
        + (
            f"{ref * 1e3:.2f} ms"
            if ref
            else "none (keep's search was cut)"
            if keep.get("cut")
            else "none (keep fit no batch)"
        )
    ]
    head = ["mode", "largest batch", "ms/sample", "x keep", "peak MiB", *(f"<= {x:g}x keep" for x in limits)]
    rows = []
    for mode, r in modes.items():
        if r["status"] != "ok":
            rows.append([mode, r["status"], *["-"] * (len(head) - 2)])
            continue
        p = r.get("at_largest")
        more = " (cut)" if r.get("cut") else " (slow)" if r.get("slow") else "+" if r.get("failed") is None else ""
        within = [r["within"].get(f"{x:g}") for x in limits]
        rows.append(
            [
                mode,
                f"{r['largest']}{more}",
                f"{p['s_per_sample'] * 1e3:.2f}" if p else "-",
                f"{p['s_per_sample'] / ref:.2f}" if p and ref else "-",
                f"{p['peak_bytes'] / 2**20:.1f}" if p else "-",
                *("-" if b is None else str(b) for b in within),
            ]
        )
    lines += [table(head, rows)]
    lines += [f"{m}: {r['status']}: {r.get('error', '')}" for m, r in modes.items() if r["status"] != "ok"]
    lines += [f"{m}: stopped at {r['stopped']}" for m, r in modes.items() if r.get("stopped")]
    best = []
    for name, key in [("at any speed", None), *((f"at <= {x:g}x keep", f"{x:g}") for x in limits)]:
        got = {
            m: (r["largest"] if key is None else r["within"].get(key)) for m, r in modes.items() if r["status"] == "ok"
        }
        got = {m: b for m, b in got.items() if b}
        if got:
            top = max(got.values())
            best.append(f"{name}: {top} ({', '.join(m for m, b in got.items() if b == top)})")
    if best:
        lines.append("largest overall: " + "; ".join(best))
    at_ckpt = within_mode(modes, Mode.CHECKPOINT.value)
    if at_ckpt:
        top = modes[Mode.CHECKPOINT.value]["at_largest"]  # there: within_mode found its time
        said = ", ".join(
            f"{m} {b} ({b / top['batch']:.2f}x)" if b else f"{m} none" for m, b in at_ckpt.items() if m != "keep"
        )
        lines.append(f"at checkpoint's time per sample at its largest batch ({top['batch']}, "
                     f"{top['s_per_sample'] * 1e3:.2f} ms): {said}")  # fmt: skip
    up_to = "the last of --fit-batches" if fit.get("batches") else "--fit-max-batch"
    lines.append(f"'+': no batch failed up to {up_to}; '(cut)': out of time; '(slow)': past --fit-slow x keep")
    return "\n".join(lines)


def _write(out: Path, doc: dict[str, Any]) -> None:
    (out / "rok.json").write_text(json.dumps(doc, indent=2, default=jsonable) + "\n")


def check_rok_args(args: argparse.Namespace, w: Workload) -> None:
    """What --fit would refuse, or the run drop silently, after the side-by-side run: said before it."""
    if args.fit and w.device != "cuda" and not args.memory_cap:
        raise ConfigError(f"{CLI}: --fit on the CPU needs --memory-cap SIZE (nothing runs out of memory there)")
    for name, given in (("--memory-cap", args.memory_cap), ("--fit-modes", args.fit_modes)):
        if given is not None and not args.fit:
            raise ConfigError(f"{CLI}: {name} needs --fit")
    if args.memory_cap is not None and parse_size(args.memory_cap, key="--memory-cap", source=CLI) <= 0:
        raise ConfigError(f"{CLI}: --memory-cap must be more than 0, got {args.memory_cap}")
    if args.ssdtier_compile and "ssdtier" not in args.modes:
        raise ConfigError(f"{CLI}: --ssdtier-compile runs ssdtier on compiled blocks: --modes must include ssdtier")
    if COMPILED in (args.fit_modes or ()) and not args.ssdtier_compile:
        raise ConfigError(f"{CLI}: --fit-modes {COMPILED} needs --ssdtier-compile BUDGETS")
    unrun = [m for m in args.fit_modes or () if m not in (Mode.KEEP.value, COMPILED, *args.modes)]
    if unrun:
        raise ConfigError(f"{CLI}: --fit-modes {','.join(unrun)}: not in --modes ({','.join(args.modes)}); "
                          "only modes that run side by side are searched")  # fmt: skip


def writable_out(out: Path) -> None:
    """--out is written once every setting ran: a directory that cannot take the files is said
    before any, by creating (and removing) a file in it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{CLI}: --out: {out} is a file, not a directory")
    for name in ("rok.csv", "rok.json", "rok.png"):
        if (out / name).is_dir():
            raise ConfigError(
                f"{CLI}: --out: {out / name} is a directory; rok.csv, rok.json and rok.png are written there"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ssdtier-rok-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{CLI}: --out: cannot write in {out}: {e.strerror or e}") from None


def _plot(out: Path, results: list[dict[str, Any]], w: Workload, files: list[Path]) -> str:
    """rok.png, inserted in ``files`` once written; a note where it is not."""
    if not any(r.get("status") == "ok" for r in results):
        return "\n(no rok.png: no setting ran to the end)"
    try:
        plot(out / "rok.png", results, describe(w))
    except ImportError:
        return "\n(no rok.png: matplotlib is not installed; pip install 'ssdtier[plot]')"
    files.insert(1, out / "rok.png")
    return ""


def cmd_rok(args: argparse.Namespace) -> int:
    """Every mode side by side; write rok.csv, rok.png and rok.json; the dominance table; --fit."""
    w = workload_of(args)
    check_rok_args(args, w)
    out = Path(args.out)
    writable_out(out)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s if args.budget_s else None
    # With --fit, the side-by-side run leaves half the time to it.
    sweep_deadline = t0 + args.budget_s / 2 if args.budget_s and args.fit else deadline
    settings = settings_of(
        w, tuple(args.modes), tuple(args.fractions), tuple(args.budget or ()), tuple(args.checkpoint_every),
        tuple(args.compile_budgets), tuple(args.keep_last or ()), tuple(args.ssdtier_compile or ()),
    )  # fmt: skip
    from ..offload.shelf import reusing_stores  # torch: imported once a run starts

    # In this process (CUDA), each ssdtier setting and probe takes the last one's store: its
    # host arena is opened, registered and pinned once.
    with reusing_stores():
        results = run_rounds(settings, w, "bench rok", repeats_of(args), sweep_deadline, args.lockstep)
        if out_of_time(results[0]):  # keep, first: no setting started
            raise ConfigError(
                f"{CLI}: --budget-s {args.budget_s:g} ran out before keep, the first setting, started: nothing ran"
            )
        ratios(results, losses_compared(w))
        doc: dict[str, Any] = {"workload": asdict(w), "results": results, "dominance": dominance(results)}
        if w.device == "cuda":  # what the allocator holds decides out of memory too
            doc["dominance_reserved"] = dominance(results, memory="reserved_bytes")
        files = [out / "rok.csv", out / "rok.json"]
        write_csv(out / "rok.csv", results)
        _write(out, doc)
        text = render(results, w) + "\n\n" + render_dominance(doc["dominance"])
        if "dominance_reserved" in doc:
            text += "\n\n" + render_dominance(doc["dominance_reserved"], memory="reserved memory")
        text += _plot(out, results, w, files)
        if args.fit:
            doc["fit"] = run_fit(settings, w, args, results, deadline, lambda fit: _write(out, {**doc, "fit": fit}))
            _write(out, doc)
            text += "\n\n" + render_fit(doc["fit"])
    text += "\nwrote " + ", ".join(map(str, files))
    doc["files"] = list(map(str, files))
    emit(doc, text, args.json)
    wrong = [r for r in results if r["mode"] == Mode.SSDTIER.value and r.get("losses_equal_keep") is False]
    return 1 if wrong else 0
