"""The large-payload TCP path (issue 15): payloads split across many reads, checksums streamed
as they arrive, replies held back by a small send buffer, client reads into caller buffers."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest
import redis
import xxhash

from kvstrata.clients import Client
from kvstrata.clients.resp import HEADER_READ, READ_BUFFER, ReplyReader
from kvstrata.server.intake import Intake
from kvstrata.tiers.checksum import RunningChecksum, checksum
from tests.overload import input_bytes, wait_received, wait_until

MiB = 1024 * 1024
NS = "tcp@u8@c256"


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class _Sink:
    """A payload sink as the store's: a view to fill and ``received(filled)`` reports."""

    def __init__(self, nbytes: int) -> None:
        self.view = memoryview(bytearray(nbytes))
        self.reports: list[int] = []
        self.sum = RunningChecksum()

    def received(self, filled: int) -> None:
        self.reports.append(filled)
        self.sum.advance(self.view, filled)

    def abort(self) -> None:
        pass


@pytest.mark.parametrize("step", [1, 7, 4093, 65536, 1 << 20])
def test_intake_reports_a_sinks_progress_read_by_read(step: int) -> None:
    """A KV.PUT payload arriving in pieces of ``step`` bytes: the sink is told after every read
    how much of it is final, in order, up to its length, and the checksum folded in from those
    reports is the checksum of the whole payload (before: the sink was never told)."""
    payload = _payload(300_000 if step < 4093 else 3 * MiB + 5, seed=step)
    head = b"*4\r\n$6\r\nKV.PUT\r\n$2\r\nns\r\n$1\r\nh\r\n$%d\r\n" % len(payload)
    data = head + payload + b"\r\n*1\r\n$4\r\nPING\r\n"
    sinks: list[_Sink] = []

    def sink_for(args: list[Any], nbytes: int) -> _Sink:
        sinks.append(_Sink(nbytes))
        return sinks[-1]

    intake = Intake(sink_for)
    queue: list[Any] = []
    pos = 0
    while pos < len(data):
        room = intake.get_buffer(1 << 30)
        n = min(room.nbytes, step, len(data) - pos)
        room[:n] = data[pos : pos + n]
        del room
        pos += n
        if intake.received(n):
            while intake.decode(queue, 1 << 30, 1 << 20):
                pass
    (sink,) = sinks
    assert bytes(sink.view) == payload
    assert sink.reports == sorted(sink.reports) and sink.reports[-1] == len(payload)
    if step < len(payload):
        assert len(sink.reports) > 2  # folded in as it came, not in one pass at the end
    assert sink.sum.done == len(payload)
    assert sink.sum.digest(sink.view) == checksum(payload)
    assert [type(q).__name__ for q in queue] == ["WithSinks", "list"]


def test_running_checksum_is_the_checksum_whatever_was_reported() -> None:
    data = memoryview(_payload(1 << 20))
    for reports in ([], [0], [5, 5, 100], [1 << 20], [3, 70_000, 70_001, (1 << 20) - 1]):
        running = RunningChecksum()
        for filled in reports:
            running.advance(data, filled)
        assert running.digest(data) == xxhash.xxh3_128_digest(bytes(data))
        assert running.digest(data) == checksum(data)  # digest twice: same answer


def _put_in_pieces(port: int, r: redis.Redis, h: bytes, payload: bytes, pieces: int) -> None:
    """KV.PUT over a raw socket, each piece sent only once the server has read the last one."""
    head = b"*5\r\n$6\r\nKV.PUT\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$0\r\n\r\n$%d\r\n" % (
        len(NS), NS.encode(), len(h), h, len(payload)
    )  # fmt: skip
    wire = head + payload + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        step = len(wire) // pieces + 1
        for i in range(0, len(wire), step):
            before = input_bytes(r)
            sock.sendall(wire[i : i + step])
            wait_received(r, before, len(wire[i : i + step]))
        assert sock.recv(16) == b":1\r\n"


def test_payload_split_across_many_reads_is_stored_with_its_checksum(server) -> None:
    """Scenario: a 6 MiB KV.PUT arrives in 37 pieces, each read by the server before the next
    is sent. The chunk's recorded checksum (KV.INFO) is xxh3-128 of exactly the bytes sent,
    and KV.GET returns them."""
    r = redis.Redis(port=server.port)
    payload = _payload(6 * MiB + 11, seed=3)
    _put_in_pieces(server.port, r, b"split", payload, pieces=37)
    info = r.execute_command("KV.INFO", NS, b"split")
    info = dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info
    assert info[b"checksum"] == xxhash.xxh3_128_hexdigest(payload).encode()
    assert r.execute_command("KV.GET", NS, b"split") == payload


def test_loopback_clients_get_a_small_send_buffer(make_server) -> None:
    """A loopback connection's socket gets SO_SNDBUF = loopback-sndbuf (Linux doubles the
    value asked for); with 0 it keeps the kernel's autotuned buffer (larger here)."""
    for size in (96 * 1024, 0):
        srv = make_server(loopback_sndbuf=str(size))
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(16) == b"+PONG\r\n"
            (conn,) = srv.call(lambda: list(srv.server.clients.values()))  # noqa: B023
            got = srv.call(
                lambda c=conn: c.transport.get_extra_info("socket").getsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF
                )
            )
            assert got == 2 * size if size else got > 2 * 96 * 1024
        srv.stop()


def test_a_reply_held_in_the_send_buffer_keeps_its_chunk(server) -> None:
    """Scenario: a client asks for a 12 MiB chunk and does not read. With a small send buffer
    nearly all of the reply waits in the server's transport, pointing into the arena. Another
    client deletes the chunk and stores new chunks that reuse the arena; the reader then gets
    the original bytes exactly (the slot stays pinned until its reply is written)."""
    r = redis.Redis(port=server.port)
    original = _payload(12 * MiB, seed=5)
    r.execute_command("KV.PUT", NS, b"old", b"", original)
    want = b"$%d\r\n" % len(original) + original + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        slow.sendall(b"*3\r\n$6\r\nKV.GET\r\n$%d\r\n%b\r\n$3\r\nold\r\n" % (len(NS), NS.encode()))
        got = bytearray()
        while b"\r\n" not in got:  # the reply has begun: the GET ran before the delete below
            part = slow.recv(64)
            assert part, "server closed the connection"
            got += part
        wait_until(lambda: r.execute_command("KV.DEL", NS, b"old") == 1, what="the delete")
        for i in range(6):  # 6 × 12 MiB through a 64 MiB arena: the freed space is reused
            r.execute_command("KV.PUT", NS, b"new%d" % i, b"", bytes([i]) * (12 * MiB))
        while len(got) < len(want):
            part = slow.recv(1 << 20)
            assert part, "server closed the connection"
            got += part
    assert got == want


def test_client_reads_only_a_header_ahead_of_a_bulk_bound_for_out() -> None:
    """While a reply with a caller buffer is expected, the reader offers at most HEADER_READ
    bytes of its own buffer, so at most that much of the payload is copied into ``out``
    afterwards (before: up to READ_BUFFER); replies without one still get the whole buffer."""
    outs: list[Any] = [bytearray(MiB)]
    reader = ReplyReader(lambda _v: outs.pop(0), lambda: outs[0] if outs else None)
    assert reader.get_buffer().nbytes == HEADER_READ
    outs[0] = None
    assert reader.get_buffer().nbytes == READ_BUFFER
    outs[0] = [bytearray(10), bytearray(MiB)]  # KV.MGET: inside the array too
    first = reader.get_buffer()
    first[:4] = b"*2\r\n"
    del first
    reader.buffer_updated(4)
    assert reader.get_buffer().nbytes <= HEADER_READ


def test_client_get_and_mget_into_buffers_are_exact(server) -> None:
    payloads = [_payload(n, seed=n) for n in (70_000, 3 * MiB + 1, 1)]
    with Client(port=server.port) as kv:
        for i, p in enumerate(payloads):
            kv.put(NS, b"c%d" % i, None, p)
        outs = [bytearray(len(p) + 3) for p in payloads]
        got = kv.mget(NS, [b"c0", b"c1", b"missing", b"c2"], outs=[*outs[:2], None, outs[2]])
        assert [None if g is None else bytes(g) for g in got] == [*payloads[:2], None, payloads[2]]
        for i, p in enumerate(payloads):
            out = np.zeros(len(p) + 8, dtype=np.uint8)
            assert bytes(kv.get(NS, b"c%d" % i, out=out)) == p
            assert not out[len(p) :].any()
