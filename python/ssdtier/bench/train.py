"""One model trained several ways side by side (keep, ssdtier, checkpoint, save_on_cpu),
each setting's peak activation memory and step time: the machinery ``bench train``
(train_cli.py) and ``bench rok`` run their modes with.

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

import contextlib
import difflib
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

from .._cli import CLI
from ..config import Config
from ..errors import ConfigError
from ..paths import check_paths
from ..sizes import format_size
from ._report import Progress, jsonable

__all__ = [
    "Mode",
    "Setting",
    "Workload",
    "check_hf",
    "is_oom",
    "measure_safely",
    "plan_counts",
    "plan_text",
    "run",
]

OUT_OF_TIME = "out of time (--budget-s)"  # a setting not started: its status "skipped"
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


def check_hf(name: str) -> None:
    """``--hf``'s model type, checked as a worker would meet it: transformers installed, and
    a causal or seq2seq LM of that type in it."""
    try:
        from transformers.models.auto import modeling_auto as auto
    except ImportError:
        raise ConfigError(f"{CLI}: --hf needs transformers: pip install 'ssdtier[hf]'") from None
    known = [*auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else " (llama, gpt2, t5...)"
        raise ConfigError(f"{CLI}: --hf {name!r}: not a transformers model type with a language-model head{hint}")


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
        "use_cache": False,  # in every mode, as checkpointing sets it: no cache for ssdtier's blocks to update
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
    try:
        said = []
        for line in proc.stderr:
            if line.startswith(_TAG):
                on_step()
            else:
                said.append(line)
        out = proc.stdout.read()
        return result_of(s, w, out, proc.wait(), said)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Ends a worker this process no longer reads (Ctrl-C, an error here), so that none trains
    on, orphaned: SIGTERM, then SIGKILL if it outlives ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


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
        raise Skipped(OUT_OF_TIME)
    reason = skip_reason(s, w)
    if reason is not None:
        raise Skipped(reason)
    return resolve(s, w, known)


def out_of_time(r: dict[str, Any]) -> bool:
    return r.get("status") == "skipped" and r.get("error") == OUT_OF_TIME


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
        line += f", {round(r['guard_recomputed'], 2):g} blocks a step recomputed past the plan"
    return line + (f", plan {plan_text(r['plan'])} (keep/offload/recompute)" if r.get("plan") else "")


def plan_text(plan: dict[str, int] | None) -> str:
    """A plan's blocks kept / offloaded / recomputed (and recomputed with their inputs offloaded)."""
    if not plan:
        return "-"
    text = f"{plan.get('keep', 0)}/{plan.get('offload', 0)}/{plan.get('recompute', 0)}"
    return text + (f" +{plan['recompute+offload']} r+o" if plan.get("recompute+offload") else "")


if __name__ == "__main__":
    _worker()
