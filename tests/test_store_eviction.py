"""Placement scenarios: eviction order, watermarks, leases against eviction, demotion to and
promotion from lower tiers (a fake tier and the real NvmeTier), OOM."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import OutOfMemoryError
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier
from tests.fakes import FakeTier, chain, make_dram, open_store, wait_until

NS = "m@c4"
SLOT = 4096  # the DRAM arena allocates 4096-byte aligned slots


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def blob(i: int, size: int = SLOT) -> bytes:
    return bytes([i % 251]) * (size - 7) + i.to_bytes(7, "big")


def test_eviction_order_leaves_first_then_lru() -> None:
    """Scenario: chains a0→a1→a2 and b0→b1 are stored in that order, then a2 is read. Evicting
    one chunk at a time from DRAM picks leaves only, least recently used first: b1 (oldest
    leaf), b0 (now a leaf), a2, a1, a0 — never a parent before its child."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(64 * SLOT), nvme], start=False) as store:
            a, b = chain(3, b"a"), chain(2, b"b")
            for hashes in (a, b):
                parent = b""
                for i, h in enumerate(hashes):
                    assert await store.put(NS, h, parent, blob(i))
                    parent = h
            p = await store.get(NS, a[2])
            p.release()
            order = []
            for _ in range(5):
                victims = store.placement.pick(0, 1)
                assert len(victims) == 1
                assert await store.placement.move_down(victims[0], 0)
                order.append(victims[0].key.hash)
            assert order == [b[1], b[0], a[2], a[1], a[0]]
            assert store.placement.pick(0, 1) == []
            assert store.match_tiers(NS, a) == ["nvme"] * 3
            assert store.stats()["dram"]["demotions"] == 5

    run(main())


def test_background_demoter_keeps_dram_under_high_watermark() -> None:
    """Scenario: DRAM (16 slots, high 0.5, low 0.25) receives 12 chunks; the demoter writes
    the coldest back to NVMe until DRAM is at most a quarter full; every chunk still
    matches and reads back identical."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        cfg: dict[str, Any] = {"dram_high_watermark": 0.5, "dram_low_watermark": 0.25}
        async with open_store([make_dram(16 * SLOT), nvme], **cfg) as store:
            hashes = chain(12)
            parent = b""
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, parent, blob(i))
                parent = h
            dram = store.state.dram
            assert await wait_until(lambda: dram.used <= 4 * SLOT)
            assert store.match(NS, hashes) == 12
            assert len(nvme.data) >= 8
            tiers = store.match_tiers(NS, hashes)
            # leaves first: the tail of the chain left DRAM, the head stayed
            assert tiers[-1] == "nvme" and tiers[0] == "dram"
            for i, h in enumerate(hashes):
                p = await store.get(NS, h)
                assert bytes(p.view) == blob(i)
                if p.release:
                    p.release()

    run(main())


def test_leased_chunks_are_never_evicted() -> None:
    """Scenario: a DRAM-only store holds 4 chunks, 2 of them leased; making room for the
    whole arena evicts the 2 others and keeps the leased ones readable through their
    handles; a new chunk that needs the leased space gets -OOM naming dram."""

    async def main() -> None:
        async with open_store([make_dram(4 * SLOT)], start=False) as store:
            hashes = chain(4)
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, b"", blob(i))
            lease = await store.lease(NS, hashes[:2])
            assert lease is not None and len(lease.handles) == 2
            assert not await store.placement.make_room(0, 4 * SLOT)
            assert store.match(NS, hashes[:2]) == 2
            assert store.match(NS, hashes[2:3]) == 0 and store.match(NS, hashes[3:]) == 0
            dram = store.state.dram
            for i, h in enumerate(lease.handles):
                assert bytes(dram._buf[h.offset : h.offset + h.length]) == blob(i)
            with pytest.raises(OutOfMemoryError, match="dram"):
                await store.put(NS, b"big", b"", b"x" * (3 * SLOT))
            store.release(lease.id)
            assert await store.put(NS, b"big", b"", b"x" * (3 * SLOT))

    run(main())


def test_promotion_from_lower_tier_keeps_lower_copy() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(8 * SLOT), nvme], start=False) as store:
            assert await store.put(NS, b"x", b"", blob(1))
            rec = store.index.get(ChunkKey(NS, b"x"))
            assert await store.placement.move_down(rec, 0)
            assert rec.tiers == {"nvme"}
            p = await store.get(NS, b"x")
            assert bytes(p.view) == blob(1)
            assert rec.tiers == {"dram", "nvme"}  # promoted, lower copy kept
            assert store.stats()["dram"]["promotions"] == 1
            p.release()
            # a clean copy in DRAM is dropped without a second write
            puts = nvme.puts
            assert await store.placement.move_down(rec, 0)
            assert nvme.puts == puts and rec.tiers == {"nvme"}

    run(main())


def test_corrupt_lower_copy_is_a_miss_not_wrong_bytes() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(8 * SLOT), nvme], start=False) as store:
            assert await store.put(NS, b"x", b"", blob(2))
            rec = store.index.get(ChunkKey(NS, b"x"))
            assert await store.placement.move_down(rec, 0)
            nvme.corrupt(ChunkKey(NS, b"x"))
            assert await store.get(NS, b"x") is None
            assert store.match(NS, [b"x"]) == 0
            assert nvme.holds(ChunkKey(NS, b"x")) is None
            assert store.stats()["nvme"]["errors"] >= 1

    run(main())


def test_dram_to_nvme_demotion_and_back_with_real_nvme(tmp_path: Path) -> None:
    """Scenario: a 3-chunk chain is demoted from DRAM to a real NvmeTier; reading it back
    through KV.GET and through a lease gives identical bytes and promotes it to DRAM."""

    async def main() -> None:
        nvme = NvmeTier(NvmeConfig(path=str(tmp_path / "nvme"), capacity=1 << 24))
        async with open_store([make_dram(16 * SLOT), nvme], start=True) as store:
            hashes = chain(3)
            parent = b""
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, parent, blob(i, 5000))
                parent = h
            assert await store.placement.make_room(0, 16 * SLOT)
            assert store.match_tiers(NS, hashes) == ["nvme"] * 3
            p = await store.get(NS, hashes[0])
            assert bytes(p.view) == blob(0, 5000)
            p.release()
            lease = await store.lease(NS, hashes)
            assert lease is not None and len(lease.handles) == 3
            dram = store.state.dram
            for i, h in enumerate(lease.handles):
                assert bytes(dram._buf[h.offset : h.offset + h.length]) == blob(i, 5000)
            assert store.match_tiers(NS, hashes) == ["dram"] * 3
            store.release(lease.id)

    run(main())


def test_chunk_larger_than_dram_goes_below() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(4 * SLOT), nvme], start=False) as store:
            data = b"L" * (6 * SLOT)
            assert await store.put(NS, b"L", b"", data)
            assert store.match_tiers(NS, [b"L"]) == ["nvme"]
            p = await store.get(NS, b"L")
            assert bytes(p.view) == data and p.release is None

    run(main())


def test_match_prefetch_promotes_in_background() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(16 * SLOT), nvme]) as store:
            hashes = chain(3)
            parent = b""
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, parent, blob(i))
                parent = h
            assert await store.placement.make_room(0, 16 * SLOT)
            assert store.match_tiers(NS, hashes) == ["nvme"] * 3
            assert store.prefetch(NS, [*hashes, b"missing"]) == 3
            await store.prefetch_idle()
            assert store.match_tiers(NS, hashes) == ["dram"] * 3
            assert store.prefetch(NS, hashes) == 0

    run(main())


def test_victim_lost_to_another_mover_stays_a_candidate() -> None:
    """Scenario: eviction picks a chunk, but another mover (a promotion, a prefetch) starts
    moving it before the eviction does. The eviction gives up on it, and the chunk is still
    an eviction candidate once that move is over."""

    async def main() -> None:
        async with open_store([make_dram(8 * SLOT)], start=False) as store:
            assert await store.put(NS, b"x", b"", blob(1))
            rec = store.index.get(ChunkKey(NS, b"x"))
            placement = store.placement
            assert placement.pick(0, 1) == [rec]  # popped from DRAM's candidates
            assert store.state.begin_move(rec)  # someone else moves it first
            assert await placement.move_down(rec, 0) is False
            store.state.end_move(rec)
            assert placement.pick(0, 1) == [rec]  # still a candidate

    run(main())


def test_concurrent_demotions_into_full_nvme_evict_nvme_victims(tmp_path: Path) -> None:
    """Scenario: a real NvmeTier has room for one more chunk file and holds five older chunks.
    Four DRAM chunks are demoted at once: all four see room, but NVMe counts the writes in
    flight against its capacity, so three puts hit TierFull while the placement still sees
    free space. Each of those demotions then evicts NVMe's least recently used chunks until its
    write fits: all four land on NVMe, none stays behind in DRAM, NVMe stays within capacity."""
    size = 5000
    per_file = 4096 + 8192  # header + payload rounded up to 4 KiB blocks
    nvme = NvmeTier(NvmeConfig(path=str(tmp_path / "nvme"), capacity=6 * per_file))

    async def main() -> None:
        async with open_store([make_dram(32 * SLOT), nvme], start=False) as store:
            old, new = chain(5, b"o"), chain(4, b"n")
            for i, h in enumerate(old):
                assert await store.put(NS, h, b"", blob(i, size))
            assert await store.placement.make_room(0, 32 * SLOT)
            assert store.match_tiers(NS, old) == ["nvme"] * 5
            assert nvme.capacity - nvme.used == per_file
            for i, h in enumerate(new):
                assert await store.put(NS, h, b"", blob(10 + i, size))
            victims = store.placement.pick(0, 4 * size)
            assert sorted(r.key.hash for r in victims) == new
            moved = await asyncio.gather(*(store.placement.move_down(r, 0) for r in victims))
            assert moved == [True] * 4
            assert [store.match_tiers(NS, [h]) for h in new] == [["nvme"]] * 4
            assert store.stats()["nvme"]["evictions"] == 3 and nvme.used == nvme.capacity
            assert sum(store.match_tiers(NS, [h]) == ["nvme"] for h in old) == 2
            for i, h in enumerate(new):
                p = await store.get(NS, h)
                assert bytes(p.view) == blob(10 + i, size)
                if p.release is not None:
                    p.release()

    run(main())


def test_promotion_in_flight_does_not_make_its_parent_a_victim() -> None:
    """Scenario: DRAM (8 slots, high 0.5, low 0.25) holds a0, b0, b1, c0 (4 slots: at its high
    mark, not above); a0's child a1 is only in NVMe. A GET of a1 promotes it: its DRAM slot is
    reserved while NVMe is read. A demoter round in that window must not run (the reservation
    is not committed), else it sees a0 as a leaf and demotes it although a1 is about to land
    under it. Once a1 is committed the round runs: the other leaves leave, a0 and a1 stay."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        cfg: dict[str, Any] = {"dram_high_watermark": 0.5, "dram_low_watermark": 0.25}
        async with open_store([make_dram(8 * SLOT), nvme], start=False, **cfg) as store:
            a0, a1, b0, b1, c0 = b"a0", b"a1", b"b0", b"b1", b"c0"
            assert await store.put(NS, a0, b"", blob(0))
            assert await store.put(NS, a1, a0, blob(1))
            rec0, rec1 = store.index.get(ChunkKey(NS, a0)), store.index.get(ChunkKey(NS, a1))
            assert await store.placement.move_down(rec1, 0) and rec1.tiers == {"nvme"}
            for i, h in enumerate((b0, b1, c0)):
                assert await store.put(NS, h, b"", blob(2 + i))
            dram = store.state.dram
            assert dram.used == 4 * SLOT
            nvme.gate = asyncio.Event()
            reading = asyncio.create_task(store.get(NS, a1))
            assert await wait_until(lambda: dram.used == 5 * SLOT)  # a1's slot is reserved
            await store.placement.enforce(0)  # a demoter round now (its 50 ms tick)
            assert "dram" in rec0.tiers
            nvme.gate.set()
            p = await reading
            assert p is not None and bytes(p.view) == blob(1)
            if p.release:
                p.release()
            assert rec1.tiers == {"dram", "nvme"} and store.placement.above_high(dram)
            await store.placement.enforce(0)
            assert "dram" in rec0.tiers and "dram" in rec1.tiers
            assert dram.used == 2 * SLOT  # b0, b1, c0 left, the least recently used leaves

    run(main())


def test_demoter_counts_writes_in_flight() -> None:
    """The demoter measures NVMe with its writes in flight (``pending``: write-backs still
    landing): a tier whose committed chunks are under the high mark but whose pending writes
    take it above is demoted, down to the low mark with those writes counted, so that they
    find their room when they land."""
    nvme = FakeTier("nvme", capacity=40 * SLOT)

    async def main() -> None:
        async with open_store([make_dram(64 * SLOT), nvme], start=False) as store:
            hashes = chain(30, b"w")
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, b"", blob(i))
            assert await store.placement.make_room(0, 64 * SLOT)  # all of them go to NVMe
            assert nvme.used == 30 * SLOT
            placement, j = store.placement, store.state.tier_index("nvme")
            assert not placement.above_high(nvme)  # 75 % used: under the 0.95 mark
            nvme.pending = 9 * SLOT  # type: ignore[attr-defined]  (write-backs in flight)
            assert placement.filled(nvme) == 39 * SLOT and placement.above_high(nvme)
            await placement.enforce(j)
            pol = placement.policy("nvme")
            assert pol.low is not None
            assert nvme.used + 9 * SLOT <= pol.low * nvme.capacity  # room for what lands
            assert store.stats()["nvme"]["evictions"] >= 5

    run(main())


class _LateReader(FakeTier):
    """A tier whose reads, like NVMe's on its I/O threads, go on writing into the caller's
    buffer after the caller was cancelled (the job runs until ``release`` is set)."""

    def __init__(self) -> None:
        super().__init__("nvme")
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.late_writes = 0

    async def get(self, key: ChunkKey, out: memoryview) -> Any:
        meta, blob = self.data[key]
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def job() -> None:  # (not cancelled with the caller, as a pool thread is not)
            self.started.set()
            await self.release.wait()
            out[: meta.size] = blob
            self.late_writes += 1
            done.set_result(meta)

        self._job = asyncio.ensure_future(job())
        return await done


def test_a_cancelled_promotion_keeps_its_slot_until_the_read_ends() -> None:
    """A KV.GET whose promotion reads from NVMe is cancelled mid-read (its client left): the
    read goes on into the DRAM slot, so the slot stays held until it ends; a chunk written
    meanwhile gets other memory, and its bytes are intact after the late read landed."""
    lower = _LateReader()

    async def main() -> None:
        async with open_store([make_dram(4 * SLOT), lower], start=False) as store:
            a, b = b"A" * 16, b"B" * 16
            assert await store.put(NS, a, b"", blob(1))
            assert await store.placement.make_room(0, 4 * SLOT)  # A is in NVMe only now
            assert store.match_tiers(NS, [a]) == ["nvme"]
            dram = store.state.dram
            getting = asyncio.ensure_future(store.get(NS, a))
            await lower.started.wait()
            getting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await getting
            assert dram.deferred_frees == 1  # the aborted slot is not reusable yet
            assert await store.put(NS, b, b"", blob(2))  # lands in other memory
            lower.release.set()
            await lower._job
            assert await wait_until(lambda: dram.deferred_frees == 0)  # freed once it ended
            assert lower.late_writes == 1
            p = await store.get(NS, b)
            assert bytes(p.view) == blob(2)  # not the late read's bytes
            if p.release is not None:
                p.release()

    run(main())
