"""The batch paths' saved look-ups (issue 31): a KV.MRESERVE looks each chunk up once, until
it first awaits; a key's writer event exists only once someone waits for the key; the index
finds a new record's parent once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.kvstore import batch
from kvstrata.store.kvstore.batch import EXISTS, BatchItem
from tests.fakes import chain, make_dram, open_store

NS = "m@c4"


def test_a_chunk_published_while_the_batch_waits_is_reported_stored_not_reserved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scenario: the first slot of a batch of four takes the awaited path (as when it waits
    for room) and another writer stores the third chunk meanwhile: the reservation reports
    that chunk as stored (no slot, no second writer of a published key), reserves the others,
    and their commit leaves the other writer's record as it was."""

    async def main() -> None:
        async with open_store([make_dram()]) as store:
            hashes = chain(4)
            real_now, real_slot = batch._reserve_now, store.writes.reserve_slot

            def now(writes: Any, index: int, *args: Any) -> Any:
                return None if index == 0 else real_now(writes, index, *args)

            async def slot(key: ChunkKey, nbytes: int, in_gpu: bool) -> Any:
                assert await store.put(NS, hashes[2], hashes[1], b"w" * 100)
                return await real_slot(key, nbytes, in_gpu)

            monkeypatch.setattr(batch, "_reserve_now", now)
            monkeypatch.setattr(store.writes, "reserve_slot", slot)
            res = await store.reserve_batch(NS, b"", [BatchItem(h, 100) for h in hashes])
            assert res.entries[2] == EXISTS
            assert res.lease is not None and sorted(res.lease.pending) == [0, 1, 3]
            other = store.state.index.get(ChunkKey(NS, hashes[2]))
            for chunk in res.lease.chunks:
                chunk.sink.view[:] = b"b" * 100
            await store.commit(res.lease.id)
            assert store.match(NS, hashes) == 4
            assert store.state.index.get(ChunkKey(NS, hashes[2])) is other

    asyncio.run(main())


def test_a_writer_event_is_made_for_the_first_waiter_and_set_at_release() -> None:
    """Scenario: a key is claimed (no event yet); two waiters wait for it, sharing the one
    event the first made; releasing the claim wakes both, and a later claim starts bare."""

    async def main() -> None:
        async with open_store([make_dram()]) as store:
            state = store.state
            key = ChunkKey(NS, b"k")
            assert state.claim(key) and state.writers[key] is None
            assert not state.claim(key)  # owned: a second writer is refused
            waiters = [asyncio.ensure_future(state.wait_key(key, 5)) for _ in range(2)]
            for _ in range(100):  # until the first waiter ran (a yield, not a timed sleep)
                if state.writers[key] is not None:
                    break
                await asyncio.sleep(0)
            event = state.writers[key]
            assert event is not None and not any(w.done() for w in waiters)
            state.release_claim(key)
            await asyncio.wait_for(asyncio.gather(*waiters), 5)
            assert event.is_set() and key not in state.writers
            assert state.claim(key) and state.writers[key] is None
            state.release_claim(key)
            await asyncio.wait_for(state.wait_key(key, 5), 5)  # free: returns at once

    asyncio.run(main())


def _rec(h: bytes, parent: bytes, tiers: set[str]) -> ChunkRecord:
    rec = ChunkRecord(ChunkKey(NS, h), parent, 4, 10, b"c" * 16)
    rec.tiers = set(tiers)
    return rec


def test_the_index_counts_a_new_records_residency_in_its_parent_either_order() -> None:
    """Scenario: a parent then its child, and another child before its parent: the parent's
    per-tier child counts, the residency totals and the hook's calls come out the same."""
    seen: list[tuple[bytes, str]] = []
    index = ChunkIndex(lambda rec, tier: seen.append((rec.key.hash, tier)))
    index.add(_rec(b"p", b"", {"dram"}))
    index.add(_rec(b"c", b"p", {"dram", "nvme"}))
    parent = index.get(ChunkKey(NS, b"p"))
    assert parent is not None and parent.child_res == {"dram": 1, "nvme": 1}
    assert index.count_in == {"dram": 2, "nvme": 1}
    assert (b"p", "dram") in seen[1:]  # the parent stopped being a leaf in dram: re-armed
    index.add(_rec(b"c2", b"q", {"dram"}))  # the child first
    index.add(_rec(b"q", b"", {"dram"}))
    q = index.get(ChunkKey(NS, b"q"))
    assert q is not None and q.child_res == {"dram": 1}
    index.remove(index.get(ChunkKey(NS, b"c2")))  # type: ignore[arg-type]
    assert q.child_res == {} and index.count_in == {"dram": 3, "nvme": 1}
