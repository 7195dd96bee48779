"""How much memory this process can still take: the kernel's MemAvailable, and the room
left under its cgroup's limit (a container's), whichever is less."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .mounts import read_kernel_file

__all__ = ["Available", "available", "pinnable"]

_V1_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2^63


@dataclass(frozen=True)
class Available:
    bytes: int
    bound: str  # what sets it: "MemAvailable" or the cgroup file that does


def pinnable(left: int) -> int:
    """Bytes of pinned memory to take of ``left``: a quarter of it, and at least 2 GiB, stay
    with the rest of the machine (pinned pages cannot be reclaimed); whole MiB."""
    return max(min(left * 3 // 4, left - (2 << 30)), 0) >> 20 << 20


def _stat(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


def _mem_available(proc: str) -> int | None:
    for line in (read_kernel_file(f"{proc}/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def _room(d: str, v2: bool) -> int | None:
    """Bytes left under the limit of cgroup directory ``d``; None without a limit. Inactive
    file pages are left out of the usage: the kernel reclaims them before it kills."""
    limit_f, usage_f, inactive = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    limit = read_kernel_file(os.path.join(d, limit_f)) or ""
    usage = read_kernel_file(os.path.join(d, usage_f)) or ""
    if not limit.isdigit() or not usage.isdigit() or int(limit) >= _V1_UNLIMITED:
        return None  # "max", unreadable, or v1's no limit
    used = int(usage) - _stat(read_kernel_file(os.path.join(d, "memory.stat")), inactive)
    return max(int(limit) - max(used, 0), 0)


def _cgroup_dirs(proc: str, root: str) -> list[tuple[str, bool]]:
    """This process's memory cgroup and its ancestors, as directories under ``root``: a limit
    may be set on any of them. A path not mounted here (a container's view) is the root."""
    out: list[tuple[str, bool]] = []
    for line in (read_kernel_file(f"{proc}/self/cgroup") or "").splitlines():
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = hid == "0" and ctrls == ""
        if not v2 and "memory" not in ctrls.split(","):
            continue
        base = root if v2 else os.path.join(root, "memory")
        p = path.strip().strip("/")
        while True:
            d = os.path.join(base, p) if p else base
            if os.path.isdir(d):
                out.append((d, v2))
            if not p:
                break
            p = os.path.dirname(p)
    return out


def available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Available | None:
    """What this process can still take without an OOM kill; None if nothing says."""
    best: Available | None = None
    found = _mem_available(proc)
    if found is not None:
        best = Available(found, "MemAvailable")
    for d, v2 in _cgroup_dirs(proc, cgroup_root):
        room = _room(d, v2)
        if room is not None and (best is None or room < best.bytes):
            best = Available(room, os.path.join(d, "memory.max" if v2 else "memory.limit_in_bytes"))
    return best
