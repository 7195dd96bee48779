"""TieredStore: exact round trips through the host arena and NVMe, both I/O
engines, every dtype, sizes from 0 to 64 MiB, and the error paths."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ssdtier
from ssdtier import ConfigError, OutOfSpaceError, StoreClosedError, TieredStore, UnknownKeyError

from .conftest import REPO, store_config

BACKENDS = ["io_uring", "posix"]

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]

# Bytes, including 0, sizes that are not multiples of 4096, and 64 MiB.
SIZES = [0, 1, 7, 4095, 4096, 4097, 100_003, (1 << 20) + 5, 3 << 20, 64 << 20]


def random_tensor(nbytes: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits viewed as `dtype` (bool gets 0/1), about `nbytes` long."""
    esize = torch.empty((), dtype=dtype).element_size()
    n = nbytes // esize
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8).view(torch.bool)
    raw = torch.randint(0, 256, (n * esize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bits include NaNs, for which torch.equal is False)."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_dtype_and_size_round_trips(store_dir, backend):
    gen = torch.Generator().manual_seed(0)
    # A 16 MiB arena: small entries stay and are evicted under pressure, 64 MiB ones stream past it.
    with TieredStore(store_config(store_dir, host="16MiB", backend=backend)) as store:
        assert store.backend == backend
        assert store.direct
        cases = []
        for i, dtype in enumerate(DTYPES):
            for nbytes in SIZES[:-1] if i % 4 else SIZES:
                t = random_tensor(nbytes, dtype, gen)
                cases.append((store.put(t), t))
        store.flush()
        for key, t in cases:
            out = store.get(key)
            assert same(out, t), (t.dtype, t.numel())
            assert out.is_contiguous()
        st = store.stats()
        assert st.nvme_bytes_written > 64 << 20
        assert st.nvme_bytes_read > 0
        assert st.staged_puts >= 1 and st.staged_gets >= 1
        # Evict each and read it back again: every entry through NVMe.
        for key, t in cases:
            store.evict(key)
            assert store.location(key)[0] is False
            assert same(store.get(key), t)
        for key, _ in cases:
            store.free(key)
        st = store.stats()
        assert (st.entries, st.host_used, st.nvme_used) == (0, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(store_dir, backend):
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    views = [
        base.transpose(0, 2),
        base[:, ::2, 1::3],
        base[1],
        base[..., 0],
        base[0, 0, 0],  # 0-d
        torch.tensor(3.5).expand(5, 7),  # stride 0
        base.permute(2, 0, 1).flip(0),
        torch.empty(0, 3)[:, 1:],
        # Lazy views: contiguous, but their bytes are not their values (the conjugate and
        # negative bits are applied on read); what is stored is the values.
        torch.complex(base, -base).conj(),
        torch.complex(base, base).conj().imag,  # a negative-bit view
    ]
    with TieredStore(store_config(store_dir, host="1MiB", backend=backend)) as store:
        keys = [store.put(v) for v in views]
        for k in keys:
            store.evict(k)
        for k, v in zip(keys, views, strict=True):
            out = store.get(k)
            assert torch.equal(out, v) and out.shape == v.shape and out.dtype == v.dtype
            assert out.is_contiguous() and not out.is_conj() and not out.is_neg()


def test_ten_thousand_small_tensors(store_dir):
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 300, (10_000,), generator=gen)]
    # 8 MiB of arena for 10,000 slots of 4 KiB: about a fifth stay, the rest go to NVMe.
    with TieredStore(store_config(store_dir, host="8MiB")) as store:
        keys = [store.put(t) for t in tensors]
        assert len(store) == 10_000
        for k, t in zip(keys, tensors, strict=True):
            assert torch.equal(store.get(k), t)
        st = store.stats()
        assert st.entries == 10_000 and st.nvme_bytes_written > 0
        for k in keys:
            store.free(k)
        assert store.stats().entries == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_put_get_free_cycles_do_not_grow(store_dir, backend):
    t = torch.arange(256 * 1024, dtype=torch.int32)  # 1 MiB
    with TieredStore(store_config(store_dir, host="4MiB", backend=backend)) as store:
        live = []
        seen = []
        for i in range(3000):
            live.append(store.put(t + i))
            if len(live) > 6:
                k = live.pop(0)
                assert store.get(k)[0].item() == i - 6
                store.free(k)
            if i % 500 == 499:
                st = store.stats()
                seen.append((st.host_used, st.nvme_used, st.device_high_water[0]))
        # At most 7 live entries of 1 MiB: which of them sit in the arena depends on
        # when writes complete, but no checkpoint may exceed the live set, and the space
        # used in the file never reaches past it (first fit reuses what was freed).
        assert all(h <= 4 << 20 and n <= 7 << 20 and w <= 7 << 20 for h, n, w in seen), seen
        for k in live:
            store.free(k)
        st = store.stats()
        assert (st.host_used, st.nvme_used, st.entries) == (0, 0, 0)


def test_prefetch_and_locations(store_dir):
    t = torch.randn(1000, 100)
    with TieredStore(store_config(store_dir)) as store:
        k = store.put(t)
        assert store.location(k) == (True, False)
        store.evict(k)
        assert store.location(k) == (False, True)
        ticket = store.prefetch(k)
        ticket.wait()
        assert ticket.done()
        assert store.location(k) == (True, True)
        read = store.stats().nvme_bytes_read
        assert torch.equal(store.get(k), t)
        assert store.stats().nvme_bytes_read == read
        assert store.stats().nvme_hits == 0 and store.stats().host_hits == 1


def test_read_into_says_whether_it_copied_at_once(store_dir):
    from ssdtier.offload._util import aligned_storage

    t = torch.arange(5000, dtype=torch.int32)
    with TieredStore(store_config(store_dir)) as store:
        k = store.put(t)
        for resident in (True, False):
            buf, pad = aligned_storage(t.nbytes)
            ticket = store.native.read_into(k, buf.data_ptr() + pad, buf.nbytes() - pad, buf)
            # None: copied from the arena before the call returned; else a read from NVMe.
            assert (ticket is None) == resident
            if ticket is not None:
                ticket.wait()
            got = torch.empty(0, dtype=torch.int32).set_(buf, pad // 4, t.shape, t.stride())
            assert torch.equal(got, t)
            store.evict(k)


def test_transfers_outside_the_store(store_dir):
    """What a cuFile transport does: the store hands out NVMe extents of its files, the
    caller moves the bytes itself (here with pwrite and pread), then says so."""
    import mmap

    from ssdtier import SsdtierError, SsdtierOSError

    data = torch.arange((3 << 20) // 4 + 5, dtype=torch.int32)
    nbytes = data.nbytes
    with TieredStore(store_config(store_dir, host="1MiB")) as store:
        native = store.native
        (fd,) = native.device_fds
        key, slot = native.reserve(nbytes)
        assert slot is None  # larger than the arena
        extents = native.begin_external_write(key)
        assert sum(n for *_, n in extents) == -(-nbytes // 4096) * 4096
        raw = data.numpy().tobytes()
        for _, file_off, entry_off, n in extents:
            buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT wants
            buf[: max(0, min(n, nbytes - entry_off))] = raw[entry_off : entry_off + n]
            assert os.pwrite(fd, buf, file_off) == n
        native.end_external(key)
        out = torch.empty_like(data)
        native.read_staged(key, out.data_ptr(), nbytes, out)
        assert torch.equal(out, data)
        # Read back outside the store.
        got = bytearray(nbytes)
        for _, file_off, entry_off, n in native.begin_external_read(key):
            buf = mmap.mmap(-1, n)
            assert os.preadv(fd, [buf], file_off) == n
            got[entry_off : entry_off + n] = buf[: max(0, min(n, nbytes - entry_off))]
        native.end_external(key)
        assert bytes(got) == raw
        # A failed write leaves no bytes, says why, and frees its space.
        k2, _ = native.reserve(nbytes)
        native.begin_external_write(k2)
        with pytest.raises(SsdtierError, match="cuFile said no"):
            native.end_external(k2, "cuFile said no")
        with pytest.raises(SsdtierError):
            native.begin_external_read(k2)
        with pytest.raises(SsdtierError):
            native.end_external(key)  # none in flight
        native.free(k2)
        native.free(key)
        # Small enough for the arena, but reserved without a slot: written outside the store.
        k3 = native.reserve_unslotted(1000)
        assert [n for *_, n in native.begin_external_write(k3)] == [4096]
        with pytest.raises(SsdtierOSError, match="a transfer outside the store failed: not written"):
            native.end_external(k3, "not written")
        native.free(k3)
        native.reserve_unslotted(0)  # the store takes new work after such failures


def test_fixed_buffers_off_and_on_agree(store_dir):
    t = torch.randn(300_000)
    for fixed in (True, False):
        with TieredStore(store_config(store_dir, host="2MiB", fixed_buffers=fixed)) as store:
            # 2 MiB is under the default RLIMIT_MEMLOCK (8 MiB), so registration succeeds when asked.
            assert store.fixed_buffers is fixed
            k = store.put(t)
            store.evict(k)
            assert torch.equal(store.get(k), t)


def test_a_large_arena_is_said_before_it_is_registered_and_timed(store_dir, monkeypatch, caplog):
    import ssdtier.store as st

    monkeypatch.setattr(st, "SLOW_ARENA", 1 << 20)  # "large": registering takes seconds from 8 GiB on
    with caplog.at_level("INFO", logger="ssdtier"):
        TieredStore(store_config(store_dir, host="2MiB")).close()
    text = caplog.text
    assert "mapping and registering a 2MiB host arena" in text and "; ready in " in text
    assert text.index("mapping and registering") < text.index("ready in")


def test_a_large_arena_is_said_on_stderr_where_the_log_shows_nothing(store_dir, monkeypatch, capsys):
    import logging

    import ssdtier.store as st

    monkeypatch.setattr(st, "SLOW_ARENA", 1 << 20)
    log = logging.getLogger("ssdtier")
    level = log.level
    log.setLevel(logging.WARNING)  # as in a plain script
    try:
        TieredStore(store_config(store_dir, host="2MiB")).close()
    finally:
        log.setLevel(level)
    assert "ssdtier: mapping and registering a 2MiB host arena..." in capsys.readouterr().err


def test_stats_count_traffic(store_dir):
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    with TieredStore(store_config(store_dir)) as store:
        k = store.put(t)
        store.evict(k)
        store.get(k)
        st = store.stats()
        assert st.host_bytes_in == 1 << 20
        assert st.nvme_bytes_written == 1 << 20
        assert st.nvme_bytes_read == 1 << 20
        assert st.nvme_write_ops == 4  # 256 KiB blocks
        assert st.wait_seconds >= 0.0
        assert isinstance(st, ssdtier.StoreStats)


def test_out_of_space_is_its_own_error_and_loses_nothing(store_dir):
    t = torch.ones(256 * 1024, dtype=torch.uint8)
    with TieredStore(store_config(store_dir, host="1MiB", nvme="1MiB")) as store:
        keys = []
        with pytest.raises(OutOfSpaceError) as info:
            for i in range(100):
                keys.append(store.put(t * (i % 200)))
        assert info.value.errno == errno.ENOSPC
        assert isinstance(info.value, OSError) and isinstance(info.value, ssdtier.SsdtierError)
        assert len(keys) == 8
        for i, k in enumerate(keys):
            assert torch.equal(store.get(k), t * (i % 200))


def test_misuse_gives_clear_errors(store_dir):
    store = TieredStore(store_config(store_dir))
    with pytest.raises(UnknownKeyError, match="unknown key 12345"):
        store.get(12345)
    with pytest.raises(KeyError):
        store.free(12345)
    with pytest.raises(TypeError, match="torch.Tensor"):
        store.put([1, 2, 3])
    with pytest.raises(TypeError, match="strided"):
        store.put(torch.eye(3).to_sparse())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated
        q = torch.quantize_per_tensor(torch.randn(8), 0.1, 3, torch.qint8)
    with pytest.raises(TypeError, match="quantized"):
        store.put(q)
    assert len(store) == 0
    # A zero tensor has no storage (data pointer 0): its value is stored.
    kz = store.put(torch._efficientzerotensor(4, 4))
    assert torch.equal(store.get(kz), torch.zeros(4, 4))
    store.free(kz)
    k = store.put(torch.ones(3))
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        store.get(k)


def test_bad_directories(store_dir):
    plain = store_dir / "a-file"
    plain.write_text("x")
    # Checked before anything is opened, naming the key and the path.
    for path in (plain, plain / "below"):
        with pytest.raises(ConfigError, match=r"nvme\[0\]\.path = .*a-file.* is not a directory"):
            TieredStore(store_config(path))
    if os.path.isdir("/dev/shm"):
        with pytest.raises(ConfigError, match="tmpfs.*io.direct = false"):
            TieredStore(store_config("/dev/shm/ssdtier-test"))


def test_directory_that_vanishes_is_an_os_error(store_dir, monkeypatch):
    # Past the config check, the OS's own error comes through with errno and path.
    import ssdtier.store as store_mod

    plain = store_dir / "a-file"
    plain.write_text("x")
    monkeypatch.setattr(store_mod, "check_paths", lambda cfg: [str(plain)])
    with pytest.raises(ssdtier.SsdtierOSError) as info:
        TieredStore(store_config(plain))
    assert info.value.errno == errno.ENOTDIR
    assert str(plain) in str(info.value)


def test_tmpfs_with_direct_off_warns_once_and_works(store_dir, warned):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    cfg = store_config("/dev/shm/ssdtier-test-buffered", direct=False)
    with TieredStore(cfg) as store:
        assert store.direct is False
        k = store.put(torch.arange(10))
        store.evict(k)
        assert torch.equal(store.get(k), torch.arange(10))
    assert len(warned("the directory is on tmpfs, whose files are memory: spilling there frees none")) == 1


def test_default_directory_from_env(store_dir, monkeypatch):
    monkeypatch.setenv("SSDTIER_DIR", str(store_dir / "default"))
    monkeypatch.delenv("SSDTIER_CONFIG", raising=False)
    with TieredStore(host__capacity="1MiB") as store:
        k = store.put(torch.arange(100_000))
        store.evict(k)
        assert torch.equal(store.get(k), torch.arange(100_000))
    assert (store_dir / "default").is_dir()
    assert oct((store_dir / "default").stat().st_mode & 0o777) == oct(0o700)
    # The file had no name: nothing is left behind.
    assert os.listdir(store_dir / "default") == []


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_io_uring_unavailable_falls_back_to_posix_with_a_warning(store_dir):
    code = f"""
import warnings, torch, ssdtier
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as w:
    s = ssdtier.TieredStore({store_config(store_dir)!r})
print(s.backend)
print([str(x.message) for x in w])
k = s.put(torch.arange(5)); s.evict(k); assert torch.equal(s.get(k), torch.arange(5))
"""
    r = _run(code, SSDTIER_DISABLE_IO_URING="1")
    assert r.returncode == 0, r.stderr
    backend, msgs = r.stdout.strip().splitlines()
    assert backend == "posix"
    assert "io_uring is not available" in msgs
    r = _run(code.replace("'block_size'", "'backend': 'io_uring', 'block_size'"), SSDTIER_DISABLE_IO_URING="1")
    assert r.returncode != 0 and "io_uring cannot be set up" in r.stderr


def test_import_is_lean():
    code = """
import os, sys
before = sorted(os.listdir('/proc/self/fd'))
import ssdtier
after = sorted(os.listdir('/proc/self/fd'))
print(before == after, 'torch' in sys.modules, 'ssdtier._native' in sys.modules)
"""
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False"]


def test_no_warning_on_a_real_file_system(store_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TieredStore(store_config(store_dir)) as store:
            assert store.backend == "io_uring"


@pytest.mark.parametrize(("preallocate", "size"), [(0, 1 << 20), ("4MiB", 4 << 20), ("all", 64 << 20)])
def test_files_grow_ahead_of_their_use_as_configured(store_dir, preallocate, size):
    with TieredStore(store_config(store_dir, host="1MiB", nvme="64MiB", preallocate=preallocate)) as store:
        k = store.put(torch.zeros(1 << 20, dtype=torch.uint8))
        store.evict(k)
        st = store.stats()
        assert (st.device_high_water[0], st.device_file_size[0]) == (1 << 20, size)
        assert torch.equal(store.get(k), torch.zeros(1 << 20, dtype=torch.uint8))


def test_preallocate_is_a_size_or_all(store_dir):
    with pytest.raises(ssdtier.ConfigError, match="io.preallocate"):
        TieredStore(store_config(store_dir, preallocate="most"))


def test_a_view_of_the_arena_keeps_the_native_store_alive(store_dir):
    import gc
    import weakref

    store = TieredStore(store_config(store_dir, host="1MiB"))
    arena, native = store.arena, weakref.ref(store._native)
    store.close()
    del store
    gc.collect()
    assert native() is not None, "the arena's view would outlive its mapping"
    arena[-1] = 7  # still mapped
    assert arena[-1].item() == 7
    del arena
    gc.collect()
    assert native() is None


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("huge", [False, True])
def test_huge_pages_are_asked_for_the_arena_only_when_set(store_dir, huge):
    cfg = store_config(store_dir, host="8MiB")
    cfg["host"]["huge_pages"] = huge
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel takes the advice: nothing to say
        store = TieredStore(cfg)
    with store:
        assert ("hg" in _vm_flags(store.arena.data_ptr())) is huge
        x = torch.arange(1 << 20, dtype=torch.int32)
        assert torch.equal(store.get(store.put(x)), x)


def test_an_arena_larger_than_memory_names_the_key_and_a_size_that_fits(store_dir):
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("vm.overcommit_memory = 1: the kernel maps any size, so no arena is too large")
    with pytest.raises(ConfigError, match=r"host\.capacity = 1TiB: cannot map a host arena .* is left \(.*\): at most"):
        TieredStore(store_config(store_dir, host="1TiB", fixed_buffers=False))


def test_a_capacity_past_the_free_space_is_said_at_open(store_dir, warned):
    cfg = store_config(store_dir, nvme="1000TiB")
    TieredStore(cfg).close()
    (msg,) = warned("has ")
    assert "nvme[0].capacity = 1000TiB, and the file system of" in msg and "writes past the free space" in msg
    cfg["io"]["preallocate"] = "all"
    with pytest.raises(ConfigError, match='io.preallocate = "all" takes it all at open; give at most'):
        TieredStore(cfg)
    # Two directories on one file system: their capacities add up.
    half = store_config(store_dir, nvme="600TiB")
    half["nvme"].append({"path": str(store_dir / "b"), "capacity": "600TiB"})
    with pytest.raises(ConfigError, match=r"nvme\[0\]\.capacity \+ nvme\[1\]\.capacity = 1\.2PiB"):
        TieredStore({**half, "io": {**half["io"], "preallocate": "all"}})
