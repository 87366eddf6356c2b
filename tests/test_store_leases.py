"""Read and write leases: pins, expiry by the sweeper, commit/abort, wrong kinds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import BusyError, CommandError, LeaseError
from kvstrata.store.leases import LeaseTable, ReadLease
from tests.fakes import chain, open_store, wait_until

NS = "m@c4"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_lease_stops_at_first_miss_and_release_unpins() -> None:
    async def main() -> None:
        async with open_store() as store:
            hashes = chain(3)
            for h in (hashes[0], hashes[2]):
                assert await store.put(NS, h, b"", h * 10)
            lease = await store.lease(NS, hashes)
            assert lease is not None and len(lease.handles) == 1
            assert len(lease.id) == 16 and int(lease.id, 16) >= 0
            rec = store.index.get(ChunkKey(NS, hashes[0]))
            assert rec.pins == 1 and rec.leases == 1
            assert store.info(NS, hashes[0])["leases"] == 1
            store.release(lease.id)
            assert rec.pins == 0 and rec.leases == 0
            with pytest.raises(LeaseError):
                store.release(lease.id)
            assert await store.lease(NS, [b"none"]) is None

    run(main())


def test_lease_expiry_frees_pins() -> None:
    """Scenario: a client leases two chunks with a 30 ms TTL and disappears; the sweeper ends
    the lease, the pins drop to zero and the lease id is refused afterwards."""

    async def main() -> None:
        async with open_store() as store:
            hashes = chain(2)
            for h in hashes:
                assert await store.put(NS, h, b"", b"z" * 100)
            lease = await store.lease(NS, hashes, ttl_ms=30)
            recs = [store.index.get(ChunkKey(NS, h)) for h in hashes]
            assert all(r.pins == 1 for r in recs)
            assert await wait_until(lambda: all(r.pins == 0 for r in recs))
            assert all(r.leases == 0 for r in recs)
            assert len(store.leases) == 0 and store.leases.expired == 1
            with pytest.raises(LeaseError):
                store.release(lease.id)

    run(main())


def test_write_lease_commit_publishes_with_checksum() -> None:
    async def main() -> None:
        async with open_store() as store:
            lease = await store.reserve(NS, b"w", b"", 5000, tokens=8)
            dram = store.state.dram
            h = lease.handle
            assert h.length == 5000
            dram._buf[h.offset : h.offset + h.length] = b"k" * 5000
            assert store.match(NS, [b"w"]) == 0
            with pytest.raises(BusyError):
                await store.reserve(NS, b"w", b"", 10)
            with pytest.raises(LeaseError, match="is a write lease"):
                store.release(lease.id)
            await store.commit(lease.id)
            p = await store.get(NS, b"w")
            assert bytes(p.view) == b"k" * 5000
            p.release()
            from kvstrata.tiers.checksum import checksum

            assert store.info(NS, b"w")["checksum"] == checksum(b"k" * 5000).hex()
            assert store.info(NS, b"w")["tokens"] == 8
            with pytest.raises(LeaseError):
                await store.commit(lease.id)
            with pytest.raises(CommandError, match="already exists"):
                await store.reserve(NS, b"w", b"", 10)

    run(main())


def test_write_lease_abort_and_expiry_free_the_slot() -> None:
    async def main() -> None:
        async with open_store() as store:
            dram = store.state.dram
            lease = await store.reserve(NS, b"a", b"", 5000)
            assert dram.used > 0
            store.abort(lease.id)
            assert dram.used == 0 and store.match(NS, [b"a"]) == 0
            with pytest.raises(LeaseError):
                store.abort(lease.id)
            await store.reserve(NS, b"b", b"", 5000, ttl_ms=20)
            assert await wait_until(lambda: dram.used == 0)
            # the key is free again after expiry
            again = await store.reserve(NS, b"b", b"", 100)
            store.abort(again.id)

    run(main())


def test_commit_of_read_lease_is_an_error_without_state_change() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"r", b"", b"r" * 10)
            lease = await store.lease(NS, [b"r"])
            with pytest.raises(LeaseError, match="read lease"):
                await store.commit(lease.id)
            with pytest.raises(LeaseError, match="read lease"):
                store.abort(lease.id)
            assert store.index.get(ChunkKey(NS, b"r")).pins == 1
            store.release(lease.id)

    run(main())


def test_reserve_rejects_bad_sizes() -> None:
    async def main() -> None:
        async with open_store() as store:
            cap = store.state.dram.capacity
            for n in (0, cap + 1):
                with pytest.raises(CommandError, match="nbytes"):
                    await store.reserve(NS, b"x", b"", n)
            assert not store.state.writers and len(store.leases) == 0

    run(main())


def test_deleted_chunk_stays_readable_through_lease_until_release() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"d", b"", b"D" * 3000)
            lease = await store.lease(NS, [b"d"])
            assert await store.delete(NS, b"d") == 1
            assert store.match(NS, [b"d"]) == 0
            h = lease.handles[0]
            dram = store.state.dram
            # the slot is not reused while leased: a new chunk lands elsewhere
            assert await store.put(NS, b"e", b"", b"E" * 3000)
            assert bytes(dram._buf[h.offset : h.offset + h.length]) == b"D" * 3000
            store.release(lease.id)
            await store.drain()
            assert dram.info()["chunks"] == 1

    run(main())


def test_lease_table_ids_and_expiry_order() -> None:
    now = [0.0]
    table = LeaseTable(clock=lambda: now[0])
    ids = {table.new_id() for _ in range(100)}
    assert len(ids) == 100
    for i, d in enumerate((3.0, 1.0, 2.0)):
        table.add(ReadLease(f"l{i}", "ns", (), (), d))
    now[0] = 2.5
    assert sorted(x.id for x in table.take_expired()) == ["l1", "l2"]
    assert len(table) == 1 and table.get("l0") is not None
