"""End-to-end: the standard commands through redis-py 8 (sync and asyncio, RESP2 and RESP3)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import RunningServer

PROTOCOLS = [2, 3]


def connect(srv: RunningServer, protocol: int = 2, **kw: Any) -> redis.Redis:
    return redis.Redis(
        host=srv.host, port=srv.port, protocol=protocol, retry=Retry(NoBackoff(), 0), **kw
    )


@pytest.fixture
def clients(server: RunningServer) -> Iterator[Callable[..., redis.Redis]]:
    made: list[redis.Redis] = []

    def factory(protocol: int = 2, **kw: Any) -> redis.Redis:
        r = connect(server, protocol, **kw)
        made.append(r)
        return r

    yield factory
    for r in made:
        r.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_basics(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r = clients(protocol)
    assert r.ping() is True
    assert r.echo(b"\x00hi") == b"\x00hi"
    assert r.set("k", b"v") is True
    assert r.get("k") == b"v"
    assert r.exists("k", "k", "nope") == 2
    assert r.type("k") == b"string"
    assert r.dbsize() == 1
    sec, usec = r.time()
    assert sec > 1_600_000_000 and 0 <= usec < 1_000_000
    assert r.delete("k", "nope") == 1
    assert r.execute_command("SELECT", 0) in (True, b"OK")
    with pytest.raises(redis.ResponseError, match="DB index is out of range"):
        r.execute_command("SELECT", 1)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_client_commands(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r, other = clients(protocol), clients(protocol)
    victim = other.client_id()  # redis-py connects lazily
    assert r.client_setname("worker") is True
    assert r.client_getname() in ("worker", b"worker")
    my_id = r.client_id()
    listed = {int(c["id"]): c for c in r.client_list()}
    assert my_id in listed and victim in listed
    assert listed[my_id]["name"] == "worker"
    assert listed[my_id]["lib-name"] == "redis-py"  # CLIENT SETINFO sent on connect
    assert int(r.client_info()["id"]) == my_id
    assert r.client_kill_filter(_id=str(victim)) == 1
    assert victim not in {int(c["id"]) for c in r.client_list()}
    assert other.client_id() != victim  # its connection was closed; redis-py reconnected


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pipeline_of_10k_commands(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r = clients(protocol)
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.set(f"p:{i}", i)
        pipe.get(f"p:{i}")
    results = pipe.execute()
    assert len(results) == 10_000
    assert results[0::2] == [True] * 5000
    assert results[1::2] == [str(i).encode() for i in range(5000)]
    assert r.dbsize() == 5000


def test_scan_sees_every_old_key_once_despite_inserts(clients: Callable[..., redis.Redis]) -> None:
    r, writer = clients(), clients()
    old = {f"old:{i}".encode() for i in range(3000)}
    pipe = r.pipeline(transaction=False)
    for key in old:
        pipe.set(key, 1)
    pipe.execute()
    seen: list[Any] = []
    cursor, n = 0, 0
    while True:
        cursor, keys = r.scan(cursor, count=97)
        seen += keys
        writer.set(f"new:{n}", 1)
        n += 1
        if cursor == 0:
            break
    old_seen = [k for k in seen if k.startswith(b"old:")]
    assert sorted(old_seen) == sorted(old)  # each old key exactly once
    assert set(r.scan_iter(match="old:1?", count=500)) == {b"old:%d" % i for i in range(10, 20)}
    assert set(r.scan_iter(_type="string", match="new:*")) == {b"new:%d" % i for i in range(n)}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_expire_ttl_and_set_options(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r = clients(protocol)
    assert r.ttl("k") == -2
    assert r.set("k", "v", nx=True, ex=100) is True
    assert r.set("k", "w", nx=True) is None
    assert 99 <= r.ttl("k") <= 100 and 98_000 < r.pttl("k") <= 100_000
    assert r.set("k", "w", xx=True, keepttl=True) is True
    assert 90 <= r.ttl("k") <= 100
    assert r.set("k", "x", get=True) == b"w"
    assert r.ttl("k") == -1
    assert r.expire("k", 50, xx=True) is False
    assert r.expire("k", 50, nx=True) is True
    assert r.expire("k", 10, gt=True) is False
    assert r.expire("k", 10, lt=True) is True
    assert r.persist("k") is True and r.ttl("k") == -1
    assert r.pexpire("k", 0) is True and r.exists("k") == 0
    with pytest.raises(redis.ResponseError, match="invalid expire time in 'set' command"):
        r.set("k", "v", ex=0)
    with pytest.raises(redis.ResponseError, match="syntax error"):
        r.execute_command("SET", "k", "v", "NX", "XX")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_info_and_config(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r = clients(protocol)
    r.set("a", 1)
    info = r.info()
    assert info["redis_version"] == "7.2.0" and "kvstrata_version" in info
    assert info["connected_clients"] >= 1 and info["db0"]["keys"] == 1
    assert set(r.info("server")) >= {"run_id", "tcp_port", "uptime_in_seconds"}
    everything = r.config_get("*")
    assert everything["slowlog-max-len"] == "128" and "requirepass" not in everything
    assert r.config_set("slowlog-max-len", 7) is True
    assert r.config_get("slowlog-max-len") == {"slowlog-max-len": "7"}
    with pytest.raises(redis.ResponseError, match="immutable"):
        r.config_set("port", 1)
    assert r.config_resetstat() is True


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_slowlog(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r = clients(protocol)
    r.client_setname("slowpoke")
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()
    r.set("slow-key", "x" * 300)
    entries = r.slowlog_get(10)
    assert r.slowlog_len() >= 1
    mine = [e for e in entries if b"slow-key" in e["command"]]
    assert mine, entries
    assert mine[0]["command"].startswith(b"SET slow-key " + b"x" * 128 + b"... (172 more bytes)")
    assert mine[0]["client_name"] in (b"slowpoke", "slowpoke")
    r.config_set("slowlog-log-slower-than", -1)
    before = r.slowlog_len()
    r.ping()
    assert r.slowlog_len() == before


def test_monitor_sees_other_clients(clients: Callable[..., redis.Redis]) -> None:
    watcher, worker = clients(), clients()
    worker.ping()
    with watcher.monitor() as m:
        worker.set("watched", b'va"l\n')
        event = m.next_command()
    assert event["command"] == 'SET watched va"l\\n'
    assert event["db"] == 0 and event["client_type"] == "tcp"
    assert event["client_address"] == "127.0.0.1" and event["time"] > 1_600_000_000


def test_auth_flows(make_server: Callable[..., RunningServer]) -> None:
    srv = make_server(requirepass="pw")
    with pytest.raises(redis.AuthenticationError):
        connect(srv).ping()
    with pytest.raises(redis.AuthenticationError):
        connect(srv, password="bad").ping()
    for protocol in PROTOCOLS:
        good = connect(srv, protocol, password="pw")
        assert good.ping() is True
        assert good.execute_command("RESET") in ("RESET", b"RESET")
        with pytest.raises(redis.AuthenticationError):
            good.execute_command("GET", "k")
        good.close()
    user = connect(srv, username="default", password="pw")
    assert user.ping() is True
    user.close()


def test_shutdown(make_server: Callable[..., RunningServer]) -> None:
    srv = make_server()
    r = connect(srv)
    r.shutdown(nosave=True)  # redis-py raises "SHUTDOWN seems to have failed" on any reply
    assert srv.thread is not None
    srv.thread.join(15)
    assert not srv.thread.is_alive()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_asyncio_client(server: RunningServer, protocol: int) -> None:
    async def main() -> None:
        r = aioredis.Redis(host=server.host, port=server.port, protocol=protocol)
        try:
            assert await r.ping() is True
            await r.set("a", b"1", ex=100)
            assert await r.get("a") == b"1"
            assert 99 <= await r.ttl("a") <= 100
            async with r.pipeline(transaction=False) as pipe:
                for i in range(1000):
                    pipe.set(f"x{i}", i)
                assert len(await pipe.execute()) == 1000
            keys = {k async for k in r.scan_iter(match="x*", count=100)}
            assert len(keys) == 1000
            big = b"\x01" * (1 << 20)
            await r.set("big", big)
            assert await r.get("big") == big
            assert await r.client_setname("aio") is True
            listed = await r.client_list()
            assert [c["resp"] for c in listed if c["name"] == "aio"] == [str(protocol)]
        finally:
            await r.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_command_introspection(clients: Callable[..., redis.Redis], protocol: int) -> None:
    r = clients(protocol)
    docs = r.execute_command("COMMAND DOCS", "set")  # no redis-py callback: the raw reply
    if not isinstance(docs, dict):
        docs = dict(zip(docs[::2], docs[1::2], strict=True))
    assert list(docs) == [b"set"]
    assert r.command_count() >= 25
    assert b"client|kill" in r.command_list() or "client|kill" in r.command_list()


def test_bare_command(clients: Callable[..., redis.Redis]) -> None:
    table = clients().command()
    assert table["get"]["arity"] == 2 and "readonly" in table["get"]["flags"]


def test_clients_in_parallel_threads(clients: Callable[..., redis.Redis]) -> None:
    errors: list[BaseException] = []
    conns = [clients(p) for p in (2, 3, 2, 3)]

    def work(r: redis.Redis, n: int) -> None:
        try:
            for i in range(300):
                r.set(f"t{n}:{i}", i)
                assert r.get(f"t{n}:{i}") == str(i).encode()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r, n)) for n, r in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert conns[0].dbsize() == 1200
