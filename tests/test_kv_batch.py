"""KV.MRESERVE (batched zero-copy writes) over the wire: redis-py and raw RESP against a server on
port 0. A batch is one write lease over the slots of a chain's chunks; KV.COMMIT publishes them
all (only then are they visible), KV.ABORT or expiry frees them all, an expired batch whose
holder is still connected is fenced like a single reservation.

The server runs in this process (a thread) with a 4 MiB arena, no NVMe, watermarks at 1.0.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.conftest import RunningServer
from tests.fakes import wait_for, write_slot

NS = "batch@u8@c16"
KiB = 1024
ARENA = 4096 * KiB


@pytest.fixture
def srv(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(
        dram_capacity=str(ARENA), nvme_capacity="0", write_wait_timeout="200",
        dram_high_watermark="1.0", dram_low_watermark="1.0",
    )  # fmt: skip


@pytest.fixture
def r(srv: RunningServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(port=srv.port, protocol=3)
    yield conn
    conn.close()


def info(r: redis.Redis) -> dict[str, Any]:
    return dict(r.info("tiers"))


def test_batch_is_visible_only_after_commit_and_keeps_the_chain(r: redis.Redis) -> None:
    """Scenario: three chunks of a chain under parent P are reserved in one command (one lease),
    written through the shared arena; before KV.COMMIT nothing of them matches or reads; after
    it all three read back exactly, match as a chain after P, carry TOKENS and their links."""
    assert r.execute_command("KV.PUT", NS, b"P", b"", b"p" * 100) == 1
    lease_id, entries = r.execute_command(
        "KV.MRESERVE", NS, b"P", 3, b"a", 1000, b"b", 2000, b"c", 3000, "TOKENS", 16
    )
    assert len(entries) == 3 and [e[2] for e in entries] == [1000, 2000, 3000]
    assert len({(e[0], e[1]) for e in entries}) == 3  # three distinct slots
    assert info(r)["kv_leases"] == 1  # one lease for the batch
    for e, ch in zip(entries, b"abc", strict=True):
        write_slot(r, e, bytes([ch]) * e[2])
    assert r.execute_command("KV.MATCH", NS, b"P", b"a", b"b", b"c") == 1
    assert r.execute_command("KV.MGET", NS, b"a", b"b", b"c") == [None, None, None]
    assert r.execute_command("KV.COMMIT", lease_id) == b"OK"
    assert r.execute_command("KV.MATCH", NS, b"P", b"a", b"b", b"c") == 4
    assert r.execute_command("KV.MGET", NS, b"a", b"b", b"c") == [
        b"a" * 1000, b"b" * 2000, b"c" * 3000,
    ]  # fmt: skip
    meta = r.execute_command("KV.INFO", NS, b"b")
    assert meta[b"parent"] == b"a".hex().encode() and meta[b"tokens"] == 16
    assert r.execute_command("KV.INFO", NS, b"a")[b"parent"] == b"P".hex().encode()
    assert info(r)["kv_leases"] == 0
    with pytest.raises(redis.ResponseError, match="no such lease"):
        r.execute_command("KV.COMMIT", lease_id)


def test_raw_resp2_reply_shape(srv: RunningServer, r: redis.Redis) -> None:
    """On a RESP2 connection the reply is a 2-array: the lease id, then per chunk a 4-array
    handle or the simple string exists; a batch of stored chunks only has a null lease."""
    r.execute_command("KV.PUT", NS, b"x", b"", b"x" * 10)
    with socket.create_connection((srv.host, srv.port), timeout=10) as s:
        s.sendall(b"*8\r\n$11\r\nKV.MRESERVE\r\n$12\r\n" + NS.encode() + b"\r\n$0\r\n\r\n"
                  b"$1\r\n2\r\n$1\r\nx\r\n$2\r\n10\r\n$1\r\ny\r\n$2\r\n20\r\n")  # fmt: skip
        got = b""
        while not got.endswith(b"\r\n") or got.count(b"\r\n") < 12:
            got += s.recv(65536)
        assert got.startswith(b"*2\r\n$16\r\n")
        assert b"*2\r\n+exists\r\n*4\r\n$5\r\ndram0\r\n:" in got
        assert b":20\r\n" in got
        s.sendall(b"*6\r\n$11\r\nKV.MRESERVE\r\n$12\r\n" + NS.encode() + b"\r\n$0\r\n\r\n"
                  b"$1\r\n1\r\n$1\r\nx\r\n$2\r\n10\r\n")  # fmt: skip
        reply = b""
        while not reply.endswith(b"+exists\r\n"):
            reply += s.recv(65536)
        assert reply == b"*2\r\n$-1\r\n*1\r\n+exists\r\n"
    assert r.execute_command("KV.GET", NS, b"y") is None  # reserved, never committed
    with pytest.raises(redis.ResponseError, match=r"^NOLEASE no such lease"):
        r.execute_command("KV.ABORT", got[9:25])  # the lease was that socket's, not r's
    assert info(r)["kv_leases"] == 1  # left to its TTL


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((NS, b""), "wrong number of arguments"),
        ((NS, b"", 1, b"a"), "wrong number of arguments"),
        ((NS, b"", 2, b"a", 10), "count is 2 but only 1"),
        ((NS, b"", 0, b"a", 10), "invalid count"),
        ((NS, b"", "x", b"a", 10), "invalid count"),
        ((NS, b"", 2, b"a", 10, b"a", 20), "duplicate hash"),
        ((NS, b"b", 2, b"a", 10, b"b", 20), "loop back"),
        ((NS, b"a", 1, b"a", 10), "loop back"),
        ((NS, b"", 1, b"a", 0), "invalid nbytes"),
        ((NS, b"", 1, b"a", "ten"), "invalid nbytes"),
        ((NS, b"", 1, b"", 10), "invalid hash"),
        ((NS, b"", 2, b"a", ARENA, b"b", 1), "the batch needs"),
        ((NS, b"", 1, b"a", 10, "BOGUS", 1), "unknown option"),
        ((NS, b"", 1, b"a", 10, "TIER", "nvme"), "invalid TIER"),
        ((NS, b"", 1, b"a", 10, "TTL", 0), "invalid TTL"),
        (("bad ns\n", b"", 1, b"a", 10), "namespace"),
    ],
)
def test_bad_input_is_an_error_and_reserves_nothing(
    r: redis.Redis, args: tuple[Any, ...], message: str
) -> None:
    with pytest.raises(redis.ResponseError, match=message):
        r.execute_command("KV.MRESERVE", *args)
    stats = info(r)
    assert stats["kv_leases"] == 0 and stats["dram_used"] == 0
    # nothing stays claimed: the same chunks can be reserved at once
    lease_id, _ = r.execute_command("KV.MRESERVE", NS, b"", 2, b"a", 10, b"b", 10)
    r.execute_command("KV.ABORT", lease_id)


def test_more_chunks_than_max_chain_chunks(r: redis.Redis) -> None:
    r.config_set("max-chain-chunks", 2)
    with pytest.raises(redis.ResponseError, match="too many chunks"):
        r.execute_command("KV.MRESERVE", NS, b"", 3, b"a", 1, b"b", 1, b"c", 1)


def test_stored_and_busy_chunks_get_no_slot(srv: RunningServer, r: redis.Redis) -> None:
    """A chunk stored already is reported exists, one another connection is writing (its
    KV.RESERVE is open) busy; only the others get slots, and committing the batch publishes
    those while the other writer's chunk stays its own."""
    r.execute_command("KV.PUT", NS, b"a", b"", b"A" * 10)
    other = redis.Redis(port=srv.port)
    wid, _ = other.execute_command("KV.RESERVE", NS, b"b", b"a", 10)
    lease_id, entries = r.execute_command("KV.MRESERVE", NS, b"", 3, b"a", 10, b"b", 10, b"c", 10)
    assert entries[0] == b"exists" and entries[1] == b"busy" and entries[2][2] == 10
    write_slot(r, entries[2], b"C" * 10)
    r.execute_command("KV.COMMIT", lease_id)
    assert r.execute_command("KV.INFO", NS, b"c")[b"parent"] == b"b".hex().encode()
    assert r.execute_command("KV.GET", NS, b"b") is None  # still the other writer's
    other.execute_command("KV.ABORT", wid)
    other.close()


def test_a_batch_counts_as_one_lease_against_the_limits(srv: RunningServer, r: redis.Redis) -> None:
    r.config_set("lease-max-per-client", 1)
    lease_id, _ = r.execute_command("KV.MRESERVE", NS, b"", 3, b"a", 10, b"b", 10, b"c", 10)
    with pytest.raises(redis.ResponseError, match="lease-max-per-client"):
        r.execute_command("KV.MRESERVE", NS, b"", 1, b"d", 10)
    with pytest.raises(redis.ResponseError, match="lease-max-per-client"):
        r.execute_command("KV.RESERVE", NS, b"d", b"", 10)
    r.execute_command("KV.ABORT", lease_id)
    stats = info(r)
    assert stats["kv_leases"] == 0 and stats["dram_used"] == 0
    lease_id, _ = r.execute_command("KV.MRESERVE", NS, b"", 1, b"d", 10)
    r.execute_command("KV.ABORT", lease_id)


def test_oom_part_way_frees_every_slot_of_the_batch(r: redis.Redis) -> None:
    """All or nothing: with 3 MiB of the 4 MiB arena pinned by a read lease, a batch of two
    768 KiB chunks cannot get both slots: -OOM (refused before the first slot is made, since
    the leased chunk cannot leave), and no slot or claim is left behind."""
    r.execute_command("KV.PUT", NS, b"big", b"", b"z" * (3 * 1024 * KiB))
    read_id, _ = r.execute_command("KV.LEASE", NS, b"big")
    with pytest.raises(redis.exceptions.OutOfMemoryError, match="nothing was evicted"):
        r.execute_command("KV.MRESERVE", NS, b"", 2, b"a", 768 * KiB, b"b", 768 * KiB)
    stats = info(r)
    assert stats["kv_leases"] == 1 and stats["dram_used"] == 3 * 1024 * KiB
    wid, _ = r.execute_command("KV.RESERVE", NS, b"a", b"", 768 * KiB)  # not left claimed
    r.execute_command("KV.ABORT", wid)
    r.execute_command("KV.RELEASE", read_id)


def test_abort_release_and_unknown_ids(r: redis.Redis) -> None:
    lease_id, _ = r.execute_command("KV.MRESERVE", NS, b"", 2, b"a", 100, b"b", 100)
    with pytest.raises(redis.ResponseError, match="write lease"):
        r.execute_command("KV.RELEASE", lease_id)
    assert info(r)["dram_used"] == 8 * KiB
    assert r.execute_command("KV.ABORT", lease_id) == b"OK"
    stats = info(r)
    assert stats["kv_leases"] == 0 and stats["dram_used"] == 0
    assert r.execute_command("KV.MATCH", NS, b"a", b"b") == 0
    for verb in ("KV.COMMIT", "KV.ABORT"):
        with pytest.raises(redis.ResponseError, match="no such lease"):
            r.execute_command(verb, lease_id)
        with pytest.raises(redis.ResponseError, match="no such lease"):
            r.execute_command(verb, "0123456789abcdef")


def test_expired_batch_of_a_gone_client_frees_everything(
    srv: RunningServer, r: redis.Redis
) -> None:
    """A batch reserved with a 100 ms TTL by a client that disconnects is ended by the sweeper:
    no lease, no fence, no used byte, nothing visible; the chunks can be reserved again."""
    gone = redis.Redis(port=srv.port)
    gone.execute_command("KV.MRESERVE", NS, b"", 3, b"a", 100, b"b", 100, b"c", 100, "TTL", 100)
    gone.close()
    assert wait_for(lambda: info(r)["kv_leases"] == 0)
    stats = info(r)
    assert stats["kv_fenced_bytes"] == 0 and stats["dram_used"] == 0
    assert r.execute_command("KV.MATCH", NS, b"a") == 0
    lease_id, entries = r.execute_command("KV.MRESERVE", NS, b"", 1, b"a", 100)
    assert entries[0][2] == 100
    r.execute_command("KV.ABORT", lease_id)


def test_expired_batch_of_a_connected_writer_is_fenced_and_never_committed(
    r: redis.Redis,
) -> None:
    """A writer still connected when its batch expires may still write into the slots: all of
    them stay fenced (not reused), its late KV.COMMIT is refused (-NOLEASE … expired) and
    publishes nothing, and that ends the fence."""
    lease_id, entries = r.execute_command(
        "KV.MRESERVE", NS, b"", 2, b"a", 5000, b"b", 5000, "TTL", 100
    )
    assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
    assert info(r)["kv_fenced_bytes"] == 2 * 5000
    write_slot(r, entries[0], b"L" * 5000)  # the late writer
    with pytest.raises(redis.ResponseError, match="expired"):
        r.execute_command("KV.COMMIT", lease_id)
    assert r.execute_command("KV.MGET", NS, b"a", b"b") == [None, None]
    stats = info(r)
    assert stats["kv_fenced_bytes"] == 0 and stats["dram_used"] == 0


def test_commit_of_named_chunks_publishes_them_one_by_one(r: redis.Redis) -> None:
    """KV.COMMIT lease index… publishes only the chunks named (by request position) and leaves
    the others reserved and invisible; naming one twice, one without a slot or one out of range
    is an error that changes nothing; the lease ends with its last chunk."""
    r.execute_command("KV.PUT", NS, b"a", b"", b"A" * 10)
    lease_id, entries = r.execute_command(
        "KV.MRESERVE", NS, b"", 4, b"a", 10, b"b", 10, b"c", 10, b"d", 10
    )
    assert entries[0] == b"exists"
    for e, ch in zip(entries[1:], b"bcd", strict=True):
        write_slot(r, e, bytes([ch]) * 10)
    assert r.execute_command("KV.COMMIT", lease_id, 2) == b"OK"
    assert r.execute_command("KV.MGET", NS, b"b", b"c", b"d") == [None, b"c" * 10, None]
    assert r.execute_command("KV.INFO", NS, b"c")[b"parent"] == b"b".hex().encode()
    for bad in (2, 0, 9, -1, "x"):
        with pytest.raises(redis.ResponseError, match=r"no reserved slot|invalid index"):
            r.execute_command("KV.COMMIT", lease_id, bad)
    assert info(r)["kv_leases"] == 1 and info(r)["kv_leased_bytes"] == 20
    assert r.execute_command("KV.COMMIT", lease_id, 3, 1) == b"OK"
    assert r.execute_command("KV.MATCH", NS, b"a", b"b", b"c", b"d") == 4
    assert info(r)["kv_leases"] == 0
    with pytest.raises(redis.ResponseError, match="no such lease"):
        r.execute_command("KV.COMMIT", lease_id)
    wid, _ = r.execute_command("KV.RESERVE", NS, b"e", b"d", 10)
    with pytest.raises(redis.ResponseError, match="takes no index"):
        r.execute_command("KV.COMMIT", wid, 0)
    r.execute_command("KV.ABORT", wid)


def test_abort_and_expiry_after_some_chunks_were_published(r: redis.Redis) -> None:
    """Chunks published one by one stay stored; KV.ABORT (or expiry, fenced while the holder is
    connected) discards only the ones left, and frees their slots."""
    lease_id, entries = r.execute_command("KV.MRESERVE", NS, b"", 3, b"a", 10, b"b", 10, b"c", 10)
    write_slot(r, entries[0], b"A" * 10)
    r.execute_command("KV.COMMIT", lease_id, 0)
    r.execute_command("KV.ABORT", lease_id)
    assert r.execute_command("KV.MGET", NS, b"a", b"b", b"c") == [b"A" * 10, None, None]
    assert info(r)["dram_used"] == 4 * KiB and info(r)["kv_leases"] == 0
    lease_id, entries = r.execute_command(
        "KV.MRESERVE", NS, b"a", 2, b"b", 5000, b"c", 5000, "TTL", 100
    )
    write_slot(r, entries[0], b"B" * 5000)
    r.execute_command("KV.COMMIT", lease_id, 0)
    assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
    assert info(r)["kv_fenced_bytes"] == 5000  # only the slot still reserved
    with pytest.raises(redis.ResponseError, match="expired"):
        r.execute_command("KV.COMMIT", lease_id, 1)
    assert r.execute_command("KV.MGET", NS, b"b", b"c") == [b"B" * 5000, None]
    assert info(r)["kv_fenced_bytes"] == 0
