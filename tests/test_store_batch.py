"""KV.MRESERVE in the store (``kvstore.batch``): what one failing chunk of a batch does, and
that the batch's one-loop publish leaves what a commit per chunk leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.protocol.errors import CommandError, LeaseError
from kvstrata.store.kvstore.batch import EXISTS, BatchItem
from kvstrata.tiers.base import Buffer, TierIOError
from kvstrata.tiers.checksum import checksum
from tests.fakes import FakeTier, chain, make_dram, open_store

NS = "m@c4"


class FailingThirdPut(FakeTier):
    """An NVMe stand-in whose ``fail_at``-th put fails (the third by default)."""

    fail_at = 3

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        if self.puts + 1 == self.fail_at:
            raise TierIOError("nvme: disk full")
        await super().put(meta, data)


def test_commit_stops_at_a_failing_chunk_publishing_only_those_before_it() -> None:
    """Scenario: a batch of four chunks is committed and the third cannot be published (its
    write-through fails): the error names it, chunks 1-2 are stored, 3-4 are not, every slot
    of theirs is freed and their keys can be reserved again; the lease is gone."""

    async def main() -> None:
        nvme = FailingThirdPut()
        async with open_store([make_dram(), nvme], nvme_write_policy="write-through") as store:
            hashes = chain(4)
            res = await store.reserve_batch(NS, b"", [BatchItem(h, 1000) for h in hashes])
            assert res.lease is not None and len(res.entries) == 4
            for chunk in res.lease.chunks:
                chunk.sink.view[:] = chunk.key.hash[-1:] * 1000
            with pytest.raises(CommandError, match=r"chunk 2 .* 2 named before it were, .*full"):
                await store.commit(res.lease.id)
            assert nvme.puts == 2  # the third put failed, the fourth was never tried
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


class ListTracer:
    """Keeps what the store reports to the trace recorder."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, tuple[bytes, ...], dict[str, Any]]] = []

    def record(self, op: str, ns: str, hashes: Sequence[bytes], **kw: Any) -> None:
        self.records.append((op, ns, tuple(hashes), kw))


def test_batch_commit_leaves_what_one_commit_per_chunk_leaves() -> None:
    """Scenario: the same chain of six chunks under parent P (half with a writer's DIGEST,
    half hashed by the store) is stored once as one KV.MRESERVE + KV.COMMIT (the batch's
    one-loop publish) and once as six KV.RESERVE, then six KV.COMMIT (``commit_new`` each).
    Both stores end the same: trace records, records (links, sizes, checksums, verified),
    children counts, DRAM counters and LRU victim order."""

    def snapshot(store: Any, tracer: ListTracer) -> dict[str, Any]:
        recs = {}
        for h in [b"P", *hashes]:
            rec = store.index.get(ChunkKey(NS, h))
            recs[h] = (rec.parent, rec.tokens, rec.size, rec.checksum, rec.verified,
                       sorted(rec.tiers), dict(rec.child_res), len(rec.children))  # fmt: skip
        heap = store.placement.heaps["dram"]
        victims = []
        while (rec := heap.pop()) is not None:
            victims.append(rec.key.hash)
        return {
            "trace": tracer.records, "records": recs, "victims": victims,
            "counters": store.state.counters["dram"].as_dict(), "keys": len(store.keyspace),
        }  # fmt: skip

    hashes = chain(6)
    data = {h: h[-1:] * (1000 + 100 * i) for i, h in enumerate(hashes)}
    digest = {h: checksum(data[h]) if i % 2 else None for i, h in enumerate(hashes)}

    async def batched() -> dict[str, Any]:
        async with open_store() as store:
            tracer = ListTracer()
            store.state.tracer = tracer
            assert await store.put(NS, b"P", b"", b"p" * 100)
            items = [BatchItem(h, len(data[h])) for h in hashes]
            res = await store.reserve_batch(NS, b"P", items, tokens=16)
            assert res.lease is not None
            for chunk in res.lease.chunks:
                chunk.sink.view[:] = data[chunk.key.hash]
            await store.commit(res.lease.id, range(6), digests=[digest[h] for h in hashes])
            return snapshot(store, tracer)

    async def per_chunk() -> dict[str, Any]:
        async with open_store() as store:
            tracer = ListTracer()
            store.state.tracer = tracer
            assert await store.put(NS, b"P", b"", b"p" * 100)
            leases, parent = [], b"P"
            for h in hashes:
                leases.append(await store.reserve(NS, h, parent, len(data[h]), tokens=16))
                parent = h
            for h, lease in zip(hashes, leases, strict=True):
                lease.sink.view[:] = data[h]
                await store.commit(lease.id, digests=[digest[h]])
            return snapshot(store, tracer)

    one, many = asyncio.run(batched()), asyncio.run(per_chunk())
    assert [r[0] for r in one["trace"]] == ["put"] + ["reserve"] * 6 + ["put"] * 6
    assert [r[4] for r in one["records"].values()] == [True, True, False, True, False, True, False]
    assert one == many
