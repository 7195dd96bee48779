"""Several NVMe directories (striping, capacities, hand-over) and eviction
policies replayed on a recorded activation trace."""

from __future__ import annotations

import pytest
import torch

from ssdtier import OutOfSpaceError, TieredStore


def two_dirs(store_dir, cap_a="1GiB", cap_b="1GiB", host="0"):
    return {
        "host": {"capacity": host},
        "nvme": [
            {"path": str(store_dir / "a"), "capacity": cap_a},
            {"path": str(store_dir / "b"), "capacity": cap_b},
        ],
        "io": {"block_size": "256KiB"},
    }


def test_striping_splits_bytes_evenly(store_dir):
    t = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB = 16 blocks of 256 KiB
    with TieredStore(two_dirs(store_dir)) as store:
        k = store.put(t)
        st = store.stats()
        assert st.device_bytes_written == [2 << 20, 2 << 20]
        assert torch.equal(store.get(k), t)
        assert store.stats().device_bytes_read == [2 << 20, 2 << 20]


def test_capacities_are_respected_and_the_other_takes_over(store_dir):
    t = torch.zeros(256 * 1024, dtype=torch.uint8)  # 256 KiB
    with TieredStore(two_dirs(store_dir, cap_a="1MiB", cap_b="3MiB")) as store:
        keys = [store.put(t + i) for i in range(16)]
        st = store.stats()
        assert st.device_used == [1 << 20, 3 << 20]
        with pytest.raises(OutOfSpaceError):
            store.put(t)
        for i, k in enumerate(keys):
            assert torch.equal(store.get(k), t + i)


def replay(store_dir, policy):
    """Forward saves 16 activations; two backward passes read them in reverse
    (retain_graph). The arena holds 4. Returns the NVMe bytes read."""
    cfg = {
        "host": {"capacity": "1MiB"},
        "nvme": [{"path": str(store_dir / policy), "capacity": "1GiB"}],
        "io": {"block_size": "256KiB"},
        "policy": {"eviction": policy},
    }
    t = torch.zeros(64 * 1024, dtype=torch.int32)  # 256 KiB
    with TieredStore(cfg) as store:
        keys = [store.put(t + i) for i in range(16)]
        for _ in range(2):
            for i in reversed(range(16)):
                assert store.get(keys[i])[0] == i
        return store.stats().nvme_bytes_read


def test_lifetime_needs_no_more_reads_than_lru_or_fifo(store_dir):
    reads = {p: replay(store_dir, p) for p in ("lifetime", "lru", "fifo")}
    assert reads["lifetime"] <= reads["lru"] and reads["lifetime"] <= reads["fifo"], reads
    # On this trace the difference is real: the second pass starts with what lifetime kept.
    assert reads["lifetime"] < max(reads["lru"], reads["fifo"]), reads
