"""Command line: ``ssdtier info`` and ``ssdtier demo`` (also ``python -m ssdtier``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from . import __version__
from .config import default_nvme_dir, format_size, is_tmpfs, parse_size


def _store(args: argparse.Namespace, host: int):
    from .store import TieredStore

    cfg: dict = {"host": {"capacity": host}}
    if args.dir:
        cfg["nvme"] = [{"path": args.dir, "capacity": "1TiB"}]
    return TieredStore(cfg)


def cmd_info(args: argparse.Namespace) -> int:
    """Tell what this machine supports for the directory."""
    path = os.path.abspath(args.dir or default_nvme_dir())
    print(f"ssdtier {__version__}")
    print(f"directory       {path}{'  (tmpfs: no O_DIRECT)' if is_tmpfs(path) else ''}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            store = _store(argparse.Namespace(dir=path), 16 << 20)
        except Exception as e:  # report, don't crash: this command is for diagnosis
            print(f"store           cannot open: {e}")
            return 1
    with store:
        print(f"backend         {store.backend}")
        print(f"O_DIRECT        {'yes' if store.direct else 'no (buffered I/O)'}")
        print(f"fixed buffers   {'yes' if store.fixed_buffers else 'no'}")
    for w in caught:
        print(f"note            {w.message}")
    import torch

    cuda = torch.cuda.is_available()
    print(f"torch           {torch.__version__}")
    print(f"CUDA            {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no'}")
    try:
        import cuda.bindings  # noqa: F401

        print("cuda-python     yes")
    except ImportError:
        print("cuda-python     no")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Round-trip tensors through the store with a small arena, so they go to NVMe."""
    import torch

    total = parse_size(args.size, key="--size")
    tensor = parse_size(args.tensor, key="--tensor")
    n = max(1, total // tensor)
    src = torch.arange(tensor // 4, dtype=torch.int32)
    with _store(args, parse_size(args.arena, key="--arena")) as store:
        print(
            f"ssdtier demo: {n} tensors of {format_size(tensor)} through a {args.arena} arena "
            f"({store.backend}, O_DIRECT {'on' if store.direct else 'off'})",
            file=sys.stderr,
        )
        t0 = time.perf_counter()
        keys = []
        for i in range(n):
            keys.append(store.put(src))
            if (i + 1) % max(1, n // 4) == 0:
                print(f"  put {i + 1}/{n}", file=sys.stderr)
        for k in keys:
            store.evict(k)
        t_write = time.perf_counter() - t0
        written = store.stats().nvme_bytes_written
        t0 = time.perf_counter()
        ok = True
        for i, k in enumerate(keys):
            if i + 2 < n:
                store.prefetch(keys[i + 2])
            out = store.get(k)
            ok = ok and torch.equal(out, src)
        t_read = time.perf_counter() - t0
        read = store.stats().nvme_bytes_read
        print(f"wrote {format_size(written)} to NVMe at {written / t_write / 1e6:8.1f} MB/s")
        print(f"read  {format_size(read)} back  at {read / t_read / 1e6:8.1f} MB/s")
        print(f"data intact: {'yes' if ok else 'NO'}")
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ssdtier", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ssdtier {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="what this machine supports (io_uring, O_DIRECT, CUDA)")
    p.add_argument("dir", nargs="?", help="directory to check (default: SSDTIER_DIR or ~/.cache/ssdtier)")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("demo", help="round-trip tensors through NVMe and print the bandwidth")
    p.add_argument("--dir", help="NVMe directory (default: SSDTIER_DIR or ~/.cache/ssdtier)")
    p.add_argument("--size", default="1GiB", help="bytes in all (default 1GiB)")
    p.add_argument("--tensor", default="32MiB", help="bytes per tensor (default 32MiB)")
    p.add_argument("--arena", default="128MiB", help="host arena (default 128MiB)")
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        from .errors import SsdtierError

        if isinstance(e, (SsdtierError, OSError)):
            print(f"ssdtier: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
