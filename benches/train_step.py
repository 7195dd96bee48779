#!/usr/bin/env python3
"""Training-step memory and time of ``ssdtier.attach`` next to the usual alternatives.

One run, one model (a :class:`ssdtier.models.GPT`), four modes:

``keep``
    plain training: autograd keeps every saved activation in memory.
``ssdtier``
    ``ssdtier.attach(model, cfg)``: saved activations go to a small host arena
    (``--arena``) and beyond it to NVMe files in ``--dir``.
``checkpoint``
    the same model built with ``checkpoint=True``: every block runs through
    non-reentrant ``torch.utils.checkpoint`` and is recomputed in backward.
``save_on_cpu``
    ``torch.autograd.graph.save_on_cpu(pin_memory=False)`` around the forward.
    On a CPU-only machine ``tensor.cpu()`` is a no-op, so this is plain training
    plus the cost of a pair of Python hooks per saved tensor.

A step is forward + backward + optimizer step (AdamW by default). For each mode
the script reports the median step time over ``--steps`` steps (``--warmup``
steps before them are excluded) and the peak activation memory:

* CPU: each mode runs in a fresh subprocess (the script re-invokes itself with
  a hidden ``--worker MODE``). After the warmup steps, once model, gradients,
  optimizer state and batch exist, the worker calls ``malloc_trim(0)``, reads
  ``VmRSS`` from ``/proc/self/status`` as the baseline and writes ``5`` to
  ``/proc/self/clear_refs``, which resets the kernel's RSS high-water mark
  (``VmHWM``) to the current RSS. Peak = ``VmHWM`` after the measured steps
  minus that baseline. ssdtier's host arena is process memory that is already
  resident in the baseline (io_uring fixed-buffer registration pins it at
  attach time, and the warmup fills it anyway), so its full size is *added* to
  ssdtier's peak.
* CUDA (when available and ``--device`` allows it): the modes run in this
  process, one after the other; peak = ``torch.cuda.max_memory_allocated()``
  after the measured steps minus ``memory_allocated()`` when the peak was
  reset. The host arena is host memory and is reported, not added.

Before timing, the losses of the first steps (same seeds, same batch) of
``ssdtier`` are compared bitwise with those of ``keep``; the second loss comes
after one optimizer step, so it depends on ssdtier's backward too.

Second part, "cost per saved tensor": a deep stack of tiny Linear+Tanh blocks
(``--pt-layers`` x width ``--pt-width``, batch ``--pt-batch``), in this process,
with ``policy.min_tensor_bytes = 0`` and ``keep_last_layers = 0`` so every saved
tensor goes through ssdtier's hooks, and a large arena so nothing waits for I/O.
(time of fwd+bwd with ssdtier - time without) / saved tensors per iteration (the
``OffloadStats.packs`` count: every call of the pack hook, parameters included)
gives microseconds per saved tensor for pack + unpack; the same for
``save_on_cpu``.

The goal line (CPU: ssdtier memory <= 0.4 of keep and step time <= 1.05 of keep)
is reporting only: the exit status is 0 unless something failed.

Example::

    .venv/bin/python benches/train_step.py --json /tmp/train_step.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "target" / "bench-train"
MODES = ("keep", "ssdtier", "checkpoint", "save_on_cpu")
RESULT_TAG = "@@train_step_result "
GOAL_MEM = 0.4
GOAL_TIME = 1.05
MB = 1e6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fail(msg: str, code: int = 2) -> None:
    print(f"train_step: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


# ---------------------------------------------------------------- machine info


def _unescape_mount(s: str) -> str:
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        s = s.replace(esc, ch)
    return s


def mount_of(path: Path) -> dict[str, str]:
    """Device, mount point, file system type and options of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = {"device": "?", "mountpoint": "?", "fstype": "?", "options": ""}
    best_len = -1
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt = _unescape_mount(parts[1])
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= best_len:
                    best_len = len(mnt)
                    best = {
                        "device": _unescape_mount(parts[0]),
                        "mountpoint": mnt,
                        "fstype": parts[2],
                        "options": parts[3],
                    }
    except OSError:
        pass
    return best


def cpu_model() -> str:
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
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def machine_info(directory: Path) -> dict[str, Any]:
    import torch

    try:
        nproc = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        nproc = os.cpu_count() or 0
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "nproc": nproc,
        "cpu": cpu_model(),
        "kernel": platform.release(),
        "mem_total": mem_total(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dir": str(directory),
        "mount": mount_of(directory),
    }
    return info


# ---------------------------------------------------------------- memory probes


def _proc_status_kib(*keys: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def _malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


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
        _malloc_trim()
        self.baseline = _proc_status_kib("VmRSS")["VmRSS"]
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            hwm = _proc_status_kib("VmHWM")["VmHWM"]
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
            self._sampled = max(self._sampled, _proc_status_kib("VmRSS")["VmRSS"])
            time.sleep(0.001)

    def stop(self) -> tuple[int, int]:
        """(peak RSS in the region, baseline RSS), bytes."""
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            return self._sampled, self.baseline
        return _proc_status_kib("VmHWM")["VmHWM"], self.baseline


class CudaPeak:
    def __init__(self, device: Any) -> None:
        self.device = device
        self.method = "torch.cuda.max_memory_allocated delta"
        self.baseline = 0

    def start(self) -> None:
        import torch

        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)

    def stop(self) -> tuple[int, int]:
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device), self.baseline


# ---------------------------------------------------------------- one mode


def gpt_config(args: argparse.Namespace, checkpoint: bool) -> Any:
    from ssdtier.models import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=args.dropout,
        checkpoint=checkpoint,
    )


def ssdtier_config(args: argparse.Namespace, arena: str, min_bytes: Any, keep_last: Any) -> dict[str, Any]:
    return {
        "host": {"capacity": arena},
        "nvme": [{"path": str(args.dir), "capacity": args.nvme_capacity}],
        "policy": {
            "min_tensor_bytes": min_bytes,
            "keep_last_layers": keep_last,
            "prefetch_layers": args.prefetch_layers,
        },
    }


def _keep_last(value: str) -> int | str:
    return value if value == "auto" else int(value)


def stats_dict(stats: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(stats)


def stats_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in after.items():
        if k in ("peak_resident_bytes", "layers_offloaded", "layers_kept") or k.endswith(
            ("_peak", "_capacity", "_used")
        ):
            out[k] = v
        elif isinstance(v, dict):
            out[k] = stats_delta(v, before[k])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v - before[k]
    return out


def run_mode(mode: str, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Build, warm up, then measure one mode; returns a JSON-able dict."""
    import torch
    from ssdtier.models import batch_loss, build_model, make_batch

    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    cfg = gpt_config(args, checkpoint=mode == "checkpoint")
    model = build_model(cfg).to(device)
    if args.optim == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    batch = make_batch(cfg, args.batch, torch.Generator().manual_seed(args.seed + 1), device=device)
    off = None
    extra: dict[str, Any] = {}
    if mode == "ssdtier":
        import ssdtier

        scfg = ssdtier_config(args, args.arena, args.min_tensor_bytes, _keep_last(args.keep_last_layers))
        off = ssdtier.attach(model, scfg)
        store = off.store
        extra["store"] = {
            "backend": store.backend,
            "direct": store.direct,
            "fixed_buffers": store.fixed_buffers,
            "arena_bytes": store.arena.numel() if store.arena is not None else 0,
            "layers_path": off.layers_path,
        }
    # Dropout masks: the same stream in every mode.
    torch.manual_seed(args.seed + 2)

    def step() -> torch.Tensor:
        # Gradients stay allocated (zeroed in place): they are in the baseline, not in the peak.
        opt.zero_grad(set_to_none=False)
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                loss = batch_loss(model, batch)
        else:
            loss = batch_loss(model, batch)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        return loss.detach()

    losses: list[float] = []
    warm_times: list[float] = []
    for i in range(args.warmup):
        t0 = time.perf_counter()
        loss = step()
        warm_times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        log(f"  [{mode}] warmup {i + 1}/{args.warmup}: {warm_times[-1]:.3f} s, loss {losses[-1]:.6f}")

    before = stats_dict(off.stats()) if off is not None else None
    probe: Any = CudaPeak(device) if cuda else CpuPeak()
    probe.start()
    times: list[float] = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        log(f"  [{mode}] step {i + 1}/{args.steps}: {times[-1]:.3f} s, loss {losses[-1]:.6f}")
    peak_abs, baseline = probe.stop()
    peak = peak_abs - baseline
    arena_added = 0
    if off is not None and not cuda:
        arena_added = extra["store"]["arena_bytes"]
    result: dict[str, Any] = {
        "mode": mode,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "memory_method": probe.method,
        "baseline_bytes": baseline,
        "peak_abs_bytes": peak_abs,
        "peak_measured_bytes": peak,
        "arena_added_bytes": arena_added,
        "peak_bytes": peak + arena_added,
        "step_seconds": times,
        "warmup_seconds": warm_times,
        "median_step_s": statistics.median(times) if times else float("nan"),
        "losses": [x.hex() for x in losses],
        **extra,
    }
    if off is not None:
        after = stats_dict(off.stats())
        result["offload_stats_total"] = after
        result["offload_stats_measured"] = stats_delta(after, before) if before else after
        if args.profile and not cuda:
            result["profile"] = profile_steps(step, args.profile_steps, args.profile)
        off.detach()
    return result


def profile_steps(step: Any, n: int, top: int) -> str:
    """cProfile of ``n`` extra steps (not part of the timings), top ``top`` by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def worker_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    res = run_mode(args.worker, args, torch.device("cpu"))
    sys.stdout.write(RESULT_TAG + json.dumps(res) + "\n")
    sys.stdout.flush()


def run_worker(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--worker", mode]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        fail(
            f"the {mode} worker did not finish within {args.worker_timeout} s (hang?); "
            f"reproduce with: {' '.join(cmd)}",
            3,
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG) :])
            res["process_seconds"] = time.perf_counter() - t0
            return res
    fail(f"the {mode} worker failed (exit status {proc.returncode}); reproduce with: {' '.join(cmd)}", 3)
    raise AssertionError  # unreachable


# ---------------------------------------------------------------- cost per saved tensor


def per_tensor_cost(args: argparse.Namespace) -> dict[str, Any]:
    """µs per saved tensor (pack + unpack) of ssdtier and save_on_cpu on a deep stack of tiny layers."""
    import copy

    import ssdtier
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)
            self.act = nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    class Stack(nn.Module):
        def __init__(self, n: int, width: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Tiny(width) for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x.square().mean()

    torch.manual_seed(args.seed)
    plain = Stack(args.pt_layers, args.pt_width)
    ssd_model = copy.deepcopy(plain)
    x = torch.randn(args.pt_batch, args.pt_width, generator=torch.Generator().manual_seed(args.seed))

    n_saved = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal n_saved
        n_saved += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        plain(x).backward()

    cfg = ssdtier_config(args, args.pt_arena, 0, 0)
    off = ssdtier.attach(ssd_model, cfg)

    def run(model: nn.Module, ctx: Any) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if ctx is None:
            loss = model(x)
        else:
            with ctx:
                loss = model(x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    variants = {
        "plain": lambda: run(plain, None),
        "ssdtier": lambda: run(ssd_model, None),
        "save_on_cpu": lambda: run(plain, torch.autograd.graph.save_on_cpu(pin_memory=False)),
    }
    for _ in range(args.pt_warmup):
        for fn in variants.values():
            fn()
    before = off.stats()
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    # Interleaved, so that drift (frequency, other load) hits every variant alike.
    for _ in range(args.pt_reps):
        for k, fn in variants.items():
            samples[k].append(fn())
    after = off.stats()
    off.detach()
    reps = args.pt_reps
    packs = (after.packs - before.packs) / reps
    unpacks = (after.unpacks - before.unpacks) / reps
    offloaded = (after.tensors_offloaded - before.tensors_offloaded) / reps
    out: dict[str, Any] = {
        "layers": args.pt_layers,
        "width": args.pt_width,
        "batch": args.pt_batch,
        "reps": reps,
        "arena": args.pt_arena,
        "saved_tensors_per_iter": n_saved,
        "ssdtier_packs_per_iter": packs,
        "ssdtier_unpacks_per_iter": unpacks,
        "ssdtier_offloaded_per_iter": offloaded,
        "ssdtier_dedup_hits_per_iter": (after.dedup_hits - before.dedup_hits) / reps,
        "ssdtier_kept_per_iter": (after.tensors_kept - before.tensors_kept) / reps,
        "ssdtier_nvme_bytes_written": after.bytes_written_nvme - before.bytes_written_nvme,
        "ssdtier_stall_seconds": after.stall_seconds - before.stall_seconds,
    }
    med = {}
    for k, s in samples.items():
        fwd = statistics.median(a for a, _ in s)
        bwd = statistics.median(b for _, b in s)
        tot = statistics.median(a + b for a, b in s)
        med[k] = {"fwd_s": fwd, "bwd_s": bwd, "total_s": tot}
    out["median"] = med
    base = med["plain"]
    for k, n in (("ssdtier", packs), ("save_on_cpu", float(n_saved))):
        m = med[k]
        out[f"{k}_us_per_tensor"] = (m["total_s"] - base["total_s"]) / n * 1e6
        out[f"{k}_us_per_pack_fwd"] = (m["fwd_s"] - base["fwd_s"]) / n * 1e6
        out[f"{k}_us_per_unpack_bwd"] = (m["bwd_s"] - base["bwd_s"]) / n * 1e6
    return out


# ---------------------------------------------------------------- report


def fmt_mb(n: float) -> str:
    return f"{n / MB:,.0f}"


def losses_equal(a: list[str], b: list[str], n: int) -> bool:
    import torch

    if len(a) < n or len(b) < n:
        return False
    ta = torch.tensor([float.fromhex(x) for x in a[:n]], dtype=torch.float64)
    tb = torch.tensor([float.fromhex(x) for x in b[:n]], dtype=torch.float64)
    return torch.equal(ta, tb)


def render(info: dict[str, Any], args: argparse.Namespace, results: dict[str, Any]) -> str:
    runs: dict[str, dict[str, Any]] = results["modes"]
    lines: list[str] = []
    m = info["mount"]
    lines.append("== ssdtier training-step benchmark ==")
    lines.append(
        f"machine: {info['hostname']}, {info['nproc']} CPUs ({info['cpu']}), "
        f"{info['mem_total'] / 2**30:.1f} GiB RAM, kernel {info['kernel']}"
    )
    lines.append(
        f"software: Python {info['python']}, torch {info['torch']}, "
        f"{runs['keep']['threads']} torch threads per process"
        + (f", CUDA {info['cuda']}" if info["cuda"] else ", no CUDA")
    )
    lines.append(f"--dir: {info['dir']} on {m['device']} ({m['fstype']}, {m['options']})")
    st = runs["ssdtier"].get("store", {})
    lines.append(
        f"ssdtier: backend {st.get('backend')}, O_DIRECT {st.get('direct')}, "
        f"fixed buffers {st.get('fixed_buffers')}, arena {args.arena}, "
        f"min_tensor_bytes {args.min_tensor_bytes}, keep_last_layers {args.keep_last_layers}, "
        f"prefetch_layers {args.prefetch_layers}, layers {st.get('layers_path')!r}"
    )
    lines.append(
        f"model: GPT vocab {args.vocab}, seq {args.seq}, d_model {args.d_model}, layers {args.layers}, "
        f"heads {args.heads}, dropout {args.dropout}; batch {args.batch}; optimizer {args.optim}; "
        f"{args.warmup} warmup + {args.steps} measured steps (fwd+bwd+optimizer step)"
    )
    cuda = results["device"] == "cuda"
    if cuda:
        lines.append(
            "memory: torch.cuda.max_memory_allocated() over the measured steps minus "
            "memory_allocated() at reset_peak_memory_stats(); modes run in one process; "
            "the host arena is host memory and is not counted."
        )
    else:
        lines.append(
            f"memory: each mode in a fresh process; {runs['keep']['memory_method']}: after warmup, "
            "malloc_trim(0), baseline = VmRSS, write 5 to /proc/self/clear_refs; "
            "peak = VmHWM after the measured steps - baseline. Gradients and optimizer state are "
            "in the baseline. ssdtier: its whole host arena "
            f"({fmt_mb(runs['ssdtier'].get('arena_added_bytes', 0))} MB) is resident in the baseline "
            "and is added to its peak."
        )
    lines.append("")
    keep = runs["keep"]
    hdr = ("mode", "peak act. memory (MB)", "ratio vs keep", "median step (s)", "ratio vs keep")
    rows = []
    for mode in MODES:
        r = runs[mode]
        mem = r["peak_bytes"]
        label = mode + (" (+arena)" if r.get("arena_added_bytes") else "")
        rows.append(
            (
                label,
                fmt_mb(mem),
                f"{mem / keep['peak_bytes']:.3f}" if keep["peak_bytes"] > 0 else "n/a",
                f"{r['median_step_s']:.3f}",
                f"{r['median_step_s'] / keep['median_step_s']:.3f}",
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for mode in MODES:
        r = runs[mode]
        ts = r["step_seconds"]
        lines.append(
            f"{mode}: step times {', '.join(f'{t:.2f}' for t in ts)} s; baseline RSS/alloc "
            f"{fmt_mb(r['baseline_bytes'])} MB, measured peak {fmt_mb(r['peak_measured_bytes'])} MB"
            + (f" + arena {fmt_mb(r['arena_added_bytes'])} MB" if r.get("arena_added_bytes") else "")
        )
    lines.append("")
    eq = results["losses_identical"]
    lines.append(
        f"losses identical: {'yes' if eq['ssdtier'] else 'no'} "
        f"(ssdtier vs keep, first {eq['n']} losses, bitwise; the 2nd comes after one optimizer step)"
    )
    others = ", ".join(f"{k} {'yes' if eq[k] else 'no'}" for k in ("checkpoint", "save_on_cpu"))
    lines.append(f"  other modes vs keep: {others}; all losses ssdtier vs keep: {eq['ssdtier_all']}")
    s = runs["ssdtier"].get("offload_stats_measured", {})
    n = args.steps
    if s:
        lines.append("")
        lines.append(f"ssdtier OffloadStats over the {n} measured steps (per step in brackets):")
        lines.append(
            f"  offloaded {s['tensors_offloaded']} tensors / {fmt_mb(s['bytes_offloaded'])} MB "
            f"[{fmt_mb(s['bytes_offloaded'] / n)} MB]; NVMe written {fmt_mb(s['bytes_written_nvme'])} MB "
            f"[{fmt_mb(s['bytes_written_nvme'] / n)}], read {fmt_mb(s['bytes_read_nvme'])} MB "
            f"[{fmt_mb(s['bytes_read_nvme'] / n)}]"
        )
        lines.append(
            f"  kept {s['tensors_kept']} tensors / {fmt_mb(s['bytes_kept'])} MB; forwarded (served without "
            f"NVMe read) {s['forwarded']}; dedup hits {s['dedup_hits']}; packs {s['packs']}, "
            f"unpacks {s['unpacks']}"
        )
        lines.append(
            f"  stall {s['stall_seconds']:.3f} s [{s['stall_seconds'] / n:.3f} s]; store wait "
            f"{s['store']['wait_seconds']:.3f} s; "
            f"peak_resident_bytes {fmt_mb(s['peak_resident_bytes'])} MB; layers offloaded "
            f"{s['layers_offloaded']}, kept {s['layers_kept']}"
        )
        tot = runs["ssdtier"]["offload_stats_total"]["store"]
        lines.append(
            f"  store (whole run): evictions {tot['evictions']}, prefetches {tot['prefetches']} "
            f"(skipped {tot['prefetch_skipped']}), host hits {tot['host_hits']}, nvme hits "
            f"{tot['nvme_hits']}, wait {tot['wait_seconds']:.3f} s, host peak "
            f"{fmt_mb(tot['host_peak'])} MB, nvme peak {fmt_mb(tot['nvme_peak'])} MB"
        )
    pt = results.get("per_tensor")
    if pt:
        lines.append("")
        lines.append(
            f"cost per saved tensor: {pt['layers']} x (Linear({pt['width']},{pt['width']}) + Tanh), "
            f"batch {pt['batch']}, {pt['reps']} interleaved reps, in one process; ssdtier with "
            f"min_tensor_bytes 0, keep_last_layers 0, arena {pt['arena']}"
        )
        lines.append(
            f"  saved tensors per fwd+bwd: {pt['saved_tensors_per_iter']} (ssdtier packs "
            f"{pt['ssdtier_packs_per_iter']:.0f}: offloaded {pt['ssdtier_offloaded_per_iter']:.0f}, "
            f"dedup hits {pt['ssdtier_dedup_hits_per_iter']:.0f}, kept {pt['ssdtier_kept_per_iter']:.0f}, "
            "the rest parameters; unpacks "
            f"{pt['ssdtier_unpacks_per_iter']:.0f}); NVMe bytes written {pt['ssdtier_nvme_bytes_written']}"
        )
        med = pt["median"]
        lines.append(
            "  median fwd / bwd / total (ms): "
            + "; ".join(
                f"{k} {v['fwd_s'] * 1e3:.2f} / {v['bwd_s'] * 1e3:.2f} / {v['total_s'] * 1e3:.2f}"
                for k, v in med.items()
            )
        )
        for k in ("ssdtier", "save_on_cpu"):
            lines.append(
                f"  {k}: {pt[f'{k}_us_per_tensor']:.1f} us per saved tensor (pack+unpack) "
                f"[fwd {pt[f'{k}_us_per_pack_fwd']:.1f} + bwd {pt[f'{k}_us_per_unpack_bwd']:.1f}]"
            )
    lines.append("")
    sr = runs["ssdtier"]
    mem_ratio = sr["peak_bytes"] / keep["peak_bytes"] if keep["peak_bytes"] > 0 else float("inf")
    time_ratio = sr["median_step_s"] / keep["median_step_s"]
    met = mem_ratio <= GOAL_MEM and time_ratio <= GOAL_TIME
    what = "CUDA" if cuda else "CPU"
    lines.append(
        f"goal ({what}): ssdtier memory <= {GOAL_MEM} of keep and step time <= {GOAL_TIME} of keep: "
        f"{'MET' if met else 'NOT MET'} (memory {mem_ratio:.3f}, time {time_ratio:.3f})"
    )
    results["goal"] = {"met": met, "memory_ratio": mem_ratio, "time_ratio": time_ratio}
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Peak activation memory and median step time of one GPT model trained four ways: "
            "keep (plain), ssdtier (attach), checkpoint (per-block torch.utils.checkpoint), "
            "save_on_cpu; then ssdtier's cost per saved tensor. On CPU every mode runs in a "
            "fresh subprocess and memory is the RSS high-water mark above the post-warmup baseline."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and training")
    g.add_argument("--layers", type=int, default=8, help="GPT blocks")
    g.add_argument("--d-model", type=int, default=256, help="model width")
    g.add_argument("--seq", type=int, default=256, help="sequence length")
    g.add_argument("--batch", type=int, default=8, help="batch size")
    g.add_argument("--heads", type=int, default=8, help="attention heads")
    g.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    g.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    g.add_argument("--optim", choices=("adamw", "sgd"), default="adamw", help="optimizer")
    g.add_argument("--steps", type=int, default=8, help="measured steps per mode")
    g.add_argument("--warmup", type=int, default=2, help="warmup steps per mode (not timed)")
    g.add_argument("--seed", type=int, default=0, help="seed of weights, batch and dropout")
    g.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads in every process"
    )
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when available (modes in this process), else CPU (a subprocess per mode)",
    )
    g = p.add_argument_group("ssdtier")
    g.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="NVMe directory (not tmpfs)")
    g.add_argument("--nvme-capacity", default="16GiB", help="capacity of --dir given to ssdtier")
    g.add_argument("--arena", default="64MiB", help="host arena (host.capacity)")
    g.add_argument("--min-tensor-bytes", default="64KiB", help="policy.min_tensor_bytes")
    g.add_argument("--keep-last-layers", default="1", help="policy.keep_last_layers (an int or 'auto')")
    g.add_argument("--prefetch-layers", type=int, default=2, help="policy.prefetch_layers")
    g.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile --profile-steps extra ssdtier steps (CPU) and print the top N functions",
    )
    g.add_argument("--profile-steps", type=int, default=2, help="steps profiled with --profile")
    g = p.add_argument_group("cost per saved tensor")
    g.add_argument("--skip-per-tensor", action="store_true", help="skip this part")
    g.add_argument("--pt-layers", type=int, default=200, help="tiny Linear+Tanh blocks")
    g.add_argument("--pt-width", type=int, default=64, help="their width")
    g.add_argument("--pt-batch", type=int, default=64, help="their batch")
    g.add_argument("--pt-reps", type=int, default=30, help="timed fwd+bwd per variant")
    g.add_argument("--pt-warmup", type=int, default=3, help="untimed fwd+bwd per variant")
    g.add_argument("--pt-arena", default="256MiB", help="arena of this part (no I/O wait)")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, help="write every result to this JSON file")
    g.add_argument("--worker-timeout", type=float, default=900, help="seconds before a mode counts as hung")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.keep_last_layers != "auto":
        try:
            int(args.keep_last_layers)
        except ValueError:
            p.error("--keep-last-layers must be an integer or 'auto'")
    args.dir = args.dir.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    from ssdtier.config import is_tmpfs

    if is_tmpfs(args.dir):
        fail(f"{args.dir} is on tmpfs: spill files there would be RAM, not disk; pick another --dir")
    args.dir.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch sees no CUDA device")
    info = machine_info(args.dir)
    log(f"train_step: {info['hostname']}, {info['nproc']} CPUs, torch {info['torch']}, dir {args.dir}")
    results: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
    results["device"] = "cuda" if use_cuda else "cpu"
    runs: dict[str, Any] = {}
    t_all = time.perf_counter()
    for mode in MODES:
        log(f"train_step: mode {mode} ({'in process' if use_cuda else 'fresh subprocess'})")
        if use_cuda:
            runs[mode] = run_mode(mode, args, torch.device("cuda"))
            gc.collect()
            torch.cuda.empty_cache()
        else:
            runs[mode] = run_worker(mode, args)
        r = runs[mode]
        log(f"train_step: {mode}: peak {fmt_mb(r['peak_bytes'])} MB, median step {r['median_step_s']:.3f} s")
    results["modes"] = runs
    n = min(2, args.warmup + args.steps)
    keep_losses = runs["keep"]["losses"]
    results["losses_identical"] = {
        "n": n,
        **{m: losses_equal(runs[m]["losses"], keep_losses, n) for m in MODES if m != "keep"},
        "ssdtier_all": runs["ssdtier"]["losses"] == keep_losses,
    }
    if not args.skip_per_tensor:
        log("train_step: cost per saved tensor")
        results["per_tensor"] = per_tensor_cost(args)
    results["wall_seconds"] = time.perf_counter() - t_all
    text = render(info, args, results)
    print(text)
    prof = runs["ssdtier"].get("profile")
    if prof:
        print(f"\ncProfile of {args.profile_steps} extra ssdtier steps (by own time):\n{prof}")
    print(f"\n(total wall time {results['wall_seconds']:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        log(f"train_step: wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
