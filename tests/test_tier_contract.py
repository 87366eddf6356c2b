"""One contract suite for every tier (kvstrata/tiers/base.py), parametrized over TIER_CASES.

To run the suite against another tier, append a :class:`TierCase` to ``TIER_CASES`` below: a
name, an async factory taking a fresh ``tmp_path`` and returning an empty tier of about
``CAPACITY`` bytes (or ``bounded=False`` when the tier has no hard capacity, as S3), and the
factory may call ``pytest.skip`` when its backend is missing on this machine (no CUDA, no
moto). The suite closes the tier at the end of every test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.base import ChunkMissing, Tier, TierError, TierFull
from kvstrata.tiers.checksum import checksum

MiB = 1024 * 1024
CAPACITY = 12 * MiB


@dataclass(frozen=True)
class TierCase:
    name: str
    make: Callable[[Path], Awaitable[Tier]]
    bounded: bool = True  # has a capacity, so TierFull is part of its contract


async def _make_dram(tmp_path: Path) -> Tier:
    from kvstrata.tiers.dram import DramConfig, DramTier

    return DramTier(DramConfig(capacity=CAPACITY, name_prefix="kvstrata-test"))


async def _make_nvme(tmp_path: Path, direct: str = "auto") -> Tier:
    from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

    config = NvmeConfig(str(tmp_path / "nvme"), capacity=CAPACITY, io_threads=2, direct=direct)
    tier = NvmeTier(config)
    async for _ in tier.scan():
        pass
    return tier


async def _make_nvme_buffered(tmp_path: Path) -> Tier:
    return await _make_nvme(tmp_path, direct="no")


TIER_CASES: list[TierCase] = [
    TierCase("dram", _make_dram),
    TierCase("nvme", _make_nvme),  # O_DIRECT where the filesystem of tmp_path takes it
    TierCase("nvme-buffered", _make_nvme_buffered),
]


def chunk(
    i: int, size: int, ns: str = "contract@test", parent: bytes = b""
) -> tuple[ChunkMeta, bytes]:
    """A chunk with reproducible random bytes; the hash encodes i."""
    data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = ChunkKey(ns, i.to_bytes(8, "big") + b"\xaa" * 8)
    return ChunkMeta(key, parent, tokens=i % 512, size=size, checksum=checksum(data)), data


def run(case: TierCase, tmp_path: Path, body: Callable[[Tier], Awaitable[None]]) -> None:
    async def main() -> None:
        tier = await case.make(tmp_path)
        try:
            await body(tier)
        finally:
            await tier.close()

    asyncio.run(main())


@pytest.fixture(params=TIER_CASES, ids=lambda c: c.name)
def case(request: pytest.FixtureRequest) -> TierCase:
    param: TierCase = request.param
    return param


SIZES = [1, 100, 4095, 4096, 4097, 65536 + 3, MiB, 4 * MiB]


def test_round_trip_exact_bytes(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        for i, size in enumerate(SIZES):
            meta, data = chunk(i, size, parent=b"\x01" * 32 if i else b"")
            await tier.put(meta, data)
            out = bytearray(size)
            got = await tier.get(meta.key, memoryview(out))
            assert out == data, f"bytes differ for size {size}"
            assert got == meta
            await tier.delete(meta.key)  # keep the tier below capacity

    run(case, tmp_path, body)


def test_get_accepts_memoryview_of_numpy(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        meta, data = chunk(7, 10_000)
        await tier.put(meta, np.frombuffer(data, dtype=np.uint8).data)
        out = np.zeros(10_000, dtype=np.uint8)
        await tier.get(meta.key, out.data)
        assert out.tobytes() == data

    run(case, tmp_path, body)


def test_get_into_too_small_buffer_errors(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        meta, data = chunk(1, 5000)
        await tier.put(meta, data)
        with pytest.raises((ValueError, TierError)):
            await tier.get(meta.key, memoryview(bytearray(4999)))
        out = bytearray(5000)  # the chunk is still intact afterwards
        await tier.get(meta.key, memoryview(out))
        assert out == data

    run(case, tmp_path, body)


def test_missing_key(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        meta, _ = chunk(2, 10)
        with pytest.raises(ChunkMissing):
            await tier.get(meta.key, memoryview(bytearray(10)))
        assert not await tier.contains(meta.key)
        assert await tier.meta(meta.key) is None
        assert await tier.delete(meta.key) is False

    run(case, tmp_path, body)


def test_delete_and_contains(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        meta, data = chunk(3, 3000)
        await tier.put(meta, data)
        assert await tier.contains(meta.key)
        assert await tier.delete(meta.key) is True
        assert not await tier.contains(meta.key)
        with pytest.raises(ChunkMissing):
            await tier.get(meta.key, memoryview(bytearray(3000)))

    run(case, tmp_path, body)


def test_meta_is_kept(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        meta, data = chunk(4, 777, parent=b"\x05" * 64)
        meta = ChunkMeta(meta.key, meta.parent, 256, meta.size, meta.checksum, codec="fp8")
        await tier.put(meta, data)
        assert await tier.meta(meta.key) == meta

    run(case, tmp_path, body)


def test_replace_is_atomic(case: TierCase, tmp_path: Path) -> None:
    """A reader racing a replacement sees the whole old or the whole new chunk."""

    async def body(tier: Tier) -> None:
        old, old_data = chunk(5, 200_000)
        await tier.put(old, old_data)
        new_data = bytes(reversed(old_data))
        new = ChunkMeta(old.key, b"", 9, len(new_data), checksum(new_data))
        out = bytearray(200_000)
        results = await asyncio.gather(
            tier.get(old.key, memoryview(out)), tier.put(new, new_data), return_exceptions=True
        )
        assert results[1] is None
        assert results[0] in (old, new)
        assert bytes(out) == (old_data if results[0] == old else new_data)
        await tier.get(old.key, memoryview(out))
        assert out == new_data
        assert await tier.meta(old.key) == new

    run(case, tmp_path, body)


def test_replace_frees_old_space(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        base = tier.used
        meta, data = chunk(6, MiB)
        await tier.put(meta, data)
        once = tier.used
        for _ in range(3):
            await tier.put(meta, data)
        assert tier.used == once > base

    run(case, tmp_path, body)


def test_batch_forms(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        items = [chunk(10 + i, 1000 * (i + 1)) for i in range(5)]
        assert await tier.put_many(items) == [None] * 5
        missing, _ = chunk(99, 10)
        keys = [m.key for m, _ in items] + [missing.key]
        assert await tier.contains_many(keys) == [True] * 5 + [False]
        outs = [bytearray(m.size) for m, _ in items] + [bytearray(10)]
        results = await tier.get_many([(k, memoryview(o)) for k, o in zip(keys, outs, strict=True)])
        for (meta, data), res, out in zip(items, results, outs, strict=False):
            assert res == meta and out == data
        assert isinstance(results[-1], ChunkMissing)

    run(case, tmp_path, body)


def test_capacity_and_used_accounting(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        if case.bounded:
            assert tier.capacity >= CAPACITY - 4096
        base = tier.used
        metas = [chunk(20 + i, 100_000)[0] for i in range(3)]
        for meta in metas:
            await tier.put(meta, chunk(20 + metas.index(meta), 100_000)[1])
        assert tier.used >= base + 3 * 100_000
        for meta in metas:
            await tier.delete(meta.key)
        assert tier.used == base

    run(case, tmp_path, body)


def test_tier_full(case: TierCase, tmp_path: Path) -> None:
    """Filling the tier with 1 MiB chunks ends in TierFull; deleting one makes room again."""
    if not case.bounded:
        pytest.skip(f"{case.name} has no hard capacity")

    async def body(tier: Tier) -> None:
        huge, huge_data = chunk(30, tier.capacity + 1)
        with pytest.raises(TierFull):
            await tier.put(huge, huge_data)
        stored: list[ChunkMeta] = []
        with pytest.raises(TierFull):
            for i in range(tier.capacity // MiB + 2):
                meta, data = chunk(100 + i, MiB)
                await tier.put(meta, data)
                stored.append(meta)
        assert tier.used <= tier.capacity
        assert len(stored) >= tier.capacity // MiB - 2
        await tier.delete(stored[0].key)
        meta, data = chunk(500, MiB)
        await tier.put(meta, data)
        assert await tier.contains(meta.key)

    run(case, tmp_path, body)


def test_stats_move(case: TierCase, tmp_path: Path) -> None:
    async def body(tier: Tier) -> None:
        s = tier.stats
        meta, data = chunk(40, 5000)
        await tier.put(meta, data)
        assert (s.puts, s.bytes_in, s.chunks) == (1, 5000, 1)
        await tier.get(meta.key, memoryview(bytearray(5000)))
        assert (s.hits, s.bytes_out) == (1, 5000)
        with pytest.raises(ChunkMissing):
            await tier.get(chunk(41, 1)[0].key, memoryview(bytearray(1)))
        assert s.misses == 1
        await tier.delete(meta.key)
        assert (s.deletes, s.chunks) == (1, 0)

    run(case, tmp_path, body)


def test_close_is_idempotent(case: TierCase, tmp_path: Path) -> None:
    async def main() -> None:
        tier = await case.make(tmp_path)
        meta, data = chunk(50, 100)
        await tier.put(meta, data)
        await tier.close()
        await tier.close()
        assert isinstance(tier.info(), dict)

    asyncio.run(main())
