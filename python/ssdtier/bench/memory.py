"""Peak memory over a region of a run: the RSS high-water mark on the CPU, the caching
allocator's peak on CUDA."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from typing import Any

__all__ = ["CpuPeak", "CudaPeak", "free_cuda", "mapping_rss", "malloc_trim", "proc_status"]


def proc_status(*keys: str) -> dict[str, int]:
    """Byte counts of ``keys`` (``VmRSS``, ``VmHWM``...) from /proc/self/status."""
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def mapping_rss(address: int) -> int:
    """Resident bytes of this process's mapping that starts at ``address`` (from /proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                found = int(head.split("-", 1)[0], 16) == address
            elif found and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return 0


def malloc_trim() -> bool:
    """Give glibc's free heap memory back to the system (so that the baseline is what is live)."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def free_cuda() -> None:
    """Between runs in one process, and after an out of memory: Python's garbage, then the
    caching allocators' blocks (the device's, and the pinned host blocks that save_on_cpu and
    torchtune leave)."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()


class CpuPeak:
    """Peak RSS over a region: VmHWM after it minus VmRSS at its start.

    ``/proc/self/clear_refs`` = 5 resets VmHWM to the current RSS. Where the kernel
    refuses that, a thread samples VmRSS every millisecond instead (and says so).
    """

    def __init__(self) -> None:
        self.method = "VmHWM after clear_refs=5"
        self.baseline = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled = 0

    def start(self) -> None:
        gc.collect()
        malloc_trim()
        self.baseline = proc_status("VmRSS")["VmRSS"]
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            hwm = proc_status("VmHWM")["VmHWM"]
            if hwm > self.baseline + (16 << 20):
                raise OSError("VmHWM was not reset")
        except OSError as e:
            self.method = f"VmRSS sampled every 1 ms (clear_refs unusable: {e})"
            self._sampled = self.baseline
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, proc_status("VmRSS")["VmRSS"])
            time.sleep(0.001)

    def stop(self) -> tuple[int, int]:
        """(peak RSS in the region, baseline RSS), bytes."""
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            return self._sampled, self.baseline
        return proc_status("VmHWM")["VmHWM"], self.baseline


class CudaPeak:
    """Peak of ``torch.cuda.max_memory_allocated`` over a region, and the allocation at its start.
    After ``stop()``, ``reserved`` is the peak the allocator held from the device (cached blocks
    let go at the start): unlike ``allocated`` it counts a freed block that still waits for
    another stream's work on it (``record_stream``), such as a copy to host memory, and
    ``retries`` how often an allocation failed and was retried after the cache was emptied
    (each a synchronization: memory pressure the peaks do not show)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.method = "torch.cuda.max_memory_allocated delta"
        self.baseline = 0
        self.reserved = 0
        self.retries = 0

    def start(self) -> None:
        import torch

        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)
        self.retries = -torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def stop(self) -> tuple[int, int]:
        import torch

        torch.cuda.synchronize(self.device)
        self.reserved = torch.cuda.max_memory_reserved(self.device)
        self.retries += torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        return torch.cuda.max_memory_allocated(self.device), self.baseline
