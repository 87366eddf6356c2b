"""The shared tier as untrusted input, with two and three stores over one bucket (moto's
server): objects planted with boto3 (malformed metadata, tampered payloads whose xxh3 checksum
was fixed up, objects replayed under another chunk's name), a chunk replaced by another node
(same and larger size), authenticated objects (``s3-auth-key``) and key rotation, sessions
recorded on one node and prefetched in full on another, and the bound on remote records.

Each scenario builds KVStores over a real DRAM tier and an S3Tier on moto; waits are bounded
polls of a condition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.base import ChunkMissing
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier
from kvstrata.tiers.s3 import S3Config, object_name
from tests.fakes import chain, make_dram, open_store, s3_tier

if TYPE_CHECKING:
    from pathlib import Path

    from tests.s3fixture import MotoServer

pytest_plugins = ["tests.s3fixture"]

NS = "trust@bf16@c4"
SIZE = 4096
KEY = "k" * 32


def run(coro: Awaitable[Any]) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, 90)

    return asyncio.run(guarded())


def blob(i: int, size: int = SIZE) -> bytes:
    return bytes([(i * 7 + 1) % 251]) * size


def node(server: MotoServer, bucket: str, auth: str = "", **cfg: Any) -> open_store:
    tier = s3_tier(server, bucket, **({"auth_key": auth.encode()} if auth else {}))
    return open_store([make_dram(), tier], **cfg)


async def put_chain(store: Any, hashes: list[bytes], size: int = SIZE, salt: int = 0) -> None:
    parent = b""
    for i, h in enumerate(hashes):
        assert await store.put(NS, h, parent, blob(i + salt, size), tokens=4)
        parent = h


async def read(store: Any, h: bytes) -> bytes | None:
    payload = await store.get(NS, h)
    if payload is None:
        return None
    try:
        return bytes(payload.view)
    finally:
        if payload.release:
            payload.release()


async def poll(check: Callable[[], bool | Awaitable[bool]], limit: float = 20.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = check()
        if not isinstance(got, bool):
            got = await got
        if got:
            return True
        await asyncio.sleep(0.05)
    return False


def names(server: MotoServer, bucket: str) -> set[str]:
    listed = server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"] for o in listed}


def tier_row(store: Any) -> dict[str, Any]:
    return dict(store.stats()["s3"])


def plant(server: MotoServer, bucket: str, h: bytes, body: bytes, **md: str) -> str:
    """An object under chunk ``h``'s name, metadata as a kvstrata writer of format 1 would
    write it unless ``md`` overrides fields."""
    meta = {"kvs-version": "1", "kvs-parent": "", "kvs-tokens": "4", "kvs-codec": "raw",
            "kvs-checksum": checksum(body).hex(), "kvs-size": str(len(body))}  # fmt: skip
    meta.update(md)
    name = object_name("kvstrata", ChunkKey(NS, h))
    server.client().put_object(Bucket=bucket, Key=name, Body=body, Metadata=meta)
    return name


# -- validation ----------------------------------------------------------------------------------


def test_malformed_metadata_is_a_counted_miss_left_in_the_bucket(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: objects planted with boto3 whose payload checksum is right but whose metadata
    a KV.PUT could never carry (empty codec, a parent equal to the hash, negative or too many
    tokens, a 65-byte parent, numbers written as no kvstrata writer writes them (``1_0``,
    ``+4``, 400 digits), no kvstrata metadata at all). Nodes B and C see misses, count
    them in INFO (s3_invalid_objects), and every object stays in the bucket."""
    bad = {
        b"codec-empty": {"kvs-codec": ""},
        b"own-parent": {"kvs-parent": b"own-parent".hex()},
        b"tokens-neg": {"kvs-tokens": "-1"},
        b"tokens-big": {"kvs-tokens": str(2**31)},
        b"long-parent": {"kvs-parent": "ab" * 65},
        b"tokens-underscore": {"kvs-tokens": "1_0"},
        b"tokens-plus": {"kvs-tokens": "+4"},
        b"tokens-huge": {"kvs-tokens": "9" * 400},
        b"size-underscore": {"kvs-size": f"{SIZE // 1000}_{SIZE % 1000:03d}"},
    }

    async def main() -> None:
        planted = {plant(moto_server, s3_bucket, h, blob(1), **md) for h, md in bad.items()}
        name = object_name("kvstrata", ChunkKey(NS, b"bare"))
        moto_server.client().put_object(Bucket=s3_bucket, Key=name, Body=blob(2))
        planted.add(name)
        async with node(moto_server, s3_bucket) as b, node(moto_server, s3_bucket) as c:
            for store in (b, c):
                for h in [*bad, b"bare"]:
                    assert await store.match_all(NS, [h]) == []
                    assert await read(store, h) is None
                assert tier_row(store)["invalid_objects"] == 2 * (len(bad) + 1)
                assert len(store.index) == 0
        assert names(moto_server, s3_bucket) == planted

    run(main())


def test_parent_links_that_loop_are_refused(moto_server: MotoServer, s3_bucket: str) -> None:
    """Scenario: two planted objects name each other as parent (x → y → x). A node adopts
    the first; the second would close a loop (never a leaf, never evicted), so it is refused
    as KV.PUT would refuse it, and counted."""

    async def main() -> None:
        plant(moto_server, s3_bucket, b"x", blob(1), **{"kvs-parent": b"y".hex()})
        plant(moto_server, s3_bucket, b"y", blob(2), **{"kvs-parent": b"x".hex()})
        async with node(moto_server, s3_bucket) as b:
            assert len(await b.match_all(NS, [b"x"])) == 1
            assert await b.match_all(NS, [b"y"]) == []
            assert b.remote.invalid == 1
            assert dict(b.info_sections()["tiers"])["remote_invalid"] == 1

    run(main())


def test_eviction_round_drops_a_victim_no_lower_tier_can_hold(tmp_path: Path) -> None:
    """Scenario: a DRAM record carries metadata the NVMe header cannot hold (an empty codec, as
    an unvalidated S3 object once brought in). Eviction rounds meet it as a victim: the
    write-back is refused, counted, the victim dropped, and every later PUT still succeeds."""

    async def main() -> None:
        nvme = NvmeTier(NvmeConfig(str(tmp_path / "nvme"), capacity=1 << 20, io_threads=1))
        async with open_store([make_dram(64 << 10), nvme]) as store:
            assert await store.put(NS, b"bad", b"", blob(0))
            store.index.get(ChunkKey(NS, b"bad")).codec = ""
            for i in range(40):
                assert await store.put(NS, b"p%d" % i, b"", blob(i))
            assert store.info(NS, b"bad") is None
            assert store.stats()["nvme"]["errors"] >= 1

    run(main())


# -- replacement by another node -----------------------------------------------------------------


@pytest.mark.parametrize("new_size", [SIZE, 2 * SIZE])
def test_chunk_replaced_by_another_node_is_adopted_not_deleted(
    moto_server: MotoServer, s3_bucket: str, new_size: int
) -> None:
    """Scenario: nodes B and C index chunk K from S3 (A wrote it). A then stores K again with
    other bytes (same size, or twice the size). B's and C's next GET compare the object with
    its own metadata, adopt the new version and serve it; nothing is deleted and no integrity
    error is counted."""

    async def main() -> None:
        k = b"chunk-k"
        wt = {"s3_write_policy": "write-through"}
        async with (
            node(moto_server, s3_bucket, **wt) as a,
            node(moto_server, s3_bucket) as b,
            node(moto_server, s3_bucket) as c,
        ):
            assert await a.put(NS, k, b"", blob(1))
            for store in (b, c):
                assert len(await store.match_all(NS, [k])) == 1
            new = blob(9, new_size)
            assert await a.put(NS, k, b"", new)
            name = object_name("kvstrata", ChunkKey(NS, k))
            client = moto_server.client()

            def replaced() -> bool:
                try:
                    md = client.head_object(Bucket=s3_bucket, Key=name)["Metadata"]
                except Exception:
                    return False
                return md["kvs-checksum"] == checksum(new).hex()

            assert await poll(replaced)
            for store in (b, c):
                assert await read(store, k) == new
                assert store.info(NS, k)["size"] == new_size
                row = tier_row(store)
                assert row["integrity_errors"] == 0 and row["kept_objects"] == 0
                assert store.remote.replaced_count == 1
            assert replaced()

    run(main())


def test_corrupt_object_is_deleted_only_in_the_version_read(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: an object's bytes disagree with its own metadata (checksum). The reading tier
    deletes it conditionally on the ETag it read; when the object was replaced in between (the
    ETag no longer matches, as S3 answers 412) the new object stays."""

    async def main() -> None:
        tier = s3_tier(moto_server, s3_bucket)
        try:
            plant(moto_server, s3_bucket, b"c1", blob(1), **{"kvs-checksum": "00" * 16})
            name = plant(moto_server, s3_bucket, b"c2", blob(2), **{"kvs-checksum": "00" * 16})
            head = moto_server.client().head_object(Bucket=s3_bucket, Key=name)
            plant(moto_server, s3_bucket, b"c2", blob(3))  # a good version replaces it
            assert not await tier._call("delete", tier._req.delete_version, name, head["ETag"])
            assert name in names(moto_server, s3_bucket)
            with pytest.raises(Exception, match="checksum"):
                await tier.get(ChunkKey(NS, b"c1"), memoryview(bytearray(SIZE)))
            assert names(moto_server, s3_bucket) == {name}
            assert tier.stats.integrity_errors == 1
        finally:
            await tier.close()

    run(main())


# -- authenticated objects -----------------------------------------------------------------------


def test_authenticated_objects_reject_tampering_and_replays(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: A, B and C share the key. An attacker with write access to the bucket (1)
    changes a payload and fixes up its xxh3 checksum, (2) copies chunk 0's object under chunk
    3's name, (3) plants an untagged object. B and C read A's good chunks, and see each forged
    object as a miss counted in s3_auth_failures; nothing is deleted."""

    async def main() -> None:
        hashes = chain(4)
        wt = {"s3_write_policy": "write-through"}
        async with (
            node(moto_server, s3_bucket, KEY, **wt) as a,
            node(moto_server, s3_bucket, KEY) as b,
            node(moto_server, s3_bucket, KEY) as c,
        ):
            await put_chain(a, hashes)
            client = moto_server.client()
            key1 = object_name("kvstrata", ChunkKey(NS, hashes[1]))
            md = client.head_object(Bucket=s3_bucket, Key=key1)["Metadata"]
            forged = b"\x66" * SIZE
            md = {**md, "kvs-checksum": checksum(forged).hex()}
            client.put_object(Bucket=s3_bucket, Key=key1, Body=forged, Metadata=md)
            key0 = object_name("kvstrata", ChunkKey(NS, hashes[0]))
            key3 = object_name("kvstrata", ChunkKey(NS, hashes[3]))
            src = client.get_object(Bucket=s3_bucket, Key=key0)
            replay = {**src["Metadata"], "kvs-parent": hashes[2].hex()}
            client.put_object(Bucket=s3_bucket, Key=key3, Body=src["Body"].read(), Metadata=replay)
            untagged = plant(moto_server, s3_bucket, b"untagged", blob(5))
            before = names(moto_server, s3_bucket)
            for store in (b, c):
                assert await read(store, hashes[0]) == blob(0)
                assert await read(store, hashes[2]) == blob(2)
                assert await read(store, hashes[1]) is None  # tag over the payload fails
                assert await read(store, hashes[3]) is None  # replayed: tags name chunk 0
                assert await read(store, b"untagged") is None
                row = tier_row(store)
                assert row["auth"] == "on" and row["auth_failures"] >= 3
                assert row["integrity_errors"] == 0
            assert names(moto_server, s3_bucket) == before and untagged in before

    run(main())


def test_changed_or_removed_key_makes_old_objects_misses(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: A writes with key K1. B configured with another key (a rotation) and C with
    none read A's chunks: B sees misses (auth failures) and deletes nothing; C, without a
    key, does not check tags and reads them; A's own chunks stay readable to a node with K1."""

    async def main() -> None:
        hashes = chain(3)
        wt = {"s3_write_policy": "write-through"}
        async with (
            node(moto_server, s3_bucket, KEY, **wt) as a,
            node(moto_server, s3_bucket, "rotated-key-" + "r" * 20) as b,
            node(moto_server, s3_bucket) as c,
            node(moto_server, s3_bucket, KEY) as d,
        ):
            await put_chain(a, hashes)
            assert await b.match_all(NS, hashes) == []
            assert await read(b, hashes[0]) is None
            assert tier_row(b)["auth_failures"] >= 2
            assert await read(c, hashes[2]) == blob(2)
            assert await read(d, hashes[2]) == blob(2)
            assert len(names(moto_server, s3_bucket)) == 3

    run(main())


def test_authenticated_multipart_round_trip(moto_server: MotoServer, s3_bucket: str) -> None:
    """A chunk above the multipart threshold is tagged over all its parts' bytes and read
    back (tag checked step by step); one flipped byte in the middle is an auth failure."""

    async def main() -> None:
        size = 6 * 1024 * 1024 + 5
        tier = s3_tier(moto_server, s3_bucket, auth_key=KEY.encode(),
                       multipart_threshold=5 * 1024 * 1024,
                       multipart_chunksize=5 * 1024 * 1024)  # fmt: skip
        try:
            data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
            meta = ChunkMeta(ChunkKey(NS, b"big"), b"", 4, size, checksum(data))
            await tier.put(meta, data)
            out = bytearray(size)
            assert await tier.get(meta.key, memoryview(out)) == meta and bytes(out) == data
            client = moto_server.client()
            name = object_name("kvstrata", meta.key)
            md = client.head_object(Bucket=s3_bucket, Key=name)["Metadata"]
            bad = bytearray(data)
            bad[size // 2] ^= 1
            md["kvs-checksum"] = checksum(bad).hex()
            client.put_object(Bucket=s3_bucket, Key=name, Body=bytes(bad), Metadata=md)
            with pytest.raises(ChunkMissing):
                await tier.get(meta.key, memoryview(out))
            assert tier.info()["auth_failures"] == 1 and tier.stats.integrity_errors == 0
        finally:
            await tier.close()

    run(main())


def test_auth_key_is_not_shown() -> None:
    """The key is in no repr, INFO row or log line of the tier's config."""
    cfg = S3Config(bucket="b", endpoint="http://127.0.0.1:9", auth_key=KEY.encode())
    assert KEY not in repr(cfg)


# -- sessions across nodes -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_session_recorded_on_a_is_prefetched_in_full_on_b(
    moto_server: MotoServer, s3_bucket: str, policy: str
) -> None:
    """Scenario: A stores a 6-chunk conversation and records the session. With write-back
    the session object is written once the chunks reach S3 (here: A's DRAM is emptied).
    B knows neither the session nor any chunk: KV.PREFETCH SESSION on B reads the session
    object, walks the chain's ancestors through S3 and promotes all six into B's DRAM. C,
    which knows only the tail, also gets the whole chain."""

    async def main() -> None:
        hashes = chain(6)
        async with (
            node(moto_server, s3_bucket, s3_write_policy=policy) as a,
            node(moto_server, s3_bucket) as b,
            node(moto_server, s3_bucket) as c,
        ):
            await put_chain(a, hashes)
            a.record_session(NS, b"conv-1", hashes[-1])
            if policy == "write-back":
                await a.drain()
                assert a.hints.shared.written == 0 and a.hints.shared.pending(NS, b"conv-1")
                await a.placement.make_room(0, 1 << 20)  # demote everything to s3
            assert await poll(lambda: a.hints.shared.written == 1)
            request_id, queued = await b.prefetch_session_shared(NS, b"conv-1")
            assert request_id > 0 and queued == 6
            await b.prefetch_idle()
            assert b.match_tiers(NS, hashes) == ["dram"] * 6
            assert await read(b, hashes[0]) == blob(0)
            c.record_session(NS, b"conv-1", hashes[-1])  # c's own record of the tail only
            assert (await c.prefetch_session_shared(NS, b"conv-1"))[1] == 6
            await c.prefetch_idle()
            assert c.match_tiers(NS, hashes) == ["dram"] * 6
            assert await b.prefetch_session_shared(NS, b"unknown") == (0, 0)

    run(main())


def test_planted_session_objects_are_counted_misses(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: session objects planted with boto3: one not JSON, one nested too deep, one
    naming another session, and (for a node with a key) a well-formed but untagged one. Each is
    a miss for KV.PREFETCH SESSION, counted, and stays in the bucket."""
    from kvstrata.tiers.s3_objects import SessionObject, encode_session, session_name

    async def main() -> None:
        client = moto_server.client()
        hour = int(time.time() * 1000) + 3_600_000
        good = encode_session(SessionObject(NS, b"s-ok", b"tail", hour))
        bodies = {b"s-junk": b"not json", b"s-deep": b"[" * 3000 + b"]" * 3000,
                  b"s-other": encode_session(SessionObject(NS, b"elsewhere", b"t", hour)),
                  b"s-ok": good}  # fmt: skip
        for sid, body in bodies.items():
            client.put_object(Bucket=s3_bucket, Key=session_name("kvstrata", NS, sid), Body=body)
        async with node(moto_server, s3_bucket) as b, node(moto_server, s3_bucket, KEY) as c:
            for sid in (b"s-junk", b"s-deep", b"s-other"):
                assert await b.prefetch_session_shared(NS, sid) == (0, 0)
            assert tier_row(b)["invalid_objects"] == 3
            assert (await b.prefetch_session_shared(NS, b"s-ok"))[1] == 1  # the tail, unknown
            assert await c.prefetch_session_shared(NS, b"s-ok") == (0, 0)
            assert tier_row(c)["auth_failures"] == 1
        assert len(names(moto_server, s3_bucket)) == 4

    run(main())


def _session_doc(sid: bytes, tail: bytes) -> dict[str, Any]:
    return {"format": 1, "namespace": NS, "session": sid.hex(), "tail": tail.hex(),
            "expires_ms": int(time.time() * 1000) + 3_600_000}  # fmt: skip


#: (what is wrong, the body's JSON text given a valid document): every field out of range or
#: of the wrong type, missing fields, overlong strings, NaN
BAD_SESSIONS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("expires 400 digits", lambda d: _json(d, expires_ms=10**400)),
    ("expires negative", lambda d: _json(d, expires_ms=-1)),
    ("expires 31 days ahead", lambda d: _json(d, expires_ms=d["expires_ms"] + 31 * 86_400_000)),
    ("expires float", lambda d: _json(d, expires_ms=float(d["expires_ms"]))),
    ("expires NaN", lambda d: _json(d, expires_ms=float("nan"))),
    ("expires Infinity", lambda d: _json(d, expires_ms=float("inf"))),
    ("expires string", lambda d: _json(d, expires_ms=str(d["expires_ms"]))),
    ("expires true", lambda d: _json(d, expires_ms=True)),
    ("expires null", lambda d: _json(d, expires_ms=None)),
    ("format true", lambda d: _json(d, format=True)),
    ("format string", lambda d: _json(d, format="1")),
    ("format float", lambda d: _json(d, format=1.0)),
    ("namespace int", lambda d: _json(d, namespace=5)),
    ("session int", lambda d: _json(d, session=12)),
    ("session not hex", lambda d: _json(d, session="zz")),
    ("tail empty", lambda d: _json(d, tail="")),
    ("tail 65 bytes", lambda d: _json(d, tail="ab" * 65)),
    ("tail list", lambda d: _json(d, tail=[d["tail"]])),
    ("tail overlong", lambda d: _json(d, tail="ab" * 1800)),
    ("body too large", lambda d: _json(d, pad="x" * 5000)),
    *[(f"no {k}", lambda d, k=k: _json({f: v for f, v in d.items() if f != k}))
      for k in ("format", "namespace", "session", "tail", "expires_ms")],
    ("an array", lambda d: "[1, 2, 3]"),
    ("a number", lambda d: "7"),
]  # fmt: skip


def _json(doc: dict[str, Any], **changes: Any) -> str:
    import json

    return json.dumps({**doc, **changes})


def test_planted_session_fields_out_of_range_are_counted_and_the_own_record_kept(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: node B (no s3-auth-key) stores a 6-chunk chain (write-through) and records
    session conv-9 at its tail. Each planted object then replaces B's session object with one
    that names chunk 2 as the tail and is wrong in one field (a 400-digit expires_ms used to
    answer ``-ERR internal error … int too large to convert to float`` after dropping B's own
    record). KV.PREFETCH SESSION answers normally: the object is absent (counted, left in the
    bucket) and B's own record of the tail is kept, so the whole chain (6, not 3) is promoted
    from S3 with its bytes."""
    from kvstrata.tiers.s3_objects import session_name

    async def main() -> None:
        hashes = chain(6)
        name = session_name("kvstrata", NS, b"conv-9")
        client = moto_server.client()
        async with node(moto_server, s3_bucket, s3_write_policy="write-through") as b:
            await put_chain(b, hashes)
            b.record_session(NS, b"conv-9", hashes[-1])
            assert await poll(lambda: b.hints.shared.written == 1)
            doc = _session_doc(b"conv-9", hashes[2])
            for n, (what, body) in enumerate(BAD_SESSIONS, start=1):
                await b.placement.make_room(0, 1 << 20)  # every chunk back to s3 only
                assert b.match_tiers(NS, hashes) == ["s3"] * 6, what
                client.put_object(Bucket=s3_bucket, Key=name, Body=body(doc).encode())
                assert (await b.prefetch_session_shared(NS, b"conv-9"))[1] == 6, what
                await b.prefetch_idle()
                assert tier_row(b)["invalid_objects"] == n, what
                entry = b.hints.sessions.get(NS, b"conv-9")
                assert entry is not None and entry.tail == hashes[-1], what
                assert b.match_tiers(NS, hashes) == ["dram"] * 6, what
            assert [await read(b, h) for h in hashes] == [blob(i) for i in range(6)]
            got = client.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
            assert got == BAD_SESSIONS[-1][1](doc).encode()  # left in the bucket
            client.put_object(Bucket=s3_bucket, Key=name, Body=_json(doc).encode())
            await b.placement.make_room(0, 1 << 20)
            assert (await b.prefetch_session_shared(NS, b"conv-9"))[1] == 3  # a valid one wins
            assert tier_row(b)["invalid_objects"] == len(BAD_SESSIONS)

    run(main())


# -- bounded remote records ----------------------------------------------------------------------


def test_remote_records_are_bounded_and_forgotten_without_touching_the_bucket(
    moto_server: MotoServer, s3_bucket: str
) -> None:
    """Scenario: A stores 40 chunks; B (s3-max-remote-records 10) matches them all. B keeps at
    most 10 records of chunks held only in S3, forgets the least recently used without a
    request to the bucket (all 40 objects stay), and finds a forgotten chunk again on demand.
    Chunks in B's DRAM do not count."""

    async def main() -> None:
        hashes = chain(40)
        wt = {"s3_write_policy": "write-through"}
        async with (
            node(moto_server, s3_bucket, **wt) as a,
            node(moto_server, s3_bucket, s3_max_remote_records=10) as b,
        ):
            await put_chain(a, hashes)
            deletes = b.state.remote.stats.deletes
            assert len(await b.match_all(NS, hashes)) == 40
            assert await poll(lambda: len(b.index) <= 10)
            info = dict(b.info_sections()["tiers"])
            assert info["remote_records"] <= 10 and info["remote_records_forgotten"] >= 30
            assert b.state.remote.stats.deletes == deletes
            assert len(names(moto_server, s3_bucket)) == 40
            assert await read(b, hashes[0]) == blob(0)  # found again, promoted into DRAM
            assert b.match_tiers(NS, [hashes[0]]) == ["dram"]
            assert b.remote.records.limit == 10 and len(b.remote.records) <= 10

    run(main())
