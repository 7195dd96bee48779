"""ssdtier bench disk and train end to end on tiny workloads: what they print and write
is checked for shape and for exactness (losses), never for speed."""

from __future__ import annotations

import json
import shutil

import pytest

from .test_cli import ssdtier

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64"]
FAST = ["--steps", "1", "--warmup", "1", "--device", "cpu"]


@pytest.mark.parametrize("fio", [True, False], ids=["fio", "no-fio"])
def test_bench_disk(store_dir, fio):
    if fio and shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    args = ["bench", "disk", str(store_dir), "--size", "4MiB", "--tensor", "1MiB", "--arena", "1MiB"]
    r = ssdtier(*args, *([] if fio else ["--no-fio"]))
    assert r.returncode == 0, r.stderr
    assert "data intact: yes" in r.stdout and "ssdtier MB/s" in r.stdout
    r = ssdtier(*args, *([] if fio else ["--no-fio"]), "--json")
    out = json.loads(r.stdout)
    assert out["store"]["intact"] and out["store"]["write"] > 0 and out["store"]["read"] > 0
    assert (out["fio"] is not None) == fio
    assert sorted(p.name for p in store_dir.iterdir()) == [], "nothing left in the directory"


def test_bench_disk_bad_sizes(store_dir):
    # --tensor 4 raised from inside torch; --size 0 ran 32MiB.
    for args, said in [
        (["--tensor", "4"], "--tensor must be at least 8 bytes, got 4"),
        (["--size", "0"], "--size (0) must hold at least one --tensor (32MiB)"),
    ]:
        r = ssdtier("bench", "disk", str(store_dir), "--no-fio", *args)
        assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_train_side_by_side(store_dir):
    r = ssdtier("bench", "train", *TINY, *FAST, "--dir", str(store_dir), "--min-tensor-bytes", "0", "--json")
    assert r.returncode == 0, r.stderr
    results = {x["setting"]: x for x in json.loads(r.stdout)["results"]}
    assert list(results) == ["keep", "ssdtier", "checkpoint", "save_on_cpu"]
    assert all(x["losses_equal_keep"] for x in results.values())
    assert results["ssdtier"]["offload"]["tensors_offloaded"] > 0
    assert all(x["median_step_s"] > 0 and x["memory_vs_keep"] > 0 for x in results.values())


def test_bench_train_table_and_bad_arguments(store_dir):
    r = ssdtier("bench", "train", *TINY, *FAST, "--dir", str(store_dir))
    assert r.returncode == 0, r.stderr
    assert "setting" in r.stdout and "losses = keep" in r.stdout and "\nssdtier " in r.stdout
    r = ssdtier("bench", "train", "--d-model", "30", "--heads", "4")
    assert r.returncode == 1 and "--d-model (30) must be a multiple of --heads (4)" in r.stderr
    r = ssdtier("bench", "train", "--dir", "/proc/nope/x")
    assert r.returncode == 1 and "cannot be created in /proc" in r.stderr and "step" not in r.stderr


def test_bench_train_hf_model(store_dir):
    pytest.importorskip("transformers")
    r = ssdtier("bench", "train", "--hf", "llama", *TINY, *FAST, "--dir", str(store_dir), "--json")
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    assert all(x["losses_equal_keep"] for x in results)
    r = ssdtier("bench", "train", "--hf", "no-such-model", *TINY, *FAST)
    assert r.returncode == 1 and "--hf 'no-such-model'" in r.stderr


def test_bench_train_on_cuda_shows_reserved_memory_too():
    # On a GPU a freed source whose copy out is still queued is reserved, not allocated.
    from ssdtier.bench.summary import ratios, render
    from ssdtier.bench.train import Workload

    def result(setting, peak, reserved):
        return {"setting": setting, "mode": setting, "status": "ok", "batch": 2, "peak_bytes": peak << 20,
                "reserved_bytes": reserved << 20, "median_step_s": 1.0, "s_per_sample": 0.5, "tokens_per_s": 100.0,
                "losses": ["0x1p+0"], "memory_method": "m"}  # fmt: skip

    results = [result("keep", 400, 420), result("ssdtier", 100, 300)]
    ratios(results)
    assert results[1]["reserved_vs_keep"] == pytest.approx(300 / 420)
    w = Workload(None, 2, 32, 2, 16, 2, 64, 1, 1, "cuda", None, "64MiB", "1MiB", None)
    text = render(results, w)
    row = next(line.split() for line in text.splitlines() if line.startswith("ssdtier "))
    assert "reserved MiB" in text and row[:5] == ["ssdtier", "100.0", "0.25", "300.0", "0.71"]


def test_bench_disk_refuses_a_size_past_the_free_space(store_dir, monkeypatch, capsys):
    # It warned, then filled the disk: now nothing is written.
    from ssdtier.__main__ import main
    from ssdtier.bench import disk

    usage = shutil.disk_usage(store_dir)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    monkeypatch.setattr(disk, "_store_pass", lambda *a: pytest.fail("written past the free space"))
    assert main(["bench", "disk", str(store_dir), "--size", "4MiB", "--tensor", "1MiB", "--no-fio"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ssdtier: error: command line: --size 4MiB needs ") and "has 1MiB free" in err, err
    assert list(store_dir.iterdir()) == []


def test_an_interrupted_setting_stops_its_worker(monkeypatch):
    # Ctrl-C (or any error) in the parent: the worker is ended, not left training, orphaned.
    import signal
    import subprocess
    import sys

    from ssdtier.bench import train
    from ssdtier.bench.train import Mode, Setting, Workload

    started = []

    def worker(s, w, lockstep=False):
        code = f"import sys, time; print({train._TAG + 'step'!r}, file=sys.stderr, flush=True); time.sleep(600)"
        pipe = subprocess.PIPE
        started.append(subprocess.Popen([sys.executable, "-c", code], stdout=pipe, stderr=pipe, text=True))
        return started[-1]

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "worker", worker)
    w = Workload(None, 2, 32, 2, 16, 2, 64, 1, 1, "cpu", None, "auto", "0", 1)
    try:
        with pytest.raises(KeyboardInterrupt):
            train._in_subprocess(Setting(Mode.KEEP), w, interrupt)
        assert started[0].returncode == -signal.SIGTERM
    finally:
        started[0].kill()  # a no-op once it has ended; else no sleeper outlives a failure
        started[0].wait()
