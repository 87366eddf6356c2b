"""KVStore basics over a real (small) DRAM tier: put/get, NX, match, info, delete, TTL, the
keyspace integration and the payload sink."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey
from tests.fakes import FakeTier, chain, make_dram, open_store

NS = "llama@bf16@c4"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _put_chain(store: Any, hashes: list[bytes], size: int = 100) -> None:
    parent = b""
    for i, h in enumerate(hashes):
        assert await store.put(NS, h, parent, bytes([i % 251]) * size, tokens=4)
        parent = h


def test_put_get_roundtrip_and_release() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"a", b"", b"hello world", tokens=4)
            payload = await store.get(NS, b"a")
            assert payload is not None and bytes(payload.view) == b"hello world"
            rec = store.index.get(ChunkKey(NS, b"a"))
            assert rec.pins == 1  # pinned until released
            assert payload.release is not None
            payload.release()
            payload.release()  # idempotent
            assert rec.pins == 0
            assert await store.get(NS, b"zz") is None

    run(main())


def test_nx_and_identical_reput() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"a", b"", b"one")
            assert not await store.put(NS, b"a", b"", b"two", nx=True)
            p = await store.get(NS, b"a")
            assert bytes(p.view) == b"one"
            p.release()
            assert await store.put(NS, b"a", b"", b"one")  # identical: refresh only
            assert await store.put(NS, b"a", b"", b"three")  # replace
            p = await store.get(NS, b"a")
            assert bytes(p.view) == b"three"
            p.release()
            assert len(store.keyspace) == 1

    run(main())


def test_match_over_10k_chain() -> None:
    """Scenario: a 10,000-chunk chain is stored; MATCH of the whole chain answers 10,000, a
    longer query stops at the end of what is cached, and WITHTIERS names dram for each."""

    async def main() -> None:
        async with open_store([make_dram(48 << 20)]) as store:
            hashes = chain(10_000)
            await _put_chain(store, hashes, size=16)
            assert store.match(NS, hashes) == 10_000
            assert store.match(NS, [*hashes, b"nope"]) == 10_000
            assert store.match(NS, hashes[:123]) == 123
            tiers = store.match_tiers(NS, hashes)
            assert len(tiers) == 10_000 and set(tiers) == {"dram"}
            assert store.match("other-ns", hashes) == 0

    run(main())


def test_miss_in_the_middle_of_a_chain() -> None:
    """Scenario: chunk 5 of a 10-chunk chain is deleted; MATCH stops at 5 although later
    chunks are still cached."""

    async def main() -> None:
        async with open_store() as store:
            hashes = chain(10)
            await _put_chain(store, hashes)
            assert await store.delete(NS, hashes[5]) == 1
            assert store.match(NS, hashes) == 5
            assert store.match(NS, hashes[6:]) == 4

    run(main())


def test_info_and_children() -> None:
    async def main() -> None:
        async with open_store() as store:
            await _put_chain(store, chain(3))
            info = store.info(NS, chain(3)[1])
            assert info["tiers"] == ["dram"]
            assert info["size"] == 100 and info["tokens"] == 4
            assert info["parent"] == chain(3)[0].hex()
            assert info["children"] == 1 and info["leases"] == 0 and info["ttl"] == -1
            assert len(info["checksum"]) == 32
            assert store.info(NS, b"missing") is None

    run(main())


def test_delete_cascade_frees_every_tier() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(), nvme], nvme_write_policy="write-through") as store:
            hashes = chain(4)
            await _put_chain(store, hashes)
            assert len(nvme.data) == 4
            assert await store.delete(NS, hashes[1], cascade=True) == 3
            assert store.match(NS, hashes) == 1
            assert len(nvme.data) == 1
            assert store.state.dram.info()["chunks"] == 1
            assert len(store.keyspace) == 1

    run(main())


def test_keyspace_del_and_flush_free_the_chunk() -> None:
    async def main() -> None:
        async with open_store() as store:
            await _put_chain(store, chain(3))
            key = ChunkKey(NS, chain(3)[0]).redis_key()
            assert store.keyspace.lookup(key).type_name == "kvchunk"
            assert store.keyspace.delete(key)
            await store.drain()
            assert store.match(NS, chain(3)) == 0
            assert store.state.dram.info()["chunks"] == 2
            store.keyspace.flush()
            await store.drain()
            assert len(store.index) == 0 and store.state.dram.used == 0

    run(main())


def test_ttl_expiry_is_a_miss_and_frees() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"t", b"", b"x" * 10, ttl_ms=30)
            assert store.match(NS, [b"t"]) == 1
            assert 0 < store.info(NS, b"t")["ttl"] <= 30
            await asyncio.sleep(0.06)
            assert store.match(NS, [b"t"]) == 0
            await store.drain()
            assert store.state.dram.used == 0
            assert await store.get(NS, b"t") is None

    run(main())


def test_payload_sink_is_one_copy_and_invisible_until_put() -> None:
    async def main() -> None:
        async with open_store() as store:
            sink = store.reserve_put(NS, b"big", b"", 70_000)
            assert sink is not None
            # a second upload of the same chunk may arrive meanwhile: the key is claimed only
            # when a PUT runs, so neither upload can block the other (or a command before it)
            second = store.reserve_put(NS, b"big", b"", 70_000)
            assert second is not None
            sink.view[:] = b"q" * 70_000
            second.view[:] = b"q" * 70_000
            assert store.match(NS, [b"big"]) == 0  # invisible until committed
            assert await store.put(NS, b"big", b"", sink.view, sink=sink)
            assert not await store.put(NS, b"big", b"", second.view, nx=True, sink=second)
            assert store.state.dram.info()["reserved"] == 0  # the loser's slot is freed
            p = await store.get(NS, b"big")
            assert bytes(p.view) == b"q" * 70_000
            p.release()
            aborted = store.reserve_put(NS, b"other", b"", 5000)
            aborted.abort()
            assert store.match(NS, [b"other"]) == 0
            assert store.state.dram.info()["reserved"] == 0
            assert store.reserve_put(NS, b"other", b"", 5000) is not None  # key free again

    run(main())


def test_stats_and_info_sections() -> None:
    async def main() -> None:
        async with open_store() as store:
            await _put_chain(store, chain(2))
            p = await store.get(NS, chain(2)[0])
            p.release()
            assert await store.get(NS, b"none") is None
            stats = store.stats()
            assert stats["dram"]["chunks"] == 2
            assert stats["dram"]["hits"] == 1 and stats["dram"]["misses"] == 1
            for field in ("capacity", "used", "promotions", "demotions", "evictions",
                          "bytes_in", "bytes_out", "errors"):  # fmt: skip
                assert field in stats["dram"]
            sections = store.info_sections()
            fields = dict(sections["tiers"])
            assert fields["dram_chunks"] == 2
            assert "rebuild_chunks" in dict(sections["persistence"])

    run(main())


@pytest.mark.parametrize("size", [1, 4096, 65536 + 3])
def test_sizes_roundtrip(size: int) -> None:
    async def main() -> None:
        async with open_store() as store:
            data = bytes(range(256)) * (size // 256) + bytes(size % 256)
            assert await store.put(NS, b"s", b"", data)
            p = await store.get(NS, b"s")
            assert bytes(p.view) == data
            p.release()

    run(main())
