"""The largest micro-batch a way of training fits, and the largest it fits at nearly keep's
speed (the ROK view as a user meets it: what batch can I run, at what cost).

Micro-batches 1, 2, 4... until one does not fit, then bisection; then, per time limit
(1.05 and 1.10 x keep's time per sample at keep's largest batch), the boundary is bisected
between the probes either side. A probe is one run at one batch: it does not fit when it
runs out of memory, or (``cap``) when its peak activation memory is over the cap, which is
how a CPU, where nothing runs out of memory, is searched. With listed batches (``batches``)
each mode runs those instead, ascending, the modes after keep only those past keep's largest:
a few probes that answer the targets where a search takes too long (a compiled block builds
afresh at each batch). The search functions take the probe as a function, so they are tested
with fake ones.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

from .train import OUT_OF_TIME

__all__ = [
    "Probe",
    "ProbeError",
    "fit_all",
    "largest_within",
    "probe_batches",
    "reference",
    "rok",
    "search",
    "search_batches",
    "search_rok",
    "within_mode",
]


class Probe(enum.Enum):
    """What one probe found."""

    FITS = "fits"
    FAILS = "fails"  # out of memory (or over the cap)
    SLOW = "slow"  # fits, but so slow that larger batches are not tried
    STOP = "stop"  # out of time: not run


def search_batches(fits: Callable[[int], Probe], max_batch: int) -> dict[str, Any]:
    """Largest b in 1..max_batch that ``fits(b)``: doubling from 1, then bisection. Returns
    the largest that fit (0: none), the smallest that did not (None: none failed), whether
    the search was cut by time and whether the doubling stopped at a slow batch."""
    doubling = [1]
    while doubling[-1] < max_batch:
        doubling.append(min(2 * doubling[-1], max_batch))
    out = probe_batches(fits, doubling)
    lo, hi = out["largest"], out["failed"]
    while not out["cut"] and hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        got = fits(mid)
        if got is Probe.STOP:
            return {"largest": lo, "failed": hi, "cut": True, "slow": False}
        lo, hi = (lo, mid) if got is Probe.FAILS else (mid, hi)
    return {**out, "largest": lo, "failed": hi}


def probe_batches(fits: Callable[[int], Probe], batches: Sequence[int]) -> dict[str, Any]:
    """Each of ``batches``, ascending, until one does not fit or is slow: the largest that
    fit (0: none), the first that did not (None: none), whether cut by time or stopped slow."""
    lo, hi = 0, None
    for b in sorted(set(batches)):
        got = fits(b)
        if got is Probe.STOP:
            return {"largest": lo, "failed": hi, "cut": True, "slow": False}
        if got is Probe.FAILS:
            hi = b
            break
        lo = b
        if got is Probe.SLOW:
            return {"largest": lo, "failed": hi, "cut": False, "slow": True}
    return {"largest": lo, "failed": hi, "cut": False, "slow": False}


def search_rok(probe: Callable[[int], dict[str, Any] | None], probes: list[dict[str, Any]], limit_s: float) -> bool:
    """Bisects between the largest probe at <= ``limit_s`` per sample and the next larger one
    (slower or out of memory); ``probe`` runs one more (None: out of time). False if cut."""
    within = max((p["batch"] for p in probes if p.get("fits") and p["s_per_sample"] <= limit_s), default=0)
    above = min((p["batch"] for p in probes if p["batch"] > within), default=None)
    while above is not None and above - within > 1:
        mid = (within + above) // 2
        p = probe(mid)
        if p is None:
            return False
        within, above = (mid, above) if p.get("fits") and p["s_per_sample"] <= limit_s else (within, mid)
    return True


def search(
    probe_at: Callable[[int], dict[str, Any] | None],
    max_batch: int,
    limits_s: Sequence[float] = (),
    probes: list[dict[str, Any]] | None = None,
    batches: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``search_batches`` over ``probe_at``, then ``search_rok`` at each of ``limits_s``; or,
    given ``batches``, ``probe_batches`` over them alone.

    ``probe_at(b)`` returns a probe (``batch``, ``fits``, and when it fits ``s_per_sample``
    and optionally ``slow``), or None when out of time; each is appended to ``probes``.
    Returns search_batches' answer with ``probes``."""
    probes = [] if probes is None else probes

    def run(b: int) -> dict[str, Any] | None:
        p = probe_at(b)
        if p is not None:
            probes.append(p)
        return p

    def fits(b: int) -> Probe:
        p = run(b)
        if p is None:
            return Probe.STOP
        if not p["fits"]:
            return Probe.FAILS
        return Probe.SLOW if p.get("slow") else Probe.FITS

    if batches is not None:
        return {**probe_batches(fits, batches), "probes": probes}
    out = search_batches(fits, max_batch)
    for limit in limits_s:
        if out["cut"]:
            break
        out["cut"] = not search_rok(run, probes, limit)
    out["probes"] = probes
    return out


def largest_within(probes: list[dict[str, Any]], limit_s: float) -> dict[str, Any] | None:
    """The probe of the largest batch that fit at <= ``limit_s`` per sample (None: none did)."""
    ok = [p for p in probes if p.get("fits") and p["s_per_sample"] <= limit_s]
    return max(ok, key=lambda p: p["batch"]) if ok else None


def reference(fit: dict[str, dict[str, Any]], mode: str = "keep") -> float | None:
    """Keep's time per sample at its largest batch: what the limits multiply (None: keep fit nothing)."""
    top = (fit.get(mode) or {}).get("at_largest")
    return top["s_per_sample"] if top else None


def within_mode(fit: dict[str, dict[str, Any]], mode: str) -> dict[str, int] | None:
    """Each other mode's largest batch at <= ``mode``'s time per sample at its largest batch
    (0: none; None: ``mode`` fit nothing)."""
    ref = reference(fit, mode)
    if ref is None:
        return None
    out = {}
    for m, r in fit.items():
        if m != mode and r.get("status") == "ok":
            top = largest_within(r.get("probes", []), ref)
            out[m] = top["batch"] if top else 0
    return out


def rok(fit: dict[str, dict[str, Any]], limit: float) -> float | None:
    """Adds to each mode the largest batch whose time per sample is <= ``limit`` x keep's at
    keep's largest batch (``rok_batch``, 0: none; None: not known); returns keep's time per
    sample (None if keep fit nothing)."""
    ref = reference(fit)
    for r in fit.values():
        if ref is None or r.get("status") != "ok":
            r["rok_batch"] = None
            continue
        top = largest_within(r.get("probes", []), limit * ref)
        r["rok_batch"] = top["batch"] if top else 0
        r["rok_s_per_sample"] = top["s_per_sample"] if top else None
    return ref


class ProbeError(Exception):
    """A probe failed otherwise than by running out of memory: its mode's search ends, with
    the probe's status ("error", "skipped"...)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def fit_all(
    modes: Sequence[str],
    run_at: Callable[[str, int], dict[str, Any]],
    max_batch: int,
    limits: Sequence[float] = (1.05, 1.10),
    cap: int | None = None,
    slow: float = 8.0,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_mode: Callable[[str, dict[str, Any]], None] | None = None,
    batches: Sequence[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every mode's largest batch, and its largest at <= each of ``limits`` x keep's time per
    sample. ``modes[0]`` is the reference (keep). ``run_at(mode, b)`` trains ``mode`` at batch
    ``b`` and returns a result: ``status`` ("ok", "OOM", or another with ``error``: the mode's
    search ends), ``peak_bytes``, ``median_step_s``. Past ``slow`` x keep's time per sample a
    mode tries no larger batch. Each mode gets an equal share of the time left to ``deadline``;
    ``on_mode(mode, result)`` is called as each ends. ``batches``: the modes after keep probe
    these (those past keep's largest), not search; keep is searched up to ``max_batch``."""
    fit: dict[str, dict[str, Any]] = {}
    ref: float | None = None
    listed = None if batches is None else list(batches)
    for i, mode in enumerate(modes):
        now = clock()
        if deadline is not None and now > deadline:
            r: dict[str, Any] = {"mode": mode, "status": "skipped", "error": OUT_OF_TIME, "probes": []}
        elif listed == []:
            r = {"mode": mode, "status": "skipped", "error": "no listed batch past keep's largest", "probes": []}
        else:
            # Keep, the reference, may take half the time left; the others share it evenly.
            until = None if deadline is None else now + (deadline - now) / (2 if i == 0 else len(modes) - i)
            probe = _Prober(mode, run_at, cap, None if ref is None else slow * ref, until, clock)
            r = {"mode": mode, "status": "ok", "probes": []}
            try:
                limits_s = [x * ref for x in limits] if ref is not None else []
                # Keep is searched: a list that starts past its largest still gives the reference.
                r.update(search(probe, max_batch, limits_s, r["probes"], listed if i else None))
            except ProbeError as e:
                fitted = [p["batch"] for p in r["probes"] if p.get("fits")]
                if fitted:  # the batches that ran stand; the search ends there
                    r.update(largest=max(fitted), cut=True, stopped=f"{e.status}: {e}")
                else:
                    r.update(status=e.status, error=str(e))
        best = [p for p in r["probes"] if p.get("fits") and p["batch"] == r.get("largest")]
        r["at_largest"] = best[-1] if best else None
        if i == 0:
            # A search cut short may have stopped below keep's largest, where a sample takes longer.
            ref = None if r.get("cut") else reference({mode: r}, mode)
            if listed is not None:
                listed = [b for b in listed if b > r.get("largest", 0)]
        known = ref is not None and r["status"] == "ok"
        r["within"] = {}
        for x in limits:
            top = largest_within(r["probes"], x * ref) if known and ref is not None else None
            r["within"][f"{x:g}"] = top["batch"] if top else (0 if known else None)
        fit[mode] = r
        if on_mode is not None:
            on_mode(mode, r)
    return fit


class _Prober:
    """One mode's probe: ``run_at`` at a batch, read as fits / does not / slow."""

    def __init__(
        self,
        mode: str,
        run_at: Callable[[str, int], dict[str, Any]],
        cap: int | None,
        slow_s: float | None,
        until: float | None,
        clock: Callable[[], float],
    ) -> None:
        self.mode, self.run_at, self.cap, self.slow_s, self.until, self.clock = mode, run_at, cap, slow_s, until, clock

    def __call__(self, b: int) -> dict[str, Any] | None:
        if self.until is not None and self.clock() > self.until:
            return None
        r = self.run_at(self.mode, b)
        p: dict[str, Any] = {"batch": b}
        if r["status"] == "OOM":
            p["fits"] = False
            if r.get("error"):
                p["error"] = r["error"]
            return p
        if r["status"] != "ok":
            raise ProbeError(r["status"], f"batch {b}: {r.get('error', '')}")
        p.update(peak_bytes=r["peak_bytes"], s_per_sample=r["median_step_s"] / b)
        p["fits"] = self.cap is None or r["peak_bytes"] <= self.cap
        p["slow"] = self.slow_s is not None and p["s_per_sample"] > self.slow_s
        for key in ("plan", "losses_equal_keep", "reserved_bytes", "alloc_retries", "guard_recomputed"):
            if key in r:
                p[key] = r[key]
        return p
