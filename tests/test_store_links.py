"""Parent links that would make a chunk un-evictable are refused: a chunk cannot be its own
parent, and a link may not close a loop (a chunk in a loop always has a resident child)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.chunks import validate_parent
from kvstrata.protocol.errors import CommandError
from tests.fakectx import FakeServer
from tests.fakes import open_store

NS = "links@c4"


def test_own_parent_is_refused() -> None:
    with pytest.raises(CommandError, match="cannot be its own parent"):
        validate_parent(b"h", b"h")
    assert validate_parent(b"p", b"h") == b"p" and validate_parent(b"", b"h") == b""


def test_loops_are_refused_and_change_nothing() -> None:
    """Scenario: b is stored under parent a before a exists (children may come first); then
    KV.PUT of a under parent b would close the loop a→b→a: it is refused, and a stays absent.
    Stored under no parent, a is accepted and the chain matches."""

    async def main() -> Any:
        async with open_store() as store:
            server = FakeServer()
            server.store = store
            server.keyspace = store.keyspace
            ctx = server.connect()
            reply = ctx.call("KV.PUT", NS, b"b", b"a", b"bytes-b")
            assert (await reply if asyncio.iscoroutine(reply) else reply) == 1
            with pytest.raises(CommandError, match="loop"):
                ctx.call("KV.PUT", NS, b"a", b"b", b"bytes-a")
            with pytest.raises(CommandError, match="loop"):
                await ctx.call("KV.RESERVE", NS, b"a", b"b", 10)
            with pytest.raises(CommandError, match="own parent"):
                ctx.call("KV.PUT", NS, b"c", b"c", b"bytes-c")
            assert store.match(NS, [b"a"]) == 0
            reply = ctx.call("KV.PUT", NS, b"a", b"", b"bytes-a")
            assert (await reply if asyncio.iscoroutine(reply) else reply) == 1
            assert store.match(NS, [b"a", b"b"]) == 2

    asyncio.run(main())
