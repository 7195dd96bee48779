"""benches/gpu_step.py without a GPU: options, batch search, report, and every mode end to end
on the CPU (``DEVICE = "cpu"``, torch.cuda's memory counters stubbed), so that the script
cannot rot between the rare runs on a GPU machine."""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ssdtier.bench.models import build_model

BENCHES = Path(__file__).resolve().parents[1] / "benches"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "2"]
TINY += ["--steps", "1", "--warmup", "1", "--min-tensor-bytes", "0", "--keep-last-layers", "0"]


@pytest.fixture
def gs(monkeypatch):
    """The bench module, imported from its path (benches/ is not a package)."""
    monkeypatch.syspath_prepend(str(BENCHES))  # for its `import _machine`
    spec = importlib.util.spec_from_file_location("gpu_step", BENCHES / "gpu_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def on_cpu(gs, monkeypatch):
    """Modes run on the CPU; torch.cuda's synchronize and memory counters are stubs."""
    monkeypatch.setattr(gs, "DEVICE", "cpu")
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    props = SimpleNamespace(name="fake GPU", total_memory=80 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo
    gc.freeze()  # the bench collects garbage between modes: only the new objects get scanned
    yield gs
    gc.unfreeze()
    torch.set_num_threads(threads)


def test_defaults_are_the_1b_model_and_quick_is_small(gs):
    a = gs.parse_args([])
    assert (a.layers, a.d_model, a.heads, a.seq, a.vocab, a.batch) == (24, 2048, 16, 2048, 32000, "auto")
    assert a.dtype == "bf16" and a.modes == gs.MODES and a.budget_s == 540
    assert 0.9e9 < gs.param_count(a) < 1.5e9
    small = gs.parse_args(TINY)
    built = sum(p.numel() for p in build_model(gs.gpt_config(small, False)).parameters())
    assert gs.param_count(small) == built
    q = gs.parse_args(["--quick", "--layers", "2"])
    assert (q.layers, q.d_model, q.batch, q.nvme_arena) == (2, 512, 8, "64MiB")
    assert gs.parse_args(["--modes", "checkpoint,ssdtier_nvme"]).modes == ("keep", "checkpoint", "ssdtier_nvme")
    for bad in (["--modes", "nope"], ["--batch", "x"], ["--warmup", "0"], ["--d-model", "100", "--heads", "3"]):
        with pytest.raises(SystemExit):
            gs.parse_args(bad)


def test_host_capacity_follows_keep_within_ram(gs):
    a = gs.parse_args([])
    assert gs.host_capacity(a, 10 << 30, 128 << 30) == (15 << 30, "1.5 x keep's activations")
    got, why = gs.host_capacity(a, 100 << 30, 128 << 30)
    assert got <= 0.6 * (128 << 30) and "capped" in why
    assert gs.host_capacity(gs.parse_args(["--host-capacity", "3GiB"]), 1, 1)[0] == 3 << 30
    got, why = gs.host_capacity(a, 100 << 30, 128 << 30, 40 << 30)  # a sandbox's RAM less its caches
    assert got == 30 << 30 and why.endswith("capped at what ssdtier pins of the RAM available")


def test_adaptive_gets_the_host_tier_and_the_disk(gs, monkeypatch, tmp_path):
    monkeypatch.setattr(gs, "nvme_capacity", lambda args: 38 << 30)
    monkeypatch.setattr(gs, "mem_total", lambda: 128 << 30)
    monkeypatch.setattr(gs, "mem_available", lambda: 100 << 30)
    a, notes = gs.parse_args(["--dir", str(tmp_path)]), {}
    cfg = {m: gs.ssd_for(m, a, 10 << 30, notes) for m in ("ssdtier_host", "ssdtier_adaptive", "ssdtier_nvme")}
    assert cfg["ssdtier_adaptive"]["host"] == cfg["ssdtier_host"]["host"] == {"capacity": 15 << 30}
    assert cfg["ssdtier_adaptive"]["nvme"] == cfg["ssdtier_nvme"]["nvme"]
    assert (
        cfg["ssdtier_adaptive"]["policy"] == {"mode": "adaptive", "device_budget": "auto"}
        and cfg["ssdtier_nvme"]["host"]["capacity"] == 2 << 30
    )


def test_nvme_batch_fits_the_disk(gs):
    ssd = gs.ssdtier_config(gs.parse_args([]), 2 << 30, 38 << 30)  # 40 GiB of room
    assert gs.nvme_batch(gs.parse_args([]), 4, 32 << 30, ssd) == (4, "")
    b, why = gs.nvme_batch(gs.parse_args([]), 4, 64 << 30, ssd)  # 16 GiB per sample
    assert b == 2 and "not 4" in why
    assert gs.nvme_batch(gs.parse_args(["--nvme-batch", "3"]), 4, 64 << 30, ssd)[0] == 3
    assert gs.nvme_batch(gs.parse_args([]), 4, None, ssd) == (4, "")
    # 8 GiB a sample each way at 1 GB/s write, 2 GB/s read: 12.9 s a sample; 30 s allow 2.
    fio = {"status": "ok", "write": 1e9, "read": 2e9}
    b, why = gs.nvme_batch(gs.parse_args([]), 4, 32 << 30, ssd, fio)
    assert b == 2 and "over 30.0 s" in why
    assert gs.nvme_batch(gs.parse_args(["--disk-step-s", "100"]), 4, 32 << 30, ssd, fio) == (4, "")
    # The arena holds keep's activations (the adaptive mode): little reaches NVMe, no cut.
    big = gs.ssdtier_config(gs.parse_args([]), 40 << 30, 38 << 30)
    assert gs.nvme_batch(gs.parse_args([]), 4, 32 << 30, big, fio) == (4, "")


def test_tmpfs_dir_is_refused(gs):
    from ssdtier.paths import is_tmpfs

    if not is_tmpfs("/dev/shm"):
        pytest.skip("/dev/shm is not tmpfs here")
    with pytest.raises(gs.BenchError, match="tmpfs"):
        gs.check_dir(Path("/dev/shm/gpu_step-test"))


def fake_run(mode, act, step, status="ok", batch=4, reserved=None, **extra):
    r = {"mode": mode, "status": status, "batch": batch}
    if status == "ok":
        r.update(peak_bytes=act + (20 << 30), act_bytes=act, median_step_s=step, tokens_per_s=1000.0)
        r.update(reserved_act_bytes=act + (1 << 30) if reserved is None else reserved)
        r.update(losses=["0x1.0p+0", "0x1.1p+0"], **extra)
    else:
        r["error"] = extra.get("error", "")
    return r


def fake_results(gs):
    args = gs.args_dict(gs.parse_args(["--quick"]))
    machine = {
        "hostname": "h", "gpu": "H100", "gpu_memory": 80 << 30, "torch": "2.11", "cuda": "12.8", "python": "3.12",
        "cpu": "x", "nproc": 16, "kernel": "6", "mem_total": 128 << 30, "dir": "/d", "disk_free": 50 << 30,
        "mount": {"device": "/dev/nvme0n1p1", "fstype": "ext4"},
    }  # fmt: skip
    nvme = {
        "per_step": {"nvme_written": 4e9, "nvme_read": 4e9, "offloaded": 4e9, "stall_s": 0.1, "failed_writes": 0},
        "nvme_write_bps": 2e9, "nvme_read_bps": 3e9, "offload": {"store": {"host_peak": 1, "nvme_peak": 2}},
    }  # fmt: skip
    modes = {
        "keep": fake_run("keep", 40 << 30, 1.0),
        "ssdtier_nvme": fake_run("ssdtier_nvme", 5 << 30, 0.51, batch=2, **nvme),  # per sample as below
        "checkpoint": fake_run("checkpoint", 8 << 30, 1.3),
        "save_on_cpu": fake_run("save_on_cpu", 0, 0, status="OOM", error="CUDA out of memory"),
        "torchtune": fake_run("torchtune", 0, 0, status="not installed", error="not installed (ImportError)"),
    }
    fio = {"status": "ok", "bytes": 1 << 30, "block": 1 << 20, "depth": 64, "write": 4e9, "read": 6e9}
    modes["ssdtier_nvme"]["plan"] = "ssdtier plan: keep the last 3 of 24 layers; why\n  host tier 2GiB; more\n  layer"
    copy = {"status": "ok", "bytes_per_s": 20e9}
    res = {"machine": machine, "args": args, "params": 1.3e9, "modes": modes, "fit": {}, "batch": 4, "fio": fio}
    return {**res, "copy": copy}


def test_report_has_ratios_goal_and_failures(gs):
    res = fake_results(gs)
    gs.compare(SimpleNamespace(compare_losses=2, deterministic=False, attention="plain"), res)
    text = gs.render_steps(res)
    assert re.search(r"\| save_on_cpu +\| +OOM \|", text) and re.search(r"\| torchtune +\| +not installed \|", text)
    assert re.search(r"\| +0\.250 \|", text)  # ssdtier_nvme's activations / keep's
    assert "4.0 + 4.0" in text and "2.00 / 3.00" in text
    assert "ssdtier_nvme: at fio's rates its NVMe bytes take 1.00 of its median step (writes 0.50, reads 0.50)" in text
    assert "(a row at another batch than keep's: its activations and step time x keep are per sample)" in text
    assert "goal: activations <= 0.3 of keep" in text
    assert "8 heads (sdpa attention)" in text
    assert "ssdtier_nvme MET (0.293, 1.020)" in text and "checkpoint NOT MET" in text  # reserved: 6/41 per sample
    assert "ssdtier_nvme: ssdtier plan: keep the last 3 of 24 layers; why\nssdtier_nvme: host tier 2GiB; more\n" in text
    # 40 GiB in a third of 1 s need 129 GB/s; 20 GB/s moves 0.16 of them.
    assert "copies GPU <-> pinned host: 20.0 GB/s" in text and "need 129 GB/s: at most 0.16 of them" in text
    json.dumps(res)


def test_reserved_memory_is_split_by_the_stream_it_was_reserved_for(gs, monkeypatch):
    monkeypatch.setattr(gs, "DEVICE", "cuda")
    stream = lambda handle: SimpleNamespace(cuda_stream=handle)  # noqa: E731
    off = SimpleNamespace(
        cuda=SimpleNamespace(streams={"cuda:0": (stream(11), stream(12))}), cpu=SimpleNamespace(side={})
    )
    segments = [
        {"stream": 0, "total_size": 8 << 30, "allocated_size": 5 << 30, "active_size": 6 << 30},
        {"stream": 12, "total_size": 2 << 30, "allocated_size": 0},
        {"stream": 0, "total_size": 1 << 30, "allocated_size": 1 << 30},
        {"stream": 99, "total_size": 1 << 30, "allocated_size": 1 << 30},
    ]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream(0))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **k: segments)
    by = gs.reserved_by_stream(off)
    assert by == {
        "compute": {"reserved": 9 << 30, "allocated": 6 << 30, "awaiting": 1 << 30},
        "ssdtier prefetch": {"reserved": 2 << 30, "allocated": 0, "awaiting": 0},
        "other streams": {"reserved": 1 << 30, "allocated": 1 << 30, "awaiting": 0},
    }
    res = fake_results(gs)
    res["modes"]["ssdtier_nvme"]["reserved_by_stream"] = by
    text = gs.render_steps(res)
    assert (
        "ssdtier_nvme: reserved GiB by stream after its steps: compute 9.00 (2.00 free, 1.00 awaiting other streams), "
        "ssdtier prefetch 2.00 (2.00 free), other streams 1.00 (0.00 free)" in text
    )


def test_the_header_names_the_allocator_settings(gs, monkeypatch):
    res = fake_results(gs)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in gs.render_steps(res)
    res["machine"]["alloc_conf"] = "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in gs.render_steps(res)


def test_the_goal_counts_blocks_still_being_copied_out(gs):
    # Allocated: a quarter of keep's activations; reserved, with the sources whose copies to
    # host memory were still queued: 0.6 of keep's.
    res = fake_results(gs)
    r = res["modes"]["ssdtier_nvme"]
    r.update(batch=4, median_step_s=1.0, act_bytes=10 << 30, reserved_act_bytes=24 << 30)
    gs.compare(SimpleNamespace(compare_losses=2, deterministic=False, attention="plain"), res)
    assert res["modes"]["ssdtier_nvme"]["reserved_act_vs_keep"] == pytest.approx(24 / 41)
    assert "ssdtier_nvme NOT MET (0.585, 1.000)" in gs.render_steps(res)


def test_each_phase_has_its_own_peak_and_the_step_the_largest(gs, monkeypatch):
    # The allocator's counters as a script: (allocated now, its peak, reserved's peak) per lap.
    laps = iter([(30, 50, 60), (25, 45, 70), (20, 30, 70), (32, 52, 61), (26, 40, 72), (20, 31, 72)])
    monkeypatch.setattr(gs, "DEVICE", "cpu")
    monkeypatch.setattr(gs.Phases, "_memory", staticmethod(lambda: next(laps)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    ph = gs.Phases()
    for _ in range(2):
        ph.begin()
        for _ in gs.Phases.NAMES:
            ph.lap()
        ph.end()
    assert ph.peak == (52, 72)
    got = ph.summary(base=10)
    assert (got["forward_peak_bytes"], got["backward_peak_bytes"], got["optimizer_peak_bytes"]) == (42, 35, 21)
    assert (got["forward_reserved_bytes"], got["backward_reserved_bytes"]) == (51, 62)
    assert got["held_at_forward_end_bytes"] == 22 and got["forward_s"] >= 0
    assert got["forward_host_s"] >= 0 and got["backward_host_s"] >= 0
    res = {"keep": {"status": "ok", "phases": got}, "save_on_cpu": {"status": "OOM"}}
    text = "\n".join(gs.render_phases(res))
    assert "Where a step goes" in text and "save_on_cpu" not in text
    host = f"{got['forward_host_s']:.3f} / {got['backward_host_s']:.3f}"
    assert re.search(rf"\| keep +\|.*\| +{re.escape(host)} \|", text), text


def test_allocations_retried_under_memory_pressure_are_said(gs, monkeypatch):
    from ssdtier.bench.memory import CudaPeak

    retries = iter([5, 11])  # at start(), at stop()
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: {"num_alloc_retries": next(retries)})
    probe = CudaPeak("cuda")
    probe.start()
    probe.stop()
    assert probe.retries == 6
    res = fake_results(gs)
    res["modes"]["ssdtier_nvme"]["alloc_retries_per_step"] = probe.retries / 3
    gs.compare(SimpleNamespace(compare_losses=2, deterministic=False, attention="plain"), res)
    text = gs.render_steps(res)
    assert "allocations retried per step after emptying the cache (each waits for the GPU): ssdtier_nvme 2.0" in text
    assert "keep 0" not in text  # modes without retries are not listed


def test_fio_falls_back_to_psync_where_io_uring_is_refused(gs, monkeypatch, tmp_path):
    from ssdtier.bench import disk
    from ssdtier.errors import SsdtierError

    def fake(fio, path, rw, size, block, depth, extra=()):
        if "--ioengine=io_uring" in extra:
            raise SsdtierError("fio failed: io_uring_queue_init: Function not implemented")
        return {"bw_bytes": 1e9 if rw == "write" else 2e9, "cmd": ["fio", *extra]}

    monkeypatch.setattr(disk, "run_fio", fake)
    monkeypatch.setattr(gs.shutil, "which", lambda name: "/usr/bin/fio")
    got = gs.fio_bandwidth(gs.parse_args(["--dir", str(tmp_path), "--quick"]))
    assert got["status"] == "ok" and got["engine"] == "psync" and (got["write"], got["read"]) == (1e9, 2e9)
    res = {**fake_results(gs), "fio": got}
    assert "fio on --dir (0.25 GiB, psync, O_DIRECT" in gs.render_steps(res)


def test_fused_attention_compares_only_the_first_loss(gs):
    # Its backward is not bitwise reproducible: from the second step on every mode's weights
    # differ from keep's, ssdtier or not.
    res = fake_results(gs)
    res["modes"]["checkpoint"]["losses"][1] = "0x1.2p+0"
    gs.compare(SimpleNamespace(compare_losses=2, deterministic=False, attention="sdpa"), res)
    assert res["losses_compared"] == 1 and res["modes"]["checkpoint"]["losses_equal_keep"]
    assert "(losses: only the first 1 compared" in gs.render_steps(res)
    gs.compare(SimpleNamespace(compare_losses=2, deterministic=True, attention="sdpa"), res)
    assert res["losses_compared"] == 2 and not res["modes"]["checkpoint"]["losses_equal_keep"]


def test_losses_at_another_batch_are_not_compared(gs):
    res = fake_results(gs)
    res["modes"]["checkpoint"]["batch"] = 1
    gs.compare(SimpleNamespace(compare_losses=1, deterministic=False, attention="sdpa"), res)
    assert res["modes"]["checkpoint"]["losses_equal_keep"] is None
    assert re.search(r"\| checkpoint +\| +1 \|.*\| +- \|", gs.render_steps(res))


def test_stats_deltas_leave_the_plan_as_it_is(gs):
    before = {"packs": 2, "store": {"host_peak": 9, "nvme_written": 1}, "plan": {"keep_last": 3}}
    after = {"packs": 5, "store": {"host_peak": 9, "nvme_written": 4}, "plan": {"keep_last": 3}}
    assert gs.delta(after, before) == {
        "packs": 3,
        "store": {"host_peak": 9, "nvme_written": 3},
        "plan": {"keep_last": 3},
    }


def test_fit_report_has_the_rok_view(gs):
    res = fake_results(gs)

    def probes(*pairs):
        return [{"batch": b, "fits": s is not None, "s_per_sample": s, "peak_bytes": 1 << 30} for b, s in pairs]

    res["fit"] = {
        "keep": {"status": "ok", "largest": 4, "failed": 5, "probes": probes((1, 0.3), (2, 0.25), (4, 0.2), (5, None))},
        "ssdtier_host": {"status": "ok", "largest": 16, "failed": 17, "probes": probes((4, 0.205), (16, 0.3))},
        "checkpoint": {"status": "ok", "largest": 64, "failed": None, "cut": True, "probes": probes((64, 0.27))},
    }
    for r in res["fit"].values():
        r["at_largest"] = next(p for p in r["probes"] if p["batch"] == r["largest"])
    res["fit"]["ssdtier_host"]["at_largest"].update(
        reserved_by_stream={"compute": {"reserved": 3 << 30, "allocated": 0}}, steps=2, alloc_retries=1
    )
    res["fit"]["ssdtier_host"]["probes"][0]["layers_kept"] = 2
    res["rok_reference_s_per_sample"] = gs.rok(res["fit"], 1.05)
    assert res["rok_reference_s_per_sample"] == 0.2
    assert [res["fit"][m]["rok_batch"] for m in ("keep", "ssdtier_host", "checkpoint")] == [4, 4, 0]
    text = gs.render_fit(res)
    assert "ROK: largest micro-batch at <= 1.05x keep's time per sample: keep 4, ssdtier_host 4, checkpoint 0" in text
    assert re.search(r"\| checkpoint +\| +64 \(cut\) \|", text)
    assert (
        "ssdtier_host: reserved GiB by stream at its largest batch: compute 3.00 (3.00 free); "
        "allocations retried over its 2 steps: 1"
    ) in text
    assert "ssdtier_host: layers kept at the end of each probe (batch: layers): 4: 2" in text


def test_every_mode_runs_on_the_cpu(on_cpu, store_dir, monkeypatch, capsys):
    gs = on_cpu
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    monkeypatch.setattr(gs, "torchtune_maker", lambda: (lambda model: hooks, "stand-in hooks"))
    out = store_dir / "r.json"
    argv = [*TINY, "--dir", str(store_dir / "nvme"), "--nvme-arena", "0", "--no-fio", "--json", str(out)]
    assert gs.main(argv) == 0
    res = json.loads(out.read_text())
    for mode in gs.MODES:
        assert res["modes"][mode]["status"] == "ok", res["modes"][mode]
        assert res["modes"][mode]["losses_equal_keep"], mode
    assert res["modes"]["ssdtier_nvme"]["per_step"]["nvme_written"] > 0  # (on the CPU, ssdtier_host's too: zero copy)
    assert res["modes"]["ssdtier_adaptive"]["store"]["policy"]["mode"] == "adaptive"
    assert res["modes"]["ssdtier_adaptive"]["plan"].startswith("ssdtier plan: ")  # its table, whatever the planner
    assert res["args"]["attention"] == "sdpa"  # flash attention, as LLM training uses
    assert res["modes"]["ssdtier_nvme"]["store"]["policy"].get("mode", "all") == "all"
    assert all(r["alloc_retries_per_step"] == 0 for r in res["modes"].values())  # no CUDA allocator here
    phases = res["modes"]["ssdtier_host"]["phases"]
    assert phases["forward_s"] > 0 and phases["backward_s"] > 0 and phases["optimizer_s"] > 0
    # ssdtier's own INFO lines are in the log, during the run only.
    assert " ssdtier plan: " in capsys.readouterr().err
    assert not logging.getLogger("ssdtier").handlers


def test_a_slow_mode_gets_its_share_of_the_time_not_all(on_cpu, store_dir, monkeypatch):
    gs = on_cpu
    clock = [0.0]
    monkeypatch.setattr(gs.time, "monotonic", lambda: clock[0])
    step = gs.Setup.step

    def slow(self, batch):  # 1 s a step; ssdtier_nvme's 100 s, past its share (a third of 396 s)
        clock[0] += 100.0 if self.mode == "ssdtier_nvme" else 1.0
        return step(self, batch)

    monkeypatch.setattr(gs.Setup, "step", slow)
    out = store_dir / "r.json"
    argv = [*TINY, "--dir", str(store_dir / "nvme"), "--no-fio", "--json", str(out), "--budget-s", "400"]
    argv += ["--modes", "keep,ssdtier_nvme,ssdtier_adaptive,ssdtier_cufile", "--steps", "3"]
    assert gs.main(argv) == 0
    runs = json.loads(out.read_text())["modes"]
    assert len(runs["keep"]["step_seconds"]) == 3
    assert len(runs["ssdtier_nvme"]["step_seconds"]) == 1 and "over its share" in runs["ssdtier_nvme"]["note"]
    assert len(runs["ssdtier_adaptive"]["step_seconds"]) == len(runs["ssdtier_cufile"]["step_seconds"]) == 3


def test_fit_on_the_cpu_with_a_fake_memory_limit(on_cpu, store_dir, monkeypatch):
    gs = on_cpu
    step = gs.Setup.step
    limit = {"keep": 3, "ssdtier_nvme": 4}  # samples that "fit"; save_on_cpu: any, but the RAM bounds it

    def limited(self, batch):
        if batch[0].shape[0] > limit.get(self.mode, 100):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return step(self, batch)

    monkeypatch.setattr(gs.Setup, "step", limited)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 << 30)  # keep: 1 GiB per sample
    monkeypatch.setattr(gs, "mem_available", lambda: 6 << 30)  # save_on_cpu: at most 0.7 x 6 GiB / 1 GiB
    out = store_dir / "fit.json"
    argv = [*TINY, "--fit", "--fit-steps", "1", "--fit-max-batch", "8", "--dtype", "fp32"]
    argv += ["--modes", "save_on_cpu,ssdtier_nvme,ssdtier_adaptive", "--nvme-arena", "1MiB"]
    argv += ["--fit-slow", "1e6"]  # off: CPU times vary
    assert gs.main([*argv, "--dir", str(store_dir / "nvme"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    fit = res["fit"]
    assert list(fit) == ["keep", "ssdtier_adaptive", "save_on_cpu", "ssdtier_nvme"]  # the likeliest first
    got = [(fit[m]["largest"], fit[m]["failed"]) for m in ("keep", "save_on_cpu", "ssdtier_nvme")]
    assert got == [(3, 4), (4, None), (4, 5)]
    assert fit["save_on_cpu"]["max_batch"] == 4 and fit["keep"]["rok_batch"] == 3
    assert fit["ssdtier_adaptive"]["store"]["policy"]["device_budget"] == "auto"
    # Adaptive mode's timed step runs the plan made at its batch: 2 steps more per probe.
    steps = [(p["batch"], p["steps"]) for p in fit["ssdtier_adaptive"]["probes"] if p["fits"]]
    assert steps[0] == (1, 4) and all(n == 3 for _, n in steps[1:]), steps
    assert all(p["alloc_retries"] == 0 and "layers_kept" in p for p in fit["ssdtier_adaptive"]["probes"] if p["fits"])
    assert all(p["steps"] in (1, 2) for p in fit["ssdtier_nvme"]["probes"] if p["fits"])


def test_fit_bisects_the_rok_boundary_and_stops_growing_when_slow(on_cpu, store_dir, monkeypatch):
    gs = on_cpu
    step = gs.Setup.step

    def timed(self, batch):  # keep: 1 s a sample up to 4; the host mode: as fast up to 6, then 20x
        b = batch[0].shape[0]
        if self.mode == "keep" and b > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        _, loss = step(self, batch)
        return (b * (20.0 if self.mode == "ssdtier_host" and b > 6 else 1.0), loss)

    monkeypatch.setattr(gs.Setup, "step", timed)
    out = store_dir / "fit.json"
    argv = [*TINY, "--fit", "--fit-steps", "3", "--fit-max-batch", "64", "--dtype", "fp32", "--modes", "ssdtier_host"]
    assert gs.main([*argv, "--dir", str(store_dir / "nvme"), "--json", str(out), "--md", str(store_dir / "f.md")]) == 0
    host = json.loads(out.read_text())["fit"]["ssdtier_host"]
    assert [p["batch"] for p in host["probes"]] == [1, 2, 4, 8, 6, 7]  # no 16: 8 ran 20x keep
    assert [p["steps"] for p in host["probes"]] == [4, 3, 3, 1, 3, 1]  # a slow step ends its probe
    assert (host["largest"], host["slow"], host["cut"], host["rok_batch"]) == (8, True, False, 6)
    assert re.search(r"\| ssdtier_host +\| +8 \(slow\) \|", (store_dir / "f.md").read_text())


def test_fit_tries_the_first_step_of_adaptive_mode_once_more(on_cpu, store_dir, monkeypatch):
    # Its budget was learned at the batch before: a first step out of memory is retried once.
    gs = on_cpu
    step = gs.Setup.step
    tried = set()

    def first_step_fails(self, batch):
        b = batch[0].shape[0]
        if b > 2 and (self.mode, b) not in tried:
            tried.add((self.mode, b))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return step(self, batch)

    monkeypatch.setattr(gs.Setup, "step", first_step_fails)
    out = store_dir / "fit.json"
    argv = [
        *TINY,
        "--fit",
        "--fit-steps",
        "1",
        "--fit-max-batch",
        "4",
        "--dtype",
        "fp32",
        "--fit-slow",
        "1e6",
    ]  # off: CPU times vary
    argv += ["--modes", "ssdtier_adaptive", "--dir", str(store_dir / "nvme"), "--json", str(out)]
    assert gs.main(argv) == 0
    fit = json.loads(out.read_text())["fit"]
    assert (fit["keep"]["largest"], fit["ssdtier_adaptive"]["largest"]) == (2, 4)
    (retried,) = [p for p in fit["ssdtier_adaptive"]["probes"] if p.get("first_step_out_of_memory")]
    assert retried["batch"] == 4 and retried["fits"]


def test_without_cuda_it_says_so(gs, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gs.main(["--quick"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_torchtune_offloading_module_loads_alone(gs, tmp_path, monkeypatch):
    """torchtune's package imports its datasets (pandas, pyarrow...); its offloading module is
    then run by itself, with its output head given as torchtune's recipes have it."""
    pkg = tmp_path / "torchtune"
    (pkg / "training").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import datasets_not_here\n")
    (pkg / "training" / "_activation_offloading.py").write_text(
        "from torchtune.modules import TiedLinear\n"
        "from torchtune.utils import get_logger\n"
        "log = get_logger('DEBUG')\n"
        "def get_act_offloading_ctx_manager(model, enable):\n"
        "    assert not isinstance(model.output, TiedLinear)\n"
        "    return ('ctx', model.output, enable)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    maker, what = gs.torchtune_maker()
    assert maker is not None and "offloading module alone" in what, what
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(2, 2)
    assert maker(model) == ("ctx", model.lm_head, True)
    assert "torchtune" not in sys.modules  # the stand-ins are gone


def test_without_torchtune_the_mode_says_why(gs):
    maker, what = gs.torchtune_maker()
    assert maker is None and "torchtune" in what
