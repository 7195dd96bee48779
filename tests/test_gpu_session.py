"""benches/gpu_session.sh without a GPU: parts, time limits, and what comes back (the device
tool returns at most 8 files, so everything is packed into two)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from ssdtier.bench import add_parser

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "gpu_session.sh"


def session(tmp_path: Path, *parts: str, **env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "out"), "LOGS": str(tmp_path / "logs"), **env}
    return subprocess.run(["bash", str(SCRIPT), *parts], env=env, capture_output=True, text=True, timeout=120)


def test_an_unknown_part_is_refused_before_anything_runs(tmp_path):
    r = session(tmp_path, "import", "bench_2b")
    assert r.returncode == 2
    assert "unknown part 'bench_2b'" in r.stderr and "call1" in r.stderr and "call4" in r.stderr
    assert not (tmp_path / "out").exists()


def test_logs_come_back_as_a_summary_and_one_archive(tmp_path):
    r = session(tmp_path, "import", "cufile", CUDA_VISIBLE_DEVICES="")  # cufile fails: no CUDA device
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_session.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "out" / "gpu_session.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"machine.txt", "import.log", "cufile.log"} <= names
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [["import", "rc=0"], ["cufile", "rc=2"]]
    # A failed part's log tail is printed, since the archive may not come back.
    assert "== cufile.log, last lines ==" in r.stdout and "needs CUDA" in r.stdout


def test_parts_past_the_session_time_are_skipped_not_started(tmp_path):
    r = session(tmp_path, "import", "info", SESSION_S="15")
    assert r.returncode == 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.count("skipped: ") == 2 and "SESSION_S=15" in summary
    assert not (tmp_path / "logs" / "import.log").exists()


def test_the_rok_part_is_known_and_sized_by_the_session(tmp_path):
    # call4 runs it; here only its name and its limit (too little time left: not started).
    r = session(tmp_path, "rok", SESSION_S="15")
    assert r.returncode == 0, r.stderr
    assert "rok" in (tmp_path / "out" / "summary.txt").read_text() and "skipped" in r.stdout
    assert not (tmp_path / "logs" / "rok.log").exists()
    script = SCRIPT.read_text()
    assert "call4) parts+=(install import test_cuda rok)" in script and "-m ssdtier bench rok --device cuda" in script


ECHO_ARGS = """#!/bin/sh
printf '%s\\n' "$@" > "$ARGS_TO"
"""


def echoed(tmp_path, part, gpu_mib):
    """What ``part`` runs, with a stand-in interpreter that writes what it was given, on a
    machine with no nvidia-smi or one that reports ``gpu_mib``."""
    fake = tmp_path / "py"
    fake.write_text(ECHO_ARGS)
    fake.chmod(0o755)
    env = {}
    if gpu_mib is not None:
        (tmp_path / "bin").mkdir()
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho {gpu_mib}\n")
        smi.chmod(0o755)
        env["PATH"] = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    got = tmp_path / "args"
    r = session(tmp_path, part, PY=str(fake), ARGS_TO=str(got), SESSION_S="600", **env)
    assert r.returncode == 0, r.stderr
    return got.read_text().splitlines()


@pytest.mark.parametrize("gpu_mib", [None, "143771"])
def test_plan_trace_runs_auto_past_keeps_largest_batch_on_each_gpu(tmp_path, gpu_mib):
    argv = echoed(tmp_path, "plan_trace", gpu_mib)
    runs = argv[argv.index("--runs") + 1].split(",")
    assert runs[0] == "keep" and runs[3:] == ["1.2", "0.8", "0.4", "0.25"]
    assert runs[1:3] == (["auto:32", "auto:40"] if gpu_mib else ["auto:16", "auto:20"])  # first: the session may end


@pytest.mark.parametrize("part", ["rok", "rok_targets", "rok_fit", "rok_long"])
@pytest.mark.parametrize("gpu_mib", [None, "81559", "143771"])  # no nvidia-smi, an H100's, an H200's
def test_each_rok_part_runs_a_command_line_the_bench_takes(tmp_path, part, gpu_mib):
    # The bench's own parser reads what the part runs.
    argv = echoed(tmp_path, part, gpu_mib)
    assert argv[:4] == ["-m", "ssdtier", "bench", "rok"], argv
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(argv[2:])
    assert a.device == "cuda" and a.budget_s > 0
    if part in ("rok_targets", "rok_fit"):
        # keep's largest x1.4 and x1.8, checkpoint's largest and x1.15 of it, on each GPU
        h200 = gpu_mib == "143771"
        assert a.fit and a.fit_batches == ([37, 47, 72, 96, 110] if h200 else [19, 24, 32, 43, 50])
        assert a.ssdtier_compile == ([0.5] if part == "rok_targets" else [0.2]) and a.arena == "48GiB"
        assert "ssdtier" in a.modes and ("compile" in a.modes) == (part == "rok_targets")
        # rok_fit probes ssdtier on compiled blocks alone: eager ssdtier's probes are rok_targets'.
        fitted = ["keep", "ssdtier", "checkpoint"] if part == "rok_targets" else ["keep", "ssdtier-compile"]
        assert a.fit_modes == fitted


def test_the_udev_shim_writes_an_entry_once_and_leaves_one_alone(tmp_path):
    shim = SCRIPT.parent / "cufile_udev_shim.sh"
    where = SCRIPT.parents[1] / "target" / "udev-shim-test"  # on the disk, not a tmpfs
    env = {**os.environ, "UDEV_DATA": str(tmp_path / "data")}

    def run() -> str:
        r = subprocess.run(["bash", str(shim), str(where)], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = run()
    if "not a block device" in out:  # an overlay or tmpfs here: nothing to write
        assert not (tmp_path / "data").exists()
        return
    (db,) = (tmp_path / "data").iterdir()
    assert db.name.startswith("b") and "wrote" in out
    lines = db.read_text().splitlines()
    assert "E:ID_FS_USAGE=filesystem" in lines and any(x.startswith("E:ID_FS_TYPE=") for x in lines)
    db.write_text("E:ID_FS_USAGE=filesystem\n")  # udevd's own entry: left as it is
    assert "left as it is" in run() and db.read_text() == "E:ID_FS_USAGE=filesystem\n"


def test_the_cufile_probe_runs_only_where_cufile_failed(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cufile_bandwidth.json").write_text('{"parts": {"cufile": {"status": "ok"}}}')
    r = session(tmp_path, "cufile_probe")
    assert r.returncode == 0, r.stderr
    assert "skipped: cuFile worked" in (tmp_path / "out" / "summary.txt").read_text()
    assert not (logs / "cufile_probe.log").exists()
    (logs / "cufile_bandwidth.json").write_text('{"parts": {"cufile": {"status": "failed"}}}')
    session(tmp_path, "cufile_probe", CUDA_VISIBLE_DEVICES="")
    assert (logs / "cufile_probe.log").exists()


def test_a_wheel_built_from_another_tree_is_told(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from _wheel_check import differing
    finally:
        sys.path.pop(0)
    tree, wheel = tmp_path / "tree", tmp_path / "wheel"
    for d in (tree, wheel, tree / "bench", wheel / "bench"):
        d.mkdir()
    for root in (tree, wheel):
        (root / "a.py").write_text("x = 1\n")
        (root / "bench" / "b.py").write_text("y = 1\n")
    assert differing(tree, wheel) == []
    (tree / "bench" / "b.py").write_text("y = 2\n")
    (tree / "c.py").write_text("")
    assert differing(tree, wheel) == ["bench/b.py", "c.py"]
    # Here ssdtier is the tree itself (an editable install): it matches.
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "_wheel_check.py")], capture_output=True, text=True)
    assert r.returncode == 0 and "is this tree's" in r.stdout, r.stderr


def test_a_part_cut_short_from_outside_still_brings_its_log(tmp_path):
    # The device's time can end inside a part: its log is packed every PACK_S seconds meanwhile.
    fake = tmp_path / "py"
    fake.write_text('#!/bin/sh\ncase "$*" in *" info "*) echo started; exec sleep 60 ;; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "OUT": str(tmp_path / "out"), "LOGS": str(tmp_path / "logs"), "PACK_S": "1"}
    p = subprocess.Popen(
        ["bash", str(SCRIPT), "info"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # killed as a group: the part and the packing loop too
    )
    tgz = tmp_path / "out" / "gpu_session.tgz"
    try:
        for _ in range(300):  # up to 30 s on a busy machine
            if tgz.exists():
                with tarfile.open(tgz) as tar:
                    if any(Path(n).name == "info.log" for n in tar.getnames()):
                        break
            time.sleep(0.1)
        else:
            raise AssertionError("info.log was not packed while the part ran")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
