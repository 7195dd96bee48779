"""The benchmark scripts run end to end on a tiny model (what they print is checked for
shape, never for speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
