"""Step by step, what adaptive mode does on a GPU: each step's time, peak and plan, its log,
and a profile of one settled step against checkpointing (research extra, not a bench).

    python benches/plan_trace.py --out DIR [--steps 10] [--runs keep,0.8,0.25,auto:16,keep:13]

A run is ``keep``, ``checkpoint``, a share of keep's peak (a fixed device budget) or
``auto`` (device_budget = "auto"), each at ``--batch`` or ``:B``. Each step records the
memory reserved per stream. Writes DIR/trace.json,
DIR/<run>.log (ssdtier's INFO log), DIR/profile_<run>.txt (--profile: torch.profiler's
tables of the last step) and DIR/profile_<run>_python.txt (cProfile of one step more)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
import traceback
from pathlib import Path

import torch

import ssdtier
from ssdtier.bench.models import GPTConfig, batch_loss, build_model, make_batch


def gpt(batch: int, every: int = 0) -> tuple[torch.nn.Module, object]:
    cfg = GPTConfig(
        vocab_size=32000,
        seq_len=2048,
        d_model=2048,
        n_layers=24,
        n_heads=16,
        dropout=0.0,
        sdpa=True,
        checkpoint_every=every,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg)
    data = make_batch(cfg, batch, torch.Generator().manual_seed(1), device="cuda")
    return model, lambda: batch_loss(model, data)


def steps(model, loss_of, n: int, off=None, profile: Path | None = None) -> list[dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    out = []
    for i in range(n):
        prof = None
        if profile is not None and i == n - 1:
            try:
                prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                prof.__enter__()
            except Exception:  # noqa: BLE001 - a profiler that fails costs its tables, not the run's rows
                profile.write_text(traceback.format_exc())
                prof = None
        torch.cuda.synchronize()
        before = _waits(off)
        base = torch.cuda.memory_allocated()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        forward_s = _step(loss_of, opt)
        row = {
            "step": i,
            "s": time.perf_counter() - t0,
            "forward_host_s": forward_s,
            "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "reserved_by_stream_gib": _reserved_by_stream(),
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
        }
        if off is not None:  # where the host's and the GPU's time went, this step
            row.update({k: v - before[k] for k, v in _waits(off).items()})
        if off is not None and off.adaptive is not None:
            plan = off.adaptive.plan
            row["budget_gib"] = (off._budget or 0) / 2**30
            row["plan"] = None if plan is None else [d.action.value for d in plan.decisions]
            row["predicted_peak_gib"] = None if plan is None else plan.outcome.peak / 2**30
            row["guard_switched"] = off.adaptive.switched
            # "auto": what the budget left for all but activations (the plan's peak excludes it).
            made = off.adaptive.watch.auto.made if off.adaptive.watch.gpu is not None else None
            row["made_gib"] = None if made is None else made / 2**30
            row["unhooked"] = off.c.get("forwards_unhooked", 0)  # running total: forwards of a settled plan
            row["solves"], row["replan_s"] = off.adaptive.solving.count, off.adaptive.replan_s  # running totals
            # Each block's last forward and backward as timed (the step before's, read at this
            # one's plan), not scaled for offloading: where an offloaded block's cost lies.
            measured = off.adaptive.profile
            row["block_fwd_ms"] = [round(d[-1][0] * 1e3, 2) if d else None for d in measured.fwd_recent]
            row["block_bwd_ms"] = [None if b is None else round(b * 1e3, 2) for b in measured.backward_s]
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
                profile.write_text(
                    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                    + "\n\n"
                    + prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
                )
            except Exception:  # noqa: BLE001
                profile.write_text(traceback.format_exc())
        if profile is not None and i == n - 1:
            py = profile.with_name(profile.stem + "_python.txt")
            try:
                py.write_text(_python_profile(loss_of, opt))
            except Exception:  # noqa: BLE001
                py.write_text(traceback.format_exc())
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _step(loss_of, opt) -> float:
    """One training step, the GPU's part waited for; returns the forward's host seconds."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of()
    t1 = time.perf_counter()
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return t1 - t0


def _python_profile(loss_of, opt) -> str:
    """One more step under cProfile: the hooks' Python time, and any wait for the GPU
    inside the forward (a synchronize would show as the GPU's time in one call)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    _step(loss_of, opt)
    pr.disable()
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    return out.getvalue()


def _reserved_by_stream() -> dict[str, float]:
    """GiB the caching allocator holds per stream's pool: "compute" (the current stream's),
    the others by handle (ssdtier's prefetch stream's, if it read ahead into its own)."""
    compute = torch.cuda.current_stream().cuda_stream
    out: dict[str, float] = {}
    for seg in torch.cuda.memory_snapshot():
        name = "compute" if seg["stream"] == compute else hex(seg["stream"])
        out[name] = out.get(name, 0.0) + seg["total_size"] / 2**30
    return out


def _waits(off) -> dict[str, float]:
    """The offloader's running totals: the forward's waits for copies out (held back by the
    queue's bound, or for the store), the backward's for reads, the GPU's for copies back."""
    if off is None:
        return {}
    r, st = off.res, off.stats()
    return {"held_back_s": r.held_back, "forward_wait_s": r.forward_wait, "stall_s": r.stall,
            "gpu_wait_s": st.gpu_wait_seconds, "offloaded": st.tensors_offloaded}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--runs", default="keep,checkpoint,0.8,0.25,auto:16")
    p.add_argument("--dir", default="benches/out/trace-nvme")
    p.add_argument("--profile", default="", help="runs to profile a step of (torch.profiler)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    doc: dict = {}
    keep_peak = None
    for run in a.runs.split(","):
        kind, _, b = run.partition(":")
        batch = int(b) if b else a.batch
        handler = logging.FileHandler(a.out / f"{run.replace(':', '_')}.log", mode="w")
        logging.getLogger("ssdtier").addHandler(handler)
        logging.getLogger("ssdtier").setLevel(logging.INFO)
        model = off = loss_of = None
        # A cycle may hold the last run's model and optimizer (20 GiB): said, then collected.
        left = torch.cuda.memory_allocated() / 2**30
        gc.collect()
        torch.cuda.empty_cache()
        gone = left - torch.cuda.memory_allocated() / 2**30
        print(f"== {run} (batch {batch}); {left:.2f} GiB allocated before, {gone:.2f} of it in cycles", flush=True)
        try:
            model, loss_of = gpt(batch, every=1 if kind == "checkpoint" else 0)
            if kind not in ("keep", "checkpoint"):
                budget = "auto" if kind == "auto" else int(float(kind) * keep_peak)
                cfg = {
                    "policy": {"mode": "adaptive", "device_budget": budget, "min_tensor_bytes": "1MiB"},
                    "host": {"capacity": "16GiB"},
                    "nvme": [{"path": a.dir, "capacity": "32GiB"}],
                }
                off = ssdtier.attach(model, cfg)
            prof = a.out / f"profile_{run.replace(':', '_')}.txt" if run in a.profile.split(",") else None
            rows = steps(model, loss_of, a.steps, off, prof)
            last = sorted(r["s"] for r in rows[-3:])[1]
            doc[run] = {"status": "ok", "steps": rows, "median_last3_s": last, "ms_per_sample": 1e3 * last / batch}
            end = rows[-1]
            planned = f"{end['solves']} solves, {end['replan_s']:.3f} s planning, " if "solves" in end else ""
            print(
                f"== {run}: {1e3 * last / batch:.2f} ms/sample, peak {max(r['peak_gib'] for r in rows[-3:]):.1f} GiB, "
                f"{planned}plan {rows[-1].get('plan')}",
                flush=True,
            )
            if run == "keep":
                keep_peak = int(sorted(r["peak_gib"] for r in rows)[len(rows) // 2] * 2**30)
        except Exception as e:  # noqa: BLE001 - a trace tool: say it and go on
            doc[run] = {"status": type(e).__name__, "error": traceback.format_exc()[-3000:]}
            print(doc[run]["error"], flush=True)
        finally:
            if off is not None:
                doc.setdefault(run, {})["stats"] = str(off.stats())[:4000]
                off.detach()
            logging.getLogger("ssdtier").removeHandler(handler)
            model = off = loss_of = None  # the next run starts from an empty GPU
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        (a.out / "trace.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    with ssdtier.reusing_stores():  # each run takes the last one's arena, pinned once
        main()
