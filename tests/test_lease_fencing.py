"""Fenced leases over the wire (issue 10): a view keeps showing its own chunk's bytes after its
lease expired, a late write through an expired write lease never reaches another chunk and is
never committed, and the memory held that way returns when the holder ends it or disconnects.
Also the lease limits (lease-max, lease-max-per-client, lease-fence-max).

The server runs in this process (a thread), with a 4 MiB arena of 16 slots of 256 KiB, no NVMe,
and watermarks at 1.0, so that filling it puts a live chunk into every slot that is free: on a
server without fencing the expired lease's slot is then another chunk's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from kvstrata.clients import Client, LeaseError
from tests.conftest import RunningServer
from tests.fakes import wait_for

NS = "fence@u8@c16"
SLOT = 256 * 1024
SLOTS = 16


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


def fill(r: redis.Redis, first: int, count: int) -> None:
    """Put chunks ``first … first+count-1``: more than the arena holds, so it ends full."""
    for i in range(first, first + count):
        assert r.execute_command("KV.PUT", NS, key(i), b"", content(i)) == 1


def check_present(r: redis.Redis, indexes: range) -> int:
    """Every chunk still stored has exactly its own bytes; returns how many are stored."""
    found = 0
    for i in indexes:
        got = r.execute_command("KV.GET", NS, key(i))
        if got is not None:
            assert got == content(i), f"chunk {i} holds foreign bytes"
            found += 1
    return found


def test_expired_read_lease_view_keeps_its_bytes_under_slot_pressure(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Scenario (issue 10, reproduction 2): a client leases chunk A with a 100 ms TTL and keeps
    the view; the lease expires, A is deleted and the arena is filled with other chunks. The
    view still shows A's bytes (its slot is fenced while the client is connected); when the
    client disconnects, the slot is freed."""
    kv = Client(port=srv.port)
    try:
        assert kv.put(NS, b"A", None, content(0))
        lease = kv.lease(NS, [b"A"], ttl_ms=100)
        assert lease is not None
        view = lease.views()[0]
        assert wait_for(lambda: info(r)["kv_leases"] == 0)  # expired and ended by the server
        assert r.execute_command("KV.DEL", NS, b"A") == 1
        fill(r, 1, 2 * SLOTS)
        assert bytes(view) == content(0), "the expired lease's view shows another chunk"
        assert check_present(r, range(1, 2 * SLOTS + 1)) == SLOTS - 1  # one slot is fenced
        stats = info(r)
        assert stats["kv_fenced_leases"] == 1 and stats["kv_fenced_bytes"] == SLOT
    finally:
        kv.close()
    assert wait_for(lambda: info(r)["kv_fenced_bytes"] == 0)
    fill(r, 100, SLOTS)
    assert check_present(r, range(100, 100 + SLOTS)) == SLOTS  # the slot is in use again


def test_late_write_through_expired_write_lease_reaches_no_other_chunk(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Scenario (issue 10, reproduction 3): a slow writer reserves chunk C with a 100 ms TTL;
    the lease expires, other clients fill the arena, then the writer fills its view and
    commits. No stored chunk changes, the commit is refused (-NOLEASE … expired), C is never
    visible, and the commit ends the fence."""
    with Client(port=srv.port) as kv:
        w = kv.reserve(NS, b"C", None, SLOT, ttl_ms=100)
        assert wait_for(lambda: info(r)["kv_leases"] == 0)
        fill(r, 1, 2 * SLOTS)
        w.view()[:] = b"\xee" * SLOT  # the late writer
        assert check_present(r, range(1, 2 * SLOTS + 1)) == SLOTS - 1
        assert info(r)["kv_fenced_bytes"] == SLOT
        with pytest.raises(LeaseError, match="expired"):
            w.commit()
        assert r.execute_command("KV.GET", NS, b"C") is None
        assert info(r)["kv_fenced_bytes"] == 0
        with pytest.raises(LeaseError, match="no such lease"):
            kv.abort(w.lease_id)


def test_release_of_an_expired_lease_ends_its_fence(srv: RunningServer, r: redis.Redis) -> None:
    """KV.RELEASE of a fenced lease answers -NOLEASE … expired and frees the slot at once;
    an unknown lease id afterwards."""
    with Client(port=srv.port) as kv:
        kv.put(NS, b"A", None, content(0))
        lease = kv.lease(NS, [b"A"], ttl_ms=50)
        assert lease is not None
        assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
        r.execute_command("KV.DEL", NS, b"A")
        assert info(r)["dram_used"] == SLOT  # deleted, but its slot is fenced
        with pytest.raises(LeaseError, match="expired"):
            lease.release()
        assert info(r)["kv_fenced_bytes"] == 0 and info(r)["dram_used"] == 0
        with pytest.raises(LeaseError, match="no such lease"):
            kv.release(lease.lease_id)


def test_a_holder_past_lease_fence_max_gets_leaselimit(srv: RunningServer, r: redis.Redis) -> None:
    """With lease-fence-max below one slot, a connection holding a fenced lease is refused new
    leases and reservations (-LEASELIMIT) until it releases the expired one; another
    connection is not affected."""
    r.config_set("lease-fence-max", str(SLOT // 2))
    kv = redis.Redis(port=srv.port)
    try:
        kv.execute_command("KV.PUT", NS, b"A", b"", content(0))
        lease_id, _ = kv.execute_command("KV.LEASE", NS, b"A", "TTL", 50)
        assert wait_for(lambda: info(r)["kv_fenced_leases"] == 1)
        with pytest.raises(redis.ResponseError, match=r"^LEASELIMIT .*lease-fence-max"):
            kv.execute_command("KV.LEASE", NS, b"A")
        with pytest.raises(redis.ResponseError, match=r"^LEASELIMIT"):
            kv.execute_command("KV.RESERVE", NS, b"B", b"", 10)
        other, _ = r.execute_command("KV.LEASE", NS, b"A")
        assert other and r.execute_command("KV.RELEASE", other) == b"OK"
        with pytest.raises(redis.ResponseError, match=r"^NOLEASE .*expired"):
            kv.execute_command("KV.RELEASE", lease_id)
        again, _ = kv.execute_command("KV.LEASE", NS, b"A")
        assert again and kv.execute_command("KV.RELEASE", again) == b"OK"
    finally:
        kv.close()


def test_lease_count_limits_per_connection_and_in_total(srv: RunningServer, r: redis.Redis) -> None:
    """lease-max-per-client bounds one connection's leases, lease-max all of them; both answer
    -LEASELIMIT naming the key, and a released lease makes room again."""
    from kvstrata.protocol.errors import LeaseLimitError

    r.execute_command("KV.PUT", NS, b"A", b"", b"a" * 100)
    r.config_set("lease-max-per-client", "2")
    r.config_set("lease-max", "3")
    a, b = redis.Redis(port=srv.port), redis.Redis(port=srv.port)
    try:
        held = [a.execute_command("KV.LEASE", NS, b"A")[0] for _ in range(2)]
        with pytest.raises(redis.ResponseError, match=r"^LEASELIMIT .*lease-max-per-client 2"):
            a.execute_command("KV.LEASE", NS, b"A")
        with pytest.raises(redis.ResponseError, match=r"^LEASELIMIT .*lease-max-per-client"):
            a.execute_command("KV.RESERVE", NS, b"W", b"", 10)
        b.execute_command("KV.LEASE", NS, b"A")
        with pytest.raises(redis.ResponseError, match=r"^LEASELIMIT .*lease-max 3"):
            b.execute_command("KV.LEASE", NS, b"A")
        assert a.execute_command("KV.RELEASE", held[0]) == b"OK"
        assert b.execute_command("KV.LEASE", NS, b"A")[0]
        assert info(r)["kv_leases_refused"] == 3
    finally:
        a.close()
        b.close()
    with Client(port=srv.port) as kv:
        r.config_set("lease-max", "0")
        r.config_set("lease-max-per-client", "1")
        first = kv.lease(NS, [b"A"])
        assert first is not None
        with pytest.raises(LeaseLimitError):
            kv.execute("KV.LEASE", NS, b"A")
