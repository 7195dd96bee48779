"""Which files cuFile takes in a directory, and with which settings: a descriptor opened as the
store opens its files (O_TMPFILE), the same file reopened through /proc, the same file given
a name (what ssdtier registers: cuFile opens a file again by its path), and a plain named
file; each with cuFile's defaults and with
CUFILE_FORCE_COMPAT_MODE=true. Each try runs in a process of its own and moves 1 MiB from the
GPU to the file and back.

    python benches/cufile_probe.py DIR [--json OUT]

(``--device cpu --module fake_cufile`` runs it against the tests' stand-in.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

KINDS = ("tmpfile", "reopened", "linked", "named")
NAME = "probe.bin"
ENVS = {"defaults": {}, "force_compat": {"CUFILE_FORCE_COMPAT_MODE": "true"}}
SIZE = 1 << 20


def _open(kind: str, d: str) -> tuple[int, list[int]]:
    flags = os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC
    if kind == "named":
        fd = os.open(os.path.join(d, NAME), flags | os.O_CREAT, 0o600)
        return fd, [fd]
    tmp = os.open(d, flags | os.O_TMPFILE, 0o600)
    if kind == "tmpfile":
        return tmp, [tmp]
    if kind == "linked":
        from ssdtier.offload.cufile import _link_open_file

        _link_open_file(f"/proc/self/fd/{tmp}", os.path.join(d, NAME))
        fd = os.open(os.path.join(d, NAME), flags)
        return fd, [fd, tmp]
    fd = os.open(f"/proc/self/fd/{tmp}", flags)
    return fd, [fd, tmp]


def child(kind: str, d: str, device: str, module: str) -> dict:
    import fcntl
    import importlib

    import torch

    cufile = importlib.import_module(module)
    out: dict = {"kind": kind}
    torch.zeros(1, device=device)  # a context first, as in training
    fd, fds = _open(kind, d)
    out["flags"] = oct(fcntl.fcntl(fd, fcntl.F_GETFL))
    os.posix_fallocate(fd, 0, SIZE)
    step = "driver_open"
    try:
        cufile.driver_open()
        step = "handle_register"
        descr = cufile.Descr()
        descr.type = cufile.FileHandleType.OPAQUE_FD
        descr.handle.fd = fd
        descr.fs_ops = 0
        h = cufile.handle_register(descr.ptr)
        src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        if device == "cuda":
            torch.cuda.synchronize()
        step = "write"
        cufile.write(h, src.data_ptr(), SIZE, 0, 0)
        step = "read"
        cufile.read(h, dst.data_ptr(), SIZE, 0, 0)
        out["intact"] = bool(torch.equal(src, dst))
        cufile.handle_deregister(h)
        cufile.driver_close()
        out["ok"] = out["intact"]
    except Exception as e:
        out.update(ok=False, step=step, error=f"{type(e).__name__}: {e}")
    for f in fds:
        os.close(f)
    if kind in ("named", "linked"):
        os.unlink(os.path.join(d, NAME))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--module", default="cuda.bindings.cufile")
    p.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.child:
        print(json.dumps(child(a.child, a.dir, a.device, a.module)))
        return 0
    rows = []
    for env_name, extra in ENVS.items():
        env = dict(os.environ, CUFILE_LOGFILE_PATH=os.path.join(a.dir, f"cufile-{env_name}.log"), **extra)
        for kind in KINDS:
            r = subprocess.run(
                [sys.executable, __file__, a.dir, "--child", kind, "--device", a.device, "--module", a.module],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            lines = r.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if r.returncode == 0 and lines else {"kind": kind, "ok": False}
            if r.returncode != 0:
                row["error"] = f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
            row["env"] = env_name
            rows.append(row)
            print(json.dumps(row), flush=True)
        log = os.path.join(a.dir, f"cufile-{env_name}.log")
        if os.path.exists(log):
            with open(log) as f:
                tail = f.read().splitlines()[-6:]
            print(f"{env_name} cufile.log:", *tail, sep="\n  ")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
