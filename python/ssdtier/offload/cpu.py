"""The CPU transport: a CPU storage goes to NVMe from its own pages (zero copy) and comes
back straight into the page-aligned buffer that becomes the restored storage; the arena
takes only what cannot (with ``io.zero_copy`` off, or a storage not 64-byte aligned)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from ..errors import SsdtierError
from ._util import PAGE, aligned_storage
from .entry import Entry

if TYPE_CHECKING:
    from .forward import Fwd
    from .offloader import Offloader


class CpuTransport:
    def __init__(self, off: Offloader) -> None:
        self.off = off
        self.native = off.store.native
        self.zero_copy = off.config.io.zero_copy
        self.writing: deque[Entry] = deque()  # writes from the tensors' own pages in flight, in order

    def offload(self, st: torch.UntypedStorage, nbytes: int, f: Fwd) -> Entry:
        ptr = st.data_ptr()
        lead = ptr % PAGE
        # The restored view starts `lead` bytes into its page as the original did; a
        # multiple of 64 keeps every dtype's views aligned (torch allocates at 64).
        if self.zero_copy and lead % 64 == 0:
            # Held until written; the ticket holds it too, so its pages outlive the write.
            key, ticket = self.native.write_from(ptr - lead, lead + nbytes, st)
            e = Entry(key, nbytes, st.device, False, f)
            e.lead, e.src, e.ticket, e.wrote = lead, st, ticket, ptr
            self.off.res.writing += nbytes
            self.writing.append(e)
            return e
        key = self.native.put_from(ptr, nbytes, st)  # a copy into the arena (or to NVMe)
        return Entry(key, nbytes, st.device, False, f)

    def poll(self) -> None:
        """Drop the sources of writes that are done."""
        if self.writing:
            with self.off._lock:  # another thread's pack or unpack may poll too
                while self.writing and self.writing[0].ticket.done():
                    self._end_write(self.writing.popleft())

    def _end_write(self, e: Entry) -> None:
        off = self.off
        ticket, e.ticket = e.ticket, None
        failed: SsdtierError | None = None
        try:
            ticket.wait()
        except SsdtierError as err:
            failed = err
        if failed is None and e.refs:
            failed = off._moved(e, e.src)
        if e.refs == 0:  # released while writing (its key was discarded then)
            self.drop_src(e)
        elif failed is not None:
            off._copy_lost(e, failed)  # the source stays in memory and serves the unpack
        elif not e.wanted:
            self.drop_src(e)
        # Else the backward is about to use it: it stays and serves the unpack, with no read.

    def drop_src(self, e: Entry) -> None:
        if e.src is not None:
            e.src = None
            self.off.res.writing -= e.nbytes

    def start_read(self, e: Entry) -> None:
        """The bytes go from NVMe straight into the page-aligned buffer that becomes the
        restored storage; the arena is not used, so read-ahead never evicts what is about to
        be needed. The entry starts `lead` bytes before the data (a write covers whole pages)."""
        st, pad = aligned_storage(e.lead + e.nbytes)
        self.off._track(st, e.nbytes)
        ticket = self.native.read_into(e.key, st.data_ptr() + pad, st.nbytes() - pad, st)
        e.reading = (st, pad + e.lead, ticket, ticket is None)  # None: copied from the arena

    def close(self) -> None:
        for e in self.writing:
            e.ticket = None
            self.drop_src(e)
        self.writing.clear()
