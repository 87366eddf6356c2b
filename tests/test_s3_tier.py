"""S3 tier specifics on a real moto server: object layout and metadata, multipart uploads,
integrity checks, the negative cache, prefix matching, scans, config, and outages.

The generic contract (round trips, missing, delete, replace, batch forms, stats) runs in
``tests/test_s3_contract.py``. Hang guards use ``asyncio.wait_for``; nothing asserts timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.config import load_config
from kvstrata.tiers.base import (
    ChunkMissing,
    IntegrityError,
    TierIOError,
    TierUnavailable,
    build_tier,
)
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.s3 import (
    NegativeCache,
    S3Config,
    S3Tier,
    decode_metadata,
    encode_metadata,
    object_name,
    parse_object_name,
)
from kvstrata.tiers.s3_objects import InvalidObject
from tests.conftest import free_port

if TYPE_CHECKING:
    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]

MiB = 1024 * 1024
NS = "llama-3.1-8b@bf16@tp1r0@c256"
GUARD = 60.0  # seconds before a hung call fails the test (pytest-timeout is not installed)
T = TypeVar("T")


def chunk(i: int, size: int, ns: str = NS, parent: bytes = b"") -> tuple[ChunkMeta, bytes]:
    data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = ChunkKey(ns, i.to_bytes(4, "big") * 8)
    return ChunkMeta(key, parent, tokens=256, size=size, checksum=checksum(data)), data


def make_tier(server: MotoServer, bucket: str, **kw: Any) -> S3Tier:
    settings: dict[str, Any] = {"max_connections": 4, "timeout": 5.0, "retries": 1}
    settings.update(kw)
    return S3Tier(S3Config(bucket=bucket, endpoint=server.endpoint, **settings))


def run(tier: S3Tier, body: Callable[[S3Tier], Awaitable[T]]) -> T:
    async def main() -> T:
        try:
            return await asyncio.wait_for(body(tier), GUARD)
        finally:
            await tier.close()

    return asyncio.run(main())


# -- names and metadata (no server) ----------------------------------------------------------

_NS_CHARS = st.sampled_from(list("abcXYZ019_.:@/+=,#%~^-"))


@given(ns=st.text(_NS_CHARS, min_size=1, max_size=40), digest=st.binary(min_size=1, max_size=64))
def test_object_names_round_trip(ns: str, digest: bytes) -> None:
    key = ChunkKey(ns, digest)
    for prefix in ("kvstrata", "a/b", ""):
        name = object_name(prefix, key)
        parts = name.split("/")
        assert parts[-1] == digest.hex() and parts[-2] == digest.hex()[:2]
        assert ".." not in parts and "." not in parts and "" not in parts
        assert parse_object_name(prefix, name) == key


def test_foreign_names_are_not_chunks() -> None:
    for name in (
        "kvstrata/ns/ac/abcd",
        "kvstrata/ns/AB/ABCD",
        "kvstrata/n s/ab/ab",
        "other/ns/ab/ab12",
        "kvstrata/x",
    ):
        assert parse_object_name("kvstrata", name) is None
    assert object_name("kvstrata/", ChunkKey("a/b", b"\xab")) == "kvstrata/a%2Fb/ab/ab"


def test_metadata_round_trip_and_versions() -> None:
    meta, _ = chunk(1, 10, parent=b"\x07" * 32)
    meta = ChunkMeta(meta.key, meta.parent, 3, 10, meta.checksum, codec="kivi int4/%x")
    md = encode_metadata(meta)
    assert all(v.isascii() for v in md.values())
    assert decode_metadata(meta.key, md, 10) == meta
    assert decode_metadata(meta.key, {**md, "kvs-version": "99"}, 10) is None
    # a codec no tier header can hold (not ASCII) is refused like a client write would be
    with pytest.raises(InvalidObject, match="codec"):
        decode_metadata(meta.key, {**md, "kvs-codec": "kivi%C3%A9"}, 10)


def test_config_from_kvstrata_config(moto_server: MotoServer) -> None:
    bucket = moto_server.make_bucket()
    flags = {"s3-bucket": bucket, "s3-endpoint": moto_server.endpoint, "s3-max-connections": "8"}
    cfg = S3Config.from_config(load_config(flags=flags, env={}), retries=0)
    assert (cfg.bucket, cfg.endpoint, cfg.max_connections, cfg.retries) == (
        bucket, moto_server.endpoint, 8, 0)  # fmt: skip
    assert (cfg.prefix, cfg.write_policy, cfg.timeout) == ("kvstrata", "write-back", 10.0)
    tier = build_tier("s3", cfg)
    assert isinstance(tier, S3Tier) and tier.capacity == 0
    asyncio.run(tier.close())
    with pytest.raises(TierUnavailable):
        S3Config(bucket="")


def test_negative_cache_ignores_misses_that_raced_a_write() -> None:
    """A HEAD that started before our put finished must not cache a miss for that key."""
    cache = NegativeCache(ttl=60.0)
    a, b = ChunkKey("ns", b"a"), ChunkKey("ns", b"b")
    since = cache.seq()
    cache.wrote(a)
    cache.miss(a, since)
    cache.miss(b, since)
    assert not cache.hit(a) and cache.hit(b)
    cache.wrote(b)
    assert not cache.hit(b)
    assert not NegativeCache(ttl=0).hit(a)
    small = NegativeCache(ttl=60.0, limit=2)
    since = small.seq()
    for k in (b"x", b"y", b"z"):
        small.wrote(ChunkKey("ns", k))
    small.miss(a, since)  # the write history was trimmed: cannot prove no racing write
    assert not small.hit(a)


# -- against moto ------------------------------------------------------------------------


def test_object_layout_and_metadata(moto_server: MotoServer, s3_bucket: str) -> None:
    """A put lands at prefix/namespace/hh/hex with the documented user metadata."""
    meta, data = chunk(2, 1000, parent=b"\x01" * 32)
    run(make_tier(moto_server, s3_bucket, prefix="team/kv"), lambda t: t.put(meta, data))
    name = f"team/kv/{NS}/{meta.key.hex[:2]}/{meta.key.hex}"
    head = moto_server.client().head_object(Bucket=s3_bucket, Key=name)
    assert head["ContentLength"] == 1000
    assert head["Metadata"] == {
        "kvs-version": "1", "kvs-parent": "01" * 32, "kvs-tokens": "256", "kvs-codec": "raw",
        "kvs-checksum": meta.checksum.hex(), "kvs-size": "1000",
    }  # fmt: skip


def test_multipart_upload_round_trip(moto_server: MotoServer, s3_bucket: str) -> None:
    """Above the threshold a chunk is uploaded in parts and still reads back exactly."""
    meta, data = chunk(3, 8 * MiB + 5)
    tier = make_tier(moto_server, s3_bucket, multipart_threshold=6 * MiB,
                     multipart_chunksize=5 * MiB)  # fmt: skip

    async def body(t: S3Tier) -> bytes:
        await t.put(meta, data)
        out = bytearray(meta.size)
        assert await t.get(meta.key, memoryview(out)) == meta
        assert t.stats.extra["multipart_puts"] == 1
        return bytes(out)

    assert run(tier, body) == data
    head = moto_server.client().head_object(Bucket=s3_bucket, Key=object_name("kvstrata", meta.key))
    assert head["ETag"].strip('"').endswith("-2")  # S3 ETags of multipart objects end in -parts


def test_checksum_mismatch_removes_object(moto_server: MotoServer, s3_bucket: str) -> None:
    """Bytes changed behind our back (metadata kept) read as IntegrityError; the object goes."""
    meta, data = chunk(4, 4096)
    name = object_name("kvstrata", meta.key)
    s3 = moto_server.client()

    async def body(t: S3Tier) -> None:
        await t.put(meta, data)
        bad = bytearray(data)
        bad[100] ^= 0xFF
        md = s3.head_object(Bucket=s3_bucket, Key=name)["Metadata"]
        s3.put_object(Bucket=s3_bucket, Key=name, Body=bytes(bad), Metadata=md)
        with pytest.raises(IntegrityError):
            await t.get(meta.key, memoryview(bytearray(4096)))
        assert t.stats.integrity_errors == 1
        assert not await t.contains(meta.key)
        with pytest.raises(ChunkMissing):
            await t.get(meta.key, memoryview(bytearray(4096)))

    run(make_tier(moto_server, s3_bucket), body)
    assert s3.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0


def test_foreign_objects_under_our_names(moto_server: MotoServer, s3_bucket: str) -> None:
    """No metadata: not a valid kvstrata object, a miss counted as invalid and left in place.
    Another format version: a miss, left in place, not counted."""
    s3 = moto_server.client()
    plain, _ = chunk(5, 10)
    newer, data = chunk(6, 10)
    s3.put_object(Bucket=s3_bucket, Key=object_name("kvstrata", plain.key), Body=b"x" * 10)
    md = {**encode_metadata(newer), "kvs-version": "3"}  # 2: coded objects
    s3.put_object(Bucket=s3_bucket, Key=object_name("kvstrata", newer.key), Body=data, Metadata=md)

    async def body(t: S3Tier) -> None:
        with pytest.raises(ChunkMissing):
            await t.get(plain.key, memoryview(bytearray(10)))
        assert not await t.contains(plain.key)
        with pytest.raises(ChunkMissing):
            await t.get(newer.key, memoryview(bytearray(10)))
        assert not await t.contains(newer.key)
        assert not await t.delete(plain.key)  # not ours to judge: left alone
        assert (t.info()["invalid_objects"], t.stats.integrity_errors) == (3, 0)

    run(make_tier(moto_server, s3_bucket, negative_ttl=0), body)
    names = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket).get("Contents", []))
    assert names == sorted(object_name("kvstrata", m.key) for m in (plain, newer))


def test_negative_cache_and_own_puts(moto_server: MotoServer, s3_bucket: str) -> None:
    """A miss is remembered (another node's upload stays unseen for the TTL); our put clears it."""
    meta, data = chunk(7, 100)
    s3 = moto_server.client()

    async def body(t: S3Tier) -> None:
        assert not await t.contains(meta.key)
        s3.put_object(Bucket=s3_bucket, Key=object_name("kvstrata", meta.key), Body=data,
                      Metadata=encode_metadata(meta))  # fmt: skip
        assert not await t.contains(meta.key)
        assert await t.contains_many([meta.key]) == [False]
        assert t.stats.extra["negative_hits"] == 2
        await t.put(meta, data)
        assert await t.contains(meta.key)

    run(make_tier(moto_server, s3_bucket, negative_ttl=3600), body)


def test_match_length_and_contains_many(moto_server: MotoServer, s3_bucket: str) -> None:
    chain = [chunk(100 + i, 64) for i in range(11)]

    async def body(t: S3Tier) -> None:
        assert await t.match_length([m.key for m, _ in chain]) == 0
        await t.put_many(chain[:6])
        await t.put(*chain[8])
        keys = [m.key for m, _ in chain]
        assert await t.match_length(keys) == 6
        assert await t.contains_many(keys) == [True] * 6 + [False, False, True, False, False]
        assert await t.match_length(keys[:6]) == 6

    run(make_tier(moto_server, s3_bucket, max_connections=4, negative_ttl=0), body)


def test_scan_lists_our_chunks_only(moto_server: MotoServer, s3_bucket: str) -> None:
    """scan() rebuilds metadata from the bucket; foreign keys under the prefix are skipped."""
    items = [chunk(200 + i, 10 + i, ns=f"ns{i % 2}/x") for i in range(5)]
    s3 = moto_server.client()
    s3.put_object(Bucket=s3_bucket, Key="kvstrata/README", Body=b"not a chunk")
    s3.put_object(Bucket=s3_bucket, Key="elsewhere/ns/ab/ab", Body=b"not ours")

    async def body(t: S3Tier) -> tuple[list[ChunkMeta], int]:
        await t.put_many(items)
        fresh = make_tier(moto_server, s3_bucket)
        try:
            found = [m async for m in fresh.scan()]
            return found, fresh.used
        finally:
            await fresh.close()

    found, used = run(make_tier(moto_server, s3_bucket), body)
    assert sorted(found, key=lambda m: m.key.hash) == sorted(
        (m for m, _ in items), key=lambda m: m.key.hash
    )
    assert used == sum(m.size for m, _ in items)


# -- outages ------------------------------------------------------------------------------


async def _until_ok(fn: Callable[[], Awaitable[T]], attempts: int = 200) -> T:
    for _ in range(attempts):
        try:
            return await fn()
        except TierIOError:
            await asyncio.sleep(0.05)
    return await fn()


def test_endpoint_down_then_back(private_moto_server: MotoServer) -> None:
    """moto stopped: every call raises TierIOError (no crash, no hang) and is counted;
    restarted on the same port: the same tier object works again without intervention."""
    server = private_moto_server
    bucket = server.make_bucket("outage")
    meta, data = chunk(8, 2048)
    other, other_data = chunk(9, 2048)

    async def body(t: S3Tier) -> None:
        await t.put(meta, data)
        server.stop()
        for call in (
            lambda: t.get(meta.key, memoryview(bytearray(2048))),
            lambda: t.contains(other.key),
            lambda: t.put(other, other_data),
            lambda: t.delete(meta.key),
        ):
            with pytest.raises(TierIOError):
                await call()
        assert t.stats.errors >= 4
        assert t.info()["breaker_trips"] >= 1
        server.start()
        server.make_bucket(bucket)  # moto forgets everything on restart
        await _until_ok(lambda: t.put(other, other_data))
        out = bytearray(2048)
        assert await t.get(other.key, memoryview(out)) == other
        assert out == other_data
        with pytest.raises(ChunkMissing):  # lost with moto's memory: a miss, not an error
            await t.get(meta.key, memoryview(bytearray(2048)))

    run(make_tier(server, bucket, timeout=1.0, retries=1, retry_after=0.2, negative_ttl=0), body)


def test_endpoint_hangs(private_moto_server: MotoServer) -> None:
    """A frozen endpoint (accepts connections, never answers) fails by the read timeout."""
    server = private_moto_server
    bucket = server.make_bucket("frozen")
    meta, data = chunk(10, 512)

    async def body(t: S3Tier) -> None:
        await t.put(meta, data)
        server.freeze()
        try:
            with pytest.raises(TierIOError):
                await t.get(meta.key, memoryview(bytearray(512)))
            with pytest.raises(TierIOError, match="unavailable"):  # breaker: no second wait
                await t.contains(meta.key)
        finally:
            server.thaw()
        assert await _until_ok(lambda: t.contains(meta.key))

    run(make_tier(server, bucket, timeout=0.5, retries=0, retry_after=0.2, negative_ttl=0), body)


def test_missing_bucket_stops_startup_but_an_absent_endpoint_does_not(
    moto_server: MotoServer,
) -> None:
    """A bucket that does not exist is a configuration error (clear message at start); an S3
    endpoint that does not answer is an outage (the tier starts and degrades to misses)."""
    cfg = S3Config(bucket="no-such-bucket", endpoint=moto_server.endpoint, retries=0)
    with pytest.raises(TierUnavailable, match=r"no-such-bucket.*not usable"):
        S3Tier(cfg)
    down = S3Config(bucket="b", endpoint=f"http://127.0.0.1:{free_port()}", retries=0)
    tier = S3Tier(down)
    asyncio.run(tier.close())
