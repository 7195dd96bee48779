"""The configuration an offloader runs with: the user's, made concrete for the model and the
machine, in one place (``attach``, ``ssdtier check`` and ``ssdtier info`` use it)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import ARENA_OFF_GPU, Config, NvmeConfig
from .errors import warn
from .ram import Available, available, pinnable
from .sizes import format_size


@dataclass(frozen=True)
class Machine:
    """What the effective configuration depends on."""

    gpu: bool  # the model is on a GPU (check and info: this machine has one)
    cpu_model: bool  # every parameter and buffer is on the CPU
    pinned: bool  # the arena would be pinned, for copies from a GPU
    memory: Callable[[], Available | None] = available  # memory left, read only if the arena is pinned
    ranks: tuple[int, str] = (1, "")  # training processes on this node, and what said so
    gpu_memory: int = 0  # bytes of the model's GPU (0: unknown or none)

    @classmethod
    def here(cls) -> Machine:
        """This machine, for a model on its GPU if it has one."""
        import torch

        gpu = torch.cuda.is_available()
        memory = torch.cuda.get_device_properties(0).total_memory if gpu else 0
        return cls(gpu=gpu, cpu_model=not gpu, pinned=gpu, ranks=local_ranks(), gpu_memory=memory)


# host.capacity "auto" on a GPU: this share of its memory. An H200's link moves ~25 GiB out of
# a 1.3B GPT's forward at batch 50, a fifth of the GPU (docs/planner.md has what more buys).
GPU_ARENA_SHARE = 1 / 4

# torchrun and accelerate; DeepSpeed's launcher; Open MPI
RANK_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def local_ranks() -> tuple[int, str]:
    """The training processes on this node, as the launcher says, and the variable that said it."""
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) >= 1:
            return int(value), name
    return 1, ""


@dataclass(frozen=True)
class Choice:
    """A value the effective configuration has that the user's did not say, and why."""

    key: str
    value: Any
    why: str

    def __str__(self) -> str:
        value = format_size(self.value) if self.key.endswith("capacity") else repr(self.value)
        return f"{self.key} = {value}: {self.why}"


@dataclass(frozen=True)
class Effective:
    config: Config
    choices: tuple[Choice, ...]


def effective(config: Config, machine: Machine) -> Effective:
    """``config`` for ``machine``: ``policy.mode = "auto"`` resolved, fixed buffers off for a
    CPU model's zero-copy writes, ``host.capacity`` made bytes (``"auto"``: a quarter of the
    GPU), the arena cut to what can be pinned (with a warning if the user sized it)."""
    choices: list[Choice] = []
    was, pol = config.policy, config.policy.resolved(machine.gpu)
    if pol.mode != was.mode:
        where = (
            "on a GPU: per block keep, offload or recompute, the fastest mix within what the GPU has room for"
            if machine.gpu
            else "on the CPU with a device_budget: per block keep, offload or recompute within it"
            if pol.mode == "adaptive"
            else "on the CPU: every block is offloaded (a device_budget would plan per block)"
        )
        choices.append(Choice("policy.mode", pol.mode, f"'auto' {where}"))
    if pol.device_budget != was.device_budget:
        choices.append(Choice("policy.device_budget", pol.device_budget, "what the GPU has room for, before each step"))
    # Not config.replace (here and below): errors and warnings name the user's config.
    config = dataclasses.replace(config, policy=pol)
    if config.io.zero_copy and config.io.fixed_buffers and machine.cpu_model:
        config = dataclasses.replace(config, io=dataclasses.replace(config.io, fixed_buffers=False))
        choices.append(
            Choice(
                "io.fixed_buffers",
                False,
                "a CPU model's activations go to NVMe from their own pages; registered, the arena would be all pinned",
            )
        )
    ranks, said = (config.io.local_ranks, "") if config.io.local_ranks != "auto" else machine.ranks
    if config.io.local_ranks == "auto":
        config = dataclasses.replace(config, io=dataclasses.replace(config.io, local_ranks=ranks))
        if ranks > 1:
            choices.append(Choice("io.local_ranks", ranks, f"{said}: ranks on this node share its memory and disks"))
    share = f", a {ranks}th of it for each of {ranks} ranks on this node" if ranks > 1 else ""
    offloads = pol.mode != "none" or pol.device_budget is not None
    pinned = machine.pinned and offloads
    if config.host.capacity == "auto":
        cap, why = ARENA_OFF_GPU, ""
        if pinned and machine.gpu_memory:
            cap, why = int(machine.gpu_memory * GPU_ARENA_SHARE) >> 20 << 20, "a quarter of the GPU's memory"
        avail = machine.memory() if pinned else None
        if avail is not None and arena_share(avail.bytes, ranks) < cap:
            cap, why = arena_share(avail.bytes, ranks), f"what can be pinned here, safely{share}"
        config = dataclasses.replace(config, host=config.host.sized(cap))
        if why:
            choices.append(Choice("host.capacity", cap, f"'auto' on a GPU: {why}"))
    elif pinned:
        fitted = fit_arena(config, machine.memory(), ranks)
        if fitted.host.capacity != config.host.capacity:
            choices.append(Choice("host.capacity", fitted.host.capacity, f"what can be pinned here, safely{share}"))
        config = fitted
    if ranks > 1 and offloads and not config.nvme:
        from .paths import default_nvme_dir
        from .store import default_capacity

        path = default_nvme_dir()
        cap = default_capacity(path, ranks)
        config = dataclasses.replace(config, nvme=(NvmeConfig(path=path, capacity=cap),))
        choices.append(Choice("nvme[0].capacity", cap, f"90% of the free space, at most 64GiB{share}"))
    return Effective(config, tuple(choices))


def arena_share(left: int, ranks: int = 1) -> int:
    """Bytes of pinned arena one of ``ranks`` processes may take of ``left`` (whole MiB)."""
    return pinnable(left) // ranks >> 20 << 20


def fit_arena(config: Config, avail: Available | None, ranks: int = 1) -> Config:
    """``config`` with ``host.capacity`` cut to what can be pinned safely, shared by ``ranks``
    processes. Pinning faults in and locks every page: an arena past the memory left brings
    the OOM killer, not an error."""
    cap = config.host.capacity
    if avail is None:
        return config
    safe = arena_share(avail.bytes, ranks)
    if cap <= safe:
        return config
    instead = f"the arena takes {format_size(safe)}" if safe else "no host arena: activations go straight to NVMe"
    each = f", and {ranks} ranks on this node share it" if ranks > 1 else ""
    warn(
        f"{config.source}: host.capacity = {format_size(cap)} is more than can be pinned here: "
        f"{format_size(avail.bytes)} of memory is left ({avail.bound}){each}; {instead}, leaving a quarter "
        "of it (at least 2GiB) to the rest of the machine"
    )
    return dataclasses.replace(config, host=dataclasses.replace(config.host, capacity=safe))
