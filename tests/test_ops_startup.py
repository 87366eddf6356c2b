"""Start-up: the port is bound at once and the store serves while the DRAM arena warms;
``-LOADING`` (Redis's wording) is kept for indexing existing data (the NVMe rebuild), during
which PING, INFO, AUTH and HELLO answer and KV and keyspace commands get ``-LOADING``."""

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

import kvstrata.store.kvstore as kvstore_module
from kvstrata.config import load_config
from kvstrata.server.app import Server
from kvstrata.tiers.dram import DramTier
from tests.conftest import TEST_DEFAULTS, raw_exchange

LOADING = b"-LOADING kvstrata is loading the dataset in memory\r\n"


class GatedServer:
    """A server in a thread held at one start-up step until ``gate`` is set: the DRAM
    warm-up's first step (``hold="warm"``) or the NVMe index rebuild (``hold="rebuild"``)."""

    def __init__(
        self, data_dir: Path, monkeypatch: pytest.MonkeyPatch, hold: str = "warm", **flags: str
    ) -> None:
        self.gate = threading.Event()
        self.touching = threading.Event()  # the held step has been reached
        self.arenas: set[str] = set()  # shared-memory names of the arenas being warmed
        if hold == "warm":
            original = DramTier._touch_range

            def slow_touch(tier: DramTier, start: int, end: int) -> None:
                self.arenas.add(tier._shm.name)
                self.touching.set()
                assert self.gate.wait(30), "test never opened the gate"
                original(tier, start, end)

            monkeypatch.setattr(DramTier, "_touch_range", slow_touch)
        else:
            rebuild = kvstore_module.rebuild_index

            async def slow_rebuild(state: Any, report: Any) -> None:
                self.touching.set()
                loop = asyncio.get_running_loop()
                assert await loop.run_in_executor(None, self.gate.wait, 30), "gate never opened"
                await rebuild(state, report)

            monkeypatch.setattr(kvstore_module, "rebuild_index", slow_rebuild)
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
    srv = GatedServer(tmp_path / "data", monkeypatch, hold="warm")
    yield srv
    srv.stop()


@pytest.fixture
def indexing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedServer]:
    srv = GatedServer(tmp_path / "data", monkeypatch, hold="rebuild")
    yield srv
    srv.stop()


def _info_field(client: Any, section: str, name: str) -> Any:
    return client.info(section)[name]


def _wait_for(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_kv_commands_are_served_while_the_arena_warms(gated: GatedServer) -> None:
    """The warm-up is held at its first step, before it has reached any page: the store
    already serves (loading:0), chunks are stored and read back byte for byte, INFO shows the
    warm-up in progress; once it has run over the pages holding them, the bytes are intact."""
    assert gated.touching.wait(30)
    client = redis.Redis(port=gated.port, retry_on_error=[])
    _wait_for(lambda: _info_field(client, "persistence", "loading") == 0)
    tiers = client.info("tiers")
    assert tiers["dram_warming"] == 1 and tiers["dram_warmed_percent"] == 0
    assert tiers["dram_pretouch_seconds"] == 0
    payloads = {f"{i:02x}": os.urandom(3 * 1024 * 1024 + 17 * i) for i in range(8)}
    parent = ""
    for h, data in payloads.items():
        assert client.execute_command("KV.PUT", "ns", h, parent, data) is not None
        parent = h
    for h, data in payloads.items():
        assert client.execute_command("KV.GET", "ns", h) == data
    assert client.execute_command("SET", "k", b"v" * 100_000)  # a large string: in the arena
    gated.gate.set()
    _wait_for(lambda: _info_field(client, "tiers", "dram_warming") == 0)
    tiers = client.info("tiers")
    assert tiers["dram_warmed_percent"] == 100 and tiers["dram_pretouch_seconds"] > 0
    for h, data in payloads.items():
        assert client.execute_command("KV.GET", "ns", h) == data
    assert client.get("k") == b"v" * 100_000
    client.close()


def test_ping_info_auth_hello_answer_while_nvme_is_indexed(indexing: GatedServer) -> None:
    """The NVMe index rebuild is held: the port is already bound, PING/INFO/HELLO answer,
    KV.GET, KV.PUT, KV.STATS, GET and DBSIZE get -LOADING; INFO says loading:1."""
    assert indexing.touching.wait(30)
    port = indexing.port
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
    indexing.gate.set()
    _wait_for(lambda: _info_field(client, "persistence", "loading") == 0)
    assert client.execute_command("KV.PUT", "ns", "aa", "", b"x" * 100) is not None
    assert client.execute_command("KV.GET", "ns", "aa") == b"x" * 100
    client.close()


def test_shutdown_while_warming_stops_and_removes_the_arena(gated: GatedServer) -> None:
    assert gated.touching.wait(30)
    arenas = [n for n in os.listdir("/dev/shm") if n in gated.arenas]
    assert arenas, "the arena exists while it is being warmed"
    with socket.create_connection(("127.0.0.1", gated.port)) as sock:
        sock.sendall(b"SHUTDOWN NOSAVE\r\n")
        _wait_for(lambda: gated.server.stopping)
        gated.gate.set()  # the step in flight finishes; the rest is skipped
        assert sock.recv(100) == b""  # closed without a reply, as Redis
    gated.thread.join(30)
    assert not gated.thread.is_alive() and not gated.errors
    left = [n for n in os.listdir("/dev/shm") if n in arenas]
    assert left == []


def test_shutdown_while_indexing_stops_without_a_store(indexing: GatedServer) -> None:
    assert indexing.touching.wait(30)
    with socket.create_connection(("127.0.0.1", indexing.port)) as sock:
        sock.sendall(b"SHUTDOWN NOSAVE\r\n")
        _wait_for(lambda: indexing.server.stopping)
        indexing.gate.set()
        assert sock.recv(100) == b""
    indexing.thread.join(30)
    assert not indexing.thread.is_alive() and not indexing.errors
    assert indexing.server.store is None


def test_kvstrata_client_waits_out_loading(indexing: GatedServer) -> None:
    """kvstrata's own client sends a command refused with -LOADING again until the server is
    ready (nothing was done by the refusal), within ``loading_timeout``; 0 raises at once."""
    from kvstrata.clients import AsyncClient, Client
    from kvstrata.protocol.errors import LoadingError

    assert indexing.touching.wait(30)
    probe = redis.Redis(port=indexing.port, retry_on_error=[])
    with Client(port=indexing.port, loading_timeout=0) as impatient, pytest.raises(LoadingError):
        impatient.match("ns", [b"aa"])
    done: list[Any] = []
    client = Client(port=indexing.port)  # (connecting works while loading: HELLO answers)
    writer = threading.Thread(target=lambda: done.append(client.put("ns", b"aa", None, b"y" * 64)))
    writer.start()

    async def aio_put() -> bool:
        async with await AsyncClient.connect(port=indexing.port) as aio:
            return await aio.put("ns", b"bb", None, b"z" * 64)

    aio_writer = threading.Thread(target=lambda: done.append(asyncio.run(aio_put())))
    aio_writer.start()

    def refusals() -> int:
        return int(probe.info("errorstats").get("errorstat_LOADING", {}).get("count", 0))

    _wait_for(lambda: refusals() >= 5)  # the impatient one's, then both puts', sent again
    assert writer.is_alive() and aio_writer.is_alive() and not done  # not given up, not answered
    indexing.gate.set()
    writer.join(30)
    aio_writer.join(30)
    assert done == [True, True], done
    assert client.get("ns", b"aa") == b"y" * 64 and client.get("ns", b"bb") == b"z" * 64
    client.close()
    probe.close()
