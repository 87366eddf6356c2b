"""A client that does not read its zero-copy replies cannot pin DRAM for long (issue 22, item 3).

A ``KV.MGET``/``KV.GET`` reply is sent straight from the arena; the chunks stay pinned until the
transport has written them. With ``reply-pin-max`` 8 MiB and ``reply-pin-timeout`` 1 s: a
connection hands its socket at most 4 MiB of such a reply at a time; once its unsent replies
have pinned more than 8 MiB for a second, the part not handed yet is copied out of the arena
(the chunks may be evicted, the reader still gets every byte), and a client whose socket alone
still pins more than 8 MiB a second later is closed. Each test waits on the server's counters
(``INFO stats``), never on a clock.

The server runs in this process (a thread) with a 64 MiB arena and no NVMe.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import pytest
import redis

from tests.conftest import RunningServer
from tests.overload import wait_until

NS = "pins@u8@c16"
MiB = 1024 * 1024


@pytest.fixture
def srv(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(
        dram_capacity=str(64 * MiB), nvme_capacity="0", reply_pin_max="8MiB",
        reply_pin_timeout="1", write_wait_timeout="5000",
    )  # fmt: skip


@pytest.fixture
def r(srv: RunningServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(port=srv.port, protocol=3)
    yield conn
    conn.close()


def chunk(i: int, size: int = MiB) -> bytes:
    return bytes([i % 251]) * (size - 1) + bytes([i % 7])


def resp(*args: bytes) -> bytes:
    out = b"*%d\r\n" % len(args)
    for a in args:
        out += b"$%d\r\n%b\r\n" % (len(a), a)
    return out


def non_reader(port: int, command: bytes) -> socket.socket:
    """A client with a 4 KiB receive buffer that sends ``command`` and does not read yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(command)
    return sock


def read_bulks(f: Any, count: int | None) -> list[bytes]:
    """Read one reply from ``f`` (the socket's file): an array of ``count`` bulks, or one
    bulk (``count`` None)."""
    if count is not None:
        assert f.readline() == b"*%d\r\n" % count
    out = []
    for _ in range(1 if count is None else count):
        header = f.readline()
        assert header[:1] == b"$", header[:64]
        data = f.read(int(header[1:]) + 2)
        assert data[-2:] == b"\r\n"
        out.append(data[:-2])
    return out


def stat(r: redis.Redis, name: str) -> int:
    return int(r.info("stats")[name])


def put_and_lease(r: redis.Redis, h: bytes, data: bytes) -> None:
    """Another client's write and zero-copy read of it succeed, with its bytes."""
    assert r.execute_command("KV.PUT", NS, h, b"", data) == 1
    lease_id, handles = r.execute_command("KV.LEASE", NS, h, "TIER", "dram")
    assert lease_id is not None
    region, offset, length, _ = handles[0]
    paths = {reg[b"name"]: reg[b"path"] for reg in r.execute_command("KV.REGIONS")}
    shm = shared_memory.SharedMemory(name=paths[region].decode())
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    try:
        assert shm.buf is not None and bytes(shm.buf[offset : offset + length]) == data
    finally:
        shm.close()
    assert r.execute_command("KV.RELEASE", lease_id) == b"OK"


def test_an_unread_mget_is_copied_out_and_the_late_reader_gets_every_byte(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Scenario: 56 chunks of 1 MiB fill 56 of 64 MiB; a client with a 4 KiB receive buffer
    sends KV.MGET of all 56 and does not read. Once the server has copied the waiting part of
    the reply out of the arena (INFO reply_pin_copyouts), another client's 16 MiB KV.PUT and a
    KV.LEASE of it succeed with its bytes (DRAM evicts chunks the reply no longer pins); then
    the non-reader reads and gets all 56 chunks exactly."""
    hashes = [b"m%d" % i for i in range(56)]
    for i, h in enumerate(hashes):
        assert r.execute_command("KV.PUT", NS, h, b"", chunk(i)) == 1
    sock = non_reader(srv.port, resp(b"KV.MGET", NS.encode(), *hashes))
    try:
        wait_until(lambda: stat(r, "reply_pin_copyouts") >= 1, what="the reply to be copied out")
        assert stat(r, "reply_pin_copied_bytes") >= 40 * MiB
        put_and_lease(r, b"other", chunk(99, 16 * MiB))
        assert r.execute_command("KV.GET", NS, b"other") == chunk(99, 16 * MiB)
        f = sock.makefile("rb")
        got = read_bulks(f, 56)
        assert [g == chunk(i) for i, g in enumerate(got)] == [True] * 56
        sock.sendall(resp(b"PING"))
        assert f.readline() == b"+PONG\r\n"  # the connection goes on
    finally:
        sock.close()
    assert stat(r, "reply_pin_disconnections") == 0


def test_a_client_whose_socket_keeps_a_large_chunk_pinned_is_closed(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Scenario: a 32 MiB chunk is cached; a client with a 4 KiB receive buffer sends KV.GET
    of it and never reads. Its socket holds the first 4 MiB of the chunk, which pins all
    32 MiB; the rest is copied out after reply-pin-timeout, and one timeout later the client is
    closed (INFO reply_pin_disconnections). Then another client's 40 MiB KV.PUT (which needs
    the chunk evicted) and its lease succeed with their bytes."""
    assert r.execute_command("KV.PUT", NS, b"big", b"", chunk(5, 32 * MiB)) == 1
    sock = non_reader(srv.port, resp(b"KV.GET", NS.encode(), b"big"))
    try:
        wait_until(lambda: stat(r, "reply_pin_disconnections") >= 1, what="the client closed")
        assert stat(r, "reply_pin_copyouts") == 1
        wait_until(lambda: len(r.client_list()) == 1, what="the connection to be gone")
        put_and_lease(r, b"other", chunk(77, 40 * MiB))
    finally:
        sock.close()


def test_a_reply_within_the_window_is_not_touched(srv: RunningServer, r: redis.Redis) -> None:
    """Scenario: a non-reader's KV.GET of a 2 MiB chunk pins less than reply-pin-max: nothing
    is copied and the client is not closed; when it reads it gets the chunk. A pipelined burst
    of 12 such GETs (24 MiB, more than the window) is handed over as the client reads, in
    order, with every byte."""
    data: list[bytes] = []
    for i in range(12):
        data.append(chunk(40 + i, 2 * MiB))
        assert r.execute_command("KV.PUT", NS, b"w%d" % i, b"", data[-1]) == 1
    sock = non_reader(srv.port, resp(b"KV.GET", NS.encode(), b"w0"))
    try:
        info: dict[str, Any] = r.info("stats")
        f = sock.makefile("rb")
        assert read_bulks(f, None) == [data[0]]
        assert info["reply_pin_copyouts"] == 0 and info["reply_pin_disconnections"] == 0
        sock.sendall(b"".join(resp(b"KV.GET", NS.encode(), b"w%d" % i) for i in range(12)))
        for i in range(12):
            assert read_bulks(f, None) == [data[i]]
    finally:
        sock.close()
