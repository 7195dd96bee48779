"""The effective configuration: the user's made concrete for a model and a machine, once."""

from __future__ import annotations

import pytest
import tomllib
import torch

import ssdtier
from ssdtier.config import Config
from ssdtier.effective import Machine, arena_share, effective
from ssdtier.errors import SsdtierWarning
from ssdtier.ram import Available
from ssdtier.sizes import GiB

from .conftest import store_config

GPU = Machine(gpu=True, cpu_model=False, pinned=True, memory=lambda: Available(3 * GiB, "MemAvailable"))
CPU = Machine(gpu=False, cpu_model=True, pinned=False, memory=lambda: None)


def test_auto_on_a_gpu_plans_within_the_room_the_gpu_has():
    with pytest.warns(SsdtierWarning, match="t.toml: host.capacity = 2GiB is more than can be pinned"):
        eff = effective(Config.from_dict({"host": {"capacity": "2GiB"}}, source="t.toml"), GPU)
    pol = eff.config.policy
    assert (pol.mode, pol.device_budget) == ("adaptive", "auto")
    said = {c.key: c for c in eff.choices}
    assert said["policy.mode"].why.startswith("'auto' on a GPU")
    assert said["host.capacity"].value == eff.config.host.capacity == GiB  # 3 GiB left, 2 stay with the machine
    assert eff.config.io.fixed_buffers and eff.config.source == "t.toml"


def test_auto_on_the_cpu_offloads_every_block_or_plans_within_a_budget():
    eff = effective(Config(), CPU)
    assert eff.config.policy.mode == "all" and not eff.config.io.fixed_buffers
    assert [c.key for c in eff.choices] == ["policy.mode", "io.fixed_buffers"]
    budget = effective(Config.from_dict({"policy": {"device_budget": "1GiB"}}), CPU)
    assert budget.config.policy.mode == "adaptive" and budget.config.policy.device_budget == GiB


def test_what_the_user_said_is_kept_and_nothing_is_chosen():
    cfg = Config.from_dict(
        {"policy": {"mode": "all"}, "io": {"fixed_buffers": False, "local_ranks": 1}, "host": {"capacity": "1GiB"}}
    )
    eff = effective(cfg, GPU)
    assert eff.config == cfg and eff.choices == ()
    # Nothing offloaded: nothing pinned, the memory not even read.
    none = Machine(gpu=True, cpu_model=False, pinned=True, memory=lambda: 1 / 0)
    assert effective(Config.from_dict({"policy": {"mode": "none"}, "host": {"capacity": "64GiB"}}), none).choices == ()


def test_stats_say_what_attach_chose(store_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with ssdtier.attach(model, store_config(store_dir, host="64MiB")) as off:
        chosen = off.stats().chosen
        assert off.config.policy.mode == "all"
        assert any(c.startswith("policy.mode = 'all': 'auto' on the CPU") for c in chosen), chosen
        assert "chosen: policy.mode = 'all'" in str(off.stats())


def test_ranks_on_one_node_share_the_arena_and_the_disk(monkeypatch):
    import collections
    import shutil

    from ssdtier.effective import local_ranks
    from ssdtier.ram import pinnable
    from ssdtier.store import default_capacity

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_ranks() == (4, "LOCAL_WORLD_SIZE")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(200 * GiB, 100 * GiB, 100 * GiB))
    memory = Available(34 * GiB, "MemAvailable")
    four = Machine(gpu=True, cpu_model=False, pinned=True, memory=lambda: memory, ranks=local_ranks())
    with pytest.warns(SsdtierWarning, match="4 ranks on this node share it"):
        eff = effective(Config.from_dict({"host": {"capacity": "16GiB"}}), four)
    assert eff.config.io.local_ranks == 4
    assert eff.config.host.capacity == pinnable(34 * GiB) // 4 >> 20 << 20  # the four arenas fit together
    said = {c.key: str(c) for c in eff.choices}
    assert "LOCAL_WORLD_SIZE: ranks on this node share" in said["io.local_ranks"]
    assert "a 4th of it for each of 4 ranks" in said["host.capacity"]
    (nvme,) = eff.config.nvme
    assert nvme.capacity == default_capacity(nvme.path, 4) == 16 * GiB  # 90% of 100 GiB, at most 64, over 4
    assert "a 4th of it for each of 4 ranks" in said["nvme[0].capacity"]
    # Said in the config, it wins over the launcher's variable; a directory given is the user's.
    mine = Config.from_dict({"io": {"local_ranks": 1}, "nvme": [{"path": "/tmp/x", "capacity": "1GiB"}]})
    one = effective(mine, four)
    assert one.config.io.local_ranks == 1 and one.config.nvme == mine.nvme
    assert [c.key for c in one.choices] == ["policy.mode", "policy.device_budget"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert local_ranks() == (1, "")


def test_the_plan_takes_a_ranks_share_of_the_store_bandwidth(store_dir, monkeypatch):
    from ssdtier.offload.adaptive import Adaptive

    monkeypatch.setattr(Adaptive, "calibrate", lambda self: (1e9, 2e9))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cfg = store_config(store_dir, host="64MiB")
    cfg["policy"] = {"mode": "adaptive"}
    cfg["io"]["local_ranks"] = 4
    with ssdtier.attach(model, cfg) as off:
        assert off.adaptive.bw == (0.25e9, 0.5e9)
        assert "io.local_ranks" not in " ".join(off.stats().chosen)  # said in the config: no choice


def test_an_auto_arena_on_a_gpu_is_a_quarter_of_it_cut_to_what_can_be_pinned(recwarn):
    def gpu(left: int, ranks: int = 1) -> Machine:
        memory = Available(left, "MemAvailable")
        return Machine(True, False, True, lambda: memory, ranks=(ranks, "LOCAL_WORLD_SIZE"), gpu_memory=80 * GiB)

    eff = effective(Config(), gpu(500 * GiB))
    assert eff.config.host.capacity == 20 * GiB
    said = {c.key: str(c) for c in eff.choices}
    assert said["host.capacity"] == "host.capacity = 20GiB: 'auto' on a GPU: a quarter of the GPU's memory"
    cut = effective(Config(), gpu(10 * GiB))  # 7.5 GiB can be pinned
    assert cut.config.host.capacity == arena_share(10 * GiB) < 20 * GiB
    assert "what can be pinned here, safely" in {c.key: c.why for c in cut.choices}["host.capacity"]
    four = effective(Config(), gpu(100 * GiB, 4))
    assert four.config.host.capacity == arena_share(100 * GiB, 4) < 20 * GiB
    assert not [w for w in recwarn if issubclass(w.category, SsdtierWarning)]  # "auto" is cut without a warning
    # The CPU, a GPU of unknown size, or nothing offloaded: 1 GiB, the memory read only if pinned.
    assert effective(Config(), CPU).config.host.capacity == GiB
    unknown = Machine(True, False, True, lambda: Available(500 * GiB, "MemAvailable"))
    assert effective(Config(), unknown).config.host.capacity == GiB
    none = Machine(True, False, True, lambda: 1 / 0, gpu_memory=80 * GiB)
    off = effective(Config.from_dict({"policy": {"mode": "none"}}), none)
    assert off.config.host.capacity == GiB and off.choices == ()
    # The effective configuration is loadable again, with the bytes chosen.
    assert 'capacity = "auto"' in Config().to_toml()
    assert Config.from_dict(tomllib.loads(eff.config.to_toml())).host.capacity == 20 * GiB
