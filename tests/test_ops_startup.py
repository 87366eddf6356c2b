"""Start-up: the port is bound before the DRAM arena is pre-touched; PING, INFO, AUTH and HELLO
answer while loading, KV and keyspace commands get ``-LOADING`` (Redis's wording)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstrata.config import load_config
from kvstrata.server.app import Server
from kvstrata.tiers.dram import DramTier
from tests.conftest import TEST_DEFAULTS, raw_exchange

LOADING = b"-LOADING kvstrata is loading the dataset in memory\r\n"


class GatedServer:
    """A server in a thread whose DRAM pre-touch waits for ``gate`` before its first step."""

    def __init__(self, data_dir: Path, monkeypatch: pytest.MonkeyPatch, **flags: str) -> None:
        self.gate = threading.Event()
        self.touching = threading.Event()
        self.arenas: set[str] = set()  # shared-memory names of the arenas being pre-touched
        original = DramTier._touch_range

        def slow_touch(tier: DramTier, start: int, end: int) -> None:
            self.arenas.add(tier._shm.name)
            self.touching.set()
            assert self.gate.wait(30), "test never opened the gate"
            original(tier, start, end)

        monkeypatch.setattr(DramTier, "_touch_range", slow_touch)
        values = {**TEST_DEFAULTS, "data-dir": str(data_dir), **flags}
        self.server = Server(load_config(flags=values, env={}))
        self.loop = asyncio.new_event_loop()
        self.listening = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self.listening.wait(30)
        if self.errors:
            raise self.errors[0]

    def _main(self) -> None:
        async def run() -> None:
            task = asyncio.ensure_future(self.server.run())
            await asyncio.wait(
                [task, asyncio.ensure_future(self.server.wait_listening())],
                return_when=asyncio.FIRST_COMPLETED,
            )
            self.listening.set()
            await task

        try:
            self.loop.run_until_complete(run())
        except BaseException as exc:
            self.errors.append(exc)
            self.listening.set()
        finally:
            self.loop.close()

    @property
    def port(self) -> int:
        return int(self.server.port)

    def stop(self) -> None:
        self.gate.set()
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.request_shutdown, False)
            self.thread.join(30)


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedServer]:
    srv = GatedServer(tmp_path / "data", monkeypatch)
    yield srv
    srv.stop()


def _info_field(client: Any, section: str, name: str) -> Any:
    return client.info(section)[name]


def _wait_for(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_ping_info_auth_hello_answer_while_the_arena_is_pretouched(gated: GatedServer) -> None:
    """The pre-touch is held at its first step: the port is already bound, PING/INFO/HELLO
    answer, KV.GET, KV.PUT, KV.STATS, GET and DBSIZE get -LOADING; INFO says loading:1."""
    assert gated.touching.wait(30)
    port = gated.port
    assert raw_exchange(port, b"PING\r\n", until=b"\r\n") == b"+PONG\r\n"
    for command in (b"KV.GET ns aa", b"KV.PUT ns aa '' x", b"KV.STATS", b"GET k", b"DBSIZE"):
        assert raw_exchange(port, command + b"\r\n", until=b"\r\n") == LOADING, command
    hello = raw_exchange(port, b"HELLO 3\r\n", until=b"modules")
    assert hello.startswith(b"%") and b"kvstrata" in hello
    auth = raw_exchange(port, b"AUTH nopass\r\n", until=b"\r\n")
    assert auth.startswith(b"-ERR AUTH") or auth.startswith(b"-WRONGPASS"), auth
    client = redis.Redis(port=port, retry_on_error=[])
    assert _info_field(client, "persistence", "loading") == 1
    with pytest.raises(redis.exceptions.BusyLoadingError):
        client.execute_command("KV.GET", "ns", "aa")
    gated.gate.set()
    _wait_for(lambda: _info_field(client, "persistence", "loading") == 0)
    assert client.execute_command("KV.PUT", "ns", "aa", "", b"x" * 100) is not None
    assert client.execute_command("KV.GET", "ns", "aa") == b"x" * 100
    assert client.info("tiers")["dram_pretouch_seconds"] > 0
    client.close()


def test_shutdown_while_loading_stops_and_removes_the_arena(gated: GatedServer) -> None:
    assert gated.touching.wait(30)
    arenas = [n for n in os.listdir("/dev/shm") if n in gated.arenas]
    assert arenas, "the arena exists while it is being pre-touched"
    with socket.create_connection(("127.0.0.1", gated.port)) as sock:
        sock.sendall(b"SHUTDOWN NOSAVE\r\n")
        _wait_for(lambda: gated.server.stopping)
        gated.gate.set()  # the step in flight finishes; the rest is skipped
        assert sock.recv(100) == b""  # closed without a reply, as Redis
    gated.thread.join(30)
    assert not gated.thread.is_alive() and not gated.errors
    assert gated.server.store is None
    left = [n for n in os.listdir("/dev/shm") if n in arenas]
    assert left == []
