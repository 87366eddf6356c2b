"""NVMe slab files under adversarial conditions: a wall clock that steps back between (or
during) runs, a put racing the start-up rebuild, a slot freed and reused under a read in
flight, nvme-slab-max lowered between restarts, puts and deletes cancelled mid-I/O, a damaged
slab header."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from kvstrata.tiers import _nvme_files, _nvme_slab_scan, _nvme_slabs
from kvstrata.tiers import _nvme_format as fmt
from kvstrata.tiers._nvme_slabs import slot_size_for
from kvstrata.tiers.base import ChunkMissing
from kvstrata.tiers.nvme import NvmeTier
from tests.test_nvme_slabs import MiB, chunk, chunk_files, flip, read, run, slab_files

HOUR_NS = 3600 * 10**9


def _clock_back(monkeypatch: pytest.MonkeyPatch, by_ns: int) -> None:
    """The writers' wall clock reads ``by_ns`` earlier (NTP step, VM restore, new host)."""
    fake = types.SimpleNamespace(time_ns=lambda: time.time_ns() - by_ns)
    for module in (_nvme_slabs, _nvme_files, fmt):
        monkeypatch.setattr(module, "time", fake, raising=False)


def test_overwrite_cut_after_the_clock_stepped_back_keeps_the_newer_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1 writes a chunk. Run 2 starts with the wall clock an hour earlier and overwrites
    it, but is killed between writing the new slot and invalidating the old one (two valid
    slots). Run 3 must serve the newer bytes: the generation that orders two slots of one
    chunk has to be above every generation on disk, whatever the clock says."""
    old, old_data = chunk(1, 20_000)
    new, new_data = chunk(1, 20_000, seed=9)

    async def first(tier: NvmeTier) -> None:
        await tier.put(old, old_data)

    async def cut_overwrite(tier: NvmeTier) -> None:
        assert await read(tier, old) == old_data
        await asyncio.get_running_loop().run_in_executor(
            None, tier._slabs.write, new, memoryview(new_data), False
        )

    async def third(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.stale == 1
        assert await read(tier, new) == new_data

    run(tmp_path, first)
    with monkeypatch.context() as m:
        _clock_back(m, HOUR_NS)
        run(tmp_path, cut_overwrite)
    run(tmp_path, third)


def test_clock_step_back_within_a_run_keeps_the_newer_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one run the clock steps back between two writes of one chunk, and the process
    dies before the first copy is invalidated: the restart keeps the second copy."""
    old, old_data = chunk(2, 9_000)
    new, new_data = chunk(2, 9_000, seed=3)

    async def both(tier: NvmeTier) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, tier._slabs.write, old, memoryview(old_data), False)
        with monkeypatch.context() as m:
            _clock_back(m, HOUR_NS)
            await loop.run_in_executor(None, tier._slabs.write, new, memoryview(new_data), False)

    async def after(tier: NvmeTier) -> None:
        assert await read(tier, new) == new_data

    run(tmp_path, both, scan=False)
    run(tmp_path, after)


@pytest.mark.parametrize(
    "layouts", [("slot", "file"), ("file", "slot")], ids=["slot-then-file", "file-then-slot"]
)
def test_file_and_slot_copies_after_the_clock_stepped_back_keep_the_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layouts: tuple[str, str]
) -> None:
    """Run 1 writes a chunk as a slot (or a file). Run 2, its clock an hour earlier, writes it
    again as a file (nvme-slab-max lowered; or as a slot) and is killed before the old copy is
    dropped. Run 3 keeps run 2's copy: write times given out are never below those on disk."""
    old, old_data = chunk(14, 20_000)
    new, new_data = chunk(14, 20_000, seed=4)
    limit = {"slot": MiB, "file": 0}

    async def first(tier: NvmeTier) -> None:
        await tier.put(old, old_data)

    async def cut_overwrite(tier: NvmeTier) -> None:
        assert await read(tier, old) == old_data
        loop = asyncio.get_running_loop()
        if layouts[1] == "slot":
            await loop.run_in_executor(None, tier._slabs.write, new, memoryview(new_data), False)
        else:  # the new file renamed over nothing (the old copy is a slot): close its fd
            _, fd = await loop.run_in_executor(None, tier._files.write, new, memoryview(new_data))
            if fd >= 0:
                os.close(fd)

    async def third(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.stale == 1
        assert await read(tier, new) == new_data

    run(tmp_path, first, slab_max=limit[layouts[0]])
    with monkeypatch.context() as m:
        _clock_back(m, HOUR_NS)
        run(tmp_path, cut_overwrite, slab_max=limit[layouts[1]])
    run(tmp_path, third)


@pytest.mark.parametrize("first_layout", ["slot", "file"])
def test_put_while_the_start_up_rebuild_runs_is_not_undone_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_layout: str
) -> None:
    """A chunk is on disk from the last run (in a slot, or in an old chunk file). The next run
    overwrites it while scan() is still reading the folder: the rebuild, which found the old
    copy, must not put it back in the index over the new one (old bytes served, the new slot
    leaked); the old copy is dropped, ``used`` counts one slot, and a restart agrees."""
    old, old_data = chunk(3, 12_000)
    new, new_data = chunk(3, 12_000, seed=5)
    real = _nvme_slab_scan.rebuild

    async def first(tier: NvmeTier) -> None:
        await tier.put(old, old_data)

    async def overwrite_during_scan(tier: NvmeTier) -> None:
        loop = asyncio.get_running_loop()

        def rebuild(*args: Any) -> Any:  # the overwrite lands after scan() took its snapshot
            asyncio.run_coroutine_threadsafe(tier.put(new, new_data), loop).result()
            return real(*args)

        with monkeypatch.context() as m:
            m.setattr(_nvme_slab_scan, "rebuild", rebuild)
            found = [meta async for meta in tier.scan()]
        assert [m.checksum for m in found] == [new.checksum]
        assert await read(tier, new) == new_data
        assert tier.used == slot_size_for(new.size, MiB) and tier.info()["slab_chunks"] == 1
        assert chunk_files(tmp_path) == []

    async def after(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.chunks == 1
        assert await read(tier, new) == new_data

    run(tmp_path, first, slab_max=0 if first_layout == "file" else MiB)
    run(tmp_path, overwrite_during_scan, scan=False)
    run(tmp_path, after)


def test_read_whose_slot_is_freed_and_reused_by_another_chunk_is_a_miss(tmp_path: Path) -> None:
    """A read of chunk K starts; before it reads, K is deleted and its slot is reused by chunk
    J (same size class). The read sees J's header there: a plain miss for K, never J's bytes,
    and J's slot is left alone (not invalidated by the reader as if it were corrupt)."""
    k, k_data = chunk(4, 30_000)
    j, j_data = chunk(5, 30_000)

    async def body(tier: NvmeTier) -> None:
        await tier.put(k, k_data)
        where = tier.locate(k.key)
        loop = asyncio.get_running_loop()
        real = tier._slabs.read

        def read_slot(*args: Any) -> Any:
            async def reuse() -> None:
                assert await tier.delete(k.key)
                await tier.put(j, j_data)

            asyncio.run_coroutine_threadsafe(reuse(), loop).result()
            return real(*args)

        tier._slabs.read = read_slot  # type: ignore[method-assign]
        out = bytearray(k.size)
        with pytest.raises(ChunkMissing):
            await tier.get(k.key, memoryview(out))
        tier._slabs.read = real  # type: ignore[method-assign]
        assert tier.locate(j.key) == where  # the very slot K had
        assert await read(tier, j) == j_data
        assert tier.stats.integrity_errors == 0 and tier.info()["slots_invalid"] == 0

    run(tmp_path, body)


def test_slab_max_lowered_between_restarts(tmp_path: Path) -> None:
    """Chunks written into slots with nvme-slab-max 1MiB are served after a restart with
    64KiB; overwriting one now writes a chunk file and invalidates its slot, and the next
    restart finds the file only (no second copy, no old bytes)."""
    big, big_data = chunk(6, 500_000)
    big2, big2_data = chunk(6, 500_000, seed=2)
    small, small_data = chunk(7, 5_000)

    async def first(tier: NvmeTier) -> None:
        await tier.put_many([(big, big_data), (small, small_data)])

    async def lowered(tier: NvmeTier) -> None:
        assert await read(tier, big) == big_data and await read(tier, small) == small_data
        await tier.put(big2, big2_data)
        assert tier.locate(big.key) == (str(tmp_path / fmt.chunk_relpath(big.key)), 0)

    async def again(tier: NvmeTier) -> None:
        report = tier.rebuild_report
        assert report is not None and (report.chunks, report.stale) == (2, 0)
        assert tier.info()["slab_chunks"] == 1
        assert await read(tier, big2) == big2_data and await read(tier, small) == small_data

    run(tmp_path, first)
    run(tmp_path, lowered, slab_max=64 * 1024)
    run(tmp_path, again, slab_max=64 * 1024)


def _pool_idle(tier: NvmeTier) -> None:
    """Block until every job submitted to the tier's pool so far has run (one worker)."""
    tier._pool.submit(lambda: None).result(timeout=30)


def test_delete_cancelled_while_queued_still_invalidates_the_slot(tmp_path: Path) -> None:
    """A delete drops the chunk from the index, then waits for a free I/O thread to zero the
    slot's header; the delete is cancelled while its job is still queued (a shutdown cancelling
    background work). The slot must still be invalidated: a clean restart must not bring the
    deleted chunk back, and the slot is free for reuse."""
    meta, data = chunk(8, 10_000)
    busy, gate = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        gate.wait(30)

    async def body(tier: NvmeTier) -> None:
        await tier.put(meta, data)
        tier._pool.submit(block)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, busy.wait, 30)  # the only I/O thread is busy
        try:
            task = asyncio.ensure_future(tier.delete(meta.key))
            deadline = time.monotonic() + 30
            while tier._pool._work_queue.qsize() < 1:  # the invalidation is queued
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            assert not await tier.contains(meta.key)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()
        await loop.run_in_executor(None, _pool_idle, tier)

    async def after(tier: NvmeTier) -> None:
        assert not await tier.contains(meta.key)
        assert tier.rebuild_report is not None and tier.rebuild_report.chunks == 0

    run(tmp_path, body, io_threads=1)
    run(tmp_path, after)


@pytest.mark.parametrize("during", ["write", "group sync"])
def test_put_cancelled_during_its_slot_write_leaves_no_slot_behind(
    tmp_path: Path, during: str
) -> None:
    """A put is cancelled while its slot is being written (the write runs on in its thread),
    or while it waits for the group sync that makes the write durable. The put did not
    happen: the slot is invalidated and free again once the write ends, and a restart does
    not find the chunk (which the index never had, so no delete could reach it)."""
    meta, data = chunk(9, 10_000)
    other, other_data = chunk(10, 10_000)
    started, gate = threading.Event(), threading.Event()

    async def body(tier: NvmeTier) -> None:
        assert tier._group is not None
        real, real_sync = tier._slabs.write, tier._group._sync

        def write(*args: Any) -> Any:
            if during == "write":
                started.set()
                gate.wait(30)
            return real(*args)

        def sync(*args: Any) -> Any:
            if during == "group sync":
                started.set()
                gate.wait(30)
            return real_sync(*args)

        tier._slabs.write = write  # type: ignore[method-assign]
        tier._group._sync = sync  # type: ignore[method-assign]
        try:
            task = asyncio.ensure_future(tier.put(meta, data))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            gate.set()
        await asyncio.get_running_loop().run_in_executor(None, _pool_idle, tier)
        tier._slabs.write, tier._group._sync = real, real_sync  # type: ignore[method-assign]
        assert not await tier.contains(meta.key) and tier.used == 0
        await tier.put(other, other_data)  # reuses the abandoned slot
        assert tier.locate(other.key) == (str(slab_files(tmp_path)[0]), 4096)

    async def after(tier: NvmeTier) -> None:
        assert not await tier.contains(meta.key)
        assert await read(tier, other) == other_data

    run(tmp_path, body, io_threads=1)
    run(tmp_path, after)


@pytest.mark.parametrize("damage", ["flip", "empty"])
def test_slab_with_a_bad_header_is_quarantined_never_served(tmp_path: Path, damage: str) -> None:
    """A slab file whose own header is damaged (a flipped byte) or empty (a crash right after
    its creation) is moved to quarantine at start; none of its slots is served, the other
    slab's chunks are, and new chunks go to a new slab file, not over the quarantined one."""
    small, small_data = chunk(11, 5_000)  # 8 KiB class
    big, big_data = chunk(12, 50_000)  # another class: another slab file
    new, new_data = chunk(13, 5_000)

    async def first(tier: NvmeTier) -> None:
        await tier.put(small, small_data)  # in slab file 1
        await tier.put(big, big_data)

    async def second(tier: NvmeTier) -> None:
        report = tier.rebuild_report
        assert report is not None and (report.chunks, report.quarantined) == (1, 1)
        assert not await tier.contains(small.key)
        assert await read(tier, big) == big_data
        await tier.put(new, new_data)
        assert await read(tier, new) == new_data
        assert len(list((tmp_path / "quarantine").iterdir())) == 1

    run(tmp_path, first)
    first_slab = slab_files(tmp_path)[0]
    if damage == "flip":
        flip(str(first_slab), 20)
    else:
        first_slab.write_bytes(b"")
    run(tmp_path, second)
    assert first_slab not in slab_files(tmp_path) and len(slab_files(tmp_path)) == 2


def test_file_written_while_the_rebuild_runs_is_not_removed_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old chunk file of K is on disk; the new run puts K in a slot before scan(), so the
    rebuild will treat a file of K as stale. While it runs, K is written again, now larger
    than nvme-slab-max: a new file renamed over the old one. The rebuild must not remove that
    new file (the chunk the index holds): a read serves it, and a restart too."""
    v1, v1_data = chunk(15, 20_000)
    v2, v2_data = chunk(15, 20_000, seed=2)
    v3, v3_data = chunk(15, 100_000, seed=3)
    real = _nvme_slab_scan.rebuild

    async def first(tier: NvmeTier) -> None:
        await tier.put(v1, v1_data)

    async def second(tier: NvmeTier) -> None:
        loop = asyncio.get_running_loop()
        await tier.put(v2, v2_data)  # a slot, before the scan

        def rebuild(*args: Any) -> Any:
            asyncio.run_coroutine_threadsafe(tier.put(v3, v3_data), loop).result()
            return real(*args)

        with monkeypatch.context() as m:
            m.setattr(_nvme_slab_scan, "rebuild", rebuild)
            [meta async for meta in tier.scan()]
        assert await read(tier, v3) == v3_data
        assert chunk_files(tmp_path) == [tmp_path / fmt.chunk_relpath(v3.key)]

    async def third(tier: NvmeTier) -> None:
        assert await read(tier, v3) == v3_data

    run(tmp_path, first, slab_max=0)
    run(tmp_path, second, scan=False, slab_max=64 * 1024)
    run(tmp_path, third, slab_max=64 * 1024)
