"""Per-command limits and long commands that do not stall other clients (issue 12)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import redis

from kvstrata.store.hashing import chunk_hashes
from tests.overload import ping_seconds, rss_bytes

MiB = 1024 * 1024
NS = "lim@c256"


def _tokens(n: int) -> bytes:
    return np.arange(n, dtype="<u4").tobytes()


def test_matchtokens_with_tiny_chunks_is_refused_at_once(make_process_server) -> None:
    """Scenario (the issue's): 16 MiB of tokens with CHUNK 1. Before, 4M hashes were computed
    on the event loop (PING stalled 13 s, RSS +900 MiB); now the command is refused."""
    srv = make_process_server(dram_capacity="8MiB", nvme_capacity="0")
    assert srv.process is not None
    r = redis.Redis(port=srv.port)
    r.ping()
    before = rss_bytes(srv.process.pid)
    started = time.monotonic()
    with pytest.raises(redis.ResponseError, match="min-chunk-tokens"):
        r.execute_command("KV.MATCHTOKENS", NS, _tokens(4 * MiB), "CHUNK", 1)
    assert time.monotonic() - started < 5.0
    grown = rss_bytes(srv.process.pid) - before
    assert grown < 150 * MiB, f"RSS grew by {grown // MiB} MiB"
    assert ping_seconds(srv.port) < 0.5


def test_chain_limits_give_clear_errors(server) -> None:
    r = redis.Redis(port=server.port)
    r.config_set("max-chain-chunks", 8)
    r.config_set("max-match-tokens", 1000)
    hashes = [b"h%d" % i for i in range(9)]
    for cmd in (("KV.MATCH",), ("KV.MGET",), ("KV.LEASE",), ("KV.PREFETCH",)):
        with pytest.raises(redis.ResponseError, match="too many chunks: 9 given, max-chain"):
            r.execute_command(*cmd, NS, *hashes)
        r.execute_command(*cmd, NS, *hashes[:8])  # at the limit: fine
    with pytest.raises(redis.ResponseError, match="too many tokens: 1001 given, max-match"):
        r.execute_command("KV.MATCHTOKENS", NS, _tokens(1001), "CHUNK", 256)
    with pytest.raises(redis.ResponseError, match="too many chunks: 62 of 16 tokens"):
        r.execute_command("KV.MATCHTOKENS", NS, _tokens(1000), "CHUNK", 16)
    with pytest.raises(redis.ResponseError, match="min-chunk-tokens is 16"):
        r.execute_command("KV.MATCHTOKENS", NS, _tokens(64), "CHUNK", 8)
    with pytest.raises(redis.ResponseError, match="min-chunk-tokens"):
        r.config_set("min-chunk-tokens", 512)  # above chunk-tokens (256)


def test_a_million_token_prompt_is_well_inside_the_defaults(server) -> None:
    """1M tokens at 256 per chunk (and at 16 per chunk) match with the default limits; the
    hashes are those of docs/hashing.md, and a stored prefix is found."""
    r = redis.Redis(port=server.port)
    packed = _tokens(1_000_000)
    hashes = chunk_hashes(packed, NS, 256)
    assert len(hashes) == 3906
    for i in range(3):
        parent = hashes[i - 1] if i else b""
        assert r.execute_command("KV.PUT", NS, hashes[i], parent, b"kv") == 1
    got = r.execute_command("KV.MATCHTOKENS", NS, packed, "CHUNK", 256)
    assert got[:2] == [768, 3] and got[2] == hashes
    assert r.execute_command("KV.MATCH", NS, *hashes) == 3
    assert len(r.execute_command("KV.MATCHTOKENS", NS, packed, "CHUNK", 16)[2]) == 62_500


HEAVY = """
import struct, sys
import numpy as np, redis
r = redis.Redis(port=int(sys.argv[1]))
hashes = [struct.pack("<Q", i) * 4 for i in range(65536)]
tokens = np.arange(16 * 1024 * 1024, dtype="<u4").tobytes()
for _ in range(2):
    assert len(r.execute_command("KV.MATCHTOKENS", "ns", tokens, "CHUNK", 256)[2]) == 65536
    assert r.execute_command("KV.MATCH", "ns", *hashes) == 0
    assert len(r.execute_command("KV.MGET", "ns", *hashes)) == 65536
"""


def test_long_legal_commands_leave_ping_fast(make_process_server) -> None:
    """Scenario: one client (another process) sends the largest legal commands (16M tokens
    hashed, MATCH and MGET of 65536 hashes) back to back while this one PINGs: PING stays
    fast because the hashing runs on a worker thread and the chains are walked in slices."""
    srv = make_process_server(dram_capacity="8MiB", nvme_capacity="0")
    heavy = subprocess.Popen([sys.executable, "-c", HEAVY, str(srv.port)])
    worst, probes = 0.0, 0
    while heavy.poll() is None:
        worst = max(worst, ping_seconds(srv.port, count=1))
        probes += 1
    assert heavy.wait() == 0
    assert probes > 3
    assert worst < 1.0, f"PING took {worst * 1000:.0f} ms"


MILLION = """
import socket, sys
n = 1_000_000
data = b"*%d\\r\\n$7\\r\\nKV.MGET\\r\\n$2\\r\\nns\\r\\n" % (n + 2) + b"$8\\r\\nxxxxxxxx\\r\\n" * n
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=120) as s:
    s.sendall(data)
    reply = s.recv(200)
assert reply.startswith(b"-ERR too many chunks: 1000000 given"), reply
"""


def test_a_million_hashes_are_refused_without_stalling(make_process_server) -> None:
    """Scenario (the issue's): a KV.MGET of 1M hashes. Before, every hash was looked up on the
    event loop (seconds during which PING waited); now it is parsed in slices and refused
    with a clear error while another client's PING stays fast."""
    srv = make_process_server(dram_capacity="8MiB", nvme_capacity="0")
    heavy = subprocess.Popen([sys.executable, "-c", MILLION, str(srv.port)])
    worst = 0.0
    while heavy.poll() is None:
        worst = max(worst, ping_seconds(srv.port, count=1))
    assert heavy.wait() == 0
    assert worst < 1.0, f"PING took {worst * 1000:.0f} ms"
