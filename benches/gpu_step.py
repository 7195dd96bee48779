#!/usr/bin/env python3
"""CUDA training step of a ~1B-parameter GPT, eight ways side by side; with ``--fit``, the
largest micro-batch each way fits (the ROK view). CUDA only.

Modes, all in this process, one after another, each on a fresh model built from the same
seeds (so their losses can be compared bitwise with keep's):

``keep``          plain training: autograd keeps every saved activation on the GPU.
``ssdtier_host``  ``ssdtier.attach`` with a host arena big enough that nothing reaches NVMe.
``checkpoint``    every block through non-reentrant ``torch.utils.checkpoint``.
``save_on_cpu``   ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward.
``torchtune``     ``torchtune.training.get_act_offloading_ctx_manager`` (``OffloadActivations``
                  with the output head left alone), when torchtune imports.
``ssdtier_nvme``  ``ssdtier.attach`` with a small arena (``--nvme-arena``), the rest on ``--dir``;
                  at keep's batch unless its activations would not fit there or, at fio's
                  rates, take over ``--disk-step-s`` to move (``--nvme-batch``).
``ssdtier_adaptive`` ``ssdtier_host``'s arena, ``--dir`` beyond it, ``policy.mode = "adaptive"``
                  and ``policy.device_budget = "auto"``: the last layers whose activations the
                  copies and the disk could not move in time stay on the GPU while it has room
                  (a user's setup: host RAM first, NVMe for the rest).
``ssdtier_cufile`` as ``ssdtier_nvme`` with ``io.backend = "cufile"``: GPU memory to the disk
                  and back through cuFile (GDS, or its compatibility mode), the arena unused.

The model is ssdtier.bench.models.GPT with fused attention (``--attention sdpa``: flash or cuDNN, as
LLM training uses; ``plain`` builds it from ops that save each block's T x T scores).
A step is forward + backward + fused AdamW under bf16 autocast (``--dtype``). After
``--warmup`` steps (gradients and optimizer state then exist), the peak counter is reset:
peak GPU memory = ``max_memory_allocated`` over the measured steps, activation memory = that
peak minus ``memory_allocated`` at the reset. Step time = median of the measured steps,
each between ``torch.cuda.synchronize`` calls. For the ssdtier modes, ``off.stats()`` before
and after gives NVMe bytes and the waits of forward and backward per step; those bytes at the
rates fio reaches on the same directory (same block size and queue depth) are set as a share
of the step: 1.00 means the step runs at the disk's speed. After a mode's steps, the
allocator's reserved memory is split by the stream it was reserved for.
A row at another batch than keep's has its activations and time compared per sample. Each
mode gets its share of the time left (``--budget-s``): a slow one is cut to fewer steps.

``--fit``: per mode, micro-batches 1, 2, 4... until one runs out of memory, then bisection;
each probe is ``--fit-steps`` steps, timed by its last. Keep's time per sample at its
largest batch is the reference; the report gives the largest batch each mode reaches at
<= ``--rok-time`` (1.05) times that, bisected between the probes on either side. A mode
stops growing once it runs ``--fit-slow`` (8) times slower per sample: it went to the disk.

    python benches/gpu_step.py --quick                 # small model, well under a minute
    python benches/gpu_step.py --json out.json         # the 1B model (batch: keep's largest)
    python benches/gpu_step.py --fit --json fit.json   # the ROK view
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import cpu_model, hostname, kernel, mem_total, mount_of, nproc
from train_step import gpt_config, md_table

from ssdtier.bench.fit import Probe, rok, search, search_batches, search_rok  # noqa: F401 (the tests use them here)
from ssdtier.bench.memory import free_cuda
from ssdtier.bench.peers import torchtune_maker
from ssdtier.bench.train import is_oom

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "benches" / "out" / "gpu_step-nvme"  # benches/out is git-ignored
# In the order they run: the disk bounds ssdtier_nvme's time, so a slow one cuts only it.
MODES = (
    "keep", "ssdtier_host", "checkpoint", "save_on_cpu", "torchtune",
    "ssdtier_nvme", "ssdtier_adaptive", "ssdtier_cufile",
)  # fmt: skip
# --fit's order: the modes that can fit more at keep's speed first, before the time runs out.
FIT_ORDER = (
    "keep",
    "ssdtier_adaptive",
    "checkpoint",
    "ssdtier_host",
    "save_on_cpu",
    "torchtune",
    "ssdtier_nvme",
    "ssdtier_cufile",
)
# --fit: adaptive mode's plan at a new batch comes from the step before; its probes take
# this many steps more, so that the one timed runs the plan made at that batch.
ADAPTIVE_SETTLE = 2
HOST_MODES = ("save_on_cpu", "torchtune")  # keep every activation in pinned host memory
HOST_RAM_USE = 0.7  # --fit: their batch stays within this share of the RAM available
SSDTIER_MODES = ("ssdtier_host", "ssdtier_nvme", "ssdtier_adaptive", "ssdtier_cufile")
DISK_MODES = ("ssdtier_nvme", "ssdtier_adaptive", "ssdtier_cufile")
# Defaults of the 1B run, and of --quick; an option given on the command line wins over both.
FULL = {
    "layers": 24, "d_model": 2048, "heads": 16, "seq": 2048, "vocab": 32000, "batch": "auto",
    "steps": 5, "warmup": 2, "nvme_arena": "2GiB", "fio_size": "4GiB", "fit_max_batch": 256,
}  # fmt: skip
QUICK = {
    "layers": 4, "d_model": 512, "heads": 8, "seq": 512, "vocab": 8192, "batch": "8",
    "steps": 3, "warmup": 2, "nvme_arena": "64MiB", "fio_size": "256MiB", "fit_max_batch": 64,
}  # fmt: skip
GOAL_ACT = 0.3  # the goal: activation memory <= 0.3 of keep ...
GOAL_TIME = 1.03  # ... at <= 1.03 of keep's step time
HOST_FACTOR = 1.5  # ssdtier_host's arena: keep's activation bytes times this ...
HOST_MAX_FRACTION = 0.6  # ... but at most this share of the machine's RAM (it is pinned)
GiB = 1 << 30
DEVICE = "cuda"  # the CPU smoke test (tests/test_gpu_bench.py) sets "cpu"


class BenchError(Exception):
    """A problem to report in one line (exit status 2), not a traceback."""


def log(msg: str) -> None:
    print(f"gpu_step: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- options


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}"
        )
    # Every ratio is to keep's figures, so keep always runs, first.
    return ("keep", *(m for m in MODES if m in names and m != "keep"))


def _int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="CUDA training step of a GPT (default ~1B parameters) with keep, ssdtier (host tier; "
        "NVMe), checkpointing, save_on_cpu and torchtune's OffloadActivations side by side; --fit: the "
        "largest micro-batch each fits."
    )
    g = p.add_argument_group("model and training (defaults: the 1B GPT; with --quick, a small one)")
    g.add_argument("--quick", action="store_true", help="4 blocks, width 512, seq 512, batch 8: well under a minute")
    for name, kind, what in (
        ("layers", int, "GPT blocks"),
        ("d-model", int, "model width"),
        ("heads", int, "attention heads"),
        ("seq", int, "sequence length"),
        ("vocab", int, "vocabulary size"),
        ("steps", int, "measured steps per mode"),
        ("warmup", int, "warmup steps per mode (>= 1: optimizer state must exist before the baseline)"),
    ):
        key = name.replace("-", "_")
        g.add_argument(f"--{name}", type=kind, help=f"{what} (default {FULL[key]}; --quick {QUICK[key]})")
    g.add_argument("--batch", help="micro-batch, or 'auto': the largest keep fits (default auto; --quick 8)")
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="bf16 autocast or plain fp32")
    g.add_argument(
        "--attention",
        choices=("sdpa", "plain"),
        default="sdpa",
        help="sdpa: scaled_dot_product_attention (fused: flash or cuDNN, as LLM training uses); plain: "
        "matmul and softmax ops, which save each block's T x T scores (default sdpa)",
    )
    g.add_argument("--dropout", type=float, default=0.0, help="dropout (LLM pretraining uses none)")
    g.add_argument("--seed", type=int, default=0, help="seed of weights and batch")
    g.add_argument("--compare-losses", type=int, default=2, help="first losses compared bitwise with keep's")
    g.add_argument(
        "--deterministic", action="store_true", help="torch.use_deterministic_algorithms (for the loss comparison)"
    )
    g = p.add_argument_group("modes and time")
    g.add_argument("--modes", type=_modes, default=MODES, help=f"comma-separated subset of {','.join(MODES)}")
    g.add_argument("--budget-s", type=float, default=540, help="modes not started within this many seconds are skipped")
    g.add_argument("--fit", action="store_true", help="the ROK view: the largest micro-batch of each mode")
    g.add_argument("--fit-steps", type=int, default=2, help="steps per --fit probe (timed by the last)")
    g.add_argument("--fit-max-batch", type=int, help="largest batch --fit tries (default 256; --quick 64)")
    g.add_argument("--rok-time", type=float, default=1.05, help="--fit: time per sample allowed, x keep's")
    g.add_argument(
        "--fit-slow",
        type=float,
        default=8.0,
        help="--fit: larger batches are not tried past this x keep's time per sample",
    )
    g = p.add_argument_group("ssdtier")
    g.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="NVMe directory, on a local disk (not tmpfs)")
    g.add_argument(
        "--host-capacity",
        default="auto",
        help=f"ssdtier_host's and ssdtier_adaptive's arena: a size, or auto = {HOST_FACTOR} x keep's activation "
        f"memory, at most {HOST_MAX_FRACTION} of RAM (--fit: that cap)",
    )
    g.add_argument("--nvme-arena", help="ssdtier_nvme's and ssdtier_cufile's arena (default 2GiB; --quick 64MiB)")
    g.add_argument(
        "--nvme-batch",
        type=_int_or_auto,
        default="auto",
        help="ssdtier_nvme's micro-batch; auto: keep's, lowered until its activations fit on the disk",
    )
    g.add_argument("--nvme-capacity", default="auto", help="NVMe capacity: a size, or auto = 0.8 of the free space")
    g.add_argument(
        "--disk-step-s",
        type=float,
        default=30.0,
        help="nvme batch auto: at most this many seconds of NVMe traffic per step at fio's rates (default 30)",
    )
    g.add_argument(
        "--policy-mode",
        choices=("auto", "all", "adaptive", "none"),
        help="policy.mode of the ssdtier modes but ssdtier_adaptive (default: all)",
    )
    g.add_argument("--keep-last-layers", type=_int_or_auto, help="policy.keep_last_layers (default: ssdtier's)")
    g.add_argument("--prefetch-layers", type=_int_or_auto, help="policy.prefetch_layers (default: ssdtier's)")
    g.add_argument("--min-tensor-bytes", help="policy.min_tensor_bytes (default: ssdtier's)")
    g.add_argument("--fio-size", help="bytes fio writes then reads in --dir (default 4GiB; --quick 256MiB)")
    g.add_argument("--no-fio", action="store_true", help="skip fio")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, help="write the results here (rewritten after every mode)")
    g.add_argument("--md", type=Path, help="also write the report (Markdown) here")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch != "auto":
        try:
            args.batch = int(args.batch)
        except ValueError:
            p.error(f"--batch must be an integer or 'auto', got {args.batch!r}")
        if args.batch < 1:
            p.error("--batch must be >= 1")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if args.fit_steps < 1 or args.fit_max_batch < 1:
        p.error("--fit-steps and --fit-max-batch must be >= 1")
    if args.fit_slow <= args.rok_time:
        p.error("--fit-slow must be more than --rok-time")
    args.dir = args.dir.expanduser().resolve()
    return args


def args_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def param_count(args: argparse.Namespace) -> int:
    """Parameters of ssdtier.bench.models.GPT (tied embeddings, d_ff = 4 d), without building it."""
    d, ff = args.d_model, 4 * args.d_model
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)  # 2 LayerNorms, qkv, proj, MLP
    return args.vocab * d + args.seq * d + args.layers * block + 2 * d


# ---------------------------------------------------------------- the machine, the disk


def mem_available() -> int:
    """MemAvailable, or the room under this process's cgroup limit where that is less."""
    from ssdtier.ram import available

    got = available()
    return got.bytes if got is not None else mem_total()


def check_dir(path: Path) -> dict[str, str]:
    """Create ``path``; refuse tmpfs and ramfs (spill files there would be RAM, not disk)."""
    from ssdtier.paths import is_tmpfs

    m = mount_of(path)
    if is_tmpfs(path) or m["fstype"] in ("tmpfs", "ramfs"):
        raise BenchError(f"--dir {path} is on {m['fstype']} ({m['mountpoint']}): NVMe spill files must be on a disk")
    path.mkdir(parents=True, exist_ok=True)
    return mount_of(path)


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "hostname": hostname(),
        "gpu": props.name,
        "gpu_memory": props.total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "nproc": nproc(),
        "kernel": kernel(),
        "mem_total": mem_total(),
        "dir": str(args.dir),
        "mount": mount_of(args.dir),
        "disk_free": shutil.disk_usage(args.dir).free,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }


def fio_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """fio write then read of ``--fio-size`` in ``--dir``, as the store does I/O (io_uring,
    O_DIRECT, its default block size and queue depth); with psync where io_uring is refused
    (gVisor), as the store then falls back to its POSIX engine."""
    from ssdtier.bench.disk import run_fio
    from ssdtier.config import IoConfig
    from ssdtier.errors import SsdtierError
    from ssdtier.sizes import parse_size

    fio = shutil.which("fio")
    if fio is None:
        return {"status": "fio is not installed"}
    io = IoConfig()
    size = parse_size(args.fio_size, key="--fio-size", source="command line")
    path = args.dir / ".gpu_step-fio.dat"
    failed = ""
    try:
        for engine in ("io_uring", "psync"):
            out: dict[str, Any] = {"status": "ok", "bytes": size, "block": io.block_size, "depth": io.queue_depth}
            out["engine"] = engine
            try:
                for rw in ("write", "read"):
                    log(f"fio {rw} of {size / GiB:.2f} GiB in {args.dir} ({engine})")
                    res = run_fio(fio, str(path), rw, size, io.block_size, io.queue_depth, (f"--ioengine={engine}",))
                    out[rw] = res["bw_bytes"]
                    out[f"{rw}_cmd"] = " ".join(res["cmd"])
            except SsdtierError as e:
                failed += f"{engine}: {str(e).splitlines()[0][:300]}; "
                continue
            if out["write"] > 0 and out["read"] > 0:
                return out
            failed += f"{engine}: no bytes moved; "
    finally:
        path.unlink(missing_ok=True)
    return {"status": f"fio failed: {failed.rstrip('; ')}"}


# ---------------------------------------------------------------- the modes


def copy_rate() -> dict[str, Any]:
    """Copies between the GPU and pinned host memory, as the adaptive plan measures them."""
    import torch

    from ssdtier.offload.adaptive import copy_bandwidth

    try:
        return {"status": "ok", "bytes_per_s": copy_bandwidth(torch.device(DEVICE))}
    except Exception as e:
        return {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}


def ssdtier_config(args: argparse.Namespace, host: int, nvme: int) -> dict[str, Any]:
    policy: dict[str, Any] = {"mode": "all"}  # not the default "auto" (adaptive on a GPU): ssdtier_adaptive is that
    for key in ("mode", "keep_last_layers", "prefetch_layers", "min_tensor_bytes"):
        value = getattr(args, "policy_mode" if key == "mode" else key)
        if value is not None:
            policy[key] = value
    cfg: dict[str, Any] = {"host": {"capacity": host}, "nvme": [{"path": str(args.dir), "capacity": nvme}]}
    cfg["policy"] = policy
    return cfg


def host_capacity(
    args: argparse.Namespace, keep_act: int | None, ram: int, available: int | None = None
) -> tuple[int, str]:
    """ssdtier_host's (and ssdtier_adaptive's) arena in bytes, and how it was chosen: at most
    HOST_MAX_FRACTION of the RAM and what ssdtier would pin of what is available."""
    from ssdtier.ram import pinnable
    from ssdtier.sizes import parse_size

    if args.host_capacity != "auto":
        return parse_size(args.host_capacity, key="--host-capacity", source="command line"), "--host-capacity"
    cap, limit = int(HOST_MAX_FRACTION * ram), f"{HOST_MAX_FRACTION} of RAM"
    if available is not None and pinnable(available) < cap:
        cap, limit = pinnable(available), "what ssdtier pins of the RAM available"
    if keep_act is None or args.fit:
        return cap >> 20 << 20, limit
    want = int(HOST_FACTOR * keep_act)
    if want > cap:
        return cap >> 20 << 20, f"{HOST_FACTOR} x keep's activations, capped at {limit}"
    return max(want >> 20 << 20, 256 << 20), f"{HOST_FACTOR} x keep's activations"


def nvme_capacity(args: argparse.Namespace) -> int:
    from ssdtier.sizes import parse_size

    if args.nvme_capacity != "auto":
        return parse_size(args.nvme_capacity, key="--nvme-capacity", source="command line")
    return max(int(0.8 * shutil.disk_usage(args.dir).free) >> 20 << 20, GiB)


def free_memory() -> None:
    """Between modes and after an OOM: Python garbage, the caching allocators (device and pinned host)."""
    import torch

    free_cuda()
    torch.cuda.reset_peak_memory_stats()


def reserved_by_stream(off: Any) -> dict[str, dict[str, int]]:
    """The allocator's segments by the stream they were reserved for: reserved, allocated, and
    freed but awaiting other streams. What a side stream's pool (ssdtier's prefetch stream)
    adds to reserved memory."""
    import torch

    if DEVICE != "cuda":
        return {}
    names = {torch.cuda.current_stream().cuda_stream: "compute"}
    if off is not None:
        for offload, prefetch in off.cuda.streams.values():
            names[offload.cuda_stream] = "ssdtier offload"
            names[prefetch.cuda_stream] = "ssdtier prefetch"
        for side in off.cpu.side.values():
            names[side.cuda_stream] = "ssdtier cuFile reads"
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # an older torch: no include_traces
        segments = torch.cuda.memory_snapshot()
    out: dict[str, dict[str, int]] = {}
    for seg in segments:
        d = out.setdefault(names.get(seg["stream"], "other streams"), {"reserved": 0, "allocated": 0, "awaiting": 0})
        d["reserved"] += seg["total_size"]
        d["allocated"] += seg["allocated_size"]
        # Freed, but another stream may still use it (a source whose copy out is queued).
        d["awaiting"] += seg.get("active_size", seg["allocated_size"]) - seg["allocated_size"]
    return out


def alloc_retries() -> int:
    """Allocations the caching allocator retried after freeing its cached blocks, so far: each
    is a stall, and adaptive mode's auto budget reads one as the GPU running full."""
    import torch

    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if DEVICE == "cuda" else 0


def release(setup: Setup | None, r: dict[str, Any]) -> None:
    """A mode's end: detach, free; a failure here goes into its result, and the next mode still runs."""
    try:
        if setup is not None:
            setup.close()
        free_memory()
    except Exception as e:
        r.setdefault("error", f"at release: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()


class Phases:
    """Where the measured steps go: each step's forward, backward and optimizer step, in GPU
    seconds (CUDA events; host clocks on the CPU) and in the host's seconds (the GPU's time
    close to the host's says the host was the limit), the peak allocated and reserved memory
    in each (the peak counters reset between them), and what is allocated at the forward's end."""

    NAMES = ("forward", "backward", "optimizer")

    def __init__(self) -> None:
        self.steps: list[dict[str, list[float]]] = []
        self.marks: list[Any] = []
        self.clocks: list[float] = []  # the host's, at each mark
        self.peaks: list[tuple[int, int]] = []
        self.held = 0

    @staticmethod
    def _mark() -> Any:
        import torch

        if DEVICE != "cuda":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def _memory() -> tuple[int, int, int]:
        """Allocated now, its peak and reserved's peak: one call to the allocator's counters."""
        import torch

        if DEVICE != "cuda":
            return 0, 0, 0
        st = torch.cuda.memory_stats_as_nested_dict()
        return (
            st["allocated_bytes"]["all"]["current"],
            st["allocated_bytes"]["all"]["peak"],
            st["reserved_bytes"]["all"]["peak"],
        )

    def begin(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()
        self.marks, self.peaks, self.clocks = [self._mark()], [], [time.perf_counter()]

    def lap(self) -> None:
        """A phase ends."""
        import torch

        self.marks.append(self._mark())
        self.clocks.append(time.perf_counter())
        now, peak, reserved = self._memory()
        if len(self.marks) == 2:
            self.held = now
        self.peaks.append((peak, reserved))
        torch.cuda.reset_peak_memory_stats()

    def end(self) -> None:
        """After the step's synchronize."""
        m = self.marks
        if DEVICE == "cuda":
            secs = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(m)]
        else:
            secs = [b - a for a, b in itertools.pairwise(m)]
        self.steps.append(
            {
                "seconds": secs,
                "host_seconds": [b - a for a, b in itertools.pairwise(self.clocks)],
                "allocated": [float(p[0]) for p in self.peaks],
                "reserved": [float(p[1]) for p in self.peaks],
                "held": [float(self.held)],
            }
        )

    @property
    def peak(self) -> tuple[int, int]:
        """The peak allocated and reserved over every step measured (the counters were reset)."""
        return (
            int(max((max(s["allocated"]) for s in self.steps), default=0)),
            int(max((max(s["reserved"]) for s in self.steps), default=0)),
        )

    def summary(self, base: int) -> dict[str, Any]:
        """Median seconds and peak bytes above ``base`` per phase, over the steps measured."""
        out: dict[str, Any] = {}
        for i, name in enumerate(self.NAMES):
            out[f"{name}_s"] = statistics.median(s["seconds"][i] for s in self.steps)
            out[f"{name}_host_s"] = statistics.median(s["host_seconds"][i] for s in self.steps)
            out[f"{name}_peak_bytes"] = max(s["allocated"][i] for s in self.steps) - base
            out[f"{name}_reserved_bytes"] = max(s["reserved"][i] for s in self.steps) - base
        out["held_at_forward_end_bytes"] = max(s["held"][0] for s in self.steps) - base
        return out


class Setup:
    """One mode's model (built on the GPU from ``--seed``), fused AdamW and saved-tensor handling."""

    def __init__(self, mode: str, args: argparse.Namespace, ssd: dict[str, Any] | None, tt: Any) -> None:
        import torch

        from ssdtier.bench.models import build_model

        self.mode, self.args, self.tt = mode, args, tt
        self.cfg = gpt_config(args, mode == "checkpoint")
        torch.manual_seed(args.seed)
        with torch.device(DEVICE):
            self.model = build_model(self.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)  # fused: no big temporaries
        self.off: Any = None
        self.ctx: Callable[[], Any] = contextlib.nullcontext
        self.phases: Phases | None = None  # set while the steps are measured
        if ssd is not None:
            import ssdtier

            self.off = ssdtier.attach(self.model, ssd)
        elif mode == "save_on_cpu":
            self.ctx = lambda: torch.autograd.graph.save_on_cpu(pin_memory=DEVICE == "cuda")  # pinning needs CUDA
        elif mode == "torchtune":
            self.reset_hooks()
        torch.manual_seed(args.seed + 2)  # dropout masks, the same stream in every mode

    def reset_hooks(self) -> None:
        """torchtune's context asserts that the last backward emptied it: a fresh one after an OOM."""
        if self.mode == "torchtune":
            ctx = self.tt(self.model)
            self.ctx = lambda: ctx

    def batch(self, n: int) -> Any:
        import torch

        from ssdtier.bench.models import make_batch

        return make_batch(self.cfg, n, torch.Generator().manual_seed(self.args.seed + 1), device=DEVICE)

    def step(self, batch: Any) -> tuple[float, float]:
        """One training step: (seconds between synchronizes, loss)."""
        import torch

        from ssdtier.bench.models import batch_loss

        ph = self.phases
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if ph is not None:
            ph.begin()
        self.opt.zero_grad(set_to_none=False)  # gradients stay allocated: in the baseline
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=self.args.dtype == "bf16"), self.ctx():
            loss = batch_loss(self.model, batch)
        if ph is not None:
            ph.lap()
        loss.backward()
        if ph is not None:
            ph.lap()
        self.opt.step()
        if ph is not None:
            ph.lap()
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        if ph is not None:
            ph.end()
        return t, float(loss.detach())

    def stats(self) -> dict[str, Any] | None:
        return self.off.stats().as_dict() if self.off is not None else None

    def store_info(self) -> dict[str, Any]:
        st = self.off.store
        arena = getattr(st, "arena", None)
        return {
            "backend": getattr(st, "backend", "?"),
            "cufile": self.off.uses_cufile,  # CUDA activations through cuFile, not the arena
            "direct": getattr(st, "direct", "?"),
            "fixed_buffers": getattr(st, "fixed_buffers", "?"),
            "arena_bytes": arena.numel() if arena is not None else 0,
            "layers": self.off.layers_path,
            "policy": self.off.config.to_dict().get("policy", {}),
        }

    def close(self) -> None:
        if self.off is not None:
            self.off.detach()
        self.off = self.model = self.opt = None
        self.ctx = contextlib.nullcontext


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counters of ``off.stats()`` over a region (peaks, capacities and lists as they are at its end)."""
    out: dict[str, Any] = {}
    for k, v in after.items():
        if k == "plan":  # the adaptive plan in force: not a counter
            out[k] = v
        elif isinstance(v, dict):
            out[k] = delta(v, before.get(k) or {})
        elif (
            isinstance(v, (int, float)) and not isinstance(v, bool) and "peak" not in k and not k.endswith("_capacity")
        ):
            out[k] = v - before.get(k, 0)
        else:
            out[k] = v
    return out


def measure(mode: str, args: argparse.Namespace, batch_size: int, ssd: Any, tt: Any, deadline: float) -> dict[str, Any]:
    """Build, warm up and measure one mode; an OOM or an error is reported in the result."""
    import torch

    from ssdtier.bench.memory import CudaPeak

    r: dict[str, Any] = {"mode": mode, "batch": batch_size, "status": "ok"}
    setup: Setup | None = None
    batch = None
    t_start = time.monotonic()
    try:
        setup = Setup(mode, args, ssd, tt)
        if setup.off is not None:
            r["store"] = setup.store_info()
        batch = setup.batch(batch_size)
        losses: list[float] = []
        warm: list[float] = []
        for i in range(args.warmup):
            if warm and time.monotonic() > deadline:
                r["note"] = f"warmup cut to {len(warm)} step(s): over its share of --budget-s"
                break
            t, loss = setup.step(batch)
            warm.append(t)
            losses.append(loss)
            log(f"[{mode}] warmup {i + 1}/{args.warmup}: {t:.3f} s, loss {loss:.5f}")
        probe = CudaPeak(torch.device(DEVICE))
        probe.start()
        phases = setup.phases = Phases()
        before, retries = setup.stats(), alloc_retries()
        times: list[float] = []
        for i in range(args.steps):
            if times and time.monotonic() > deadline:
                r["note"] = (
                    r.get("note", "") + f"; cut to {len(times)} measured step(s): over its share of --budget-s"
                ).lstrip("; ")
                break
            t, loss = setup.step(batch)
            times.append(t)
            losses.append(loss)
            log(f"[{mode}] step {i + 1}/{args.steps}: {t:.3f} s, loss {loss:.5f}")
        peak, base = probe.stop()
        setup.phases = None
        # The phases reset the peak counters: the peaks are theirs.
        peak, reserved = max(peak, phases.peak[0]), max(probe.reserved, phases.peak[1])
        r["phases"] = phases.summary(base)
        r["reserved_by_stream"] = reserved_by_stream(setup.off)
        r["alloc_retries_per_step"] = (alloc_retries() - retries) / len(times)
        after = setup.stats()
        plan = setup.off.plan() if setup.off is not None else None
        if plan is not None:
            r["plan"] = plan.table()
        med = statistics.median(times)
        r.update(
            peak_bytes=peak,
            baseline_bytes=base,
            act_bytes=peak - base,
            reserved_bytes=reserved,
            reserved_act_bytes=reserved - base,
            alloc_retries_per_step=probe.retries / len(times),
            step_seconds=times,
            warmup_seconds=warm,
            median_step_s=med,
            tokens_per_s=batch_size * args.seq / med,
            losses=[x.hex() for x in losses],
        )
        if after is not None and before is not None:
            d = delta(after, before)
            n = len(times)
            r["offload"] = d
            r["per_step"] = {
                "nvme_written": d["bytes_written_nvme"] / n,
                "nvme_read": d["bytes_read_nvme"] / n,
                "offloaded": d["bytes_offloaded"] / n,
                "stall_s": d["stall_seconds"] / n,
                "forward_wait_s": d["forward_wait_seconds"] / n,
                "gpu_wait_s": d.get("gpu_wait_seconds", 0.0) / n,
                "failed_writes": d["failed_writes"] / n,
            }
            r["nvme_write_bps"] = d["bytes_written_nvme"] / n / med
            r["nvme_read_bps"] = d["bytes_read_nvme"] / n / med
    except Exception as e:
        if is_oom(e):
            r.update(status="OOM", error=(str(e).splitlines() or [""])[0][:300])
        else:
            r.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc()
    finally:
        batch = None
        release(setup, r)
        setup = None
    r["wall_s"] = time.monotonic() - t_start
    return r


# ---------------------------------------------------------------- --fit and --batch auto


def fit_mode(
    mode: str,
    args: argparse.Namespace,
    ssd: Any,
    tt: Any,
    until: float,
    steps: int,
    max_batch: int,
    ref: float | None = None,
) -> dict[str, Any]:
    """The largest micro-batch ``mode`` fits, each probe ``steps`` steps (the first probe one
    more); with keep's time per sample ``ref``, also the largest at <= --rok-time x it."""
    import torch

    r: dict[str, Any] = {"mode": mode, "status": "ok", "probes": []}
    t_start = time.monotonic()
    setup: Setup | None = None
    try:
        setup = Setup(mode, args, ssd, tt)
        if setup.off is not None:
            r["store"] = setup.store_info()
        s = setup

        def first_step(batch: Any, probe: dict[str, Any]) -> float:
            """A probe's first step. Adaptive mode's device budget was learned at another
            batch: out of memory, its first step is tried once more, as a job that starts at
            this batch would not have run the others."""
            try:
                return s.step(batch)[0]
            except Exception as e:
                if mode != "ssdtier_adaptive" or not is_oom(e):
                    raise
            free_memory()
            s.reset_hooks()
            probe["first_step_out_of_memory"] = True
            log(f"fit [{mode}] batch {probe['batch']}: out of memory at its first step; once more")
            return s.step(batch)[0]

        def probe_at(b: int) -> dict[str, Any] | None:
            if time.monotonic() > until:
                return None
            probe: dict[str, Any] = {"batch": b}
            batch = None
            try:
                batch = s.batch(b)
                before = s.stats()
                torch.cuda.reset_peak_memory_stats()
                probe["base_bytes"] = torch.cuda.memory_allocated()
                retries = alloc_retries()
                first = first_step(batch, probe)
                more = steps - 1 + (0 if r["probes"] else 1) + (ADAPTIVE_SETTLE if mode == "ssdtier_adaptive" else 0)
                # A step past --fit-slow ends the probe (on the disk, steps take minutes); not
                # the first probe's first step, which warms up.
                slow_s = args.fit_slow * ref * b if ref is not None else float("inf")
                times = [first]
                while len(times) <= more and (times[-1] <= slow_s or len(times) == 1 and not r["probes"]):
                    times.append(s.step(batch)[0])
                after = s.stats()
                probe.update(fits=True, steps=len(times), step_s=times[-1], s_per_sample=times[-1] / b)
                probe["slow"] = times[-1] > slow_s
                probe["peak_bytes"] = torch.cuda.max_memory_allocated()
                probe["reserved_by_stream"] = reserved_by_stream(s.off)
                probe["alloc_retries"] = alloc_retries() - retries
                plan = s.off.plan() if s.off is not None else None
                if plan is not None:
                    probe["layers_kept"] = plan.keep_last
                if before is not None and after is not None:
                    d = delta(after, before)
                    probe["nvme_written_per_step"] = d["bytes_written_nvme"] / len(times)
                    probe["failed_writes"] = d["failed_writes"]
            except Exception as e:
                if not is_oom(e):
                    raise
                probe["fits"] = False
            finally:
                batch = None
                free_memory()
            if probe["fits"]:
                log(
                    f"fit [{mode}] batch {b}: {probe['step_s']:.3f} s/step, "
                    f"{probe['s_per_sample'] * 1e3:.1f} ms/sample, peak {probe['peak_bytes'] / GiB:.1f} GiB"
                )
            else:
                log(f"fit [{mode}] batch {b}: out of memory")
                s.reset_hooks()
            return probe

        # search() appends each probe to r["probes"] after probe_at returns it.
        limits = [args.rok_time * ref] if ref is not None and mode != "keep" else []
        r.update(search(probe_at, max_batch, limits, r["probes"]))
    except Exception as e:
        r.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
        traceback.print_exc()
    finally:
        release(setup, r)
        setup = None
    best = [p for p in r["probes"] if p.get("fits") and p["batch"] == r.get("largest")]
    r["at_largest"] = best[-1] if best else None
    r["wall_s"] = time.monotonic() - t_start
    return r


def auto_batch(args: argparse.Namespace, until: float) -> dict[str, Any]:
    """--batch auto: keep's largest micro-batch (one step per probe)."""
    log("--batch auto: searching keep's largest micro-batch")
    r = fit_mode("keep", args, None, None, until, 1, args.fit_max_batch)
    if r["status"] != "ok" or r.get("largest", 0) < 1:
        raise BenchError(f"--batch auto: keep fits no batch ({r.get('error', 'out of memory at batch 1')})")
    log(f"--batch auto: keep fits batch {r['largest']}" + (" (search cut by time)" if r.get("cut") else ""))
    return r


# ---------------------------------------------------------------- runs


def ssd_for(mode: str, args: argparse.Namespace, keep_act: int | None, notes: dict[str, str]) -> Any:
    """The ssdtier config of ``mode`` (None for the others)."""
    from ssdtier.sizes import parse_size

    if mode not in SSDTIER_MODES:
        return None
    nvme = nvme_capacity(args)
    if mode in ("ssdtier_host", "ssdtier_adaptive"):
        host, why = host_capacity(args, keep_act, mem_total(), mem_available())
        notes[mode] = f"host.capacity {host / GiB:.1f} GiB ({why}); nvme capacity {nvme / GiB:.1f} GiB"
    else:
        host = parse_size(args.nvme_arena, key="--nvme-arena", source="command line")
        notes[mode] = f"host.capacity {host / GiB:.2f} GiB (--nvme-arena); nvme capacity {nvme / GiB:.1f} GiB"
    cfg = ssdtier_config(args, host, nvme)
    if mode == "ssdtier_cufile":
        cfg["io"] = {"backend": "cufile"}
    if mode == "ssdtier_adaptive":
        cfg.setdefault("policy", {}).update(mode="adaptive", device_budget="auto")
    return cfg


def nvme_batch(
    args: argparse.Namespace, batch: int, keep_act: int | None, ssd: dict[str, Any], fio: dict[str, Any] | None = None
) -> tuple[int, str]:
    """A disk mode's micro-batch: --nvme-batch, or keep's lowered until its activations fit in
    the arena and on the disk (a forward writes them all before the backward reads any) and,
    where most of them go to NVMe, until fio's rates move a step's bytes in --disk-step-s."""
    room = ssd["host"]["capacity"] + ssd["nvme"][0]["capacity"]
    if args.nvme_batch != "auto":
        b = args.nvme_batch
        if keep_act is not None and keep_act / batch * b > room:
            return b, f"; at batch {b} keep's activations would exceed {room / GiB:.0f} GiB: expect failed writes"
        return b, ""
    if keep_act is None:
        return batch, ""
    b, why = batch, ""
    if keep_act > 0.9 * room:
        b = max(1, int(0.9 * room / (keep_act / batch)))
        why = f"; batch {b}, not {batch}: keep's activations at {batch} exceed 0.9 x {room / GiB:.0f} GiB"
    if fio is not None and fio.get("status") == "ok" and ssd["host"]["capacity"] < keep_act:
        per_sample = keep_act / batch * (1 / fio["write"] + 1 / fio["read"])  # seconds of NVMe traffic
        fast = max(1, int(args.disk_step_s / per_sample))
        if fast < b:
            b = fast
            why = f"; batch {b}, not {batch}: at fio's rates a step's NVMe traffic would take over {args.disk_step_s} s"
    return b, why


def write_out(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


def run_steps(args: argparse.Namespace, results: dict[str, Any], deadline: float) -> None:
    """The side-by-side run: every mode at one micro-batch."""
    tt, tt_what = torchtune_maker() if "torchtune" in args.modes else (None, "")
    if tt is not None:
        results["config_notes"]["torchtune"] = tt_what
    if any(m in args.modes for m in DISK_MODES) and not args.no_fio:
        results["fio"] = fio_bandwidth(args)
    if DEVICE == "cuda":
        results["copy"] = copy_rate()
    batch = args.batch
    if batch == "auto":
        found = auto_batch(args, time.monotonic() + args.budget_s / 4)
        results["auto_batch"] = {k: v for k, v in found.items() if k != "store"}
        batch = found["largest"]
    results["batch"] = batch
    runs: dict[str, Any] = results["modes"]
    notes: dict[str, str] = results["config_notes"]
    for i, mode in enumerate(args.modes):
        now = time.monotonic()
        # Each mode's share of the time left, so that one slow mode does not crowd out the rest
        # (each still runs one warmup and one measured step).
        share = now + (deadline - now) / (len(args.modes) - i)
        if now > deadline:
            runs[mode] = {"mode": mode, "status": "skipped", "error": f"over --budget-s {args.budget_s:.0f}"}
            log(f"[{mode}] skipped: over the time budget")
            continue
        if mode == "torchtune" and tt is None:
            runs[mode] = {"mode": mode, "status": "not installed", "error": tt_what}
            log(f"[{mode}] skipped: {tt_what}")
            continue
        keep = runs.get("keep", {})
        keep_act = keep.get("act_bytes") if keep.get("status") == "ok" else None
        ssd = ssd_for(mode, args, keep_act, notes)
        mode_batch = batch
        if mode in DISK_MODES:
            mode_batch, why = nvme_batch(args, batch, keep_act, ssd, results.get("fio"))
            notes[mode] += why
        log(f"[{mode}] started at batch {mode_batch}" + (f": {notes[mode]}" if mode in notes else ""))
        r = measure(mode, args, mode_batch, ssd, tt, share)
        # A batch found by 'auto' can be one too many once the allocator is fragmented.
        while mode == "keep" and args.batch == "auto" and r["status"] == "OOM" and batch > 1:
            batch -= 1
            results["batch"] = batch
            log(f"[keep] OOM at the auto batch: batch {batch}")
            r = measure(mode, args, batch, ssd, tt, share)
        runs[mode] = r
        if r["status"] == "ok":
            log(
                f"[{mode}] peak {r['peak_bytes'] / GiB:.2f} GiB, activations {r['act_bytes'] / GiB:.2f} GiB, "
                f"median step {r['median_step_s']:.3f} s ({time.monotonic() - results['t0']:.0f} s elapsed)"
            )
        else:
            log(f"[{mode}] {r['status']}: {r.get('error', '')}")
        write_out(args, results)
    compare(args, results)


def compare(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Ratios to keep, losses equal to keep's, and the goal, into ``results``."""
    runs = results["modes"]
    keep = runs.get("keep", {})
    # Fused attention's backward (flash or cuDNN) is not bitwise reproducible unless
    # deterministic: after the first step the weights differ from keep's in any mode.
    n = args.compare_losses if args.deterministic or args.attention == "plain" else min(args.compare_losses, 1)
    results["losses_compared"] = n
    goal = {}
    for mode, r in runs.items():
        if r.get("status") != "ok" or keep.get("status") != "ok":
            continue
        scale = r["batch"] / keep["batch"]  # another batch than keep's: activations and time per sample
        r["peak_vs_keep"] = r["peak_bytes"] / max(keep["peak_bytes"], 1)
        r["act_vs_keep"] = r["act_bytes"] / max(keep["act_bytes"] * scale, 1)
        if "reserved_act_bytes" in r and "reserved_act_bytes" in keep:
            r["reserved_act_vs_keep"] = r["reserved_act_bytes"] / max(keep["reserved_act_bytes"] * scale, 1)
        r["time_vs_keep"] = r["median_step_s"] / (keep["median_step_s"] * scale)
        # Losses of another batch are other numbers: not compared (None).
        same = r["batch"] == keep["batch"]
        r["losses_equal_keep"] = (len(r["losses"]) >= n and r["losses"][:n] == keep["losses"][:n]) if same else None
        if mode != "keep":
            # Reserved too: a source whose copy out is still queued is no longer "allocated".
            act = max(r["act_vs_keep"], r.get("reserved_act_vs_keep", 0.0))
            met = act <= GOAL_ACT and r["time_vs_keep"] <= GOAL_TIME
            goal[mode] = {"met": met, "act_vs_keep": act, "time_vs_keep": r["time_vs_keep"]}
    results["goal"] = goal


def act_per_sample(keep: dict[str, Any] | None) -> float | None:
    """keep's activation bytes per sample at its largest batch (--fit)."""
    p = (keep or {}).get("at_largest")
    return (p["peak_bytes"] - p["base_bytes"]) / p["batch"] if p and "base_bytes" in p else None


def run_fit(args: argparse.Namespace, results: dict[str, Any], deadline: float) -> None:
    """--fit: every mode's largest micro-batch, and the ROK view."""
    fit: dict[str, Any] = results["fit"]
    notes: dict[str, str] = results["config_notes"]
    tt, tt_what = torchtune_maker() if "torchtune" in args.modes else (None, "")
    if tt is not None:
        notes["torchtune"] = tt_what
    order = sorted(args.modes, key=FIT_ORDER.index)
    left = [m for m in order if m != "torchtune" or tt is not None]
    for mode in order:
        if mode not in left:
            fit[mode] = {"mode": mode, "status": "not installed", "error": tt_what}
            continue
        left.remove(mode)
        now = time.monotonic()
        if now > deadline:
            fit[mode] = {"mode": mode, "status": "skipped", "error": f"over --budget-s {args.budget_s:.0f}"}
            continue
        # The time left, shared by the modes left: what one does not use passes to the next.
        until = now + (deadline - now) / (len(left) + 1)
        ssd = ssd_for(mode, args, None, notes)
        max_batch = args.fit_max_batch
        per_sample = act_per_sample(fit.get("keep"))
        if mode in HOST_MODES and per_sample:
            # Their activations go to pinned RAM: past it the kernel, not CUDA, would stop them.
            max_batch = max(1, min(max_batch, int(HOST_RAM_USE * mem_available() / per_sample)))
            notes[mode] = (
                f"batch at most {max_batch}: {HOST_RAM_USE} of the RAM available / keep's activations per sample"
            )
        log(f"fit [{mode}] started, until +{until - now:.0f} s" + (f": {notes[mode]}" if mode in notes else ""))
        ref = ((fit.get("keep") or {}).get("at_largest") or {}).get("s_per_sample")
        fit[mode] = fit_mode(mode, args, ssd, tt, until, args.fit_steps, max_batch, ref)
        fit[mode]["max_batch"] = max_batch
        write_out(args, results)
    results["rok_reference_s_per_sample"] = rok(fit, args.rok_time)


# ---------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _by_stream(by: dict[str, dict[str, int]]) -> str:
    return ", ".join(
        f"{k} {_gib(v['reserved'])} ({_gib(v['reserved'] - v['allocated'] - v.get('awaiting', 0))} free"
        + (f", {_gib(v['awaiting'])} awaiting other streams)" if v.get("awaiting") else ")")
        for k, v in by.items()
    )


def _x(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.3f}" if key in r else "-"


def header(results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    a = results["args"]
    mt = m["mount"]
    lines = [
        f"machine: {m['hostname']}, {m['gpu']} ({m['gpu_memory'] / GiB:.0f} GiB), {m['nproc']} CPUs ({m['cpu']}), "
        f"{m['mem_total'] / GiB:.0f} GiB RAM, kernel {m['kernel']}; Python {m['python']}, torch {m['torch']}, "
        f"CUDA {m['cuda']}",
        f"model: GPT {results['params'] / 1e6:,.0f}M parameters: {a['layers']} blocks, d_model {a['d_model']}, "
        f"{a['heads']} heads ({a.get('attention', 'plain')} attention), seq {a['seq']}, vocab {a['vocab']}, "
        f"dropout {a['dropout']}; {a['dtype']}"
        f"{' autocast' if a['dtype'] == 'bf16' else ''}, fused AdamW",
        f"--dir {m['dir']} on {mt['device']} ({mt.get('medium', mt['fstype'])}), {m['disk_free'] / GiB:.0f} GiB free",
    ]
    if m.get("alloc_conf"):
        lines.append(f"PYTORCH_CUDA_ALLOC_CONF={m['alloc_conf']}")
    for mode, note in results.get("config_notes", {}).items():
        lines.append(f"{mode}: {note}")
    return lines


def render_steps(results: dict[str, Any]) -> str:
    runs = results["modes"]
    a = results["args"]
    lines = ["== gpu_step: one training step, side by side ==", *header(results)]
    auto = " (keep's largest, --batch auto)" if "auto_batch" in results else ""
    lines.append(
        f"micro-batch {results.get('batch')}{auto}; {a['warmup']} warmup + {a['steps']} measured steps per mode; "
        "peak = max_memory_allocated over the measured steps; activations = peak - memory_allocated at their "
        "start (weights, gradients, optimizer state already there); reserved = max_memory_reserved less the "
        "same (the cache emptied first): it also counts blocks whose copy out is still queued; step = median, "
        "between synchronizes"
    )
    lines.append("")
    hdr = ["mode", "batch", "peak GiB", "x keep", "activations GiB", "x keep", "reserved GiB", "x keep"]
    hdr += ["step s", "x keep", "tokens/s"]
    n = results.get("losses_compared", a["compare_losses"])
    hdr += [f"losses = keep ({n})", "NVMe GB/step w+r", "NVMe GB/s w / r", "wait s/step fwd / bwd / GPU"]
    rows = []
    for mode, r in runs.items():
        if r.get("status") != "ok":
            rows.append([mode, r.get("status", "?"), *["-"] * (len(hdr) - 2)])
            continue
        ps = r.get("per_step")
        eq = r.get("losses_equal_keep")
        rows.append(
            [
                mode,
                str(r["batch"]),
                _gib(r["peak_bytes"]),
                _x(r, "peak_vs_keep"),
                _gib(r["act_bytes"]),
                _x(r, "act_vs_keep"),
                _gib(r["reserved_act_bytes"]) if "reserved_act_bytes" in r else "-",
                _x(r, "reserved_act_vs_keep"),
                f"{r['median_step_s']:.3f}",
                _x(r, "time_vs_keep"),
                f"{r['tokens_per_s']:,.0f}",
                "-" if eq is None else ("yes" if eq else "NO"),
                f"{ps['nvme_written'] / 1e9:.1f} + {ps['nvme_read'] / 1e9:.1f}" if ps else "-",
                f"{r['nvme_write_bps'] / 1e9:.2f} / {r['nvme_read_bps'] / 1e9:.2f}" if ps else "-",
                f"{ps.get('forward_wait_s', 0.0):.3f} / {ps['stall_s']:.3f} / {ps.get('gpu_wait_s', 0.0):.3f}"
                if ps
                else "-",
            ]
        )
    lines += md_table(hdr, rows)
    lines.append("")
    lines += render_phases(runs)
    if n < a["compare_losses"]:
        lines.append(
            f"(losses: only the first {n} compared: fused attention's backward is not bitwise reproducible; "
            "--deterministic compares more, and tests/test_cuda.py checks exact gradients)"
        )
    if any(r.get("batch") not in (None, results.get("batch")) for r in runs.values()):
        lines.append("(a row at another batch than keep's: its activations and step time x keep are per sample)")
    retried = [f"{m} {r['alloc_retries_per_step']:.1f}" for m, r in runs.items() if r.get("alloc_retries_per_step")]
    if retried:
        lines.append(
            "allocations retried per step after emptying the cache (each waits for the GPU): " + ", ".join(retried)
        )
    for mode, r in runs.items():
        if r.get("status") != "ok":
            lines.append(f"{mode}: {r.get('status')}: {r.get('error', '')}")
        elif r.get("note"):
            lines.append(f"{mode}: {r['note']}")
        if r.get("status") == "ok" and "offload" in r:
            st, ps, d = r.get("store", {}), r["per_step"], r["offload"]
            lines.append(
                f"{mode}: store {st.get('backend')}, O_DIRECT {st.get('direct')}, fixed buffers "
                f"{st.get('fixed_buffers')}, arena {_gib(st.get('arena_bytes', 0))} GiB, layers {st.get('layers')!r}; "
                f"per step: offloaded {ps['offloaded'] / 1e9:.2f} GB, failed writes {ps['failed_writes']:.0f}; "
                f"host peak {_gib(d['store']['host_peak'])} GiB, NVMe peak {_gib(d['store']['nvme_peak'])} GiB"
            )
    for mode, r in runs.items():
        if r.get("status") == "ok" and r.get("reserved_by_stream"):
            lines.append(
                f"{mode}: reserved GiB by stream after its steps: {_by_stream(r['reserved_by_stream'])}; "
                f"allocations retried per step: {r.get('alloc_retries_per_step', 0):.1f}"
            )
    for mode, r in runs.items():
        if r.get("plan"):
            lines += [f"{mode}: {line.strip()}" for line in r["plan"].splitlines()[:2]]
    lines += copy_ceiling(results)
    fio = results.get("fio")
    if fio is not None:
        if fio.get("status") != "ok":
            lines.append(f"fio: {fio['status']}")
        else:
            lines.append(
                f"fio on --dir ({fio['bytes'] / GiB:.2f} GiB, {fio.get('engine', 'io_uring')}, O_DIRECT, "
                f"block {fio['block'] >> 10} KiB, "
                f"depth {fio['depth']}): write {fio['write'] / 1e9:.2f} GB/s, read {fio['read'] / 1e9:.2f} GB/s"
            )
            for m in DISK_MODES:
                r = runs.get(m, {})
                if r.get("status") == "ok" and (r["nvme_write_bps"] or r["nvme_read_bps"]):
                    w, rd = r["nvme_write_bps"] / fio["write"], r["nvme_read_bps"] / fio["read"]
                    lines.append(
                        f"{m}: at fio's rates its NVMe bytes take {w + rd:.2f} of its median step (writes {w:.2f}, "
                        f"reads {rd:.2f}); 1.00: the step runs at the disk's speed"
                    )
    goal = results.get("goal", {})
    if goal:
        parts = [
            f"{m} {'MET' if g['met'] else 'NOT MET'} ({g['act_vs_keep']:.3f}, {g['time_vs_keep']:.3f})"
            for m, g in goal.items()
        ]
        lines.append("")
        lines.append(
            f"goal: activations <= {GOAL_ACT} of keep at step time <= {GOAL_TIME} of keep "
            f"(activations, allocated or reserved whichever is more, time): {'; '.join(parts)}"
        )
    return "\n".join(lines)


def render_phases(runs: dict[str, Any]) -> list[str]:
    """Where each mode's step goes: the time and the peak memory of its phases."""
    hdr = ["mode", "forward s", "backward s", "optimizer s", "host s fwd / bwd", "held at forward end GiB"]
    hdr += ["peak GiB fwd / bwd / opt", "reserved GiB fwd / bwd / opt"]
    rows = []
    for mode, r in runs.items():
        ph = r.get("phases")
        if r.get("status") != "ok" or not ph:
            continue
        names = Phases.NAMES
        rows.append(
            [
                mode,
                *(f"{ph[f'{x}_s']:.3f}" for x in names),
                " / ".join(f"{ph[f'{x}_host_s']:.3f}" if f"{x}_host_s" in ph else "-" for x in names[:2]),
                _gib(ph["held_at_forward_end_bytes"]),
                " / ".join(_gib(ph[f"{x}_peak_bytes"]) for x in names),
                " / ".join(_gib(ph[f"{x}_reserved_bytes"]) for x in names),
            ]
        )
    if not rows:
        return []
    what = (
        "Where a step goes (medians; GPU time between CUDA events, and the host's time between them: close "
        "to the GPU's, the host was the limit; memory above the start's allocation, the peak counters "
        "reset between phases):"
    )
    return [what, "", *md_table(hdr, rows), ""]


def copy_ceiling(results: dict[str, Any]) -> list[str]:
    """How much of keep's activations the GPU-host link can move during a forward (about a
    third of the step): an upper bound on what leaves at no cost through the arena."""
    copy, keep = results.get("copy"), results["modes"].get("keep", {})
    if copy is None:
        return []
    if copy.get("status") != "ok":
        return [f"copies GPU <-> pinned host: {copy.get('status')}"]
    rate = copy["bytes_per_s"]
    line = f"copies GPU <-> pinned host: {rate / 1e9:.1f} GB/s (the slower way, 64 MiB)"
    if keep.get("status") == "ok" and keep["act_bytes"] > 0:
        fwd = keep["median_step_s"] / 3
        line += (
            f"; keep's {_gib(keep['act_bytes'])} GiB of activations in {fwd:.3f} s (a third of its step, about the "
            f"forward) need {keep['act_bytes'] / fwd / 1e9:.0f} GB/s: at most "
            f"{min(1.0, rate * fwd / keep['act_bytes']):.2f} of them can leave the GPU during the forward"
        )
    return [line]


def render_fit(results: dict[str, Any]) -> str:
    fit = results["fit"]
    a = results["args"]
    ref = results.get("rok_reference_s_per_sample")
    lim = a["rok_time"]
    lines = ["== gpu_step --fit: the largest micro-batch of each mode (ROK view) ==", *header(results)]
    lines.append(
        f"batches 1, 2, 4... up to {a['fit_max_batch']} until out of memory or {a.get('fit_slow', '-')}x keep's "
        f"time per sample, then bisection; then the <= {lim}x boundary is bisected; {a['fit_steps']} "
        "step(s) per probe, timed by the last; time per sample = that step / batch"
    )
    lines.append(
        f"keep's time per sample at its largest batch: {ref * 1e3:.1f} ms" if ref else "keep fit no batch: no reference"
    )
    lines.append("")
    hdr = ["mode", "largest batch", "ms/sample", "x keep", "peak GiB", f"largest batch at <= {lim}x keep", "x keep"]
    rows = []
    for mode, r in fit.items():
        if r.get("status") != "ok":
            rows.append([mode, r.get("status", "?"), *["-"] * (len(hdr) - 2)])
            continue
        p = r.get("at_largest")
        more = " (cut)" if r.get("cut") else " (slow)" if r.get("slow") else "+" if r.get("failed") is None else ""
        largest = f"{r['largest']}{more}"
        rb = r.get("rok_batch")
        rs = r.get("rok_s_per_sample")
        rows.append(
            [
                mode,
                largest,
                f"{p['s_per_sample'] * 1e3:.1f}" if p else "-",
                f"{p['s_per_sample'] / ref:.3f}" if p and ref else "-",
                _gib(p["peak_bytes"]) if p else "-",
                "-" if rb is None else str(rb),
                f"{rs / ref:.3f}" if rs and ref else "-",
            ]
        )
    lines += md_table(hdr, rows)
    lines.append("")
    lines.append(
        "'(cut)': the search ran out of its share of --budget-s; '(slow)': past --fit-slow x keep's time per "
        "sample, larger batches were not tried; '+': no batch failed up to the cap "
        f"(--fit-max-batch; for {', '.join(HOST_MODES)}, the RAM: see above)"
    )
    for mode, r in fit.items():
        if r.get("status") != "ok":
            lines.append(f"{mode}: {r.get('status')}: {r.get('error', '')}")
        top = r.get("at_largest") or {}
        if top.get("reserved_by_stream"):
            lines.append(
                f"{mode}: reserved GiB by stream at its largest batch: {_by_stream(top['reserved_by_stream'])}; "
                f"allocations retried over its {top['steps']} steps: {top.get('alloc_retries', 0)}"
            )
        kept = [f"{p['batch']}: {p['layers_kept']}" for p in r.get("probes", []) if "layers_kept" in p]
        if kept:
            lines.append(f"{mode}: layers kept at the end of each probe (batch: layers): {', '.join(kept)}")
        spilled = [p for p in r.get("probes", []) if p.get("nvme_written_per_step")]
        if mode == "ssdtier_host" and spilled:
            lines.append(
                f"{mode}: reached NVMe from batch {min(p['batch'] for p in spilled)} on (the host arena was full)"
            )
    ok = {m: r["rok_batch"] for m, r in fit.items() if r.get("rok_batch") is not None}
    if ok:
        lines.append("")
        lines.append(
            f"ROK: largest micro-batch at <= {lim}x keep's time per sample: "
            + ", ".join(f"{m} {b}" for m, b in ok.items())
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ssdtier_info_logged():
        return run(args)


@contextlib.contextmanager
def ssdtier_info_logged() -> Any:
    """ssdtier's INFO lines (each adaptive plan, the arena's pinning, the read-ahead window) on
    stderr beside the bench's own, for this run only."""
    logger = logging.getLogger("ssdtier")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run(args: argparse.Namespace) -> int:
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_step: error: this bench needs CUDA, and torch sees no CUDA device", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    try:
        check_dir(args.dir)
        if args.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # not a fill per allocation
        results: dict[str, Any] = {
            "kind": "fit" if args.fit else "steps",
            "machine": machine_info(args),
            "args": args_dict(args),
            "params": param_count(args),
            "modes": {},
            "fit": {},
            "config_notes": {},
            "t0": t0,
        }
        log(f"{results['machine']['gpu']}, torch {torch.__version__}, {results['params'] / 1e6:,.0f}M parameters")
        if args.fit:
            run_fit(args, results, deadline)
        else:
            run_steps(args, results, deadline)
    except BenchError as e:
        print(f"gpu_step: error: {e}", file=sys.stderr)
        return 2
    results["wall_seconds"] = time.monotonic() - t0
    text = render_fit(results) if args.fit else render_steps(results)
    write_out(args, results)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text + "\n")
    print(f"(wall time {results['wall_seconds']:.0f} s)\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
