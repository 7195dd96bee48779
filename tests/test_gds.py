"""The GPUDirect Storage probe (ssdtier.gds): no cuFile without CUDA, a bounded child
process otherwise, its answer parsed; and the line `ssdtier info` prints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ssdtier import gds
from ssdtier.gds import GdsState, probe

from .test_cli import ssdtier as run_cli


@pytest.fixture
def cuda_up(monkeypatch):
    """Pretend a CUDA device is there, so that probe starts its child."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_without_cuda_cufile_is_not_touched(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)

    def no_child(*args, **kwargs):
        raise AssertionError("a child process was started without CUDA")

    monkeypatch.setattr(gds.subprocess, "run", no_child)
    t0 = time.monotonic()
    g = probe()
    assert time.monotonic() - t0 < 3
    assert g.state is GdsState.UNAVAILABLE and g.reason == "no CUDA device"
    assert str(g) == "unavailable (no CUDA device)"
    assert list(tmp_path.iterdir()) == []  # no cufile.log


def test_a_hung_child_is_bounded_and_its_directory_removed(cuda_up, monkeypatch, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    seen = tmp_path / "seen.json"
    code = (
        "import json, os, time\n"
        f"open({str(seen)!r}, 'w').write(json.dumps([os.getcwd(), os.environ.get('CUFILE_LOGFILE_PATH')]))\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    g = probe(timeout=1.5, _code=code)
    took = time.monotonic() - t0
    assert g.state is GdsState.UNAVAILABLE and g.reason == "cuFile did not answer in 1.5 s", g
    assert took < 1.5 + 5, took
    cwd, log = json.loads(seen.read_text())
    # The child ran in a directory of its own, cuFile's log sent there, and it is gone.
    assert Path(log).parent == Path(cwd) and Path(cwd) != work
    assert not Path(cwd).exists()
    assert list(work.iterdir()) == []


def test_the_real_child_leaves_no_log_behind(cuda_up, monkeypatch, tmp_path):
    # Where cuFile hangs (this CPU machine: no libcuda.so.1) the timeout answers; where
    # it answers, any state may come; either way nothing lands in the caller's directory.
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    g = probe(timeout=3)
    assert time.monotonic() - t0 < 3 + 5
    assert isinstance(g.state, GdsState) and g.reason
    assert list(tmp_path.iterdir()) == []


FAKE_CUFILE = """
import ctypes, enum, struct

class BoolConfigParameter(enum.IntEnum):
    FORCE_COMPAT_MODE = 2

def get_version():
    return 1170

def driver_open():
    open("opened", "w").close()

def driver_get_properties(ptr):
    raw = struct.pack("IIQQII", {major}, {minor}, 4, 1024, 0, 2)
    ctypes.memmove(ptr, raw, len(raw))

def get_parameter_bool(param):
    assert param == BoolConfigParameter.FORCE_COMPAT_MODE
    return {force}

def driver_close():
    import os
    os.rename("opened", {closed!r})  # opened in the child's directory, closed after
"""


@pytest.mark.parametrize(
    ("major", "minor", "force", "state", "words"),
    [
        (2, 25, False, GdsState.USABLE, "nvidia-fs 2.25, cuFile 1.17"),
        (0, 0, False, GdsState.COMPAT, "nvidia-fs driver not loaded"),
        (2, 25, True, GdsState.COMPAT, "force_compat_mode"),
    ],
)
def test_the_real_child_code_reads_cufile(cuda_up, monkeypatch, tmp_path, major, minor, force, state, words):
    # The child's own code against a stand-in cuda.bindings.cufile, found first on PYTHONPATH:
    # the properties struct read as cuFile lays it out, and the driver closed after.
    pkg = tmp_path / "fake" / "cuda" / "bindings"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    closed = tmp_path / "closed"
    (pkg / "cufile.py").write_text(FAKE_CUFILE.format(major=major, minor=minor, force=force, closed=str(closed)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    g = probe(timeout=30)
    assert g.state is state and words in g.reason, g
    assert g.cufile_version == "1.17"
    assert closed.exists()  # driver_close ran, after driver_open


def child_printing(*lines: str) -> str:
    return "".join(f"print({line!r})\n" for line in lines)


@pytest.mark.parametrize(
    ("out", "state", "words"),
    [
        ({"nvfs": [2, 25], "version": 1170, "force_compat": False}, GdsState.USABLE, "nvidia-fs 2.25, cuFile 1.17"),
        ({"nvfs": [2, 26]}, GdsState.USABLE, "nvidia-fs 2.26"),
        ({"nvfs": [0, 0], "version": 1150}, GdsState.COMPAT, "not loaded: I/O goes through host memory, cuFile 1.15"),
        ({"nvfs": [2, 25], "force_compat": True}, GdsState.COMPAT, "force_compat_mode"),
        ({"missing": "No module named 'cuda.bindings.cufile'"}, GdsState.UNAVAILABLE, "cuda-bindings >= 12.9.1"),
        ({"error": "cuFileError: driver not loaded", "version": 1170}, GdsState.UNAVAILABLE, "driver not loaded"),
        ({"nvfs": "2.25"}, GdsState.UNAVAILABLE, "no nvidia-fs version"),
        ({}, GdsState.UNAVAILABLE, "no nvidia-fs version"),
    ],
)
def test_the_childs_answer_is_parsed(cuda_up, out, state, words):
    # A line cuFile might print first is skipped: the answer is the last line.
    g = probe(timeout=30, _code=child_printing("cuFile says hello", json.dumps(out)))
    assert g.state is state, g
    assert words in g.reason, g
    if state is GdsState.USABLE:
        assert g.nvfs_version == ".".join(map(str, out["nvfs"]))
        assert str(g) == f"usable ({g.reason})"


def test_a_directory_whose_files_cufile_refuses_is_unavailable_with_its_log(cuda_up, tmp_path):
    # As on a VM whose disk udev has no data for: cuFile works, but refuses the file.
    code = (
        "import json, os\n"
        "with open(os.environ['CUFILE_LOGFILE_PATH'], 'w') as f:\n"
        "    f.write(' 26-11-2026 [pid=1] NOTICE cufio-drv: running in compatible mode\\n')\n"
        "    f.write(' 26-11-2026 [pid=1] ERROR  cufio-udev:67 udev property not found: ID_FS_USAGE vda\\n')\n"
        "assert os.environ['SSDTIER_GDS_DIR'] == " + repr(str(tmp_path)) + "\n"
        "print(json.dumps({'nvfs': [0, 0], 'version': 1150, 'file_error': 'cuFileError: HANDLE_NOT_REGISTERED'}))\n"
    )
    g = probe(timeout=30, where=str(tmp_path), _code=code)
    assert g.state is GdsState.UNAVAILABLE and g.cufile_version == "1.15", g
    assert g.reason == (
        f"cuFile refuses a file in {tmp_path}: cuFileError: HANDLE_NOT_REGISTERED; "
        "its log: cufio-udev:67 udev property not found: ID_FS_USAGE vda"
    )
    ok = probe(timeout=30, where=str(tmp_path), _code=child_printing(json.dumps({"nvfs": [0, 0]})))
    assert ok.state is GdsState.COMPAT and ok.file_error is None


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (
            "import sys\nsys.stderr.write('boom: cuFile blew up\\n')\nsys.exit(3)\n",
            "exit status 3): boom: cuFile blew up",
        ),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "killed by signal 11"),
        (child_printing("not json at all"), "no result: 'not json at all'"),
        (child_printing("[1, 2]"), "no result"),
        ("", "no result"),
    ],
)
def test_a_failed_or_garbled_child_is_unavailable(cuda_up, code, words):
    g = probe(timeout=30, _code=code)
    assert g.state is GdsState.UNAVAILABLE and words in g.reason, g


def test_a_child_that_cannot_start_is_unavailable(cuda_up, monkeypatch):
    def cannot(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "python")

    monkeypatch.setattr(gds.subprocess, "run", cannot)
    g = probe()
    assert g.state is GdsState.UNAVAILABLE and "cannot start the cuFile probe" in g.reason


def test_info_reports_gds(store_dir):
    r = run_cli("info", str(store_dir))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("GPUDirect Storage: ")]
    assert len(lines) == 1, r.stdout
    if not torch.cuda.is_available():
        assert lines[0] == "GPUDirect Storage: unavailable (no CUDA device)"
        assert "CUDA activations go through the host arena" in r.stdout.splitlines()
    else:
        assert lines[0].split(": ", 1)[1].startswith(tuple(s.value for s in GdsState)), lines
        link = [line for line in r.stdout.splitlines() if line.startswith("GPU link ")]
        assert len(link) == 1 and " GB/s to and from pinned host memory" in link[0], r.stdout


def test_info_runs_no_child_without_cuda(store_dir):
    # The CLI's own process starts no child when CUDA is not there: info stays fast.
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the probe runs")
    code = (
        "import subprocess, sys\n"
        "def no(*a, **k): raise SystemExit('child started')\n"
        "subprocess.run = no\n"
        "from ssdtier.__main__ import main\n"
        f"sys.exit(main(['info', {str(store_dir)!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "GPUDirect Storage: unavailable (no CUDA device)" in r.stdout


def test_the_probes_own_child_registers_a_named_file(cuda_up, tmp_path):
    """The real child, with the stand-in cufile (which, as libcufile, opens a registered file
    again by its path): a file unlinked before registering would be refused."""
    repo = str(Path(__file__).resolve().parent.parent)
    prefix = (
        "import sys, types\n"
        f"sys.path.insert(0, {repo!r})\n"
        "from tests import fake_cufile as f\n"
        "b = types.ModuleType('cuda.bindings'); b.cufile = f\n"
        "c = types.ModuleType('cuda'); c.bindings = b\n"
        "sys.modules.update({'cuda': c, 'cuda.bindings': b, 'cuda.bindings.cufile': f})\n"
    )
    g = probe(timeout=30, where=str(tmp_path), _code=prefix + gds._CHILD)
    assert g.state is GdsState.COMPAT and g.file_error is None, g
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
