"""KV.* handlers called directly through a fake connection context over a real store."""

from __future__ import annotations

import asyncio
import inspect
import struct
from typing import Any

import pytest

from kvstrata.protocol.errors import RespError
from kvstrata.protocol.frames import OK, BulkView
from tests.fakectx import FakeCtx, FakeServer
from tests.fakes import FakeTier, make_dram, open_store

NS = b"llama@bf16@c4"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def call(ctx: FakeCtx, *words: Any) -> Any:
    reply = ctx.call(*words)
    if inspect.isawaitable(reply):
        reply = await reply
    return reply


async def error(ctx: FakeCtx, *words: Any) -> str:
    try:
        reply = await call(ctx, *words)
    except RespError as exc:
        return exc.reply_line().decode()
    raise AssertionError(f"{words!r} did not fail: {reply!r}")


class with_ctx:  # an async context manager, named like a function
    def __init__(self, tiers: Any = None, **cfg: Any) -> None:
        self.opened = open_store(tiers, **cfg)

    async def __aenter__(self) -> FakeCtx:
        store = await self.opened.__aenter__()
        server = FakeServer()
        server.store = store
        server.keyspace = store.keyspace
        return server.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.opened.__aexit__(*exc)


def body(reply: Any) -> bytes:
    assert isinstance(reply, BulkView)
    data = bytes(reply.view)
    if reply.release:
        reply.release()
    return data


def test_put_get_mget_match_info_del() -> None:
    async def main() -> None:
        async with with_ctx() as ctx:
            assert await call(ctx, "KV.PUT", NS, b"h1", b"", b"one", "TOKENS", "4") == 1
            assert await call(ctx, "kv.put", NS, b"h2", b"h1", b"two", "nx") == 1
            assert await call(ctx, "KV.PUT", NS, b"h2", b"h1", b"TWO", "NX") == 0
            assert body(await call(ctx, "KV.GET", NS, b"h2")) == b"two"
            assert await call(ctx, "KV.GET", NS, b"h3") is None
            replies = await call(ctx, "KV.MGET", NS, b"h1", b"h3", b"h2")
            assert replies[1] is None and [body(replies[0]), body(replies[2])] == [b"one", b"two"]
            assert await call(ctx, "KV.MATCH", NS, b"h1", b"h2", b"h3") == 2
            assert await call(ctx, "KV.MATCH", NS, b"h1", b"h2", "withtiers") == [
                2,
                ["dram", "dram"],
            ]
            assert await call(ctx, "KV.MATCH", NS, b"h1", "PREFETCH", "WITHTIERS") == [1, ["dram"]]
            info = await call(ctx, "KV.INFO", NS, b"h1")
            assert info["tokens"] == 4 and info["children"] == 1
            assert await call(ctx, "KV.INFO", NS, b"zz") is None
            assert await call(ctx, "KV.DEL", NS, b"h1", "CASCADE") == 2
            assert await call(ctx, "KV.MATCH", NS, b"h1") == 0
            stats = await call(ctx, "KV.STATS")
            assert stats["dram"]["hits"] >= 2
            regions = await call(ctx, "KV.REGIONS")
            assert regions[0]["kind"] == "shm" and regions[0]["size"] > 0

    run(main())


def test_put_through_sink_factory() -> None:
    async def main() -> None:
        async with with_ctx() as ctx:
            spec = ctx.server.registry.lookup(b"kv.put")
            assert spec is not None and spec.sink is not None
            sink = spec.sink(ctx, [b"KV.PUT", NS, b"big", b""], 100_000)
            assert sink is not None
            assert spec.sink(ctx, [b"KV.PUT", b"bad ns", b"x", b""], 10) is None
            assert spec.sink(ctx, [b"KV.PUT", NS, b"", b""], 10) is None
            assert spec.sink(ctx, [b"KV.PUT", NS], 10) is None
            sink.view[:] = b"s" * 100_000
            ctx.sinks[4] = sink
            assert await call(ctx, "KV.PUT", NS, b"big", b"", sink.view, "TTL", "60000") == 1
            ctx.sinks.clear()
            assert body(await call(ctx, "KV.GET", NS, b"big")) == b"s" * 100_000
            assert 0 < (await call(ctx, "KV.INFO", NS, b"big"))["ttl"] <= 60000

    run(main())


def test_lease_reserve_commit_abort_release() -> None:
    async def main() -> None:
        async with with_ctx() as ctx:
            store = ctx.server.store
            await call(ctx, "KV.PUT", NS, b"a", b"", b"A" * 100)
            lease_id, handles = await call(ctx, "KV.LEASE", NS, b"a", b"b", "TTL", "5000")
            assert isinstance(lease_id, str) and len(handles) == 1
            region, offset, length, instance = handles[0]
            assert region == "dram0" and length == 100
            assert instance == store.state.dram.instance and len(instance) == 16
            assert bytes(store.state.dram._buf[offset : offset + length]) == b"A" * 100
            assert (await error(ctx, "KV.COMMIT", lease_id)).startswith("NOLEASE")
            assert await call(ctx, "KV.RELEASE", lease_id) == OK
            assert (await error(ctx, "KV.RELEASE", lease_id)).startswith("NOLEASE")
            assert await call(ctx, "KV.LEASE", NS, b"zz") == [None, []]
            wid, (region, offset, length, _) = await call(
                ctx, "KV.RESERVE", NS, b"b", b"a", "50", "TOKENS", "2"
            )
            store.state.dram._buf[offset : offset + length] = b"B" * 50
            assert await call(ctx, "KV.COMMIT", wid) == OK
            assert body(await call(ctx, "KV.GET", NS, b"b")) == b"B" * 50
            assert await call(ctx, "KV.MATCH", NS, b"a", b"b") == 2
            wid2, _ = await call(ctx, "KV.RESERVE", NS, b"c", b"b", "10")
            assert await call(ctx, "KV.ABORT", wid2) == OK
            assert await call(ctx, "KV.MATCH", NS, b"a", b"b", b"c") == 2
            assert (await error(ctx, "KV.ABORT", "nope")).startswith("NOLEASE")

    run(main())


def test_matchtokens() -> None:
    pytest.importorskip("kvstrata.store.hashing")
    from kvstrata.store.hashing import chunk_hashes

    async def main() -> None:
        async with with_ctx() as ctx:
            tokens = list(range(40))
            packed = struct.pack("<40I", *tokens)
            hashes = chunk_hashes(packed, NS.decode(), 16)
            assert len(hashes) == 2
            await call(ctx, "KV.PUT", NS, hashes[0], b"", b"x")
            reply = await call(ctx, "KV.MATCHTOKENS", NS, packed, "CHUNK", "16")
            assert reply == [16, 1, hashes]
            with_extra = await call(ctx, "KV.MATCHTOKENS", NS, packed, "CHUNK", "16", "EXTRA", "l")
            assert with_extra[1] == 0 and with_extra[2] == chunk_hashes(
                packed, NS.decode(), 16, [b"l"]
            )
            assert (await error(ctx, "KV.MATCHTOKENS", NS, b"abc")).startswith("ERR invalid tokens")

    run(main())


def test_bad_arguments_change_nothing() -> None:
    """Scenario: a series of malformed KV.* commands (bad hash lengths, bad namespace, non-
    integer and unknown options, zero or oversized reservations, unknown leases) each gets an
    error reply, and the store's index, keyspace, DRAM usage, writers and leases are exactly
    as before."""

    async def main() -> None:
        async with with_ctx([make_dram(), FakeTier("nvme")]) as ctx:
            store = ctx.server.store
            await call(ctx, "KV.PUT", NS, b"a", b"", b"A" * 100)

            def snapshot() -> tuple:
                s = store.state
                return (len(s.index), len(store.keyspace), s.dram.used, dict(s.writers),
                        len(s.leases), store.match(NS.decode(), [b"a"]))  # fmt: skip

            before = snapshot()
            bad = [
                ("KV.PUT", NS, b"x" * 65, b"", b"p"),
                ("KV.PUT", NS, b"", b"", b"p"),
                ("KV.PUT", b"bad ns", b"x", b"", b"p"),
                ("KV.PUT", NS, b"x", b"y" * 70, b"p"),
                ("KV.PUT", NS, b"x", b"", b"p", "TOKENS", "abc"),
                ("KV.PUT", NS, b"x", b"", b"p", "TTL", "0"),
                ("KV.PUT", NS, b"x", b"", b"p", "TTL"),
                ("KV.PUT", NS, b"x", b"", b"p", "BOGUS"),
                ("KV.PUT", NS, b"x", b"", b""),
                ("KV.GET", NS, b""),
                ("KV.MATCH", NS, b"a", b"z" * 65),
                ("KV.LEASE", NS, b"a", "TTL", "x"),
                ("KV.RESERVE", NS, b"x", b"", "0"),
                ("KV.RESERVE", NS, b"x", b"", str(10**12)),
                ("KV.RESERVE", NS, b"x", b"", "ten"),
                ("KV.RESERVE", NS, b"x", b"", "10", "TTL", "-5"),
                ("KV.COMMIT", "0123456789abcdef"),
                ("KV.RELEASE", b"\xff\xfe"),
                ("KV.DEL", NS, b"a", "CASCADES"),
                ("KV.MATCHTOKENS", NS, b"12345678", "CHUNK", "0"),
            ]
            for words in bad:
                line = await error(ctx, *words)
                assert line.split()[0] in ("ERR", "NOLEASE"), (words, line)
                assert snapshot() == before, words
            assert "must be 1 to 64 bytes" in await error(ctx, "KV.GET", NS, b"")
            assert "invalid namespace" in await error(ctx, "KV.INFO", b"a b", b"x")
            assert "unknown option 'BOGUS'" in await error(
                ctx, "KV.PUT", NS, b"x", b"", b"p", "bogus"
            )

    run(main())


def test_dram_hits_and_arena_puts_answer_without_a_task() -> None:
    """Scenario: KV.GET of a DRAM chunk, a plain miss, and a KV.PUT whose payload already sits
    in its arena slot are answered by the handler itself (no coroutine, so no task per
    command); a PUT whose payload is not in a slot yet still goes through the async path."""

    async def scenario() -> None:
        async with with_ctx() as ctx:
            spec = ctx.server.registry.lookup(b"KV.PUT")
            sink = spec.sink(ctx, [b"KV.PUT", NS, b"fast", b""], 100_000)
            assert sink is not None
            sink.view[:] = b"f" * 100_000
            ctx.sinks[4] = sink
            put = ctx.call("KV.PUT", NS, b"fast", b"", sink.view)
            assert put == 1  # an int, not a coroutine
            ctx.sinks = {}
            got = ctx.call("KV.GET", NS, b"fast")
            assert not inspect.isawaitable(got) and body(got) == b"f" * 100_000
            miss = ctx.call("KV.GET", NS, b"nope")
            assert miss is None
            small = ctx.call("KV.PUT", NS, b"small", b"", b"x")  # no sink: async path
            assert inspect.isawaitable(small) and await small == 1

    run(scenario())
