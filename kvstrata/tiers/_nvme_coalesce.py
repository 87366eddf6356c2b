"""Coalesced slot writes of the NVMe tier: the small-chunk puts queued while every I/O thread
is busy are taken together by the next free one, which writes each run of adjacent slots with
one ``pwritev`` and posts all their outcomes to the event loop at once.

Why: a put that is a pool job of its own costs two thread wake-ups (the I/O thread's, then the
loop's for its completion) and one 256 KiB write; on two busy cores the hand-offs cost more CPU
than the write. An eviction round demotes all its victims at once (``asyncio.gather``), so
their puts queue up: taken a share at a time (slots under one hold of the allocator's lock, so
fresh slots of one slab file are adjacent) they cost a few wake-ups and a few large writes.

The format is unchanged: each slot gets what :meth:`Slabs.write` writes — its header block,
the payload, the last block zero-padded — plus zeros up to the slot's end when the payload is
smaller than its class (bytes nothing reads), so a run is one contiguous range. A crash inside
a coalesced write leaves each slot complete or failing its checksums, as with single writes: a
torn slot is freed at the next start, never served. Each put still gets its own future, set in
the I/O thread, so cancelling a put behaves as with a job of its own (a write not started is
skipped; one running goes on and its slot is freed once written). ``nvme-fsync always``:
one ``fdatasync`` per slab file per job, before any of the job's puts is acknowledged. A job
of one put is :meth:`Slabs.write` itself; writes that cannot go straight from the payload
(buffered I/O, kvikio, an unaligned payload) are written one by one in the job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvstrata.chunks import ChunkMeta
from kvstrata.tiers._nvme_format import HEADER_SIZE
from kvstrata.tiers._nvme_io import BLOCK, STAGING, PosixBackend, _aligned, _pwrite_all, _staging
from kvstrata.tiers._nvme_slabs import Slabs, SlotRef
from kvstrata.tiers.base import TierUnavailable

log = logging.getLogger(__name__)

#: slots per ``pwritev``: at most 4 buffers each (under IOV_MAX, 1024); their header and last
#: blocks use the first 512 KiB of the thread's staging buffer, the zero filler the rest
MAX_RUN = 64
_FILLER_AT = 2 * MAX_RUN * BLOCK

Written = tuple[ChunkMeta, SlotRef]
Item = tuple[SlotRef, "SlotJob", ChunkMeta]  # a slot, its put, the meta stored


@dataclass(slots=True, eq=False)
class SlotJob:
    """One put's slot write: what to write, the future the I/O thread settles (``done``) and
    the one the put awaits on its event loop (``waiter``), set from ``done`` a batch at a time."""

    meta: ChunkMeta
    payload: memoryview
    done: Future[Written]
    waiter: asyncio.Future[Written]
    loop: asyncio.AbstractEventLoop


class SlotBatcher:
    """The queue of slot writes and the pool jobs that drain it: at most ``threads`` drain
    jobs at once, each taking its share of what is queued (up to :data:`MAX_RUN` writes) and,
    while more is queued, submitting itself again (behind other pool work: a long eviction
    round does not hold reads back). Puts queued while every I/O thread is busy are thus taken
    together, without a round trip through the event loop, and a drain posts the outcomes of
    all the writes it took to the loop at once."""

    def __init__(self, slabs: Slabs, pool: ThreadPoolExecutor, threads: int, sync: bool) -> None:
        self._slabs = slabs
        self._pool = pool
        self._threads = max(1, threads)
        self._sync = sync
        self._lock = threading.Lock()
        self._queued: deque[SlotJob] = deque()
        self._draining = 0  # drain jobs submitted and not yet finished

    @property
    def busy(self) -> bool:
        """Writes wait in the queue for a drain (they are piling up: the C pool leaves new
        ones to it too, as taken together they cost less than a C job each)."""
        return bool(self._queued)

    async def write(self, meta: ChunkMeta, payload: memoryview) -> Written:
        """Write the chunk to a slot: (stored meta, slot). OSError and IntegrityError as
        :meth:`Slabs.write`; TierUnavailable once the pool is shut down. A put cancelled while
        queued is not written; one cancelled later has its slot freed once written."""
        loop = asyncio.get_running_loop()
        job = SlotJob(meta, payload, Future(), loop.create_future(), loop)
        with self._lock:
            self._queued.append(job)
            start = self._draining < self._threads
            self._draining += start
        if start:
            try:
                self._pool.submit(self._drain)
            except RuntimeError:  # the pool is shut down: the tier closed meanwhile
                with self._lock:
                    self._draining -= 1
                    self._queued.remove(job)
                raise TierUnavailable("nvme tier is closed") from None
        try:
            return await job.waiter
        except asyncio.CancelledError:
            if not job.done.cancel():  # running or done: the slot is written, or will be
                job.done.add_done_callback(self._undo)
            raise

    def _drain(self) -> None:
        while True:
            with self._lock:
                share = -(-len(self._queued) // self._draining)  # ceil: the backlog split
                jobs = [self._queued.popleft() for _ in range(min(share, MAX_RUN))]
                if not jobs:
                    self._draining -= 1
                    return
            write_slots(self._slabs, jobs, self._sync)
            try:
                jobs[0].loop.call_soon_threadsafe(_deliver, jobs)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            with self._lock:
                if not self._queued:
                    self._draining -= 1
                    return
            try:  # more queued: again, but behind the reads and deletes submitted meanwhile
                self._pool.submit(self._drain)
                return
            except RuntimeError:  # the pool is shutting down: finish the queue here
                continue

    def _undo(self, done: Future[Written]) -> None:
        """Free the slot of a write whose put was cancelled, if the write succeeded."""
        if done.cancelled() or done.exception() is not None:
            return
        try:
            self._slabs.discard(done.result()[1])
        except OSError as exc:
            log.warning("nvme: undoing a cancelled write failed: %s", exc)


def _deliver(jobs: list[SlotJob]) -> None:
    """On the loop: hand each write's outcome to its put (one not waiting any more is skipped)."""
    for job in jobs:
        if job.waiter.done():
            continue
        if job.done.cancelled():
            job.waiter.cancel()
        elif (exc := job.done.exception()) is not None:
            job.waiter.set_exception(exc)
        else:
            job.waiter.set_result(job.done.result())


def write_slots(slabs: Slabs, jobs: list[SlotJob], sync: bool) -> None:
    """Write ``jobs`` (an I/O thread); every future is settled, never raises."""
    live = [job for job in jobs if job.done.set_running_or_notify_cancel()]
    try:
        direct = isinstance(slabs.backend, PosixBackend) and slabs.backend.direct
        together = [j for j in live if direct and _aligned(j.payload)] if len(live) > 1 else []
        for job in live:
            if job not in together:
                try:
                    _settle(job, slabs.write(job.meta, job.payload, sync))
                except BaseException as exc:  # handed to the waiter
                    _settle(job, exc)
        if together:
            _write_coalesced(slabs, together, sync)
    except BaseException as exc:  # a bug here must not leave a put hanging
        for job in live:
            _settle(job, exc)


def _write_coalesced(slabs: Slabs, jobs: list[SlotJob], sync: bool) -> None:
    ready: list[Item] = []
    by_size: dict[int, list[tuple[SlotJob, ChunkMeta]]] = {}
    for job in jobs:
        try:
            stored = slabs.stored(job.meta, job.payload)
        except BaseException as exc:  # IntegrityError: to the waiter
            _settle(job, exc)
            continue
        by_size.setdefault(slabs.slot_size(job.meta.size), []).append((job, stored))
    for size, group in by_size.items():
        refs, error = slabs.allocate_many(size, len(group))
        for job, _ in group[len(refs) :]:
            _settle(job, error or OSError("no slot"))
        ready += [(ref, job, stored) for ref, (job, stored) in zip(refs, group, strict=False)]
    ready.sort(key=lambda item: (item[0].slab, item[0].offset))
    written: list[Item] = []
    for run in _runs(ready):
        try:
            _write_run(slabs, run)
        except OSError as exc:
            _fail(slabs, run, exc)
        else:
            written += run
    if sync:
        written = _datasync(slabs, written)
    for ref, job, stored in written:
        _settle(job, (stored, ref))


def _runs(items: list[Item]) -> list[list[Item]]:
    """Split offset-sorted slots into runs of adjacent slots of one slab file."""
    runs: list[list[Item]] = []
    for item in items:
        ref = item[0]
        if runs and len(runs[-1]) < MAX_RUN:
            last = runs[-1][-1][0]
            if last.slab == ref.slab and last.offset + last.slot_size == ref.offset:
                runs[-1].append(item)
                continue
        runs.append([item])
    return runs


def _write_run(slabs: Slabs, run: list[Item]) -> None:
    """One ``pwritev`` of adjacent slots: per slot its header block, the payload's whole
    blocks, the zero-padded last block and zeros to the slot's end."""
    stage = _staging()
    views: list[memoryview] = []
    zeroed = 0
    for i, (ref, job, stored) in enumerate(run):
        head = stage[2 * i * BLOCK : (2 * i + 1) * BLOCK]
        head[:] = slabs.header(stored, ref)
        payload = job.payload
        body = len(payload) // BLOCK * BLOCK
        tail = len(payload) - body
        views += [head, payload[:body]]
        if tail:
            last = stage[(2 * i + 1) * BLOCK : (2 * i + 2) * BLOCK]
            last[:tail] = payload[body:]
            np.frombuffer(last, dtype=np.uint8)[tail:] = 0
            views.append(last)
        filler = ref.slot_size - HEADER_SIZE - (body + (BLOCK if tail else 0))
        if filler:
            if filler > STAGING - _FILLER_AT:
                raise OSError(22, "slot filler larger than the staging buffer")
            if filler > zeroed:
                np.frombuffer(stage, dtype=np.uint8)[_FILLER_AT : _FILLER_AT + filler] = 0
                zeroed = filler
            views.append(stage[_FILLER_AT : _FILLER_AT + filler])
    _pwrite_all(slabs.slabs[run[0][0].slab].fd, views, run[0][0].offset)


def _datasync(slabs: Slabs, written: list[Item]) -> list[Item]:
    """``always``: one fdatasync per slab file written; the slots of one that fails fail."""
    kept: list[Item] = []
    for number in dict.fromkeys(ref.slab for ref, _, _ in written):
        mine = [item for item in written if item[0].slab == number]
        try:
            os.fdatasync(slabs.slabs[number].fd)
        except OSError as exc:
            _fail(slabs, mine, exc)
        else:
            kept += mine
    return kept


def _fail(slabs: Slabs, items: list[Item], exc: BaseException) -> None:
    for ref, job, _ in items:
        slabs.discard(ref)
        _settle(job, exc)


def _settle(job: SlotJob, outcome: Written | BaseException) -> None:
    """Set the job's future once (a cancelled or already settled one is left as it is)."""
    try:
        if isinstance(outcome, BaseException):
            job.done.set_exception(outcome)
        else:
            job.done.set_result(outcome)
    except InvalidStateError:
        pass
