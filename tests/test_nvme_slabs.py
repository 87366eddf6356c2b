"""NVMe slab files (chunks ≤ nvme-slab-max in slots): round trip, restart, torn and corrupt
slots, crashes between write and publish, no resurrection, full slabs and ENOSPC, old chunk
files beside slabs, the fsync policies (more in test_nvme_slabs_io.py)."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers import _nvme_format as fmt
from kvstrata.tiers._nvme_slabs import CLASSES, SLAB_DIR, slot_size_for
from kvstrata.tiers.base import IntegrityError, TierFull, TierIOError
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

KiB, MiB = 1024, 1024 * 1024
NS = "slab@test"


def chunk(i: int, size: int, seed: int = 0) -> tuple[ChunkMeta, bytes]:
    data = np.random.default_rng(i * 1000 + seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    return ChunkMeta(ChunkKey(NS, i.to_bytes(4, "big")), b"", i, size, checksum(data)), data


def run(root: Path, body: Callable[[NvmeTier], Awaitable[None]], scan: bool = True,
        **kw: Any) -> None:  # fmt: skip
    """Open a tier on ``root`` (rebuilding its index first unless ``scan`` is False), run
    ``body``, close it."""

    async def main() -> None:
        kw.setdefault("capacity", 256 * MiB)
        kw.setdefault("io_threads", 2)
        tier = NvmeTier(NvmeConfig(str(root), **kw))
        try:
            if scan:
                [m async for m in tier.scan()]
            await body(tier)
        finally:
            await tier.close()

    asyncio.run(main())


async def read(tier: NvmeTier, meta: ChunkMeta) -> bytes:
    out = bytearray(meta.size)
    assert await tier.get(meta.key, memoryview(out)) == meta
    return bytes(out)


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if p.is_file())


def slab_files(root: Path) -> list[Path]:
    return sorted((root / SLAB_DIR).glob("*.slab"))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_size_classes() -> None:
    assert slot_size_for(1, MiB) == 8 * KiB and slot_size_for(4096, MiB) == 8 * KiB
    assert slot_size_for(5000, MiB) == 12 * KiB and slot_size_for(MiB, MiB) == 4 * KiB + MiB
    assert slot_size_for(256 * KiB, MiB) == 260 * KiB
    assert slot_size_for(MiB + 1, MiB) == 0 and slot_size_for(1, 0) == 0
    assert slot_size_for(CLASSES[-1], CLASSES[-1]) == 4 * KiB + CLASSES[-1]


def test_small_chunks_go_to_slots_large_ones_to_files(tmp_path: Path) -> None:
    """Chunks up to nvme-slab-max get no file of their own; a larger one does; every one reads
    back intact and ``used`` counts slot sizes."""
    sizes = [1, 4096, 5000, 256 * KiB, MiB, MiB + 1]
    items = [chunk(i, s) for i, s in enumerate(sizes)]

    async def body(tier: NvmeTier) -> None:
        await tier.put_many(items)
        (big,) = chunk_files(tmp_path)
        assert big == tmp_path / fmt.chunk_relpath(items[-1][0].key)
        assert len(slab_files(tmp_path)) == 4  # classes 4, 8, 256 KiB and 1 MiB
        for meta, data in items:
            assert await read(tier, meta) == data
        slots = sum(slot_size_for(s, MiB) for s in sizes[:-1])
        assert tier.used == slots + fmt.file_bytes(MiB + 1)
        info = tier.info()
        assert (info["slab_chunks"], info["slab_files"], info["slab_max"]) == (5, 4, MiB)
        path, offset = tier.locate(items[0][0].key) or ("", -1)
        assert path.endswith(".slab") and offset == 4096

    run(tmp_path, body)


def test_restart_rebuilds_slots_and_reuses_free_ones(tmp_path: Path) -> None:
    """Close and reopen: scan() finds every slot chunk, bytes intact, ``used`` as before; a
    slot freed after the restart is reused without growing the slab file."""
    items = [chunk(i, 20_000 + i) for i in range(10)]
    before: dict[str, int] = {}

    async def write(tier: NvmeTier) -> None:
        await tier.put_many(items)
        before["used"] = tier.used

    async def reopen(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.chunks == 10
        assert tier.used == before["used"] and tier.info()["slab_chunks"] == 10
        for meta, data in items:
            assert await read(tier, meta) == data
        where = tier.locate(items[3][0].key)
        size = slab_files(tmp_path)[0].stat().st_size
        assert await tier.delete(items[3][0].key)
        new, data = chunk(99, 20_500)
        await tier.put(new, data)
        assert tier.locate(new.key) == where and slab_files(tmp_path)[0].stat().st_size == size

    run(tmp_path, write, scan=False)
    run(tmp_path, reopen)


@pytest.mark.parametrize("where", ["header", "payload"])
def test_torn_slot_is_never_served_and_its_slot_reused(tmp_path: Path, where: str) -> None:
    """A byte of a slot's header or payload changes on disk (a torn write). Header: the
    restart finds no chunk there and counts the slot invalid. Payload: the header is intact,
    so the chunk is indexed, but the read fails its checksum: IntegrityError, never the
    bytes; the slot is invalidated. Either way the next write of that size takes the slot."""
    (meta, data), (keep, keep_data) = chunk(1, 50_000), chunk(2, 50_000)
    spot: dict[str, Any] = {}

    async def write(tier: NvmeTier) -> None:
        await tier.put_many([(meta, data), (keep, keep_data)])
        spot["at"] = tier.locate(meta.key)

    run(tmp_path, write)
    path, offset = spot["at"]
    flip(path, offset + (100 if where == "header" else 4096 + 30_000))

    async def reopen(tier: NvmeTier) -> None:
        report = tier.rebuild_report
        assert report is not None
        if where == "header":
            assert (report.chunks, report.slots_invalid) == (1, 1)
            assert not await tier.contains(meta.key)
        else:
            assert report.chunks == 2
            with pytest.raises(IntegrityError, match="checksum"):
                await read(tier, meta)
            assert not await tier.contains(meta.key)
            assert tier.info()["slots_invalid"] == 1 and tier.stats.integrity_errors == 1
        assert await read(tier, keep) == keep_data
        new, new_data = chunk(3, 50_000)
        await tier.put(new, new_data)
        assert tier.locate(new.key) == (path, offset)
        assert await read(tier, new) == new_data

    run(tmp_path, reopen)


def test_write_never_published_is_whole_or_absent_after_restart(tmp_path: Path) -> None:
    """A crash between the slot write and the put's return (publish): the restart finds the
    chunk complete. A crash in the middle of the slot write (header landed, payload partly):
    the chunk is indexed from its header but its read fails, never serving wrong bytes."""
    (whole, whole_data), (torn, torn_data) = chunk(1, 70_000), chunk(2, 70_000)

    async def crash(tier: NvmeTier) -> None:
        loop = asyncio.get_running_loop()
        for meta, data in ((whole, whole_data), (torn, torn_data)):
            await loop.run_in_executor(None, tier._slabs.write, meta, memoryview(data), False)
        assert not await tier.contains(whole.key)  # written, never published
        return None

    run(tmp_path, crash)
    (slab,) = slab_files(tmp_path)
    with open(slab, "r+b") as f:  # the second slot's payload, half of it never written
        f.seek(4096 + slot_size_for(70_000, MiB) + 4096 + 35_000)
        f.write(bytes(35_000))

    async def reopen(tier: NvmeTier) -> None:
        assert await read(tier, whole) == whole_data
        with pytest.raises(IntegrityError):
            await read(tier, torn)

    run(tmp_path, reopen)


def test_delete_and_overwrite_do_not_resurrect_after_restart(tmp_path: Path) -> None:
    """Delete one chunk, overwrite another with new bytes: a restart has neither the deleted
    chunk nor the old bytes. An overwrite cut before the old slot was invalidated (two valid
    slots) serves the newer one, invalidates the older, and a later delete stays deleted."""
    (a, a_data), (b, b_data) = chunk(1, 30_000), chunk(2, 30_000)
    b2, b2_data = chunk(2, 30_000, seed=7)

    async def first(tier: NvmeTier) -> None:
        await tier.put_many([(a, a_data), (b, b_data)])
        assert await tier.delete(a.key)
        await tier.put(b2, b2_data)

    async def second(tier: NvmeTier) -> None:
        assert not await tier.contains(a.key)
        assert await read(tier, b2) == b2_data
        # an overwrite cut short: the new slot is written, the old one still valid
        b3, b3_data = chunk(2, 30_000, seed=8)
        await asyncio.get_running_loop().run_in_executor(
            None, tier._slabs.write, b3, memoryview(b3_data), False
        )

    async def third(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.stale == 1
        assert await read(tier, chunk(2, 30_000, seed=8)[0]) == chunk(2, 30_000, seed=8)[1]
        assert await tier.delete(b.key)

    async def fourth(tier: NvmeTier) -> None:
        assert not await tier.contains(b.key) and not await tier.contains(a.key)
        assert tier.rebuild_report is not None and tier.rebuild_report.chunks == 0

    for body in (first, second, third, fourth):
        run(tmp_path, body)


def test_full_slab_opens_the_next_and_enospc_is_a_full_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slab of three slots: the fourth chunk starts a second slab file. When the disk cannot
    grow a slab (ENOSPC from fallocate) the put fails as a full tier (capacity lowered, counted,
    nothing indexed) and the tier works again once there is room."""
    slot = slot_size_for(10_000, MiB)

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def body(tier: NvmeTier) -> None:
        items = [chunk(i, 10_000) for i in range(4)]
        await tier.put_many(items[:3])
        assert len(slab_files(tmp_path)) == 1
        await tier.put(*items[3])
        assert len(slab_files(tmp_path)) == 2
        meta, data = chunk(9, 100_000)  # another class: a new slab must grow
        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", full)
            with pytest.raises(TierFull, match="ENOSPC") as caught:
                await tier.put(meta, data)
        assert isinstance(caught.value, TierIOError)
        assert tier.stats.extra["enospc"] == 1 and not await tier.contains(meta.key)
        assert tier.capacity <= tier.used + tier.info()["slab_spare"] + tier._space.available()
        tier._space.limit = None  # the disk has room again (re-checked once a second)
        await tier.put(meta, data)
        for m_, d in [*items, (meta, data)]:
            assert await read(tier, m_) == d

    run(tmp_path, body, slab_bytes=4096 + 3 * slot)


def test_old_chunk_files_are_served_beside_slabs_and_replaced_on_overwrite(
    tmp_path: Path,
) -> None:
    """A folder written with one file per chunk (an older version, or slabs off) opens with
    slabs on: the files are found and served; new small chunks go to slabs; overwriting a
    chunk held in a file moves it to a slot and removes the file; a restart agrees."""
    (a, a_data), (b, b_data), (c, c_data) = chunk(1, 9_000), chunk(2, 9_000), chunk(3, 9_000)
    a2, a2_data = chunk(1, 9_000, seed=5)

    async def old(tier: NvmeTier) -> None:
        await tier.put_many([(a, a_data), (b, b_data)])

    async def mixed(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.chunks == 2
        assert await read(tier, a) == a_data and await read(tier, b) == b_data
        await tier.put(c, c_data)
        await tier.put(a2, a2_data)
        assert chunk_files(tmp_path) == [tmp_path / fmt.chunk_relpath(b.key)]

    async def after(tier: NvmeTier) -> None:
        report = tier.rebuild_report
        assert report is not None and (report.chunks, report.stale) == (3, 0)
        assert tier.info()["slab_chunks"] == 2
        assert await read(tier, a2) == a2_data
        assert await read(tier, b) == b_data and await read(tier, c) == c_data

    run(tmp_path, old, slab_max=0)
    run(tmp_path, mixed)
    run(tmp_path, after)


def test_file_and_slot_of_one_chunk_keep_the_newer(tmp_path: Path) -> None:
    """A crash left a chunk both in an old file and in a newer slot: the slot wins and the file
    is removed, so the old bytes never come back."""
    meta, data = chunk(1, 9_000)
    newer, newer_data = chunk(1, 9_000, seed=3)

    async def old(tier: NvmeTier) -> None:
        await tier.put(meta, data)

    async def crash(tier: NvmeTier) -> None:  # writes the slot without knowing of the file
        await asyncio.get_running_loop().run_in_executor(
            None, tier._slabs.write, newer, memoryview(newer_data), False
        )

    async def reopen(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.stale == 1
        assert await read(tier, newer) == newer_data and chunk_files(tmp_path) == []

    run(tmp_path, old, slab_max=0)
    run(tmp_path, crash, scan=False)
    run(tmp_path, reopen)


class _Counter:
    def __init__(self, real: Callable[[int], None]) -> None:
        self.real, self.calls = real, 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.real(fd)


@pytest.mark.parametrize("direct", ["auto", "no"])
def test_fsync_policies_for_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """always: one fdatasync of the slab per put and per delete (and, once per new slab file,
    an fsync of it and of its folder). batch: a put or delete returns after a group pass, which
    fsyncs the marker (and the slab too when writes are buffered). never: no sync at all."""
    datasync, fsync = _Counter(os.fdatasync), _Counter(os.fsync)
    monkeypatch.setattr(os, "fdatasync", datasync)
    monkeypatch.setattr(os, "fsync", fsync)
    items = [chunk(i, 10_000) for i in range(3)]

    async def always(tier: NvmeTier) -> None:
        datasync.calls = fsync.calls = 0
        for n, (meta, data) in enumerate(items, 1):
            await tier.put(meta, data)
            assert datasync.calls == n
        await tier.delete(items[0][0].key)
        assert (datasync.calls, fsync.calls) == (4, 2)

    async def batch(tier: NvmeTier) -> None:
        datasync.calls = fsync.calls = 0
        per_pass = 1 if tier.backend.direct else 2
        for n, (meta, data) in enumerate(items, 1):
            await tier.put(meta, data)
            assert tier.info()["group_syncs"] == n and fsync.calls == n * per_pass
        await tier.delete(items[0][0].key)
        assert tier.info()["group_syncs"] == 4 and datasync.calls == 0

    async def never(tier: NvmeTier) -> None:
        datasync.calls = fsync.calls = 0
        await tier.put_many(items)
        await tier.delete(items[0][0].key)
        assert (datasync.calls, fsync.calls) == (0, 0)

    for policy, body in (("always", always), ("batch", batch), ("never", never)):
        run(tmp_path / policy, body, scan=False, fsync=policy, direct=direct)


def test_batch_sync_failure_leaves_no_slot_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group sync fails: the put raises, the slot is invalidated (a restart finds nothing)
    and reused by the next write."""

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    meta, data = chunk(1, 30_000)

    async def body(tier: NvmeTier) -> None:
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", broken)
            with pytest.raises(TierIOError, match="EIO"):
                await tier.put(meta, data)
        assert not await tier.contains(meta.key) and tier.used == 0

    async def reopen(tier: NvmeTier) -> None:
        assert tier.rebuild_report is not None and tier.rebuild_report.chunks == 0

    run(tmp_path, body, fsync="batch")
    run(tmp_path, reopen)


def test_a_slab_read_at_start_keeps_growing(tmp_path: Path) -> None:
    """A slab file whose grown slots are all used when the tier restarts takes the next chunk
    of its size by growing, instead of a new slab file per restart."""
    items = [chunk(i, MiB) for i in range(7)]  # one 8 MiB growth step of 1 MiB slots

    async def write(tier: NvmeTier) -> None:
        await tier.put_many(items)

    async def reopen(tier: NvmeTier) -> None:
        (slab,) = slab_files(tmp_path)
        size = slab.stat().st_size
        assert tier.info()["slab_spare"] == 0
        extra, data = chunk(8, MiB)
        await tier.put(extra, data)
        assert slab_files(tmp_path) == [slab] and slab.stat().st_size > size
        assert await read(tier, extra) == data and await read(tier, items[0][0]) == items[0][1]

    run(tmp_path, write)
    run(tmp_path, reopen)
