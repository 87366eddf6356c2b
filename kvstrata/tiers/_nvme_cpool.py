"""Slab slot reads and writes through the C I/O pool (``_iopool``), without Python threads.

Why: at a few puts or gets in flight each slot I/O on the tier's thread pool costs two thread
hand-offs under the GIL — the loop waking an I/O thread (``SimpleQueue.put``) and that thread
waking the loop (``call_soon_threadsafe``'s self-pipe) — and on two busy cores those cost more
CPU than the 256 KiB write itself. Here the loop hands the ``pwritev``/``preadv`` to POSIX
threads that never take the GIL, and they signal completions through one eventfd the loop
watches (``add_reader``), all the completions waiting taken per wakeup.

The bytes are exactly those of the pool path (``Slabs.write`` / ``Slabs.read``): the header
block, the payload's whole blocks straight from and into the caller's buffer, the last block
zero-padded through a block of this module's own aligned buffer. What runs on the loop is
what is cheap: the checksum (xxh3, ~20 µs per 256 KiB), the header, taking a slot the slab
files have room for already. Everything else goes the pool way, as before: a slot that needs a
slab file grown or created, a payload or buffer that is not 4096-aligned, the buffered and
kvikio backends, and writes while ``threads`` I/Os are in the C pool already or while writes
wait in :class:`SlotBatcher`'s queue (they are piling up, as in an eviction round: taken
together there, one ``pwritev`` per run of adjacent slots, they cost less than a C job each).
``nvme-fsync always``: the C job's ``fdatasync`` comes before the put is acknowledged. A put
or get cancelled while its I/O runs leaves it to finish (its buffers are held until then); a
slot written for a cancelled put is freed once written. ``close()`` waits for the jobs queued
and running.

Chosen at run time: without the extension (``_iopool`` not built) the tier uses the pool path.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers._nvme_format import HEADER_SIZE
from kvstrata.tiers._nvme_io import BLOCK, PosixBackend, _aligned
from kvstrata.tiers._nvme_slabs import Slabs, SlotRef

try:
    from kvstrata.tiers._iopool import Pool
except ImportError:  # not built: the pool path
    Pool = None

log = logging.getLogger(__name__)

#: header + last blocks per buffer pair; more I/Os in flight than this wait for a pair
PAIRS = 256

Done = Callable[[int], None]


def usable(slabs: Slabs) -> bool:
    """The C path serves this tier: the extension is built and slabs are O_DIRECT POSIX."""
    backend = slabs.backend
    return Pool is not None and isinstance(backend, PosixBackend) and backend.direct


class CSlotIO:
    """The C pool of one tier and the slot I/O it runs; see the module docstring."""

    def __init__(self, slabs: Slabs, threads: int, pool: ThreadPoolExecutor, sync: bool) -> None:
        assert Pool is not None
        self._slabs = slabs
        self._pool = pool  # the tier's: for the rare clean-up (a failed or cancelled write)
        self._sync = sync
        self.threads = max(1, threads)
        self._cpool = Pool(self.threads)
        self._blocks = memoryview(mmap.mmap(-1, 2 * PAIRS * BLOCK))  # page aligned
        self._free = list(range(PAIRS))
        self._done: dict[int, Done] = {}
        self._tags = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0
        self.closed = False

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._cpool.fileno())
            loop.add_reader(self._cpool.fileno(), self._completed)
            self._loop = loop
        return loop

    def _completed(self) -> None:
        for tag, result in self._cpool.completions():
            done = self._done.pop(tag)
            try:
                done(result)
            except Exception:  # a bug in a completion must not stop the others
                log.exception("nvme: slot I/O completion failed")

    def _submit(self, write: bool, fd: int, offset: int, views: list[Any], done: Done) -> None:
        tag = next(self._tags)
        self._done[tag] = done
        try:
            self._cpool.submit(tag, write, fd, offset, views, write and self._sync)
        except BaseException:
            del self._done[tag]
            raise
        self.in_flight += 1

    def _pair(self) -> tuple[int, memoryview, memoryview] | None:
        if not self._free:
            return None
        n = self._free.pop()
        at = 2 * n * BLOCK
        return n, self._blocks[at : at + BLOCK], self._blocks[at + BLOCK : at + 2 * BLOCK]

    # -- writes -----------------------------------------------------------------------------

    async def write(self, meta: ChunkMeta, payload: memoryview) -> tuple[ChunkMeta, SlotRef] | None:
        """Write the chunk to a slot as :meth:`Slabs.write` does; None when this one goes the
        pool way (see the module docstring). OSError and IntegrityError as ``Slabs.write``."""
        slabs = self._slabs
        if self.closed or self.in_flight >= self.threads or not _aligned(payload):
            return None
        size = slabs.slot_size(meta.size)
        if not self._free:
            return None
        ref = slabs.take_ready(size)
        if ref is None:
            return None
        try:
            stored = slabs.stored(meta, payload)
        except BaseException:  # IntegrityError: the slot was never written, free as it is
            slabs.release(ref)
            raise
        loop = self._attach()
        pair = self._pair()
        assert pair is not None  # checked above, and nothing awaited since
        number, head, last = pair
        head[:] = slabs.header(stored, ref)
        body = len(payload) // BLOCK * BLOCK
        tail = len(payload) - body
        views: list[Any] = [head, payload[:body]] if body else [head]
        if tail:
            last[:tail] = payload[body:]
            np.frombuffer(last, dtype=np.uint8)[tail:] = 0
            views.append(last)
        want = HEADER_SIZE + body + (BLOCK if tail else 0)
        waiter: asyncio.Future[int] = loop.create_future()

        def done(result: int) -> None:
            self.in_flight -= 1
            self._free.append(number)
            if waiter.cancelled():  # the put is gone: its slot must not stay, written or torn
                self._clean(ref)
                return
            waiter.set_result(result)

        try:
            self._submit(True, slabs.slabs[ref.slab].fd, ref.offset, views, done)
        except BaseException:
            self._free.append(number)
            slabs.release(ref)  # never written: free again as it is
            raise
        result = await waiter
        if result != want:
            self._clean(ref)  # as Slabs.write: the slot invalidated and free again
            raise _error(result, "short write of a slab slot")
        return stored, ref

    def _clean(self, ref: SlotRef) -> None:
        try:
            self._pool.submit(self._slabs.discard, ref)
        except RuntimeError:  # the pool is shut down (closing): here, then
            self._slabs.discard(ref)

    # -- reads ------------------------------------------------------------------------------

    async def read(
        self, key: ChunkKey, ref: SlotRef, out: memoryview, want: ChunkMeta
    ) -> ChunkMeta | None:
        """:meth:`Slabs.read` through the C pool; None when this one goes the pool way."""
        dst = out[: want.size]
        slab = self._slabs.slabs.get(ref.slab)
        if self.closed or slab is None or not _aligned(dst):
            return None
        pair = self._pair()
        if pair is None:
            return None
        loop = self._attach()
        number, head, last = pair
        body = len(dst) // BLOCK * BLOCK
        tail = len(dst) - body
        views: list[Any] = [head, dst[:body]] if body else [head]
        if tail:
            views.append(last)
        waiter: asyncio.Future[tuple[bytes, int]] = loop.create_future()

        def done(result: int) -> None:
            self.in_flight -= 1
            try:
                if waiter.cancelled():
                    return
                if result < 0:
                    waiter.set_exception(_error(result, "slot read failed"))
                    return
                if result < HEADER_SIZE:
                    waiter.set_result((b"", 0))
                    return
                got = min(result - HEADER_SIZE, len(dst))
                if got > body:
                    dst[body:got] = last[: got - body]
                waiter.set_result((bytes(head), got))
            finally:
                self._free.append(number)

        try:
            self._submit(False, slab.fd, ref.offset, views, done)
        except BaseException:
            self._free.append(number)
            raise
        block, got = await waiter
        return self._slabs.verify(key, ref, want, block, got, out)

    # -- life -------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the jobs queued and running, then hand out their completions."""
        self.closed = True
        self._cpool.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._cpool.fileno())
        self._completed()


def _error(result: int, what: str) -> OSError:
    if result < 0:
        return OSError(-result, os.strerror(-result))
    return OSError(errno.EIO, what)
