"""One client cannot make the server allocate what it did not send (issue 12, input side).

Each test runs the server as a subprocess and measures that process (VmRSS) while another
client keeps using it.
"""

from __future__ import annotations

import redis

from tests.overload import input_bytes, open_raw, ping_seconds, rss_bytes, wait_received

MiB = 1024 * 1024


def test_declared_bulk_costs_only_what_arrives(make_process_server) -> None:
    """Scenario: a client declares a 1 GiB ECHO argument, sends 64 KiB of it and stops. Redis
    grows its buffer as bytes arrive; the server must too (before: +1 GiB zero-filled)."""
    srv = make_process_server(dram_capacity="8MiB", nvme_capacity="0")
    assert srv.process is not None
    r = redis.Redis(port=srv.port)
    r.ping()
    before_rss = rss_bytes(srv.process.pid)
    before_in = input_bytes(r)
    head = b"*2\r\n$4\r\nECHO\r\n$1073741824\r\n" + b"x" * (64 * 1024)
    attacker = open_raw(srv.port, head)
    try:
        wait_received(r, before_in, len(head))
        grown = rss_bytes(srv.process.pid) - before_rss
        assert grown < 64 * MiB, f"RSS grew by {grown // MiB} MiB for 64 KiB received"
        assert ping_seconds(srv.port) < 0.5
    finally:
        attacker.close()


def test_large_echo_still_arrives_whole(server) -> None:
    """A bulk that crosses several growth steps comes back byte for byte."""
    r = redis.Redis(port=server.port)
    value = bytes(range(256)) * (5 * MiB // 256 + 7)
    assert r.echo(value) == value


def test_put_without_a_slot_costs_only_what_arrives(make_process_server) -> None:
    """Scenario: a KV.PUT whose payload fits no DRAM slot (512 MiB declared, 8 MiB arena) sends
    1 MiB and stalls: the server holds about that 1 MiB, not the declared size."""
    srv = make_process_server(dram_capacity="8MiB", nvme_capacity="0")
    assert srv.process is not None
    r = redis.Redis(port=srv.port)
    r.ping()
    before_rss = rss_bytes(srv.process.pid)
    before_in = input_bytes(r)
    head = b"*5\r\n$6\r\nKV.PUT\r\n$2\r\nns\r\n$1\r\nh\r\n$0\r\n\r\n$536870912\r\n" + b"y" * MiB
    attacker = open_raw(srv.port, head)
    try:
        wait_received(r, before_in, len(head))
        grown = rss_bytes(srv.process.pid) - before_rss
        assert grown < 64 * MiB, f"RSS grew by {grown // MiB} MiB for 1 MiB received"
    finally:
        attacker.close()
