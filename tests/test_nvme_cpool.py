"""Slab slot I/O through the C pool (``_nvme_cpool`` over ``_iopool``) against the pool path:
the same bytes on disk and the same reads both ways (and across a restart from one to the
other); a failed write fails only its own put and frees its slot; a put cancelled while its
write runs leaves no chunk behind, before or after a restart; a corrupt slot read through the
C pool is invalidated, never served; without the extension the tier takes the pool path."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import select
import time
from pathlib import Path
from typing import Any

import pytest

from kvstrata.chunks import ChunkMeta
from kvstrata.tiers import _nvme_coalesce, _nvme_cpool
from kvstrata.tiers._nvme_slabs import SLAB_DIR
from kvstrata.tiers.base import IntegrityError, TierIOError
from kvstrata.tiers.nvme import NvmeTier
from tests.test_nvme_slabs import chunk, run

pytestmark = pytest.mark.skipif(_nvme_cpool.Pool is None, reason="_iopool not built")

SIZES = [4096, 8192, 10_000, 200_000, 262_144, 1 << 20]  # whole blocks and a padded last one


def aligned(data: bytes | int) -> memoryview:
    """Bytes at a page-aligned address (an arena slot's): the C path takes those."""
    view = memoryview(mmap.mmap(-1, data if isinstance(data, int) else max(1, len(data))))
    if not isinstance(data, int):
        view[: len(data)] = data
    return view


def uses_c(tier: NvmeTier) -> bool:
    return tier._cio is not None


def chunks(n: int, seed: int = 0) -> list[tuple[ChunkMeta, bytes]]:
    return [chunk(i, SIZES[i % len(SIZES)], seed) for i in range(n)]


async def read_aligned(tier: NvmeTier, meta: ChunkMeta) -> bytes:
    out = aligned(meta.size + 4096)  # larger than the chunk, as a reader's buffer may be
    assert await tier.get(meta.key, out) == meta
    return bytes(out[: meta.size])


def slab_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / SLAB_DIR).glob("*.slab"))}


async def _c_calls(tier: NvmeTier) -> list[str]:
    """Counts what the C pool ran (wrapping ``_submit``): 'w' and 'r' per job."""
    assert tier._cio is not None
    calls: list[str] = []
    real = tier._cio._submit

    def submit(write: bool, fd: int, offset: int, views: list[Any], done: Any) -> None:
        calls.append("w" if write else "r")
        real(write, fd, offset, views, done)

    tier._cio._submit = submit  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("fsync", ["never", "always", "batch"])
def test_same_bytes_on_disk_and_same_reads_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    items = chunks(24)
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)  # fixed headers
    seen: dict[str, list[bytes]] = {}

    def write_all(root: Path, c_path: bool) -> None:
        async def body(tier: NvmeTier) -> None:
            assert uses_c(tier) is c_path
            if tier._cio is not None:  # ``always``: every C write job ends with fdatasync
                assert tier._cio._sync is (fsync == "always")
            calls = await _c_calls(tier) if c_path else []
            for meta, data in items:  # one at a time: the same slot order both ways
                await tier.put(meta, aligned(data))
            seen[str(c_path)] = [await read_aligned(tier, m) for m, _ in items]
            if c_path:
                assert calls.count("w") >= len(items) - 6  # a new slab file per class: pool path
                assert calls.count("r") == len(items)

        run(root, body, scan=False, fsync=fsync, io_threads=2)

    write_all(tmp_path / "c", True)
    with monkeypatch.context() as m:
        m.setattr(_nvme_cpool, "Pool", None)
        write_all(tmp_path / "py", False)
    assert seen["True"] == seen["False"] == [d for _, d in items]
    on_c, on_py = slab_bytes(tmp_path / "c"), slab_bytes(tmp_path / "py")
    assert on_c.keys() == on_py.keys() and on_c
    for name in on_c:
        assert on_c[name] == on_py[name], name


@pytest.mark.parametrize("writer_c", [True, False])
def test_restart_reads_what_the_other_path_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer_c: bool
) -> None:
    items = chunks(18, seed=3)

    async def write(tier: NvmeTier) -> None:
        await asyncio.gather(*(tier.put(m, aligned(d)) for m, d in items))

    async def check(tier: NvmeTier) -> None:
        assert uses_c(tier) is not writer_c
        assert set(tier._index) == {m.key for m, _ in items}
        got = await asyncio.gather(*(read_aligned(tier, m) for m, _ in items))
        assert got == [d for _, d in items]

    with monkeypatch.context() as m:
        if not writer_c:
            m.setattr(_nvme_cpool, "Pool", None)
        run(tmp_path, write, fsync="never")
    with monkeypatch.context() as m:
        if writer_c:
            m.setattr(_nvme_cpool, "Pool", None)
        run(tmp_path, check, fsync="never")


def test_writes_piling_up_are_left_to_the_coalescing_drains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [chunk(i, 200_000, seed=11) for i in range(64)]
    runs: list[int] = []
    real = _nvme_coalesce._write_run

    def write_run(slabs: Any, run_: list[Any]) -> None:
        runs.append(len(run_))
        real(slabs, run_)

    monkeypatch.setattr(_nvme_coalesce, "_write_run", write_run)

    async def body(tier: NvmeTier) -> None:
        calls = await _c_calls(tier)
        await asyncio.gather(*(tier.put(m, aligned(d)) for m, d in items))  # an eviction round
        assert calls.count("w") < len(items) // 2  # most taken by the drains
        assert max(runs) > 1  # queued writes were taken together
        got = await asyncio.gather(*(read_aligned(tier, m) for m, _ in items))
        assert got == [d for _, d in items]

    run(tmp_path, body, fsync="never", io_threads=2)


def test_a_failed_write_fails_only_its_own_put(tmp_path: Path) -> None:
    items = chunks(8, seed=5)
    bad = items[3][0].key
    name = bad.namespace.encode() + bad.hash  # as the chunk header holds it

    async def body(tier: NvmeTier) -> None:
        assert tier._cio is not None
        for i, size in enumerate(SIZES):  # a slab file per class first: then every write is C's
            meta, data = chunk(100 + i, size)
            await tier.put(meta, aligned(data))
        real = tier._cio._submit
        spare = tier._slabs.spare_bytes()

        def submit(write: bool, fd: int, offset: int, views: list[Any], done: Any) -> None:
            failing = write and name in bytes(views[0][:4096])
            real(write, -1 if failing else fd, offset, views, done)  # EBADF from the C pool

        tier._cio._submit = submit  # type: ignore[method-assign]
        outcomes = await asyncio.gather(
            *(tier.put(m, aligned(d)) for m, d in items), return_exceptions=True
        )
        failed = [m.key for (m, _), o in zip(items, outcomes, strict=True) if o is not None]
        assert failed == [bad]
        assert isinstance(outcomes[3], TierIOError) and "EBADF" in str(outcomes[3])
        assert tier.stats.errors == 1
        assert bad not in tier._index
        for meta, data in items:
            if meta.key != bad:
                assert await read_aligned(tier, meta) == data
        tier._cio._submit = real  # type: ignore[method-assign]
        # the failed put's slot is free again (invalidated on the pool): only the 7 are held
        held = sum(tier._slabs.slot_size(m.size) for m, _ in items if m.key != bad)
        for _ in range(10_000):
            if tier._slabs.spare_bytes() == spare - held:
                break
            await asyncio.sleep(0)  # a pass of the loop while the clean-up job runs
        assert tier._slabs.spare_bytes() == spare - held
        await tier.put(items[3][0], aligned(items[3][1]))
        assert await read_aligned(tier, items[3][0]) == items[3][1]

    run(tmp_path, body, fsync="never", io_threads=len(items))  # all 8 in the C pool at once


def test_a_failed_read_is_an_io_error_and_the_chunk_stays(tmp_path: Path) -> None:
    meta, data = chunk(1, 200_000)

    async def body(tier: NvmeTier) -> None:
        assert tier._cio is not None and tier.info()["slot_io"] == "c"
        await tier.put(meta, aligned(data))
        real = tier._cio._submit

        def submit(write: bool, fd: int, offset: int, views: list[Any], done: Any) -> None:
            real(write, -1, offset, views, done)

        tier._cio._submit = submit  # type: ignore[method-assign]
        with pytest.raises(TierIOError, match="EBADF"):
            await read_aligned(tier, meta)
        tier._cio._submit = real  # type: ignore[method-assign]
        assert await read_aligned(tier, meta) == data

    run(tmp_path, body, fsync="never")


def test_a_put_cancelled_while_its_write_runs_leaves_nothing(tmp_path: Path) -> None:
    (meta, data), (other, odata) = chunk(1, 262_144), chunk(2, 200_000)  # one slot class

    async def body(tier: NvmeTier) -> None:
        assert tier._cio is not None
        await tier.put(other, aligned(odata))  # the slab file exists: the next write is C's
        calls = await _c_calls(tier)
        task = asyncio.ensure_future(tier.put(meta, aligned(data)))
        for _ in range(1000):
            if calls:
                break
            await asyncio.sleep(0)  # passes of the loop until the write is in the C pool
        assert calls == ["w"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert meta.key not in tier._index
        for _ in range(10_000):  # the write completes, then its slot is invalidated (pool)
            if tier._cio.in_flight == 0 and tier._slabs.spare_bytes() > 0:
                break
            await asyncio.sleep(0)
        assert tier._cio.in_flight == 0

    async def after(tier: NvmeTier) -> None:
        assert set(tier._index) == {other.key}
        assert await read_aligned(tier, other) == odata

    run(tmp_path, body, fsync="never")
    run(tmp_path, after, fsync="never")


def test_close_waits_for_writes_in_the_c_pool(tmp_path: Path) -> None:
    items = chunks(12, seed=7)

    async def body(tier: NvmeTier) -> None:
        tasks = [asyncio.ensure_future(tier.put(m, aligned(d))) for m, d in items]
        await asyncio.sleep(0)
        await tier.close()  # joins the C threads: every write queued there has run
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        done = [m for (m, _), o in zip(items, outcomes, strict=True) if o is None]
        assert done, outcomes
        self_check[:] = [m.key for m in done]

    async def after(tier: NvmeTier) -> None:
        assert set(self_check) <= set(tier._index)
        for meta, data in items:
            if meta.key in tier._index:
                assert await read_aligned(tier, meta) == data

    self_check: list[Any] = []
    run(tmp_path, body, fsync="never")
    run(tmp_path, after, fsync="never")


def test_a_corrupt_slot_read_through_the_c_pool_is_invalidated(tmp_path: Path) -> None:
    meta, data = chunk(4, 200_000)

    async def body(tier: NvmeTier) -> None:
        await tier.put(meta, aligned(data))
        ref = tier._where[meta.key]
        path, offset = tier._slabs.locate(ref)
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xff" * 16, offset + 4096 + 1000)  # payload bytes flipped
            os.fsync(fd)
        finally:
            os.close(fd)
        calls = await _c_calls(tier)
        with pytest.raises(IntegrityError, match="slot invalidated"):
            await read_aligned(tier, meta)
        assert calls == ["r"]
        assert meta.key not in tier._index and tier.stats.extra["slots_invalid"] == 1

    run(tmp_path, body, fsync="never")


def test_without_the_extension_the_tier_takes_the_pool_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_nvme_cpool, "Pool", None)
    meta, data = chunk(9, 8192)

    async def body(tier: NvmeTier) -> None:
        assert tier._cio is None and tier.info()["slot_io"] == "threads"
        await tier.put(meta, aligned(data))
        assert await read_aligned(tier, meta) == data

    run(tmp_path, body, fsync="never")


def test_the_pool_itself_short_reads_errors_and_batched_completions(tmp_path: Path) -> None:
    assert _nvme_cpool.Pool is not None
    pool = _nvme_cpool.Pool(2)
    path, short = tmp_path / "f", tmp_path / "short"
    path.write_bytes(b"x" * 10_000)
    short.write_bytes(b"s" * 3000)
    fd, sfd = os.open(path, os.O_RDWR), os.open(short, os.O_RDONLY)
    into = bytearray(5000)
    try:
        for tag in range(20):
            pool.submit(tag, True, fd, 10_000 + tag * 100, [b"a" * 60, memoryview(b"b" * 40)])
        pool.submit(100, False, sfd, 1000, [memoryview(into)])  # past the end: short
        pool.submit(101, True, -1, 0, [b"z"])
        got: dict[int, int] = {}
        wakeups = 0
        while len(got) < 22:  # wait on the eventfd (a condition, bounded), not on the clock
            assert select.select([pool.fileno()], [], [], 10)[0], "no completion in 10 s"
            got.update(pool.completions())
            wakeups += 1
        assert wakeups <= 22
        assert all(got[t] == 100 for t in range(20))
        assert got[101] == -errno.EBADF
        assert got[100] == 2000 and into == b"s" * 2000 + bytes(3000)
        assert pool.pending() == 0
    finally:
        pool.close()
        os.close(fd)
        os.close(sfd)
    assert path.read_bytes()[10_000:] == (b"a" * 60 + b"b" * 40) * 20
    with pytest.raises(RuntimeError):
        pool.submit(1, True, 0, 0, [b"x"])


def test_the_pools_sync_flag_runs_fdatasync_after_the_write() -> None:
    assert _nvme_cpool.Pool is not None
    pool = _nvme_cpool.Pool(1)
    fd = os.open(os.devnull, os.O_WRONLY)  # writes succeed, fdatasync fails (EINVAL)
    try:
        pool.submit(1, True, fd, 0, [b"abc"])
        pool.submit(2, True, fd, 0, [b"abc"], True)
        got: dict[int, int] = {}
        while len(got) < 2:
            assert select.select([pool.fileno()], [], [], 10)[0], "no completion in 10 s"
            got.update(pool.completions())
        assert got == {1: 3, 2: -errno.EINVAL}
    finally:
        pool.close()
        os.close(fd)


def test_a_payload_not_matching_its_checksum_takes_no_slot(tmp_path: Path) -> None:
    (meta, data), (first, fdata) = chunk(1, 200_000), chunk(2, 200_000)

    async def body(tier: NvmeTier) -> None:
        await tier.put(first, aligned(fdata))  # the slab file exists: the next write is C's
        calls = await _c_calls(tier)
        spare = tier._slabs.spare_bytes()
        wrong = bytearray(data)
        wrong[7] ^= 1
        with pytest.raises(IntegrityError):
            await tier.put(meta, aligned(bytes(wrong)))
        assert calls == [] and tier._slabs.spare_bytes() == spare  # no write, no slot held
        assert meta.key not in tier._index and tier.stats.integrity_errors == 1
        await tier.put(meta, aligned(data))
        assert calls == ["w"] and await read_aligned(tier, meta) == data

    run(tmp_path, body, fsync="never")
