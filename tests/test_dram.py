"""DRAM tier specifics: reservations, views, handles, shared memory across processes, pinning."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers import _cuda
from kvstrata.tiers.base import ChunkMissing, TierError, TierFull, TierUnavailable, build_tier
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.dram import DramConfig, DramTier

MiB = 1024 * 1024


def meta_for(i: int, data: bytes) -> ChunkMeta:
    return ChunkMeta(ChunkKey("dram@test", bytes([i]) * 16), b"", 1, len(data), checksum(data))


def with_tier(body: Callable[[DramTier], Awaitable[None]], capacity: int = 4 * MiB) -> None:
    async def main() -> None:
        tier = DramTier(DramConfig(capacity=capacity, name_prefix="kvstrata-test", pin="auto"))
        try:
            await body(tier)
        finally:
            await tier.close()

    asyncio.run(main())


def test_reserved_slot_is_invisible_until_commit() -> None:
    async def body(tier: DramTier) -> None:
        data = b"x" * 10_000
        meta = meta_for(1, data)
        slot = tier.reserve(meta.key, len(data))
        slot[:] = data
        assert not tier.has(meta.key) and not await tier.contains(meta.key)
        assert await tier.meta(meta.key) is None
        with pytest.raises(ChunkMissing):
            tier.view(meta.key)
        with pytest.raises(ChunkMissing):
            await tier.get(meta.key, memoryview(bytearray(10_000)))
        h = tier.reserved_handle(meta.key)
        assert (h.region, h.length, h.offset % 4096) == ("dram0", 10_000, 0)
        tier.commit(meta)
        assert tier.has(meta.key)
        assert bytes(tier.view(meta.key)) == data
        assert tier.handle(meta.key) == h
        with pytest.raises(ChunkMissing):
            tier.reserved_handle(meta.key)

    with_tier(body)


def test_abort_frees_the_slot() -> None:
    async def body(tier: DramTier) -> None:
        key = meta_for(2, b"").key
        tier.reserve(key, 3 * MiB)
        with pytest.raises(TierFull):
            tier.reserve(meta_for(3, b"").key, 2 * MiB)
        tier.abort(key)
        tier.abort(key)  # idempotent
        assert tier.used == 0 and not tier.has(key)
        tier.reserve(meta_for(3, b"").key, 2 * MiB)

    with_tier(body)


def test_reserve_while_committed_replaces_on_commit() -> None:
    """A committed chunk keeps serving while its replacement is reserved; commit swaps them."""

    async def body(tier: DramTier) -> None:
        old = b"o" * 5000
        new = b"n" * 7000
        await tier.put(meta_for(4, old), old)
        slot = tier.reserve(meta_for(4, old).key, len(new))
        slot[:] = new
        assert bytes(tier.view(meta_for(4, old).key)) == old
        with pytest.raises(TierError):
            tier.reserve(meta_for(4, old).key, 10)  # one pending reservation per key
        tier.commit(meta_for(4, new))
        assert bytes(tier.view(meta_for(4, new).key)) == new
        assert tier.used == 8192  # the old slot was freed

    with_tier(body)


def test_commit_errors() -> None:
    async def body(tier: DramTier) -> None:
        data = b"z" * 100
        with pytest.raises(ChunkMissing):
            tier.commit(meta_for(5, data))
        tier.reserve(meta_for(5, data).key, 50)
        with pytest.raises(ValueError):
            tier.commit(meta_for(5, data))
        tier.abort(meta_for(5, data).key)
        with pytest.raises(ValueError):
            await tier.put(meta_for(5, data), data[:10])

    with_tier(body)


def test_info_regions_and_pinning_without_cuda() -> None:
    async def body(tier: DramTier) -> None:
        info = tier.info()
        assert info["arena"] == tier.arena_name and info["capacity"] == 4 * MiB
        assert (info["fragmentation"], info["largest_free"]) == (0.0, 4 * MiB)
        if _cuda.cuda_unavailable_reason() is not None:
            assert (info["pinned"], info["pin_reason"]) == (0, "no CUDA")
        (region,) = tier.regions()
        assert (region.name, region.kind, region.size) == ("dram0", "shm", 4 * MiB)
        assert os.path.exists(f"/dev/shm/{region.path}")

    with_tier(body)


def test_pin_no_is_reported() -> None:
    async def main() -> None:
        tier = DramTier(DramConfig(capacity=MiB, name_prefix="kvstrata-test", pin="no"))
        assert (tier.pinned, tier.pin_reason) == (0, "disabled (dram-pin no)")
        await tier.close()

    asyncio.run(main())


def test_close_unlinks_and_blocks_writes() -> None:
    async def main() -> None:
        tier = DramTier(DramConfig(capacity=MiB, name_prefix="kvstrata-test"))
        path = f"/dev/shm/{tier.arena_name}"
        data = b"q" * 10
        await tier.put(meta_for(6, data), data)
        view = tier.view(meta_for(6, data).key)  # held across close: must not break close
        await tier.close()
        assert not os.path.exists(path)
        assert bytes(view) == data
        with pytest.raises(TierUnavailable):
            await tier.put(meta_for(7, data), data)

    asyncio.run(main())


def test_bad_config_and_registry() -> None:
    with pytest.raises(TierUnavailable):
        DramTier(DramConfig(capacity=0))
    with pytest.raises(TierUnavailable):
        DramTier(DramConfig(capacity=MiB, pin="maybe"))
    tier = build_tier("dram", DramConfig(capacity=MiB, name_prefix="kvstrata-test"))
    assert isinstance(tier, DramTier)
    asyncio.run(tier.close())


def _child_read(shm_name: str, offset: int, length: int, queue: Any) -> None:
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    # Python 3.11 registers attached segments too and would unlink ours when this child exits.
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    assert shm.buf is not None
    queue.put(bytes(shm.buf[offset : offset + length]))
    shm.close()


def test_second_process_reads_exact_bytes_at_handle() -> None:
    """Another process maps the arena by its region path and reads the chunk at its handle."""

    async def body(tier: DramTier) -> None:
        await tier.put(meta_for(8, b"pad" * 1000), b"pad" * 1000)
        data = os.urandom(300_000)
        await tier.put(meta_for(9, data), data)
        h = tier.handle(meta_for(9, data).key)
        (region,) = [r for r in tier.regions() if r.name == h.region]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_child_read, args=(region.path, h.offset, h.length, queue))
        proc.start()
        got = await asyncio.get_running_loop().run_in_executor(None, queue.get, True, 60)
        proc.join(30)
        assert proc.exitcode == 0
        assert got == data
        assert os.path.exists(f"/dev/shm/{region.path}")  # the child did not unlink it

    with_tier(body)


def test_stale_arena_of_dead_process_is_reclaimed() -> None:
    """A server killed before close() leaves its segment; the next start removes it. A segment
    a live server holds (its lock) is kept, even when its name's pid means nothing here (a
    server in another PID namespace sharing /dev/shm), and so is a segment too young to have
    been locked yet."""
    import fcntl

    stale = "/dev/shm/kvstrata-reclaim-999999-0"
    alive = "/dev/shm/kvstrata-reclaim-999998-0"
    young = "/dev/shm/kvstrata-reclaim-999997-0"
    for path in (stale, alive, young):
        with open(path, "wb") as f:
            f.write(b"x")
    old = time.time() - 60
    os.utime(stale, (old, old))
    os.utime(alive, (old, old))
    holder = os.open(alive, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        tier = DramTier(DramConfig(capacity=MiB, name_prefix="kvstrata-reclaim"))
        assert tier.reclaimed == [os.path.basename(stale)]
        assert not os.path.exists(stale) and os.path.exists(alive) and os.path.exists(young)
        asyncio.run(tier.close())
    finally:
        os.close(holder)
        os.unlink(alive)
        os.unlink(young)
