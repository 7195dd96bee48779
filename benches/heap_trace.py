#!/usr/bin/env python3
"""Where a CPU training step's RSS goes under glibc: heap size, heap in use and RSS at
every block boundary, forward and backward.

The model, batch and ssdtier settings are those of ``train_step.py`` (its model and
ssdtier options are accepted). After ``--warmup`` steps the script calls
``malloc_trim(0)`` (freed heap pages are given back), then traces ``--steps`` more:
``mallinfo2()`` gives the heap's size (``arena``) and the bytes in use
(``uordblks``), ``/proc/self/status`` the RSS. Under glibc the RSS of a step can
climb far above what is in use: freed blocks are handed out again from anywhere in
a heap as big as it ever was, and each page touched again is resident again.

Example::

    .venv/bin/python benches/heap_trace.py --mode ssdtier
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import _keep_last, gpt_config, parse_args, ssdtier_config  # noqa: E402

from ssdtier.bench.memory import malloc_trim, proc_status  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "ssdtier"
    if "--mode" in argv:
        i = argv.index("--mode")
        mode = argv[i + 1]
        del argv[i : i + 2]
    if mode not in ("keep", "ssdtier"):
        print(f"heap_trace: --mode must be keep or ssdtier, not {mode!r}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        print("heap_trace: this C library has no mallinfo2 (glibc >= 2.33 needed)", file=sys.stderr)
        return 2
    mallinfo2.restype = _MallInfo2

    import torch

    import ssdtier
    from ssdtier.bench.models import batch_loss, build_model, make_batch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = gpt_config(args, checkpoint=False)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(cfg, args.batch, torch.Generator().manual_seed(args.seed + 1))
    off = None
    if mode == "ssdtier":
        args.dir.mkdir(parents=True, exist_ok=True)
        scfg = ssdtier_config(args, args.arena, args.min_tensor_bytes, _keep_last(args.keep_last_layers))
        off = ssdtier.attach(model, scfg)
    rows: list[tuple[str, int, int, int]] = []

    def note(tag: str) -> None:
        m = mallinfo2()
        rows.append((tag, m.arena, m.uordblks, proc_status("VmRSS")["VmRSS"]))

    blocks: Any = model.blocks  # type: ignore[attr-defined]
    for i, b in enumerate(blocks):
        b.register_forward_hook(lambda m, a, o, i=i: note(f"fwd {i}"))
        b.register_full_backward_pre_hook(lambda m, g, i=i: note(f"bwd {i}"))

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss = batch_loss(model, batch)
        note("fwd end")
        loss.backward()
        note("bwd end")
        opt.step()

    for _ in range(args.warmup):
        step()
    malloc_trim()
    rows.clear()
    note("start")
    for _ in range(args.steps):
        step()
    if off is not None:
        off.detach()
    mb = 1 << 20
    print(f"heap_trace: mode {mode}, {args.warmup} warmup steps, malloc_trim(0), then {args.steps} steps (MiB)")
    print(f"{'point':<10} {'heap':>7} {'in use':>7} {'RSS':>7}")
    for tag, heap, used, rss in rows:
        print(f"{tag:<10} {heap // mb:>7} {used // mb:>7} {rss // mb:>7}")
    rss_max, used_max, heap_max = (max(r[k] for r in rows) // mb for k in (3, 2, 1))
    print(f"RSS {rows[0][3] // mb} -> max {rss_max} MiB; heap: at most {used_max} MiB in use, {heap_max} MiB big")
    return 0


if __name__ == "__main__":
    sys.exit(main())
