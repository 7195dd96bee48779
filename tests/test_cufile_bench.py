"""benches/cufile_bandwidth.py without a GPU: options, the table, the refusal without CUDA, the
ssdtier part on the CPU, and the cuFile child against a stand-in cufile module (POSIX I/O on
CPU tensors) that records its calls, so that the script cannot rot between runs on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ssdtier.offload.cufile

TESTS = Path(__file__).resolve().parent
BENCHES = TESTS.parent / "benches"
SCRIPT = BENCHES / "cufile_bandwidth.py"
KiB = 1024


@pytest.fixture
def cb(monkeypatch):
    """The bench module, imported from its path (benches/ is not a package)."""
    monkeypatch.syspath_prepend(str(BENCHES))  # for its `import _machine`
    spec = importlib.util.spec_from_file_location("cufile_bandwidth", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fake_cufile(cb, monkeypatch, tmp_path):
    """CPU tensors and the stand-in cufile module (tests/fake_cufile.py: ``fake_cufile`` in the
    child, ``tests.fake_cufile`` for ssdtier's transport in this process); returns the trace
    file's path."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setattr(cb, "DEVICE", "cpu")
    monkeypatch.setattr(cb, "CUFILE_MODULE", "fake_cufile")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_CUFILE_TRACE", str(trace))
    monkeypatch.setattr(ssdtier.offload.cufile, "MODULE", "tests.fake_cufile")
    return trace


def calls(trace: Path) -> list[list]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


def test_defaults_and_size_options(cb):
    a = cb.parse_args([])
    assert (a.size, a.block, a.count) == (4 << 30, 16 << 20, 256)
    assert (a.repeats, a.timeout_s, a.parts, a.json) == (3, 120.0, ("fio", "ssdtier", "cufile", "transport"), None)
    assert a.dir == cb.DEFAULT_DIR
    a = cb.parse_args(["--size", "100MiB", "--block", "16MiB", "--parts", "cufile, fio", "--dir", "rel"])
    assert (a.count, a.size) == (6, 96 << 20)  # whole blocks only
    assert a.parts == ("fio", "cufile") and a.dir.is_absolute()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block", "1000"], "multiple of 4096"),
        (["--size", "1MiB", "--block", "2MiB"], "at least --block"),
        (["--size", "lots"], "--size"),
        (["--repeats", "0"], "--repeats"),
        (["--timeout-s", "0"], "--timeout-s"),
        (["--parts", "fio,nvme"], "--parts"),
    ],
)
def test_bad_options_are_refused(cb, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cb.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def fake_results(fio_status: str = "ok") -> dict:
    def part(w, r, status="ok", note="", **facts):
        return {"status": status, "note": note, "median_write": w, "median_read": r, "details": [facts]}

    return {
        "fio_depth": 4,
        "gds": {"state": "compatibility mode", "reason": "nvidia-fs driver not loaded"},
        "parts": {
            "fio": part(2.0, 3.0) if fio_status == "ok" else part(None, None, fio_status, "fio is not installed"),
            "ssdtier": part(1.8, 2.7, backend="io_uring"),
            "cufile": part(1.0, 1.5),
        },
    }


def test_table_has_a_row_per_path_and_ratios_to_fio(cb):
    lines = cb.render_table(fake_results()).splitlines()
    assert lines[0] == "| path | write GB/s | read GB/s | write / fio | read / fio |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| fio (io_uring, O_DIRECT, QD 4) | 2.00 | 3.00 | 1.00 | 1.00 |"
    assert lines[3] == "| ssdtier io_uring (GPU->pinned->NVMe) | 1.80 | 2.70 | 0.90 | 0.90 |"
    assert lines[4] == "| cuFile (GPU<->file, compatibility mode) | 1.00 | 1.50 | 0.50 | 0.50 |"
    assert len(lines) == 5


def test_table_without_fio_has_no_ratios_and_says_why(cb):
    text = cb.render_table(fake_results("skipped"))
    assert "| fio (io_uring, O_DIRECT, QD 4) (skipped) | - | - | - | - |" in text
    assert "| cuFile (GPU<->file, compatibility mode) | 1.00 | 1.50 | - | - |" in text
    assert "- fio: skipped: fio is not installed" in text


def test_without_cuda_it_stops_at_once(tmp_path):
    target = tmp_path / "not-made"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(target)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # no device, also on a GPU machine
    )
    assert p.returncode != 0
    assert "needs CUDA" in p.stderr + p.stdout
    assert time.monotonic() - t0 < 60
    assert not target.exists()  # nothing was written, cuFile not started


def test_store_part_round_trips_on_the_cpu(cb, monkeypatch, store_dir):
    monkeypatch.setattr(cb, "DEVICE", "cpu")
    got = cb.run_store_part(store_dir, 8 * 64 * KiB, 64 * KiB, 2)
    assert got["intact"] and got["bad_blocks"] == []
    assert got["write"] > 0 and got["read"] > 0
    assert got["nvme_bytes_written"] >= 8 * 64 * KiB
    assert got["pinned"] is False  # no CUDA: the arena is not registered
    assert list(store_dir.iterdir()) == []  # its files are gone


def test_cufile_child_writes_every_block_and_reads_it_back(cb, fake_cufile, store_dir):
    block, count = 64 * KiB, 6
    got = cb.run_cufile_part(store_dir / "c.dat", count * block, block, 60)
    assert got["ok"], got
    assert got["intact"] and got["buf_registered"] and got["cufile_version"] == 1170
    assert got["write"] > 0 and got["read"] > 0
    assert got["log"] == ["NOTICE cufio: GDS not available, using compat mode"]
    trace = calls(fake_cufile)
    opened = trace[0]
    assert opened[0] == "driver_open" and opened[1] != os.getcwd() and opened[2].endswith("cufile.log")
    assert not os.path.exists(opened[1])  # its working directory is gone
    names = [c[0] for c in trace]
    assert names[:4] == ["driver_open", "handle_register", "buf_register", "buf_register"]
    assert [c[2] for c in trace if c[0] == "write"] == [i * block for i in range(count)]
    assert [c[2] for c in trace if c[0] == "read"] == [i * block for i in range(count)]
    assert names[-4:] == ["buf_deregister", "buf_deregister", "handle_deregister", "driver_close"]
    assert not (store_dir / "c.dat").exists()


def test_cufile_child_notices_wrong_data(cb, fake_cufile, store_dir, monkeypatch):
    monkeypatch.setenv("FAKE_CUFILE_CORRUPT", "1")
    got = cb.run_cufile_part(store_dir / "c.dat", 4 * 64 * KiB, 64 * KiB, 60)
    assert got["ok"] and not got["intact"] and got["bad_blocks"] == [0]


def test_a_hanging_cufile_is_killed(cb, fake_cufile, store_dir, monkeypatch):
    monkeypatch.setenv("FAKE_CUFILE_HANG", "1")
    t0 = time.monotonic()
    got = cb.run_cufile_part(store_dir / "c.dat", 4 * 64 * KiB, 64 * KiB, 5)
    assert not got["ok"] and got["timed_out"] and "did not finish in 5 s" in got["error"]
    assert time.monotonic() - t0 < 30


def test_main_end_to_end_with_cuda_stubbed(cb, fake_cufile, store_dir, monkeypatch, capsys):
    import ssdtier.gds

    gds = ssdtier.gds.Gds(ssdtier.gds.GdsState.COMPAT, "nvidia-fs driver not loaded")
    monkeypatch.setattr(ssdtier.gds, "probe", lambda timeout=20.0: gds)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(cb.shutil, "which", lambda name: None)  # fio: skipped, whether installed or not
    out = store_dir / "out.json"
    argv = ["--dir", str(store_dir), "--size", "512KiB", "--block", "64KiB", "--repeats", "2", "--json", str(out)]
    assert cb.main(argv) == 0
    text = capsys.readouterr().out
    assert "| ssdtier io_uring (GPU->pinned->NVMe) |" in text or "| ssdtier posix" in text
    assert "| cuFile (GPU<->file, compatibility mode) |" in text
    assert "GDS probe: compatibility mode (nvidia-fs driver not loaded)" in text
    assert "| ssdtier cuFile transport (compatibility mode) |" in text
    res = json.loads(out.read_text())
    assert res["parts"]["fio"]["status"] == "skipped"
    for name in ("ssdtier", "cufile", "transport"):
        part = res["parts"][name]
        assert part["status"] == "ok" and len(part["write"]) == 2 and part["intact"], part
    assert sorted(p.name for p in store_dir.iterdir()) == ["out.json"]  # its files are gone


def test_transport_part_moves_every_block_through_the_workers(cb, fake_cufile, store_dir):
    from . import fake_cufile as fake

    fake.reset()
    got = cb.run_transport_part(store_dir, 8 * 64 * KiB, 64 * KiB)
    assert got["intact"] and got["threads"] == 4 and got["write"] > 0 and got["read"] > 0
    calls = fake.state["calls"]
    assert sum(c[3] for c in calls if c[0] == "write") == sum(c[3] for c in calls if c[0] == "read") == 8 * 64 * KiB
    assert len({c[5] for c in calls}) > 1  # several workers
    assert fake.state["opens"] == fake.state["closes"] == 1 and not fake.state["fds"]
    assert not (store_dir / "transport").exists()


def test_transport_part_is_skipped_where_cufile_is_unavailable(cb, fake_cufile, store_dir, monkeypatch, capsys):
    import ssdtier.gds

    gds = ssdtier.gds.Gds(ssdtier.gds.GdsState.UNAVAILABLE, "no cufile")
    monkeypatch.setattr(ssdtier.gds, "probe", lambda timeout=20.0: gds)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    out = store_dir / "out.json"
    argv = ["--dir", str(store_dir), "--size", "256KiB", "--block", "64KiB", "--repeats", "1", "--parts", "transport"]
    assert cb.main([*argv, "--json", str(out)]) == 0
    part = json.loads(out.read_text())["parts"]["transport"]
    assert part["status"] == "skipped" and "unavailable (no cufile)" in part["note"]


def test_the_probe_against_the_stand_in(tmp_path, monkeypatch):
    """benches/cufile_probe.py: each kind of file in a process of its own; the stand-in refuses
    the O_TMPFILE flags and a file with no name as libcufile does, and takes it named."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "probe.json"
    d = TESTS.parent / "target" / "probe-test"  # O_DIRECT needs a real file system, not tmpfs
    r = subprocess.run(
        [
            sys.executable,
            str(BENCHES / "cufile_probe.py"),
            str(d),
            "--json",
            str(out),
            "--device",
            "cpu",
            "--module",
            "fake_cufile",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    rows = {(x["env"], x["kind"]): x for x in json.loads(out.read_text())}
    assert len(rows) == 8
    for env in ("defaults", "force_compat"):
        assert not rows[env, "tmpfile"]["ok"] and "INVALID_FILE_OPEN_FLAG" in rows[env, "tmpfile"]["error"]
        assert not rows[env, "reopened"]["ok"] and "GETNEWFD_FAILED" in rows[env, "reopened"]["error"]
        assert rows[env, "linked"]["ok"] and rows[env, "named"]["ok"]
