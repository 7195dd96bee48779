"""What a directory is on: its mount, file system, disk, and whether that is local and
solid-state. Read from /proc/self/mountinfo and /sys; nothing is written."""

from __future__ import annotations

import enum
import os
import re
import stat
from dataclasses import dataclass

__all__ = ["Medium", "Mount", "Where", "local_ssds", "mount_of", "mounts", "read_kernel_file", "where"]

MOUNTINFO = "/proc/self/mountinfo"
SYS = "/sys"

# File systems whose bytes cross a network (fuse.* by subtype). 9p is left out: gVisor and
# WSL use it for local files too.
_NETWORK = frozenset(
    "nfs nfs4 cifs smb3 smbfs ncpfs ceph lustre gpfs beegfs glusterfs afs orangefs pvfs2 panfs wekafs davfs".split()
)
_NETWORK_FUSE = frozenset(
    "sshfs glusterfs s3fs gcsfuse juicefs rclone goofys blobfuse blobfuse2 mountpoint-s3 ceph-fuse davfs2 weka".split()
)
_MEMORY = frozenset({"tmpfs", "ramfs"})


class Medium(enum.Enum):
    """What a file system's bytes live on, as the kernel tells."""

    SSD = "a local SSD"
    ROTATIONAL = "a local disk the kernel calls rotational (virtual disks often say so)"
    NETWORK = "a network file system"
    MEMORY = "memory (its files take RAM)"
    UNKNOWN = "a disk not known"


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    mountpoint: str
    fstype: str
    source: str
    options: str
    dev: tuple[int, int]  # major, minor


@dataclass(frozen=True)
class Where:
    """A directory's mount, its medium, the block device under it and the space there."""

    path: str
    mount: Mount | None
    medium: Medium
    disk: str | None
    free: int | None
    total: int | None

    def describe(self) -> str:
        m = self.mount
        fs = m.fstype if m else "?"
        if self.disk:
            on = f" on {self.disk}"
        else:  # a server's export, a pool's dataset; not a name that repeats the type
            on = f" from {m.source}" if m and m.source not in ("", "none", m.fstype) else ""
        return f"{fs}{on}, {self.medium.value}"


def _unescape(s: str) -> str:
    # The kernel writes space, tab, newline and backslash as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)


def mounts(path: str = MOUNTINFO) -> list[Mount]:
    """The mounts this process sees, in the kernel's order; [] if they cannot be read."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        pre, sep, post = line.partition(" - ")
        a, b = pre.split(), post.split()
        if not sep or len(a) < 6 or len(b) < 2:
            continue
        major, _, minor = a[2].partition(":")
        try:
            dev = (int(major), int(minor))
        except ValueError:
            continue
        opts = a[5] + ("," + b[2] if len(b) > 2 else "")
        out.append(Mount(_unescape(a[4]), b[0], _unescape(b[1]), opts, dev))
    return out


def mount_of(path: str | os.PathLike[str], table: list[Mount] | None = None) -> Mount | None:
    """The mount holding ``path`` (its nearest existing ancestor): the longest mount point
    above it, the last mounted of equals (an over-mount hides the one below)."""
    real = os.path.realpath(existing(path))
    best: Mount | None = None
    for m in mounts() if table is None else table:
        mp = m.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) >= len(best.mountpoint)):
            best = m
    return best


def existing(path: str | os.PathLike[str]) -> str:
    """``path``, or its nearest ancestor that exists (where a directory would be created)."""
    p = os.path.abspath(os.path.expanduser(os.fspath(path)))
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def read_kernel_file(path: str) -> str | None:
    """A small file of /proc or /sys, stripped; None if it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _disk(dev: tuple[int, int], sys_root: str) -> tuple[str, bool] | None:
    """The block device ``dev`` (name) and whether the kernel calls it rotational; a
    partition's answer is its disk's."""
    node = os.path.realpath(f"{sys_root}/dev/block/{dev[0]}:{dev[1]}")
    for d in (node, os.path.dirname(node)):
        rot = read_kernel_file(f"{d}/queue/rotational")
        if rot in ("0", "1"):
            return os.path.basename(node), rot == "1"
    return None


def _rdev(source: str) -> tuple[int, int] | None:
    if not source.startswith("/dev/"):
        return None
    try:
        st = os.stat(source)
    except OSError:
        return None
    return (os.major(st.st_rdev), os.minor(st.st_rdev)) if stat.S_ISBLK(st.st_mode) else None


def _medium(m: Mount | None, st_dev: tuple[int, int] | None, sys_root: str) -> tuple[Medium, str | None]:
    if m is not None:
        fs = m.fstype
        if fs in _MEMORY:
            return Medium.MEMORY, None
        if fs in _NETWORK or (fs.startswith("fuse.") and fs[5:] in _NETWORK_FUSE):
            return Medium.NETWORK, None
    # The path's own device, then the mount's (btrfs gives each subvolume an anonymous one),
    # then the device node it was mounted from.
    for dev in (st_dev, m and m.dev, m and _rdev(m.source)):
        found = _disk(dev, sys_root) if dev and dev[0] else None
        if found:
            return (Medium.ROTATIONAL if found[1] else Medium.SSD), found[0]
    return Medium.UNKNOWN, None


def where(path: str | os.PathLike[str], table: list[Mount] | None = None, sys_root: str = SYS) -> Where:
    """What ``path`` (or its nearest existing ancestor) is on."""
    p = existing(path)
    try:
        s = os.stat(p)
        st_dev: tuple[int, int] | None = (os.major(s.st_dev), os.minor(s.st_dev))
    except OSError:
        st_dev = None
    m = mount_of(p, table)
    medium, disk = _medium(m, st_dev, sys_root)
    try:
        v = os.statvfs(p)
        free, total = v.f_bavail * v.f_frsize, v.f_blocks * v.f_frsize
    except OSError:
        free = total = None
    return Where(p, m, medium, disk, free, total)


_NOT_FOR_DATA = ("/boot", "/efi", "/proc", "/sys", "/dev", "/run", "/snap")


def local_ssds(
    min_free: int = 10 << 30, table: list[Mount] | None = None, sys_root: str = SYS, limit: int = 3
) -> list[Where]:
    """Writable directories on local SSDs with at least ``min_free`` bytes free, most free
    first: each such file system's mount point (``/var/tmp`` for the root's)."""
    table = mounts() if table is None else table
    seen: set[tuple[int, int]] = set()
    found = []
    for m in table:
        mp = m.mountpoint
        if m.dev in seen or "ro" in m.options.split(",") or mp.startswith(_NOT_FOR_DATA):
            continue
        # Told from the mount line and /sys first: a network mount is never touched (a stale
        # NFS mount would hang a stat), nor an automount point.
        if _medium(m, None, sys_root)[0] is not Medium.SSD:
            continue
        d = os.path.join(mp, "var/tmp") if mp == "/" else mp
        if not os.path.isdir(d) or not os.access(d, os.W_OK | os.X_OK):
            continue
        w = where(d, table, sys_root)
        if w.medium is Medium.SSD and w.mount == m and (w.free or 0) >= min_free:
            seen.add(m.dev)
            found.append(w)
    found.sort(key=lambda w: -(w.free or 0))
    return found[:limit]
