"""No client can take DRAM from the others through write leases (issue 22, items 4 and 5).

- A KV.MRESERVE that cannot fit is refused before anything is evicted: sizes count in the
  arena's 4 KiB allocation units, and what cannot leave DRAM (leased chunks, reservations)
  is not counted as room.
- One connection's live write-lease slots are bounded (``lease-reserve-max-per-client``), and
  so is a write lease's TTL (``write-lease-ttl-max``): past either, ``-LEASELIMIT``, and the
  other clients' writes and leases go on.

The server runs in this process (a thread) with a 64 MiB arena and no NVMe, so a chunk evicted
from DRAM is gone (which is what the first tests look for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import pytest
import redis

from tests.conftest import RunningServer
from tests.fakes import write_slot

NS = "bounds@u8@c16"
MiB = 1024 * 1024
ARENA = 64 * MiB


@pytest.fixture
def srv(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(dram_capacity=str(ARENA), nvme_capacity="0")


@pytest.fixture
def r(srv: RunningServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(port=srv.port, protocol=3)
    yield conn
    conn.close()


def chunk(i: int, size: int = MiB) -> bytes:
    return bytes([i % 251]) * (size - 1) + bytes([i % 7])


def cache_chunks(r: redis.Redis, count: int) -> None:
    for i in range(count):
        assert r.execute_command("KV.PUT", NS, b"c%d" % i, b"", chunk(i)) == 1


def assert_cached(r: redis.Redis, count: int) -> None:
    got = r.execute_command("KV.MGET", NS, *[b"c%d" % i for i in range(count)])
    assert [g == chunk(i) for i, g in enumerate(got)] == [True] * count


def evictions(r: redis.Redis) -> int:
    stats: dict[Any, Any] = r.execute_command("KV.STATS")
    return int(stats[b"dram"][b"evictions"]) + int(stats[b"dram"][b"demotions"])


def put_and_lease(r: redis.Redis, h: bytes, data: bytes) -> None:
    """Another client's write and zero-copy read of it succeed, with its bytes."""
    assert r.execute_command("KV.PUT", NS, h, b"", data) == 1
    assert r.execute_command("KV.GET", NS, h) == data
    lease_id, handles = r.execute_command("KV.LEASE", NS, h, "TIER", "dram")
    assert lease_id is not None and handles[0][2] == len(data)
    region, offset, length, _ = handles[0]
    paths = {reg[b"name"]: reg[b"path"] for reg in r.execute_command("KV.REGIONS")}
    shm = shared_memory.SharedMemory(name=paths[region].decode())
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    try:
        assert shm.buf is not None and bytes(shm.buf[offset : offset + length]) == data
    finally:
        shm.close()
    assert r.execute_command("KV.RELEASE", lease_id) == b"OK"


# -- item 4: a hopeless KV.MRESERVE evicts nothing -----------------------------------------------


def test_one_byte_slots_count_in_allocation_units_and_evict_nothing(r: redis.Redis) -> None:
    """Scenario: 40 chunks of 1 MiB are cached; a KV.MRESERVE of 65,536 one-byte chunks (64 KiB
    of payload, 256 MiB of 4 KiB slots in a 64 MiB arena) is refused at once with an error
    that says why, and all 40 chunks are still served with their bytes, none evicted."""
    cache_chunks(r, 40)
    before = evictions(r)
    pairs: list[Any] = []
    for i in range(65536):
        pairs += [b"x%d" % i, 1]
    with pytest.raises(redis.ResponseError, match="allocation units") as err:
        r.execute_command("KV.MRESERVE", NS, b"", 65536, *pairs)
    assert "268435456" in str(err.value)  # 65,536 slots of 4 KiB
    assert evictions(r) == before
    assert_cached(r, 40)
    assert r.info("tiers")["kv_leases"] == 0


def test_batch_larger_than_what_can_leave_dram_evicts_nothing(r: redis.Redis) -> None:
    """Scenario: 40 chunks of 1 MiB are cached and 35 of them leased (they cannot leave); a
    KV.MRESERVE of 8 × 4 MiB fits the arena's size but not the 29 MiB that evicting every
    other chunk would free: -OOM at once, nothing evicted, all 40 chunks served intact; once
    the lease ends the same batch is reserved (making room by eviction)."""
    cache_chunks(r, 40)
    lease_id, handles = r.execute_command(
        "KV.LEASE", NS, *[b"c%d" % i for i in range(35)], "TIER", "dram"
    )
    assert len(handles) == 35
    before = evictions(r)
    pairs: list[Any] = []
    for i in range(8):
        pairs += [b"y%d" % i, 4 * MiB]
    with pytest.raises(redis.exceptions.OutOfMemoryError, match="nothing was evicted"):
        r.execute_command("KV.MRESERVE", NS, b"", 8, *pairs)
    assert evictions(r) == before
    assert_cached(r, 40)
    assert r.execute_command("KV.RELEASE", lease_id) == b"OK"
    batch, entries = r.execute_command("KV.MRESERVE", NS, b"", 8, *pairs)
    assert batch is not None and len(entries) == 8
    assert r.execute_command("KV.ABORT", batch) == b"OK"


# -- item 5: one connection cannot reserve the arena for a day -----------------------------------


def hog_pairs(count: int, size: int, prefix: bytes = b"h") -> list[Any]:
    pairs: list[Any] = []
    for i in range(count):
        pairs += [prefix + b"%d" % i, size]
    return pairs


def test_a_day_long_write_lease_is_refused(srv: RunningServer, r: redis.Redis) -> None:
    """Scenario: a hog asks KV.MRESERVE of 15 × 4 MiB with TTL 86400000 (a day): -LEASELIMIT
    naming write-lease-ttl-max, nothing reserved; a KV.RESERVE with a long TTL likewise; the
    same within the cap is granted. Another client's 16 MiB KV.PUT and KV.LEASE succeed."""
    hog = redis.Redis(port=srv.port, protocol=3)
    try:
        with pytest.raises(redis.ResponseError, match=r"LEASELIMIT.*write-lease-ttl-max"):
            hog.execute_command("KV.MRESERVE", NS, b"", 15, *hog_pairs(15, 4 * MiB),
                                "TTL", 86_400_000)  # fmt: skip
        with pytest.raises(redis.ResponseError, match=r"LEASELIMIT.*write-lease-ttl-max"):
            hog.execute_command("KV.RESERVE", NS, b"one", b"", 4 * MiB, "TTL", 60_001)
        assert r.info("tiers")["kv_leases"] == 0
        put_and_lease(r, b"other", chunk(7, 16 * MiB))
        lease_id, handle = hog.execute_command("KV.RESERVE", NS, b"one", b"", MiB, "TTL", 60_000)
        write_slot(hog, handle, chunk(3))
        assert hog.execute_command("KV.COMMIT", lease_id) == b"OK"
        assert r.execute_command("KV.GET", NS, b"one") == chunk(3)
    finally:
        hog.close()


def test_one_connection_cannot_reserve_more_than_its_share(
    srv: RunningServer, r: redis.Redis
) -> None:
    """Scenario: with the default share (50% of the 64 MiB arena), a hog's KV.MRESERVE of
    15 × 4 MiB (60 MiB) is refused whole with -LEASELIMIT naming lease-reserve-max-per-client;
    4 MiB KV.RESERVEs are granted up to 32 MiB and the next one is refused; another client's
    16 MiB KV.PUT and KV.LEASE succeed meanwhile, and its own reservation too. After the hog
    aborts one lease it may reserve again."""
    hog = redis.Redis(port=srv.port, protocol=3)
    try:
        with pytest.raises(redis.ResponseError, match=r"LEASELIMIT.*lease-reserve-max-per-client"):
            hog.execute_command("KV.MRESERVE", NS, b"", 15, *hog_pairs(15, 4 * MiB))
        assert r.info("tiers")["kv_leases"] == 0
        leases = [
            hog.execute_command("KV.RESERVE", NS, b"r%d" % i, b"", 4 * MiB)[0] for i in range(8)
        ]
        with pytest.raises(redis.ResponseError, match=r"LEASELIMIT.*33554432 bytes"):
            hog.execute_command("KV.RESERVE", NS, b"r8", b"", 1)
        put_and_lease(r, b"other", chunk(9, 16 * MiB))
        mine, entries = r.execute_command("KV.MRESERVE", NS, b"", 2, *hog_pairs(2, MiB, b"o"))
        for i, e in enumerate(entries):
            write_slot(r, e, chunk(20 + i))
        assert r.execute_command("KV.COMMIT", mine) == b"OK"
        got = r.execute_command("KV.MGET", NS, b"o0", b"o1")
        assert got == [chunk(20), chunk(21)]
        assert hog.execute_command("KV.ABORT", leases[0]) == b"OK"
        lease_id, handle = hog.execute_command("KV.RESERVE", NS, b"r8", b"", 4 * MiB)
        write_slot(hog, handle, chunk(8, 4 * MiB))
        assert hog.execute_command("KV.COMMIT", lease_id) == b"OK"
        assert r.execute_command("KV.GET", NS, b"r8") == chunk(8, 4 * MiB)
    finally:
        hog.close()


def test_reserve_bounds_follow_config_set(srv: RunningServer, r: redis.Redis) -> None:
    """Scenario: CONFIG SET lease-reserve-max-per-client 8MiB / 0 and write-lease-ttl-max 0
    apply to the next reservation; CONFIG GET shows the share as a percentage by default."""
    assert r.config_get("lease-reserve-max-per-client") == {"lease-reserve-max-per-client": "50%"}
    r.config_set("lease-reserve-max-per-client", "8MiB")
    lease_id, _ = r.execute_command("KV.MRESERVE", NS, b"", 2, *hog_pairs(2, 4 * MiB))
    with pytest.raises(redis.ResponseError, match=r"LEASELIMIT"):
        r.execute_command("KV.RESERVE", NS, b"z", b"", 1)
    r.config_set("lease-reserve-max-per-client", "0")
    r.config_set("write-lease-ttl-max", "0")
    second, _ = r.execute_command("KV.RESERVE", NS, b"z", b"", 1, "TTL", 86_400_000)
    assert r.execute_command("KV.ABORT", second) == b"OK"
    assert r.execute_command("KV.ABORT", lease_id) == b"OK"
