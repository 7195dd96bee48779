"""Whether GPUDirect Storage (cuFile) is usable here: a probe for ``ssdtier info`` and for
choosing ``io.backend`` (offload/cufile.py), run in a child process."""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["Gds", "GdsState", "probe"]


class GdsState(enum.Enum):
    USABLE = "usable"
    COMPAT = "compatibility mode"  # cuFile works, but through host memory (POSIX I/O)
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Gds:
    """What :func:`probe` found; ``str()`` is the line ``ssdtier info`` prints."""

    state: GdsState
    reason: str
    cufile_version: str | None = None  # "1.17"
    nvfs_version: str | None = None  # the nvidia-fs kernel driver's, when loaded
    file_error: str | None = None  # cuFile's refusal of a file in the directory probed

    def __str__(self) -> str:
        return f"{self.state.value} ({self.reason})"


# Run in a child: cuFile can hang in driver_open (seen without libcuda.so.1) and keeps
# process-wide state. Prints one JSON line of facts; the parent decides the state.
_CHILD = r"""
import ctypes, json, os, struct
try:
    from cuda.bindings import cufile
except ImportError as e:
    print(json.dumps({"missing": str(e)}))
    raise SystemExit
out = {}
try:
    try:
        out["version"] = cufile.get_version()  # 1000 * major + 10 * minor
    except Exception:
        pass
    cufile.driver_open()
    try:
        # CUfileDrvProps_t (56 bytes today) starts with nvfs.major_version, minor_version.
        props = ctypes.create_string_buffer(512)
        cufile.driver_get_properties(ctypes.addressof(props))
        out["nvfs"] = list(struct.unpack_from("II", props))
        try:
            out["force_compat"] = bool(cufile.get_parameter_bool(cufile.BoolConfigParameter.FORCE_COMPAT_MODE))
        except Exception:
            pass
        where = os.environ.get("SSDTIER_GDS_DIR")
        if where:  # a file there, as the store's: cuFile refuses some disks (no udev data)
            name = os.path.join(where, f".ssdtier-gds-{os.getpid()}")
            try:
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT, 0o600)
            except OSError as e:
                out["file_error"] = f"cannot open an O_DIRECT file there: {e}"
            else:
                try:  # named while registered: cuFile opens the file again by its path
                    descr = cufile.Descr()
                    descr.type = cufile.FileHandleType.OPAQUE_FD
                    descr.handle.fd = fd
                    descr.fs_ops = 0
                    cufile.handle_deregister(cufile.handle_register(descr.ptr))
                except Exception as e:
                    out["file_error"] = f"{type(e).__name__}: {e}"
                finally:
                    os.close(fd)
                    os.unlink(name)
    finally:
        cufile.driver_close()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def probe(timeout: float = 20.0, *, where: str | None = None, _code: str = _CHILD) -> Gds:
    """Whether GPUDirect Storage is usable, asked of cuFile in a child process that gets
    ``timeout`` seconds; with ``where`` (an existing directory), for a file there too.
    Without a CUDA device, cuFile is not touched at all."""
    import torch

    if not torch.cuda.is_available():
        return Gds(GdsState.UNAVAILABLE, "no CUDA device")
    # cuFile writes cufile.log into the working directory unless told otherwise.
    with tempfile.TemporaryDirectory(prefix="ssdtier-gds-", ignore_cleanup_errors=True) as tmp:
        log = os.path.join(tmp, "cufile.log")
        env = {**os.environ, "CUFILE_LOGFILE_PATH": log}
        if where is not None:
            env["SSDTIER_GDS_DIR"] = where
        try:
            r = subprocess.run(
                [sys.executable, "-c", _code],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",  # whatever cuFile prints, it is no reason to fail
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Gds(GdsState.UNAVAILABLE, f"cuFile did not answer in {timeout:g} s")
        except OSError as e:
            return Gds(GdsState.UNAVAILABLE, f"cannot start the cuFile probe: {e}")
        g = _parse(r.returncode, r.stdout, r.stderr)
        if g.state is not GdsState.UNAVAILABLE and g.file_error is not None:
            why = _first_error(log)
            return Gds(
                GdsState.UNAVAILABLE,
                f"cuFile refuses a file in {where}: {g.file_error}" + (f"; its log: {why}" if why else ""),
                g.cufile_version,
                g.nvfs_version,
            )
        return g


def _first_error(log: str) -> str | None:
    """The first ERROR line of cuFile's log, from its message on ("udev property not found...")."""
    try:
        with open(log, errors="replace") as f:
            for line in f:
                if " ERROR " in line:
                    return line.split(" ERROR ", 1)[1].strip()[:200]
    except OSError:
        pass
    return None


def _parse(rc: int, stdout: str, stderr: str) -> Gds:
    if rc != 0:
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        tail = stderr.strip().splitlines()
        detail = f": {tail[-1][:200]}" if tail else ""
        return Gds(GdsState.UNAVAILABLE, f"cuFile probe failed ({how}){detail}")
    lines = stdout.strip().splitlines()
    try:
        facts = json.loads(lines[-1]) if lines else None
    except ValueError:
        facts = None
    if not isinstance(facts, dict):
        return Gds(GdsState.UNAVAILABLE, f"cuFile probe gave no result: {stdout.strip()[-200:]!r}")
    if "missing" in facts:
        return Gds(
            GdsState.UNAVAILABLE,
            f"cuda-bindings with cufile not installed (needs cuda-bindings >= 12.9.1): {facts['missing']}",
        )
    version = facts.get("version")
    cufile = f"{version // 1000}.{version % 1000 // 10}" if isinstance(version, int) and version > 0 else None
    if "error" in facts:
        return Gds(GdsState.UNAVAILABLE, str(facts["error"]), cufile)
    nvfs = facts.get("nvfs")
    if not (isinstance(nvfs, list) and len(nvfs) == 2 and all(isinstance(v, int) for v in nvfs)):
        return Gds(GdsState.UNAVAILABLE, f"cuFile probe gave no nvidia-fs version: {lines[-1][:200]!r}", cufile)
    on = f", cuFile {cufile}" if cufile else ""
    # As kvikio's is_gds_available: nvidia-fs version 0.0 means the driver is not loaded.
    refused = facts.get("file_error")
    refused = str(refused) if refused is not None else None
    if nvfs == [0, 0]:
        why = f"nvidia-fs driver not loaded: I/O goes through host memory{on}"
        return Gds(GdsState.COMPAT, why, cufile, None, refused)
    loaded = f"{nvfs[0]}.{nvfs[1]}"
    if facts.get("force_compat") is True:
        return Gds(GdsState.COMPAT, f"cuFile force_compat_mode is set; nvidia-fs {loaded}{on}", cufile, loaded, refused)
    return Gds(GdsState.USABLE, f"nvidia-fs {loaded}{on}", cufile, loaded, refused)
