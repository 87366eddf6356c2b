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


def test_trickled_multibulk_is_scanned_once(monkeypatch) -> None:
    """Scenario: a command of 200k small arguments arrives 64 KiB at a time. The bytes given
    to the scanner stay proportional to the command (before: it rescanned the command from its
    start on every arrival, quadratic work on the event loop), and it decodes exactly."""
    from kvstrata.protocol import decoder
    from kvstrata.server.intake import Intake

    scanned = [0]
    real = decoder.parse_requests

    def counting(buf, pos, end, *rest):  # type: ignore[no-untyped-def]
        scanned[0] += end - pos
        return real(buf, pos, end, *rest)

    monkeypatch.setattr(decoder, "parse_requests", counting)
    args = [b"KV.MATCH", b"ns", *(b"h%07d" % i for i in range(200_000))]
    args[100_000] = bytes(range(256)) * 400  # a large argument in the middle lands in place
    data = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)
    data += b"*1\r\n$4\r\nPING\r\n"
    intake = Intake(lambda _args, _n: None)
    queue: list = []
    for i in range(0, len(data), 65536):
        piece = data[i : i + 65536]
        while piece:
            room = intake.get_buffer(1 << 30)
            n = min(len(room), len(piece))
            room[:n] = piece[:n]
            piece = piece[n:]
            del room
            if intake.received(n):
                while intake.decode(queue, 1 << 30, 1 << 20) or intake.yielded:
                    pass  # (the connection calls again on the next turn of the loop)
            intake.compact()
    decoded = [q if isinstance(q, list) else q.args for q in queue]
    assert [[bytes(a) for a in cmd] for cmd in decoded] == [args, [b"PING"]]
    assert scanned[0] < 4 * len(data), f"scanned {scanned[0]} bytes for {len(data)}"
