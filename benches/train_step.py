#!/usr/bin/env python3
"""Training-step memory and time of ``ssdtier.attach`` next to the usual alternatives.

One run, one model (a :class:`ssdtier.bench.models.GPT`), four modes:

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
  minus that baseline. The part of ssdtier's host arena that is resident at
  the baseline (all of it when io_uring fixed buffers pin it; on a CPU model
  with ``io.zero_copy`` it is not registered and only used pages count) is
  *added* to ssdtier's peak: it is process memory the baseline hides.
  glibc keeps freed heap blocks resident and hands them out again, so under the
  default allocator RSS also counts memory that is free but never returned. A
  second figure ("mmap64K") comes from another fresh process per mode started
  with ``MALLOC_MMAP_THRESHOLD_=65536`` (1 warmup + ``--mem-steps`` untimed
  steps, same method): every block >= 64 KiB is then its own mapping, unmapped
  when freed, so the high-water mark follows the live bytes.
  A third figure ("from 1st fwd") is the issue's own definition: the RSS
  high-water mark over warmup and measured steps minus VmRSS just before the
  first forward (model, optimizer and batch built, ssdtier attached); it also
  counts gradients and optimizer state, made in the first step, alike in every
  mode. ``--malloc tcmalloc|jemalloc|PATH`` runs every worker with that
  allocator preloaded (``LD_PRELOAD``); tcmalloc never returns freed memory, so
  there the post-warmup figure is about zero and this one is what to read (the
  mmap64K run is glibc's and is skipped).
  Each worker also reports its CPU time (user/system), page faults, context
  switches and the CPU time the rest of the machine used meanwhile (from
  ``/proc/stat``), so that contention from other jobs shows in the output.
* CUDA (when available and ``--device`` allows it): the modes run in this
  process, one after the other; peak = ``torch.cuda.max_memory_allocated()``
  after the measured steps minus ``memory_allocated()`` when the peak was
  reset. The host arena is host memory and is reported, not added.

The losses of the first two steps (same seeds, same batch; warmup steps) of
every mode are compared bitwise with those of ``keep``; the second loss comes
after one optimizer step, so it depends on ssdtier's backward too.

Second part, "cost per saved tensor": a deep stack of tiny Linear+Tanh blocks
(``--pt-layers`` x width ``--pt-width``, batch ``--pt-batch``), in this process,
with ``policy.min_tensor_bytes = 0`` and ``keep_last_layers = 0`` so every saved
tensor goes through ssdtier's hooks, and a large arena so nothing waits for I/O.
(time of fwd+bwd with ssdtier - time without) / saved tensors per iteration (the
``OffloadStats.packs`` count: every call of the pack hook, parameters included)
gives microseconds per saved tensor for pack + unpack; the same for
``save_on_cpu``.

Optional part, "throttled disk" (``--throttled RATE``, e.g. ``150MB``): the same
model three more ways, ssdtier with ``io.throttle = RATE`` (the store's reads and
writes together paced to RATE bytes/s) and ``policy.mode`` ``all``, ``adaptive``
and ``none``, each in a fresh process (plus its mmap64K memory run) like the
modes above. ``adaptive`` gets ``--adaptive-warmup`` warmup steps (its plan is
made at the start of the 2nd step and grows after steps that stall). For each:
peak activation memory, median step time, their ratios to ``keep`` of the main
table, and the backward stall per measured step (``OffloadStats.stall_seconds``
delta / steps); then the adaptive plan's table. The line "throttled goal" says
MET when adaptive's stall per step is below 0.1 of all's and all's is above
0.05 s.

The goal lines (CPU: ssdtier memory <= 0.4 of keep and step time <= 1.05 of keep;
throttled) are reporting only: the exit status is 0 unless something failed.

Example::

    .venv/bin/python benches/train_step.py --throttled 150MB --json /tmp/train_step.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _machine import cpu_busy_seconds, cpu_model, hostname, kernel, loadavg, mem_total, mount_of, nproc

from ssdtier.bench.memory import CpuPeak, CudaPeak, mapping_rss, proc_status

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "target" / "bench-train"
MODES = ("keep", "ssdtier", "checkpoint", "save_on_cpu")
# --throttled: worker mode -> policy.mode; every one with io.throttle = --throttled.
THROTTLED = {"throttled-all": "all", "throttled-adaptive": "adaptive", "throttled-none": "none"}
THROTTLED_GOAL_RATIO = 0.1  # adaptive's stall per step below this fraction of all's ...
THROTTLED_GOAL_STALL = 0.05  # ... while all's stall per step is above this many seconds
RESULT_TAG = "@@train_step_result "
MMAP_THRESHOLD = 64 * 1024
GOAL_MEM = 0.4
GOAL_TIME = 1.05
MB = 1e6


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fail(msg: str, code: int = 2) -> None:
    print(f"train_step: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


# ---------------------------------------------------------------- machine info


def machine_info(directory: Path) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "hostname": hostname(),
        "nproc": nproc(),
        "cpu": cpu_model(),
        "kernel": kernel(),
        "mem_total": mem_total(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dir": str(directory),
        "mount": mount_of(directory),
    }
    return info


# ---------------------------------------------------------------- one mode


def gpt_config(args: argparse.Namespace, checkpoint: bool) -> Any:
    from ssdtier.bench.models import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=args.dropout,
        checkpoint=checkpoint,
        sdpa=getattr(args, "attention", "plain") == "sdpa",  # gpu_step.py's --attention
    )


def ssdtier_config(
    args: argparse.Namespace,
    arena: str,
    min_bytes: Any,
    keep_last: Any,
    policy_mode: str | None = None,
    throttle: str | None = None,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "host": {"capacity": arena},
        "nvme": [{"path": str(args.dir), "capacity": args.nvme_capacity}],
        "policy": {
            "min_tensor_bytes": min_bytes,
            "keep_last_layers": keep_last,
            "prefetch_layers": args.prefetch_layers,
        },
    }
    cfg["policy"]["mode"] = policy_mode or "all"  # on a GPU the default, "auto", would be adaptive
    if throttle is not None:
        cfg["io"] = {"throttle": throttle}
    return cfg


def _keep_last(value: str) -> int | str:
    return value if value == "auto" else int(value)


def stats_dict(stats: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(stats)


def stats_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in after.items():
        if k in (
            "peak_resident_bytes",
            "layers_offloaded",
            "layers_kept",
            "prefetch_layers",
            "prefetch_bytes",
            "plan",
        ) or k.endswith(("_peak", "_capacity", "_used")):
            out[k] = v
        elif isinstance(v, dict):
            out[k] = stats_delta(v, before[k])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v - before[k]
    return out


def run_mode(mode: str, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Build, warm up, then measure one mode; returns a JSON-able dict."""
    import torch

    from ssdtier.bench.models import batch_loss, build_model, make_batch

    cuda = device.type == "cuda"
    policy_mode = THROTTLED.get(mode)
    uses_ssdtier = mode == "ssdtier" or policy_mode is not None
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
    if uses_ssdtier:
        import ssdtier

        throttle = args.throttled if policy_mode is not None else None
        keep_last = _keep_last(args.keep_last_layers)
        scfg = ssdtier_config(args, args.arena, args.min_tensor_bytes, keep_last, policy_mode, throttle)
        off = ssdtier.attach(model, scfg)
        store = off.store
        extra["store"] = {
            "backend": store.backend,
            "direct": store.direct,
            "fixed_buffers": store.fixed_buffers,
            "arena_bytes": store.arena.numel() if store.arena is not None else 0,
            "arena_address": store.arena.data_ptr() if store.arena is not None else 0,
            "layers_path": off.layers_path,
        }
        if policy_mode is not None:
            extra["policy_mode"] = policy_mode
            extra["throttle"] = throttle
            extra["throttle_bytes_per_s"] = off.config.io.throttle
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

    # Per step, read after it (untimed): layers ssdtier kept (the adaptive plan changes it) and
    # its stall (OffloadStats.stall_seconds delta).
    kept_warmup: list[int] = []
    kept_steps: list[int] = []
    stall_warmup: list[float] = []
    stall_steps: list[float] = []
    stall_seen = [0.0]

    def kept(into: list[int], stalls: list[float]) -> str:
        if off is None:
            return ""
        st = off.stats()
        into.append(st.layers_kept)
        stalls.append(st.stall_seconds - stall_seen[0])
        stall_seen[0] = st.stall_seconds
        ahead = f"{fmt_mb(st.prefetch_bytes)} MB" if st.prefetch_bytes else f"{st.prefetch_layers} layer(s)"
        return f", layers kept {into[-1]}, reading {ahead} ahead, stall {stalls[-1]:.3f} s"

    losses: list[float] = []

    def run_steps(n: int, label: str, kept_into: list[int], stalls_into: list[float]) -> list[float]:
        times: list[float] = []
        for i in range(n):
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
            note = kept(kept_into, stalls_into)
            log(f"  [{mode}] {label} {i + 1}/{n}: {times[-1]:.3f} s, loss {losses[-1]:.6f}{note}")
        return times

    rss_start = 0 if cuda else proc_status("VmRSS")["VmRSS"]
    warm_times = run_steps(args.warmup, "warmup", kept_warmup, stall_warmup)
    # The high-water mark since the process started (the warmup's), before the probe resets it.
    hwm_warmup = 0 if cuda else proc_status("VmHWM")["VmHWM"]

    before = stats_dict(off.stats()) if off is not None else None
    probe: Any = CudaPeak(device) if cuda else CpuPeak()
    load_start = loadavg()
    probe.start()
    # The arena's pages resident at the baseline are hidden by it: added back to the peak below.
    arena_resident = mapping_rss(extra["store"]["arena_address"]) if off is not None and not cuda else 0
    cpu0 = os.times()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    busy0 = cpu_busy_seconds()
    times = run_steps(args.steps, "step", kept_steps, stall_steps)
    cpu1 = os.times()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    busy1 = cpu_busy_seconds()
    peak_abs, baseline = probe.stop()
    after = stats_dict(off.stats()) if off is not None else None
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    arena_added = arena_resident
    result: dict[str, Any] = {
        "mode": mode,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "memory_method": probe.method,
        "baseline_bytes": baseline,
        "peak_abs_bytes": peak_abs,
        "peak_measured_bytes": peak_abs - baseline,
        "arena_added_bytes": arena_added,
        "peak_bytes": peak_abs - baseline + arena_added,
        "rss_start_bytes": rss_start,
        "peak_from_start_bytes": max(hwm_warmup, peak_abs) - rss_start,
        "step_seconds": times,
        "warmup_seconds": warm_times,
        "median_step_s": statistics.median(times),
        "cpu_seconds_per_step": cpu_s / len(times),
        "cpu_user_per_step": (cpu1.user - cpu0.user) / len(times),
        "cpu_system_per_step": (cpu1.system - cpu0.system) / len(times),
        "minor_faults_per_step": (ru1.ru_minflt - ru0.ru_minflt) / len(times),
        "ctx_switches_per_step": (ru1.ru_nvcsw - ru0.ru_nvcsw + ru1.ru_nivcsw - ru0.ru_nivcsw) / len(times),
        "cpu_utilisation": cpu_s / sum(times) if sum(times) > 0 else 0.0,
        # Busy cores of the machine not accounted to this process (other jobs, kernel I/O threads).
        "other_cpu_cores": ((busy1 - busy0) - cpu_s) / sum(times) if sum(times) > 0 else 0.0,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        **extra,
    }
    result["losses"] = [x.hex() for x in losses]
    if off is not None and after is not None:
        result["offload_stats_total"] = after
        result["offload_stats_measured"] = stats_delta(after, before) if before else after
        result["layers_kept_warmup"] = kept_warmup
        result["layers_kept_steps"] = kept_steps
        result["stall_seconds_warmup"] = stall_warmup
        result["stall_seconds_steps"] = stall_steps
        plan = off.plan()
        if plan is not None:
            result["plan"] = {
                "keep_last": plan.keep_last,
                "n_layers": len(plan.decisions),
                "actions": [a.value for a in plan.actions],
                "fits": plan.fits,
                "reason": plan.reason,
                "table": plan.table(),
            }
        if args.profile and mode == "ssdtier" and not cuda:
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


MALLOC_LIBS = {"tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}


def malloc_library(name: str) -> str:
    """The library to preload for ``--malloc`` ("" for glibc's own); exits when it is not there.
    (Not loaded here to check: a malloc library dlopen'ed after start frees pointers it never made.)"""
    if name == "glibc":
        return ""
    if name in MALLOC_LIBS:
        dirs = [f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
        for d in dirs:
            if (Path(d) / MALLOC_LIBS[name]).exists():
                return str(Path(d) / MALLOC_LIBS[name])
        fail(
            f"--malloc {name}: {MALLOC_LIBS[name]} not found in {', '.join(dirs)} "
            "(Debian: apt install libtcmalloc-minimal4 / libjemalloc2)"
        )
    if not Path(name).is_file():
        fail(f"--malloc {name}: no such file (glibc, tcmalloc, jemalloc, or the path of a malloc library)")
    return str(Path(name).resolve())


def worker_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    res = run_mode(args.worker, args, torch.device("cpu"))
    sys.stdout.write(RESULT_TAG + json.dumps(res) + "\n")
    sys.stdout.flush()


def run_worker(
    mode: str, args: argparse.Namespace, mmap_threshold: int | None = None, warmup: int | None = None
) -> dict[str, Any]:
    """Run one mode in a fresh interpreter; ``mmap_threshold``: a memory-only run (``warmup`` or 1
    warmup steps, ``--mem-steps`` steps) with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at that many
    bytes; ``warmup``: warmup steps instead of ``--warmup``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--worker", mode]
    env = dict(os.environ)
    if args.malloc_lib:
        env["LD_PRELOAD"] = args.malloc_lib
    if mmap_threshold is not None:
        cmd += ["--warmup", str(1 if warmup is None else warmup), "--steps", str(args.mem_steps), "--profile", "0"]
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    elif warmup is not None:
        cmd += ["--warmup", str(warmup)]
    t0 = time.perf_counter()
    shown = " ".join(cmd)
    if mmap_threshold is not None:
        shown = f"MALLOC_MMAP_THRESHOLD_={mmap_threshold} {shown}"
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.worker_timeout, env=env)
    except subprocess.TimeoutExpired:
        limit = args.worker_timeout
        fail(f"the {mode} worker did not finish within {limit} s (hang?); reproduce with: {shown}", 3)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG) :])
            res["process_seconds"] = time.perf_counter() - t0
            return res
    fail(f"the {mode} worker failed (exit status {proc.returncode}); reproduce with: {shown}", 3)
    raise AssertionError  # unreachable


# ---------------------------------------------------------------- cost per saved tensor


def tiny_stack(n: int, width: int) -> Any:
    """``n`` blocks of Linear(width)+Tanh and a mean-square loss: 3 saved tensors per block
    (the input, the weight's transpose, the output), every storage small."""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)
            self.act = nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Tiny() for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x.square().mean()

    return Stack()


def count_saved(model: Any, x: Any) -> int:
    """Saved tensors in one forward and backward of ``model`` on ``x``."""
    import torch

    n = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        model(x).backward()
    return n


def per_tensor_cost(args: argparse.Namespace) -> dict[str, Any]:
    """µs per saved tensor (pack + unpack) of ssdtier and save_on_cpu on a deep stack of tiny layers."""
    import copy

    import torch
    from torch import nn

    import ssdtier

    torch.manual_seed(args.seed)
    plain = tiny_stack(args.pt_layers, args.pt_width)
    ssd_model = copy.deepcopy(plain)
    arena_model = copy.deepcopy(plain)
    x = torch.randn(args.pt_batch, args.pt_width, generator=torch.Generator().manual_seed(args.seed))

    n_saved = count_saved(plain, x)

    cfg = ssdtier_config(args, args.pt_arena, 0, 0)
    off = ssdtier.attach(ssd_model, cfg)
    # The same through the arena: no NVMe I/O at all, so this is the Python layer's own cost.
    off_arena = ssdtier.attach(arena_model, {**cfg, "io": {"zero_copy": False}})

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

    def floor_pack(t: torch.Tensor) -> tuple:
        # What any hook that stores a tensor's bytes elsewhere must read to rebuild it.
        st = t.untyped_storage()
        return (t, st.data_ptr(), st.nbytes(), t.dtype, t.storage_offset(), t.shape, t.stride(), t._version)

    def floor_unpack(h: tuple) -> torch.Tensor:
        t, _, _, dtype, offset, size, stride, _ = h
        return torch.empty(0, dtype=dtype).set_(t.untyped_storage(), offset, size, stride)

    variants = {
        "plain": lambda: run(plain, None),
        "ssdtier": lambda: run(ssd_model, None),
        "ssdtier-arena": lambda: run(arena_model, None),
        "save_on_cpu": lambda: run(plain, torch.autograd.graph.save_on_cpu(pin_memory=False)),
        "view_floor": lambda: run(plain, torch.autograd.graph.saved_tensors_hooks(floor_pack, floor_unpack)),
    }
    for _ in range(args.pt_warmup):
        for fn in variants.values():
            fn()
    before = off.stats()
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    w0, c0, b0 = time.perf_counter(), os.times(), cpu_busy_seconds()
    # Interleaved, so that drift (frequency, other load) hits every variant alike.
    for _ in range(args.pt_reps):
        for k, fn in variants.items():
            samples[k].append(fn())
    w1, c1, b1 = time.perf_counter(), os.times(), cpu_busy_seconds()
    after = off.stats()
    off.detach()
    arena_written = off_arena.stats().bytes_written_nvme
    off_arena.detach()
    reps = args.pt_reps
    own = (c1.user - c0.user) + (c1.system - c0.system)
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
        "ssdtier_arena_nvme_bytes_written": arena_written,
        "ssdtier_stall_seconds": after.stall_seconds - before.stall_seconds,
        "cpu_utilisation": own / (w1 - w0),
        "other_cpu_cores": ((b1 - b0) - own) / (w1 - w0),
    }
    med = {}
    for k, s in samples.items():
        fwd = statistics.median(a for a, _ in s)
        bwd = statistics.median(b for _, b in s)
        tot = statistics.median(a + b for a, b in s)
        med[k] = {"fwd_s": fwd, "bwd_s": bwd, "total_s": tot}
    out["median"] = med
    base = med["plain"]
    for k, n in (
        ("ssdtier", packs),
        ("ssdtier-arena", packs),
        ("save_on_cpu", float(n_saved)),
        ("view_floor", float(n_saved)),
    ):
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


def ratio(x: float, base: float) -> str:
    return f"{x / base:.3f}" if base > 0 else "n/a"


def memory_time_cells(label: str, r: dict[str, Any], keep: dict[str, Any], mmap: bool) -> list[str]:
    """A table row's first cells: peak memory and median step, each with its ratio to keep."""
    row = [
        label,
        fmt_mb(r["peak_bytes"]),
        ratio(r["peak_bytes"], keep["peak_bytes"]),
        f"{r['median_step_s']:.3f}",
        ratio(r["median_step_s"], keep["median_step_s"]),
    ]
    if mmap:
        row += [fmt_mb(r["mmap_peak_bytes"]), ratio(r["mmap_peak_bytes"], keep["mmap_peak_bytes"])]
    return row


def md_table(hdr: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_per_tensor(pt: dict[str, Any]) -> list[str]:
    """The "cost per saved tensor" lines."""
    lines: list[str] = []
    lines.append(
        f"cost per saved tensor: {pt['layers']} x (Linear({pt['width']},{pt['width']}) + Tanh), "
        f"batch {pt['batch']}, {pt['reps']} interleaved reps, in one process; ssdtier with "
        f"min_tensor_bytes 0, keep_last_layers 0, arena {pt['arena']} (ssdtier: zero copy, every storage "
        "written to NVMe and read back; ssdtier-arena: io.zero_copy false, everything stays in the arena, "
        "no NVMe I/O: the Python layer's own cost; view_floor: Python hooks that only read a tensor's "
        "storage, dtype, shape, strides, offset and version and rebuild the view from them, the least a "
        "hook that moves bytes does); CPU use "
        f"{pt['cpu_utilisation']:.2f} cores, rest of machine {pt['other_cpu_cores']:.2f} cores"
    )
    lines.append(
        f"  saved tensors per fwd+bwd: {pt['saved_tensors_per_iter']} (ssdtier packs "
        f"{pt['ssdtier_packs_per_iter']:.0f}: offloaded {pt['ssdtier_offloaded_per_iter']:.0f}, "
        f"dedup hits {pt['ssdtier_dedup_hits_per_iter']:.0f}, kept {pt['ssdtier_kept_per_iter']:.0f}, "
        "the rest parameters; unpacks "
        f"{pt['ssdtier_unpacks_per_iter']:.0f}); NVMe bytes written {pt['ssdtier_nvme_bytes_written']} "
        f"(ssdtier-arena: {pt.get('ssdtier_arena_nvme_bytes_written', 0)})"
    )
    med = pt["median"]
    lines.append(
        "  median fwd / bwd / total (ms): "
        + "; ".join(
            f"{k} {v['fwd_s'] * 1e3:.2f} / {v['bwd_s'] * 1e3:.2f} / {v['total_s'] * 1e3:.2f}" for k, v in med.items()
        )
    )
    extra_s = med["ssdtier"]["total_s"] - med["plain"]["total_s"]
    per_store = extra_s / max(pt["ssdtier_offloaded_per_iter"], 1)
    lines.append(
        f"  ssdtier per offloaded storage (the same time / {pt['ssdtier_offloaded_per_iter']:.0f}): "
        f"{per_store * 1e6:.1f} us"
    )
    for k in ("ssdtier", "ssdtier-arena", "save_on_cpu", "view_floor"):
        if f"{k}_us_per_tensor" not in pt:
            continue
        lines.append(
            f"  {k}: {pt[f'{k}_us_per_tensor']:.1f} us per saved tensor (pack+unpack) "
            f"[fwd {pt[f'{k}_us_per_pack_fwd']:.1f} + bwd {pt[f'{k}_us_per_unpack_bwd']:.1f}]"
        )
    return lines


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
        + ("" if results["device"] == "cuda" else f"; allocator {args.malloc}")
    )
    lines.append(f"--dir: {info['dir']} on {m['device']} ({m.get('medium', m['fstype'])}; {m['options']})")
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
            "in the baseline. ssdtier: the part of its host arena resident in the baseline "
            f"({fmt_mb(runs['ssdtier'].get('arena_added_bytes', 0))} of "
            f"{fmt_mb(runs['ssdtier'].get('store', {}).get('arena_bytes', 0))} MB) is added to its peak."
        )
    mmap = not cuda and "mmap_peak_bytes" in runs["keep"]
    if mmap:
        lines.append(
            "        second figure (mmap64K): another fresh process per mode with "
            f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}, 1 warmup + {args.mem_steps} untimed step(s), same "
            "method: every block >= 64 KiB is its own mapping, unmapped when freed, so the peak follows "
            "live bytes; under glibc's default, freed heap memory stays resident and is reused, so RSS "
            "also counts memory that is free but was never returned."
        )
    if not cuda:
        lines.append(
            "        third figure (from 1st fwd): VmHWM over warmup and measured steps - VmRSS just before "
            "the first forward; gradients and optimizer state (made in the first step) are in it, alike "
            "in every mode."
        )
    lines.append("")
    keep = runs["keep"]
    hdr = ["mode", "peak act. memory (MB)", "ratio vs keep", "median step (s)", "ratio vs keep"]
    if mmap:
        hdr += ["peak, mmap64K (MB)", "ratio vs keep"]
    if not cuda:
        hdr += ["from 1st fwd (MB)", "ratio vs keep", "CPU s/step"]
    rows = []
    for mode in MODES:
        r = runs[mode]
        label = mode + (" (+arena)" if r.get("arena_added_bytes") else "")
        row = memory_time_cells(label, r, keep, mmap)
        if not cuda and args.malloc != "glibc":
            row[2] = "n/a"  # the warmup reached the peak already (see the goal line)
        if not cuda:
            row += [
                fmt_mb(r["peak_from_start_bytes"]),
                ratio(r["peak_from_start_bytes"], keep["peak_from_start_bytes"]),
                f"{r['cpu_seconds_per_step']:.2f}",
            ]
        rows.append(row)
    lines += md_table(hdr, rows)
    lines.append("")
    for mode in MODES:
        r = runs[mode]
        ts = r["step_seconds"]
        la = r.get("loadavg_start") or ["?"]
        lb = r.get("loadavg_end") or ["?"]
        lines.append(
            f"{mode}: steps {', '.join(f'{t:.2f}' for t in ts)} s; CPU use {r['cpu_utilisation']:.2f} "
            f"cores (user {r['cpu_user_per_step']:.2f} + sys {r['cpu_system_per_step']:.2f} s/step, "
            f"{r['minor_faults_per_step'] / 1e3:.0f}k page faults/step), "
            f"rest of machine {r['other_cpu_cores']:.2f} cores; loadavg {la[0]} -> {lb[0]}; "
            f"baseline {fmt_mb(r['baseline_bytes'])} MB, "
            f"peak above it {fmt_mb(r['peak_measured_bytes'])} MB"
            + (f" (mmap64K {fmt_mb(r['mmap_peak_measured_bytes'])} MB)" if mmap else "")
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
            f"NVMe read) {s['forwarded']}; copied ahead on the prefetch stream {s.get('copied_ahead', 0)}; "
            f"dedup hits {s['dedup_hits']}; packs {s['packs']}, "
            f"unpacks {s['unpacks']}"
        )
        lines.append(
            f"  stall {s['stall_seconds']:.3f} s [{s['stall_seconds'] / n:.3f} s]; store wait "
            f"{s['store']['wait_seconds']:.3f} s; "
            f"peak_resident_bytes {fmt_mb(s['peak_resident_bytes'])} MB; layers offloaded "
            f"{s['layers_offloaded']}, kept {s['layers_kept']}"
            + (
                f"; reading {fmt_mb(s['prefetch_bytes'])} MB ahead at the end"
                if s.get("prefetch_bytes")
                else f"; reading {s['prefetch_layers']} layer(s) ahead at the end"
                if "prefetch_layers" in s
                else ""
            )
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
        lines += render_per_tensor(pt)
    lines.append("")
    sr = runs["ssdtier"]
    # Under an allocator that keeps what it freed, the warmup already reached the peak: the
    # post-warmup figure is about zero in every mode, and the from-1st-fwd one is the measure.
    key = "peak_bytes" if cuda or args.malloc == "glibc" else "peak_from_start_bytes"
    mem_ratio = sr[key] / keep[key] if keep[key] > 0 else float("inf")
    time_ratio = sr["median_step_s"] / keep["median_step_s"]
    met = mem_ratio <= GOAL_MEM and time_ratio <= GOAL_TIME
    what = "CUDA" if cuda else "CPU"
    results["goal"] = {"met": met, "memory_ratio": mem_ratio, "time_ratio": time_ratio, "memory_figure": key}
    lines.append(
        f"goal ({what}): ssdtier memory <= {GOAL_MEM} of keep and step time <= {GOAL_TIME} of keep: "
        f"{'MET' if met else 'NOT MET'} (memory {mem_ratio:.3f}"
        + ("" if key == "peak_bytes" else " from 1st fwd")
        + f", time {time_ratio:.3f})"
    )
    if mmap:
        r2 = sr["mmap_peak_bytes"] / keep["mmap_peak_bytes"] if keep["mmap_peak_bytes"] > 0 else float("inf")
        met2 = r2 <= GOAL_MEM and time_ratio <= GOAL_TIME
        lines.append(
            f"  same goal with the mmap64K memory figure: {'MET' if met2 else 'NOT MET'} "
            f"(memory {r2:.3f}, time {time_ratio:.3f})"
        )
        results["goal"]["mmap64k"] = {"met": met2, "memory_ratio": r2}
    if not cuda and key == "peak_bytes":
        r3 = sr["peak_from_start_bytes"] / max(keep["peak_from_start_bytes"], 1)
        met3 = r3 <= GOAL_MEM and time_ratio <= GOAL_TIME
        lines.append(
            f"  same goal with the from-1st-fwd memory figure: {'MET' if met3 else 'NOT MET'} "
            f"(memory {r3:.3f}, time {time_ratio:.3f})"
        )
        results["goal"]["from_start"] = {"met": met3, "memory_ratio": r3}
    fl = results.get("io_floor")
    if fl:
        floor = fl["median_step_s"] / keep["median_step_s"]
        results["goal"]["io_floor_ratio"] = floor
        lines.append(
            f"  the I/O alone: keep with fio moving ssdtier's bytes per second in the background "
            f"({fl['write_bytes_per_s'] / 1e6:.0f} MB/s write + {fl['read_bytes_per_s'] / 1e6:.0f} MB/s read, "
            f"O_DIRECT, same directory): median step {fl['median_step_s']:.3f} s = {floor:.3f} of keep; "
            f"ssdtier = {sr['median_step_s'] / fl['median_step_s']:.3f} of that"
        )
        lines.append(f"    ({fl['cmd']})")
    return "\n".join(lines)


def render_throttled(args: argparse.Namespace, results: dict[str, Any]) -> str:
    th = results["throttled"]
    runs: dict[str, dict[str, Any]] = th["modes"]
    keep = results["modes"]["keep"]
    cuda = results["device"] == "cuda"
    mmap = not cuda and "mmap_peak_bytes" in keep and all("mmap_peak_bytes" in r for r in runs.values())
    rate = th["rate_bytes_per_s"]
    n = args.steps
    warm = th["warmup"]
    lines = [f"== throttled disk: io.throttle = {th['rate']} ({rate / MB:,.0f} MB/s, reads and writes together) =="]
    lines.append(
        "ssdtier with policy.mode all, adaptive and none; model and ssdtier settings as above. "
        + ("Modes run in this process. " if cuda else "Each mode in a fresh process, memory measured as above. ")
        + f"Warmup steps: all {warm['throttled-all']}, adaptive {warm['throttled-adaptive']}, none "
        f"{warm['throttled-none']}; then {n} measured steps. keep: the (unthrottled) keep run of the table above."
    )
    lines.append(
        "stall: OffloadStats.stall_seconds (backward waiting for reads) over the measured steps / steps; "
        "store wait: StoreStats.wait_seconds likewise (waiting on the store, e.g. for arena space in the forward)."
    )
    lines.append("")
    hdr = ["mode", "peak act. memory (MB)", "ratio vs keep", "median step (s)", "ratio vs keep"]
    if mmap:
        hdr += ["peak, mmap64K (MB)", "ratio vs keep"]
    hdr += ["stall s/step", "store wait s/step", "layers kept"]
    if not cuda:
        hdr += ["CPU s/step"]
    row = ["keep (unthrottled)", fmt_mb(keep["peak_bytes"]), "1.000", f"{keep['median_step_s']:.3f}", "1.000"]
    if mmap:
        row += [fmt_mb(keep["mmap_peak_bytes"]), "1.000"]
    row += ["-", "-", f"{args.layers}/{args.layers}"]
    if not cuda:
        row += [f"{keep['cpu_seconds_per_step']:.2f}"]
    rows = [row]
    for mode, r in runs.items():
        s = r["offload_stats_measured"]
        label = THROTTLED[mode] + (" (+arena)" if r.get("arena_added_bytes") else "")
        row = memory_time_cells(label, r, keep, mmap)
        row += [
            f"{stall_per_step(r):.3f}",
            f"{s['store']['wait_seconds'] / n:.3f}",
            f"{s['layers_kept']}/{s['layers_kept'] + s['layers_offloaded']}",
        ]
        if not cuda:
            row += [f"{r['cpu_seconds_per_step']:.2f}"]
        rows.append(row)
    lines += md_table(hdr, rows)
    lines.append("")
    for mode, r in runs.items():
        s = r["offload_stats_measured"]
        ts = r["step_seconds"]
        kw = " ".join(str(k) for k in r.get("layers_kept_warmup", [])) or "-"
        km = " ".join(str(k) for k in r.get("layers_kept_steps", [])) or "-"
        sw = " ".join(f"{x:.2f}" for x in r.get("stall_seconds_warmup", [])) or "-"
        sm = " ".join(f"{x:.2f}" for x in r.get("stall_seconds_steps", [])) or "-"
        lines.append(
            f"{THROTTLED[mode]}: steps {', '.join(f'{t:.2f}' for t in ts)} s; per step (warmup | measured): "
            f"layers kept {kw} | {km}, stall {sw} | {sm} s; per step: offloaded "
            f"{fmt_mb(s['bytes_offloaded'] / n)} MB, NVMe written "
            f"{fmt_mb(s['bytes_written_nvme'] / n)} MB, read {fmt_mb(s['bytes_read_nvme'] / n)} MB; "
            f"rest of machine {r['other_cpu_cores']:.2f} cores"
        )
    eq = th["losses_identical"]
    lines.append(
        f"losses identical to keep (first {eq['n']}, bitwise): "
        + ", ".join(f"{THROTTLED[m]} {'yes' if eq[m] else 'no'}" for m in THROTTLED)
    )
    lines.append("")
    plan = runs["throttled-adaptive"].get("plan")
    if plan:
        lines.append(
            f"adaptive plan after the measured steps, for {plan['n_layers']} blocks: "
            f"{', '.join(plan.get('actions', []))}; fits its budget: {'yes' if plan.get('fits', True) else 'no'}"
        )
        lines.append(plan["table"])
    else:
        lines.append("adaptive plan: none was made (the model has no layers, or too few steps)")
    lines.append("")
    g = th["goal"]
    lines.append(
        f"throttled goal: adaptive has no backward stall where all stalls: {'MET' if g['met'] else 'NOT MET'} "
        f"(stall per step: adaptive {g['stall_per_step_adaptive']:.3f} s, all {g['stall_per_step_all']:.3f} s; "
        f"needs adaptive < {THROTTLED_GOAL_RATIO} x all and all > {THROTTLED_GOAL_STALL} s)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- runs


def warmup_of(mode: str, args: argparse.Namespace) -> int:
    return args.adaptive_warmup if THROTTLED.get(mode) == "adaptive" else args.warmup


def measure_modes(modes: tuple[str, ...], args: argparse.Namespace, use_cuda: bool) -> dict[str, Any]:
    """Each mode timed (CUDA: in this process; CPU: a fresh process each), then on CPU its
    memory-only run with large blocks mmapped (unless ``--mem-steps 0``)."""
    import torch

    runs: dict[str, Any] = {}
    for mode in modes:
        warmup = warmup_of(mode, args)
        log(f"train_step: mode {mode} ({'in process' if use_cuda else 'fresh subprocess'}, {warmup} warmup steps)")
        if use_cuda:
            runs[mode] = run_mode(mode, argparse.Namespace(**{**vars(args), "warmup": warmup}), torch.device("cuda"))
            gc.collect()
            torch.cuda.empty_cache()
        else:
            runs[mode] = run_worker(mode, args, warmup=None if warmup == args.warmup else warmup)
        r = runs[mode]
        log(f"train_step: {mode}: peak {fmt_mb(r['peak_bytes'])} MB, median step {r['median_step_s']:.3f} s")
    if not use_cuda and args.mem_steps > 0 and not args.malloc_lib:
        for mode in modes:
            log(f"train_step: mode {mode}, memory only, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}")
            # 1 warmup step, except where a plan has to settle first.
            warmup = warmup_of(mode, args) if THROTTLED.get(mode) == "adaptive" else None
            res = run_worker(mode, args, MMAP_THRESHOLD, warmup=warmup)
            r = runs[mode]
            r["mmap_run"] = {k: v for k, v in res.items() if k != "profile"}
            r["mmap_peak_bytes"] = res["peak_bytes"]
            r["mmap_peak_measured_bytes"] = res["peak_measured_bytes"]
            log(f"train_step: {mode}: peak {fmt_mb(res['peak_bytes'])} MB with large blocks mmapped")
    return runs


def io_floor(args: argparse.Namespace, runs: dict[str, Any]) -> dict[str, Any] | None:
    """keep again (fresh process), while fio moves as many bytes per second as ssdtier did, in
    the same directory (O_DIRECT, io_uring, 1 MiB blocks as the store's default): how much the I/O alone
    slows the model's compute on this machine, whoever does it. None without fio."""
    import shutil as sh

    fio = sh.which("fio")
    if fio is None:
        return None
    sr = runs["ssdtier"]
    steps = len(sr["step_seconds"])
    per_step = sr["offload_stats_measured"]
    secs = sr["median_step_s"]
    write_bps = int(per_step["bytes_written_nvme"] / steps / secs)
    read_bps = int(per_step["bytes_read_nvme"] / steps / secs)
    if write_bps <= 0 or read_bps <= 0:
        return None
    path = args.dir / "fio-floor.tmp"
    cmd = [
        fio, "--name=floor", f"--filename={path}", "--size=1G", "--rw=rw", "--rwmixread=50",
        "--bs=1M", "--direct=1", "--ioengine=io_uring", "--iodepth=16",
        f"--rate={read_bps},{write_bps}", "--time_based", "--runtime=3600", "--output=/dev/null",
    ]  # fmt: skip
    log(f"train_step: keep under fio ({write_bps / 1e6:.0f} MB/s write + {read_bps / 1e6:.0f} MB/s read)")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # file laid out, rate reached
        if proc.poll() is not None:
            log(f"train_step: fio failed: {proc.stderr.read().strip() if proc.stderr else ''}")
            return None
        res = run_worker("keep", args)
    finally:
        proc.terminate()
        proc.wait()
        path.unlink(missing_ok=True)
    return {
        "write_bytes_per_s": write_bps,
        "read_bytes_per_s": read_bps,
        "median_step_s": res["median_step_s"],
        "step_seconds": res["step_seconds"],
        "cmd": " ".join(cmd),
    }


def stall_per_step(r: dict[str, Any]) -> float:
    """OffloadStats.stall_seconds over the measured steps / steps."""
    return r["offload_stats_measured"]["stall_seconds"] / len(r["step_seconds"])


def run_throttled(args: argparse.Namespace, use_cuda: bool, main_runs: dict[str, Any]) -> dict[str, Any]:
    """all, adaptive and none with io.throttle = --throttled; ratios against keep, and the goal."""
    runs = measure_modes(tuple(THROTTLED), args, use_cuda)
    n = min(2, args.warmup + args.steps)
    keep_losses = main_runs["keep"]["losses"]
    stall_all = stall_per_step(runs["throttled-all"])
    stall_adaptive = stall_per_step(runs["throttled-adaptive"])
    met = stall_all > THROTTLED_GOAL_STALL and stall_adaptive < THROTTLED_GOAL_RATIO * stall_all
    return {
        "rate": args.throttled,
        "rate_bytes_per_s": runs["throttled-all"].get("throttle_bytes_per_s"),
        "warmup": {mode: warmup_of(mode, args) for mode in THROTTLED},
        "modes": runs,
        "losses_identical": {"n": n, **{m: losses_equal(runs[m]["losses"], keep_losses, n) for m in THROTTLED}},
        "goal": {
            "met": met,
            "stall_per_step_all": stall_all,
            "stall_per_step_adaptive": stall_adaptive,
            "rule": f"adaptive < {THROTTLED_GOAL_RATIO} x all and all > {THROTTLED_GOAL_STALL} s (stall per step)",
        },
    }


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
    g.add_argument(
        "--malloc",
        default="glibc",
        help="CPU: allocator of every worker process: glibc (the default one), tcmalloc, jemalloc, or the "
        "path of a malloc library to LD_PRELOAD",
    )
    g.add_argument("--warmup", type=int, default=2, help="warmup steps per mode (not timed)")
    g.add_argument(
        "--mem-steps",
        type=int,
        default=1,
        help="CPU: steps of a second, memory-only process per mode with MALLOC_MMAP_THRESHOLD_=65536 "
        "(glibc returns every freed block >= 64 KiB), for a peak that follows live bytes (0: skip)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of weights, batch and dropout")
    ncpu = os.cpu_count() or 1
    g.add_argument("--threads", type=int, default=ncpu, help="torch.set_num_threads in every process")
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
    g.add_argument("--keep-last-layers", default="auto", help="policy.keep_last_layers (an int or 'auto')")
    g.add_argument(
        "--prefetch-layers", type=_keep_last, default="auto", help="policy.prefetch_layers (an int or 'auto')"
    )
    g.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile --profile-steps extra ssdtier steps (CPU) and print the top N functions",
    )
    g.add_argument("--profile-steps", type=int, default=2, help="steps profiled with --profile")
    g = p.add_argument_group("throttled disk (after the main table)")
    g.add_argument(
        "--throttled",
        metavar="RATE",
        help="also run ssdtier with io.throttle = RATE (bytes per second of the store, reads and writes "
        "together; suggested: 150MB, at which 'all' stalls with the default model: it moves about 0.5 GB "
        "each way per step) three ways, each in a fresh process: policy.mode all, adaptive and none; "
        "reported side by side with keep from the main table; not given: skipped",
    )
    g.add_argument(
        "--adaptive-warmup",
        type=int,
        default=6,
        help="warmup steps of the throttled adaptive mode (>= 4: its plan is made at the start of the 2nd "
        "step and grows by a layer after each step that stalls); all and none use --warmup",
    )
    g = p.add_argument_group("cost per saved tensor")
    g.add_argument("--skip-per-tensor", action="store_true", help="skip this part")
    g.add_argument(
        "--per-tensor-only",
        action="store_true",
        help="run this part only (in this process: e.g. to compare two checkouts with PYTHONPATH)",
    )
    g.add_argument(
        "--skip-io-floor",
        action="store_true",
        help="CPU: skip the run of keep under fio moving ssdtier's bytes per second (the cost of the I/O alone)",
    )
    g.add_argument("--pt-layers", type=int, default=200, help="tiny Linear+Tanh blocks")
    g.add_argument("--pt-width", type=int, default=64, help="their width")
    g.add_argument("--pt-batch", type=int, default=64, help="their batch")
    g.add_argument("--pt-reps", type=int, default=30, help="timed fwd+bwd per variant")
    g.add_argument("--pt-warmup", type=int, default=3, help="untimed fwd+bwd per variant")
    g.add_argument("--pt-arena", default="256MiB", help="arena of this part (no I/O wait)")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, help="write every result to this JSON file")
    g.add_argument("--worker-timeout", type=float, default=900, help="seconds before a mode counts as hung")
    p.add_argument("--worker", choices=(*MODES, *THROTTLED), help=argparse.SUPPRESS)
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
    if args.throttled is not None and args.adaptive_warmup < 4:
        p.error("--adaptive-warmup must be >= 4: the adaptive plan needs a few steps to settle")
    args.dir = args.dir.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    args.malloc_lib = malloc_library(args.malloc)
    from ssdtier.errors import ConfigError
    from ssdtier.paths import is_tmpfs
    from ssdtier.sizes import parse_size

    if is_tmpfs(args.dir):
        fail(f"{args.dir} is on tmpfs: spill files there would be RAM, not disk; pick another --dir")
    if args.throttled is not None:
        try:
            rate = parse_size(args.throttled, key="--throttled", source="command line")
        except ConfigError as e:
            fail(str(e))
        if rate <= 0:
            fail("--throttled must be a positive rate (0 would mean no throttle)")
    args.dir.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(args.threads)
    if args.per_tensor_only:
        import ssdtier

        log(f"train_step: cost per saved tensor, ssdtier from {Path(ssdtier.__file__).parent}")
        print("\n".join(render_per_tensor(per_tensor_cost(args))))
        return 0
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch sees no CUDA device")
    info = machine_info(args.dir)
    log(f"train_step: {info['hostname']}, {info['nproc']} CPUs, torch {info['torch']}, dir {args.dir}")
    results: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}}
    results["device"] = "cuda" if use_cuda else "cpu"
    t_all = time.perf_counter()
    runs = measure_modes(MODES, args, use_cuda)
    results["modes"] = runs
    n = min(2, args.warmup + args.steps)
    keep_losses = runs["keep"]["losses"]
    results["losses_identical"] = {
        "n": n,
        **{m: losses_equal(runs[m]["losses"], keep_losses, n) for m in MODES if m != "keep"},
        "ssdtier_all": runs["ssdtier"]["losses"] == keep_losses,
    }
    if not use_cuda and not args.skip_io_floor:
        results["io_floor"] = io_floor(args, runs)
    if args.throttled is not None:
        results["throttled"] = run_throttled(args, use_cuda, runs)
    if not args.skip_per_tensor:
        log("train_step: cost per saved tensor")
        results["per_tensor"] = per_tensor_cost(args)
    results["wall_seconds"] = time.perf_counter() - t_all
    text = render(info, args, results)
    print(text)
    if "throttled" in results:
        print("\n" + render_throttled(args, results))
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
