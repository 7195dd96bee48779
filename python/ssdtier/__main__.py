"""The ssdtier command line (also ``python -m ssdtier``)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings

from . import __version__
from ._cli import CLI, Help, positive
from .config import Config
from .errors import ConfigError, SsdtierError, SsdtierWarning
from .mounts import existing, where
from .paths import check_paths, default_nvme_dir, is_tmpfs, space_problems
from .ram import available
from .sizes import format_size

DESCRIPTION = """\
Offload PyTorch training activations to pinned host memory and NVMe SSDs.
In a training script: `with ssdtier.attach(model): ...`. This command checks
configs, tells what a machine supports, and shows ssdtier at work."""


def _store(args: argparse.Namespace, host: int):
    from .store import TieredStore

    cfg: dict = {"host": {"capacity": host}}
    if args.dir:
        # Opened only to see what the directory supports, never written: small, so no note on free space.
        cfg["nvme"] = [{"path": args.dir, "capacity": "1MiB"}]
    return TieredStore(Config.from_dict(cfg, source=CLI))


def _path_problems(name: str) -> list[str]:
    """Each [[nvme]] path of a file whose values did not load, checked alone: with the value
    problems, every problem is said at once."""
    from .config import _relative_to, _toml_module

    try:
        with open(name, "rb") as f:
            data = _toml_module(name).loads(f.read().decode("utf-8"))
    except Exception:
        return []  # unreadable or not TOML: load_config said so
    nvme = data.get("nvme")
    tables = [t for t in (nvme if isinstance(nvme, list) else []) if isinstance(t, dict)]
    _relative_to(tables, os.path.dirname(os.path.abspath(name)))
    io = data.get("io") if isinstance(data.get("io"), dict) else {}
    direct = io.get("direct") if isinstance(io.get("direct"), bool) else True
    out = []
    for i, t in enumerate(tables):
        if not isinstance(t.get("path"), str) or not t["path"]:
            continue
        try:
            one = Config.from_dict({"nvme": [{"path": t["path"]}], "io": {"direct": direct}}, source=name)
            check_paths(one)
        except ConfigError as e:
            out.append(str(e).replace("nvme[0]", f"nvme[{i}]", 1))
    return out


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a config file and print the effective config, defaults filled in."""
    from .config import load_config

    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        more = _path_problems(args.file)
        if more:
            raise ConfigError("\n".join([str(e), *more])) from None
        raise
    paths = check_paths(cfg)
    space = space_problems(cfg, paths) if cfg.nvme else []
    if any(fatal for _, fatal in space):
        raise ConfigError("\n".join(msg for msg, _ in space))
    for msg, _ in space:
        print(f"# warning: {msg}")
    from .effective import Machine, effective

    machine = Machine.here()
    eff = effective(cfg, machine)
    model = "a model on this machine's GPU" if machine.gpu else "a model on the CPU (no GPU here)"
    print(f"# {args.file}: valid. Effective configuration for {model}, defaults filled in:")
    for c in eff.choices:
        print(f"# chosen: {c}")
    if not cfg.nvme:
        print(f"# no [[nvme]] table: the default directory {paths[0]} is used")
    print(eff.config.to_toml(), end="")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """Tell what this machine supports for the directory."""
    path = os.path.abspath(args.dir or default_nvme_dir())
    print(f"ssdtier {__version__}")
    print(f"directory       {path}{'  (tmpfs: no O_DIRECT)' if is_tmpfs(path) else ''}")
    probe = existing(path)  # a store would create the directory: not for a look
    if probe != path and not os.path.isdir(probe):
        print(f"                cannot be created: a parent, {probe}, is a file")
        return 1
    if probe != path:
        print(f"                does not exist: checked in {probe}, where it would be created")
    w = where(probe)
    print(f"file system     {w.describe()}")
    if w.free is not None and w.total:
        print(f"free            {format_size(w.free)} of {format_size(w.total)}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            store = _store(argparse.Namespace(dir=probe), 16 << 20)
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

    on_gpu = torch.cuda.is_available()
    print(f"torch           {torch.__version__}")
    print(f"CUDA            {'yes: ' + torch.cuda.get_device_name(0) if on_gpu else 'no'}")
    if on_gpu:
        from .offload.adaptive import copy_bandwidth

        try:
            rate = f"{copy_bandwidth(torch.device('cuda', 0)) / 1e9:.1f} GB/s"
        except Exception as e:  # report, don't crash
            rate = f"not measured ({type(e).__name__}: {e})"
        # Activations made faster than this cannot all leave the GPU without it waiting.
        print(f"GPU link        {rate} to and from pinned host memory (the slower way)")
    from .effective import arena_share, local_ranks

    ranks, said = local_ranks()
    mem = available()
    if mem is not None:
        most = format_size(arena_share(mem.bytes, ranks))
        each = f", each of {ranks} ranks on this node ({said})" if ranks > 1 else ""
        print(f"memory left     {format_size(mem.bytes)} ({mem.bound}); a GPU's host arena can take {most} of it{each}")
    try:
        import cuda.bindings  # noqa: F401

        print("cuda-python     yes")
    except ImportError:
        print("cuda-python     no")
    from .gds import GdsState
    from .gds import probe as probe_gds

    gds = probe_gds(where=probe)  # without CUDA: at once, no child process
    print(f"GPUDirect Storage: {gds}")
    path_of = {
        GdsState.USABLE: 'through cuFile (io.backend "auto" or "cufile")',
        GdsState.COMPAT: 'through the host arena; through cuFile\'s compatibility mode with io.backend "cufile"',
        GdsState.UNAVAILABLE: "through the host arena",
    }
    print(f"CUDA activations go {path_of[gds.state]}")
    from .config import Config
    from .effective import Machine, effective

    eff = effective(Config(), Machine.here())
    mode = next(c for c in eff.choices if c.key == "policy.mode")
    print(f"default policy  {mode.value}: {mode.why}")
    arena = next((c for c in eff.choices if c.key == "host.capacity"), None)
    why = arena.why if arena else "'auto' off a GPU"
    print(f"default arena   {format_size(eff.config.host.capacity)}: {why}")
    return 0


def _saved_bytes(step, model) -> int:
    """Bytes of distinct storages autograd saves in one step (all held at once, until the
    backward), parameters and views of them (``weight.t()``) excluded, as ssdtier counts."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(count_only=True)
    return sum(seen.values())


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a small GPT for a few steps with and without ssdtier; compare memory and step time."""
    import statistics

    import torch

    from .bench.models import GPTConfig, batch_loss, build_model, make_batch
    from .offload import attach

    if args.d_model % 8:
        raise ConfigError(f"{CLI}: --d-model must be a multiple of 8 (the attention heads), got {args.d_model}")
    store: dict = {"host": {"capacity": args.arena}, "policy": {"min_tensor_bytes": "64KiB"}}
    if args.dir:
        store["nvme"] = [{"path": args.dir, "capacity": "64GiB"}]
    store_cfg = Config.from_dict(store, source=CLI)
    check_paths(store_cfg)  # before the baseline run, not after it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(vocab_size=1024, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=8)
    batch = make_batch(cfg, args.batch, torch.Generator().manual_seed(0), device=device)

    def run(offload: bool) -> tuple[list[float], int, float, object]:
        torch.manual_seed(0)
        model = build_model(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        off = attach(model, store_cfg) if offload else None
        times, loss0 = [], 0.0

        def step(count_only: bool = False) -> float:
            loss = batch_loss(model, batch)
            loss.backward()
            if not count_only:
                opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for i in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            t0 = time.perf_counter()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            loss0 = loss0 or loss
            print(
                f"  {'ssdtier' if offload else 'keep   '} step {i + 1}/{args.steps}: loss {loss:.4f}, "
                f"{times[-1]:.3f} s",
                file=sys.stderr,
            )
        if device.type == "cuda":
            mem = torch.cuda.max_memory_allocated() - base
        elif off is not None:
            mem = off.stats().peak_resident_bytes
        else:
            mem = _saved_bytes(step, model)
        stats = off.stats() if off is not None else None
        if off is not None:
            off.detach()
        return times, mem, loss0, stats

    print(
        f"ssdtier demo: GPT with {args.layers} layers, d_model {args.d_model}, seq {args.seq}, "
        f"batch {args.batch}, on {device.type}",
        file=sys.stderr,
    )
    t_keep, m_keep, l_keep, _ = run(False)
    t_ssd, m_ssd, l_ssd, st = run(True)
    # The first step warms up (allocator, caches): left out when there are others.
    med_keep = statistics.median(t_keep[1:] or t_keep)
    med_ssd = statistics.median(t_ssd[1:] or t_ssd)
    what = "peak GPU memory of the step" if device.type == "cuda" else "activation bytes held in memory"
    print(
        f"{what:36s} keep {format_size(m_keep):>9s}   ssdtier {format_size(m_ssd):>9s}   "
        f"ratio {m_ssd / max(m_keep, 1):.2f}"
    )
    print(f"{'median step time':36s} keep {med_keep:8.3f}s   ssdtier {med_ssd:8.3f}s   ratio {med_ssd / med_keep:.2f}")
    assert st is not None
    print(
        f"offloaded {format_size(st.bytes_offloaded)} in {st.tensors_offloaded} tensors; "
        f"NVMe wrote {format_size(st.bytes_written_nvme)}, read {format_size(st.bytes_read_nvme)}; "
        f"stalled {st.stall_seconds:.3f} s"
    )
    same = l_keep == l_ssd
    print(f"first-step loss identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _show_warning(show, message, category, filename, lineno, file=None, line=None) -> None:
    # ssdtier's own warnings as the command's lines, not Python's (they would name runpy).
    if issubclass(category, SsdtierWarning):
        text = str(message).removeprefix("ssdtier: ")
        print(f"ssdtier: warning: {text}", file=file or sys.stderr)
    else:
        show(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    fmt = Help
    parser = argparse.ArgumentParser(prog="ssdtier", description=DESCRIPTION, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"ssdtier {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    default_dir = "SSDTIER_DIR, else ~/.cache/ssdtier"

    def command(name: str, func, help: str):
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=fmt)
        p.set_defaults(func=func)
        return p

    p = command("check", cmd_check, "validate a TOML config file and print the effective config")
    p.add_argument("file", help="the TOML file")
    p = command("info", cmd_info, "what this machine supports in a directory: io_uring, O_DIRECT, CUDA, GDS")
    p.add_argument("dir", nargs="?", help=f"the directory (default: {default_dir}); not created")
    p = command("demo", cmd_demo, "train a small GPT with and without ssdtier; compare memory and step time")
    p.add_argument("--dir", help=f"NVMe directory (default: {default_dir})")
    p.add_argument("--steps", type=positive, default=5, help="training steps of each run")
    p.add_argument("--layers", type=positive, default=6, help="GPT blocks")
    p.add_argument("--d-model", type=positive, default=256, help="model width (a multiple of 8)")
    p.add_argument("--seq", type=positive, default=256, help="sequence length")
    p.add_argument("--batch", type=positive, default=8, help="batch size")
    p.add_argument("--arena", default="64MiB", help="host arena (host.capacity)")
    from .bench import add_parser

    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = functools.partial(_show_warning, warnings.showwarning)
            rc = args.func(args)
        sys.stdout.flush()  # a closed pipe (`| head`) shows here, not at exit
        return rc
    except KeyboardInterrupt:
        # Ctrl-C: the user knows; no traceback (the bench workers are stopped where they run).
        print("ssdtier: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader is gone: nothing more to say, and nothing to say it with.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (SsdtierError, OSError) as e:
        print(f"ssdtier: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
