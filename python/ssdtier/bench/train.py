"""``ssdtier bench train``: one model trained several ways side by side (keep, ssdtier,
checkpoint, save_on_cpu), each setting's peak activation memory and step time.

On the CPU each setting runs in a fresh process (``python -m ssdtier.bench.train``) with
glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, so that freed activations leave the RSS: the
peak is the RSS high-water mark of the measured steps above the RSS at their start (plus
the host arena's pages resident then). On CUDA they run in this process and the peak is
``torch.cuda.max_memory_allocated`` above the allocation at the start; ``reserved`` is
``max_memory_reserved`` above it, which also counts blocks still being copied out.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from .._cli import CLI, positive
from ..config import Config
from ..errors import ConfigError
from ..paths import check_paths
from ..sizes import format_size
from ._report import Progress, emit, table

__all__ = ["Mode", "Setting", "Workload", "add_workload_arguments", "cmd_train", "run", "workload_of"]

_TAG = "@@ssdtier-bench "  # the worker's lines to its parent: a step done, or the result
MMAP_THRESHOLD = 64 << 10


class Mode(enum.Enum):
    KEEP = "keep"  # autograd keeps every saved activation in memory
    SSDTIER = "ssdtier"  # ssdtier.attach
    CHECKPOINT = "checkpoint"  # every block recomputed in backward (torch.utils.checkpoint)
    SAVE_ON_CPU = "save_on_cpu"  # torch.autograd.graph.save_on_cpu around the forward


@dataclass(frozen=True)
class Setting:
    """One way to train the workload; ``keep_last`` and ``budget`` are ssdtier's
    ``policy.keep_last_layers`` and ``policy.device_budget`` (None: the default)."""

    mode: Mode
    keep_last: int | None = None
    budget: str | None = None

    @property
    def label(self) -> str:
        parts = [self.mode.value]
        if self.keep_last is not None:
            parts.append(f"keep {self.keep_last}")
        if self.budget is not None:
            parts.append(f"budget {self.budget}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """The model and its training, the same in every setting of a run."""

    hf: str | None  # a transformers model type (random weights), or None for ssdtier.models.GPT
    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    vocab: int
    steps: int
    warmup: int
    device: str  # "cpu" or "cuda"
    dir: str | None  # NVMe directory (None: the default one)
    arena: str
    min_tensor_bytes: str
    threads: int | None

    def store_config(self, s: Setting) -> Config:
        policy: dict[str, Any] = {"min_tensor_bytes": self.min_tensor_bytes}
        if s.keep_last is not None:
            policy["keep_last_layers"] = s.keep_last
        if s.budget is not None:
            policy["device_budget"] = s.budget
        cfg: dict[str, Any] = {"host": {"capacity": self.arena}, "policy": policy}
        if self.dir:
            cfg["nvme"] = [{"path": self.dir, "capacity": "64GiB"}]
        return Config.from_dict(cfg, source=CLI)


def _hf_model(w: Workload, device: Any) -> tuple[Any, Callable[[], Any]]:
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf needs transformers: pip install 'ssdtier[hf]'") from None
    # Given to the config's __init__, which derives the rest from them (head size, key-value
    # heads); names a config does not use are kept as plain attributes, harmlessly.
    sizes = {
        "vocab_size": w.vocab,
        "hidden_size": w.d_model,
        "num_hidden_layers": w.layers,
        "num_attention_heads": w.heads,
        "num_key_value_heads": w.heads,
        "intermediate_size": 4 * w.d_model,
        "max_position_embeddings": max(w.seq, 64),
    }
    try:
        cfg = transformers.AutoConfig.for_model(w.hf, **sizes)
    except ValueError as e:
        raise ConfigError(f"--hf {w.hf!r}: {e}") from None
    auto = transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg).to(device)
    ids = _ids(w, device)
    if cfg.is_encoder_decoder:
        return model, lambda: model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _ids(w: Workload, device: Any) -> Any:
    import torch

    return torch.randint(0, w.vocab, (w.batch, w.seq), generator=torch.Generator().manual_seed(1)).to(device)


def _model(w: Workload, checkpoint: bool, device: Any) -> tuple[Any, Callable[[], Any]]:
    """The model (seeded) and its loss on a fixed batch."""
    if w.hf is not None:
        model, loss = _hf_model(w, device)
        if checkpoint:
            from ..integrations.hf import checkpointing

            checkpointing(model)
        model.train()
        return model, loss
    import torch

    from ..models import GPTConfig, batch_loss, build_model, make_batch

    cfg = GPTConfig(
        vocab_size=w.vocab, seq_len=w.seq, d_model=w.d_model, n_layers=w.layers, n_heads=w.heads, checkpoint=checkpoint
    )
    model = build_model(cfg).to(device)
    batch = make_batch(cfg, w.batch, torch.Generator().manual_seed(1), device=device)
    return model, lambda: batch_loss(model, batch)


def measure(s: Setting, w: Workload, on_step: Callable[[], None]) -> dict[str, Any]:
    """Train ``w`` the ``s`` way in this process: warmup steps, then the measured ones."""
    import torch

    from ..offload import attach
    from .memory import CpuPeak, CudaPeak, mapping_rss

    device = torch.device(w.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model, loss_of = _model(w, s.mode is Mode.CHECKPOINT, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = attach(model, w.store_config(s)) if s.mode is Mode.SSDTIER else None
    around = (
        (lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda))
        if s.mode is Mode.SAVE_ON_CPU
        else contextlib.nullcontext
    )
    torch.manual_seed(1)  # dropout, the same in every setting

    def step() -> float:
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: in the baseline, not the peak
        with around():
            loss = loss_of()
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        on_step()
        return float(loss)

    losses = [step() for _ in range(w.warmup)]
    probe: Any = CudaPeak(device) if cuda else CpuPeak()
    probe.start()
    # On the CPU, the arena's pages resident now are hidden by the baseline: added back.
    arena = off.store.arena if off is not None and not cuda else None
    hidden = mapping_rss(arena.data_ptr()) if arena is not None else 0
    times = []
    for _ in range(w.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    peak, baseline = probe.stop()
    median = statistics.median(times)
    result: dict[str, Any] = {
        "setting": s.label,
        **asdict(s),
        "mode": s.mode.value,
        "peak_bytes": peak - baseline + hidden,
        "memory_method": probe.method,
        "median_step_s": median,
        "step_seconds": times,
        "tokens_per_s": w.batch * w.seq / median,
        "losses": [x.hex() for x in losses],
    }
    if cuda:
        result["reserved_bytes"] = probe.reserved - baseline
    if off is not None:
        stats = off.stats()
        off.detach()
        result["layers_kept"] = stats.layers_kept
        result["offload"] = stats.as_dict()
    return result


def _worker() -> None:
    """``python -m ssdtier.bench.train '<json>'``: one setting, its result on stdout."""
    job = json.loads(sys.argv[1])
    w = Workload(**job["workload"])
    s = Setting(Mode(job["setting"]["mode"]), job["setting"]["keep_last"], job["setting"]["budget"])
    if w.threads:
        import torch

        torch.set_num_threads(w.threads)
    result = measure(s, w, lambda: print(_TAG + "step", file=sys.stderr, flush=True))
    print(_TAG + json.dumps(result), flush=True)


def _in_subprocess(s: Setting, w: Workload, bar: Progress) -> dict[str, Any]:
    job = json.dumps({"setting": {**asdict(s), "mode": s.mode.value}, "workload": asdict(w)})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    cmd = [sys.executable, "-m", "ssdtier.bench.train", job]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None and proc.stdout is not None
    said = []
    for line in proc.stderr:
        if line.startswith(_TAG):
            bar.update(1, s.label)
        else:
            said.append(line)
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"the {s.label} run failed:\n{''.join(said[-30:])}")
    for line in out.splitlines():
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG) :])
    raise RuntimeError(f"the {s.label} run gave no result:\n{''.join(said[-30:])}")


def run(settings: list[Setting], w: Workload, desc: str) -> list[dict[str, Any]]:
    """Every setting, one after the other (CPU: each in a fresh process), with a progress bar."""
    for s in settings:
        if s.mode is Mode.SSDTIER:
            check_paths(w.store_config(s))  # a bad directory is said before any work
    results = []
    with Progress(len(settings) * (w.warmup + w.steps), desc, unit="step") as bar:
        for s in settings:
            if w.device == "cuda":
                import torch

                results.append(measure(s, w, lambda s=s: bar.update(1, s.label)))
                torch.cuda.empty_cache()
            else:
                results.append(_in_subprocess(s, w, bar))
            r = results[-1]
            peak = format_size(max(r["peak_bytes"], 0))
            bar.write(f"{desc}: {r['setting']}: peak {peak}, {r['median_step_s']:.3f} s a step")
    return results


def ratios(results: list[dict[str, Any]]) -> None:
    """Adds to each result its memory and time against keep's, and whether its losses equal keep's."""
    keep = next(r for r in results if r["mode"] == Mode.KEEP.value)
    for r in results:
        r["memory_vs_keep"] = r["peak_bytes"] / max(keep["peak_bytes"], 1)
        if "reserved_bytes" in r:
            r["reserved_vs_keep"] = r["reserved_bytes"] / max(keep["reserved_bytes"], 1)
        r["time_vs_keep"] = r["median_step_s"] / keep["median_step_s"]
        r["losses_equal_keep"] = r["losses"] == keep["losses"]


def render(results: list[dict[str, Any]], w: Workload) -> str:
    model = f"{w.hf} (random weights)" if w.hf else "GPT (ssdtier.models)"
    reserved = all("reserved_bytes" in r for r in results)
    rows = [
        [
            r["setting"],
            f"{r['peak_bytes'] / 2**20:.1f}",
            f"{r['memory_vs_keep']:.2f}",
            *([f"{r['reserved_bytes'] / 2**20:.1f}", f"{r['reserved_vs_keep']:.2f}"] if reserved else []),
            f"{r['median_step_s']:.3f}",
            f"{r['time_vs_keep']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            "yes" if r["losses_equal_keep"] else "NO",
        ]
        for r in results
    ]
    head = ["setting", "peak MiB", "x keep", *(["reserved MiB", "x keep"] if reserved else [])]
    head += ["step s", "x keep", "tokens/s", "losses = keep"]
    return "\n".join(
        [
            f"{model}: {w.layers} layers, width {w.d_model}, seq {w.seq}, batch {w.batch}, on {w.device}; "
            f"{w.warmup} warmup + {w.steps} measured steps",
            f"peak: activation memory of a step ({results[0]['memory_method']})",
            "",
            table(head, rows),
        ]
    )


def add_workload_arguments(p: argparse.ArgumentParser, quick_note: str) -> None:
    p.add_argument("--hf", metavar="MODEL_TYPE", help="a transformers model type (llama, gpt2, t5...), random weights")
    p.add_argument("--layers", type=positive, default=8, help="blocks")
    p.add_argument("--d-model", type=positive, default=256, help="model width")
    p.add_argument("--heads", type=positive, default=8, help="attention heads")
    p.add_argument("--seq", type=positive, default=256, help="sequence length")
    p.add_argument("--batch", type=positive, default=8, help="batch size")
    p.add_argument("--vocab", type=positive, default=1024, help="vocabulary size")
    p.add_argument("--steps", type=positive, default=5, help="measured steps per setting")
    p.add_argument("--warmup", type=int, default=2, help="steps per setting before the measured ones")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to train")
    p.add_argument("--threads", type=positive, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--dir", help="NVMe directory (default: SSDTIER_DIR, else ~/.cache/ssdtier)")
    p.add_argument("--arena", default="64MiB", help="ssdtier's host arena (host.capacity)")
    p.add_argument("--min-tensor-bytes", default="64KiB", help="ssdtier's policy.min_tensor_bytes")
    p.add_argument("--quick", action="store_true", help=quick_note)
    p.add_argument("--json", action="store_true", help="print the results as JSON, not as a table")


def workload_of(args: argparse.Namespace) -> Workload:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{CLI}: --device cuda, but torch sees no CUDA device")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.d_model % args.heads:
        raise ConfigError(f"{CLI}: --d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    w = Workload(
        args.hf,
        args.layers,
        args.d_model,
        args.heads,
        args.seq,
        args.batch,
        args.vocab,
        args.steps,
        max(args.warmup, 0),
        device,
        args.dir,
        args.arena,
        args.min_tensor_bytes,
        args.threads,
    )
    if args.quick:  # a small model: a minute on a laptop's CPU
        w = replace(w, layers=4, d_model=128, heads=4, seq=64, batch=4, vocab=512, steps=3, warmup=1)
    return w


def cmd_train(args: argparse.Namespace) -> int:
    """Keep, ssdtier, checkpoint and save_on_cpu on one model, side by side."""
    w = workload_of(args)
    settings = [Setting(m) for m in Mode]
    results = run(settings, w, "bench train")
    ratios(results)
    emit({"workload": asdict(w), "results": results}, render(results, w), args.json)
    return 0 if all(r["losses_equal_keep"] for r in results if r["mode"] == Mode.SSDTIER.value) else 1


if __name__ == "__main__":
    _worker()
