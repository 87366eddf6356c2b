"""KV.* edge cases on the wire: reply buffers stay pinned until sent, MGET releases its pins,
pipelined uploads of one key cannot deadlock, and a client that sends a large pipeline before
reading its replies is not deadlocked by flow control."""

from __future__ import annotations

import socket
import time

import redis

from tests.conftest import RunningServer
from tests.fakes import cmd as resp

NS = "edge@u8@c4"
MiB = 1 << 20


def read_exactly(sock: socket.socket, n: int, timeout: float = 20) -> bytes:
    sock.settimeout(timeout)
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(1 << 20, n - len(data)))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def test_unsent_reply_keeps_its_chunk_pinned_after_quit(make_server) -> None:
    """Scenario: client A (tiny receive buffer) pipelines KV.GET of an 8 MiB chunk and QUIT,
    then stalls. Client B deletes the chunk and stores another 8 MiB chunk, which would reuse
    the freed slot. When A finally reads, its reply holds only the original bytes."""
    srv = make_server(dram_capacity="24MiB", nvme_capacity=0)
    r = redis.Redis(port=srv.port, socket_timeout=20)
    assert r.execute_command("KV.PUT", NS, b"k1", b"", b"A" * (8 * MiB)) == 1
    a = socket.socket()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.connect(("127.0.0.1", srv.port))
    a.sendall(resp(b"KV.GET", NS.encode(), b"k1") + resp(b"QUIT"))
    time.sleep(0.3)  # the server has queued the reply and closes after sending it
    assert r.execute_command("KV.DEL", NS, b"k1") == 1
    for i in range(2):
        assert r.execute_command("KV.PUT", NS, b"k%d" % (i + 2), b"", b"B" * (8 * MiB)) == 1
    header = b"$%d\r\n" % (8 * MiB)
    reply = read_exactly(a, len(header) + 8 * MiB + 2 + 5)
    a.close()
    assert reply[: len(header)] == header
    body = reply[len(header) : len(header) + 8 * MiB]
    assert body.count(b"A") == 8 * MiB
    assert reply.endswith(b"\r\n+OK\r\n")


def test_mget_releases_its_pins(server: RunningServer) -> None:
    """Scenario: KV.MGET of DRAM chunks, then KV.DEL and a new KV.PUT of the same key: the put
    answers (the MGET's pins were released, so the deleted record could be freed)."""
    r = redis.Redis(port=server.port, socket_timeout=10)
    payload = b"x" * 100_000
    assert r.execute_command("KV.PUT", NS, b"h1", b"", payload) == 1
    assert r.execute_command("KV.MGET", NS, b"h1", b"nope") == [payload, None]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # releases run once the reply left the transport
        info = r.execute_command("KV.INFO", NS, b"h1")
        if info[b"leases"] == 0:
            break
        time.sleep(0.05)
    assert r.execute_command("KV.DEL", NS, b"h1") == 1
    assert r.execute_command("KV.PUT", NS, b"h1", b"", b"y" * 100_000) == 1
    assert r.execute_command("KV.GET", NS, b"h1") == b"y" * 100_000


def test_pipelined_puts_of_one_key_do_not_deadlock(server: RunningServer) -> None:
    """Scenario: one send carries a small KV.PUT of a key followed by a 100 KB KV.PUT of the
    same key (whose payload is received into a slot before the first runs). Both answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            resp(b"KV.PUT", NS.encode(), b"same", b"", b"small")
            + resp(b"KV.PUT", NS.encode(), b"same", b"", b"L" * 100_000)
        )
        assert read_exactly(sock, 8, timeout=10) == b":1\r\n:1\r\n"
    r = redis.Redis(port=server.port, socket_timeout=10)
    assert r.execute_command("KV.GET", NS, b"same") == b"L" * 100_000


def test_send_everything_then_read_is_not_deadlocked(make_server) -> None:
    """Scenario: a client sends KV.GET of a 16 MiB chunk and then a 16 MiB KV.PUT without
    reading in between (as redis-py pipelines do). The server keeps receiving the upload while
    the first reply waits to be read, so both complete."""
    srv = make_server(dram_capacity="48MiB", nvme_capacity=0)
    r = redis.Redis(port=srv.port, socket_timeout=20)
    assert r.execute_command("KV.PUT", NS, b"g", b"", b"G" * (16 * MiB)) == 1
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(
            resp(b"KV.GET", NS.encode(), b"g")
            + resp(b"KV.PUT", NS.encode(), b"p", b"", b"P" * (16 * MiB))
        )
        header = b"$%d\r\n" % (16 * MiB)
        reply = read_exactly(sock, len(header) + 16 * MiB + 2 + 4)
    assert reply.startswith(header) and reply.endswith(b"\r\n:1\r\n")
    assert r.execute_command("KV.MATCH", NS, b"p") == 1
