"""The benchmark scripts run end to end on a tiny model (what they print is checked for
shape, never for speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"
TINY = ["--layers", "2", "--d-model", "32", "--seq", "16", "--batch", "2", "--heads", "2", "--vocab", "64"]


def run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHES / script), *args], capture_output=True, text=True, timeout=timeout
    )


def test_train_step_runs_every_mode_and_reports_ratios(store_dir):
    p = run(
        "train_step.py",
        *TINY,
        "--dir",
        str(store_dir),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--min-tensor-bytes",
        "0",
        "--keep-last-layers",
        "0",
        "--prefetch-layers",
        "auto",
        "--skip-io-floor",
        "--pt-layers",
        "4",
        "--pt-reps",
        "2",
        "--pt-warmup",
        "1",
        "--json",
        str(store_dir / "out.json"),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for mode in ("keep", "ssdtier", "checkpoint", "save_on_cpu"):
        assert f"| {mode}" in out, out
    assert "from 1st fwd (MB)" in out and "peak, mmap64K (MB)" in out
    assert "losses identical: yes" in out
    assert "us per saved tensor (pack+unpack)" in out
    assert "goal (CPU):" in out
    assert (store_dir / "out.json").stat().st_size > 0


def test_train_step_refuses_an_allocator_it_cannot_find(store_dir):
    p = run("train_step.py", "--dir", str(store_dir), "--malloc", str(store_dir / "no-such-malloc.so"))
    assert p.returncode == 2
    assert "--malloc" in p.stderr and "no such file" in p.stderr


def test_per_tensor_only(store_dir):
    p = run("train_step.py", "--dir", str(store_dir), "--per-tensor-only", "--pt-layers", "4", "--pt-reps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ssdtier-arena:" in p.stdout and "save_on_cpu:" in p.stdout and "view_floor:" in p.stdout


def test_heap_trace_prints_every_block_boundary(store_dir):
    p = run("heap_trace.py", "--mode", "ssdtier", *TINY, "--dir", str(store_dir), "--steps", "1", "--warmup", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    for row in ("start", "fwd 0", "fwd 1", "fwd end", "bwd 1", "bwd 0", "bwd end"):
        assert f"\n{row} " in p.stdout, p.stdout
    p = run("heap_trace.py", "--mode", "nope")
    assert p.returncode == 2 and "--mode must be keep or ssdtier" in p.stderr


def test_store_bandwidth_both_engines(store_dir):
    p = run(
        "store_bandwidth.py",
        "--dir",
        str(store_dir),
        "--size",
        "8MiB",
        "--tensor",
        "1MiB",
        "--arena",
        "2MiB",
        "--repeat",
        "1",
        "--no-fio",
        "--backend",
        "all",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for row in ("io_uring  write", "io_uring  read", "posix     write", "posix     read"):
        assert row in p.stdout, p.stdout
    assert "read amplification 1.00x" in p.stdout


def _hook_profile():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hook_profile", BENCHES / "hook_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hook_profile_charges_samples_to_the_hook_torch_called():
    hp = _hook_profile()
    step = "<module> (hook_profile.py:9);child.<locals>.ssdtier_steps (hook_profile.py:99);forward (x.py:1)"
    raw = "\n".join(
        [
            f"{step};Offloader._pack (ssdtier/offload/offloader.py:260);Saved.__init__ (ssdtier/offload/entry.py:5) 30",
            f"{step};Offloader._unpack (ssdtier/offload/offloader.py:400) 20",
            f"{step};Saved.__del__ (ssdtier/offload/entry.py:9);Offloader._release (ssdtier/offload/offloader.py:5) 10",
            f"{step};addmm (torch/x.py:3) 40",  # torch's own work: counted in the total only
            "<module> (hook_profile.py:9);child.<locals>.plain_steps (hook_profile.py:90) 500",  # not ssdtier's steps
        ]
    )
    total, by_entry, by_inner = hp.attribute(raw)
    assert total == 100
    assert by_entry == {"pack": 30, "unpack": 20, "release": 10}
    assert by_inner[("pack", "Saved.__init__")] == 30 and by_inner[("release", "Offloader._release")] == 10
    t = {"plain_s": 0.010, "ssdtier_s": 0.016, "ssdtier_mean_s": 0.016, "saved_per_step": 100}
    text = hp.report({**t, "offloaded_per_step": 50, "steps": 3}, total, by_entry, by_inner)
    # 16 ms / 100 saved = 160 us of a step per saved tensor; pack had 30% of it.
    assert "| pack | 48.00 | 30.0% |" in text and "ssdtier over plain: 60.00 us" in text
    assert "| outside any ssdtier frame (hook calls, handles freed, caches) | -36.00 |" in text


def test_hook_profile_child_times_plain_and_ssdtier(store_dir, tmp_path):
    import json

    out = tmp_path / "t.json"
    p = run(
        "hook_profile.py",
        "--child",
        str(out),
        "--mode",
        "zero-copy",
        "--dir",
        str(store_dir),
        "--layers",
        "4",
        "--steps",
        "2",
        "--warmup",
        "1",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    t = json.loads(out.read_text())
    assert t["saved_per_step"] == 12 and t["offloaded_per_step"] >= 4 and t["ssdtier_s"] > 0


def test_fork_cost_starts_workers_with_and_without_ssdtier(store_dir):
    p = run("fork_cost.py", "--reps", "1", "--workers", "1", "--arena", "64MiB", "--dir", str(store_dir))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith(("plain ", "ssdtier "))]
    assert [r[0] for r in rows] == ["plain", "ssdtier"] and all(len(r) == 5 for r in rows), p.stdout
    assert float(rows[0][2]) == 1.0 and float(rows[1][3]) > 0, p.stdout


def test_soak_samples_every_book_of_the_offloader(store_dir):
    p = run("soak.py", *TINY, "--steps", "12", "--every", "4", "--warmup", "4", "--dir", str(store_dir))
    # Exit 1 is a verdict (the kernel may start an io_uring worker thread at any step); not a crash.
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert p.stdout.count("verdict (io.zero_copy") == 2, p.stdout
    assert p.stdout.count("books: after warm-up 0, last half [0]: flat") == 2, p.stdout


def test_soak_books_name_what_an_adaptive_offloader_has(store_dir, monkeypatch):
    # A book renamed in the offloader must fail here, not count as an empty one.
    import torch

    import ssdtier
    from ssdtier.bench.models import GPTConfig, build_model

    monkeypatch.syspath_prepend(str(BENCHES))
    import soak

    model = build_model(GPTConfig(n_layers=2, vocab_size=64, seq_len=16, d_model=32, n_heads=2))
    cfg = {"nvme": [{"path": str(store_dir)}], "policy": {"mode": "adaptive", "min_tensor_bytes": 0}}
    with ssdtier.attach(model, cfg) as off:
        assert off.adaptive is not None
        model(torch.zeros(2, 16, dtype=torch.long))
        assert all(soak.book_size(off, name) >= 0 for name in soak.BOOKS)


def test_spill_reads_prints_a_row_per_cell(store_dir):
    p = run(
        "spill_reads.py",
        *("--entries", "16", "--arena", "4", "--windows", "1", "--repeat", "1", "--forwards", "1,2"),
        *("--dir", str(store_dir)),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [r for r in p.stdout.splitlines() if r.startswith("| 1 ") or r.startswith("| 2 ")]
    # Two disk rates each: lifetime and lru for one forward (one group either way), all three for two.
    assert len(rows) == 2 * (2 + 3), p.stdout


def test_pin_rate_times_each_way_of_pinning(tmp_path):
    out = tmp_path / "pin.json"
    args = ["--size", "64MiB", "--threads", "1,2", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    r = run("pin_rate.py", *args, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    ways = ["plain", "plain+populate x1", "plain+populate x2", "huge", "huge+populate x1", "huge+populate x2"]
    assert list(got["rows"]) == [*ways, "store", "store+huge"] and got["size"] == 64 << 20
    for way, row in got["rows"].items():
        assert row["total_s"] > 0 and row["gb_s"] == pytest.approx((64 << 20) / row["total_s"] / 1e9)
        assert (row["populate_s"] > 0) == ("populate" in way or "store" in way), way  # a store's open


def test_compile_peak_says_where_the_compiled_graph_held_the_blocks(store_dir):
    p = run(
        "compile_peak.py",
        *["--layers", "2", "--d-model", "32", "--seq", "16", "--batch", "2", "--heads", "2", "--vocab", "64"],
        *["--dir", str(store_dir), "--warmup", "1", "--steps", "1"],
    )
    assert p.returncode == 0, p.stderr
    rows = {line.split("  ")[0].strip(): line for line in p.stdout.splitlines()[-6:]}
    assert rows["whole + ssdtier"].endswith("yes"), p.stdout
    assert rows["blocks + ssdtier"].endswith("-") and rows["eager + ssdtier"].endswith("-"), p.stdout


def test_settled_cost_times_plain_and_attached_twins(store_dir, tmp_path):
    out = tmp_path / "settled.json"
    p = run(
        "settled_cost.py", "--layers", "2", "--steps", "8", "--warmup", "2", "--dir", str(store_dir), "--json", str(out)
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["keep_ms"] > 0 and got["ssdtier_ms"] > 0 and got["plan"].startswith("2 keep")
    assert 0 < got["forwards_unhooked"] < 8, got  # the first forwards are hooked


def test_settled_cost_with_dynamic_padding(store_dir, tmp_path):
    out = tmp_path / "padded.json"
    p = run(
        "settled_cost.py", "--layers", "2", "--seq", "32", "--padded", "8", "--steps", "24", "--warmup", "2",
        "--dir", str(store_dir), "--json", str(out),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["padded"] == 8 and "seq 8-32 (padded per step)" in p.stdout and "mean of" in p.stdout
    assert 0 < got["forwards_unhooked"] < 24, got  # shorter than the longest hooked one: unhooked
    assert run("settled_cost.py", "--seq", "8", "--padded", "9").returncode != 0


def test_plan_trace_records_every_run_on_a_stand_in_gpu(tmp_path, store_dir, monkeypatch):
    """plan_trace runs on a GPU only: here its CUDA calls are stubbed and its model is tiny, so
    that an error in its own code (not the GPU's) shows before a device session is spent."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    import ssdtier
    from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch

    spec = importlib.util.spec_from_file_location("plan_trace", BENCHES / "plan_trace.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)

    def gpt(batch, every=0):
        cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2, checkpoint_every=every)
        torch.manual_seed(0)
        model = build_model(cfg)
        data = make_batch(cfg, batch, torch.Generator().manual_seed(1))
        return model, lambda: batch_loss(model, data)

    attach = ssdtier.attach

    def small(model, cfg):  # the script's 16 GiB arena and NVMe directory, as a test's
        return attach(model, {**cfg, "host": {"capacity": "1MiB"}, "nvme": [{"path": str(store_dir)}]})

    cuda = torch.cuda
    for name, fn in {
        "synchronize": lambda *a: None,
        "memory_allocated": lambda *a: 0,
        "max_memory_allocated": lambda *a: 4 << 20,
        "memory_reserved": lambda *a: 8 << 20,
        "memory_stats": lambda *a: {"num_alloc_retries": 0},
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda: None,
        "current_stream": lambda *a: SimpleNamespace(cuda_stream=1),
        "memory_snapshot": lambda: [{"stream": 1, "total_size": 8 << 20}],
    }.items():
        monkeypatch.setattr(cuda, name, fn)
    monkeypatch.setattr(trace, "gpt", gpt)
    monkeypatch.setattr(trace.ssdtier, "attach", small)
    runs = "keep,0.8,0.25"
    argv = ["plan_trace", "--out", str(tmp_path), "--steps", "3", "--runs", runs, "--dir", str(store_dir)]
    monkeypatch.setattr("sys.argv", [*argv, "--profile", "0.8"])
    trace.main()
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert list(doc) == runs.split(",")
    for run in doc.values():
        assert run["status"] == "ok", run.get("error")
        assert len(run["steps"]) == 3
    row = doc["0.8"]["steps"][-1]
    assert row["plan"] and len(row["block_fwd_ms"]) == 4 and "made_gib" in row
    assert (tmp_path / "profile_0.8_python.txt").read_text()
