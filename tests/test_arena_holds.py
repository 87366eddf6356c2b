"""Slot holds of the arena tiers and the tables behind fencing: a held slot outlives its chunk
or reservation, the arena's name and handles carry a random instance identity, the lease table
counts leases per holder, the fence table bounds bytes per holder."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.protocol.errors import LeaseLimitError
from kvstrata.store.fences import FencedSlot, FenceTable
from kvstrata.store.leases import NO_HOLDER, Holder, LeaseTable, WriteLease
from kvstrata.tiers.base import Handle
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.dram import DramConfig, DramTier, reclaim_stale_arenas

SLOT = 64 * 1024


def meta(i: int) -> ChunkMeta:
    data = bytes([i]) * SLOT
    return ChunkMeta(ChunkKey("holds@c1", bytes([i])), b"", 0, SLOT, checksum(data))


def tier(slots: int = 2) -> DramTier:
    return DramTier(DramConfig(capacity=slots * SLOT, name_prefix="kvstrata-test", pin="no"))


def test_a_held_slot_is_reused_only_after_the_last_unhold() -> None:
    async def main() -> None:
        t = tier()
        try:
            await t.put(meta(1), bytes([1]) * SLOT)
            h = t.handle(meta(1).key)
            t.hold(h.offset)
            t.hold(h.offset)
            await t.delete(meta(1).key)
            assert t.used == SLOT and t.deferred_frees == 1  # deleted, not reusable
            await t.put(meta(2), bytes([2]) * SLOT)
            assert t.handle(meta(2).key).offset != h.offset
            t.unhold(h.offset)
            assert t.used == 2 * SLOT
            t.unhold(h.offset)
            assert t.used == SLOT and t.deferred_frees == 0
            t.reserve(meta(3).key, SLOT)  # an aborted reservation is held the same way
            r = t.reserved_handle(meta(3).key)
            t.hold(r.offset)
            t.abort(meta(3).key)
            assert t.used == 2 * SLOT
            t.unhold(r.offset)
            assert t.used == SLOT
        finally:
            await t.close()

    asyncio.run(main())


def test_arena_identity_is_random_and_in_every_handle_and_region() -> None:
    async def main() -> None:
        a, b = tier(), tier()
        try:
            assert a.instance != b.instance and re.fullmatch(r"[0-9a-f]{16}", a.instance)
            assert str(os.getpid()) not in a.arena_name.split("-")
            assert a.arena_name.startswith(f"kvstrata-test-{a.instance}-")
            await a.put(meta(1), bytes([1]) * SLOT)
            assert a.handle(meta(1).key).instance == a.instance
            assert a.regions()[0].instance == a.instance
            assert a.info()["instance"] == a.instance
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_stale_arenas_of_both_name_forms_are_reclaimed(tmp_path: os.PathLike[str]) -> None:
    for name in ("kvs-0123456789abcdef-0", "kvs-4242-1", "kvs-notanarena-0"):
        path = os.path.join(tmp_path, name)
        with open(path, "wb"):
            pass
        os.utime(path, (0, 0))
    removed = reclaim_stale_arenas("kvs", shm_dir=str(tmp_path))
    assert sorted(removed) == ["kvs-0123456789abcdef-0", "kvs-4242-1"]


def _write_lease(lid: str, holder: Holder) -> WriteLease:
    h = Handle("dram0", 0, 1)
    return WriteLease(lid, ChunkKey("n@c1", b"k"), b"", 0, 1, h, None, 1e18, holder)


def test_lease_table_counts_per_holder_and_in_total() -> None:
    table = LeaseTable(max_per_holder=2, max_total=3)
    a, b = Holder(1), Holder(2)
    for lid in ("1", "2"):
        table.admit(a)
        table.add(_write_lease(lid, a))
    with pytest.raises(LeaseLimitError, match="lease-max-per-client 2"):
        table.admit(a)
    table.admit(b)
    table.add(_write_lease("3", b))
    with pytest.raises(LeaseLimitError, match="lease-max 3"):
        table.admit(b)
    table.pop("1")
    table.admit(a)
    assert table.held_by(a) == 1 and table.held_by(b) == 1 and table.refused == 2
    table.max_total = 0
    table.admit(NO_HOLDER)  # in-process leases: only the total bounds them


def test_fence_table_bounds_bytes_per_holder_and_ends_gone_holders() -> None:
    async def main() -> None:
        t = tier(4)
        try:
            await t.put(meta(1), bytes([1]) * SLOT)
            h = t.handle(meta(1).key)
            open_ = {"a": True}
            a = Holder(1, lambda: open_["a"])
            fences = FenceTable(max_bytes=SLOT // 2)
            fences.admit(a)
            fences.add("L1", a, [FencedSlot(t, h.offset, h.length)])
            assert fences.bytes_of(a) == SLOT and "L1" in fences
            with pytest.raises(LeaseLimitError, match="lease-fence-max"):
                fences.admit(a)
            fences.admit(Holder(2, lambda: True))  # others are not affected
            await t.delete(meta(1).key)
            assert t.used == SLOT
            assert fences.end_gone() == 0
            open_["a"] = False
            assert fences.end_gone() == 1 and t.used == 0 and len(fences) == 0
            assert not fences.end("L1", a)
        finally:
            await t.close()

    asyncio.run(main())
