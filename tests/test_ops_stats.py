"""INFO commandstats / errorstats in Redis's formats, keyspace hits and misses counting chunk
reads, CLIENT LIST's fd, CONFIG RESETSTAT clearing them — through redis-py on a real server."""

from __future__ import annotations

import re

import pytest
import redis

from tests.conftest import RunningServer


@pytest.fixture
def client(server: RunningServer) -> redis.Redis:
    return redis.Redis(port=server.port, decode_responses=True)


def test_commandstats_count_calls_rejections_and_failures(client: redis.Redis) -> None:
    client.ping()
    client.config_resetstat()  # forget what redis-py sent on connect (HELLO, CLIENT …)
    client.ping()
    client.ping()
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        client.execute_command("GET")
    with pytest.raises(redis.ResponseError, match="invalid namespace"):
        client.execute_command("KV.GET", "", "aa")
    with pytest.raises(redis.ResponseError, match="unknown command"):
        client.execute_command("NOSUCHCOMMAND")
    client.config_get("port")
    stats = client.info("commandstats")
    assert stats["cmdstat_ping"]["calls"] == 2
    assert stats["cmdstat_ping"]["rejected_calls"] == 0
    assert stats["cmdstat_get"]["rejected_calls"] == 1
    assert stats["cmdstat_get"]["calls"] == 0
    assert stats["cmdstat_kv.get"]["failed_calls"] == 1
    assert stats["cmdstat_config|get"]["calls"] == 1
    assert set(stats["cmdstat_ping"]) == {
        "calls", "usec", "usec_per_call", "rejected_calls", "failed_calls"
    }  # fmt: skip
    errors = client.info("errorstats")
    assert errors == {"errorstat_ERR": {"count": 3}}
    with pytest.raises(redis.ResponseError, match=r"^NOLEASE"):
        client.execute_command("KV.COMMIT", "nolease")
    assert client.info("errorstats")["errorstat_NOLEASE"] == {"count": 1}
    default = client.info()
    assert not any(k.startswith(("cmdstat_", "errorstat_")) for k in default)
    assert "cmdstat_ping" in client.info("all")
    client.config_resetstat()
    assert "cmdstat_get" not in client.info("commandstats")
    assert client.info("errorstats") == {}


def test_keyspace_hits_and_misses_count_chunk_reads(client: redis.Redis) -> None:
    client.execute_command("KV.PUT", "ns", "aa", "", b"x" * 1000)
    client.execute_command("KV.GET", "ns", "aa")
    client.execute_command("KV.GET", "ns", "bb")
    client.execute_command("KV.MGET", "ns", "aa", "bb", "cc")
    stats = client.info("stats")
    assert (stats["keyspace_hits"], stats["keyspace_misses"]) == (2, 3)


def test_client_list_shows_the_socket_fd(client: redis.Redis) -> None:
    line = client.execute_command("CLIENT", "LIST")
    fds = [int(m) for m in re.findall(r" fd=(-?\d+) ", line)]
    assert fds and all(fd > 2 for fd in fds)
