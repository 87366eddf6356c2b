"""Coalesced slot writes (``_nvme_coalesce``): puts queued while every I/O thread is busy are
written together, one ``pwritev`` per run of adjacent slots, in the same on-disk format; a
failed run fails only its own puts and frees their slots; ``always`` syncs each slab once per
job, before any of its puts returns; a put cancelled while queued is never written."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvstrata.tiers import _nvme_coalesce, _nvme_cpool
from kvstrata.tiers.base import TierIOError
from kvstrata.tiers.nvme import NvmeTier
from tests.test_nvme_slabs import chunk, read, run, slab_files

SIZES = [8192, 10_000, 4096, 200_000, 262_144]  # slot-filling and smaller than their class


@pytest.fixture(autouse=True)
def _pool_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These test the pool path's batching: the C pool (``_nvme_cpool``) stays out."""
    monkeypatch.setattr(_nvme_cpool, "Pool", None)


def aligned(data: bytes) -> memoryview:
    """``data`` at a page-aligned address (as in an arena slot): written straight from there."""
    view = memoryview(mmap.mmap(-1, len(data)))
    view[:] = data
    return view


class _Runs:
    """Records the slots of every coalesced ``pwritev`` (and can fail the n-th one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int = -1) -> None:
        self.sizes: list[int] = []
        self._real = _nvme_coalesce._write_run
        self._fail_at = fail_at
        monkeypatch.setattr(_nvme_coalesce, "_write_run", self)

    def __call__(self, slabs: Any, run: list[Any]) -> None:
        self.sizes.append(len(run))
        if len(self.sizes) - 1 == self._fail_at:
            raise OSError(errno.EIO, "injected write failure")
        self._real(slabs, run)


async def _queued(tier: NvmeTier, n: int) -> None:
    """Yield to the loop until ``n`` slot writes wait in the tier's queue (bounded)."""
    for _ in range(10_000):
        if len(tier._slot_writes._queued) >= n:
            return
        await asyncio.sleep(0)  # a pass of the loop, not a wait on the clock
    raise AssertionError(f"{len(tier._slot_writes._queued)} of {n} writes queued")


async def _held(tier: NvmeTier, puts: list[Any]) -> list[BaseException | None]:
    """Run ``puts`` while the tier's only I/O thread is held, so that they queue up and one
    drain job takes them together."""
    gate = threading.Event()
    blocker = tier._pool.submit(gate.wait, 30)
    tasks = [asyncio.ensure_future(p) for p in puts]
    await _queued(tier, len(puts))
    gate.set()
    blocker.result(timeout=30)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in results]


def test_queued_puts_are_written_together_and_read_back_after_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [chunk(i, SIZES[i % len(SIZES)]) for i in range(40)]
    runs = _Runs(monkeypatch)

    async def write(tier: NvmeTier) -> None:
        assert tier.backend.direct, "needs O_DIRECT (the coalesced path)"
        results = await _held(tier, [tier.put(m, aligned(d)) for m, d in items])
        assert results == [None] * len(items)
        assert sum(runs.sizes) == len(items) and max(runs.sizes) > 1
        assert len(runs.sizes) < len(items)  # fewer writes than puts
        for meta, data in items:
            assert await read(tier, meta) == data

    async def reopen(tier: NvmeTier) -> None:
        assert tier.info()["slab_chunks"] == len(items)
        assert tier.rebuild_report is not None and tier.rebuild_report.slots_invalid == 0
        for meta, data in items:
            assert await read(tier, meta) == data

    run(tmp_path, write, io_threads=1, fsync="never")
    run(tmp_path, reopen)


def test_a_failed_run_fails_its_puts_only_and_frees_their_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [chunk(i, 8192) for i in range(6)] + [chunk(100 + i, 10_000) for i in range(6)]
    runs = _Runs(monkeypatch, fail_at=0)  # the first run: one of the two slot sizes

    async def write(tier: NvmeTier) -> None:
        results = await _held(tier, [tier.put(m, aligned(d)) for m, d in items])
        failed = [i for i, r in enumerate(results) if r is not None]
        assert runs.sizes == [6, 6] and len(failed) == 6
        assert all(isinstance(results[i], TierIOError) for i in failed)
        assert {items[i][0].size for i in failed} == {items[failed[0]][0].size}
        kept = [items[i] for i in range(len(items)) if i not in failed]
        for meta, data in kept:
            assert await read(tier, meta) == data
        for i in failed:
            assert not await tier.contains(items[i][0].key)
        assert tier.stats.extra["eio"] == 6
        again = items[failed[0]]  # the freed slots are reused (no new slab file is made)
        count = len(slab_files(tmp_path))
        await tier.put(*again)
        assert len(slab_files(tmp_path)) == count and await read(tier, again[0]) == again[1]

    async def reopen(tier: NvmeTier) -> None:
        assert tier.info()["slab_chunks"] == 7  # the six kept and the one put again

    run(tmp_path, write, io_threads=1, fsync="never")
    run(tmp_path, reopen)


def test_always_syncs_each_slab_once_per_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = os.fdatasync

    def datasync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", datasync)
    items = [chunk(i, 8192) for i in range(8)] + [chunk(100 + i, 10_000) for i in range(8)]

    async def write(tier: NvmeTier) -> None:
        results = await _held(tier, [tier.put(m, aligned(d)) for m, d in items])
        assert results == [None] * len(items)
        assert len(calls) == 2 and len(set(calls)) == 2  # two slab files, one sync each

    run(tmp_path, write, io_threads=1, fsync="always")


def test_a_put_cancelled_while_queued_is_not_written(tmp_path: Path) -> None:
    items = [chunk(i, 8192) for i in range(4)]

    async def write(tier: NvmeTier) -> None:
        gate = threading.Event()
        blocker = tier._pool.submit(gate.wait, 30)
        tasks = [asyncio.ensure_future(tier.put(m, aligned(d))) for m, d in items]
        await _queued(tier, len(items))
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        gate.set()
        blocker.result(timeout=30)
        await asyncio.gather(tasks[0], *tasks[2:])
        assert not await tier.contains(items[1][0].key)

    async def reopen(tier: NvmeTier) -> None:
        assert tier.info()["slab_chunks"] == 3 and not await tier.contains(items[1][0].key)
        assert tier.rebuild_report is not None and tier.rebuild_report.slots_invalid == 0

    run(tmp_path, write, io_threads=1, fsync="never")
    run(tmp_path, reopen)


def test_a_long_write_queue_does_not_hold_reads_back(tmp_path: Path) -> None:
    """With more writes queued than one drain takes (64), the drain submits itself again
    behind the pool work submitted meanwhile: a read waiting there is served before the rest
    of the writes, not after the whole queue."""
    first, first_data = chunk(999, 8192)
    items = [chunk(i, 8192) for i in range(100)]
    order: list[str] = []

    async def body(tier: NvmeTier) -> None:
        await tier.put(first, first_data)

        async def put(i: int) -> None:
            meta, data = items[i]
            await tier.put(meta, aligned(data))
            order.append(f"put {i}")

        async def get() -> None:
            assert await read(tier, first) == first_data
            order.append("get")

        gate = threading.Event()
        blocker = tier._pool.submit(gate.wait, 30)
        puts = [asyncio.ensure_future(put(i)) for i in range(len(items))]
        await _queued(tier, len(items))
        reader = asyncio.ensure_future(get())
        for _ in range(10_000):  # until the read waits in the pool, behind the drain job
            if tier._pool._work_queue.qsize() >= 2:
                break
            await asyncio.sleep(0)
        assert tier._pool._work_queue.qsize() >= 2
        gate.set()
        blocker.result(timeout=30)
        await asyncio.gather(reader, *puts)
        assert order.index("get") < len(items)  # not last: 36 writes were still queued
        assert sum(1 for o in order[: order.index("get")] if o.startswith("put")) <= 64

    run(tmp_path, body, io_threads=1, fsync="never")
