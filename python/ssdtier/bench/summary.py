"""What a bench run's results say: memory and time as ratios to keep's, and the side-by-side table."""

from __future__ import annotations

from typing import Any

from ._report import table
from .train import Mode, Workload, outcome, plan_text

__all__ = ["describe", "losses_compared", "on_compile", "pace", "ratios", "render"]


def ratios(results: list[dict[str, Any]], compare: int | None = None) -> None:
    """Adds to each result its memory and time (per sample) against keep's, and whether its
    first ``compare`` losses (None: all) equal those of the same run without ssdtier: keep's,
    or for ssdtier on compiled blocks the compile setting's at the same budget (None: not
    compared; compiled kernels round otherwise than eager ones)."""
    ok = [r for r in results if r.get("status") == "ok"]
    keep = next((r for r in ok if r["mode"] == Mode.KEEP.value), None)
    if keep is None:
        return
    compiled = {r["memory_budget"]: r for r in ok if r["mode"] == Mode.COMPILE.value}
    for r in ok:
        r["memory_vs_keep"] = r["peak_bytes"] / max(keep["peak_bytes"], 1)
        if "reserved_bytes" in r and "reserved_bytes" in keep:
            r["reserved_vs_keep"] = r["reserved_bytes"] / max(keep["reserved_bytes"], 1)
        r["time_vs_keep"] = pace(r, keep)
        if r["mode"] == Mode.COMPILE.value:
            base = None
        elif on_compile(r):
            base = compiled.get(r["memory_budget"])
        else:
            base = keep
        same = base is not None and r["batch"] == base["batch"]
        # A setting that warmed up longer (settle_plan) has more: the steps both took are compared.
        if same:
            n = min(len(r["losses"]), len(base["losses"])) if compare is None else compare
            r["losses_equal_keep"] = r["losses"][:n] == base["losses"][:n]
        else:
            r["losses_equal_keep"] = None


def pace(r: dict[str, Any], keep: dict[str, Any]) -> float:
    """A result's time per sample over keep's: with ``--paired``, against keep's twin in its
    own process, step by step (keep's own row is then the pairing's noise)."""
    if "paired_ratio" in r and "paired_ratio" in keep:
        return float(r["paired_ratio"])
    return float(r["s_per_sample"] / keep["s_per_sample"])


def on_compile(r: dict[str, Any]) -> bool:
    """Whether a result is ssdtier's on blocks compiled before attaching."""
    return r["mode"] == Mode.SSDTIER.value and r.get("memory_budget") is not None


def losses_compared(w: Workload) -> int | None:
    """How many losses must equal keep's: all, but with fused attention on a GPU only the
    first (its backward is not bitwise reproducible, so the weights differ after a step)."""
    return 1 if w.device == "cuda" and (w.sdpa or w.hf) else None


def describe(w: Workload) -> str:
    model = (
        f"{w.hf} (random weights)" if w.hf else f"GPT (ssdtier.bench.models, {'sdpa' if w.sdpa else 'plain'} attention)"
    )
    dtype = ", bf16 autocast" if w.dtype == "bf16" else ""
    threads = f" ({w.threads} thread{'s' if w.threads != 1 else ''})" if w.threads else ""
    throttle = f"; ssdtier's disk throttled to {w.throttle}/s" if w.throttle else ""
    paired = "; each paired with keep's twin" if w.paired else ""
    return (
        f"{model}: {w.layers} layers, width {w.d_model}, seq {w.seq}, batch {w.batch}, on {w.device}{threads}"
        f"{dtype}; {w.warmup} warmup + {w.steps} measured steps{throttle}{paired}"
    )


def render(results: list[dict[str, Any]], w: Workload) -> str:
    """Memory and time per sample as ratios to keep's, losses against keep's, ssdtier's plan;
    then why each setting that did not run to the end did not."""
    ok = [r for r in results if r.get("status") == "ok" and "memory_vs_keep" in r]
    reserved = bool(ok) and all("reserved_vs_keep" in r for r in ok)
    plans = any(r.get("plan") for r in ok)
    head = ["setting", "peak MiB", "x keep", *(["reserved MiB", "x keep"] if reserved else [])]
    head += ["ms/sample", "x keep", "tokens/s", "losses = keep", *(["plan keep/offload/recompute"] if plans else [])]
    rows = []
    for r in results:
        if r not in ok:
            rows.append([r["setting"], r.get("status", "?"), *["-"] * (len(head) - 2)])
            continue
        eq = r.get("losses_equal_keep")
        rows.append(
            [
                r["setting"],
                f"{r['peak_bytes'] / 2**20:.1f}",
                f"{r['memory_vs_keep']:.2f}",
                *([f"{r['reserved_bytes'] / 2**20:.1f}", f"{r['reserved_vs_keep']:.2f}"] if reserved else []),
                f"{r['s_per_sample'] * 1e3:.2f}",
                f"{r['time_vs_keep']:.2f}",
                f"{r['tokens_per_s']:.0f}",
                "-" if eq is None else "yes" if eq else "NO",
                *([plan_text(r.get("plan"))] if plans else []),
            ]
        )
    method = next((r["memory_method"] for r in results if "memory_method" in r), "not measured")
    lines = [describe(w), f"peak: activation memory of a step ({method}); ms/sample: median step / batch", ""]
    lines.append(table(head, rows))
    lines += [outcome(r) for r in results if r.get("status") != "ok"]
    for key, sign, what in (
        ("settle_steps", "+", "warmup steps more, until the plan stood for a step"),
        ("alloc_retries", "", "allocations retried in the measured steps (the GPU ran full; each a synchronization)"),
        ("guard_recomputed", "", "blocks a measured step recomputed past ssdtier's plan (its forward would have "
                                 "passed the budget)"),
    ):  # fmt: skip
        named = [f"{r['setting']} {sign}{round(r[key], 2):g}" for r in ok if r.get(key)]  # (a mean a step)
        if named:
            lines.append(f"{what}: {', '.join(named)}")
    if any(r.get("losses_equal_keep") is None for r in ok):
        lines.append("losses '-': not compared (compiled kernels round otherwise)")
    if ok and all("paired_ratio" in r for r in ok):
        lines.append("time x keep: paired, the median of each step's time over that of keep's twin, stepped in "
                     "turn in the setting's process (keep's row: the pairing's own noise)")  # fmt: skip
    if any(on_compile(r) for r in ok):
        lines.append("ssdtier on compile B: each block compiled under budget B, then attached; its losses are "
                     "compared with compile budget B's")  # fmt: skip
    n = losses_compared(w)
    if n is not None:
        lines.append(f"losses: the first {n} compared (fused attention's backward is not bitwise reproducible)")
    return "\n".join(lines)
