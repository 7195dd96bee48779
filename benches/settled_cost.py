#!/usr/bin/env python3
"""What adaptive mode costs a step when its plan moves nothing (docs/planner.md#a-settled-plan).

A plain GPT and its twin with ssdtier attached (adaptive mode; by default a device budget
above all it saves, so the plan keeps every block) train in one process, one step each in
turn, the order swapped every step, so the machine's drift hits both alike. Medians of the
steps after ``--warmup``, and their ratio. The default model is small and deep (24 blocks
of width 32): its step is bound by the host, as an eager model's is wherever the GPU runs
ahead of it.

    python benches/settled_cost.py [--steps 400] [--json out.json]
    python benches/settled_cost.py --layers 8 --d-model 256 --seq 256 --batch 8 --vocab 1024 \
        --heads 8 --compile 0.2 --steps 30 --warmup 8     # ssdtier on compiled blocks
    python benches/settled_cost.py --budget 350KB --throttle 1MB   # a plan that recomputes
    python benches/settled_cost.py --seq 64 --padded 16   # dynamic padding: lengths 16..64

With ``--padded`` each step's length is drawn (seeded) for both models alike, and the
figures are means over the counted steps, not medians (the lengths differ step to step).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--padded", type=int, metavar="MIN", help="dynamic padding: each step's length from MIN to --seq")
    p.add_argument("--steps", type=int, default=400, help="steps of each model")
    p.add_argument("--warmup", type=int, default=20, help="steps of each not counted")
    p.add_argument(
        "--compile",
        type=float,
        metavar="BUDGET",
        help="both models' blocks compiled (Inductor) under torch's activation memory budget BUDGET",
    )
    p.add_argument("--budget", default="1GiB", help="ssdtier's device budget (default 1GiB: every block kept)")
    p.add_argument("--throttle", help="ssdtier's io.throttle (a slow disk: the plan recomputes, not offloads)")
    p.add_argument("--dir", help="NVMe directory (default: a temporary one)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must be more than --warmup")
    if args.padded is not None and not 1 <= args.padded <= args.seq:
        p.error("--padded must be from 1 to --seq")

    import torch

    import ssdtier
    from ssdtier.bench.models import GPT, GPTConfig, gpt_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        dropout=0.0,
    )
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    twin = GPT(cfg)
    rng = random.Random(0)
    lengths = [rng.randint(args.padded, args.seq) if args.padded else args.seq for _ in range(args.steps)]
    batches = {n: gpt_batch(dataclasses.replace(cfg, seq_len=n), args.batch) for n in set(lengths)}
    budget = contextlib.nullcontext()
    if args.compile is not None:
        import torch._functorch.config as functorch_config

        budget = functorch_config.patch(activation_memory_budget=args.compile)
        for model in (plain, twin):
            for i, b in enumerate(model.blocks):
                model.blocks[i] = torch.compile(b)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        conf = {
            "policy": {"mode": "adaptive", "device_budget": args.budget, "min_tensor_bytes": 0},
            "host": {"capacity": "64MiB"},
            "nvme": [{"path": d}],
        }
        if args.throttle:
            conf["io"] = {"throttle": args.throttle}
        times: dict[str, list[float]] = {"keep": [], "ssdtier": []}
        with budget, ssdtier.attach(twin, conf) as off:
            for i, n in enumerate(lengths):
                idx, targets = batches[n]
                pair = (("keep", plain), ("ssdtier", twin))
                for name, model in pair if i % 2 else reversed(pair):
                    t0 = time.perf_counter()
                    _, loss = model(idx, targets)
                    loss.backward()
                    times[name].append(time.perf_counter() - t0)
            st = off.stats()
            plan = off.plan()
    average = statistics.mean if args.padded else statistics.median
    keep, ssd = (average(times[k][args.warmup :]) for k in ("keep", "ssdtier"))
    out = {
        "model": {"layers": args.layers, "d_model": args.d_model, "seq": args.seq, "batch": args.batch},
        "padded": args.padded,
        "compile": args.compile,
        "budget": args.budget,
        "throttle": args.throttle,
        "steps": args.steps,
        "warmup": args.warmup,
        "keep_ms": keep * 1e3,
        "ssdtier_ms": ssd * 1e3,
        "ratio": ssd / keep,
        "plan": plan.summary() if plan is not None else None,
        "packs": st.packs,
        "forwards_unhooked": getattr(st, "forwards_unhooked", None),  # None: a version without them
        "torch": torch.__version__,
    }
    how = "" if args.compile is None else f", blocks compiled under memory budget {args.compile}"
    seq = f"seq {args.padded}-{args.seq} (padded per step)" if args.padded else f"seq {args.seq}"
    print(f"GPT of {args.layers} blocks, width {args.d_model}, {seq}, batch {args.batch}, 1 thread{how}")
    print(f"{'':10}{'ms/step':>9}{'x keep':>8}  ({'mean' if args.padded else 'median'} of the counted steps)")
    print(f"{'keep':10}{keep * 1e3:9.2f}{1:8.2f}")
    print(f"{'ssdtier':10}{ssd * 1e3:9.2f}{ssd / keep:8.2f}")
    print(f"plan: {out['plan']}; packs {st.packs}; forwards without hooks: {out['forwards_unhooked']} of {args.steps}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
