"""``ssdtier bench train``: one model trained several ways side by side (keep, ssdtier,
checkpoint, save_on_cpu), each setting's peak activation memory and step time; the
machinery ``bench rok`` runs its modes with.

On the CPU each setting runs in a fresh process (``python -m ssdtier.bench.train``) with
glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, so that freed activations leave the RSS: the
peak is the RSS high-water mark of the measured steps above the RSS at their start (plus
the host arena's pages resident then). On CUDA they run in this process and the peak is
``torch.cuda.max_memory_allocated`` above the allocation at the start; ``reserved`` is
``max_memory_reserved`` above it, which also counts blocks still being copied out.

A setting that fails (out of memory, a mode that does not run here) is a row with its
status and why; the others still run.
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
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .._cli import CLI, positive
from ..config import Config
from ..errors import ConfigError
from ..paths import check_paths
from ..sizes import format_size
from ._report import Progress, emit, jsonable, table

__all__ = [
    "Mode",
    "Setting",
    "Workload",
    "add_workload_arguments",
    "cmd_train",
    "is_oom",
    "measure_safely",
    "on_compile",
    "plan_counts",
    "plan_text",
    "render",
    "run",
    "workload_of",
]

_TAG = "@@ssdtier-bench "  # the worker's lines to its parent: a step done, or the result
MMAP_THRESHOLD = 64 << 10


class Mode(enum.Enum):
    KEEP = "keep"  # autograd keeps every saved activation in memory
    SSDTIER = "ssdtier"  # ssdtier.attach
    CHECKPOINT = "checkpoint"  # blocks recomputed in backward (torch.utils.checkpoint), every k-th
    SAC = "sac"  # selective checkpointing: matmul and attention outputs kept, the rest recomputed
    SAVE_ON_CPU = "save_on_cpu"  # torch.autograd.graph.save_on_cpu around the forward
    TORCHTUNE = "torchtune"  # torchtune's OffloadActivations around the forward (CUDA)
    COMPILE = "compile"  # torch.compile per block, under torch's activation memory budget


class Skipped(Exception):
    """A setting that does not run here (its row says why)."""


@dataclass(frozen=True)
class Setting:
    """One way to train the workload. ``keep_last`` and ``budget`` are ssdtier's
    ``policy.keep_last_layers`` and ``policy.device_budget`` (None: the default); with
    ``fraction`` the budget is that share of keep's peak, set once keep has run. ``every``:
    checkpoint (or sac) every k-th block. ``memory_budget``: compile's
    ``torch._functorch.config.activation_memory_budget``; with ssdtier, each block compiled
    under it before attaching (ssdtier on compiled blocks)."""

    mode: Mode
    keep_last: int | None = None
    budget: str | int | None = None
    fraction: float | None = None
    every: int = 1
    memory_budget: float | None = None

    @property
    def label(self) -> str:
        parts = [self.mode.value]
        if self.every != 1:
            parts.append(f"1/{self.every}")
        if self.memory_budget is not None:
            on = "on compile" if self.mode is Mode.SSDTIER else "budget"
            parts.append(f"{on} {self.memory_budget:g}")
        if self.keep_last is not None:
            parts.append(f"keep {self.keep_last}")
        if self.fraction is not None:
            parts.append(f"{self.fraction:g}x keep")
        elif self.budget is not None:
            parts.append(f"budget {self.budget if isinstance(self.budget, str) else format_size(self.budget)}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Setting:
        known = {f.name for f in fields(cls)}
        return cls(**{k: (Mode(v) if k == "mode" else v) for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Workload:
    """The model and its training, the same in every setting of a run."""

    hf: str | None  # a transformers model type (random weights), or None for ssdtier.bench.models.GPT
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
    arena: str  # ssdtier's host.capacity; "auto": 64MiB on the CPU, the package's default on CUDA
    min_tensor_bytes: str
    threads: int | None
    sdpa: bool = False  # the GPT attends with scaled_dot_product_attention (fused on a GPU)
    dtype: str = "fp32"  # or "bf16": the forward under bf16 autocast
    dropout: float = 0.1
    throttle: str | None = None  # ssdtier's io.throttle: a slower disk, as a GPU's link is slower
    paired: bool = False  # CPU: keep's twin stepped beside each setting, in its process (paired.py)

    def store_config(self, s: Setting) -> Config:
        policy: dict[str, Any] = {"min_tensor_bytes": self.min_tensor_bytes}
        if s.keep_last is not None:
            policy["keep_last_layers"] = s.keep_last
        if s.budget is not None:
            policy["device_budget"] = s.budget
        cfg: dict[str, Any] = {"policy": policy}
        if self.throttle:
            cfg["io"] = {"throttle": self.throttle}
        if self.arena != "auto":
            cfg["host"] = {"capacity": self.arena}
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


def _model(w: Workload, s: Setting, device: Any) -> tuple[Any, Callable[[], Any]]:
    """The model (seeded), checkpointed as ``s`` says, and its loss on a fixed batch."""
    recompute = s.mode in (Mode.CHECKPOINT, Mode.SAC)
    if w.hf is not None:
        model, loss = _hf_model(w, device)
        if recompute:
            from ..integrations.hf import checkpointing
            from .models import selective_checkpoint_context

            checkpointing(model, context_fn=selective_checkpoint_context if s.mode is Mode.SAC else None)
        model.train()
        return model, loss
    import torch

    from .models import GPTConfig, batch_loss, build_model, make_batch

    cfg = GPTConfig(
        vocab_size=w.vocab,
        seq_len=w.seq,
        d_model=w.d_model,
        n_layers=w.layers,
        n_heads=w.heads,
        dropout=w.dropout,
        sdpa=w.sdpa,
        checkpoint_every=s.every if recompute else 0,
        selective=s.mode is Mode.SAC,
    )
    with torch.device(device):  # built where it trains: a 1B model's init on the CPU takes long
        model = build_model(cfg)
    batch = make_batch(cfg, w.batch, torch.Generator().manual_seed(1), device=device)
    return model, lambda: batch_loss(model, batch)


def block_list(model: Any) -> Any:
    """The ModuleList of the model's repeated blocks: the GPT's ``blocks``, else its longest
    (None: it has none)."""
    import torch

    if isinstance(getattr(model, "blocks", None), torch.nn.ModuleList):
        return model.blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else None


def skip_reason(s: Setting, w: Workload) -> str | None:
    """Why ``s`` cannot run on ``w`` here (None: it can), said before any work."""
    if s.mode is Mode.TORCHTUNE:
        if w.device != "cuda":
            return "torchtune's OffloadActivations moves CUDA tensors only"
        from .peers import torchtune_maker

        maker, what = torchtune_maker()
        if maker is None:
            return f"torchtune does not import ({what})"
    if s.mode in (Mode.CHECKPOINT, Mode.SAC) and s.every != 1 and w.hf is not None:
        return "every k-th block: built-in GPT only (transformers checkpoints every layer)"
    return None


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def plan_counts(off: Any, stats: Any = None) -> dict[str, int]:
    """How many blocks ssdtier's plan keeps, offloads and recomputes. Read defensively: a plan
    with ``actions`` (enum members whose values are "keep", "offload", "recompute" and
    "recompute+offload") is counted; else its ``keep_last``; with no plan, the stats' layers."""
    try:
        plan = off.plan()
    except Exception:
        plan = None
    actions = getattr(plan, "actions", None)
    if actions is not None:
        got = Counter(str(getattr(a, "value", a)) for a in actions)
        return {k: got.get(k, 0) for k in ("keep", "offload", "recompute", "recompute+offload")} | dict(got)
    if plan is not None and getattr(plan, "keep_last", None) is not None:
        n = len(getattr(plan, "layers", ()))
        return {"keep": plan.keep_last, "offload": max(n - plan.keep_last, 0), "recompute": 0}
    if stats is not None:
        return {"keep": stats.layers_kept, "offload": stats.layers_offloaded, "recompute": 0}
    return {}


@contextlib.contextmanager
def _compiled(s: Setting, model: Any) -> Iterator[None]:
    """Each block compiled on its own (regional compilation: ``blocks[i] = torch.compile(b)``,
    as torchtitan does and as ssdtier needs) with torch's activation memory budget: its
    partitioner recomputes the cheapest ops until the saved bytes fit that share."""
    import torch
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=s.memory_budget if s.memory_budget is not None else 1.0):
        found = block_list(model)
        for i, block in enumerate(found if found is not None else ()):
            found[i] = torch.compile(block)
        try:
            yield
        finally:
            torch._dynamo.reset()  # the next setting in this process compiles afresh


def measure(
    s: Setting,
    w: Workload,
    on_step: Callable[[], None],
    gate: Callable[[], Any] = lambda: None,
    settle: bool = True,
) -> dict[str, Any]:
    """Train ``w`` the ``s`` way in this process: warmup steps, then the measured ones, each
    after ``gate()`` returns (lockstep.py), untimed. With ``settle`` (not in lockstep, nor
    paired), ssdtier's warmup goes on while its plan still moves (``settle_plan``)."""
    import torch

    from .memory import CpuPeak, CudaPeak, mapping_rss

    reason = skip_reason(s, w)
    if reason is not None:
        raise Skipped(reason)
    device = torch.device(w.device)
    cuda = device.type == "cuda"

    def trainer(model: Any, loss_of: Callable[[], Any], opt: Any, around: Callable[[], Any]) -> Callable[[], float]:
        def step() -> float:
            opt.zero_grad(set_to_none=False)  # gradients stay allocated: in the baseline, not the peak
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=w.dtype == "bf16"), around():
                loss = loss_of()
            loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize(device)
            return float(loss.detach())

        return step

    twin = None
    if w.paired:
        from .paired import Twin

        torch.manual_seed(0)
        t_model, t_loss = _model(w, Setting(Mode.KEEP), device)
        twin = Twin(trainer(t_model, t_loss, torch.optim.AdamW(t_model.parameters(), lr=1e-3), contextlib.nullcontext))
    torch.manual_seed(0)
    model, loss_of = _model(w, s, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if cuda else {}))
    off = None
    compiled = s.mode is Mode.COMPILE or (s.mode is Mode.SSDTIER and s.memory_budget is not None)
    with contextlib.ExitStack() as stack:
        if compiled:
            stack.enter_context(_compiled(s, model))  # before attaching: each compiled block is a block
        if s.mode is Mode.SSDTIER:
            from ..offload import attach  # only here: the other modes run without ssdtier's runtime

            off = attach(model, w.store_config(s))
        around: Callable[[], Any] = contextlib.nullcontext
        if s.mode is Mode.SAVE_ON_CPU:
            around = lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)  # noqa: E731
        elif s.mode is Mode.TORCHTUNE:
            from .peers import torchtune_maker

            maker, _ = torchtune_maker()
            assert maker is not None  # skip_reason said so otherwise
            ctx = maker(model)
            around = lambda: ctx  # noqa: E731
        torch.manual_seed(1)  # dropout, the same in every setting
        train_step = trainer(model, loss_of, opt, around)

        done = 0  # steps that ran to the end: where a failure came is said with it

        def step(counted: bool = True) -> float:  # counted: in the progress bar's total
            nonlocal done
            loss = train_step()
            done += 1
            if counted:
                on_step()
            return loss

        try:
            losses = []
            moved = False
            for _ in range(w.warmup):
                gate()
                was = plan_of(off)
                losses.append(step())
                moved = plan_of(off) != was
                if twin is not None:
                    twin.step()
            extra = settle_plan(off, lambda: step(False), w.warmup) if settle and moved and twin is None else []
            losses += extra
            # On the CPU, the arena's pages resident now are hidden by the baseline: added back.
            arena = getattr(off.store, "arena", None) if off is not None and not cuda else None
            hidden = mapping_rss(arena.data_ptr()) if arena is not None else 0
            paired: dict[str, Any] = {}
            if twin is not None:
                from .paired import paired_steps

                paired = paired_steps(step, twin, w.steps, gate, losses)
                times, peak, baseline, method = paired.pop("times"), paired.pop("peak"), 0, paired.pop("method")
            else:
                guarded = off.c["guard_recomputed"] if off is not None else 0
                probe: Any = CudaPeak(device) if cuda else CpuPeak()
                probe.start()
                times = []
                for _ in range(w.steps):
                    gate()
                    t0 = time.perf_counter()
                    losses.append(step())
                    times.append(time.perf_counter() - t0)
                peak, baseline = probe.stop()
                method = probe.method
                guarded = off.c["guard_recomputed"] - guarded if off is not None else 0
        except Exception as e:
            e.bench_where = where_failed(done + 1, w, off)  # type: ignore[attr-defined]
            raise
        finally:
            if off is not None:
                stats = off.stats()
                plan = plan_counts(off, stats)
                off.detach()
    median = statistics.median(times)
    result: dict[str, Any] = {
        "setting": s.label,
        **s.to_dict(),
        "status": "ok",
        "batch": w.batch,
        "peak_bytes": peak - baseline + hidden,
        "memory_method": method,
        "median_step_s": median,
        "s_per_sample": median / w.batch,
        "step_seconds": times,
        "tokens_per_s": w.batch * w.seq / median,
        "losses": [x.hex() for x in losses],
        **paired,
    }
    if cuda:
        result["reserved_bytes"] = probe.reserved - baseline
        if not paired:  # each an emptied cache and a synchronization: a slow step the peak hides
            result["alloc_retries"] = probe.retries
    if off is not None:
        result["settle_steps"] = len(extra)
        if not paired:  # blocks recomputed past the plan: forwards that would have passed the budget
            result["guard_recomputed"] = guarded / w.steps
        result["layers_kept"] = stats.layers_kept
        result["plan"] = plan
        result["offload"] = stats.as_dict()
    return result


def plan_of(off: Any) -> tuple | None:
    """ssdtier's plan in force: its actions (None: no plan, or no ssdtier)."""
    acts = getattr(off.plan(), "actions", None) if off is not None else None
    return tuple(acts) if acts is not None else None


def settle_plan(off: Any, step: Callable[[], float], most: int) -> list[float]:
    """After a warmup whose last step moved ssdtier's plan: steps more (at most ``most``)
    until one leaves it as it was, so that the measured steps follow the plan it settled on,
    as a long run's do; their losses."""
    losses = []
    for _ in range(most):
        was = plan_of(off)
        losses.append(step())
        if plan_of(off) == was:
            break
    return losses


def where_failed(step: int, w: Workload, off: Any) -> str:
    """The step a run failed in and, with ssdtier, its device budget and plan then."""
    said = f"in step {step}, after {w.warmup} warmup" if step > w.warmup else f"in warmup step {step}"
    if off is None:
        return said
    try:
        plan = off.plan()
        budget = getattr(off, "_budget", None)
        summary = plan.summary() if hasattr(plan, "summary") else "no plan yet"
        return f"{said}; ssdtier: device budget {'none' if budget is None else format_size(budget)}, {summary}"
    except Exception as e:  # a report of a failure must not fail
        return f"{said}; ssdtier's state unread ({type(e).__name__})"


def failed(s: Setting, w: Workload, status: str, error: str) -> dict[str, Any]:
    """The row of a setting that did not run to the end."""
    return {"setting": s.label, **s.to_dict(), "status": status, "batch": w.batch, "error": error}


def measure_safely(
    s: Setting,
    w: Workload,
    on_step: Callable[[], None],
    gate: Callable[[], Any] = lambda: None,
    settle: bool = True,
) -> dict[str, Any]:
    """``measure``, with a failure as a result (out of memory, skipped, or an error) rather
    than an exception: one setting failing must not end a run."""
    try:
        return measure(s, w, on_step, gate, settle)
    except Skipped as e:
        return failed(s, w, "skipped", str(e))
    except Exception as e:
        where = getattr(e, "bench_where", "")
        where = f" ({where})" if where else ""
        if is_oom(e):
            return failed(s, w, "OOM", (str(e).splitlines() or [""])[0][:500] + where)  # torch's says what was free
        traceback.print_exc()
        lines = [line for line in str(e).splitlines() if line.strip()]
        return failed(s, w, "error", f"{type(e).__name__}: {(lines or [''])[0][:300]}{where}")


def _worker() -> None:
    """``python -m ssdtier.bench.train '<json>'``: one setting, its result on stdout."""
    job = json.loads(sys.argv[1])
    w = Workload(**job["workload"])
    s = Setting.from_dict(job["setting"])
    if w.threads:
        import torch

        torch.set_num_threads(w.threads)
    gate = sys.stdin.readline if job.get("lockstep") else lambda: None  # a line: take a step
    on_step = lambda: print(_TAG + "step", file=sys.stderr, flush=True)  # noqa: E731
    result = measure_safely(s, w, on_step, gate, settle=not job.get("lockstep"))
    print(_TAG + json.dumps(result, default=jsonable), flush=True)


def worker(s: Setting, w: Workload, lockstep: bool = False) -> subprocess.Popen:
    """A fresh process training ``s``: a line on its stderr per step, its result on stdout;
    with ``lockstep``, each step waits for a line on its stdin."""
    job = json.dumps({"setting": s.to_dict(), "workload": asdict(w), "lockstep": lockstep})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    cmd = [sys.executable, "-m", "ssdtier.bench.train", job]
    stdin = subprocess.PIPE if lockstep else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _in_subprocess(s: Setting, w: Workload, on_step: Callable[[], None]) -> dict[str, Any]:
    proc = worker(s, w)
    assert proc.stderr is not None and proc.stdout is not None
    said = []
    for line in proc.stderr:
        if line.startswith(_TAG):
            on_step()
        else:
            said.append(line)
    out = proc.stdout.read()
    return result_of(s, w, out, proc.wait(), said)


def result_of(s: Setting, w: Workload, out: str, rc: int, said: list[str]) -> dict[str, Any]:
    """A worker's result, from its stdout ``out``, exit status and stderr lines."""
    for line in out.splitlines():
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG) :])
    last = next((line.strip() for line in reversed(said) if line.strip()), "nothing on stderr")
    status = "OOM" if rc == -9 else "error"  # SIGKILL: most likely the kernel's OOM killer
    return failed(s, w, status, f"the process ended ({rc}) with no result: {last[:300]}")


def run_one(s: Setting, w: Workload, on_step: Callable[[], None]) -> dict[str, Any]:
    """One setting: on CUDA in this process, on the CPU in a fresh one."""
    if w.device != "cuda":
        return _in_subprocess(s, w, on_step)
    from .memory import free_cuda

    try:
        return measure_safely(s, w, on_step)
    finally:
        free_cuda()


def resolve(s: Setting, w: Workload, results: list[dict[str, Any]]) -> tuple[Setting, Workload]:
    """What depends on keep's run: a budget given as a share of keep's peak; and the arena
    ``auto`` made concrete (``auto_arena``)."""
    keep = next((r for r in results if r["mode"] == Mode.KEEP.value and r["status"] == "ok"), None)
    if s.fraction is not None and s.budget is None:
        if keep is None:
            raise Skipped("its budget is a share of keep's peak, and keep did not run")
        s = replace(s, budget=max(int(s.fraction * keep["peak_bytes"]), 0))
    if s.mode is Mode.SSDTIER and w.arena == "auto":
        w = replace(w, arena=auto_arena(w))
    return s, w


def auto_arena(w: Workload) -> str:
    """``--arena auto``: on the CPU a small one (64 MiB, so that the bytes reach NVMe); on CUDA
    the package's default, what a user gets (``host.capacity = "auto"``)."""
    return "64MiB" if w.device != "cuda" else "auto"


def run(
    settings: list[Setting],
    w: Workload,
    desc: str,
    deadline: float | None = None,
    known: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Every setting, one after the other (CPU: each in a fresh process), with a progress bar.
    A setting not started by ``deadline`` (time.monotonic) is skipped. Budgets given as shares
    of keep's peak come from ``known`` (an earlier round's results) if keep is there."""
    check_dirs(settings, w)
    results: list[dict[str, Any]] = []
    per = w.warmup + w.steps
    with Progress(len(settings) * per, desc, unit="step") as bar:
        for s in settings:
            done = bar.done
            try:
                s, sw = prepare(s, w, [*known, *results], deadline)
                r = run_one(s, sw, lambda s=s: bar.update(1, s.label))
            except Skipped as e:
                r = failed(s, w, "skipped", str(e))
            results.append(r)
            if done + per > bar.done:  # a setting that stopped early: the bar moves on
                bar.update(done + per - bar.done)
            bar.write(f"{desc}: {outcome(r)}")
    return results


def check_dirs(settings: list[Setting], w: Workload) -> None:
    """A bad directory is said before any work."""
    for s in settings:
        if s.mode is Mode.SSDTIER:
            check_paths(w.store_config(s))


def prepare(
    s: Setting, w: Workload, known: Sequence[dict[str, Any]], deadline: float | None
) -> tuple[Setting, Workload]:
    """The setting and workload to run (``resolve``), or Skipped: out of time, or not here."""
    if deadline is not None and time.monotonic() > deadline:
        raise Skipped("out of time (--budget-s)")
    reason = skip_reason(s, w)
    if reason is not None:
        raise Skipped(reason)
    return resolve(s, w, known)


def outcome(r: dict[str, Any]) -> str:
    """A result in a line."""
    return f"{r['setting']}: {in_a_line(r)}"


def in_a_line(r: dict[str, Any]) -> str:
    """A result in a line, less the setting's name."""
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('error', '')}"
    line = f"peak {format_size(max(r['peak_bytes'], 0))}, {r['median_step_s']:.3f} s a step"
    if "reserved_bytes" in r:
        line += f", reserved {format_size(max(r['reserved_bytes'], 0))}"
    if r.get("alloc_retries"):
        line += f", {r['alloc_retries']} allocator retries"
    if r.get("guard_recomputed"):
        line += f", {r['guard_recomputed']:g} blocks a step recomputed past the plan"
    return line + (f", plan {plan_text(r['plan'])} (keep/offload/recompute)" if r.get("plan") else "")


def ratios(results: list[dict[str, Any]], compare: int | None = None) -> None:
    """Adds to each result its memory and time (per sample) against keep's, and whether its
    first ``compare`` losses (None: all) equal those of the same run without ssdtier: keep's,
    or for ssdtier on compiled blocks the compile setting's at the same budget (None: not
    compared; compiled kernels round otherwise than eager ones)."""
    ok = [r for r in results if r.get("status") == "ok"]
    keep = next((r for r in ok if r["mode"] == Mode.KEEP.value), None)
    if keep is None:
        return
    compiled = {r["memory_budget"]: r for r in ok if r["mode"] == Mode.COMPILE.value}
    for r in ok:
        r["memory_vs_keep"] = r["peak_bytes"] / max(keep["peak_bytes"], 1)
        if "reserved_bytes" in r and "reserved_bytes" in keep:
            r["reserved_vs_keep"] = r["reserved_bytes"] / max(keep["reserved_bytes"], 1)
        r["time_vs_keep"] = pace(r, keep)
        if r["mode"] == Mode.COMPILE.value:
            base = None
        elif on_compile(r):
            base = compiled.get(r["memory_budget"])
        else:
            base = keep
        same = base is not None and r["batch"] == base["batch"]
        # A setting that warmed up longer (settle_plan) has more: the steps both took are compared.
        if same:
            n = min(len(r["losses"]), len(base["losses"])) if compare is None else compare
            r["losses_equal_keep"] = r["losses"][:n] == base["losses"][:n]
        else:
            r["losses_equal_keep"] = None


def pace(r: dict[str, Any], keep: dict[str, Any]) -> float:
    """A result's time per sample over keep's: with ``--paired``, against keep's twin in its
    own process, step by step (keep's own row is then the pairing's noise)."""
    if "paired_ratio" in r and "paired_ratio" in keep:
        return float(r["paired_ratio"])
    return float(r["s_per_sample"] / keep["s_per_sample"])


def on_compile(r: dict[str, Any]) -> bool:
    """Whether a result is ssdtier's on blocks compiled before attaching."""
    return r["mode"] == Mode.SSDTIER.value and r.get("memory_budget") is not None


def losses_compared(w: Workload) -> int | None:
    """How many losses must equal keep's: all, but with fused attention on a GPU only the
    first (its backward is not bitwise reproducible, so the weights differ after a step)."""
    return 1 if w.device == "cuda" and (w.sdpa or w.hf) else None


def describe(w: Workload) -> str:
    model = (
        f"{w.hf} (random weights)" if w.hf else f"GPT (ssdtier.bench.models, {'sdpa' if w.sdpa else 'plain'} attention)"
    )
    dtype = ", bf16 autocast" if w.dtype == "bf16" else ""
    threads = f" ({w.threads} thread{'s' if w.threads != 1 else ''})" if w.threads else ""
    throttle = f"; ssdtier's disk throttled to {w.throttle}/s" if w.throttle else ""
    paired = "; each paired with keep's twin" if w.paired else ""
    return (
        f"{model}: {w.layers} layers, width {w.d_model}, seq {w.seq}, batch {w.batch}, on {w.device}{threads}"
        f"{dtype}; {w.warmup} warmup + {w.steps} measured steps{throttle}{paired}"
    )


def plan_text(plan: dict[str, int] | None) -> str:
    """A plan's blocks kept / offloaded / recomputed (and recomputed with their inputs offloaded)."""
    if not plan:
        return "-"
    text = f"{plan.get('keep', 0)}/{plan.get('offload', 0)}/{plan.get('recompute', 0)}"
    return text + (f" +{plan['recompute+offload']} r+o" if plan.get("recompute+offload") else "")


def render(results: list[dict[str, Any]], w: Workload) -> str:
    """Memory and time per sample as ratios to keep's, losses against keep's, ssdtier's plan;
    then why each setting that did not run to the end did not."""
    ok = [r for r in results if r.get("status") == "ok" and "memory_vs_keep" in r]
    reserved = bool(ok) and all("reserved_vs_keep" in r for r in ok)
    plans = any(r.get("plan") for r in ok)
    head = ["setting", "peak MiB", "x keep", *(["reserved MiB", "x keep"] if reserved else [])]
    head += ["ms/sample", "x keep", "tokens/s", "losses = keep", *(["plan keep/offload/recompute"] if plans else [])]
    rows = []
    for r in results:
        if r not in ok:
            rows.append([r["setting"], r.get("status", "?"), *["-"] * (len(head) - 2)])
            continue
        eq = r.get("losses_equal_keep")
        rows.append(
            [
                r["setting"],
                f"{r['peak_bytes'] / 2**20:.1f}",
                f"{r['memory_vs_keep']:.2f}",
                *([f"{r['reserved_bytes'] / 2**20:.1f}", f"{r['reserved_vs_keep']:.2f}"] if reserved else []),
                f"{r['s_per_sample'] * 1e3:.2f}",
                f"{r['time_vs_keep']:.2f}",
                f"{r['tokens_per_s']:.0f}",
                "-" if eq is None else "yes" if eq else "NO",
                *([plan_text(r.get("plan"))] if plans else []),
            ]
        )
    method = next((r["memory_method"] for r in results if "memory_method" in r), "not measured")
    lines = [describe(w), f"peak: activation memory of a step ({method}); ms/sample: median step / batch", ""]
    lines.append(table(head, rows))
    lines += [outcome(r) for r in results if r.get("status") != "ok"]
    for key, sign, what in (
        ("settle_steps", "+", "warmup steps more, until the plan stood for a step"),
        ("alloc_retries", "", "allocations retried in the measured steps (the GPU ran full; each a synchronization)"),
        ("guard_recomputed", "", "blocks a measured step recomputed past ssdtier's plan (its forward would have "
                                 "passed the budget)"),
    ):  # fmt: skip
        named = [f"{r['setting']} {sign}{r[key]:g}" for r in ok if r.get(key)]
        if named:
            lines.append(f"{what}: {', '.join(named)}")
    if any(r.get("losses_equal_keep") is None for r in ok):
        lines.append("losses '-': not compared (compiled kernels round otherwise)")
    if ok and all("paired_ratio" in r for r in ok):
        lines.append("time x keep: paired, the median of each step's time over that of keep's twin, stepped in "
                     "turn in the setting's process (keep's row: the pairing's own noise)")  # fmt: skip
    if any(on_compile(r) for r in ok):
        lines.append("ssdtier on compile B: each block compiled under budget B, then attached; its losses are "
                     "compared with compile budget B's")  # fmt: skip
    n = losses_compared(w)
    if n is not None:
        lines.append(f"losses: the first {n} compared (fused attention's backward is not bitwise reproducible)")
    return "\n".join(lines)


PRESETS: dict[str, dict[str, Any]] = {
    # What a run is without a preset; an option given on the command line wins over any.
    "default": {
        "layers": 8, "d_model": 256, "heads": 8, "seq": 256, "batch": 8, "vocab": 1024, "steps": 5, "warmup": 2,
        "attention": "plain", "dtype": "fp32", "dropout": 0.1, "min_tensor_bytes": "64KiB",
    },
    # Small, yet its activations (~180 MiB) are well above what a process's RSS moves by
    # itself, so that memory saved shows on a CPU (3 rounds: 2 to 5 minutes there).
    "quick": {"layers": 4, "d_model": 128, "heads": 4, "seq": 256, "batch": 8, "vocab": 512, "steps": 3, "warmup": 1},
    # For a GPU: wide blocks (more FLOPs per byte saved), and long sequences (SDPA: no T x T
    # scores); too slow for a CPU.
    "wide": {
        "layers": 8, "d_model": 4096, "heads": 32, "seq": 2048, "batch": 8, "vocab": 32000,
        "attention": "sdpa", "dtype": "bf16", "dropout": 0.0, "min_tensor_bytes": "1MiB",
    },
    "long": {
        "layers": 8, "d_model": 2048, "heads": 16, "seq": 16384, "batch": 1, "vocab": 32000,
        "attention": "sdpa", "dtype": "bf16", "dropout": 0.0, "min_tensor_bytes": "1MiB",
    },
}  # fmt: skip


def add_workload_arguments(p: argparse.ArgumentParser, quick_note: str) -> None:
    d = PRESETS["default"]
    p.add_argument("--hf", metavar="MODEL_TYPE", help="a transformers model type (llama, gpt2, t5...), random weights")
    p.add_argument("--layers", type=positive, help=f"blocks (default {d['layers']})")
    p.add_argument("--d-model", type=positive, help=f"model width (default {d['d_model']})")
    p.add_argument("--heads", type=positive, help=f"attention heads (default {d['heads']})")
    p.add_argument("--seq", type=positive, help=f"sequence length (default {d['seq']})")
    p.add_argument("--batch", type=positive, help=f"batch size (default {d['batch']})")
    p.add_argument("--vocab", type=positive, help=f"vocabulary size (default {d['vocab']})")
    p.add_argument("--steps", type=positive, help=f"measured steps per setting (default {d['steps']})")
    p.add_argument("--warmup", type=int, help=f"steps per setting before the measured ones (default {d['warmup']})")
    p.add_argument("--attention", choices=("plain", "sdpa"), help="the GPT's attention: plain ops (saves T x T "
                   "scores) or scaled_dot_product_attention (default plain)")  # fmt: skip
    p.add_argument("--dtype", choices=("fp32", "bf16"), help="fp32, or the forward under bf16 autocast (default fp32)")
    p.add_argument("--dropout", type=float, help=f"dropout (default {d['dropout']})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to train")
    p.add_argument("--threads", type=positive, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--dir", help="NVMe directory (default: SSDTIER_DIR, else ~/.cache/ssdtier)")
    p.add_argument("--arena", default="auto", help="ssdtier's host arena (host.capacity); auto: 64MiB on the CPU, "
                   "the package's default on CUDA")  # fmt: skip
    p.add_argument("--min-tensor-bytes", help=f"ssdtier's policy.min_tensor_bytes (default {d['min_tensor_bytes']})")
    p.add_argument("--throttle", metavar="RATE", help="ssdtier's io.throttle (bytes/s per directory): a disk that "
                   "hides only part of the activations, as a GPU's link does")  # fmt: skip
    presets = p.add_mutually_exclusive_group()
    presets.add_argument("--quick", action="store_true", help=quick_note)
    presets.add_argument("--wide", action="store_true", help="8 blocks of width 4096, seq 2048, bf16, SDPA (a GPU's)")
    presets.add_argument("--long", action="store_true", help="8 blocks of width 2048, seq 16384, bf16, SDPA (a GPU's)")
    p.add_argument("--repeats", type=positive, help="rounds of every setting, interleaved; each setting's time "
                   "and peak are the medians of its rounds (default: 3 with --quick, else 1)")  # fmt: skip
    p.add_argument("--lockstep", action="store_true", help="CPU: every setting's process alive at once, each "
                   "taking one step in turn, so that a machine's drift slows them alike (needs the memory of "
                   "all at once)")  # fmt: skip
    p.add_argument("--paired", action="store_true", help="CPU: each setting's process also trains keep's twin, "
                   "a step of each in turn; its time x keep is the median of the steps' ratios")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the results as JSON, not as a table")


def workload_of(args: argparse.Namespace) -> Workload:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{CLI}: --device cuda, but torch sees no CUDA device")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    preset = next((name for name in ("quick", "wide", "long") if getattr(args, name, False)), None)
    v = {**PRESETS["default"], **PRESETS.get(preset or "", {})}
    for key in v:
        if getattr(args, key, None) is not None:
            v[key] = getattr(args, key)
    if device == "cuda" and getattr(args, "lockstep", False):
        raise ConfigError(f"{CLI}: --lockstep runs each setting in a process of its own: CPU only")
    if device == "cuda" and getattr(args, "paired", False):
        raise ConfigError(f"{CLI}: --paired trains a twin in each setting's process: CPU only")
    if v["d_model"] % v["heads"]:
        raise ConfigError(f"{CLI}: --d-model ({v['d_model']}) must be a multiple of --heads ({v['heads']})")
    return Workload(
        args.hf,
        v["layers"],
        v["d_model"],
        v["heads"],
        v["seq"],
        v["batch"],
        v["vocab"],
        v["steps"],
        max(v["warmup"], 0),
        device,
        args.dir,
        args.arena,
        v["min_tensor_bytes"],
        args.threads,
        sdpa=v["attention"] == "sdpa",
        dtype=v["dtype"],
        dropout=v["dropout"],
        throttle=getattr(args, "throttle", None),
        paired=getattr(args, "paired", False),
    )


TRAIN_MODES = (Mode.KEEP, Mode.SSDTIER, Mode.CHECKPOINT, Mode.SAVE_ON_CPU)


def combine(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per setting from rounds of the same settings: the median of the rounds'
    median steps and of their peaks; a failed round fails the setting, a round skipped (out
    of time) is left out. On a shared machine a setting's speed drifts between minutes:
    medians of interleaved rounds compare fairly."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for runs in zip(*rounds, strict=True):
        ran = [x for x in runs if x.get("status") == "ok"]
        bad = next((x for x in runs if x.get("status") not in ("ok", "skipped")), None)
        if bad is not None or not ran:
            out.append(dict(bad or runs[0]))
            continue
        r = dict(ran[0])
        r["round_step_s"] = [x["median_step_s"] for x in ran]
        r["round_peak_bytes"] = [x["peak_bytes"] for x in ran]
        r["median_step_s"] = statistics.median(r["round_step_s"])
        r["peak_bytes"] = int(statistics.median(r["round_peak_bytes"]))
        r["s_per_sample"] = r["median_step_s"] / r["batch"]
        r["tokens_per_s"] = r["tokens_per_s"] * ran[0]["median_step_s"] / r["median_step_s"]
        r["losses_equal_rounds"] = all(x.get("losses") == ran[0].get("losses") for x in ran)
        if all("paired_ratio" in x for x in ran):
            r["round_paired_ratio"] = [x["paired_ratio"] for x in ran]
            r["paired_ratio"] = statistics.median(r["round_paired_ratio"])
        out.append(r)
    return out


def repeats_of(args: argparse.Namespace) -> int:
    """``--repeats``, else 3 rounds for ``--quick`` (a newcomer's first numbers: one round of a
    small model drifts 1.5x between minutes) and 1 otherwise."""
    if args.repeats is not None:
        return args.repeats
    return 3 if getattr(args, "quick", False) else 1


def run_rounds(
    settings: list[Setting],
    w: Workload,
    desc: str,
    repeats: int,
    deadline: float | None = None,
    lockstep: bool = False,
) -> list[dict[str, Any]]:
    """``repeats`` interleaved rounds of every setting, combined by their medians. Every other
    round runs them in reverse: a machine that drifts within a round, or a setting that slows
    the next (its disk writes flushed after it), then favours no place in the order. Each
    round's shares of keep's peak are those of the first round's keep. ``lockstep``: each
    round's settings step in turn (lockstep.py)."""
    from .lockstep import run_lockstep  # here: it imports this module

    runner = run_lockstep if lockstep else run
    first = runner(settings, w, desc, deadline)
    rounds = [first]
    for k in range(1, repeats):
        order = settings[::-1] if k % 2 else settings
        got = runner(order, w, f"{desc} (round {k + 1} of {repeats})", deadline, first)
        rounds.append(got[::-1] if k % 2 else got)
    return combine(rounds)


def cmd_train(args: argparse.Namespace) -> int:
    """Keep, ssdtier, checkpoint and save_on_cpu on one model, side by side."""
    w = workload_of(args)
    results = run_rounds([Setting(m) for m in TRAIN_MODES], w, "bench train", repeats_of(args), None, args.lockstep)
    ratios(results, losses_compared(w))
    emit({"workload": asdict(w), "results": results}, render(results, w), args.json)
    ssd = [r for r in results if r["mode"] == Mode.SSDTIER.value]
    return 0 if all(r.get("losses_equal_keep") is not False and r["status"] == "ok" for r in ssd) else 1


if __name__ == "__main__":
    _worker()
