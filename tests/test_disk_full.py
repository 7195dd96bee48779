"""A real "disk full": a small ext4 image on a loop device, with a configured
capacity larger than the file system. Needs root and loop devices (as on the
development and CI machines); skipped elsewhere, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
import torch

from ssdtier import OutOfSpaceError, TieredStore

from .conftest import REPO, store_config


@pytest.fixture
def small_fs():
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a loop file system")
    base = REPO / "target" / "loopfs"
    base.mkdir(parents=True, exist_ok=True)
    name = uuid.uuid4().hex[:8]
    image, mnt = base / f"{name}.img", base / name
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "24M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        image.unlink()
        mnt.rmdir()
        pytest.skip(f"cannot mount a loop device here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        image.unlink()
        mnt.rmdir()


@pytest.mark.parametrize("backend", ["io_uring", "posix"])
def test_real_disk_full_raises_out_of_space_and_keeps_data(small_fs, backend):
    t = torch.arange(256 * 1024, dtype=torch.int32)  # 1 MiB
    # 4 MiB of arena; "1GiB" of NVMe promised, but the file system holds ~20 MiB.
    with TieredStore(store_config(small_fs / "st", host="4MiB", nvme="1GiB", backend=backend)) as store:
        keys = []
        with pytest.raises(OutOfSpaceError) as info:
            for i in range(100):
                keys.append(store.put(t + i))
        assert 10 < len(keys) < 30, len(keys)
        assert "no space" in str(info.value)
        # Everything put before the error is intact, wherever it ended up.
        for i, k in enumerate(keys):
            assert torch.equal(store.get(k), t + i)
        # Freeing makes room again.
        for k in keys[: len(keys) // 2]:
            store.free(k)
        store.put(t)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "arena"])
def test_attach_on_a_full_disk_keeps_activations_and_exact_gradients(small_fs, zero_copy, warned):
    from ssdtier.bench.models import GPTConfig

    from .test_attach import assert_same, train

    cfg = store_config(small_fs / "st", host="1MiB", nvme="1GiB", zero_copy=zero_copy)
    cfg["policy"] = {"min_tensor_bytes": 0, "keep_last_layers": 0}
    model_cfg = GPTConfig(vocab_size=64, seq_len=128, d_model=128, n_heads=4, n_layers=4)

    # Two micro-batches: the second forward finds the disk full from the start.
    ref = train(model_cfg, micro=2, batch=16)
    got = train(model_cfg, cfg, micro=2, batch=16)
    assert_same(ref, got)
    s = got[2]
    # More than the file system holds was offloaded; what did not fit stayed in memory.
    assert s.bytes_offloaded > 24 << 20
    assert s.tensors_kept > 0 or s.store.nvme_peak < s.bytes_offloaded
    assert s.failed_writes > 0 and s.failed_reads == 0
    assert warned("memory")
    # The file is grown ahead of its use, so the full file system shows when space is taken
    # (fallocate), before any write: the tensor that found no room stays in memory.
    assert warned("no space")


def test_adaptive_mode_attaches_where_the_disk_cannot_hold_its_calibration(small_fs, warned):
    # Measuring the store wrote 64 MiB whatever the disk held: attach raised OutOfSpaceError.
    from ssdtier.bench.models import GPTConfig

    from .test_attach import assert_same, train

    cfg = store_config(small_fs / "st", host="1MiB", nvme="1GiB")
    cfg["policy"] = {"min_tensor_bytes": 0, "mode": "adaptive", "device_budget": "256KiB"}
    model_cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    got = train(model_cfg, cfg, micro=2)
    assert_same(train(model_cfg, micro=2), got)
    assert warned("measuring the store's speed needs 16MiB of capacity and 32MiB free")
    assert not list((small_fs / "st").iterdir())
