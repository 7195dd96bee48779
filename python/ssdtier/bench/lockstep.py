"""Settings in lockstep (``--lockstep``, CPU): every setting's process alive at once, each
taking one step in turn, the order reversed every other step. A machine whose speed drifts
between minutes then slows every setting alike, where one after another it would favour
some. Each process still measures its own peak; together they need the memory of all."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

from ._report import Progress
from .train import (
    _TAG,
    Mode,
    Setting,
    Skipped,
    Workload,
    check_dirs,
    failed,
    outcome,
    prepare,
    result_of,
    run,
    worker,
)


class Stepper:
    """One setting's process, stepped on request."""

    def __init__(self, s: Setting, w: Workload) -> None:
        self.s, self.w = s, w
        self.proc: subprocess.Popen = worker(s, w, lockstep=True)
        self.said: list[str] = []
        self.live = True

    def step(self) -> bool:
        """One step; False once the process has stopped stepping (failed, or done)."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.live = False
            return False
        for line in self.proc.stderr:
            if line.startswith(_TAG):
                return True
            self.said.append(line)
        self.live = False
        return False

    def result(self) -> dict[str, Any]:
        out, err = self.proc.communicate()
        return result_of(self.s, self.w, out, self.proc.returncode, self.said + err.splitlines())


def run_lockstep(
    settings: list[Setting],
    w: Workload,
    desc: str,
    deadline: float | None = None,
    known: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """``train.run``'s results, the settings stepped in turn. Budgets given as shares of
    keep's peak need keep's: from ``known``, else keep runs alone first."""
    if w.device == "cuda":
        raise ValueError("--lockstep runs each setting in a process of its own: CPU only")
    check_dirs(settings, w)
    keep_known = any(r["mode"] == Mode.KEEP.value and r["status"] == "ok" for r in known)
    if not keep_known and any(s.fraction is not None and s.budget is None for s in settings):
        known = [*known, *run([Setting(Mode.KEEP)], w, f"{desc}: keep's peak first")]
    results: list[dict[str, Any] | None] = [None] * len(settings)
    steppers: dict[int, Stepper] = {}
    for i, s in enumerate(settings):
        try:
            rs, rw = prepare(s, w, known, deadline)
        except Skipped as e:
            results[i] = failed(s, w, "skipped", str(e))
            continue
        steppers[i] = Stepper(rs, rw)
    per = w.warmup + w.steps
    try:
        with Progress(len(steppers) * per, f"{desc} (lockstep)", unit="step") as bar:
            for k in range(per):
                order = list(steppers.items())
                for _, st in order if k % 2 == 0 else order[::-1]:
                    if st.live and st.step():
                        bar.update(1, st.s.label)
            for i, st in steppers.items():
                results[i] = st.result()
                bar.write(f"{desc}: {outcome(results[i])}")
    finally:
        for st in steppers.values():
            if st.proc.poll() is None:
                st.proc.kill()
                st.proc.wait()
    return [r for r in results if r is not None]
