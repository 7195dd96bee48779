"""Paired timing (``--paired``, CPU): each setting's process also trains keep's twin, one
step of each in turn, so that its time is a ratio to keep's taken step by step in the same
process. Between processes a small CPU model's step drifts by more than the 3% the judge
asks about; in one process, side by side, it does not (``benches/settled_cost.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .memory import CpuPeak

__all__ = ["Twin", "paired_steps"]


class Twin:
    """Keep's training of the same workload, with a random stream of its own: the setting's
    dropout masks, and so its losses, are those it draws alone."""

    def __init__(self, step: Callable[[], float], seed: int = 2) -> None:
        import torch

        self._step = step
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._rng = torch.get_rng_state()

    def step(self) -> float:
        """One step; its loss."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng)
            loss = self._step()
            self._rng = torch.get_rng_state()
        return loss


def _measured(step: Callable[[], Any]) -> tuple[Any, float, int, str]:
    """``step()``'s value, seconds and RSS peak over it, after a collection and a trim."""
    probe = CpuPeak()
    probe.start()
    t0 = time.perf_counter()
    got = step()
    took = time.perf_counter() - t0
    high, baseline = probe.stop()
    return got, took, high - baseline, probe.method


def paired_steps(
    step: Callable[[], float], twin: Twin, n: int, gate: Callable[[], Any], losses: list[float]
) -> dict[str, Any]:
    """``n`` steps of the setting, each beside one of its twin's, the twin first every other
    step; both after the same collection and trim. The setting's peak is its own steps'."""
    times, twin_times, peak, method = [], [], 0, ""
    for k in range(n):
        gate()
        if k % 2 == 0:
            twin_times.append(_measured(twin.step)[1])
        loss, took, high, method = _measured(step)
        losses.append(loss)
        times.append(took)
        peak = max(peak, high)
        if k % 2 == 1:
            twin_times.append(_measured(twin.step)[1])
    return {
        "times": times,
        "twin_step_seconds": twin_times,
        "peak": peak,
        "method": method,
        "paired_ratio": statistics.median(a / b for a, b in zip(times, twin_times, strict=True)),
    }
