"""ssdtier under torch.compile: peak activation memory and step time of the GPT, eager, compiled
whole, and compiled block by block before attaching, each with and without ssdtier, side by
side (issue: compile frees nothing, or costs memory).

    python benches/compile_peak.py --dir DIR [--device cuda] [--backend inductor] [--json OUT]

The peak is torch.cuda.max_memory_allocated's delta over a measured step on CUDA, VmHWM's on
the CPU (as ``ssdtier bench``). ssdtier's rows say if it warned that the compiled graph held
the blocks' tensors."""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import ssdtier
from ssdtier.bench.memory import CpuPeak, CudaPeak
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch

HOW = ("eager", "whole", "blocks")


def measure(a: argparse.Namespace, how: str, with_ssdtier: bool) -> dict:
    torch._dynamo.reset()
    device = torch.device(a.device)
    cfg = GPTConfig(
        vocab_size=a.vocab, seq_len=a.seq, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads, dropout=0.0
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg)
    if how == "blocks":
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b, backend=a.backend)
    off = None
    if with_ssdtier:
        store = {
            "policy": {"mode": "all", "keep_last_layers": 0, "min_tensor_bytes": "64KiB"},
            "host": {"capacity": a.arena},
            "nvme": [{"path": a.dir, "capacity": "16GiB"}],
        }
        off = ssdtier.attach(model, store)
    run = torch.compile(model, backend=a.backend) if how == "whole" else model
    batch = make_batch(cfg, a.batch, torch.Generator().manual_seed(1), device=device)
    cuda = device.type == "cuda"

    def step() -> float:
        t0 = time.perf_counter()
        batch_loss(run, batch).backward()
        model.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(a.warmup):
                step()
            probe = CudaPeak(device) if cuda else CpuPeak()
            probe.start()
            times = [step() for _ in range(a.steps)]
            peak, base = probe.stop()
        finally:
            stats = off.stats() if off is not None else None
            if off is not None:
                off.detach()
    row = {
        "how": how,
        "ssdtier": with_ssdtier,
        "peak_bytes": peak - base,
        "step_s": statistics.median(times),
        "warned_traced": any("traced ssdtier's block hooks" in str(w.message) for w in caught),
    }
    if stats is not None:
        row.update(offloaded=stats.bytes_offloaded, kept=stats.bytes_kept, peak_resident=stats.peak_resident_bytes)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="NVMe directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend (inductor on a GPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--arena", default="256MiB")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    rows = []
    for how in HOW:
        for with_ssdtier in (False, True):
            rows.append(measure(a, how, with_ssdtier))
            print(json.dumps(rows[-1]), flush=True)
    keep = rows[0]["peak_bytes"] or 1
    t0 = rows[0]["step_s"]
    print(f"{'setting':<18} {'peak MiB':>9} {'x eager keep':>12} {'step s':>8} {'x':>6}  warned")
    for r in rows:
        name = f"{r['how']}{' + ssdtier' if r['ssdtier'] else ''}"
        print(
            f"{name:<18} {r['peak_bytes'] / 2**20:9.1f} {r['peak_bytes'] / keep:12.2f} {r['step_s']:8.3f} "
            f"{r['step_s'] / t0:6.2f}  {'yes' if r['warned_traced'] else '-'}"
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
