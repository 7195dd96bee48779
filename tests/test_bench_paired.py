"""``--paired``: keep's twin stepped beside each setting in its process (CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ssdtier.bench import paired, rok, summary, train, train_cli
from ssdtier.bench.train import Mode, Setting

from .test_bench_rok import TINY, parse


def test_twin_and_setting_alternate_which_steps_first(monkeypatch):
    order = []
    twin = paired.Twin(lambda: order.append("twin") or 0.0)
    losses: list[float] = []
    got = paired.paired_steps(lambda: order.append("own") or 1.0, twin, 4, lambda: order.append("gate"), losses)
    assert order == ["gate", "twin", "own", "gate", "own", "twin"] * 2
    assert losses == [1.0] * 4 and len(got["times"]) == len(got["twin_step_seconds"]) == 4
    assert got["paired_ratio"] > 0 and got["peak"] >= 0


@pytest.mark.parametrize("mode", [Mode.KEEP, Mode.CHECKPOINT])
def test_a_paired_setting_draws_its_own_dropout_masks(mode):
    # The twin draws from a random stream of its own: the setting's losses are those it has alone.
    w = replace(TINY, warmup=1, steps=3)
    alone = train.measure(Setting(mode), w, lambda: None)
    both = train.measure(Setting(mode), replace(w, paired=True), lambda: None)
    assert both["losses"] == alone["losses"]
    assert len(both["twin_step_seconds"]) == 3 and both["paired_ratio"] > 0
    assert "paired_ratio" not in alone


def test_a_paired_ssdtier_setting_in_its_process(store_dir):
    w = replace(TINY, dir=str(store_dir), warmup=1, steps=2, paired=True)
    got = train.run([Setting(Mode.KEEP), Setting(Mode.SSDTIER, fraction=0.5)], w, "t")
    assert all(r["status"] == "ok" for r in got), got
    assert got[0]["losses"] == got[1]["losses"] and got[1]["budget"] > 0
    assert all(len(r["twin_step_seconds"]) == 2 for r in got)


def _row(setting, mode, peak, s_per_sample, ratio):
    return {"setting": setting, "mode": mode, "status": "ok", "batch": 1, "peak_bytes": peak,
            "s_per_sample": s_per_sample, "paired_ratio": ratio, "losses": []}  # fmt: skip


def test_paired_ratios_judge_where_the_processes_drifted():
    # Alone, ssdtier's process ran slow (1.3 s a sample); beside its twin it took 1.01x keep's.
    results = [
        _row("keep", "keep", 100, 1.0, 0.99),
        _row("checkpoint", "checkpoint", 30, 1.1, 1.20),
        _row("ssdtier 0.35x keep", "ssdtier", 30, 1.3, 1.01),
    ]
    summary.ratios(results)
    assert [r["time_vs_keep"] for r in results] == [0.99, 1.20, 1.01]
    row = next(d for d in rok.dominance(results) if d["fraction"] == 0.4)
    assert row["ratio"] == pytest.approx(1.01 / 1.20) and row["met"]
    for r in results:
        del r["paired_ratio"]
    row = next(d for d in rok.dominance(results) if d["fraction"] == 0.4)
    assert row["ratio"] == pytest.approx(1.3 / 1.1) and not row["met"]


def test_rounds_take_the_median_paired_ratio():
    rounds = [[_row("keep", "keep", 100, t, p)] for t, p in ((1.0, 1.02), (2.0, 0.97), (1.5, 1.00))]
    for (r,) in rounds:
        r["median_step_s"] = r["s_per_sample"]
        r["tokens_per_s"] = 1.0
    (got,) = train_cli.combine(rounds)
    assert got["paired_ratio"] == 1.00 and got["round_paired_ratio"] == [1.02, 0.97, 1.00]


def test_the_cli_passes_paired_and_refuses_it_on_cuda(monkeypatch):
    from ssdtier.errors import ConfigError

    assert train_cli.workload_of(parse("--paired", "--device", "cpu")).paired
    assert not train_cli.workload_of(parse("--device", "cpu")).paired
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError, match="CPU only"):
        train_cli.workload_of(parse("--paired", "--device", "cuda"))
