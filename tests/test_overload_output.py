"""Clients that do not read their replies (issue 12, output side).

Zero-copy replies stay pinned until the transport has written them; that is now learned from
the transport's own events, not from a timer per connection, and Redis's
``client-output-buffer-limit`` closes a client that does not read (releasing its pins). Each
test measures the server process.
"""

from __future__ import annotations

import socket
import time

import redis

from tests.overload import (
    idle_window,
    rss_bytes,
    wait_until,
)

MiB = 1024 * 1024
NS = "ns"
H = b"\x11" * 32


def _non_reader(port: int, data: bytes) -> socket.socket:
    """A client with a tiny receive buffer that sends ``data`` and then never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def _get_cmd() -> bytes:
    return b"*3\r\n$6\r\nKV.GET\r\n$2\r\nns\r\n$32\r\n" + H + b"\r\n"


def _put_chunk(r: redis.Redis, size: int) -> None:
    assert r.execute_command("KV.PUT", NS, H, b"", b"c" * size) == 1


def _output_bytes(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def _accepted(r: redis.Redis) -> int:
    return int(r.info("stats")["total_connections_received"])


def _wait_closed(r: redis.Redis, accepted_before: int) -> None:
    """Wait until the server accepted the client opened after ``accepted_before`` was read and
    then closed it (only ``r`` is left)."""
    wait_until(lambda: _accepted(r) > accepted_before, what="the client to be accepted")
    wait_until(lambda: len(r.client_list()) == 1, what="the non-reader to be closed")


def _dram_used(r: redis.Redis) -> int:
    stats = r.execute_command("KV.STATS")
    return int(stats[b"dram"][b"used"])


def test_idle_server_with_200_non_reading_clients_stays_idle(make_process_server) -> None:
    """Scenario: 200 clients each ask for a 4 MiB chunk and never read. Before, each re-armed
    a 0.5 ms timer until it read (an idle server at ~90% CPU)."""
    srv = make_process_server(dram_capacity="32MiB", nvme_capacity="0")
    assert srv.process is not None
    r = redis.Redis(port=srv.port, protocol=3)
    _put_chunk(r, 4 * MiB)
    before = _output_bytes(r)
    socks = [_non_reader(srv.port, _get_cmd()) for _ in range(200)]
    try:
        wait_until(lambda: _output_bytes(r) - before >= 200 * 4 * MiB, what="200 replies")
        share, worst = idle_window(srv.process.pid, srv.port)
        assert share < 0.10, f"idle server used {share:.0%} of a core"
        assert worst < 0.5, f"PING took {worst * 1000:.0f} ms"
    finally:
        for s in socks:
            s.close()


def test_output_hard_limit_closes_a_non_reader_and_releases_its_pins(make_process_server) -> None:
    """Scenario: ``normal 2MiB 0 0``; a client asks for a 16 MiB chunk and never reads (the
    kernel's socket buffers take a few MiB of it). It is closed, and the chunk it pinned is
    freed once deleted (before: pinned until it read)."""
    srv = make_process_server(
        "--client-output-buffer-limit", "normal 2MiB 0 0", dram_capacity="32MiB",
        nvme_capacity="0",
    )  # fmt: skip
    r = redis.Redis(port=srv.port, protocol=3)
    _put_chunk(r, 16 * MiB)
    accepted = _accepted(r)
    sock = _non_reader(srv.port, _get_cmd())
    try:
        _wait_closed(r, accepted)
        assert r.info("stats")["client_output_buffer_limit_disconnections"] == 1
        assert r.execute_command("KV.DEL", NS, H) == 1
        wait_until(lambda: _dram_used(r) == 0, what="its pinned slot to be freed")
    finally:
        sock.close()


def test_output_soft_limit_closes_after_its_seconds(make_process_server) -> None:
    """``normal 0 1MiB 2``: over the soft limit for more than 2 s is closed; a client
    that reads its reply is not."""
    srv = make_process_server(
        "--client-output-buffer-limit", "normal 0 1MiB 2", dram_capacity="32MiB",
        nvme_capacity="0",
    )  # fmt: skip
    r = redis.Redis(port=srv.port, protocol=3)
    _put_chunk(r, 16 * MiB)
    assert len(r.execute_command("KV.GET", NS, H)) == 16 * MiB  # a reader is fine
    accepted = _accepted(r)
    started = time.monotonic()
    sock = _non_reader(srv.port, _get_cmd())
    try:
        _wait_closed(r, accepted)
        assert time.monotonic() - started > 2.0
    finally:
        sock.close()


def test_monitor_that_never_reads_is_closed(make_process_server) -> None:
    """Scenario: a MONITOR client never reads while another client sends ~100 MiB worth of
    monitor lines. The default monitor limit (32 MiB hard) closes it; before, its output was
    buffered without limit (RSS grew by more than the traffic)."""
    srv = make_process_server(dram_capacity="8MiB", nvme_capacity="0")
    assert srv.process is not None
    r = redis.Redis(port=srv.port)
    mon = _non_reader(srv.port, b"MONITOR\r\n")
    try:
        wait_until(lambda: any("O" in c["flags"] for c in r.client_list()), what="MONITOR")
        before = rss_bytes(srv.process.pid)
        value = b"\x01" * 4000  # each monitor line quotes it as 16 000 bytes
        closed = False
        for _ in range(15):  # at most 15 × 7.5 MiB... closed long before with the limit
            pipe = r.pipeline(transaction=False)
            for _ in range(500):
                pipe.set("k", value)
            pipe.execute()
            if not any("O" in c["flags"] for c in r.client_list()):
                closed = True
                break
        grown = rss_bytes(srv.process.pid) - before
        assert closed, f"the monitor was not closed (RSS +{grown // MiB} MiB)"
        assert grown < 80 * MiB, f"RSS grew by {grown // MiB} MiB"
    finally:
        mon.close()


def test_config_get_and_set_output_limits(server) -> None:
    r = redis.Redis(port=server.port, decode_responses=True)
    got = r.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
    assert got.startswith("normal 0 0 0 monitor 33554432 8388608 60")
    r.config_set("client-output-buffer-limit", "normal 10MiB 5MiB 10")
    got = r.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
    assert got.startswith("normal 10485760 5242880 10 monitor 33554432 8388608 60")
    try:
        r.config_set("client-output-buffer-limit", "normal 1 2")
    except redis.ResponseError as exc:
        assert "client-output-buffer-limit" in str(exc)
    else:
        raise AssertionError("a malformed limit was accepted")


def test_tls_replies_release_their_pins(make_server, tmp_path) -> None:
    """Over TLS too, a zero-copy reply's chunk is unpinned once the transport took it: after
    KV.DEL its DRAM slot is freed."""
    from tests.conftest import free_port
    from tests.test_server_core import _self_signed

    cert, key = _self_signed(tmp_path)
    srv = make_server(tls_port=free_port(), tls_cert_file=cert, tls_key_file=key)
    r = redis.Redis(port=srv.server.tls_port, ssl=True, ssl_ca_certs=str(cert), protocol=3)
    payload = bytes(range(256)) * (8 * MiB // 256)
    assert r.execute_command("KV.PUT", NS, H, b"", payload) == 1
    for _ in range(3):
        assert r.execute_command("KV.GET", NS, H) == payload
    assert r.execute_command("KV.DEL", NS, H) == 1
    wait_until(lambda: _dram_used(r) == 0, what="the slot to be freed")
