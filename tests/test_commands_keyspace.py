"""Key commands called directly: SCAN KEYS EXISTS TYPE DEL TTL EXPIRE PERSIST DBSIZE MEMORY."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvstrata.protocol.frames import OK, Simple
from kvstrata.store.keyspace import StringEntry, now_ms
from tests.fakectx import FakeCtx, FakeServer, err


@dataclass
class Chunk:
    """A stand-in for the store's chunk record as the keyspace sees it."""

    expire_at: int | None = None
    type_name: str = "kvchunk"

    def memory_usage(self) -> int:
        return 4096


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


@pytest.fixture
def c(srv: FakeServer) -> FakeCtx:
    return srv.connect()


def test_exists_type_del_unlink(srv: FakeServer, c: FakeCtx) -> None:
    deleted: list[bytes] = []
    srv.keyspace.register_type("kvchunk", lambda key, entry: deleted.append(key))
    c.call("SET", "a", "1")
    srv.keyspace.insert(b"kv:ns:ab", Chunk())
    assert c.call("EXISTS", "a", "a", "missing", "kv:ns:ab") == 3
    assert c.call("TYPE", "a") == Simple(b"string")
    assert c.call("TYPE", "kv:ns:ab") == Simple(b"kvchunk")
    assert c.call("TYPE", "missing") == Simple(b"none")
    assert c.call("DBSIZE") == 2
    assert c.call("DEL", "a", "a", "missing") == 1
    assert c.call("UNLINK", "kv:ns:ab") == 1
    assert deleted == [b"kv:ns:ab"]  # the chunk's owner heard about it
    assert c.call("DBSIZE") == 0


def test_keys_and_scan_match_type(srv: FakeServer, c: FakeCtx) -> None:
    for i in range(25):
        c.call("SET", f"user:{i}", "x")
    srv.keyspace.insert(b"kv:ns:01", Chunk())
    assert sorted(c.call("KEYS", "user:1?")) == sorted(f"user:{i}".encode() for i in range(10, 20))
    seen: list[bytes] = []
    cursor = b"0"
    for _ in range(100):
        cursor, keys = c.call("SCAN", cursor, "MATCH", "user:*", "COUNT", "7")
        assert isinstance(cursor, bytes)
        seen += keys
        if cursor == b"0":
            break
    assert sorted(seen) == sorted(f"user:{i}".encode() for i in range(25))
    assert c.call("SCAN", "0", "TYPE", "kvchunk", "COUNT", "1000") == [b"0", [b"kv:ns:01"]]


def test_scan_errors(c: FakeCtx) -> None:
    assert err(c, "SCAN", "x") == "ERR invalid cursor"
    assert err(c, "SCAN", "-1") == "ERR invalid cursor"
    assert err(c, "SCAN", "0", "COUNT", "0") == "ERR syntax error"
    assert err(c, "SCAN", "0", "COUNT", "x") == "ERR value is not an integer or out of range"
    assert err(c, "SCAN", "0", "MATCH") == "ERR syntax error"
    assert err(c, "SCAN", "0", "FOO", "1") == "ERR syntax error"


def test_ttl_and_expire(srv: FakeServer, c: FakeCtx) -> None:
    assert c.call("TTL", "k") == -2 and c.call("PTTL", "k") == -2
    assert c.call("EXPIRE", "k", "10") == 0
    c.call("SET", "k", "v")
    assert c.call("TTL", "k") == -1 and c.call("PTTL", "k") == -1
    assert c.call("EXPIRE", "k", "100") == 1
    assert 99 <= c.call("TTL", "k") <= 100
    assert 98_000 < c.call("PTTL", "k") <= 100_000
    assert c.call("PERSIST", "k") == 1
    assert c.call("PERSIST", "k") == 0
    assert c.call("TTL", "k") == -1
    assert c.call("PEXPIRE", "k", "0") == 1  # a past time deletes the key
    assert c.call("EXISTS", "k") == 0
    assert c.call("PERSIST", "k") == 0


def test_expire_conditions(c: FakeCtx) -> None:
    c.call("SET", "k", "v")
    assert c.call("EXPIRE", "k", "100", "XX") == 0  # no ttl yet
    assert c.call("EXPIRE", "k", "100", "GT") == 0  # no ttl counts as infinite
    assert c.call("EXPIRE", "k", "100", "NX") == 1
    assert c.call("EXPIRE", "k", "200", "NX") == 0
    assert c.call("EXPIRE", "k", "50", "GT") == 0
    assert c.call("EXPIRE", "k", "200", "GT") == 1
    assert c.call("EXPIRE", "k", "300", "LT") == 0
    assert c.call("EXPIRE", "k", "150", "lt") == 1
    assert 149 <= c.call("TTL", "k") <= 150
    assert c.call("EXPIRE", "k", "120", "XX") == 1
    c.call("SET", "p", "v")
    assert c.call("EXPIRE", "p", "10", "LT") == 1  # persistent key: LT applies


def test_expire_errors(c: FakeCtx) -> None:
    c.call("SET", "k", "v")
    assert err(c, "EXPIRE", "k", "x") == "ERR value is not an integer or out of range"
    assert err(c, "EXPIRE", "k", "10", "NX", "XX") == (
        "ERR NX and XX, GT or LT options at the same time are not compatible"
    )
    assert err(c, "EXPIRE", "k", "10", "GT", "LT") == (
        "ERR GT and LT options at the same time are not compatible"
    )
    assert err(c, "EXPIRE", "k", "10", "YY") == "ERR Unsupported option YY"
    assert err(c, "EXPIRE", "k", "9223372036854775807") == (
        "ERR invalid expire time in 'expire' command"
    )
    assert err(c, "PEXPIRE", "k", "9223372036854775807") == (
        "ERR invalid expire time in 'pexpire' command"
    )
    assert c.call("TTL", "k") == -1


def test_expired_key_is_gone(srv: FakeServer, c: FakeCtx) -> None:
    srv.keyspace.insert(b"old", StringEntry(b"v", expire_at=now_ms() - 1))
    assert c.call("EXISTS", "old") == 0
    assert c.call("TTL", "old") == -2
    assert c.call("TYPE", "old") == Simple(b"none")


def test_flushall(srv: FakeServer, c: FakeCtx) -> None:
    c.call("SET", "a", "1")
    srv.keyspace.insert(b"kv:ns:ab", Chunk())
    assert c.call("FLUSHALL") == OK
    assert c.call("DBSIZE") == 0
    assert c.call("FLUSHALL", "ASYNC") == OK and c.call("FLUSHALL", "sync") == OK
    assert err(c, "FLUSHALL", "NOW") == "ERR syntax error"


def test_memory_usage(srv: FakeServer, c: FakeCtx) -> None:
    c.call("SET", "k", b"x" * 1000)
    assert c.call("MEMORY", "USAGE", "k") >= 1000
    srv.keyspace.insert(b"kv:ns:ab", Chunk())
    assert c.call("MEMORY", "USAGE", "kv:ns:ab", "SAMPLES", "5") >= 4096
    assert c.call("MEMORY", "USAGE", "missing") is None
    assert err(c, "MEMORY", "USAGE", "k", "SAMPLES") == "ERR syntax error"
    assert err(c, "MEMORY", "USAGE", "k", "SAMPLES", "-1") == "ERR syntax error"
    assert err(c, "MEMORY", "USAGE", "k", "FOO", "1") == "ERR syntax error"
    assert c.call("MEMORY", "HELP")[0].startswith(b"MEMORY <subcommand>")
