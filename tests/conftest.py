"""Shared fixtures. Stores live under <repo>/target/pytest-stores: a real file
system (ext4 here and in CI), never tmpfs, so O_DIRECT is really exercised."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

# cuBLAS is deterministic only with a fixed workspace; it must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402

from ssdtier.errors import SsdtierWarning  # noqa: E402
from ssdtier.paths import is_tmpfs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STORE_ROOT = REPO / "target" / "pytest-stores"


@pytest.fixture
def store_dir() -> Path:
    STORE_ROOT.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(dir=STORE_ROOT))
    assert not is_tmpfs(d), f"{d} is on tmpfs: O_DIRECT tests need a real file system"
    yield d
    for root, dirs, files in os.walk(d, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        for sub in dirs:
            os.rmdir(os.path.join(root, sub))
    os.rmdir(d)


def store_config(path: Path, host: str = "64MiB", nvme: str = "4GiB", **io: object) -> dict:
    return {
        "host": {"capacity": host},
        "nvme": [{"path": str(path), "capacity": nvme}],
        "io": {"block_size": "256KiB", "queue_depth": 16, **io},
    }


@pytest.fixture
def warned():
    """``warned(text)``: the messages of the SsdtierWarnings raised so far in the test that
    contain ``text``, repeats included (no filter drops them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def matching(text: str) -> list[str]:
            return [str(w.message) for w in caught if issubclass(w.category, SsdtierWarning) and text in str(w.message)]

        yield matching
