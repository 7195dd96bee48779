"""Stores kept past ``detach()`` for the next ``attach()`` with the same store settings, while
``reusing_stores()`` is open: mapping, registering and pinning a host arena takes seconds
per few GiB, and a bench attaches for every setting and probe."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config
    from ..ram import Available
    from ..store import ByteStore
    from .cuda import Pinned

_lock = threading.Lock()
_depth = 0  # reusing_stores() contexts open


@dataclass(frozen=True)
class Shelved:
    key: tuple
    store: ByteStore
    pinned: Pinned | None  # its arena registered with CUDA, when it was


_shelf: Shelved | None = None


def store_key(cfg: Config) -> tuple:
    """What a store is made from: two configs with the same key make the same store."""
    cfg = replace(cfg, host=cfg.host.sized())  # as ByteStore sizes it
    return cfg.host, cfg.nvme, cfg.io, cfg.policy.eviction


@contextlib.contextmanager
def reusing_stores() -> Iterator[None]:
    """Inside, a detached offloader's store (its host arena mapped, registered and pinned)
    waits for the next attach with the same store settings; the last one closes on exit."""
    global _depth
    pid = os.getpid()
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        if os.getpid() == pid:  # a fork child leaving its parent's context has nothing of it
            with _lock:
                _depth -= 1
                left = _take() if _depth == 0 else None
            if left is not None:
                _close(left)


def wanted() -> bool:
    """Whether a store that is done with should be shelved rather than closed."""
    return _depth > 0


def with_shelved(avail: Available | None) -> Available | None:
    """Memory left, the shelved store's arena counted as free: the next attach may take it."""
    shelved = _shelf
    arena = shelved.store.arena if shelved is not None else None
    if avail is None or arena is None:
        return avail
    return replace(avail, bytes=avail.bytes + arena.numel())


def take(cfg: Config) -> Shelved | None:
    """The shelved store if made from ``cfg``'s store settings, its counters from zero; a
    shelved one of other settings is closed (one arena at a time)."""
    with _lock:
        got = _take()
    if got is None:
        return None
    if got.store.closed or got.key != store_key(cfg):
        _close(got)
        return None
    got.store.native.reset_counters()
    return got


def put(store: ByteStore, pinned: Pinned | None) -> bool:
    """Shelve ``store`` for the next attach: only if it is open, holds no entry and has not
    failed; else the caller closes it. A store shelved before is closed."""
    if not wanted() or store.closed:
        return False
    try:
        store.native.flush()  # the writes under way end, as closing would wait for them
    except Exception:  # noqa: BLE001 - a failed write: closed by the caller, which says so
        return False
    st = store.stats()
    if st.entries or st.failure is not None or st.quarantined_bytes:
        return False
    global _shelf
    if pinned is not None and pinned.arena is None:  # its registration failed: the next attach tries again
        pinned = None
    new = Shelved(store_key(store.config), store, pinned)
    with _lock:
        if _depth == 0:  # the context ended meanwhile: nothing would close it
            return False
        old, _shelf = _shelf, new
    if old is not None and old.store is not store:
        _close(old)
    return True


def _take() -> Shelved | None:
    global _shelf
    got, _shelf = _shelf, None
    return got


def _after_fork_in_child() -> None:
    """A fork child (a DataLoader worker) never takes the parent's store: its rings, threads
    and pinned pages are the parent's."""
    global _lock, _shelf, _depth
    if _shelf is not None and _shelf.pinned is not None:
        _shelf.pinned.arena = None  # not unregistered here: CUDA is the parent's
    _lock, _shelf, _depth = threading.Lock(), None, 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close(s: Shelved) -> None:
    if s.pinned is not None:
        s.pinned.close()  # unregistered before the store unmaps the arena
    s.store.close()
