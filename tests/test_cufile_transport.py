"""The cuFile transport on the CPU, against a stand-in cufile module that moves host memory
(tests/fake_cufile.py): extents across striped devices, short and failed calls, out of
space, close with transfers queued, the driver opened once, and exact gradients through
attach(). GPU memory itself is tests/test_cuda.py's."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time

import pytest
import torch

import ssdtier
from ssdtier.errors import OutOfSpaceError, SsdtierError, SsdtierOSError
from ssdtier.gds import Gds, GdsState
from ssdtier.offload import cufile
from ssdtier.offload.cufile import CuFile
from ssdtier.paths import CUFILE_LINK_PREFIX
from ssdtier.store import ByteStore

from . import fake_cufile as fake
from .test_attach import CONFIGS, assert_same, check_out_of_space, offload_config, train, wait_copies
from .test_cuda_transport import FakeGPU, gpu  # noqa: F401 (gpu: a fixture)
from .test_lifecycle import check_two_training_threads


@pytest.fixture
def gds(monkeypatch):
    """attach() takes the stand-in cuFile for CPU tensors, as if GDS were usable."""
    fake.reset()
    monkeypatch.setattr(cufile, "MODULE", fake.__name__)
    monkeypatch.setattr(cufile, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(cufile, "probe_once", lambda: Gds(GdsState.USABLE, "stand-in"))
    return fake


def gds_config(store_dir, **kw):
    cfg = offload_config(store_dir, **kw)
    cfg["io"]["backend"] = "cufile"
    return cfg


def two_dirs(store_dir, capacity="8MiB"):
    return {
        "host": {"capacity": "64KiB"},
        "nvme": [{"path": str(store_dir / d), "capacity": capacity} for d in ("a", "b")],
        "io": {"block_size": "4KiB"},  # stripes of 4 KiB: every entry spans both files
    }


@pytest.fixture
def store(store_dir):
    s = ByteStore(two_dirs(store_dir))
    yield s
    s.close()


def source(nbytes, seed):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", [4096, 5000, 3 * 4096 + 1])
def test_round_trip_over_striped_files_stops_at_the_source_end(store, nbytes):
    fake.reset()
    io = CuFile(store.native, 2, None, fake)
    try:
        src = source(nbytes, 1)
        key = store.native.reserve_unslotted(nbytes)
        io.write(key, src.data_ptr(), nbytes, None).wait()
        writes = [c for c in fake.state["calls"] if c[0] == "write"]
        assert len({c[1] for c in writes}) == (1 if nbytes <= 4096 else 2), "striped over both files"
        assert max(c[2] + c[3] for c in writes) == src.data_ptr() + nbytes, "read past the source"
        assert all(c[5].startswith("ssdtier-cufile") for c in writes)
        out = torch.zeros(nbytes, dtype=torch.uint8)
        io.read(key, out.data_ptr(), nbytes, None).wait()
        assert torch.equal(out, src)
        assert store.native.location(key) == (False, True)
        store.discard(key)
    finally:
        io.close()
    assert fake.state["opens"] == fake.state["closes"] == 1 and not fake.state["fds"]


def test_an_entry_at_the_end_of_a_file_not_preallocated_reads_back(store_dir):
    """A write stops at the entry's end, so the file may end mid-page: the read stops there too."""
    fake.reset()
    cfg = two_dirs(store_dir)
    cfg["io"]["preallocate"] = 0
    s = ByteStore(cfg)
    io = CuFile(s.native, 1, None, fake)
    try:
        src = source(5000, 5)
        key = s.native.reserve_unslotted(5000)
        io.write(key, src.data_ptr(), 5000, None).wait()
        assert sum(os.fstat(fd).st_size for fd in fake.state["fds"].values()) == 5000  # ends mid-page
        out = torch.zeros(5000, dtype=torch.uint8)
        io.read(key, out.data_ptr(), 5000, None).wait()
        assert torch.equal(out, src)
    finally:
        io.close()
        s.close()


def round_trip(io, store, seed, nbytes=8192):
    src = source(nbytes, seed)
    key = store.native.reserve_unslotted(nbytes)
    io.write(key, src.data_ptr(), nbytes, None).wait()
    out = torch.zeros(nbytes, dtype=torch.uint8)
    io.read(key, out.data_ptr(), nbytes, None).wait()
    assert torch.equal(out, src)


def test_short_calls_are_continued(store):
    fake.reset()
    fake.state["short"] = 1000
    io = CuFile(store.native, 1, None, fake)
    try:
        round_trip(io, store, 2)
    finally:
        io.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_failed_call_is_the_stores_error_and_loses_nothing(store, op):
    fake.reset()
    io = CuFile(store.native, 1, None, fake)
    try:
        src = source(8192, 3)
        key = store.native.reserve_unslotted(8192)
        fake.state["fail"] = op
        w = io.write(key, src.data_ptr(), 8192, None)
        if op == "write":
            with pytest.raises(SsdtierOSError, match="cuFile write"):
                w.wait()
            assert store.native.location(key) == (False, False)  # no bytes: the caller has them
            return
        w.wait()
        out = torch.zeros(8192, dtype=torch.uint8)
        with pytest.raises(SsdtierOSError, match="cuFile read"):
            io.read(key, out.data_ptr(), 8192, None).wait()
        assert store.native.location(key) == (False, True)  # still on NVMe: a retry reads it
        fake.state["fail"] = None
        io.read(key, out.data_ptr(), 8192, None).wait()
        assert torch.equal(out, src)
    finally:
        io.close()


def test_out_of_space_is_raised_by_the_call_not_the_worker(store_dir):
    fake.reset()
    s = ByteStore(two_dirs(store_dir, capacity="16KiB"))
    io = CuFile(s.native, 1, None, fake)
    try:
        key = s.native.reserve_unslotted(1 << 20)
        with pytest.raises(OutOfSpaceError):
            io.write(key, source(1 << 20, 4).data_ptr(), 1 << 20, None)
        assert not fake.state["calls"]
        s.native.free(key)
    finally:
        io.close()
        s.close()


def test_close_waits_for_queued_transfers_and_the_driver_for_its_last_user(store):
    fake.reset()
    fake.state["delay"] = 0.02
    first, second = CuFile(store.native, 1, None, fake), CuFile(store.native, 1, None, fake)
    srcs = [source(4096, i) for i in range(6)]
    keys = [store.native.reserve_unslotted(4096) for _ in srcs]
    transfers = [first.write(k, s.data_ptr(), 4096, None) for k, s in zip(keys, srcs, strict=True)]
    first.close()
    assert all(t.done() for t in transfers)
    assert all(store.native.location(k) == (False, True) for k in keys)
    assert fake.state["opens"] == 1 and fake.state["closes"] == 0  # the second still uses it
    second.close()
    assert fake.state["closes"] == 1


def test_a_file_cufile_cannot_register_closes_the_driver(store, monkeypatch):
    fake.reset()

    def refuse(ptr):
        raise RuntimeError("CU_FILE_DRIVER_NOT_INITIALIZED")

    monkeypatch.setattr(fake, "handle_register", refuse)
    with pytest.raises(RuntimeError, match="NOT_INITIALIZED"):
        CuFile(store.native, 1, None, fake)
    assert fake.state["opens"] == fake.state["closes"] == 1
    assert not _links(store), "a name given for cuFile outlived the failure"


def _links(store):
    return [e for d in store.config.nvme for e in os.listdir(d.path) if e.startswith(CUFILE_LINK_PREFIX)]


def test_a_store_removes_the_names_a_dead_process_left(store_dir):
    """A process that died under cuFile leaves its store files named: a store opened in the
    same directory removes them (a live process's stay)."""
    d = store_dir / "a"
    d.mkdir(parents=True)
    stale, live = d / f"{CUFILE_LINK_PREFIX}999999999-0", d / f"{CUFILE_LINK_PREFIX}{os.getpid()}-0"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    ByteStore(two_dirs(store_dir)).close()
    assert not stale.exists() and live.exists()


def test_the_stores_nameless_files_are_named_while_cufile_has_them(store):
    """cuFile opens a registered file again by its path; the store's O_TMPFILE files get a
    name while registered and lose it at close, and a dead process's names are removed."""
    fake.reset()
    stale = os.path.join(store.config.nvme[0].path, f"{CUFILE_LINK_PREFIX}999999999-0")
    live = os.path.join(store.config.nvme[0].path, f"{CUFILE_LINK_PREFIX}{os.getppid()}-0")
    for name in (stale, live):
        open(name, "w").close()
    io = CuFile(store.native, 1, None, fake)
    try:
        mine = [n for n in _links(store) if n.startswith(f"{CUFILE_LINK_PREFIX}{os.getpid()}-")]
        assert len(mine) == 2  # one per device
        assert not os.path.exists(stale) and os.path.exists(live)
        round_trip(io, store, 6)
    finally:
        io.close()
        os.unlink(live)
    assert not _links(store)
    # A file whose name was taken back cannot be named again (the kernel's rule for O_TMPFILE).
    with pytest.raises(SsdtierError, match="named once"):
        CuFile(store.native, 1, None, fake)
    assert not _links(store) and fake.state["opens"] == fake.state["closes"] == 2


# ---------------------------------------------------------------- through attach()


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_exact_gradients_through_cufile(store_dir, gds, family):
    cfg = gds_config(store_dir, prefetch_layers=1)
    got = train(CONFIGS[family], cfg)
    assert_same(train(CONFIGS[family]), got)
    calls = gds.state["calls"]
    assert got[2].tensors_offloaded > 0
    assert got[2].bytes_written_nvme >= sum(c[3] for c in calls if c[0] == "write") > 0
    assert got[2].store.host_bytes_in == 0  # nothing went through the arena
    assert gds.state["opens"] == gds.state["closes"] == 1 and not gds.state["fds"]


def test_backward_reads_back_through_cufile(store_dir, gds):
    cfg = gds_config(store_dir)
    torch.manual_seed(0)
    model_cfg = CONFIGS["gpt"]
    from ssdtier.bench.models import batch_loss, build_model, make_batch

    model = build_model(model_cfg)
    batch = make_batch(model_cfg, 2, torch.Generator().manual_seed(2))
    with ssdtier.attach(model, cfg) as off:
        assert off.cpu.gds is not None
        loss = batch_loss(model, batch)
        wait_copies(off)  # every source let go: the backward must read
        loss.backward()
        reads = [c for c in gds.state["calls"] if c[0] == "read"]
        st = off.stats()
    assert reads and st.bytes_read_nvme > 0 and st.failed_reads == 0


def test_a_failed_cufile_write_keeps_the_source_with_exact_gradients(store_dir, gds, warned):
    gds.state["fail"] = "write"
    got = train(CONFIGS["gpt"], gds_config(store_dir))
    assert_same(train(CONFIGS["gpt"]), got)
    assert got[2].failed_writes > 0
    assert len(warned("cuFile write")) == 1


def test_a_failed_cufile_read_stops_the_backward_with_its_error(store_dir, gds):
    from ssdtier.bench.models import batch_loss, build_model, make_batch

    model = build_model(CONFIGS["gpt"])
    batch = make_batch(CONFIGS["gpt"], 2, torch.Generator().manual_seed(2))
    with ssdtier.attach(model, gds_config(store_dir)) as off:
        loss = batch_loss(model, batch)
        wait_copies(off)
        gds.state["fail"] = "read"
        with pytest.raises(SsdtierOSError, match="could not be read back.*cuFile read") as failed:
            loss.backward()
        del loss, failed  # the traceback holds the graph
        io = off._gds
    gc.collect()
    assert off.entries.live == 0 and not io.handles  # the graph gone, this offloader's cuFile let go


def test_out_of_space_keeps_activations_in_memory(store_dir, gds, warned):
    check_out_of_space(gds_config(store_dir, host="8KiB"), warned)


# ---------------------------------------------------------------- choosing cuFile


def test_cufile_asked_for_without_cuda_says_so_and_uses_the_arena(store_dir, warned, monkeypatch):
    probes = []
    monkeypatch.setattr(cufile, "probe_once", lambda: probes.append(1) or Gds(GdsState.UNAVAILABLE, "no CUDA device"))
    cfg = offload_config(store_dir)
    cfg.setdefault("io", {})["backend"] = "cufile"
    got = train(CONFIGS["gpt"], cfg)
    assert_same(train(CONFIGS["gpt"]), got)
    assert probes and len(warned("cuFile is unavailable (no CUDA device)")) == 1
    assert got[2].bytes_written_nvme > 0


def test_auto_does_not_probe_for_a_cpu_model(store_dir, monkeypatch):
    def no_probe():
        raise AssertionError("probed")

    monkeypatch.setattr(cufile, "probe_once", no_probe)
    model = torch.nn.Linear(4, 4)
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        assert off.cpu.gds is None


def test_cufile_without_nvme_says_so(warned):
    cfg = {"host": {"capacity": "1MiB"}, "io": {"backend": "cufile"}}
    with ssdtier.attach(torch.nn.Linear(4, 4), cfg) as off:
        assert off.cpu.gds is None
    assert len(warned("needs an [[nvme]] table naming a directory on a local NVMe")) == 1


def test_compatibility_mode_is_said_once(store_dir, gds, monkeypatch, warned):
    monkeypatch.setattr(cufile, "probe_once", lambda: Gds(GdsState.COMPAT, "nvidia-fs driver not loaded"))
    cfg = offload_config(store_dir)
    cfg.setdefault("io", {})["backend"] = "cufile"
    monkeypatch.delenv("CUFILE_LOGFILE_PATH", raising=False)
    with ssdtier.attach(torch.nn.Linear(4, 4), cfg) as off:
        assert off.cpu.gds is not None and off.uses_cufile
    assert len(warned("compatibility mode")) == 1
    log = os.environ["CUFILE_LOGFILE_PATH"]  # cuFile's log goes there, not to the working directory
    assert log.startswith(tempfile.gettempdir()) and os.stat(os.path.dirname(log)).st_uid == os.getuid()


def test_auto_takes_cufile_only_where_gds_is_usable(store_dir, gds, monkeypatch):
    monkeypatch.setattr(cufile, "_model_device", lambda m: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    for state, used in ((GdsState.USABLE, True), (GdsState.COMPAT, False)):
        monkeypatch.setattr(cufile, "probe_once", lambda s=state: Gds(s, "stand-in"))
        with ssdtier.attach(torch.nn.Linear(4, 4), offload_config(store_dir)) as off:
            assert (off.cpu.gds is not None) is used, state


def test_cufile_carries_a_gpu_models_activations_where_it_would_be_taken(monkeypatch):
    from ssdtier.config import Config

    cuda0, nvme = torch.device("cuda", 0), [{"path": "/x", "capacity": "1GiB"}]
    for state, backend, carried in (
        (GdsState.USABLE, "auto", True),
        (GdsState.COMPAT, "auto", False),
        (GdsState.COMPAT, "cufile", True),
        (GdsState.UNAVAILABLE, "cufile", False),
        (GdsState.USABLE, "io_uring", False),
    ):
        monkeypatch.setattr(cufile, "probe_once", lambda s=state: Gds(s, "stand-in"))
        cfg = Config.from_dict({"io": {"backend": backend}, "nvme": nvme})
        assert cufile.carries(cfg, cuda0) is carried, (state, backend)
        no_nvme = Config.from_dict({"io": {"backend": backend}})
        assert not cufile.carries(cfg, None) and not cufile.carries(no_nvme, cuda0)


def test_out_of_memory_reading_ahead_leaves_the_reads_to_the_unpacks(store_dir, gds, monkeypatch):
    """cuFile reads into new GPU memory: a read-ahead that finds none stops reading ahead
    until the next forward, and each unpack reads its own entry."""
    from ssdtier.offload import cpu

    real_empty = torch.empty
    state = {"ahead": True, "refused": 0}

    def empty(*a, **k):
        if state["ahead"] and k.get("dtype") is torch.uint8:
            state["refused"] += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real_empty(*a, **k)

    class Torch:  # cpu.py's torch, with empty() refusing read-ahead buffers
        def __getattr__(self, name):
            return empty if name == "empty" else getattr(torch, name)

    got_ref = train(CONFIGS["gpt"])
    ahead = ssdtier.offload.readahead.ReadAhead._want

    def want(self, entry):
        state["ahead"] = True
        try:
            return ahead(self, entry)
        finally:
            state["ahead"] = False

    monkeypatch.setattr(cpu, "torch", Torch())
    monkeypatch.setattr(ssdtier.offload.readahead.ReadAhead, "_want", want)
    got = train(CONFIGS["gpt"], gds_config(store_dir, prefetch_layers=2))
    assert_same(got_ref, got)
    assert 1 <= state["refused"] <= 3  # once per forward (3 micro-batches), then no more tries
    assert got[2].bytes_read_nvme > 0  # read by the unpacks


def test_a_driver_open_that_never_returns_falls_back_to_the_arena(store_dir, gds, monkeypatch, warned):
    release = threading.Event()
    monkeypatch.setattr(gds, "driver_open", lambda: release.wait(30))
    monkeypatch.setattr(cufile, "OPEN_TIMEOUT_S", 0.2)
    monkeypatch.setattr(cufile, "_driver_stuck", False)
    monkeypatch.setattr(cufile, "_driver_users", 0)  # an offloader an earlier test left may hold it
    try:
        for _ in range(2):  # the second attach does not wait again
            t0 = time.monotonic()
            with ssdtier.attach(torch.nn.Linear(4, 4), gds_config(store_dir)) as off:
                assert not off.uses_cufile
            assert time.monotonic() - t0 < 5
        msgs = warned("cuFile could not be set up")
        assert len(msgs) == 2 and "did not return in 0.2 s" in msgs[0] and "earlier in this process" in msgs[1]
    finally:
        release.set()


def test_reads_do_not_queue_behind_writes(store):
    """The backward's reads have their own workers: writes of the forward still queued (here
    held) do not delay them."""
    fake.reset()
    io = CuFile(store.native, 1, None, fake)
    hold = fake.state["hold_writes"] = threading.Event()
    try:
        hold.set()
        src = source(8192, 6)
        first = store.native.reserve_unslotted(8192)
        io.write(first, src.data_ptr(), 8192, None).wait()
        hold.clear()
        others = [source(8192, 7 + i) for i in range(4)]
        held = [io.write(store.native.reserve_unslotted(8192), s.data_ptr(), 8192, None) for s in others]
        out = torch.zeros(8192, dtype=torch.uint8)
        io.read(first, out.data_ptr(), 8192, None).wait()
        assert torch.equal(out, src) and not any(t.done() for t in held)
    finally:
        hold.set()
        io.close()


def test_writes_the_backward_overtook_are_dropped(store_dir, gds):
    """A disk slower than the step: writes still queued when the backward wants their entries
    are dropped (the sources serve it), so the disk is left to reads."""
    from ssdtier.bench.models import batch_loss, build_model, make_batch

    torch.manual_seed(0)
    model = build_model(CONFIGS["gpt"])
    batch = make_batch(CONFIGS["gpt"], 2, torch.Generator().manual_seed(2))
    ref = build_model(CONFIGS["gpt"])
    ref.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    batch_loss(ref, batch).backward()
    hold = gds.state["hold_writes"] = threading.Event()  # the disk takes nothing until set
    cfg = gds_config(store_dir)
    cfg["io"]["threads"] = 1
    try:
        with ssdtier.attach(model, cfg) as off:
            torch.manual_seed(1)
            loss = batch_loss(model, batch)
            loss.backward()
            skipped = off.stats().writes_skipped
            hold.set()
            st = off.stats()
    finally:
        hold.set()
    queued = st.tensors_offloaded
    assert queued > 2 and skipped == queued - 1, (queued, skipped)  # all but the one running
    assert st.bytes_read_nvme == 0 and st.failed_writes == 0
    assert f"{skipped} writes not needed" in str(st)
    assert len({c[4] for c in gds.state["calls"] if c[0] == "write"}) <= 1  # the disk wrote one entry
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_two_training_threads_through_cufile(store_dir, gds):
    check_two_training_threads(gds_config(store_dir))
    assert any(c[0] == "read" for c in gds.state["calls"])


class _SaveEmpty(torch.autograd.Function):
    """Saves a tensor of no bytes for its backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.new_empty(0))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        assert ctx.saved_tensors[0].numel() == 0
        return g * 2


@pytest.mark.usefixtures("gpu")
def test_a_storage_of_no_bytes_pins_no_arena_with_cufile(store_dir, gds, monkeypatch):
    # It goes the arena transport's way (cuFile moves no empty buffer), which must not pin
    # the arena that cuFile never uses: that would take seconds inside the forward.
    from ssdtier.offload import offloader

    monkeypatch.setattr(offloader.Offloader, "_streamed", frozenset({"cuda", "cpu"}))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return _SaveEmpty.apply(self.lin(x))

    model = Model()
    x = torch.randn(2, 4, requires_grad=True)
    with ssdtier.attach(model, gds_config(store_dir, min_tensor_bytes=0)) as off:
        assert off.uses_cufile
        model(x).sum().backward()
    assert off.stats().tensors_offloaded > 0 and not FakeGPU.now.pinned_on


def test_cufile_writes_hold_at_most_their_bound_of_sources(store_dir, gds, monkeypatch):
    """A disk slower than the forward: cuFile writes hold their sources, so the forward waits
    for the oldest once they would pass the bound (here 64 KiB), as copies to the arena do.
    The disk takes nothing until the forward first waits: the wait is certain."""
    from ssdtier.offload import cpu, cuda

    monkeypatch.setattr(cuda, "QUEUE_MIN", 64 << 10)
    hold = gds.state["hold_writes"] = threading.Event()
    waits = []
    wait = cpu.CpuTransport._wait_gds

    def first_wait_frees_the_disk(self):
        waits.append(self.gds_inflight)
        hold.set()
        wait(self)

    monkeypatch.setattr(cpu.CpuTransport, "_wait_gds", first_wait_frees_the_disk)
    sizes, peaks = [], []
    write = cufile.CuFile.write
    monkeypatch.setattr(cufile.CuFile, "write", lambda self, k, p, n, r: sizes.append(n) or write(self, k, p, n, r))
    try:
        got = train(
            CONFIGS["gpt"], gds_config(store_dir), micro=2, batch=8, on_step=lambda off: peaks.append(off.cpu.gds_peak)
        )
    finally:
        hold.set()
    assert_same(train(CONFIGS["gpt"], micro=2, batch=8), got)
    assert waits and sum(sizes) > 4 * (64 << 10)
    assert 0 < max(peaks) <= max(64 << 10, max(sizes))  # a larger one alone
    assert got[2].tensors_offloaded == len(sizes)
