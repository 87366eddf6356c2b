"""The client's connections against a real redis-server: HELLO 3 / RESP2, AUTH, CLIENT SETINFO,
32 MiB bulk replies received into numpy/torch/bytearray buffers, pipelines, pools (threads and
tasks) and recovery from a killed connection."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvstrata.clients import (
    AsyncClient,
    BufferTooSmall,
    Client,
    ConnectionClosedError,
    NoAuthError,
    WrongPassError,
)
from kvstrata.clients.aioconn import open_connection
from kvstrata.clients.connection import ConnectionSettings, SyncConnection
from kvstrata.protocol.errors import CommandError, WrongTypeError

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
BIG = 32 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(*extra: str) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    proc, port = start_redis()
    yield port
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def big_payload(redis_port: int) -> np.ndarray:
    data = np.random.default_rng(3).integers(0, 256, BIG, dtype=np.uint8)
    with Client(port=redis_port) as c:
        assert c.execute("SET", "big", data) == b"OK"
    return data


def test_hello3_and_setinfo(redis_port: int) -> None:
    with SyncConnection(ConnectionSettings(port=redis_port, client_name="eng-1")) as conn:
        assert conn.protocol == 3
        hello = conn.execute("HELLO", 3)
        assert hello[b"proto"] == 3 and hello[b"server"] == b"redis"
        info = conn.execute("CLIENT", "INFO")
        assert b" name=eng-1 " in info and b"resp=3" in info
        if b"lib-name=" in info:  # CLIENT SETINFO exists from Redis 7.2 (errors are ignored)
            assert b"lib-name=kvstrata-py" in info
        assert conn.execute("CONFIG", "GET", "maxmemory") == {b"maxmemory": b"0"}


def test_resp2_connection(redis_port: int) -> None:
    with SyncConnection(ConnectionSettings(port=redis_port, protocol=2)) as conn:
        assert conn.protocol == 2
        assert conn.execute("CONFIG", "GET", "maxmemory") == [b"maxmemory", b"0"]
        assert b"resp=2" in conn.execute("CLIENT", "INFO")


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "torch", "none"])
def test_get_32mib_into_buffer(redis_port: int, big_payload: np.ndarray, kind: str) -> None:
    with Client(port=redis_port) as c:
        if kind == "none":
            got = c.execute("GET", "big")
            assert isinstance(got, bytearray) and got == big_payload.tobytes()
            return
        out: Any
        if kind == "numpy":
            out = np.zeros(BIG + 10, dtype=np.uint8)
        elif kind == "bytearray":
            out = bytearray(BIG)
        else:
            torch = pytest.importorskip("torch")
            out = torch.zeros(BIG // 2, dtype=torch.float16)
        view = c.execute("GET", "big", out=out)
        assert isinstance(view, memoryview) and view.nbytes == BIG
        arr = np.frombuffer(view, dtype=np.uint8)
        assert np.array_equal(arr, big_payload)
        assert np.shares_memory(arr, np.asarray(out).view(np.uint8)) if kind != "bytearray" else 1
        assert c.execute("GET", "missing", out=out) is None


def test_too_small_buffer_keeps_connection(redis_port: int, big_payload: np.ndarray) -> None:
    with Client(port=redis_port, max_connections=1) as c:
        with pytest.raises(BufferTooSmall):
            c.execute("GET", "big", out=bytearray(1000))
        assert c.ping()


def test_pipeline(redis_port: int) -> None:
    with Client(port=redis_port) as c:
        p = c.pipeline()
        p.execute_command("DEL", "p1", "l1").execute_command("SET", "p1", "7")
        p.execute_command("INCRBY", "p1", 5).execute_command("LPUSH", "l1", "a")
        p.execute_command("INCR", "l1").execute_command("GET", "p1")
        res = p.execute(raise_on_error=False)
        assert res[1:4] == [b"OK", 12, 1]
        assert isinstance(res[4], WrongTypeError) and res[5] == b"12"
        p.execute_command("INCR", "l1").execute_command("GET", "p1")
        with pytest.raises(WrongTypeError):
            p.execute()
        assert c.execute("GET", "p1") == b"12"


def test_many_commands_in_one_pipeline(redis_port: int) -> None:
    with SyncConnection(ConnectionSettings(port=redis_port)) as conn:
        cmds = [["SET", f"k{i}", b"v" * (i % 300)] for i in range(3000)]
        assert conn.pipeline(cmds) == [b"OK"] * 3000
        got = conn.pipeline([["GET", f"k{i}"] for i in range(3000)])
        assert got == [b"v" * (i % 300) for i in range(3000)]


def test_sync_pool_is_thread_safe(redis_port: int) -> None:
    with Client(port=redis_port, max_connections=3) as c:
        c.execute("DEL", "ctr")

        def work() -> None:
            for _ in range(200):
                c.execute("INCR", "ctr")

        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert c.execute("GET", "ctr") == b"1200"
        assert c.pool._count <= 3


def test_killed_connection_raises_then_recovers(redis_port: int) -> None:
    with Client(port=redis_port, max_connections=1) as c:
        my_id = c.execute("CLIENT", "ID")
        with pytest.raises(ConnectionClosedError):
            c.execute("CLIENT", "KILL", "ID", my_id, "SKIPME", "no")
            c.execute("PING")  # if the kill reply arrived first, the next command sees EOF
        assert c.ping()
        assert c.execute("CLIENT", "ID") != my_id


def test_auth() -> None:
    proc, port = start_redis("--requirepass", "s3cret")
    try:
        with pytest.raises(NoAuthError):
            Client(port=port)
        with pytest.raises(WrongPassError):
            Client(port=port, password="nope")
        with Client(port=port, password="s3cret") as c:
            assert c.ping()
        with Client(port=port, password="s3cret", protocol=2) as c:
            assert c.ping()
        with Client.from_url(f"redis://default:s3cret@127.0.0.1:{port}") as c:
            assert c.ping()
    finally:
        proc.terminate()
        proc.wait(10)


def test_async_client(redis_port: int, big_payload: np.ndarray) -> None:
    async def main() -> None:
        async with AsyncClient(port=redis_port, max_connections=4) as c:
            assert await c.ping()
            out = np.empty(BIG, dtype=np.uint8)
            view = await c.execute("GET", "big", out=out)
            assert view.nbytes == BIG and np.array_equal(out, big_payload)
            await c.execute("DEL", "actr")
            await asyncio.gather(*(c.execute("INCR", "actr") for _ in range(100)))
            assert await c.execute("GET", "actr") == b"100"
            p = c.pipeline()
            p.execute_command("SET", "ap", "1").execute_command("INCR", "ap")
            p.execute_command("HSET", "ap", "f", "v")
            res = await p.execute(raise_on_error=False)
            assert res[:2] == [b"OK", 2] and isinstance(res[2], WrongTypeError)
            with pytest.raises(CommandError):
                await c.execute("NOSUCHCOMMAND")
            assert len(c.pool._all) <= 4

    asyncio.run(main())


def test_async_connection_pipelining_from_tasks(redis_port: int) -> None:
    async def main() -> None:
        conn = await open_connection(ConnectionSettings(port=redis_port))
        assert conn.protocol == 3
        vals = await asyncio.gather(*(conn.execute("ECHO", str(i)) for i in range(500)))
        assert vals == [str(i).encode() for i in range(500)]
        my_id = await conn.execute("CLIENT", "ID")
        killer = await open_connection(ConnectionSettings(port=redis_port, protocol=2))
        assert await killer.execute("CLIENT", "KILL", "ID", my_id) == 1
        with pytest.raises(ConnectionClosedError):
            await conn.execute("PING")
        killer.close()

    asyncio.run(main())


def test_async_auth_and_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    proc, port = start_redis("--requirepass", "pw")

    async def main() -> None:
        with pytest.raises(WrongPassError):
            await AsyncClient.connect(port=port, password="bad")
        c = await AsyncClient.connect(port=port, password="pw")
        payload = np.arange(1 << 20, dtype=np.uint32)
        assert await c.execute("SET", "u", payload) == b"OK"
        out = bytearray(payload.nbytes)
        await c.execute("GET", "u", out=out)
        assert np.array_equal(np.frombuffer(out, dtype=np.uint32), payload)
        await c.close()

    try:
        uvloop.run(main())
    finally:
        proc.terminate()
        proc.wait(10)
