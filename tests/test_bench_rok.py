"""``ssdtier bench rok``, the judge: every mode side by side on a small model (rows, files,
exact losses, memory relations that hold on any machine), the dominance table and the
``--fit`` search on synthetic results, and ``--fit --memory-cap`` on the CPU. Never timed."""

from __future__ import annotations

import argparse
import csv
import enum
import json
import os
import re
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ssdtier.bench import add_parser, fit, rok, summary, train, train_cli
from ssdtier.bench.train import Mode, Setting, Workload
from ssdtier.errors import ConfigError

from .test_cli import ssdtier

# Plain attention, 4 blocks: big enough that checkpointing visibly saves memory (the scores
# are 128 KiB a head), small enough for seconds a setting.
SMALL = ["--layers", "4", "--d-model", "64", "--heads", "2", "--seq", "128", "--batch", "4", "--vocab", "64"]
FAST = ["--steps", "1", "--warmup", "1", "--device", "cpu", "--threads", "1"]
TINY = Workload(None, 2, 32, 2, 16, 2, 64, 1, 1, "cpu", None, "auto", "0", 1)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    return p.parse_args(["bench", "rok", *argv])


def test_every_mode_side_by_side(store_dir, tmp_path):
    # torch.compile made a no-op: its row runs eagerly here (the real one has its own test).
    out = tmp_path / "rok"
    args = ["bench", "rok", *SMALL, *FAST, "--dir", str(store_dir), "--out", str(out)]
    args += ["--fractions", "1,0.5", "--checkpoint-every", "2,4"]
    r = ssdtier(*args, TORCHDYNAMO_DISABLE="1")
    assert r.returncode == 0, r.stderr
    with open(out / "rok.csv") as f:
        rows = {row["setting"]: row for row in csv.DictReader(f)}
    assert list(rows) == [
        "keep", "ssdtier 1x keep", "ssdtier 0.5x keep", "checkpoint", "checkpoint 1/2", "sac", "save_on_cpu",
        "torchtune", "compile budget 0.5",
    ]  # fmt: skip
    assert rows["torchtune"]["status"] == "skipped" and "CUDA tensors only" in rows["torchtune"]["error"]
    assert "torchtune: skipped: torchtune's OffloadActivations moves CUDA tensors only" in r.stdout
    ran = {k: v for k, v in rows.items() if v["status"] == "ok"}
    assert set(rows) - set(ran) == {"torchtune"}, {k: v["error"] for k, v in rows.items()}
    # Exact: every mode trains the same numbers; compiled kernels are not compared.
    assert all(v["losses_equal_keep"] == "True" for k, v in ran.items() if not k.startswith("compile"))
    assert rows["compile budget 0.5"]["losses_equal_keep"] == ""
    peak = {k: float(v["peak_bytes"]) for k, v in ran.items()}
    assert peak["checkpoint"] < peak["checkpoint 1/2"] < peak["keep"] and peak["sac"] < peak["keep"]
    keep = peak["keep"]
    assert int(rows["ssdtier 0.5x keep"]["budget"]) == int(0.5 * keep)  # a share of keep's measured peak
    doc = json.loads((out / "rok.json").read_text())
    assert [d["fraction"] for d in doc["dominance"]] == list(rok.DOMINANCE_FRACTIONS)
    for res in doc["results"]:
        if res["mode"] == "ssdtier":  # the plan covers every block
            assert sum(res["plan"].values()) == 4, res["plan"]
    for text in ("dominance: at each share of keep's peak", "ssdtier / other", "ms/sample", "losses = keep"):
        assert text in r.stdout
    pytest.importorskip("matplotlib")
    assert (out / "rok.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_setting_that_fails_is_a_row_and_the_run_goes_on(monkeypatch):
    # In a fresh process: a model transformers does not know ends that setting only.
    got = train._in_subprocess(Setting(Mode.KEEP), replace(TINY, hf="no-such-model"), lambda: None)
    assert got["status"] == "error" and "no-such-model" in got["error"] and got["setting"] == "keep"
    # In this process (CUDA's way): out of memory, a mode that does not run here, an error.
    for exc, status in ((torch.cuda.OutOfMemoryError("CUDA out of memory"), "OOM"), (RuntimeError("no cc"), "error")):
        monkeypatch.setattr(train, "_model", lambda *a, exc=exc: (_ for _ in ()).throw(exc))
        r = train.measure_safely(Setting(Mode.COMPILE, memory_budget=0.5), TINY, lambda: None)
        assert r["status"] == status and r["setting"] == "compile budget 0.5", r
    assert "no cc" in r["error"]
    r = train.measure_safely(Setting(Mode.TORCHTUNE), TINY, lambda: None)
    assert r["status"] == "skipped"
    # Out of memory in a step: which one, and with ssdtier its budget and plan then.
    monkeypatch.undo()
    calls = []

    def step(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    w = replace(TINY, warmup=2, steps=2)
    r = train.measure_safely(Setting(Mode.KEEP), w, lambda: None)
    assert r["status"] == "OOM" and r["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB (in warmup step 2)"
    calls.clear()
    r = train.measure_safely(Setting(Mode.SSDTIER, budget=1 << 20), replace(w, warmup=1), lambda: None)
    assert r["status"] == "OOM" and "(in step 2, after 1 warmup; ssdtier: device budget 1MiB, " in r["error"], r
    results = [train.failed(Setting(Mode.KEEP), TINY, "OOM", "x"), train.failed(Setting(Mode.SAC), TINY, "error", "y")]
    summary.ratios(results)
    assert rok.dominance(results) == [] and "keep did not run" in rok.render_dominance([])
    text = summary.render(results, TINY)
    assert "keep: OOM: x" in text and "sac: error: y" in text


def test_ssdtier_warms_up_until_its_plan_stands(monkeypatch):
    # The plan (scripted: the steps taken, up to ``top``) moved in the last warmup step: more
    # steps until one leaves it as it was, at most --warmup more, outside the progress bar.
    taken, ticks = [], []
    real = torch.optim.AdamW.step

    def step(self, *a, **k):
        taken.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    w = replace(TINY, warmup=3, steps=1)
    for top, extra in ((5, 3), (1, 0), (99, 3)):
        taken.clear()
        ticks.clear()
        monkeypatch.setattr(train, "plan_of", lambda off, top=top: min(len(taken), top))
        r = train.measure(Setting(Mode.SSDTIER, budget=1 << 20), w, lambda: ticks.append(1))
        assert r["settle_steps"] == extra and len(r["losses"]) == 4 + extra, (top, r["settle_steps"])
        assert len(ticks) == 4
    assert "settle_steps" not in train.measure(Setting(Mode.KEEP), w, lambda: None)
    # Its losses are compared with keep's over the steps both took.
    keep = result("keep", "keep", 10, 1, losses=["a", "b"], tokens_per_s=1.0)
    ours = result("ssdtier 0.5x keep", "ssdtier", 5, 1, losses=["a", "b", "c"], tokens_per_s=1.0)
    summary.ratios([keep, ours])
    assert ours["losses_equal_keep"] is True
    ours["settle_steps"] = 2
    assert "warmup steps more, until the plan stood for a step: ssdtier 0.5x keep +2" in summary.render([keep, ours], w)


def test_allocator_retries_are_said_where_they_happened():
    # A retried allocation empties the cache and synchronizes: a slow step its peak hides.
    keep = result("keep", "keep", 10, 1, losses=["a"], tokens_per_s=1.0, reserved_bytes=11 << 20)
    ours = result("ssdtier 0.5x keep", "ssdtier", 5, 1, losses=["a"], tokens_per_s=1.0, reserved_bytes=9 << 20)
    summary.ratios([keep, ours])
    assert "allocations retried" not in summary.render([keep, ours], TINY)
    assert train.in_a_line(ours) == "peak 5MiB, 0.001 s a step, reserved 9MiB"
    ours["alloc_retries"] = 3
    assert "allocations retried in the measured steps (the GPU ran full; each a synchronization): " \
        "ssdtier 0.5x keep 3" in summary.render([keep, ours], TINY)  # fmt: skip
    assert train.outcome(ours) == "ssdtier 0.5x keep: peak 5MiB, 0.001 s a step, reserved 9MiB, 3 allocator retries"
    ours["guard_recomputed"] = 1.5
    assert "blocks a measured step recomputed past ssdtier's plan (its forward would have passed the budget): " \
        "ssdtier 0.5x keep 1.5" in summary.render([keep, ours], TINY)  # fmt: skip
    assert train.in_a_line(ours).endswith("retries, 1.5 blocks a step recomputed past the plan")
    ours["guard_recomputed"] = 1 / 3  # a block in one of 3 measured steps
    assert train.in_a_line(ours).endswith("retries, 0.33 blocks a step recomputed past the plan")
    ours["plan"] = {"keep": 2, "recompute": 1}
    assert train.in_a_line(ours).endswith("past the plan, plan 2/0/1 (keep/offload/recompute)")
    assert train.in_a_line(train.failed(Setting(Mode.KEEP), TINY, "OOM", "x")) == "OOM: x"


def test_blocks_the_guard_recomputes_are_counted_in_the_measured_steps(monkeypatch):
    from ssdtier.offload.adaptive import Adaptive

    def guard(self, f, tag):  # one block a forward said recomputed past the plan
        self.off.c["guard_recomputed"] += tag == 1

    monkeypatch.setattr(Adaptive, "guard", guard)
    r = train.measure(Setting(Mode.SSDTIER, budget=1 << 16), replace(TINY, warmup=3, steps=2), lambda: None)
    assert r["guard_recomputed"] == 1 and r["offload"]["guard_recomputed"] == 3 + 2 + r["settle_steps"]


def test_on_cuda_each_setting_runs_in_this_process_and_frees_after(monkeypatch):
    from ssdtier.bench import memory

    calls = []
    monkeypatch.setattr(memory, "free_cuda", lambda: calls.append("free"))
    monkeypatch.setattr(train, "_in_subprocess", lambda *a: pytest.fail("on CUDA: in this process"))

    def oom(s, w, on_step):
        calls.append(s.label)
        return train.failed(s, w, "OOM", "CUDA out of memory")

    monkeypatch.setattr(train, "measure_safely", oom)
    cuda = replace(TINY, device="cuda")
    got = train.run([Setting(Mode.KEEP), Setting(Mode.SSDTIER, fraction=0.5), Setting(Mode.SAC)], cuda, "t")
    assert [r["status"] for r in got] == ["OOM", "skipped", "OOM"]  # no keep: no share of its peak
    assert calls == ["keep", "free", "sac", "free"]


def test_compile_under_a_memory_budget_runs_or_says_why():
    r = train.measure_safely(Setting(Mode.COMPILE, memory_budget=0.5), TINY, lambda: None)
    if r["status"] != "ok":  # no C++ compiler, say: the row says why
        assert r["status"] == "error" and r["error"], r
        return
    assert len(r["losses"]) == TINY.warmup + TINY.steps and r["median_step_s"] > 0


def result(setting: str, mode: str, peak_mib: float, ms: float, **extra) -> dict:
    return {"setting": setting, "mode": mode, "status": "ok", "batch": 1, "peak_bytes": int(peak_mib * 2**20),
            "s_per_sample": ms / 1e3, "median_step_s": ms / 1e3, **extra}  # fmt: skip


def test_dominance_takes_the_fastest_that_fits_at_each_share_of_keep():
    results = [
        result("keep", "keep", 100, 10.0),
        result("checkpoint 1/2", "checkpoint", 55, 11.0),
        result("checkpoint", "checkpoint", 20, 13.0),
        result("sac", "sac", 50, 11.5),
        result("save_on_cpu", "save_on_cpu", 100, 9.0),  # as much memory as keep: never fits
        result("ssdtier 0.8x keep", "ssdtier", 78, 10.1),
        result("ssdtier 0.6x keep", "ssdtier", 61, 10.2),  # just over 0.6: not at 0.6
        result("ssdtier 0.4x keep", "ssdtier", 39, 11.0),
        {"setting": "torchtune", "mode": "torchtune", "status": "skipped", "error": "CUDA only"},
    ]
    rows = {d["fraction"]: d for d in rok.dominance(results)}
    assert rows[0.8]["other"] == "checkpoint 1/2" and rows[0.8]["ssdtier"] == "ssdtier 0.8x keep"
    assert rows[0.8]["ratio"] == pytest.approx(10.1 / 11.0) and rows[0.8]["met"]
    assert rows[0.8]["other_time_vs_keep"] == pytest.approx(1.1) and rows[0.8]["limit_bytes"] == 80 * 2**20
    assert rows[0.6]["other"] == "checkpoint 1/2" and rows[0.6]["ssdtier"] == "ssdtier 0.4x keep"
    assert rows[0.6]["ratio"] == pytest.approx(1.0) and rows[0.6]["met"]
    assert rows[0.4]["other"] == "checkpoint" and rows[0.4]["ratio"] == pytest.approx(11 / 13)
    assert rows[0.25]["ssdtier"] is None and rows[0.25]["met"] is False  # only checkpoint fits there
    slower = [*results[:5], result("ssdtier 0.8x keep", "ssdtier", 78, 11.5)]
    assert rok.dominance(slower, (0.8,))[0]["met"] is False  # 11.5 / 11.0 > 1.03
    alone = [result("keep", "keep", 100, 10.0), result("ssdtier 0.25x keep", "ssdtier", 20, 12.0)]
    assert rok.dominance(alone, (0.25,))[0]["met"] is True  # nothing else fits: ssdtier wins
    assert rok.dominance(alone[:1], (0.25,))[0]["met"] is None
    text = rok.render_dominance(rok.dominance(results))
    assert "(none fits)" in text and "NO" in text and "yes" in text


def test_interleaved_rounds_combine_by_their_medians():
    def timed(name, mode, mib, step, losses=("a",)):
        return {**result(name, mode, mib, step / 4), "median_step_s": step, "batch": 4, "tokens_per_s": 4.0 / step,
                "losses": list(losses)}  # fmt: skip

    rounds = [
        [timed("keep", "keep", 100, 1.0), timed("ssdtier 0.5x keep", "ssdtier", 50, 1.3)],
        [timed("keep", "keep", 101, 1.2), timed("ssdtier 0.5x keep", "ssdtier", 49, 1.0)],
        [timed("keep", "keep", 100, 1.1), timed("ssdtier 0.5x keep", "ssdtier", 50, 1.1, ("b",))],
    ]
    keep, ours = train_cli.combine(rounds)
    assert keep["median_step_s"] == 1.1 and keep["s_per_sample"] == pytest.approx(0.275)
    assert keep["peak_bytes"] == 100 * 2**20 and keep["round_step_s"] == [1.0, 1.2, 1.1]
    assert ours["median_step_s"] == 1.1 and keep["losses_equal_rounds"] and not ours["losses_equal_rounds"]
    assert ours["tokens_per_s"] == pytest.approx(4.0 / 1.1)
    failed = [{**rounds[1][1], "status": "error", "error": "boom"}]
    assert train_cli.combine([[rounds[0][1]], failed])[0]["status"] == "error"
    late = [{**rounds[2][1], "status": "skipped", "error": "out of time"}]  # --budget-s ran out
    assert train_cli.combine([[rounds[0][1]], [rounds[1][1]], late])[0]["round_step_s"] == [1.3, 1.0]
    assert train_cli.combine(rounds[:1]) is rounds[0]


def test_every_other_round_runs_the_settings_in_reverse(monkeypatch):
    ran = []
    peaks = iter([100, 60, 80, 70])  # keep's peak in each round: only the first's sets the budgets

    def run_one(s, w, on_step):
        ran.append((s.label, s.budget))
        peak = next(peaks) if s.mode is Mode.KEEP else 10
        return {"setting": s.label, "mode": s.mode.value, "status": "ok", "batch": 1, "peak_bytes": peak,
                "median_step_s": 1.0, "s_per_sample": 1.0, "tokens_per_s": 1.0, "losses": []}  # fmt: skip

    monkeypatch.setattr(train, "run_one", run_one)
    settings = [Setting(Mode.KEEP), Setting(Mode.SSDTIER, fraction=0.5), Setting(Mode.CHECKPOINT)]
    got = train_cli.run_rounds(settings, TINY, "t", 4)
    labels = [label for label, _ in ran]
    forward, backward = ["keep", "ssdtier 0.5x keep", "checkpoint"], ["checkpoint", "ssdtier 0.5x keep", "keep"]
    assert labels == forward + backward + forward + backward
    assert {b for label, b in ran if label.startswith("ssdtier")} == {50}
    assert [r["setting"] for r in got] == forward and got[0]["round_peak_bytes"] == [100, 60, 80, 70]


def test_quick_runs_three_interleaved_rounds_unless_told():
    """A newcomer's --quick numbers: one round of a small model drifts 1.5x between minutes."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    for bench in ("train", "rok"):
        for argv, want in (([], 1), (["--quick"], 3), (["--quick", "--repeats", "1"], 1), (["--repeats", "2"], 2)):
            assert train_cli.repeats_of(parser.parse_args(["bench", bench, *argv])) == want, (bench, argv)


class FakeAction(enum.Enum):
    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    BOTH = "recompute+offload"


def test_the_plan_is_read_defensively():
    A = FakeAction
    acts = SimpleNamespace(actions=(A.OFFLOAD, A.OFFLOAD, A.RECOMPUTE, A.BOTH, A.KEEP))
    got = train.plan_counts(SimpleNamespace(plan=lambda: acts))
    assert got == {"keep": 1, "offload": 2, "recompute": 1, "recompute+offload": 1}
    old = SimpleNamespace(keep_last=1, layers=(1, 2, 3))
    assert train.plan_counts(SimpleNamespace(plan=lambda: old)) == {"keep": 1, "offload": 2, "recompute": 0}
    stats = SimpleNamespace(layers_kept=0, layers_offloaded=4)
    assert train.plan_counts(SimpleNamespace(plan=lambda: None), stats) == {"keep": 0, "offload": 4, "recompute": 0}

    def broken():
        raise RuntimeError("no plan yet")

    assert train.plan_counts(SimpleNamespace(plan=broken)) == {}
    assert train.plan_text(got) == "1/2/1 +1 r+o" and train.plan_text(None) == "-"


def test_settings_presets_and_options():
    w = train_cli.workload_of(parse("--quick", "--device", "cpu"))
    assert (w.layers, w.d_model, w.seq, w.batch, w.min_tensor_bytes) == (4, 128, 256, 8, "64KiB")
    w = train_cli.workload_of(parse("--wide", "--device", "cpu", "--layers", "2"))  # an option wins over the preset
    assert (w.layers, w.d_model, w.heads, w.sdpa, w.dtype, w.dropout) == (2, 4096, 32, True, "bf16", 0.0)
    w = train_cli.workload_of(parse("--long", "--device", "cpu"))
    assert w.seq >= 16384 and w.sdpa
    w = train_cli.workload_of(parse("--quick", "--device", "cpu", "--throttle", "100MB"))
    assert w.store_config(Setting(Mode.SSDTIER)).io.throttle == 100_000_000 and "throttled" in summary.describe(w)
    with pytest.raises(SystemExit):
        parse("--quick", "--long")
    a = parse("--modes", "ssdtier,checkpoint", "--keep-last", "0", "--budget", "1MiB", "--fractions", "0.5")
    labels = [s.label for s in rok.settings_of(TINY, tuple(a.modes), tuple(a.fractions), tuple(a.budget),
                                               tuple(a.checkpoint_every), (), tuple(a.keep_last))]  # fmt: skip
    assert labels == ["keep", "ssdtier 0.5x keep", "ssdtier budget 1MiB", "ssdtier keep 0", "checkpoint"]
    eight = replace(TINY, layers=8)
    assert [s.label for s in rok.settings_of(eight, ("checkpoint", "compile"), compile_budgets=(1.0, 0.5))] == [
        "keep", "checkpoint", "checkpoint 1/2", "checkpoint 1/4", "compile budget 1", "compile budget 0.5",
    ]  # fmt: skip
    for bad in (["--modes", "nope"], ["--fractions", "0,x"], ["--checkpoint-every", "1.5"]):
        with pytest.raises(SystemExit):
            parse(*bad)
    s = Setting(Mode.SSDTIER, fraction=0.5)
    assert Setting.from_dict(s.to_dict()) == s
    keep = {"mode": "keep", "status": "ok", "peak_bytes": 1000}
    assert train.resolve(s, TINY, [keep])[0].budget == 500
    with pytest.raises(train.Skipped, match="keep did not run"):
        train.resolve(s, TINY, [])


def test_the_arena_is_the_packages_default_on_cuda():
    assert train.auto_arena(TINY) == "64MiB"  # the CPU: small, the bytes reach NVMe
    cuda = replace(TINY, device="cuda")
    assert train.auto_arena(cuda) == "auto"
    assert cuda.store_config(Setting(Mode.SSDTIER)).host.capacity == "auto"
    assert summary.losses_compared(replace(cuda, sdpa=True)) == 1 and summary.losses_compared(TINY) is None


# ---------------------------------------------------------------- --fit


def test_batch_search_doubles_then_bisects():
    P = fit.Probe
    tried = []

    def fits(b):
        tried.append(b)
        return P.FITS if b <= 37 else P.FAILS

    assert fit.search_batches(fits, 256) == {"largest": 37, "failed": 38, "cut": False, "slow": False}
    assert tried[:7] == [1, 2, 4, 8, 16, 32, 64] and len(tried) < 14
    assert fit.search_batches(lambda b: P.FITS, 12) == {"largest": 12, "failed": None, "cut": False, "slow": False}
    assert fit.search_batches(lambda b: P.STOP if b > 2 else P.FITS, 64)["cut"]
    # A slow batch stops the doubling; in the bisection it counts as fitting.
    slow = fit.search_batches(lambda b: P.SLOW if b >= 8 else P.FITS, 64)
    assert slow == {"largest": 8, "failed": None, "cut": False, "slow": True}
    assert fit.search_batches(lambda b: P.FAILS if b > 37 else P.SLOW if b > 32 else P.FITS, 256)["largest"] == 37


def test_rok_search_bisects_between_the_probes_either_side():
    def s_per_sample(b):  # keep's speed up to 21 samples, then the disk's
        return 1.0 if b <= 21 else 10.0

    probes = [{"batch": b, "fits": True, "s_per_sample": s_per_sample(b)} for b in (1, 2, 4, 8, 16, 32)]
    probes.append({"batch": 64, "fits": False})
    tried = []

    def probe(b):
        tried.append(b)
        p = {"batch": b, "fits": True, "s_per_sample": s_per_sample(b)}
        probes.append(p)
        return p

    assert fit.search_rok(probe, probes, 1.05)
    assert tried == [24, 20, 22, 21]
    assert max(p["batch"] for p in probes if p.get("fits") and p["s_per_sample"] <= 1.05) == 21
    # Out of time: cut, and what was found stays.
    assert not fit.search_rok(
        lambda b: None, [{"batch": 2, "fits": True, "s_per_sample": 1.0}, {"batch": 4, "fits": False}], 1.05
    )
    # Nothing within: bisects below the smallest probe, from batch 0.
    slow = []
    assert fit.search_rok(
        lambda b: slow.append(b) or {"batch": b, "fits": True, "s_per_sample": 9.0},
        [{"batch": 4, "fits": True, "s_per_sample": 9.0}],
        1.05,
    )
    assert slow == [2, 1]


def test_search_bisects_each_time_limit():
    def probe_at(b):  # fits up to 21; keep's speed up to 10, 1.08x up to 16, then slow
        if b > 21:
            return {"batch": b, "fits": False}
        return {"batch": b, "fits": True, "s_per_sample": 1.0 if b <= 10 else 1.08 if b <= 16 else 2.0}

    got = fit.search(probe_at, 64, [1.05, 1.10])
    assert (got["largest"], got["failed"], got["cut"]) == (21, 22, False)
    assert fit.largest_within(got["probes"], 1.05)["batch"] == 10
    assert fit.largest_within(got["probes"], 1.10)["batch"] == 16
    assert fit.largest_within(got["probes"], 0.5) is None
    cut = fit.search(lambda b: None if b > 4 else probe_at(b), 64, [1.05])
    assert cut["cut"] and cut["largest"] == 4


def test_fit_all_with_fake_probes():
    # keep: 1 MiB a sample; checkpoint: a quarter of it and 1.3x slower; ssdtier: half, as fast
    # up to 6; torchtune errs; sac runs out of memory past 3.
    per = {"keep": (1.0, 1.0), "checkpoint": (0.25, 1.3), "ssdtier": (0.5, 1.0), "sac": (0.5, 1.1)}
    runs = []

    def run_at(mode, b):
        runs.append((mode, b))
        if mode == "torchtune":
            return {"status": "error", "error": "boom"}
        if mode == "sac" and b > 3:
            return {"status": "OOM", "error": "out of memory"}
        mib, slow = per[mode]
        s = slow if mode != "ssdtier" or b <= 6 else 1.5
        r = {"status": "ok", "peak_bytes": int(mib * b * 2**20), "median_step_s": s * b, "plan": {"keep": 1}}
        return {**r, "reserved_bytes": 2 * r["peak_bytes"], "alloc_retries": b} if mode == "ssdtier" else r

    got = fit.fit_all(["keep", "checkpoint", "ssdtier", "torchtune", "sac"], run_at, 64, cap=int(4.5 * 2**20))
    assert (got["keep"]["largest"], got["keep"]["failed"]) == (4, 5)
    assert (got["checkpoint"]["largest"], got["checkpoint"]["failed"]) == (18, 19)
    assert got["checkpoint"]["within"] == {"1.05": 0, "1.1": 0}  # 1.3x keep: never within
    assert got["ssdtier"]["largest"] == 9 and got["ssdtier"]["within"] == {"1.05": 6, "1.1": 6}
    assert got["ssdtier"]["at_largest"]["plan"] == {"keep": 1}
    assert got["ssdtier"]["at_largest"]["alloc_retries"] == 9  # the GPU ran full there
    assert got["ssdtier"]["at_largest"]["reserved_bytes"] == 9 * 2**20
    assert got["torchtune"]["status"] == "error" and "boom" in got["torchtune"]["error"]
    assert (got["sac"]["largest"], got["sac"]["failed"]) == (3, 4)
    text = rok.render_fit({"cap": int(4.5 * 2**20), "limits": [1.05, 1.1], "steps": 1, "modes": got})
    assert "largest overall: at any speed: 18 (checkpoint); at <= 1.05x keep: 6 (ssdtier)" in text
    assert "torchtune: error: batch 1: boom" in text
    # Out of time: the modes left are skipped; a slow mode stops growing.
    clock = iter(range(100))
    late = fit.fit_all(["keep", "checkpoint"], run_at, 64, deadline=2.5, clock=lambda: next(clock))
    assert late["keep"]["cut"] and late["checkpoint"]["status"] == "skipped"
    slow = fit.fit_all(["keep", "checkpoint"], run_at, 64, cap=int(4.5 * 2**20), slow=1.2)
    assert slow["checkpoint"]["slow"] and slow["checkpoint"]["largest"] == 1


def test_listed_batches_are_probed_ascending_until_one_fails_or_is_slow():
    P = fit.Probe
    seen = []

    def fits(b):
        seen.append(b)
        return P.FAILS if b > 20 else P.FITS

    assert fit.probe_batches(fits, [24, 13, 19, 13, 50]) == {"largest": 19, "failed": 24, "cut": False, "slow": False}
    assert seen == [13, 19, 24]  # ascending, once each, nothing past the first failure
    slow = fit.probe_batches(lambda b: P.SLOW if b >= 19 else P.FITS, [13, 19, 24])
    assert slow == {"largest": 19, "failed": None, "cut": False, "slow": True}
    assert fit.probe_batches(lambda b: P.STOP if b > 13 else P.FITS, [13, 19])["cut"]


def listed_run_at(runs):
    """keep: 1 MiB a sample, out of memory past 13; checkpoint: a quarter, 1.2x keep's time,
    to 43; ssdtier: half, keep's time to 19, 1.08x to 24, then 1.3x; out of memory past 32."""

    def run_at(mode, b):
        runs.append((mode, b))
        top, mib = {"keep": (13, 1.0), "checkpoint": (43, 0.25), "ssdtier": (32, 0.5)}[mode]
        if b > top:
            return {"status": "OOM", "error": "out of memory"}
        s = 1.2 if mode == "checkpoint" else 1.0 if mode == "keep" or b <= 19 else 1.08 if b <= 24 else 1.3
        return {"status": "ok", "peak_bytes": int(mib * b * 2**20), "median_step_s": s * b}

    return run_at


def listed_run_one(runs):
    """``run_one`` as ``listed_run_at`` trains: a result of the setting at its batch."""

    def run_one(s, w, on_step):
        r = listed_run_at(runs)(s.mode.value, w.batch)
        r |= {"setting": s.label, **s.to_dict(), "batch": w.batch}
        ok = {"s_per_sample": r.get("median_step_s", 0) / w.batch, "tokens_per_s": 1.0, "losses": ["0x1p+0"]}
        return r | (ok if r["status"] == "ok" else {})

    return run_one


def test_fit_at_listed_batches_answers_the_targets_in_a_few_probes():
    runs = []
    got = fit.fit_all(["keep", "ssdtier", "checkpoint"], listed_run_at(runs), 160, batches=[13, 19, 24, 32, 43, 50])
    # keep searched; the others only past keep's largest, until they fail.
    keep = [("keep", b) for b in (1, 2, 4, 8, 16, 12, 14, 13)]
    assert runs == keep + [("ssdtier", 19), ("ssdtier", 24), ("ssdtier", 32), ("ssdtier", 43),
                           ("checkpoint", 19), ("checkpoint", 24), ("checkpoint", 32), ("checkpoint", 43),
                           ("checkpoint", 50)]  # fmt: skip
    assert (got["keep"]["largest"], got["keep"]["failed"]) == (13, 14)
    assert (got["ssdtier"]["largest"], got["ssdtier"]["failed"]) == (32, 43)
    assert got["ssdtier"]["probes"][-1] == {"batch": 43, "fits": False, "error": "out of memory"}
    assert got["ssdtier"]["within"] == {"1.05": 19, "1.1": 24}
    assert got["checkpoint"]["largest"] == 43 and got["checkpoint"]["within"] == {"1.05": 0, "1.1": 0}
    assert fit.within_mode(got, "checkpoint") == {"keep": 13, "ssdtier": 24}  # 1.08x <= 1.2x; 1.3x is not
    text = rok.render_fit({"cap": None, "limits": [1.05, 1.1], "steps": 1, "batches": [13, 19], "modes": got})
    assert "keep searched, then batches 13, 19 past its largest" in text
    assert "at checkpoint's time per sample at its largest batch (43, 1200.00 ms): ssdtier 24 (0.56x)" in text
    slow = [{**p, "s_per_sample": 1e9} if p["fits"] else p for p in got["ssdtier"]["probes"]]
    modes = {**got, "ssdtier": {**got["ssdtier"], "probes": slow}}
    text = rok.render_fit({"cap": None, "limits": [1.05, 1.1], "steps": 1, "batches": [13, 19], "modes": modes})
    assert "(43, 1200.00 ms): ssdtier none" in text  # not "0 (0.00x)"
    # A list that starts past keep's largest: keep's own search still gives the reference.
    runs.clear()
    past = fit.fit_all(["keep", "ssdtier"], listed_run_at(runs), 160, batches=[19, 24])
    assert past["keep"]["largest"] == 13 and past["ssdtier"]["largest"] == 24
    assert past["ssdtier"]["within"] == {"1.05": 19, "1.1": 24}
    # Keep fit all of them: nothing left for the others to probe, and the table says so.
    every = fit.fit_all(["keep", "ssdtier"], listed_run_at(runs), 160, batches=[2, 13])
    assert every["keep"]["largest"] == 13 and every["ssdtier"]["status"] == "skipped"
    text = rok.render_fit({"cap": None, "limits": [1.05], "steps": 1, "batches": [2, 13], "modes": every})
    assert "ssdtier: skipped: no listed batch past keep's largest" in text and "the last of --fit-batches" in text


def test_fit_reads_the_memory_cap_and_gives_ssdtier_it_as_its_budget(monkeypatch, tmp_path, store_dir):
    seen = []

    def fake_run_one(s, w, on_step):
        seen.append((s, w.batch))
        per = 0.25 if s.mode is Mode.CHECKPOINT else 1.0
        r = {"setting": s.label, **s.to_dict(), "status": "ok", "batch": w.batch, "median_step_s": 0.1 * w.batch}
        return r | {"peak_bytes": int(per * w.batch * 2**20), "s_per_sample": 0.1, "tokens_per_s": 1.0,
                    "losses": ["0x1p+0"]}  # fmt: skip

    monkeypatch.setattr(rok, "run_one", fake_run_one)
    monkeypatch.setattr(train, "run_one", fake_run_one)
    a = parse("--device", "cpu", "--layers", "2", "--modes", "keep,checkpoint,ssdtier", "--fractions", "0.5", "--fit",
              "--ssdtier-compile", "0.5")  # fmt: skip
    a.memory_cap, a.fit_max_batch, a.out = "2.5MiB", 16, str(tmp_path / "out")
    a.dir = str(store_dir)
    assert rok.cmd_rok(a) == 0
    doc = json.loads((tmp_path / "out" / "rok.json").read_text())
    modes = doc["fit"]["modes"]
    assert list(modes) == ["keep", "ssdtier budget 2.5MiB", "ssdtier on compile 0.5 budget 2.5MiB", "checkpoint"]
    assert (modes["keep"]["largest"], modes["keep"]["failed"]) == (2, 3)
    assert (modes["checkpoint"]["largest"], modes["checkpoint"]["failed"]) == (10, 11)
    assert all(s.budget == int(2.5 * 2**20) for s, _ in seen if s.mode is Mode.SSDTIER and s.fraction is None)
    bad = parse("--device", "cpu", "--fit")
    with pytest.raises(Exception, match="--memory-cap"):
        rok.cmd_rok(bad)


def test_fit_batches_from_the_command_line(monkeypatch, tmp_path, store_dir):
    runs = []

    fake_run_one = listed_run_one(runs)
    monkeypatch.setattr(rok, "run_one", fake_run_one)
    monkeypatch.setattr(train, "run_one", fake_run_one)
    a = parse("--device", "cpu", "--layers", "2", "--modes", "keep,ssdtier", "--fractions", "0.5", "--fit",
              "--fit-batches", "24,13,19", "--memory-cap", "1GiB", "--batch", "8")  # fmt: skip
    a.out, a.dir = str(tmp_path / "out"), str(store_dir)
    assert rok.cmd_rok(a) == 0
    got = json.loads((tmp_path / "out" / "rok.json").read_text())["fit"]
    assert got["batches"] == [13, 19, 24]
    assert [p["batch"] for p in got["modes"]["keep"]["probes"]] == [1, 2, 4, 8, 16, 12, 14, 13]
    assert [p["batch"] for p in got["modes"]["ssdtier budget 1GiB"]["probes"]] == [19, 24]
    with pytest.raises(SystemExit):
        parse("--fit-batches", "0,13")


def test_fit_with_a_memory_cap_on_the_cpu(store_dir, tmp_path):
    out = tmp_path / "fit"
    # Each probe is a process of its own: two modes (test_fit_all_with_fake_probes has more).
    args = ["bench", "rok", *SMALL, *FAST, "--dir", str(store_dir), "--out", str(out), "--fractions", "0.5"]
    args += ["--modes", "keep,ssdtier", "--fit", "--memory-cap", "1GiB", "--fit-max-batch", "2"]
    r = ssdtier(*args, "--fit-steps", "1")
    assert r.returncode == 0, r.stderr
    modes = json.loads((out / "rok.json").read_text())["fit"]["modes"]
    assert list(modes) == ["keep", "ssdtier budget 1GiB"]
    for m in modes.values():  # 1 GiB: batches 1 and 2 fit; nothing failed up to the cap
        assert m["status"] == "ok" and (m["largest"], m["failed"]) == (2, None), m
        assert all(b is None or b <= 2 for b in m["within"].values())
    assert "fit: the largest micro-batch of each mode (peak activation memory <= 1GiB)" in r.stdout
    r = ssdtier("bench", "rok", *SMALL, *FAST, "--fit", "--out", str(out))
    assert r.returncode == 1 and "--fit on the CPU needs --memory-cap SIZE" in r.stderr


def test_ssdtier_on_compiled_blocks_trains_as_compile_does(store_dir, monkeypatch):
    """Each block compiled, then attached: the compiled blocks recomputed, offloaded and kept
    (a plan forced, not timed), and the losses equal compile's alone, bit for bit."""
    from ssdtier.plan import Action

    from .test_rok import forced

    forced(monkeypatch, (Action.RECOMPUTE, Action.OFFLOAD, Action.KEEP))
    w = replace(TINY, layers=3, d_model=64, seq=32, batch=4, steps=2, warmup=4, dir=str(store_dir))
    alone = train.measure_safely(Setting(Mode.COMPILE, memory_budget=1.0), w, lambda: None)
    if alone["status"] != "ok":  # no C++ compiler, say: compile's own row says why
        pytest.skip(f"torch.compile does not run here: {alone['error']}")
    s = Setting(Mode.SSDTIER, budget="1GiB", memory_budget=1.0)
    ours = train.measure(s, replace(w, arena="64MiB"), lambda: None)
    assert ours["setting"] == "ssdtier on compile 1 budget 1GiB"
    done = ours["offload"]  # the stats: a forced plan is not the planner's, so none is reported
    assert (done["layers_recomputed"], done["layers_kept"]) == (1, 1) and done["tensors_offloaded"] > 0, done
    results = [train.measure(Setting(Mode.KEEP), w, lambda: None), alone, ours]
    summary.ratios(results)
    assert ours["losses_equal_keep"] is True, (ours["losses"], alone["losses"])


def test_ssdtier_on_compile_is_compared_with_compile_at_its_budget():
    keep = result("keep", "keep", 100, 10.0, losses=["a", "b"])
    alone = result("compile budget 0.5", "compile", 50, 9.0, memory_budget=0.5, losses=["c", "d"])
    same = result("ssdtier on compile 0.5 0.4x keep", "ssdtier", 40, 9.5, memory_budget=0.5, losses=["c", "d"])
    other = result("ssdtier on compile 0.5 0.3x keep", "ssdtier", 30, 9.9, memory_budget=0.5, losses=["c", "x"])
    lone = result("ssdtier on compile 1 0.4x keep", "ssdtier", 40, 9.5, memory_budget=1.0, losses=["e", "f"])
    eager = result("ssdtier 0.4x keep", "ssdtier", 40, 12.0, losses=["a", "b"])
    summary.ratios([keep, alone, same, other, lone, eager])
    assert [r["losses_equal_keep"] for r in (alone, same, other, lone, eager)] == [None, True, False, None, True]
    curves = [rok.family_of(r) for r in (keep, alone, same, eager)]
    assert curves == ["keep", "compile", "ssdtier on compile", "ssdtier"]
    rows = {d["fraction"]: d for d in rok.dominance([keep, alone, same, eager])}
    assert rows[0.6]["other"] == "compile budget 0.5" and rows[0.6]["ssdtier"] == same["setting"]
    a = parse("--modes", "ssdtier", "--fractions", "0.5", "--ssdtier-compile", "1,0.5")
    labels = [s.label for s in rok.settings_of(TINY, tuple(a.modes), tuple(a.fractions), (), (2, 4),
                                               tuple(a.compile_budgets), (), tuple(a.ssdtier_compile))]  # fmt: skip
    assert labels == [
        "keep", "ssdtier 0.5x keep", "ssdtier on compile 1 0.5x keep", "ssdtier on compile 0.5 0.5x keep",
        "compile budget 1", "compile budget 0.5",
    ]  # fmt: skip


def test_every_ssdtier_setting_and_probe_of_a_run_in_this_process_shares_one_store(store_dir, tmp_path, monkeypatch):
    # As on CUDA (on the CPU, in this process for the test): the arena is opened once a run.
    from .test_shelf import stores_seen

    seen = stores_seen(monkeypatch)
    monkeypatch.setattr(train, "_in_subprocess", lambda s, w, on_step: train.measure_safely(s, w, on_step))
    fit = ["--fit", "--memory-cap", "1GiB", "--fit-max-batch", "2", "--fit-steps", "1"]
    args = parse(*SMALL, *FAST, "--dir", str(store_dir), "--out", str(tmp_path), "--modes", "keep,ssdtier", *fit)
    assert rok.cmd_rok(args) == 0
    assert len(seen) >= 4 and all(s is seen[0] for s in seen), seen  # 2 settings, 2 probes or more
    assert seen[0].closed


def test_the_targets_have_no_reference_when_keeps_search_was_cut():
    # Keep stopped at batch 2 for time (a sample takes longer there than at its largest):
    # ratios to it would flatter the others, so there are none.
    runs = []
    clock = iter([0, 0, 1, 9])  # keep starts at 0, probes 1 and 2, past half the time at 4
    got = fit.fit_all(["keep", "ssdtier"], listed_run_at(runs), 160, deadline=10, clock=lambda: next(clock, 9))
    assert got["keep"]["cut"] and got["keep"]["largest"] == 2
    assert got["ssdtier"]["status"] == "ok" and got["ssdtier"]["within"] == {"1.05": None, "1.1": None}
    text = rok.render_fit({"cap": None, "limits": [1.05, 1.1], "steps": 1, "modes": got})
    assert "keep's time per sample at its largest batch: none (keep's search was cut)" in text


def test_a_probe_that_errs_past_batches_that_fit_keeps_them():
    def run_at(mode, b):
        if mode == "ssdtier" and b > 24:
            return {"status": "error", "error": "disk full"}
        return listed_run_at([])(mode, b)

    got = fit.fit_all(["keep", "ssdtier"], run_at, 160, batches=[19, 24, 32])
    s = got["ssdtier"]
    assert s["status"] == "ok" and s["largest"] == 24 and s["cut"] and s["within"] == {"1.05": 19, "1.1": 24}
    text = rok.render_fit({"cap": None, "limits": [1.05, 1.1], "steps": 1, "batches": [19, 24, 32], "modes": got})
    assert "ssdtier: stopped at error: batch 32: disk full" in text and "at <= 1.1x keep: 24 (ssdtier)" in text


def test_dominance_is_not_met_against_settings_that_did_not_run():
    from ssdtier.bench.train import OUT_OF_TIME

    results = [
        result("keep", "keep", 100, 10.0),
        result("ssdtier 0.4x keep", "ssdtier", 39, 11.0),
        {"setting": "checkpoint", "mode": "checkpoint", "status": "skipped", "error": OUT_OF_TIME},
        {"setting": "torchtune", "mode": "torchtune", "status": "skipped", "error": "CUDA only"},
    ]
    row = rok.dominance(results, (0.4,))[0]
    assert row["met"] is None and row["unrun"] == ["checkpoint"]
    assert "not compared with checkpoint, which did not run" in rok.render_dominance([row])
    assert rok.dominance([r for r in results if r["mode"] != "checkpoint"], (0.4,))[0]["met"] is True
    wrong = {**results[1], "losses_equal_keep": False}  # its losses are not keep's: no win
    assert rok.dominance([results[0], wrong], (0.4,))[0]["ssdtier"] is None


def test_fit_searches_keep_and_modes_the_side_by_side_run_had_no_time_for(monkeypatch, tmp_path, store_dir, capsys):
    from ssdtier.bench.train import OUT_OF_TIME

    runs = []

    fake_run_one = listed_run_one(runs)
    a = parse("--device", "cpu", "--layers", "2", "--modes", "keep,checkpoint", "--checkpoint-every", "1", "--fit",
              "--fit-batches", "24,19", "--memory-cap", "1GiB", "--batch", "8")  # fmt: skip
    w = replace(TINY, batch=8, dir=str(store_dir))
    settings = rok.settings_of(w, ("keep", "checkpoint"), every=(1,))
    side = [
        {"setting": "keep", "mode": "keep", "status": "OOM", "error": "out of memory"},
        {"setting": "checkpoint", "mode": "checkpoint", "status": "skipped", "error": OUT_OF_TIME},
    ]

    def stepping(s, w, on_step):  # each probe's steps reach its progress bar
        on_step()
        return fake_run_one(s, w, on_step)

    monkeypatch.setattr(rok, "run_one", stepping)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the bar's line per step, without tqdm
    got = rok.run_fit(settings, w, a, side, None)["modes"]
    assert got["keep"]["largest"] == 13 and got["checkpoint"]["largest"] == 24
    assert "bench rok --fit: checkpoint at batch 24: 1/" in capsys.readouterr().err


def test_fit_modes_tell_ssdtier_on_compiled_blocks_from_eager():
    settings = rok.settings_of(TINY, ("keep", "ssdtier"), fractions=(0.5,), ssdtier_compile=(0.2,))
    eager = rok.fit_settings(settings, None, ("keep", "ssdtier"))
    compiled = rok.fit_settings(settings, None, ("keep", rok.COMPILED))
    assert [s.memory_budget for s in eager.values()] == [None, None]
    assert [s.memory_budget for s in compiled.values()] == [None, 0.2]
    assert parse("--fit-modes", "keep,ssdtier-compile").fit_modes == ["keep", "ssdtier-compile"]
    with pytest.raises(SystemExit):
        parse("--modes", "ssdtier-compile")


def test_dominance_by_reserved_memory_too():
    # ssdtier's 0.4x row fits 0.4 of keep's allocated peak but reserves 0.6 of keep's: by
    # reserved memory it does not fit 0.4, where checkpointing does.
    results = [
        {**result("keep", "keep", 100, 10.0), "reserved_bytes": 110 * 2**20},
        {**result("ssdtier 0.4x keep", "ssdtier", 39, 10.5), "reserved_bytes": 66 * 2**20},
        {**result("checkpoint", "checkpoint", 30, 12.0), "reserved_bytes": 35 * 2**20},
    ]
    assert rok.dominance(results, (0.4,))[0]["met"] is True
    row = rok.dominance(results, (0.4,), memory="reserved_bytes")[0]
    assert row["ssdtier"] is None and row["other"] == "checkpoint" and row["met"] is False
    assert "at each share of keep's reserved memory" in rok.render_dominance([row], memory="reserved memory")


# ---------------------------------------------------------------- said before any run


@pytest.fixture
def no_run(monkeypatch):
    """cmd_rok may not get as far as running a setting."""
    monkeypatch.setattr(rok, "run_rounds", lambda *a, **k: pytest.fail("ran before refusing"))


def test_an_output_directory_that_cannot_be_written_is_said_first(tmp_path, no_run):
    # Found only at the end, once every setting had run: the results were lost.
    taken = tmp_path / "taken"
    (taken / "rok.csv").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"--out: .*rok\.csv is a directory"):
        rok.cmd_rok(parse("--device", "cpu", "--out", str(taken)))
    plain = tmp_path / "plain"
    plain.write_text("x")
    for out in (plain, plain / "sub"):
        with pytest.raises(ConfigError, match="--out: ") as e:
            rok.cmd_rok(parse("--device", "cpu", "--out", str(out)))
    assert str(e.value) == f"command line: --out: cannot write in {plain / 'sub'}: Not a directory"
    with pytest.raises(ConfigError, match=f"--out: {plain} is a file, not a directory"):
        rok.cmd_rok(parse("--device", "cpu", "--out", str(plain)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_a_read_only_output_directory_is_said_first(tmp_path, no_run):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match=f"--out: cannot write in {locked}: Permission denied"):
            rok.cmd_rok(parse("--device", "cpu", "--out", str(locked)))
    finally:
        locked.chmod(0o700)


def test_fit_options_are_checked_before_the_side_by_side_run(tmp_path, no_run):
    out = ["--device", "cpu", "--out", str(tmp_path)]
    for argv, said in [
        (["--memory-cap", "1GiB"], "--memory-cap needs --fit"),
        (["--fit", "--memory-cap", "lots"], "--memory-cap"),
        (["--fit", "--memory-cap", "0"], "--memory-cap must be more than 0, got 0"),
        (["--fit-modes", "keep"], "--fit-modes needs --fit"),
        (["--modes", "keep,ssdtier", "--fit", "--memory-cap", "1GiB", "--fit-modes", "keep,checkpoint"],
         "--fit-modes checkpoint: not in --modes (keep,ssdtier)"),
        (["--fit", "--memory-cap", "1GiB", "--fit-modes", "ssdtier-compile"],
         "--fit-modes ssdtier-compile needs --ssdtier-compile BUDGETS"),
        (["--modes", "keep,checkpoint", "--ssdtier-compile", "0.5"], "--modes must include ssdtier"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(said)):
            rok.cmd_rok(parse(*out, *argv))
    # Keep always runs, so it may be searched without being named in --modes.
    rok.check_rok_args(parse("--modes", "ssdtier", "--fit", "--memory-cap", "1GiB", "--fit-modes", "keep"), TINY)


def test_workload_values_are_checked_before_any_worker(monkeypatch, capsys):
    for dropout in ("1", "-0.1"):
        with pytest.raises(ConfigError, match=re.escape(f"--dropout must be in [0, 1), got {float(dropout):g}")):
            train_cli.workload_of(parse("--device", "cpu", "--dropout", dropout))
    # --warmup 0: the first step's one-time allocations landed in the peak; negatives were clamped.
    for argv, said in [
        (["--warmup", "0"], "argument --warmup: must be a positive integer, got '0'"),
        (["--warmup", "-1"], "argument --warmup: must be a positive integer, got '-1'"),
        (["--budget-s", "0"], "argument --budget-s: must be a positive number of seconds, got '0'"),
        (["--budget-s", "-5"], "argument --budget-s: must be a positive number of seconds, got '-5'"),
    ]:
        with pytest.raises(SystemExit):
            parse(*argv)
        assert said in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.models.auto", None)
    with pytest.raises(ConfigError, match=r"--hf needs transformers: pip install 'ssdtier\[hf\]'"):
        train_cli.workload_of(parse("--device", "cpu", "--hf", "llama"))


def test_an_unknown_hf_model_type_is_said_once_with_the_nearest():
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=r"--hf 'lama': not a transformers model type .*; did you mean 'llama'\?"):
        train_cli.workload_of(parse("--device", "cpu", "--hf", "lama"))
    assert train_cli.workload_of(parse("--device", "cpu", "--hf", "gpt2")).hf == "gpt2"


def test_dominance_without_ssdtier_in_the_run_says_dash_not_no():
    results = [result("keep", "keep", 100, 10.0), result("checkpoint", "checkpoint", 20, 13.0)]
    rows = rok.dominance(results)
    assert [d["met"] for d in rows] == [None] * len(rok.DOMINANCE_FRACTIONS)
    text = rok.render_dominance(rows)
    assert "NO" not in text and "(not in the run)" in text, text


def test_keep_out_of_time_is_an_error_and_writes_no_plot(tmp_path, monkeypatch):
    from ssdtier.bench.train import OUT_OF_TIME

    def late(settings, w, *a):
        return [train.failed(s, w, "skipped", OUT_OF_TIME) for s in settings]

    monkeypatch.setattr(rok, "run_rounds", late)
    with pytest.raises(ConfigError, match="--budget-s 0.5 ran out before keep, the first setting, started"):
        rok.cmd_rok(parse("--device", "cpu", "--modes", "keep,ssdtier", "--budget-s", "0.5", "--out", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []
    # No setting ran to the end (keep failed, say): no empty plot, whose legend matplotlib warns of.
    files = [tmp_path / "rok.csv"]
    assert (
        rok._plot(tmp_path, late([Setting(Mode.KEEP)], TINY), TINY, files)
        == "\n(no rok.png: no setting ran to the end)"
    )
    assert files == [tmp_path / "rok.csv"] and list(tmp_path.iterdir()) == []
