"""What machine a benchmark ran on, and how busy it was: shared by the scripts in ``benches/``.

The scripts run as ``python benches/<script>.py``, so this directory is on
``sys.path`` and they import it as ``_machine``. Only the standard library is
used at import (ssdtier only inside ``mount_of``), so importing it costs nothing.
"""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

__all__ = [
    "cpu_busy_seconds",
    "cpu_model",
    "hostname",
    "kernel",
    "loadavg",
    "machine_info",
    "mem_total",
    "mount_of",
    "nproc",
]


def mount_of(path: str | os.PathLike[str]) -> dict[str, str]:
    """Device, mount point, file system type, options and medium (SSD, rotational, network)
    of the mount holding ``path``."""
    from ssdtier.mounts import where  # imported here: the package imports torch

    w = where(path)
    m = w.mount
    if m is None:
        return {"device": "?", "mountpoint": "?", "fstype": "?", "options": "", "medium": w.describe()}
    return {
        "device": m.source,
        "mountpoint": m.mountpoint,
        "fstype": m.fstype,
        "options": m.options,
        "medium": w.describe(),
    }


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` or "?" without it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "?"


def mem_total() -> int:
    """MemTotal from /proc/meminfo, bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def nproc() -> int:
    """CPUs this process may run on (its affinity mask), like ``nproc``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def hostname() -> str:
    return socket.gethostname()


def kernel() -> str:
    return platform.release()


def machine_info(directory: Path) -> dict[str, Any]:
    """Host name, CPUs, kernel, CPU model, RAM and the mount holding ``directory``."""
    return {
        "hostname": hostname(),
        "nproc": nproc(),
        "kernel": kernel(),
        "cpu": cpu_model(),
        "mem_total": mem_total(),
        "mount": mount_of(directory),
    }


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages ([] when unknown)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return []


def cpu_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (all processes, kernel included)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6] + (vals[7] if len(vals) > 7 else 0)
    return busy / hz
