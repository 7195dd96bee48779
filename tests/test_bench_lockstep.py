"""``--lockstep``: every setting's process alive at once, each stepping only when told, in
turn (CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ssdtier.bench import lockstep, train, train_cli
from ssdtier.bench.train import Mode, Setting

from .test_bench_rok import TINY


def test_each_step_waits_for_its_gate():
    events = []
    w = replace(TINY, warmup=2, steps=3)
    train.measure(Setting(Mode.KEEP), w, lambda: events.append("step"), lambda: events.append("gate"))
    assert events == ["gate", "step"] * 5


def test_settings_step_in_turn_and_measure_as_alone(store_dir, monkeypatch):
    w = replace(TINY, dir=str(store_dir), warmup=1, steps=2)
    order = []
    step = lockstep.Stepper.step
    monkeypatch.setattr(lockstep.Stepper, "step", lambda self: order.append(self.s.label) or step(self))
    settings = [Setting(Mode.KEEP), Setting(Mode.SSDTIER, fraction=0.5), Setting(Mode.CHECKPOINT)]
    got = lockstep.run_lockstep(settings, w, "t")
    names = ["keep", "ssdtier 0.5x keep", "checkpoint"]
    assert order == names + names[::-1] + names  # reversed every other step
    assert [r["setting"] for r in got] == names and all(r["status"] == "ok" for r in got), got
    alone = train.run([Setting(Mode.KEEP)], w, "t")[0]
    assert got[0]["losses"] == alone["losses"] and got[1]["budget"] > 0  # keep's peak was run first
    assert got[1]["losses"] == alone["losses"] and len(got[0]["step_seconds"]) == 2


def test_a_setting_that_fails_leaves_the_others_stepping(store_dir, monkeypatch):
    # checkpoint's process dies after its first step; torchtune's is skipped (CUDA only).
    w = replace(TINY, dir=str(store_dir), warmup=1, steps=2)
    step = lockstep.Stepper.step

    def dies(self):
        if self.s.mode is Mode.CHECKPOINT and getattr(self, "stepped", False):
            self.proc.kill()
            self.proc.wait()
        self.stepped = True
        return step(self)

    monkeypatch.setattr(lockstep.Stepper, "step", dies)
    settings = [Setting(Mode.KEEP), Setting(Mode.TORCHTUNE), Setting(Mode.CHECKPOINT)]
    got = lockstep.run_lockstep(settings, w, "t")
    assert [r["status"] for r in got] == ["ok", "skipped", "OOM"], got  # SIGKILL reads as the OOM killer
    assert len(got[0]["step_seconds"]) == 2


def test_lockstep_is_for_the_cpu():
    with pytest.raises(ValueError, match="CPU only"):
        lockstep.run_lockstep([Setting(Mode.KEEP)], replace(TINY, device="cuda"), "t")


def test_the_cli_passes_lockstep_and_refuses_it_on_cuda(monkeypatch):
    import argparse

    from ssdtier.bench import add_parser
    from ssdtier.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    for bench in ("train", "rok"):
        assert parser.parse_args(["bench", bench, "--lockstep"]).lockstep
        assert not parser.parse_args(["bench", bench]).lockstep
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError, match="CPU only"):
        train_cli.workload_of(parser.parse_args(["bench", "rok", "--lockstep", "--device", "cuda"]))
