"""Batched write leases fenced per slot, and leases bound to their connection (issue 22, items
1 and 2), over the wire, through the client API and raw commands.

The server runs in this process (a thread), with the 4 MiB arena of 16 slots of 256 KiB of
``test_lease_fencing`` (no NVMe, watermarks at 1.0): filling it puts a live chunk into every slot
that is free, so a slot freed under a holder that still writes is another chunk's at once, and
that chunk's bytes show it. Expiry is always the server's decision: the tests either wait until
INFO reports the lease fenced (the sweeper got there), or stop the sweeper and move the lease
table's clock past the deadline (a command of the holder finds it expired first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from kvstrata.clients import Client, LeaseError
from tests.conftest import RunningServer
from tests.fakes import wait_for

NS = "bfence@u8@c16"
SLOT = 256 * 1024
SLOTS = 16
HASHES = [b"B0", b"B1", b"B2"]
UNKNOWN = "0123456789abcdef"


def content(i: int) -> bytes:
    """Chunk ``i``'s bytes: every byte names the chunk, so a foreign byte is visible."""
    return bytes([i % 251 + 1]) * SLOT


def key(i: int) -> bytes:
    return b"c%04d" % i


def info(r: redis.Redis) -> dict[str, int]:
    return {k: v for k, v in r.info("tiers").items() if isinstance(v, int)}


@pytest.fixture
def srv(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(
        dram_capacity=f"{SLOTS * SLOT}", nvme_capacity="0",
        dram_high_watermark="1.0", dram_low_watermark="1.0",
    )  # fmt: skip


@pytest.fixture
def r(srv: RunningServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(port=srv.port)
    yield conn
    conn.close()


def fill(r: redis.Redis, first: int = 1, count: int = 2 * SLOTS) -> None:
    """Another client puts chunks ``first …``: more than the arena holds, so it ends full."""
    for i in range(first, first + count):
        assert r.execute_command("KV.PUT", NS, key(i), b"", content(i)) == 1


def check_present(r: redis.Redis, first: int = 1, count: int = 2 * SLOTS) -> int:
    """Every chunk still stored has exactly its own bytes; returns how many are stored."""
    found = 0
    for i in range(first, first + count):
        got = r.execute_command("KV.GET", NS, key(i))
        if got is not None:
            assert got == content(i), f"chunk {i} holds foreign bytes"
            found += 1
    return found


def no_batch_chunk(r: redis.Redis) -> bool:
    return all(r.execute_command("KV.GET", NS, h) is None for h in HASHES)


def server_clock(srv: RunningServer) -> list[float]:
    """Make the lease table's clock ``monotonic() + offset[0]`` and return ``offset``."""
    offset = [0.0]
    leases = srv.server.store.state.leases
    srv.call(lambda: setattr(leases, "clock", lambda: time.monotonic() + offset[0]))
    return offset


def stop_sweeper(srv: RunningServer) -> None:
    """Cancel the store's lease sweeper: an expired lease stays in the table until a command
    of its holder finds it."""

    def cancel() -> None:
        for task in srv.server.store._background:
            if task.get_name() == "kv lease sweeper":
                task.cancel()

    srv.call(cancel)


def test_expired_batch_publish_then_late_fill_reaches_no_other_chunk(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Reproduction 1 (client API, swept): a batch of three slots with a 200 ms TTL, slots 0
    and 1 written; the server's sweeper expires and fences it (the holder is connected).
    ``publish(0, 1)`` raises (nothing is published) and ends the fence of slots 0 and 1 only;
    another client fills the arena; the holder still writes slot 2: no stored chunk changes,
    and abort ends the rest."""
    with Client(port=srv.port) as kv:
        batch = kv.reserve_chain(NS, None, HASHES, [SLOT] * 3, ttl_ms=200)
        batch.write(0, content(200))
        batch.write(1, content(201))
        assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)  # expired, fenced: swept
        assert info(r)["kv_fenced_bytes"] == 3 * SLOT
        with pytest.raises(LeaseError, match="expired"):
            batch.publish(0, 1)
        assert info(r)["kv_fenced_bytes"] == SLOT  # slot 2 is still the holder's
        fill(r)
        batch.write(2, b"X" * SLOT)  # the holder keeps filling
        assert check_present(r) == SLOTS - 1
        assert no_batch_chunk(r)
        batch.abort()  # of an expired batch: ends its fence, raises nothing
        assert info(r)["kv_fenced_bytes"] == 0 and info(r)["kv_fenced_leases"] == 0
    fill(r, 100, SLOTS)
    assert check_present(r, 100, SLOTS) == SLOTS  # every slot is in use again


def test_raw_commit_of_one_slot_of_a_swept_batch_keeps_the_others_fenced(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Reproduction 1 (raw commands, swept): ``KV.MRESERVE … TTL 150``, the server fences it,
    ``KV.COMMIT lease 0`` answers -NOLEASE … expired; another client fills the arena while
    the holder writes slots 1 and 2: every stored chunk keeps its bytes. ``KV.COMMIT lease``
    (no index) then ends the rest of the fence."""
    with Client(port=srv.port, max_connections=1) as kv:  # kv.execute: the holder's connection
        batch = kv.reserve_chain(NS, None, HASHES, [SLOT] * 3, ttl_ms=150)
        lease_id = batch.lease_id
        batch.write(0, content(200))
        assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
        with pytest.raises(LeaseError, match="expired"):
            kv.execute("KV.COMMIT", lease_id, 0)
        fill(r)
        batch.write(1, b"X" * SLOT)
        batch.write(2, b"Y" * SLOT)
        assert check_present(r) == SLOTS - 2
        assert info(r)["kv_fenced_bytes"] == 2 * SLOT
        with pytest.raises(LeaseError, match="expired"):
            kv.execute("KV.COMMIT", lease_id)
        assert info(r)["kv_fenced_bytes"] == 0 and no_batch_chunk(r)
        with pytest.raises(LeaseError, match="no such lease"):
            kv.execute("KV.ABORT", lease_id)


@pytest.mark.parametrize("via", ["client", "raw"])
def test_a_command_that_finds_the_batch_expired_first_fences_it(
    srv: RunningServer, r: redis.Redis, via: str
) -> None:
    """Reproduction 1, not yet swept: the sweeper is stopped and the server's lease clock is
    moved past the deadline. The holder's ``KV.COMMIT lease 0`` (``publish(0)``) is the first to
    see the expiry: it fences the slots still reserved exactly as the sweeper would, ends the
    fence of slot 0, and answers -NOLEASE … expired. The holder's late writes into slots 1 and
    2 reach no chunk of the client that fills the arena meanwhile."""
    stop_sweeper(srv)
    offset = server_clock(srv)
    with Client(port=srv.port, max_connections=1) as kv:
        batch = kv.reserve_chain(NS, None, HASHES, [SLOT] * 3, ttl_ms=60_000)
        batch.write(0, content(200))
        offset[0] = 3600.0
        assert info(r)["kv_leases"] == 1 and info(r)["kv_fenced_leases"] == 0  # not swept
        with pytest.raises(LeaseError, match="expired"):
            if via == "raw":
                kv.execute("KV.COMMIT", batch.lease_id, 0)
            else:
                batch.publish(0)
        stats = info(r)
        assert stats["kv_leases"] == 0 and stats["kv_leases_expired"] == 1
        assert stats["kv_fenced_leases"] == 1 and stats["kv_fenced_bytes"] == 2 * SLOT
        fill(r)
        batch.write(1, b"X" * SLOT)
        batch.write(2, b"Y" * SLOT)
        assert check_present(r) == SLOTS - 2
        if via == "raw":
            with pytest.raises(LeaseError, match="expired"):
                kv.execute("KV.COMMIT", batch.lease_id, 1, 2)
        else:
            batch.abort()
        assert info(r)["kv_fenced_bytes"] == 0 and no_batch_chunk(r)


def test_a_slot_published_before_expiry_is_the_chunks_not_the_holders(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Slot 0 of a batch is published while the lease is live; then the lease expires (the
    sweeper fences it). Only slots 1 and 2 are fenced: slot 0 is chunk B0's, served with its
    bytes, no longer reachable through the batch, and reused like any chunk's slot once B0 is
    deleted. The holder's disconnect ends the fence of the other two."""
    offset = server_clock(srv)
    kv = Client(port=srv.port)
    try:
        batch = kv.reserve_chain(NS, None, HASHES, [SLOT] * 3, ttl_ms=60_000)
        batch.write(0, content(200))
        batch.publish(0)
        with pytest.raises(ValueError, match="published"):
            batch.write(0, b"X" * SLOT)
        offset[0] = 3600.0
        assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
        assert info(r)["kv_fenced_bytes"] == 2 * SLOT
        assert r.execute_command("KV.GET", NS, b"B0") == content(200)
        assert r.execute_command("KV.DEL", NS, b"B0") == 1
        fill(r)
        assert check_present(r) == SLOTS - 2  # B0's slot holds a new chunk
        batch.write(1, b"X" * SLOT)
        batch.write(2, b"Y" * SLOT)
        assert check_present(r) == SLOTS - 2
    finally:
        kv.close()
    assert wait_for(lambda: info(r)["kv_fenced_bytes"] == 0)
    fill(r, 100, SLOTS)
    assert check_present(r, 100, SLOTS) == SLOTS


def _try(conn: redis.Redis, *args: object) -> str:
    try:
        conn.execute_command(*args)
    except redis.ResponseError as exc:
        return str(exc)
    return "OK"


def _unknown(conn: redis.Redis, lease_id: bytes | str) -> str:
    """The reply to an unknown id, written as it would be for ``lease_id``."""
    lid = lease_id.decode() if isinstance(lease_id, bytes) else lease_id
    reply = _try(conn, "KV.ABORT", UNKNOWN)
    assert reply.startswith("NOLEASE no such lease")
    return reply.replace(UNKNOWN, lid)


def test_another_connection_cannot_commit_abort_or_release_a_live_lease(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Reproduction 2: a holder has a batch, a single reservation and a read lease. Another
    connection tries KV.COMMIT (with and without indexes), KV.ABORT and KV.RELEASE of each id:
    every reply is the one an unknown id gets, and nothing changes. A third client fills the
    arena, the holder fills its slots and commits: every chunk carries its own bytes."""
    with Client(port=srv.port) as kv:
        assert kv.put(NS, b"R", None, content(50))
        lease = kv.lease(NS, [b"R"], tier="dram")
        assert lease is not None
        batch = kv.reserve_chain(NS, None, HASHES, [SLOT] * 3)
        single = kv.reserve(NS, b"S", None, SLOT)
        other = redis.Redis(port=srv.port)
        try:
            ids = [batch.lease_id, single.lease_id, lease.lease_id]
            verbs = (("KV.COMMIT", 0), ("KV.COMMIT",), ("KV.ABORT",), ("KV.RELEASE",))
            tried = {
                (lid, verb): _try(other, verb[0], lid, *verb[1:]) for lid in ids for verb in verbs
            }
            fill(r)
            for i in batch.reserved:
                batch.write(i, content(300 + i))
            single.write(content(310))
            assert check_present(r) == SLOTS - 5  # 3 + 1 reserved, R leased
            assert bytes(lease.views()[0]) == content(50)
            for (lid, verb), reply in tried.items():
                assert reply == _unknown(other, lid), (verb, reply)
            assert info(r)["kv_leases"] == 3
        finally:
            other.close()
        batch.commit()
        single.commit()
        lease.release()
        got = [r.execute_command("KV.GET", NS, h) for h in [*HASHES, b"S"]]
        assert got == [content(300), content(301), content(302), content(310)]
        assert info(r)["kv_leases"] == 0


def test_another_connection_cannot_end_a_fenced_lease(srv: RunningServer, r: redis.Redis) -> None:
    """A holder's batch expired and is fenced. Another connection's KV.COMMIT lease 0,
    KV.COMMIT, KV.ABORT and KV.RELEASE of its id get the unknown-id reply and end no fence; the
    holder's late writes reach no chunk of a third client; the holder's abort ends the fence."""
    with Client(port=srv.port) as kv:
        batch = kv.reserve_chain(NS, None, HASHES, [SLOT] * 3, ttl_ms=100)
        lid = batch.lease_id
        assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
        other = redis.Redis(port=srv.port)
        try:
            for cmd in (("KV.COMMIT", lid, 0), ("KV.COMMIT", lid), ("KV.ABORT", lid),
                        ("KV.RELEASE", lid)):  # fmt: skip
                assert _try(other, *cmd) == _unknown(other, lid), cmd
        finally:
            other.close()
        assert info(r)["kv_fenced_bytes"] == 3 * SLOT
        fill(r)
        for i in batch.reserved:
            batch.write(i, b"X" * SLOT)
        assert check_present(r) == SLOTS - 3
        batch.abort()
        assert info(r)["kv_fenced_bytes"] == 0 and no_batch_chunk(r)


def test_async_publish_of_an_expired_batch_raises_and_abort_ends_the_fence(
    srv: RunningServer, r: redis.Redis
) -> None:
    """The async batch's ``publish`` waits for its reply too: once the server fenced the
    expired batch, ``await publish(0)`` raises LeaseError; ``abort()`` ends the fence."""
    import asyncio

    from kvstrata.clients import AsyncClient

    async def main() -> None:
        async with AsyncClient(port=srv.port) as kv:
            batch = await kv.reserve_chain(NS, None, HASHES, [SLOT] * 3, ttl_ms=100)
            batch.write(0, content(200))
            while info(r)["kv_fenced_leases"] != 1:  # bounded by the test's timeout below
                await asyncio.sleep(0.02)
            with pytest.raises(LeaseError, match="expired"):
                await batch.publish(0)
            assert info(r)["kv_fenced_bytes"] == 2 * SLOT
            await batch.abort()
            assert info(r)["kv_fenced_bytes"] == 0 and no_batch_chunk(r)

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_closed_connections_live_leases_end_at_the_next_sweep(
    srv: RunningServer, r: redis.Redis
) -> None:
    """A holder takes a batch, a single reservation and a read lease, all with a TTL of a
    minute, and its connection closes (a crashed engine). The sweeper ends all three at once,
    not at their TTL: no lease is left, the batch's keys can be reserved by another connection
    (their claims are gone), the read chunk can be replaced, and a fill of the arena finds
    every slot again, each chunk with its own bytes."""
    assert r.execute_command("KV.PUT", NS, b"R", b"", content(50)) == 1
    holder = redis.Redis(port=srv.port)
    holder.execute_command("KV.MRESERVE", NS, b"", 3, *[x for h in HASHES for x in (h, SLOT)],
                           "TTL", 60_000)  # fmt: skip
    holder.execute_command("KV.RESERVE", NS, b"S", b"", SLOT, "TTL", 60_000)
    holder.execute_command("KV.LEASE", NS, b"R", "TTL", 60_000, "TIER", "dram")
    assert info(r)["kv_leases"] == 3
    holder.close()
    assert wait_for(lambda: info(r)["kv_leases"] == 0)
    assert info(r)["kv_fenced_leases"] == 0
    lid, entries = r.execute_command("KV.MRESERVE", NS, b"", 1, HASHES[0], SLOT)
    assert lid is not None and isinstance(entries[0], list)  # not "busy": the claim is gone
    r.execute_command("KV.ABORT", lid)
    assert r.execute_command("KV.DEL", NS, b"R") == 1  # no longer leased
    fill(r)
    assert check_present(r) == SLOTS
