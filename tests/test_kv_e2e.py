"""End-to-end: KV.* commands against a real server on port 0 through redis-py and redis-cli."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker, shared_memory

import pytest
import redis

from tests.conftest import RunningServer

NS = "e2e@bf16@c4"


def client(srv: RunningServer, protocol: int = 3) -> redis.Redis:
    return redis.Redis(host=srv.host, port=srv.port, protocol=protocol, socket_timeout=20)


def test_large_put_get_match_and_keyspace(server: RunningServer) -> None:
    """Scenario: a 1 MiB chunk (received through a payload sink) and its 1 MiB child are
    stored with redis-py; they read back identical, match as a chain, show up in SCAN/TYPE/TTL
    as kv: keys, and DEL of the parent key removes it from the match."""
    r = client(server)
    parent = bytes(range(256)) * 4096
    child = b"c" * (1 << 20)
    assert r.execute_command("KV.PUT", NS, b"p", b"", parent, "TOKENS", 4) == 1
    assert r.execute_command("KV.PUT", NS, b"c", b"p", child) == 1
    assert r.execute_command("KV.PUT", NS, b"c", b"p", child, "NX") == 0
    assert r.execute_command("KV.GET", NS, b"p") == parent
    assert r.execute_command("KV.MGET", NS, b"c", b"zz") == [child, None]
    assert r.execute_command("KV.MATCH", NS, b"p", b"c", b"x") == 2
    assert r.execute_command("KV.MATCH", NS, b"p", b"c", "WITHTIERS") == [2, [b"dram", b"dram"]]
    key = f"kv:{NS}:{b'p'.hex()}".encode()
    assert key in list(r.scan_iter(match=f"kv:{NS}:*"))
    assert r.type(key) == b"kvchunk"
    assert r.ttl(key) == -1
    info = r.execute_command("KV.INFO", NS, b"p")
    assert info[b"size"] == len(parent) and info[b"children"] == 1
    assert r.delete(key) == 1
    assert r.execute_command("KV.MATCH", NS, b"p", b"c") == 0
    assert r.execute_command("KV.GET", NS, b"c") == child  # children survive a parent DEL
    stats = r.execute_command("KV.STATS")
    assert stats[b"dram"][b"chunks"] == 1


def test_errors_over_the_wire(server: RunningServer) -> None:
    r = client(server, protocol=2)
    with pytest.raises(redis.ResponseError, match="invalid hash"):
        r.execute_command("KV.PUT", NS, b"", b"", b"x")
    with pytest.raises(redis.ResponseError, match="no such lease"):
        r.execute_command("KV.RELEASE", "deadbeefdeadbeef")
    with pytest.raises(redis.ResponseError, match="invalid nbytes"):
        r.execute_command("KV.RESERVE", NS, b"h", b"", 0)
    # a large payload with a bad option: its sink is aborted, nothing is stored
    with pytest.raises(redis.ResponseError, match="unknown option"):
        r.execute_command("KV.PUT", NS, b"h", b"", b"x" * 200_000, "BOGUS")
    assert r.execute_command("KV.MATCH", NS, b"h") == 0
    assert r.execute_command("KV.PUT", NS, b"h", b"", b"x" * 200_000) == 1


def test_concurrent_nx_puts_over_tcp(server: RunningServer) -> None:
    """Scenario: 6 clients put the same hash with NX and different 512 KiB payloads at once;
    exactly one gets 1 and every client then reads the winner's bytes."""
    payloads = [bytes([i + 1]) * (512 * 1024) for i in range(6)]

    def put(i: int) -> int:
        with client(server) as r:
            return int(r.execute_command("KV.PUT", NS, b"same", b"", payloads[i], "NX"))

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(put, range(6)))
    assert sorted(results) == [0, 0, 0, 0, 0, 1]
    winner = payloads[results.index(1)]
    with client(server) as r:
        assert r.execute_command("KV.GET", NS, b"same") == winner


def test_lease_handle_reads_from_shared_memory(server: RunningServer) -> None:
    r = client(server)
    data = b"L" * 100_000
    assert r.execute_command("KV.PUT", NS, b"l", b"", data) == 1
    regions = r.execute_command("KV.REGIONS")
    assert regions[0][b"kind"] == b"shm"
    lease_id, handles = r.execute_command("KV.LEASE", NS, b"l", b"missing", "TTL", 10_000)
    assert len(handles) == 1
    name, offset, length, instance = handles[0]
    assert name == regions[0][b"name"] and instance == regions[0][b"instance"]
    shm = shared_memory.SharedMemory(name=regions[0][b"path"].decode())
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    try:
        assert shm.buf is not None
        assert bytes(shm.buf[offset : offset + length]) == data
    finally:
        shm.close()
    assert r.execute_command("KV.RELEASE", lease_id) in (b"OK", "OK", True)
    wid, (_, woff, wlen, _) = r.execute_command("KV.RESERVE", NS, b"w", b"l", 4096)
    shm = shared_memory.SharedMemory(name=regions[0][b"path"].decode())
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    try:
        assert shm.buf is not None
        shm.buf[woff : woff + wlen] = b"W" * 4096
    finally:
        shm.close()
    r.execute_command("KV.COMMIT", wid)
    assert r.execute_command("KV.GET", NS, b"w") == b"W" * 4096
    assert r.execute_command("KV.MATCH", NS, b"l", b"w") == 2


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli")
def test_redis_cli_put_get_stats(server: RunningServer) -> None:
    def cli(*args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(server.port), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert cli("KV.PUT", NS, "h1", "", "hello") == "1\n"
    assert cli("KV.GET", NS, "h1") == "hello\n"
    assert cli("KV.MATCH", NS, "h1", "h2") == "1\n"
    assert "dram" in cli("KV.STATS")
    assert "ERR invalid namespace" in cli("KV.GET", "bad ns", "h1")
    assert cli("--scan", "--pattern", f"kv:{NS}:*").strip() == f"kv:{NS}:{b'h1'.hex()}"
