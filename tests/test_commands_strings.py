"""GET and SET called directly: options, errors and types as Redis 7."""

from __future__ import annotations

import time

import pytest

from kvstrata.protocol.frames import OK
from kvstrata.store.keyspace import StringEntry
from tests.fakectx import FakeCtx, FakeServer, err

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"


class Chunk:
    expire_at: int | None = None
    type_name = "kvchunk"

    def memory_usage(self) -> int:
        return 1


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


@pytest.fixture
def c(srv: FakeServer) -> FakeCtx:
    return srv.connect()


def test_get_set_basic(srv: FakeServer, c: FakeCtx) -> None:
    assert c.call("GET", "k") is None
    assert c.call("SET", "k", b"v\x00") == OK
    assert c.call("GET", "k") == b"v\x00"
    assert srv.keyspace.hits == 1 and srv.keyspace.misses == 1


def test_set_keeps_bytearray_and_copies_memoryview(srv: FakeServer, c: FakeCtx) -> None:
    big = bytearray(b"x" * 100_000)
    c.call("SET", "big", big)
    entry = srv.keyspace.lookup(b"big")
    assert isinstance(entry, StringEntry) and entry.value is big  # no copy
    buf = bytearray(b"abc")
    c.call("SET", "mv", memoryview(buf))
    buf[0] = ord("z")
    assert c.call("GET", "mv") == b"abc"  # copied: later changes to the buffer do not leak


def test_set_nx_xx_get(c: FakeCtx) -> None:
    assert c.call("SET", "k", "1", "XX") is None
    assert c.call("GET", "k") is None
    assert c.call("SET", "k", "1", "NX") == OK
    assert c.call("SET", "k", "2", "NX") is None
    assert c.call("GET", "k") == b"1"
    assert c.call("SET", "k", "3", "XX") == OK
    assert c.call("SET", "k", "4", "GET") == b"3"
    assert c.call("SET", "new", "1", "GET") is None
    assert c.call("SET", "k", "5", "NX", "GET") == b"4"  # NX fails, old value returned
    assert c.call("GET", "k") == b"4"
    assert err(c, "SET", "k", "v", "NX", "XX") == "ERR syntax error"


def test_set_expiry_options(c: FakeCtx) -> None:
    c.call("SET", "k", "v", "EX", "100")
    assert 99 <= c.call("TTL", "k") <= 100
    c.call("SET", "k", "v", "PX", "5000")
    assert 4000 < c.call("PTTL", "k") <= 5000
    c.call("SET", "k", "v", "EXAT", str(int(time.time()) + 1000))
    assert 990 < c.call("TTL", "k") <= 1000
    c.call("SET", "k", "v", "PXAT", str(int(time.time() * 1000) + 60_000))
    assert 50 < c.call("TTL", "k") <= 60
    c.call("SET", "k", "v2", "KEEPTTL")
    assert 50 < c.call("TTL", "k") <= 60 and c.call("GET", "k") == b"v2"
    c.call("SET", "k", "v3")
    assert c.call("TTL", "k") == -1  # a plain SET clears the TTL


@pytest.mark.parametrize(
    ("words", "error"),
    [
        (("EX", "0"), "ERR invalid expire time in 'set' command"),
        (("PX", "-5"), "ERR invalid expire time in 'set' command"),
        (("EX", "9223372036854775"), "ERR invalid expire time in 'set' command"),
        (("EX", "x"), "ERR value is not an integer or out of range"),
        (("EX",), "ERR syntax error"),
        (("EX", "1", "PX", "1"), "ERR syntax error"),
        (("KEEPTTL", "EX", "1"), "ERR syntax error"),
        (("EX", "1", "KEEPTTL"), "ERR syntax error"),
        (("BOGUS",), "ERR syntax error"),
    ],
)
def test_set_option_errors(c: FakeCtx, words: tuple[str, ...], error: str) -> None:
    assert err(c, "SET", "k", "v", *words) == error
    assert c.call("EXISTS", "k") == 0


def test_chunk_keys_are_not_strings(srv: FakeServer, c: FakeCtx) -> None:
    deleted: list[bytes] = []
    srv.keyspace.register_type("kvchunk", lambda key, entry: deleted.append(key))
    srv.keyspace.insert(b"kv:ns:ab", Chunk())
    assert err(c, "GET", "kv:ns:ab") == WRONGTYPE
    assert err(c, "SET", "kv:ns:ab", "x", "GET") == WRONGTYPE
    assert deleted == []  # the failed SET ... GET did not touch the chunk
    assert c.call("SET", "kv:ns:ab", "x") == OK  # SET replaces a key of any type
    assert deleted == [b"kv:ns:ab"]
    assert c.call("GET", "kv:ns:ab") == b"x"


def test_get_summary_points_to_kv_get(srv: FakeServer) -> None:
    spec = srv.registry.lookup(b"get")
    assert spec is not None and "KV.GET" in spec.summary
