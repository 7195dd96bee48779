"""What a spill directory is on (ssdtier.mounts), and the warning for a network file system."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import ssdtier
from ssdtier import mounts, paths
from ssdtier.config import Config
from ssdtier.errors import SsdtierWarning
from ssdtier.mounts import Medium, Mount, Where

from .conftest import store_config

MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
40 27 259:3 / /mnt/my\040disk rw,noatime shared:5 master:2 - xfs /dev/nvme1n1 rw,attr2
41 27 0:50 / /home rw,relatime - nfs4 fs1:/export/home rw,vers=4.2
42 27 0:51 / /mnt/my\040disk rw - fuse.sshfs me@host:/data rw,user_id=0
bad line
"""


def test_mountinfo_is_parsed_with_escapes_optional_fields_and_over_mounts(tmp_path):
    f = tmp_path / "mountinfo"
    f.write_text(MOUNTINFO)
    table = mounts.mounts(str(f))
    assert [m.mountpoint for m in table] == ["/proc", "/", "/mnt/my disk", "/home", "/mnt/my disk"]
    root = table[1]
    assert (root.fstype, root.source, root.dev) == ("ext4", "/dev/nvme0n1p2", (259, 2))
    assert table[2].options == "rw,noatime,rw,attr2"
    assert mounts.mounts(str(tmp_path / "missing")) == []


def test_the_mount_of_a_path_is_the_longest_above_it_the_last_of_equals(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "ab").mkdir()
    root, a, over = (_mount(p, "ext4", (8, 0)) for p in (tmp_path, tmp_path / "a", tmp_path / "a"))
    table = [root, a, over]
    assert mounts.mount_of(tmp_path / "a" / "b", table) is over
    assert mounts.mount_of(tmp_path / "ab", table) is root
    # A directory still to be made is on its nearest existing ancestor's mount.
    assert mounts.mount_of(tmp_path / "a" / "new" / "dir", table) is over


@pytest.fixture
def sysfs(tmp_path):
    """A /sys with an NVMe SSD (a partition of it at 259:1, the disk at 259:0), a rotational
    disk (8:0) and a device-mapper volume on an SSD (253:0)."""
    root = tmp_path / "sys"
    devices = root / "devices"
    for disk, rot in (("pci/nvme0n1", "0"), ("pci/sda", "1"), ("virtual/dm-0", "0")):
        (devices / disk / "queue").mkdir(parents=True)
        (devices / disk / "queue" / "rotational").write_text(rot + "\n")
    (devices / "pci/nvme0n1/nvme0n1p1").mkdir()
    (devices / "pci/nvme0n1/nvme0n1p1/partition").write_text("1\n")
    (root / "dev" / "block").mkdir(parents=True)
    for dev, target in (
        ("259:0", "pci/nvme0n1"),
        ("259:1", "pci/nvme0n1/nvme0n1p1"),
        ("8:0", "pci/sda"),
        ("253:0", "virtual/dm-0"),
    ):
        os.symlink(f"../../devices/{target}", root / "dev" / "block" / dev)
    return str(root)


def _mount(path: Path, fstype: str, dev: tuple[int, int], source: str = "/dev/x", options: str = "rw") -> Mount:
    path.mkdir(parents=True, exist_ok=True)
    return Mount(str(path.resolve()), fstype, source, options, dev)


@pytest.mark.parametrize(
    ("fstype", "dev", "source", "medium", "disk", "said"),
    [
        ("ext4", (259, 1), "/dev/x", Medium.SSD, "nvme0n1p1", "ext4 on nvme0n1p1, a local SSD"),
        ("xfs", (253, 0), "/dev/x", Medium.SSD, "dm-0", "xfs on dm-0, a local SSD"),
        ("ext4", (8, 0), "/dev/x", Medium.ROTATIONAL, "sda", "ext4 on sda, a local disk the kernel calls rotational"),
        ("nfs4", (0, 50), "fs1:/export", Medium.NETWORK, None, "nfs4 from fs1:/export, a network file system"),
        ("lustre", (0, 51), "10.0.0.1@o2ib:/fs", Medium.NETWORK, None, "lustre from 10.0.0.1@o2ib:/fs, a network"),
        ("fuse.sshfs", (0, 52), "me@h:/d", Medium.NETWORK, None, "fuse.sshfs from me@h:/d, a network file system"),
        ("tmpfs", (0, 53), "tmpfs", Medium.MEMORY, None, "tmpfs, memory"),
        ("zfs", (0, 54), "tank/data", Medium.UNKNOWN, None, "zfs from tank/data, a disk not known"),
        # A local FUSE file system is told by its device, like any other.
        ("fuse.ntfs-3g", (8, 0), "/dev/x", Medium.ROTATIONAL, "sda", "fuse.ntfs-3g on sda"),
    ],
)
def test_the_medium_is_told_by_file_system_type_then_device(tmp_path, sysfs, fstype, dev, source, medium, disk, said):
    m = _mount(tmp_path / "mnt", fstype, dev, source)
    w = mounts.where(tmp_path / "mnt" / "not" / "made", [m], sysfs)
    assert w.path == m.mountpoint  # the nearest existing ancestor
    assert (w.mount, w.medium, w.disk) == (m, medium, disk)
    assert said in w.describe()
    assert w.free is not None and w.total is not None and 0 <= w.free <= w.total


def test_the_disk_of_this_repository_is_found():
    # Whatever this machine has: the mount found holds the path (same device, unless bind
    # mounted), and a block device named is one the kernel lists.
    w = mounts.where(Path(__file__).parent)
    assert w.mount is not None
    assert str(Path(__file__).resolve()).startswith(w.mount.mountpoint.rstrip("/") + "/")
    if w.disk is not None:
        assert w.medium in (Medium.SSD, Medium.ROTATIONAL)
        assert os.path.exists(f"/sys/class/block/{w.disk}")


def test_local_ssds_lists_writable_local_ssds_once_each(tmp_path, sysfs, monkeypatch):
    ssd = _mount(tmp_path / "ssd", "ext4", (259, 1))
    table = [
        ssd,
        _mount(tmp_path / "hdd", "ext4", (8, 0)),
        _mount(tmp_path / "nfs", "nfs4", (0, 50), "fs1:/x"),
        _mount(tmp_path / "ro", "xfs", (253, 0), options="ro,relatime"),
        _mount(tmp_path / "bind", "ext4", (259, 1)),  # the same file system again
    ]
    touched = []
    for name in ("access", "stat", "statvfs"):
        real = getattr(os, name)
        monkeypatch.setattr(mounts.os, name, lambda p, *a, real=real, **k: touched.append(str(p)) or real(p, *a, **k))
    found = mounts.local_ssds(min_free=0, table=table, sys_root=sysfs)
    assert [w.path for w in found] == [ssd.mountpoint]
    # Only SSD mounts are looked at on disk: a hung network mount cannot hang this.
    assert touched and not any(p.startswith(str(tmp_path / d)) for p in touched for d in ("hdd", "nfs"))
    assert mounts.local_ssds(min_free=1 << 62, table=table, sys_root=sysfs) == []


def _network(path: str) -> Where:
    return Where(path, Mount("/home", "nfs4", "fs1:/export/home", "rw", (0, 50)), Medium.NETWORK, None, None, None)


def test_a_network_directory_is_warned_of_once_with_local_ssds_named(store_dir, monkeypatch):
    monkeypatch.setattr(paths, "_WARNED", set())
    monkeypatch.setattr(paths, "where", _network)
    ssd = Where("/raid", None, Medium.SSD, "nvme0n1", 3 << 40, 4 << 40)
    monkeypatch.setattr(paths, "local_ssds", lambda: [ssd])
    cfg = Config.from_dict(store_config(store_dir), source="test.toml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert paths.check_paths(cfg) == [str(store_dir)]  # a warning, not an error
        paths.check_paths(cfg)
    said = [str(w.message) for w in caught if issubclass(w.category, SsdtierWarning)]
    assert said == [
        f"ssdtier: test.toml: nvme[0].path = '{store_dir}' is on nfs4 from fs1:/export/home, a network "
        "file system: every step's activations would cross the network. Point it at a local SSD: "
        "here /raid (3TiB free)"
    ]


def test_the_warning_points_at_the_attach_call(store_dir, monkeypatch):
    monkeypatch.setattr(paths, "_WARNED", set())
    monkeypatch.setattr(paths, "where", _network)
    monkeypatch.setattr(paths, "local_ssds", lambda: [])
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = ssdtier.attach(model, store_config(store_dir))
    off.detach()
    (w,) = [w for w in caught if "network" in str(w.message)]
    assert w.filename == __file__
    assert str(w.message).endswith("Point it at a local SSD")


def test_a_local_directory_is_not_warned_of(store_dir, warned, monkeypatch):
    monkeypatch.setattr(paths, "_WARNED", set())
    paths.check_paths(Config.from_dict(store_config(store_dir)))
    assert warned("network") == []
