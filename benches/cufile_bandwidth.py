#!/usr/bin/env python3
"""GPUDirect Storage (cuFile) bandwidth next to ssdtier's io_uring path and fio, on one disk.

Every repeat runs the three, in this order, so that they see the same disk conditions
(the median of the repeats is reported):

1. fio: ``--ioengine=io_uring --direct=1``, blocks of ``--block``, ``--fio-depth`` in flight,
   a write job then a read job of ``--size`` bytes (``ssdtier.bench.disk.run_fio``).
2. ssdtier: ``TieredStore`` with a small pinned arena; write = ``put`` of ``--size/--block``
   GPU tensors + ``flush`` + ``evict`` (every byte on NVMe when the clock stops), read = ``get``
   of each back to the GPU, ``--prefetch-ahead`` read-aheads in flight, then a synchronize.
   The store's own I/O settings are its defaults (1 MiB blocks, queue depth 64).
3. cuFile, in a child process with a timeout (``driver_open`` can hang): a GPU buffer of
   ``--block`` bytes written with ``cuFileWrite`` block by block into a preallocated
   O_DIRECT file, then read back with ``cuFileRead``: one call at a time, as the API is
   synchronous. ``ssdtier.gds.probe()`` says beforehand whether cuFile can reach the disk
   directly (GDS) or only through host memory (compatibility mode).
4. transport: ssdtier's cuFile transport (``io.backend = "cufile"``) in this process: every
   block of a ``--size`` GPU buffer written as one entry, all queued at once to its workers
   (``io.threads``, 4), then read back into a second buffer the same way. Skipped where the
   probe finds cuFile unavailable.

Three sample blocks are checked after each read pass. GB/s are 10^9 bytes per second. Files
live in a temporary directory under ``--dir``, removed at the end (also on error).

Example::

    python benches/cufile_bandwidth.py --dir /mnt/nvme/bench --json /tmp/cufile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ssdtier.paths import is_tmpfs
from ssdtier.sizes import format_size, parse_size

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "target" / "bench-cufile"
PARTS = ("fio", "ssdtier", "cufile", "transport")
ALIGN = 4096  # O_DIRECT needs block-aligned sizes and offsets
DEVICE = "cuda"  # the tests run the ssdtier and cuFile parts on "cpu"
CUFILE_MODULE = "cuda.bindings.cufile"  # the tests give a stand-in
MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else float("inf")


def sample_blocks(count: int) -> list[int]:
    """The blocks checked after a read pass: first, middle, last."""
    return sorted({0, count // 2, count - 1})


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="cufile_bandwidth.py",
        description="cuFile (GPUDirect Storage) vs ssdtier's io_uring path vs fio: write and read GB/s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="directory on the disk to measure (not tmpfs)")
    ap.add_argument("--size", default="4GiB", help="bytes written and read by each part, each repeat")
    ap.add_argument("--block", default="16MiB", help="bytes per tensor, per cuFile call and per fio I/O")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is reported")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="limit for each cuFile child process")
    ap.add_argument("--fio-depth", type=int, default=4, help="fio's iodepth (4 x 16MiB = the store's 64 x 1MiB)")
    ap.add_argument("--prefetch-ahead", type=int, default=2, help="ssdtier read-aheads in flight")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts to run, comma separated")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    try:
        args.size = parse_size(args.size, key="--size", source="command line")
        args.block = parse_size(args.block, key="--block", source="command line")
    except ValueError as e:  # ConfigError names the option and the value
        ap.error(str(e))
    if args.block <= 0 or args.block % ALIGN:
        ap.error(f"--block must be a positive multiple of {ALIGN} bytes (O_DIRECT), got {args.block}")
    if args.size < args.block:
        ap.error(f"--size ({args.size}) must be at least --block ({args.block})")
    args.count = args.size // args.block
    args.size = args.count * args.block  # whole blocks only
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not args.timeout_s > 0:
        ap.error("--timeout-s must be positive")
    if args.fio_depth < 1 or args.prefetch_ahead < 0:
        ap.error("--fio-depth must be at least 1 and --prefetch-ahead at least 0")
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        ap.error(f"--parts takes some of {', '.join(PARTS)}, got {args.parts!r}")
    args.parts = tuple(p for p in PARTS if p in parts)
    args.dir = args.dir.expanduser().absolute()
    return args


# ---------------------------------------------------------------- fio


def run_fio_part(fio: str, workdir: Path, size: int, block: int, depth: int) -> dict[str, Any]:
    """fio's write then read of ``size`` bytes; bytes per second each way."""
    from ssdtier.bench.disk import run_fio

    path = str(workdir / "fio.dat")
    try:
        w = run_fio(fio, path, "write", size, block, depth)
        r = run_fio(fio, path, "read", size, block, depth)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {"write": w["bw_bytes"], "read": r["bw_bytes"], "cmd": " ".join(w["cmd"])}


# ---------------------------------------------------------------- ssdtier


def _sync() -> None:
    """Wait for the work queued on the GPU (the tests run these parts on the CPU)."""
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def run_store_part(workdir: Path, size: int, block: int, ahead: int) -> dict[str, Any]:
    """A fresh TieredStore: GPU tensors to NVMe through the pinned arena and back."""
    import torch

    from ssdtier import TieredStore

    count = size // block
    src = torch.arange(block, device=DEVICE, dtype=torch.int32).remainder_(251).to(torch.uint8)
    stamp = src[:8].view(torch.int64)  # each block's index, so that blocks differ
    sdir = workdir / "store"
    cfg = {
        # Room for the block being read and the read-aheads: the arena only stages.
        "host": {"capacity": (ahead + 2) * block},
        "nvme": [{"path": str(sdir), "capacity": size + 256 * MiB}],
    }
    store = TieredStore(cfg)
    pinned = None
    try:
        if DEVICE == "cuda":
            from ssdtier.offload.cuda import Pinned

            pinned = Pinned(store.arena, torch.device(DEVICE))  # page-locked, as the offloader has it
        facts: dict[str, Any] = {
            "backend": store.backend,
            "direct": store.direct,
            "fixed_buffers": store.fixed_buffers,
            "pinned": pinned is not None and pinned.arena is not None,
            "io_block": store.config.io.block_size,
            "io_depth": store.config.io.queue_depth,
        }
        _sync()
        before = store.stats()
        keys = []
        t0 = time.perf_counter()
        for i in range(count):
            stamp.fill_(i)
            keys.append(store.put(src))  # a blocking copy into the arena
        store.flush()
        for k in keys:
            store.evict(k)
        facts["write_s"] = time.perf_counter() - t0
        facts["nvme_bytes_written"] = store.stats().nvme_bytes_written - before.nvme_bytes_written
        stuck = [k for k in keys if store.location(k) != (False, True)]
        if stuck:
            raise RuntimeError(f"{len(stuck)} of {count} entries are not only on NVMe after flush() and evict()")

        checks = sample_blocks(count)
        bad = []
        t0 = time.perf_counter()
        for j in range(min(ahead, count)):
            store.prefetch(keys[j])
        for i, k in enumerate(keys):
            if ahead and i + ahead < count:
                store.prefetch(keys[i + ahead])
            out = store.get(k)
            if i in checks:
                stamp.fill_(i)
                if not torch.equal(out, src):
                    bad.append(i)
            del out
        _sync()
        facts["read_s"] = time.perf_counter() - t0
        facts["write"] = per_s(size, facts["write_s"])
        facts["read"] = per_s(size, facts["read_s"])
        facts["intact"] = not bad
        facts["bad_blocks"] = bad
        return facts
    finally:
        if pinned is not None:
            pinned.close()  # before the arena is unmapped
        store.close()
        shutil.rmtree(sdir, ignore_errors=True)


# ---------------------------------------------------------------- ssdtier's cuFile transport


def run_transport_part(workdir: Path, size: int, block: int) -> dict[str, Any]:
    """Entries of ``block`` bytes from GPU memory to NVMe and back through ``CuFile``, all in flight."""
    import importlib

    import torch

    from ssdtier.offload import cufile
    from ssdtier.store import ByteStore

    count = size // block
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=DEVICE, generator=gen)
    dst = torch.zeros_like(src)
    sdir = workdir / "transport"
    store = ByteStore({"host": {"capacity": 16 * MiB}, "nvme": [{"path": str(sdir), "capacity": size + 256 * MiB}]})
    io = None
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else None
        io = cufile.CuFile(store.native, store.config.io.threads, device, importlib.import_module(cufile.MODULE))
        facts: dict[str, Any] = {"threads": store.config.io.threads, "direct": store.direct}
        keys = [store.native.reserve_unslotted(block) for _ in range(count)]
        _sync()
        t0 = time.perf_counter()
        for t in [io.write(k, src.data_ptr() + i * block, block, None) for i, k in enumerate(keys)]:
            t.wait()
        facts["write_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for t in [io.read(k, dst.data_ptr() + i * block, block, None) for i, k in enumerate(keys)]:
            t.wait()
        facts["read_s"] = time.perf_counter() - t0
        bad = [
            i
            for i in sample_blocks(count)
            if not torch.equal(src[i * block : (i + 1) * block], dst[i * block : (i + 1) * block])
        ]
        facts.update(
            write=per_s(size, facts["write_s"]), read=per_s(size, facts["read_s"]), intact=not bad, bad_blocks=bad
        )
        return facts
    finally:
        if io is not None:
            io.close()
        store.close()
        shutil.rmtree(sdir, ignore_errors=True)


# ---------------------------------------------------------------- cuFile

# Runs in a child: cuFile can hang in driver_open and keeps process-wide state. argv[1] is
# JSON {path, block, count, checks, device, module}; prints one JSON line of timings and facts.
CUFILE_CHILD = r"""
import importlib, json, os, sys, time
p = json.loads(sys.argv[1])
path, block, count, checks = p["path"], p["block"], p["count"], set(p["checks"])
dev = p["device"]  # "cpu" only in the tests, with a stand-in module for cufile
out = {"ok": False}
try:
    import torch
    cufile = importlib.import_module(p["module"])
    out["cuda_bindings"] = getattr(sys.modules.get("cuda.bindings"), "__version__", None)
except ImportError as e:
    out["error"] = f"cannot import {p['module']}: {e}"
    print(json.dumps(out))
    raise SystemExit
# Two fresh allocations first, each at the start of its own cudaMalloc segment.
wbuf = torch.empty(block, dtype=torch.uint8, device=dev)
rbuf = torch.empty(block, dtype=torch.uint8, device=dev)
wbuf.copy_(torch.arange(block, dtype=torch.int32, device=dev).remainder_(251))
stamp = wbuf[:8].view(torch.int64)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
sync()
torch.cuda.empty_cache()
try:
    out["cufile_version"] = cufile.get_version()
except Exception:
    pass
fd = handle = None
registered = []
opened = False


def moved(n, what, off):
    # Older bindings return None; newer ones the byte count (negative on error).
    if n is not None and n != block:
        raise RuntimeError(f"cuFile {what} at offset {off} returned {n}, not {block}")


try:
    t = time.perf_counter()
    cufile.driver_open()
    opened = True
    out["driver_open_s"] = time.perf_counter() - t
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    # As the store and fio do: writes inside allocated space, not extending the file.
    os.posix_fallocate(fd, 0, block * count)
    descr = cufile.Descr()
    descr.type = cufile.FileHandleType.OPAQUE_FD
    descr.handle.fd = fd
    descr.fs_ops = 0
    handle = cufile.handle_register(descr.ptr)
    for buf in (wbuf, rbuf):
        try:
            cufile.buf_register(buf.data_ptr(), block, 0)
            registered.append(buf.data_ptr())
        except Exception as e:  # unregistered buffers still work, through cuFile's bounce buffers
            out["buf_register_error"] = f"{type(e).__name__}: {e}"
    out["buf_registered"] = len(registered) == 2
    wptr, rptr = wbuf.data_ptr(), rbuf.data_ptr()
    t0 = time.perf_counter()
    for i in range(count):
        stamp.fill_(i)
        sync()  # cuFile reads the buffer outside torch's stream
        moved(cufile.write(handle, wptr, block, i * block, 0), "write", i * block)
    out["write_s"] = time.perf_counter() - t0
    bad = []
    t0 = time.perf_counter()
    for i in range(count):
        moved(cufile.read(handle, rptr, block, i * block, 0), "read", i * block)
        if i in checks:
            stamp.fill_(i)
            if not torch.equal(rbuf, wbuf):  # synchronizes: rbuf is read before the next call
                bad.append(i)
    sync()
    out["read_s"] = time.perf_counter() - t0
    out["intact"] = not bad
    out["bad_blocks"] = bad
    out["ok"] = True
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
finally:
    for ptr in registered:
        try:
            cufile.buf_deregister(ptr)
        except Exception:
            pass
    if handle is not None:
        try:
            cufile.handle_deregister(handle)
        except Exception:
            pass
    if fd is not None:
        os.close(fd)
    try:
        os.unlink(path)
    except OSError:
        pass
    if opened:
        try:
            cufile.driver_close()
        except Exception:
            pass
print(json.dumps(out), flush=True)
"""


def _log_lines(tmp: str, limit: int = 8) -> list[str]:
    """cufile.log's lines that say something about compatibility mode or errors."""
    try:
        with open(os.path.join(tmp, "cufile.log"), errors="replace") as f:
            lines = [ln.strip() for ln in f if any(w in ln.lower() for w in ("compat", "error", "fail", "warn"))]
    except OSError:
        return []
    return lines[:limit]


def run_cufile_part(path: Path, size: int, block: int, timeout: float) -> dict[str, Any]:
    """cuFile's write and read of ``size`` bytes in a child process; its facts, with ``ok``."""
    count = size // block
    params = json.dumps(
        {
            "path": str(path),
            "block": block,
            "count": count,
            "checks": sample_blocks(count),
            "device": DEVICE,
            "module": CUFILE_MODULE,
        }
    )
    # cuFile writes cufile.log into the working directory unless told otherwise.
    with tempfile.TemporaryDirectory(prefix="ssdtier-cufile-", ignore_cleanup_errors=True) as tmp:
        env = {**os.environ, "CUFILE_LOGFILE_PATH": os.path.join(tmp, "cufile.log")}
        try:
            r = subprocess.run(
                [sys.executable, "-c", CUFILE_CHILD, params],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:  # its log may say where it stuck
            error = f"cuFile did not finish in {timeout:g} s (killed)"
            return {"ok": False, "timed_out": True, "error": error, "log": _log_lines(tmp)}
        logged = _log_lines(tmp)
    lines = r.stdout.strip().splitlines()
    try:
        facts = json.loads(lines[-1]) if lines else None
    except ValueError:
        facts = None
    if not isinstance(facts, dict):
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
        tail = (r.stderr or r.stdout).strip().splitlines()
        facts = {"ok": False, "error": f"cuFile child gave no result ({how}){': ' + tail[-1][:300] if tail else ''}"}
    facts["log"] = logged
    if facts.get("ok"):
        facts["write"] = per_s(size, facts["write_s"])
        facts["read"] = per_s(size, facts["read_s"])
    return facts


# ---------------------------------------------------------------- report


def _label(name: str, results: dict[str, Any]) -> str:
    part = results["parts"].get(name, {})
    if name == "fio":
        return f"fio (io_uring, O_DIRECT, QD {results['fio_depth']})"
    if name == "ssdtier":
        backend = next((d["backend"] for d in part.get("details", []) if "backend" in d), "io_uring")
        return f"ssdtier {backend} (GPU->pinned->NVMe)"
    if name == "transport":
        return f"ssdtier cuFile transport ({results['gds']['state']})"
    return f"cuFile (GPU<->file, {results['gds']['state']})"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_table(results: dict[str, Any]) -> str:
    """The markdown table of median GB/s and ratios to fio, with a line per skipped part."""
    parts = results["parts"]
    fio = parts.get("fio", {})
    rows = [
        "| path | write GB/s | read GB/s | write / fio | read / fio |",
        "|---|---:|---:|---:|---:|",
    ]
    notes = []
    for name in PARTS:
        part = parts.get(name)
        if part is None:
            continue
        med = {d: part.get(f"median_{d}") for d in ("write", "read")}
        ratio = {}
        for d in ("write", "read"):
            base = fio.get(f"median_{d}")
            ratio[d] = "-" if med[d] is None or not base else f"{med[d] / base:.2f}"
        label = _label(name, results)
        if part.get("status") != "ok":
            label += f" ({part.get('status')})"
            notes.append(f"- {name}: {part.get('status')}: {part.get('note', '')}")
        rows.append(f"| {label} | {_gb(med['write'])} | {_gb(med['read'])} | {ratio['write']} | {ratio['read']} |")
    return "\n".join(rows + ([""] + notes if notes else []))


def render(results: dict[str, Any]) -> str:
    """Header lines (disk, sizes, GDS state), then the table, then the per-part facts."""
    m = results.get("mount", {})
    lines = [
        f"cuFile vs ssdtier vs fio on {results['dir']} "
        f"({m.get('device', '?')}: {m.get('medium', m.get('fstype', '?'))})",
        f"{format_size(results['size'])} in {results['count']} blocks of {format_size(results['block'])}, "
        f"median of {results['repeats']} interleaved repeats, GB/s = 10^9 B/s",
        f"GDS probe: {results['gds']['state']} ({results['gds']['reason']})",
        "",
        render_table(results),
        "",
    ]
    for name in PARTS:
        part = results["parts"].get(name)
        if not part or not part.get("details"):
            continue
        each = ", ".join(f"{w / 1e9:.2f}/{r / 1e9:.2f}" for w, r in zip(part["write"], part["read"], strict=True))
        lines.append(f"{name}: write/read GB/s per repeat {each or '-'}")
        d = part["details"][-1]
        if name == "ssdtier":
            lines.append(
                f"  O_DIRECT {'on' if d.get('direct') else 'off'}, arena pinned {'yes' if d.get('pinned') else 'NO'}, "
                f"io blocks {d.get('io_block', 0) / MiB:g} MiB x depth {d.get('io_depth')}, "
                f"data intact {'yes' if part.get('intact') else 'NO'}"
            )
        elif name == "cufile":
            v = d.get("cufile_version")
            version = f"{v // 1000}.{v % 1000 // 10}" if isinstance(v, int) else "?"  # 1170 is 1.17
            lines.append(
                f"  cuda-bindings {d.get('cuda_bindings')}, cuFile {version}, "
                f"buffers registered {'yes' if d.get('buf_registered') else 'no'}, "
                f"driver_open {d.get('driver_open_s', 0):.2f} s, data intact {'yes' if part.get('intact') else 'NO'}"
            )
            for ln in d.get("log", []):
                lines.append(f"  cufile.log: {ln[:200]}")
        elif name == "transport":
            lines.append(
                f"  {d.get('threads')} workers, all blocks in flight, O_DIRECT {'on' if d.get('direct') else 'off'}, "
                f"data intact {'yes' if part.get('intact') else 'NO'}"
            )
    return "\n".join(lines).rstrip()


# ---------------------------------------------------------------- main


def _summarize(part: dict[str, Any]) -> None:
    for d in ("write", "read"):
        part[f"median_{d}"] = statistics.median(part[d]) / 1e9 if part[d] else None
    part["intact"] = all(x.get("intact", True) for x in part["details"])
    if part["details"] and not part["intact"]:
        part["status"], part["note"] = "failed", "data read back differs from what was written"


class PartFailed(RuntimeError):
    """A part that ran but failed; ``facts`` is what it reported."""

    def __init__(self, message: str, facts: dict[str, Any]) -> None:
        super().__init__(message)
        self.facts = facts


def _run_part(name: str, args: argparse.Namespace, fio: str | None, workdir: Path) -> dict[str, Any]:
    if name == "fio":
        assert fio is not None
        return run_fio_part(fio, workdir, args.size, args.block, args.fio_depth)
    if name == "ssdtier":
        return run_store_part(workdir, args.size, args.block, args.prefetch_ahead)
    if name == "transport":
        return run_transport_part(workdir, args.size, args.block)
    got = run_cufile_part(workdir / "cufile.dat", args.size, args.block, args.timeout_s)
    if not got["ok"]:
        raise PartFailed(got["error"], got)
    return got


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        log("cufile_bandwidth: needs CUDA: torch sees no CUDA device (cuFile was not touched)")
        return 2
    if is_tmpfs(args.dir):
        log(f"cufile_bandwidth: {args.dir} is on tmpfs (RAM, not disk): give --dir a directory on the NVMe")
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < args.size + 512 * MiB:
        log(f"cufile_bandwidth: {args.dir} has {free / 2**30:.1f} GiB free, needs {args.size / 2**30 + 0.5:.1f} GiB")
        return 2

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import mount_of

    from ssdtier.gds import probe

    started = time.perf_counter()
    log("cuFile probe (ssdtier.gds.probe) ...")
    gds = probe(timeout=min(args.timeout_s, 60.0))
    log(f"  GDS: {gds}")
    fio = shutil.which("fio")
    results: dict[str, Any] = {
        "dir": str(args.dir),
        "mount": mount_of(args.dir),
        "size": args.size,
        "block": args.block,
        "count": args.count,
        "repeats": args.repeats,
        "fio_depth": args.fio_depth,
        "prefetch_ahead": args.prefetch_ahead,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gds": {"state": gds.state.value, "reason": gds.reason, "cufile": gds.cufile_version, "nvfs": gds.nvfs_version},
        "parts": {
            name: {"status": "ok", "note": "", "write": [], "read": [], "details": []}
            for name in PARTS
            if name in args.parts
        },
    }
    parts = results["parts"]
    if "fio" in parts and not fio:
        parts["fio"].update(status="skipped", note="fio is not installed")
    if "transport" in parts and gds.state.value == "unavailable":
        parts["transport"].update(status="skipped", note=f"cuFile is {gds}")
    workdir = Path(tempfile.mkdtemp(prefix=".ssdtier-cufile-bench-", dir=args.dir))
    try:
        for k in range(1, args.repeats + 1):
            for name, part in parts.items():
                if part["status"] != "ok":
                    continue
                log(f"[{k}/{args.repeats}] {name} ...")
                try:
                    got = _run_part(name, args, fio, workdir)
                except Exception as e:  # reported in the table; a failed part is not run again
                    part.update(status="failed", note=f"{type(e).__name__}: {e}")
                    part["details"].append(getattr(e, "facts", {}))
                    log(f"  {name} failed: {e}")
                    continue
                part["write"].append(got["write"])
                part["read"].append(got["read"])
                part["details"].append(got)
                log(f"  {name}: write {got['write'] / 1e9:.2f} GB/s, read {got['read'] / 1e9:.2f} GB/s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for part in parts.values():
        _summarize(part)
    results["wall_s"] = time.perf_counter() - started
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        log(f"results written to {args.json}")
    return 0 if all(p["status"] in ("ok", "skipped") for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
