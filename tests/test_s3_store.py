"""The store over a real S3 endpoint (moto's server mode): start-up without scanning the bucket,
two stores sharing one bucket, write-back of evictions, integrity, and outages.

Each scenario builds KVStores over a small real DRAM tier (plus a FakeTier as nvme where the
cascade matters) and an S3Tier on moto. Waits are bounded polls; nothing asserts timing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.tiers.base import TierIOError
from kvstrata.tiers.s3 import S3Config, S3Tier, object_name
from tests.fakes import FakeTier, chain, make_dram, open_store, s3_tier

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]

NS = "llama@bf16@c4"
SIZE = 4096


def run(coro: Awaitable[Any]) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(guarded())


def blob(i: int, size: int = SIZE) -> bytes:
    return bytes([(i * 7 + 1) % 251]) * size


async def put_chain(store: Any, hashes: list[bytes], size: int = SIZE) -> None:
    parent = b""
    for i, h in enumerate(hashes):
        assert await store.put(NS, h, parent, blob(i, size), tokens=4)
        parent = h


async def poll(check: Callable[[], Awaitable[bool]], limit: float = 15.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return False


def test_start_does_not_scan_s3_and_survives_a_failing_scan(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: the bucket already holds chunks of another node and the local nvme tier's
    scan fails. Start-up indexes nothing from S3 (found on demand later), counts the failed
    scan and serves; a store whose S3 endpoint is down also starts."""

    class BrokenScan(FakeTier):
        async def scan(self) -> Any:
            raise TierIOError("disk on fire")
            yield  # pragma: no cover

    async def main() -> None:
        async with open_store([make_dram(), s3_tier(moto_server, s3_bucket)],
                              s3_write_policy="write-through") as other:  # fmt: skip
            await put_chain(other, chain(3))
        s3 = s3_tier(moto_server, s3_bucket)
        async with open_store([make_dram(), BrokenScan("nvme"), s3]) as store:
            assert len(store.index) == 0 and s3.stats.extra["negative_hits"] == 0
            assert store.rebuild["errors"] == 1 and store.rebuild["chunks"] == 0
            assert (await store.match_all(NS, chain(3)))[-1].tiers == {"s3"}
        down = S3Tier(S3Config(bucket=s3_bucket, endpoint="http://127.0.0.1:9", retries=0))
        async with open_store([make_dram(), down]) as store:
            assert await store.put(NS, b"x", b"", b"local only")
            assert store.match(NS, [b"x"]) == 1

    run(main())


def test_two_stores_share_one_bucket(moto_server: MotoServer, s3_bucket: str) -> None:
    """Scenario: node A stores a 6-chunk chain with s3 write-through; node B, with its own
    DRAM, matches the whole chain (A's chunks get index records from the object metadata),
    leases it (promoted into B's DRAM, bytes verified) and reads it with GET/MGET."""

    async def main() -> None:
        hashes = chain(6)
        async with (
            open_store([make_dram(), s3_tier(moto_server, s3_bucket)],
                       s3_write_policy="write-through") as a,
            open_store([make_dram(), s3_tier(moto_server, s3_bucket)]) as b,
        ):  # fmt: skip
            await put_chain(a, hashes)
            assert b.match(NS, hashes) == 0  # index only
            found = await b.match_all(NS, [*hashes, b"absent"])
            assert len(found) == 6 and b.tiers_of(found) == ["s3"] * 6
            info = b.info(NS, hashes[2])
            assert info["parent"] == hashes[1].hex() and info["tokens"] == 4
            assert info["size"] == SIZE and info["tiers"] == ["s3"]
            lease = await b.lease(NS, hashes)
            assert lease is not None and len(lease.handles) == 6
            view = b.state.dram.view(ChunkKey(NS, hashes[5]))
            assert bytes(view) == blob(5)
            b.release(lease.id)
            assert b.match_tiers(NS, hashes) == ["dram"] * 6
            more = chain(2, b"g")
            await put_chain(a, more)
            payloads = await b.mget(NS, more)
            assert [bytes(p.view) for p in payloads] == [blob(0), blob(1)]
            for p in payloads:
                if p.release:
                    p.release()
            assert b.remote.found == 8

    run(main())


def test_eviction_from_lowest_local_tier_writes_back_to_s3(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: DRAM (64 KiB) and nvme (128 KiB) are too small for 64 chunks of 4 KiB; with
    write-back, chunks leaving nvme are uploaded, so every chunk is still found (in s3) and
    a GET of an evicted one reads it from s3 and promotes it into DRAM."""

    async def main() -> None:
        hashes = chain(64)
        s3 = s3_tier(moto_server, s3_bucket)
        nvme = FakeTier("nvme", capacity=128 << 10)
        async with open_store([make_dram(64 << 10), nvme, s3]) as store:
            await put_chain(store, hashes)

            async def drained() -> bool:
                # The background demoter moves chunks at the same time: a victim it holds is
                # skipped and make_room may stop short, so repeat until the oldest chunk left.
                await store.placement.make_room(0, 64 << 10)
                await store.placement.make_room(1, 128 << 10)
                return store.match_tiers(NS, hashes)[:1] == ["s3"]

            assert await poll(drained)
            tiers = store.match_tiers(NS, hashes)
            assert len(tiers) == 64 and tiers[0] == "s3"
            assert store.stats()["s3"]["bytes_in"] >= 32 * SIZE
            promoted = store.stats()["dram"]["promotions"]
            payload = await store.get(NS, hashes[0])
            assert payload is not None and bytes(payload.view) == blob(0)
            if payload.release:
                payload.release()
            assert store.stats()["dram"]["promotions"] == promoted + 1
            assert "dram" in store.info(NS, hashes[0])["tiers"]

    run(main())


def test_checksum_mismatch_in_s3_is_a_miss(moto_server: MotoServer, s3_bucket: str) -> None:
    """Scenario: an object's bytes are replaced behind kvstrata's back (metadata kept). Node
    B's HEAD still finds it, but the read fails its checksum: a miss, never wrong KV; the
    object is removed and the error counted."""

    async def main() -> None:
        hashes = chain(3)
        async with (
            open_store([make_dram(), s3_tier(moto_server, s3_bucket)],
                       s3_write_policy="write-through") as a,
            open_store([make_dram(), s3_tier(moto_server, s3_bucket)]) as b,
        ):  # fmt: skip
            await put_chain(a, hashes)
            client = moto_server.client()
            name = object_name("kvstrata", ChunkKey(NS, hashes[1]))
            head = client.head_object(Bucket=s3_bucket, Key=name)
            client.put_object(
                Bucket=s3_bucket, Key=name, Body=b"\x00" * SIZE, Metadata=head["Metadata"]
            )
            assert len(await b.match_all(NS, hashes)) == 3
            assert await b.get(NS, hashes[1]) is None
            assert b.stats()["s3"]["integrity_errors"] == 1
            assert b.info(NS, hashes[1]) is None
            assert len(await b.match_all(NS, hashes)) == 1

    run(main())


def test_s3_stopped_and_restarted(private_moto_server: MotoServer) -> None:
    """Scenario: S3 goes down mid-run. Matches answer from local tiers, reads of chunks held
    only in s3 are misses, PUTs still succeed locally, errors are counted, nothing raises.
    S3 comes back (empty, moto keeps no state): after a put the other node hits again."""

    async def main() -> None:
        srv = private_moto_server
        bucket = srv.make_bucket()
        hashes = chain(4)
        async with (
            open_store([make_dram(), s3_tier(srv, bucket)],
                       s3_write_policy="write-through") as a,
            open_store([make_dram(), s3_tier(srv, bucket)]) as b,
        ):  # fmt: skip
            await put_chain(a, hashes)
            assert len(await b.match_all(NS, hashes[:2])) == 2
            srv.stop()
            assert len(await b.match_all(NS, hashes)) == 2  # known records, no I/O needed
            assert await b.get(NS, hashes[0]) is None  # only in s3: a miss
            assert await b.put(NS, b"new", b"", b"written while s3 is down")
            assert await a.put(NS, b"new", b"", b"written while s3 is down")
            assert b.stats()["s3"]["errors"] >= 1 and a.stats()["s3"]["errors"] >= 1
            assert a.match(NS, hashes) == 4  # a keeps serving from DRAM
            srv.restart()
            srv.make_bucket(bucket)

            async def back() -> bool:
                await a.put(NS, b"late", b"", b"after the outage")
                return b.remote.enabled and await b.get(NS, b"late") is not None

            assert await poll(back)
            payload = await b.get(NS, b"late")
            assert payload is not None and bytes(payload.view) == b"after the outage"
            if payload.release:
                payload.release()

    run(main())


def test_s3_frozen_then_thawed(private_moto_server: MotoServer) -> None:
    """Scenario: S3 hangs (SIGSTOP: connections accepted, never answered). A match of a chain
    this node does not know returns within the lookup timeout with 0 (a miss) and counts a
    timeout; once S3 answers again the same match finds the chain."""

    async def main() -> None:
        srv = private_moto_server
        bucket = srv.make_bucket()
        hashes = chain(3)
        async with (
            open_store([make_dram(), s3_tier(srv, bucket, timeout=0.5)],
                       s3_write_policy="write-through") as a,
            open_store([make_dram(), s3_tier(srv, bucket, timeout=0.5)]) as b,
        ):  # fmt: skip
            await put_chain(a, hashes)
            b.remote.timeout = 0.5
            srv.freeze()
            try:
                assert await b.match_all(NS, hashes) == []
                assert b.remote.timeouts + b.remote.errors >= 1
            finally:
                srv.thaw()

            async def found() -> bool:
                return len(await b.match_all(NS, hashes)) == 3

            assert await poll(found)

    run(main())


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_write_policy_reaches_s3(moto_server: MotoServer, s3_bucket: str, policy: str) -> None:
    """write-through uploads at PUT time; write-back leaves s3 alone until an eviction."""

    async def main() -> None:
        s3 = s3_tier(moto_server, s3_bucket)
        async with open_store([make_dram(), s3], s3_write_policy=policy) as store:
            await store.put(NS, b"k", b"", b"payload")
            assert (await s3.meta(ChunkKey(NS, b"k")) is not None) == (policy == "write-through")

    run(main())
