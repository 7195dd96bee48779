"""Memory left to this process (ssdtier.ram), and the pinned arena cut to fit it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ssdtier
from ssdtier.config import Config
from ssdtier.effective import fit_arena
from ssdtier.errors import SsdtierWarning
from ssdtier.offload import offloader as offloader_mod
from ssdtier.ram import Available, available
from ssdtier.sizes import GiB, MiB

from .conftest import store_config


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


MEMINFO = "MemTotal:       65536000 kB\nMemAvailable:   41943040 kB\n"  # 40 GiB available


def test_without_a_limit_memavailable_says(tmp_path):
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "0::/user.slice\n"})
    _tree(tmp_path / "cg", {"user.slice/memory.max": "max\n", "user.slice/memory.current": "123\n"})
    assert available(str(tmp_path / "proc"), str(tmp_path / "cg")) == Available(40 * GiB, "MemAvailable")


@pytest.mark.parametrize(
    ("cgroup", "files", "bound", "left"),
    [
        # v2: the limit is on the pod, an ancestor; inactive file pages are not counted.
        (
            "0::/kubepods/pod1/c1\n",
            {
                "kubepods/pod1/c1/memory.max": "max\n",
                "kubepods/pod1/c1/memory.current": "1\n",
                "kubepods/pod1/memory.max": f"{16 * GiB}\n",
                "kubepods/pod1/memory.current": f"{10 * GiB}\n",
                "kubepods/pod1/memory.stat": f"anon {6 * GiB}\ninactive_file {4 * GiB}\n",
            },
            "kubepods/pod1/memory.max",
            10 * GiB,
        ),
        # v1 inside a container: /proc/self/cgroup names the host's path, and the container
        # sees its own cgroup as the hierarchy's root.
        (
            "9:name=systemd:/\n5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
            {
                "memory/memory.limit_in_bytes": f"{8 * GiB}\n",
                "memory/memory.usage_in_bytes": f"{3 * GiB}\n",
                "memory/memory.stat": f"cache {2 * GiB}\ntotal_inactive_file {1 * GiB}\n",
            },
            "memory/memory.limit_in_bytes",
            6 * GiB,
        ),
    ],
)
def test_a_cgroup_limit_bounds_it(tmp_path, cgroup, files, bound, left):
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": cgroup})
    _tree(tmp_path / "cg", files)
    assert available(str(tmp_path / "proc"), str(tmp_path / "cg")) == Available(left, str(tmp_path / "cg" / bound))


def test_v1_no_limit_and_nothing_readable(tmp_path):
    _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "4:memory:/\n"})
    _tree(
        tmp_path / "cg", {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5"}
    )
    assert available(str(tmp_path / "proc"), str(tmp_path / "cg")).bound == "MemAvailable"
    assert available(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_this_machine_says_something():
    got = available()
    assert got is not None and got.bytes > 0


@pytest.mark.parametrize(
    ("capacity", "left", "kept"),
    [
        (GiB, 40 * GiB, GiB),  # fits: unchanged
        (64 * GiB, 40 * GiB, 30 * GiB),  # a quarter left
        (64 * GiB, 6 * GiB, 4 * GiB),  # at least 2 GiB left
        (GiB, 1 * GiB, 0),  # nothing to spare: no arena
    ],
)
def test_the_arena_is_cut_to_what_can_be_pinned(capacity, left, kept):
    cfg = Config.from_dict({"host": {"capacity": capacity}}, source="t.toml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fit_arena(cfg, Available(left, "MemAvailable"))
    assert out.host.capacity == kept and out.source == "t.toml"
    assert out.host.capacity % MiB == 0
    said = [str(w.message) for w in caught if issubclass(w.category, SsdtierWarning)]
    assert len(said) == (kept != capacity)
    if said:
        assert said[0].startswith(f"ssdtier: t.toml: host.capacity = {capacity // GiB}GiB is more than can be pinned")
    assert fit_arena(cfg, None) is cfg


def test_attach_cuts_the_arena_only_where_it_would_be_pinned(store_dir, monkeypatch, warned):
    monkeypatch.setattr(offloader_mod, "available", lambda: Available(3 * GiB, "MemAvailable"))
    cfg = store_config(store_dir, host="2GiB")
    model = torch.nn.Linear(4, 4)
    with ssdtier.attach(model, cfg) as off:  # a CPU model: its arena is not pinned
        assert off.store.config.host.capacity == 2 * GiB
    assert warned("pinned") == []
    # A model on a device whose activations go through the pinned arena (a stand-in GPU).
    monkeypatch.setattr(offloader_mod.Offloader, "_streamed", frozenset({"cuda", "cpu"}))
    with ssdtier.attach(model, cfg) as off:
        assert off.store.config.host.capacity == GiB  # 3 GiB left, of which 2 GiB stay with the machine
    assert len(warned("more than can be pinned")) == 1
    with ssdtier.attach(model, cfg, policy__mode="none") as off:  # nothing offloaded, nothing pinned
        assert off.store.config.host.capacity == 2 * GiB
