"""A stalled upload neither blocks other writers nor holds its slot forever (issue 12)."""

from __future__ import annotations

import time

import redis

from tests.overload import closed_by_peer, input_bytes, open_raw, wait_received, wait_until

MiB = 1024 * 1024


def _put_head(h: bytes, declared: int) -> bytes:
    return b"*5\r\n$6\r\nKV.PUT\r\n$2\r\nns\r\n$%d\r\n%b\r\n$0\r\n\r\n$%d\r\n" % (
        len(h),
        h,
        declared,
    )


def _dram_used(r: redis.Redis) -> int:
    return int(r.execute_command("KV.STATS")[b"dram"][b"used"])


def test_stalled_upload_of_almost_the_arena_does_not_block_writers(make_server) -> None:
    """Scenario: 64 MiB DRAM, no NVMe; a client starts a KV.PUT of 60 MiB, sends 1 MiB and
    stalls. Others still store 8 MiB chunks (before: its slot held the arena, they got -OOM
    until it disconnected)."""
    srv = make_server(nvme_capacity="0")
    r = redis.Redis(port=srv.port)
    before = input_bytes(r)
    head = _put_head(b"big", 60 * MiB) + b"z" * MiB
    attacker = open_raw(srv.port, head)
    try:
        wait_received(r, before, len(head))
        for i in range(3):
            assert r.execute_command("KV.PUT", "ns", b"c%d" % i, b"", b"p" * (8 * MiB)) == 1
    finally:
        attacker.close()


def test_payload_timeout_closes_a_stalled_upload_and_frees_its_slot(make_server) -> None:
    """Scenario: payload-timeout 1; a KV.PUT of 16 MiB (received in place into a DRAM slot)
    stops after 1 MiB. After about a second the server closes it and frees the slot."""
    srv = make_server(nvme_capacity="0", payload_timeout="1")
    r = redis.Redis(port=srv.port)
    attacker = open_raw(srv.port, _put_head(b"slow", 16 * MiB) + b"z" * MiB)
    started = time.monotonic()
    try:
        wait_until(lambda: _dram_used(r) >= 16 * MiB, what="the upload's slot")
        assert closed_by_peer(attacker, timeout=30)
        assert time.monotonic() - started >= 1.0
        wait_until(lambda: _dram_used(r) == 0, what="the slot to be freed")
        assert r.execute_command("KV.GET", "ns", b"slow") is None
    finally:
        attacker.close()


def test_a_slow_upload_that_progresses_is_not_cut(make_server) -> None:
    """payload-timeout is about progress, not total time: an upload sent in pieces over more
    than the timeout completes."""
    srv = make_server(nvme_capacity="0", payload_timeout="1")
    r = redis.Redis(port=srv.port)
    sock = open_raw(srv.port, _put_head(b"steady", 4 * MiB))
    before = input_bytes(r)
    started, sent = time.monotonic(), 0
    while time.monotonic() - started < 2.5 or sent < 4 * MiB:
        piece = min(256 * 1024, 4 * MiB - sent)
        if piece:
            sock.sendall(b"s" * piece)
            sent += piece
            wait_received(r, before, sent)
        time.sleep(0.2)  # pacing the upload (well inside the timeout), not synchronisation
    sock.sendall(b"\r\n")
    assert sock.recv(16) == b":1\r\n"
    sock.close()
    assert len(r.execute_command("KV.GET", "ns", b"steady")) == 4 * MiB
