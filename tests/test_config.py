"""Tests of ssdtier.config: sizes, dataclasses, TOML loading and overrides."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: ssdtier depends on tomli there
    import tomli as tomllib

from ssdtier.config import (
    Config,
    HostConfig,
    IoConfig,
    NvmeConfig,
    PolicyConfig,
    load_config,
    resolve_config,
)
from ssdtier.errors import ConfigError, SsdtierWarning
from ssdtier.mounts import mount_of
from ssdtier.paths import RAMFS_MAGIC, TMPFS_MAGIC, check_paths, default_nvme_dir, is_tmpfs
from ssdtier.sizes import GiB, KiB, MiB, TiB, format_size, parse_size

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------
# parse_size / format_size
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("0", 0),
        ("4096", 4096),
        ("100B", 100),
        ("100 b", 100),
        ("512KiB", 512 * KiB),
        ("64MiB", 64 * MiB),
        ("64 MiB", 64 * MiB),
        ("64mib", 64 * MiB),
        ("8GiB", 8 * GiB),
        ("8GIB", 8 * GiB),
        ("1TiB", TiB),
        ("1.5GiB", 3 * GiB // 2),
        (".5KiB", 512),
        ("10GB", 10 * 10**9),
        ("1KB", 1000),
        ("2mb", 2 * 10**6),
        ("3TB", 3 * 10**12),
        ("  7 KiB  ", 7 * KiB),
        ("1.1GiB", 1181116006),  # fractions of a unit round down to bytes
        (1024.0, 1024),
    ],
)
def test_parse_size_valid(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (-1, "-1"),
        (True, "True of type bool"),
        (False, "False of type bool"),
        (1.5, "1.5"),
        (-2.0, "-2.0"),
        (float("inf"), "inf"),
        (float("nan"), "nan"),
        (None, "None of type NoneType"),
        ([1], r"\[1\] of type list"),
        ("", "''"),
        ("abc", "'abc'"),
        ("GiB", "'GiB'"),
        ("-5MiB", "'-5MiB'"),
        ("1.5", r"'1\.5' \(not a whole number of bytes\)"),
        ("1.5B", r"'1\.5B' \(not a whole number of bytes\)"),
        ("8 gigabytes", "'8 gigabytes'"),
        ("8G", "'8G'"),
        ("1e9", "'1e9'"),
        ("1,024", "'1,024'"),
        ("0x10", "'0x10'"),
        ("5 5MiB", "'5 5MiB'"),
    ],
)
def test_parse_size_invalid(value, shown):
    pattern = rf"^my\.toml: host\.capacity: expected a non-negative size: .*got {shown}$"
    with pytest.raises(ConfigError, match=pattern):
        parse_size(value, key="host.capacity", source="my.toml")


def test_parse_size_error_defaults_and_allowed_units():
    with pytest.raises(ConfigError) as info:
        parse_size("lots")
    msg = str(info.value)
    assert msg.startswith("<value>: size: expected a non-negative size")
    for unit in ("KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"):
        assert unit in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (1, "1B"),
        (100, "100B"),
        (1023, "1023B"),
        (1024, "1KiB"),
        (1536, "1.5KiB"),
        (1025, "1.0KiB"),
        (1048575, "1.0MiB"),
        (MiB, "1MiB"),
        (1536 * KiB, "1.5MiB"),
        (1073741824, "1GiB"),
        (64 * GiB, "64GiB"),
        (TiB, "1TiB"),
        (3 * TiB, "3TiB"),
        (10**9, "953.7MiB"),
    ],
)
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_size_rejects_bad_input():
    with pytest.raises(TypeError):
        format_size(True)
    with pytest.raises(TypeError):
        format_size(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        format_size(-1)


@given(
    st.integers(min_value=0, max_value=2**60)
    | st.builds(
        lambda k, unit: k * unit,
        st.integers(min_value=0, max_value=2**20),
        st.sampled_from([1, KiB, MiB, GiB, TiB]),
    )
)
def test_format_size_round_trip(n):
    text = format_size(n)
    back = parse_size(text)
    if "." in text:  # one decimal: close, not exact
        assert abs(back - n) <= 0.05 * n
    else:
        assert back == n


# ---------------------------------------------------------------------------
# Dataclasses
# ---------------------------------------------------------------------------


def test_mode_auto_is_adaptive_on_a_gpu_or_with_a_budget_else_all():
    auto = PolicyConfig()
    assert (auto.resolved(on_gpu=True).mode, auto.resolved(on_gpu=True).device_budget) == ("adaptive", "auto")
    assert (auto.resolved(on_gpu=False).mode, auto.resolved(on_gpu=False).device_budget) == ("all", None)
    sized = PolicyConfig(device_budget=20 << 30)
    assert (sized.resolved(on_gpu=True).mode, sized.resolved(on_gpu=True).device_budget) == ("adaptive", 20 << 30)
    assert sized.resolved(on_gpu=False).mode == "adaptive"  # a budget asks for the planner, on the CPU too
    # Asked for by its budget: adaptive on the CPU too (where it warns that there is no GPU).
    assert PolicyConfig(device_budget="auto").resolved(on_gpu=False).mode == "adaptive"
    for mode in ("all", "adaptive", "none"):
        assert PolicyConfig(mode=mode).resolved(on_gpu=True) == PolicyConfig(mode=mode)


def test_defaults():
    cfg = Config()
    assert cfg.host == HostConfig(capacity="auto")
    assert cfg.host.sized() == HostConfig(capacity=GiB) and HostConfig(capacity=0).sized(5) == HostConfig(capacity=0)
    assert cfg.nvme == ()
    assert cfg.io == IoConfig(
        backend="auto",
        queue_depth=64,
        block_size=MiB,
        direct=True,
        fixed_buffers=True,
        zero_copy=True,
        threads=4,
    )
    assert cfg.policy == PolicyConfig(
        min_tensor_bytes=MiB,
        keep_last_layers="auto",
        prefetch_layers="auto",
        eviction="lifetime",
        dedup=True,
        layers=None,
        mode="auto",
        device_budget=None,
    )
    assert cfg.source == "<defaults>"
    assert NvmeConfig("/x").capacity == 64 * GiB
    assert Config.from_dict({}) == cfg


def test_dataclasses_are_frozen_and_hashable():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.host = HostConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.io.queue_depth = 1  # type: ignore[misc]
    assert hash(cfg) == hash(Config())


def test_direct_construction_normalises_and_validates(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    assert HostConfig(capacity="8GiB").capacity == 8 * GiB
    assert HostConfig(capacity=0).capacity == 0
    assert HostConfig(capacity="1TiB").capacity == TiB
    assert NvmeConfig("~/spill").path == "/home/someone/spill"
    assert NvmeConfig(Path("/mnt/a"), "1GiB") == NvmeConfig("/mnt/a", GiB)
    assert IoConfig(block_size="4KiB").block_size == 4 * KiB
    assert PolicyConfig(device_budget="20GiB").device_budget == 20 * GiB
    assert PolicyConfig(mode="adaptive", device_budget="auto").device_budget == "auto"
    assert PolicyConfig(keep_last_layers=0).keep_last_layers == 0
    assert PolicyConfig(layers="model.layers").layers == "model.layers"
    assert PolicyConfig(layers="0.blocks").layers == "0.blocks"
    cfg = Config(nvme=[NvmeConfig("/a"), NvmeConfig("/b")])
    assert cfg.nvme == (NvmeConfig("/a"), NvmeConfig("/b"))
    with pytest.raises(ConfigError, match=r"^host\.capacity: expected a non-negative size.*got -1$"):
        HostConfig(capacity=-1)
    with pytest.raises(ConfigError, match=r"^host\.capacity: expected 'auto' or a size such as '8GiB', got 'atuo'$"):
        HostConfig(capacity="atuo")
    with pytest.raises(ConfigError, match=r"^io\.threads: expected an integer in 1\.\.64"):
        IoConfig(threads=0)
    with pytest.raises(ConfigError, match=r"^nvme\.capacity: expected a size >= 1B, got 0$"):
        NvmeConfig("/x", 0)
    with pytest.raises(ConfigError, match=r"^host: expected a HostConfig, got \{\}"):
        Config(host={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^nvme\[0\]: expected an NvmeConfig, got '/x'"):
        Config(nvme=("/x",))  # type: ignore[arg-type]


def test_source_is_not_compared():
    assert Config(source="a.toml") == Config(source="b.toml")


# ---------------------------------------------------------------------------
# from_dict / load_config
# ---------------------------------------------------------------------------

FULL = {
    "host": {"capacity": "8GiB", "huge_pages": True},
    "nvme": [
        {"path": "/mnt/nvme0/ssdtier", "capacity": "256GiB"},
        {"path": "/mnt/nvme1/ssdtier", "capacity": 100 * 10**9},
    ],
    "io": {
        "backend": "io_uring",
        "queue_depth": 128,
        "block_size": "2MiB",
        "direct": False,
        "fixed_buffers": False,
        "zero_copy": False,
        "threads": 8,
    },
    "policy": {
        "min_tensor_bytes": "64KiB",
        "keep_last_layers": 1,
        "prefetch_layers": 3,
        "eviction": "lru",
        "dedup": False,
        "layers": "model.layers",
        "mode": "adaptive",
        "device_budget": "20GiB",
    },
}

FULL_TOML = """\
[host]
capacity = "8GiB"
huge_pages = true

[[nvme]]
path = "/mnt/nvme0/ssdtier"
capacity = "256GiB"

[[nvme]]
path = "/mnt/nvme1/ssdtier"
capacity = 100_000_000_000

[io]
backend = "io_uring"
queue_depth = 128
block_size = "2MiB"
direct = false
fixed_buffers = false
threads = 8
zero_copy = false

[policy]
min_tensor_bytes = "64KiB"
keep_last_layers = 1
prefetch_layers = 3
eviction = "lru"
dedup = false
layers = "model.layers"
mode = "adaptive"
device_budget = "20GiB"
"""

FULL_CONFIG = Config(
    host=HostConfig(8 * GiB, huge_pages=True),
    nvme=(
        NvmeConfig("/mnt/nvme0/ssdtier", 256 * GiB),
        NvmeConfig("/mnt/nvme1/ssdtier", 100 * 10**9),
    ),
    io=IoConfig("io_uring", 128, 2 * MiB, False, False, 8, None, False),
    policy=PolicyConfig(64 * KiB, 1, 3, "lru", False, "model.layers", "adaptive", 20 * GiB),
)


def test_from_dict_full():
    cfg = Config.from_dict(FULL, source="full")
    assert cfg == FULL_CONFIG
    assert cfg.source == "full"
    assert Config.from_dict(FULL).source == "<dict>"


def test_from_dict_single_nvme_table_and_partial_tables():
    cfg = Config.from_dict({"nvme": {"path": "/n"}, "io": {"threads": 2}})
    assert cfg.nvme == (NvmeConfig("/n"),)
    assert cfg.io == IoConfig(threads=2)
    assert cfg.host == HostConfig()


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ConfigError, match=r"^<dict>: <config>: expected a mapping"):
        Config.from_dict([("host", {})])  # type: ignore[arg-type]


def test_load_config(tmp_path):
    path = tmp_path / "ssdtier.toml"
    path.write_text(FULL_TOML)
    cfg = load_config(path)
    assert cfg == FULL_CONFIG
    assert cfg.source == str(path)
    assert load_config(str(path)) == FULL_CONFIG


def test_a_throttle_without_a_unit_under_1_mib_is_called_out(tmp_path):
    path = tmp_path / "slow.toml"
    path.write_text("[io]\nthrottle = 200\n")
    with pytest.warns(SsdtierWarning, match=r'io.throttle = 200 caps the disk at 200 bytes per second; write "200MB"'):
        assert load_config(path).io.throttle == 200
    with pytest.warns(SsdtierWarning, match=r"<overrides>: io.throttle = 300 caps"):
        assert Config().replace(io__throttle=300).io.throttle == 300
    path.write_text('[io]\nthrottle = "20KB"\n')  # a unit says what is meant
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(path).replace(policy__dedup=False).io.throttle == 20_000  # 20000 checked once


def test_load_config_empty_file_is_defaults(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("# nothing\n")
    assert load_config(path) == Config()


BAD_FILES = [
    # (id, TOML text, regex after "<path>: ")
    (
        "unknown-key",
        "[io]\nqueue_dept = 8\n",
        (
            r"io\.queue_dept: unknown key; did you mean 'queue_depth'\? "
            r"Allowed keys in \[io\]: backend, queue_depth, block_size"
        ),
    ),
    (
        "unknown-key-no-suggestion",
        "[host]\nzzz = 1\n",
        r"host\.zzz: unknown key\. Allowed keys in \[host\]: capacity, huge_pages$",
    ),
    (
        "unknown-table",
        '[polcy]\nmode = "all"\n',
        (
            r"unknown table \[polcy\]; did you mean 'policy'\? "
            r"Allowed tables: host, nvme, io, policy$"
        ),
    ),
    (
        "unknown-top-level-key",
        "queue_depth = 8\n",
        r"unknown top-level key 'queue_depth'; did you mean 'io\.queue_depth'",
    ),
    (
        "nested-table-in-table",
        "[io.extra]\nx = 1\n",
        (
            r"io\.extra: unknown key\. Allowed keys in \[io\]: backend, queue_depth, "
            r"block_size, direct, fixed_buffers, threads, throttle, zero_copy, preallocate, local_ranks$"
        ),
    ),
    (
        "table-not-a-table",
        "io = 5\n",
        r"io: expected a table, got 5 of type int$",
    ),
    (
        "bad-backend",
        '[io]\nbackend = "io-uring"\n',
        (
            r"io\.backend: expected one of 'auto', 'io_uring', 'posix', 'cufile', "
            r"got 'io-uring'; did you mean 'io_uring'\?$"
        ),
    ),
    (
        "bad-eviction",
        '[policy]\neviction = "random"\n',
        r"policy\.eviction: expected one of 'lifetime', 'lru', 'fifo', got 'random'$",
    ),
    (
        "bad-mode",
        '[policy]\nmode = "some"\n',
        r"policy\.mode: expected one of 'auto', 'all', 'adaptive', 'none', got 'some'$",
    ),
    (
        "block-size-not-power-of-two",
        '[io]\nblock_size = "3MiB"\n',
        (
            r"io\.block_size: expected a power-of-two size between 4KiB and 64MiB, "
            r"got '3MiB' \(3145728 bytes\)$"
        ),
    ),
    (
        "block-size-too-small",
        '[io]\nblock_size = "2KiB"\n',
        (
            r"io\.block_size: expected a power-of-two size between 4KiB and 64MiB, "
            r"got '2KiB' \(2048 bytes\)$"
        ),
    ),
    (
        "block-size-too-big",
        "[io]\nblock_size = 134217728\n",
        r"io\.block_size: expected a power-of-two size .*got 134217728$",
    ),
    (
        "negative-capacity",
        "[host]\ncapacity = -1\n",
        r"host\.capacity: expected a non-negative size.* got -1$",
    ),
    (
        "bad-size-string",
        '[host]\ncapacity = "12 parsecs"\n',
        r"host\.capacity: expected a non-negative size.* got '12 parsecs'$",
    ),
    (
        "host-capacity-too-big",
        '[host]\ncapacity = "2TiB"\n',
        (
            r"host\.capacity: expected a size between 0B and 1TiB, "
            r"got '2TiB' \(2199023255552 bytes\)$"
        ),
    ),
    (
        "capacity-bool",
        "[host]\ncapacity = true\n",
        r"host\.capacity: expected a non-negative size.* got True of type bool$",
    ),
    (
        "queue-depth-string",
        '[io]\nqueue_depth = "64"\n',
        r"io\.queue_depth: expected an integer in 1\.\.4096, got '64' of type str$",
    ),
    (
        "queue-depth-float",
        "[io]\nqueue_depth = 64.0\n",
        r"io\.queue_depth: expected an integer in 1\.\.4096, got 64\.0 of type float$",
    ),
    (
        "queue-depth-zero",
        "[io]\nqueue_depth = 0\n",
        r"io\.queue_depth: expected an integer in 1\.\.4096, got 0$",
    ),
    (
        "queue-depth-too-big",
        "[io]\nqueue_depth = 5000\n",
        r"io\.queue_depth: expected an integer in 1\.\.4096, got 5000$",
    ),
    (
        "threads-too-many",
        "[io]\nthreads = 65\n",
        r"io\.threads: expected an integer in 1\.\.64, got 65$",
    ),
    (
        "dedup-string",
        '[policy]\ndedup = "yes"\n',
        r"policy\.dedup: expected true or false \(a boolean\), got 'yes' of type str$",
    ),
    (
        "direct-int",
        "[io]\ndirect = 1\n",
        r"io\.direct: expected true or false \(a boolean\), got 1 of type int$",
    ),
    (
        "prefetch-negative",
        "[policy]\nprefetch_layers = -1\n",
        r"policy\.prefetch_layers: expected 'auto' or an integer in 0\.\.64, got -1$",
    ),
    (
        "keep-last-layers-bad",
        '[policy]\nkeep_last_layers = "all"\n',
        (
            r"policy\.keep_last_layers: expected 'auto' or an integer >= 0, "
            r"got 'all' of type str$"
        ),
    ),
    (
        "keep-last-layers-negative",
        "[policy]\nkeep_last_layers = -2\n",
        r"policy\.keep_last_layers: expected 'auto' or an integer >= 0, got -2$",
    ),
    (
        "layers-bad-path",
        '[policy]\nlayers = "model..layers"\n',
        r"policy\.layers: expected a dotted module path .*got 'model\.\.layers'$",
    ),
    (
        "device-budget-bad",
        '[policy]\ndevice_budget = "lots"\n',
        r"policy\.device_budget: expected 'auto' or a size such as '20GiB', got 'lots'$",
    ),
    (
        "device-budget-auto-not-adaptive",
        '[policy]\nmode = "all"\ndevice_budget = "auto"\n',
        r"policy\.device_budget: 'auto' sizes adaptive mode's plan from GPU memory; set policy\.mode = 'adaptive' "
        r"\(it is 'all'\) or give a size$",
    ),
    (
        "min-tensor-bytes-fraction",
        "[policy]\nmin_tensor_bytes = 1.5\n",
        r"policy\.min_tensor_bytes: expected a non-negative size.* got 1\.5$",
    ),
    (
        "nvme-without-path",
        '[[nvme]]\ncapacity = "1GiB"\n',
        r"nvme\[0\]: missing required key 'path'",
    ),
    (
        "nvme-empty-path",
        '[[nvme]]\npath = ""\n',
        r"nvme\[0\]\.path: expected a non-empty path string, got ''$",
    ),
    (
        "nvme-path-int",
        "[[nvme]]\npath = 7\n",
        r"nvme\[0\]\.path: expected a non-empty path string, got 7 of type int$",
    ),
    (
        "nvme-second-capacity-zero",
        '[[nvme]]\npath = "/a"\n[[nvme]]\npath = "/b"\ncapacity = 0\n',
        r"nvme\[1\]\.capacity: expected a size >= 1B, got 0$",
    ),
    (
        "nvme-unknown-key",
        '[[nvme]]\npath = "/a"\ncapacty = "1GiB"\n',
        r"nvme\[0\]\.capacty: unknown key; did you mean 'capacity'\?",
    ),
    (
        "nvme-duplicate-path",
        '[[nvme]]\npath = "/a"\n[[nvme]]\npath = "/a/"\n',
        (
            r"nvme\[1\]\.path: expected a directory not already listed, "
            r"got '/a/' \(same as nvme\[0\]\.path\)$"
        ),
    ),
    (
        "nvme-not-a-table",
        "nvme = 5\n",
        r"nvme: expected an array of tables \(\[\[nvme\]\]\), got 5 of type int$",
    ),
    (
        "toml-syntax-error",
        "[io\nqueue_depth = 8\n",
        r"invalid TOML: .*\(at line 1, column 4\)$",
    ),
    (
        "toml-duplicate-key",
        "[io]\nthreads = 2\nthreads = 3\n",
        r"invalid TOML: .*\(at line 3, column \d+\)$",
    ),
]


@pytest.mark.parametrize(
    ("text", "pattern"),
    [pytest.param(text, pattern, id=name) for name, text, pattern in BAD_FILES],
)
def test_bad_config_files(tmp_path, text, pattern):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="^" + re.escape(str(path)) + ": " + pattern):
        load_config(path)


def test_bad_config_files_are_many_and_distinct():
    assert len({text for _, text, _ in BAD_FILES}) == len(BAD_FILES) >= 20


def test_load_config_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: config file not found$") as info:
        load_config(path)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_load_config_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))}: cannot read config file"):
        load_config(tmp_path)


def test_load_config_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[nvme]\npath = "/caf\xe9"\n')
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: config file is not valid UTF-8"):
        load_config(path)


def test_syntax_error_is_chained(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("x = = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert isinstance(info.value.__cause__, tomllib.TOMLDecodeError)


# ---------------------------------------------------------------------------
# to_dict / to_toml
# ---------------------------------------------------------------------------


def test_to_dict():
    d = FULL_CONFIG.to_dict()
    assert d == {
        "host": {"capacity": "8GiB", "huge_pages": True},
        "nvme": [
            {"path": "/mnt/nvme0/ssdtier", "capacity": "256GiB"},
            {"path": "/mnt/nvme1/ssdtier", "capacity": "100GB"},
        ],
        "io": {
            "backend": "io_uring",
            "queue_depth": 128,
            "block_size": "2MiB",
            "direct": False,
            "fixed_buffers": False,
            "zero_copy": False,
            "threads": 8,
            "throttle": None,
            "preallocate": "256MiB",
            "local_ranks": "auto",
        },
        "policy": {
            "min_tensor_bytes": "64KiB",
            "keep_last_layers": 1,
            "prefetch_layers": 3,
            "eviction": "lru",
            "dedup": False,
            "layers": "model.layers",
            "mode": "adaptive",
            "device_budget": "20GiB",
            "exclude": [],
        },
    }
    assert Config.from_dict(d) == FULL_CONFIG
    assert Config().to_dict()["policy"]["device_budget"] is None
    assert Config.from_dict(Config().to_dict()) == Config()


def test_to_toml_full():
    text = FULL_CONFIG.to_toml()
    assert '[host]\ncapacity = "8GiB"\nhuge_pages = true\n' in text
    assert text.count("[[nvme]]") == 2
    for table in ("[io]", "[policy]"):
        assert table in text
    assert Config.from_dict(tomllib.loads(text)) == FULL_CONFIG


def test_to_toml_defaults_has_every_table(tmp_path):
    text = Config().to_toml()
    for table in ("[host]", "[io]", "[policy]"):
        assert table in text
    assert "# device_budget is not set" in text
    path = tmp_path / "defaults.toml"
    path.write_text(text)
    assert load_config(path) == Config()


def test_to_toml_escapes_strings():
    weird = 'C:\\dir "quoted"\ttab\nnewline\x01'
    cfg = Config(nvme=(NvmeConfig(weird),), source="multi\nline")
    loaded = Config.from_dict(tomllib.loads(cfg.to_toml()))
    assert loaded.nvme[0].path == weird
    assert loaded == cfg


@given(
    host=st.integers(min_value=0, max_value=TiB),
    nvme=st.lists(st.integers(min_value=1, max_value=2**50), max_size=3),
    block_shift=st.integers(min_value=12, max_value=26),
    min_bytes=st.integers(min_value=0, max_value=2**40),
    budget=st.none() | st.integers(min_value=0, max_value=2**45),
    keep=st.just("auto") | st.integers(min_value=0, max_value=100),
)
def test_to_toml_round_trip_property(host, nvme, block_shift, min_bytes, budget, keep):
    cfg = Config(
        host=HostConfig(host),
        nvme=tuple(NvmeConfig(f"/d{i}", cap) for i, cap in enumerate(nvme)),
        io=IoConfig(block_size=1 << block_shift),
        policy=PolicyConfig(min_tensor_bytes=min_bytes, device_budget=budget, keep_last_layers=keep),
    )
    assert Config.from_dict(tomllib.loads(cfg.to_toml())) == cfg
    assert Config.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------
# replace
# ---------------------------------------------------------------------------


def test_replace_flat_and_nested():
    base = Config(source="base.toml")
    cfg = base.replace(
        policy__prefetch_layers=3,
        io={"backend": "posix", "threads": 2},
        **{"host.capacity": "64MiB"},
    )
    assert cfg.policy.prefetch_layers == 3
    assert cfg.host.capacity == 64 * MiB
    assert cfg.io == IoConfig(backend="posix", threads=2)
    assert cfg.policy.eviction == "lifetime"
    assert cfg.source == "base.toml + <overrides>"
    assert base == Config()  # unchanged
    assert base.replace() is base


def test_replace_positional_mapping_and_objects():
    cfg = Config().replace(
        {"io.queue_depth": 8, "policy.layers": "transformer.h"},
        host=HostConfig(0),
        nvme=[{"path": "/a", "capacity": "1GiB"}, NvmeConfig("/b")],
    )
    assert cfg.io.queue_depth == 8
    assert cfg.policy.layers == "transformer.h"
    assert cfg.host.capacity == 0
    assert cfg.nvme == (NvmeConfig("/a", GiB), NvmeConfig("/b"))
    # later keys win, and None resets an optional key
    cfg2 = cfg.replace(policy__layers=None, policy={"dedup": False})
    assert cfg2.policy.layers is None
    assert cfg2.policy.dedup is False
    assert cfg2.nvme == cfg.nvme


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {"policy__prefetch_layer": 3},
            r"unknown key 'policy__prefetch_layer'; did you mean 'policy__prefetch_layers'\?",
        ),
        (
            {"io.queue_dept": 3},
            r"unknown key 'io\.queue_dept'; did you mean 'io\.queue_depth'\?",
        ),
        (
            {"polcy__mode": "none"},
            r"unknown key 'polcy__mode'; did you mean 'policy__mode'\?",
        ),
        (
            {"prefetch_layers": 3},
            r"unknown key 'prefetch_layers'; did you mean 'policy__prefetch_layers'",
        ),
        (
            {"io__block__size": 4096},
            r"unknown key 'io__block__size'",
        ),
        (
            {"host": {"capcity": 1}},
            r"host\.capcity: unknown key; did you mean 'capacity'\?",
        ),
        (
            {"host": 5},
            r"host: expected a mapping or a HostConfig, got 5 of type int$",
        ),
        (
            {"nvme__path": "/x"},
            r"cannot override 'nvme\.path': nvme is a list of tables",
        ),
        (
            {"policy__prefetch_layers": 100},
            r"policy\.prefetch_layers: expected 'auto' or an integer in 0\.\.64, got 100$",
        ),
        (
            {"io__backend": "uring"},
            r"io\.backend: expected one of .*got 'uring'; did you mean 'io_uring'\?$",
        ),
        (
            {"host.capacity": "big"},
            r"host\.capacity: expected 'auto' or a size such as '8GiB', got 'big'$",
        ),
    ],
)
def test_replace_errors(overrides, pattern):
    with pytest.raises(ConfigError, match="^<overrides>: " + pattern):
        Config().replace(**overrides)


def test_policy_exclude(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text('[policy]\nexclude = ["lm_head", "model.layers.*.mlp"]\n')
    cfg = load_config(f)
    assert cfg.policy.exclude == ("lm_head", "model.layers.*.mlp")
    assert 'exclude = ["lm_head", "model.layers.*.mlp"]' in cfg.to_toml()
    assert Config.from_dict(tomllib.loads(cfg.to_toml())) == cfg
    assert Config().replace(policy__exclude=["head"]).policy.exclude == ("head",)
    for bad in ("lm_head", ["ok", 3], ["a b"]):
        with pytest.raises(ConfigError, match=r"policy\.exclude: expected a list of module names or glob patterns"):
            Config().replace(policy__exclude=bad)


def test_replace_suggests_keys_in_the_form_they_were_given():
    # Keyword arguments need policy__mode; a mapping takes the dotted form too.
    with pytest.raises(ConfigError, match=r"did you mean 'policy\.prefetch_layers' \(key"):
        Config().replace({"prefetch_layers": 3})
    with pytest.raises(ConfigError, match=r"did you mean 'io\.queue_depth'\?"):
        Config().replace({"io.queue_dept": 3})


def test_every_problem_is_reported_at_once(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(
        '[host]\ncapacity = "big"\n[io]\nqueue_dept = 8\nbackend = "uring"\nthreads = 0\n'
        '[[nvme]]\ncapacty = "1GiB"\n[polcy]\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(f)
    lines = str(e.value).splitlines()
    assert lines[0] == f"{f}: 7 problems:"
    for want in (
        "unknown table [polcy]; did you mean 'policy'?",
        "host.capacity: expected 'auto' or a size",
        "io.queue_dept: unknown key; did you mean 'queue_depth'?",
        "io.backend: expected one of",
        "io.threads: expected an integer in 1..64, got 0",
        "nvme[0].capacty: unknown key; did you mean 'capacity'?",
        "nvme[0]: missing required key 'path'",
    ):
        assert sum(line.startswith(f"  {want}") for line in lines[1:]) == 1, (want, lines)
    with pytest.raises(ConfigError, match=r"^<overrides>: 2 problems:\n  unknown key 'io__depth'.*\n  io\.threads"):
        Config().replace(io__depth=1, io__threads=0)


# ---------------------------------------------------------------------------
# resolve_config
# ---------------------------------------------------------------------------


def test_resolve_config_env(tmp_path, monkeypatch):
    path = tmp_path / "env.toml"
    path.write_text("[io]\nthreads = 7\n")
    monkeypatch.setenv("SSDTIER_CONFIG", str(path))
    cfg = resolve_config()
    assert cfg.io.threads == 7
    assert cfg.source == str(path)
    assert resolve_config(None, io__threads=9).io.threads == 9


def test_resolve_config_env_missing_file(tmp_path, monkeypatch):
    path = tmp_path / "missing.toml"
    monkeypatch.setenv("SSDTIER_CONFIG", str(path))
    pattern = f"^{re.escape(str(path))}: config file not found \\(path taken from \\$SSDTIER_CONFIG\\)$"
    with pytest.raises(ConfigError, match=pattern):
        resolve_config()


def test_resolve_config_defaults(monkeypatch):
    monkeypatch.delenv("SSDTIER_CONFIG", raising=False)
    assert resolve_config() == Config()
    assert resolve_config().source == "<defaults>"
    monkeypatch.setenv("SSDTIER_CONFIG", "")
    assert resolve_config() == Config()


def test_resolve_config_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDTIER_CONFIG", str(tmp_path / "ignored.toml"))
    cfg = Config(io=IoConfig(threads=3))
    assert resolve_config(cfg) is cfg
    from_dict = resolve_config({"io": {"threads": 3}})
    assert from_dict == cfg
    assert from_dict.source == "<dict>"
    path = tmp_path / "c.toml"
    path.write_text(FULL_TOML)
    assert resolve_config(path) == FULL_CONFIG
    assert resolve_config(str(path)) == FULL_CONFIG
    with pytest.raises(ConfigError, match=r"^<dict>: io\.thread: unknown key"):
        resolve_config({"io": {"thread": 3}})


@pytest.mark.parametrize("bad", [42, b"/a.toml", ["io"], 1.5])
def test_resolve_config_bad_type(bad):
    pattern = (
        r"^config must be None, a path \(str or os\.PathLike\) to a TOML file, "
        rf"a mapping or an ssdtier Config, not {type(bad).__name__}$"
    )
    with pytest.raises(TypeError, match=pattern):
        resolve_config(bad)


# ---------------------------------------------------------------------------
# default_nvme_dir / is_tmpfs
# ---------------------------------------------------------------------------


def test_default_nvme_dir(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("SSDTIER_DIR", "/fast/spill")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert default_nvme_dir() == "/fast/spill"
    monkeypatch.setenv("SSDTIER_DIR", "~/spill")
    assert default_nvme_dir() == "/home/u/spill"
    monkeypatch.delenv("SSDTIER_DIR")
    assert default_nvme_dir() == "/xdg/ssdtier"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored per XDG spec
    assert default_nvme_dir() == "/home/u/.cache/ssdtier"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_nvme_dir() == "/home/u/.cache/ssdtier"
    monkeypatch.setenv("SSDTIER_DIR", "")
    assert default_nvme_dir() == "/home/u/.cache/ssdtier"


def _mount_fstype(path: str) -> str | None:
    """File-system type of the mount holding ``path``, from mountinfo (not statfs's magic)."""
    m = mount_of(path)
    return m.fstype if m else None


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists("/proc/mounts"),
    reason="needs Linux /proc/mounts",
)


@linux_only
@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/proc/ssdtier-nope/a", "the directory cannot be created in /proc"),
        ("/proc/self", "the directory cannot hold a file"),
    ],
)
def test_check_paths_tries_what_a_store_will_do(path, why):
    # Permission bits say yes to root; only trying says no: /proc takes no new directory or file.
    cfg = Config.from_dict({"nvme": [{"path": path}]}, source="t.toml")
    with pytest.raises(ConfigError, match=re.escape(f"t.toml: nvme[0].path = {path!r}: {why}")):
        check_paths(cfg)


def test_check_paths_leaves_nothing_behind(store_dir):
    new = store_dir / "a" / "b"
    cfg = Config.from_dict({"nvme": [{"path": str(new)}, {"path": str(store_dir)}]})
    assert check_paths(cfg) == [str(new), str(store_dir)]
    assert os.listdir(store_dir) == []


def test_a_relative_nvme_path_is_relative_to_its_file(store_dir, monkeypatch):
    f = store_dir / "ssdtier.toml"
    f.write_text('[[nvme]]\npath = "spill"\n[[nvme]]\npath = "/abs/x"\n')
    monkeypatch.chdir("/")
    assert [n.path for n in load_config(f).nvme] == [str(store_dir / "spill"), "/abs/x"]


def test_is_tmpfs_dev_shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    expected = _mount_fstype("/dev/shm") in ("tmpfs", "ramfs")
    assert is_tmpfs("/dev/shm") is expected
    # a path that does not exist yet is judged by its nearest existing ancestor
    assert is_tmpfs("/dev/shm/ssdtier-does-not-exist/a/b") is expected


@linux_only
def test_is_tmpfs_repo_dir():
    expected = _mount_fstype(str(REPO)) in ("tmpfs", "ramfs")
    assert is_tmpfs(REPO) is expected
    assert is_tmpfs(str(REPO / "no" / "such" / "dir")) is expected
    if str(REPO).startswith("/work/"):
        assert expected is False  # /work is a disk file system in this environment


@linux_only
def test_is_tmpfs_tmp_path(tmp_path):
    expected = _mount_fstype(str(tmp_path)) in ("tmpfs", "ramfs")
    assert is_tmpfs(tmp_path) is expected


def test_is_tmpfs_never_raises():
    assert is_tmpfs("\0bad") in (True, False)
    assert is_tmpfs(12345) is False  # type: ignore[arg-type]
    assert TMPFS_MAGIC == 0x01021994
    assert RAMFS_MAGIC == 0x858458F6


# ---------------------------------------------------------------------------
# Import hygiene
# ---------------------------------------------------------------------------

_IMPORT_CHECK = """
import importlib, sys, types
pkg = types.ModuleType("ssdtier")  # bypass the package __init__ (it may need _native)
pkg.__path__ = [sys.argv[1]]
sys.modules["ssdtier"] = pkg
mod = importlib.import_module("ssdtier.config")
sizes = importlib.import_module("ssdtier.sizes")
importlib.import_module("ssdtier.paths")
heavy = sorted(m for m in ("torch", "numpy", "tomllib", "tomli") if m in sys.modules)
print("loaded:", heavy)
assert not heavy, heavy
assert sizes.parse_size("1KiB") == 1024 and mod.Config
"""


def test_import_does_not_import_torch():
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, str(REPO / "python" / "ssdtier")],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout


def test_policy_layers_may_name_several_stacks():
    cfg = Config.from_dict({"policy": {"layers": ["encoder.block", "decoder.block"]}})
    assert cfg.policy.layers == ("encoder.block", "decoder.block")
    assert Config.from_dict({"policy": {"layers": "model.layers"}}).policy.layers == "model.layers"
    for bad in ([], ["ok", 3], ["no spaces allowed"], 7):
        with pytest.raises(ConfigError, match="policy.layers"):
            Config.from_dict({"policy": {"layers": bad}})
