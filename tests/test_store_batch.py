"""KV.MRESERVE in the store (``kvstore.batch``): what one failing chunk of a batch does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.protocol.errors import CommandError, LeaseError
from kvstrata.store.kvstore.batch import EXISTS, BatchItem
from tests.fakes import chain, make_dram, open_store

NS = "m@c4"


def test_commit_stops_at_a_failing_chunk_publishing_only_those_before_it() -> None:
    """Scenario: a batch of four chunks is committed and the third cannot be published (its
    write-through fails): the error names it, chunks 1-2 are stored, 3-4 are not, every slot
    of theirs is freed and their keys can be reserved again; the lease is gone."""

    async def main() -> None:
        async with open_store() as store:
            hashes = chain(4)
            res = await store.reserve_batch(NS, b"", [BatchItem(h, 1000) for h in hashes])
            assert res.lease is not None and len(res.entries) == 4
            for chunk in res.lease.chunks:
                chunk.sink.view[:] = chunk.key.hash[-1:] * 1000
            real = store.writes.commit_new
            calls = 0

            async def failing(*args: Any) -> None:
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise CommandError("write-through to nvme failed: disk full")
                await real(*args)

            store.writes.commit_new = failing
            with pytest.raises(CommandError, match=r"chunk 2 .* 2 named before it were, .*full"):
                await store.commit(res.lease.id)
            store.writes.commit_new = real
            assert store.match(NS, hashes) == 2
            assert store.state.dram.used == 2 * 4096  # the slots of chunks 3 and 4 are free
            assert len(store.state.leases) == 0
            with pytest.raises(LeaseError):
                await store.commit(res.lease.id)
            again = await store.reserve_batch(NS, hashes[1], [BatchItem(h, 10) for h in hashes[2:]])
            assert again.lease is not None and len(again.lease.chunks) == 2
            store.abort(again.lease.id)
            assert (await store.reserve_batch(NS, b"", [BatchItem(hashes[0], 1)])).entries == (
                EXISTS,
            )

    asyncio.run(main())


def test_batches_into_a_full_dram_make_room_while_the_demoter_evicts() -> None:
    """Scenario (found by bench_vllm_tier): chains of 16 chunks of 2 MiB are reserved in one
    batch each into a 128 MiB DRAM with nothing below it. The fourth fills it; for the fifth the
    demoter picks the chains' leaves (the only victims) and, before their moves even start, the
    room maker finds no victim left: it must wait for that round instead of answering -OOM.
    Every batch gets its slots; DRAM ends below its capacity."""

    async def main() -> None:
        async with open_store([make_dram(128 << 20)]) as store:
            for r in range(7):
                items = [BatchItem(b"r%d-%02d" % (r, i), 2 << 20) for i in range(16)]
                res = await store.reserve_batch(NS, b"", items)
                assert res.lease is not None and len(res.lease.chunks) == 16
                await store.commit(res.lease.id)
                assert store.match(NS, [item.hash for item in items]) == 16
            assert store.state.dram.used <= 128 << 20

    asyncio.run(main())
