"""Sessions and the prefetch scheduler: a session's chain moved into DRAM, de-duplication,
deadlines (late), cancellation (frees the queue slot), a full queue (dropped), bandwidth
pacing, and the KV.SESSION / KV.PREFETCH commands. Store-level over a real DRAM tier and a
gated FakeTier as nvme; nothing asserts timing (sleeps only make a deadline certainly pass)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstrata.store.prefetch import PrefetchRequest, PrefetchScheduler
from kvstrata.store.sessions import SessionTable
from tests.fakes import FakeTier, chain, make_dram, open_store
from tests.test_kv_commands import call, error, with_ctx

NS = "llama@bf16@c4"
SLOT = 4096


def run(coro: Any) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, 30)

    return asyncio.run(guarded())


def counters(store: Any) -> dict[str, Any]:
    return {k.removeprefix("prefetch_"): v for k, v in store.info_sections()["prefetch"]}


async def cold_chain(store: Any, n: int, prefix: bytes = b"h") -> list[bytes]:
    """A chain of n chunks stored, then demoted out of DRAM into nvme."""
    hashes = chain(n, prefix)
    parent = b""
    for i, h in enumerate(hashes):
        assert await store.put(NS, h, parent, bytes([i]) * SLOT, tokens=4)
        parent = h
    dram = store.state.dram
    assert await store.placement.make_room(0, dram.capacity)
    assert store.match_tiers(NS, hashes) == ["nvme"] * n
    return hashes


def test_session_prefetch_moves_the_chain_into_dram() -> None:
    """Scenario: a 5-chunk conversation sits in nvme; KV.SESSION recorded its tail; a session
    prefetch queues the whole chain (walked through parent links) and the workers promote it,
    so the next lease finds every chunk in DRAM without promoting anything itself."""

    async def main() -> None:
        async with open_store([make_dram(32 * SLOT), FakeTier("nvme")]) as store:
            hashes = await cold_chain(store, 5)
            store.record_session(NS, b"user-1", hashes[-1])
            request_id, queued = store.prefetch_session(NS, b"user-1")
            assert request_id > 0 and queued == 5
            await store.prefetch_idle()
            assert store.match_tiers(NS, hashes) == ["dram"] * 5
            c = counters(store)
            assert (c["done"], c["late"], c["chunks"], c["bytes"]) == (1, 0, 5, 5 * SLOT)
            promotions = store.stats()["dram"]["promotions"]
            lease = await store.lease(NS, hashes)
            assert lease is not None and len(lease.handles) == 5
            assert store.stats()["dram"]["promotions"] == promotions
            store.release(lease.id)
            assert store.prefetch_session(NS, b"user-1") == (0, 0)  # already there
            assert store.prefetch_session(NS, b"nobody") == (0, 0)

    run(main())


def test_deadline_passed_is_late_and_abandons_the_rest() -> None:
    """Scenario: nvme reads are held; a 4-chunk prefetch with a 1 ms deadline starts its
    first chunk, the deadline passes, the read is released: the request is counted late,
    not done, and its other chunks are never started."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(32 * SLOT), nvme], prefetch_concurrency=1) as store:
            hashes = await cold_chain(store, 4)
            nvme.gate = asyncio.Event()
            assert store.prefetch(NS, hashes, deadline_ms=1) == 4
            await asyncio.sleep(0.05)
            nvme.gate.set()
            await store.prefetch_idle()
            c = counters(store)
            assert (c["late"], c["done"], c["queued"], c["running"]) == (1, 0, 0, 0)
            assert c["chunks"] <= 1
            assert store.match_tiers(NS, hashes)[1:] == ["nvme"] * 3

    run(main())


def test_cancel_frees_the_queue_slot_and_full_queue_drops() -> None:
    """Scenario: a queue of one request, one worker held on an nvme read. A second request is
    dropped (queue full); cancelling the first frees its slot at once, so the second is then
    accepted and completes."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store(
            [make_dram(32 * SLOT), nvme], prefetch_queue=1, prefetch_concurrency=1
        ) as store:
            first = await cold_chain(store, 3, b"a")
            second = await cold_chain(store, 2, b"b")
            nvme.gate = asyncio.Event()
            id1, n1 = store.prefetch_request(NS, first)
            assert id1 > 0 and n1 == 3
            for _ in range(100):  # let the worker start the first chunk
                if counters(store)["running"]:
                    break
                await asyncio.sleep(0.01)
            assert store.prefetch_request(NS, second) == (0, 0)
            assert counters(store)["dropped"] == 1
            assert store.cancel_prefetch(id1) and not store.cancel_prefetch(id1)
            assert counters(store)["queued"] == 0
            id2, n2 = store.prefetch_request(NS, second)
            assert id2 > id1 and n2 == 2
            nvme.gate.set()
            await store.prefetch_idle()
            c = counters(store)
            assert (c["cancelled"], c["dropped"], c["done"]) == (1, 1, 1)
            assert store.match_tiers(NS, second) == ["dram"] * 2
            assert store.match_tiers(NS, first)[1:] == ["nvme"] * 2

    run(main())


def test_duplicates_and_session_supersede() -> None:
    """An identical queued request is returned instead of queued twice; a newer request of
    the same session cancels the older queued one."""

    async def main() -> None:
        moved: list[bytes] = []
        gate = asyncio.Event()

        async def fetch(key: Any, target: str) -> int:
            await gate.wait()
            moved.append(key.hash)
            return 10

        sched = PrefetchScheduler(fetch, 8, 1, lambda: 0)
        a = sched.submit(NS, [b"x", b"y"], "dram")
        assert a is not None and sched.submit(NS, [b"x", b"y"], "dram") is a
        s1 = sched.submit(NS, [b"p"], "dram", session=b"s")
        s2 = sched.submit(NS, [b"p", b"q"], "dram", session=b"s")
        assert s1 is not None and s2 is not None and s1.state == "cancelled"
        task = asyncio.ensure_future(sched.run())
        gate.set()
        await sched.idle()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert moved == [b"x", b"y", b"p", b"q"]
        assert (sched.counts["deduped"], sched.counts["cancelled"], sched.counts["done"]) == (
            1,
            1,
            2,
        )

    run(main())


def test_bandwidth_cap_paces_chunks_on_one_clock() -> None:
    """With a byte budget the workers reserve consecutive slots on one virtual clock; a new
    rate (CONFIG SET) forgets the debt owed at the old one, and a request cancelled or past
    its deadline while waiting moves nothing."""

    async def main() -> None:
        now = [100.0]
        rate = [1000]
        sched = PrefetchScheduler(lambda k, t: asyncio.sleep(0, 0), 4, 2, lambda: rate[0],
                                  clock=lambda: now[0])  # fmt: skip
        req = PrefetchRequest(1, NS, (b"h",), "dram", None)
        assert await sched._pace(500, req)  # starts at once, next slot half a second later
        assert sched._next_slot == 100.5
        sched._charge(2_000_000)  # a large chunk at 1 kB/s: the next slot is far away
        assert sched._next_slot > 2000
        rate[0] = 10**12  # raised: the debt at the old rate is forgotten
        assert await asyncio.wait_for(sched._pace(500, req), 1)
        assert sched._next_slot < 101
        rate[0] = 0
        assert await sched._pace(10**9, req)  # no cap: no wait, no slot
        rate[0] = 1
        assert await sched._pace(0, req)  # the scheduler has seen the new rate
        sched._charge(10)  # next slot 10 s away
        waiting = asyncio.ensure_future(sched._pace(10, req))
        await asyncio.sleep(0.01)
        req.state = "cancelled"
        assert await asyncio.wait_for(waiting, 1) is False
        late = PrefetchRequest(2, NS, (b"h",), "dram", deadline=now[0] - 1)
        assert await sched._pace(10, late) is False

    run(main())


def test_session_table_ttl_and_limit() -> None:
    now = [0.0]
    table = SessionTable(limit=2, clock=lambda: now[0])
    assert table.record("ns", b"a", b"h1", ttl_ms=1000)
    assert not table.record("ns", b"a", b"h1", ttl_ms=1000)
    table.record("ns", b"b", b"h2")
    table.record("ns", b"c", b"h3")
    assert table.get("ns", b"a") is None and table.forgotten == 1
    entry = table.get("ns", b"b")
    assert entry is not None and entry.tail == b"h2"
    now[0] = 10_000.0
    assert table.get("ns", b"b") is None and table.sweep() == 1


def test_session_table_keeps_the_old_record_when_a_new_one_fails() -> None:
    """A TTL no float can hold (10**400 ms) fails before the old record is touched."""
    table = SessionTable()
    table.record("ns", b"a", b"h1", ttl_ms=60_000)
    with pytest.raises(OverflowError):
        table.record("ns", b"a", b"h2", ttl_ms=10**400)
    entry = table.get("ns", b"a")
    assert entry is not None and entry.tail == b"h1" and len(table) == 1


def test_session_and_prefetch_commands() -> None:
    async def main() -> None:
        async with with_ctx([make_dram(32 * SLOT), FakeTier("nvme")]) as ctx:
            store = ctx.server.store
            hashes = await cold_chain(store, 3)
            ns = NS.encode()
            assert await call(ctx, "KV.SESSION", ns, b"s1", hashes[-1], "TTL", "60000") == b"OK"
            assert "syntax" in await error(ctx, "KV.SESSION", ns, b"s1", hashes[-1], "TTL")
            assert "unknown tier" in await error(ctx, "KV.PREFETCH", ns, b"SESSION", b"s1",
                                                 "TO", "tape")  # fmt: skip
            assert "DEADLINE" in await error(ctx, "KV.PREFETCH", ns, hashes[0], "DEADLINE", "0")
            reply = await call(ctx, "KV.PREFETCH", ns, "session", b"s1", "deadline", "60000")
            assert reply[0] > 0 and reply[1] == 3
            assert await call(ctx, "KV.PREFETCH", ns, "CANCEL", str(reply[0])) in (0, 1)
            await store.prefetch_idle()
            id2, n2 = await call(ctx, "KV.PREFETCH", ns, *hashes, "TO", "dram")
            assert n2 == 0 or id2 > 0
            await store.prefetch_idle()
            assert await call(ctx, "KV.PREFETCH", ns, *hashes) == [0, 0]
            assert await call(ctx, "KV.MATCH", ns, *hashes, "PREFETCH") == 3
            assert store.match_tiers(NS, hashes) == ["dram"] * 3

    run(main())
