"""Issue 12, writes under pressure: a write that must wait for DRAM room waits in one FIFO
queue, in turn, with a bound, while demotion runs ahead in parallel. Before, every writer made
room for itself and raced the others for it: some lost round after round."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.protocol.errors import OutOfMemoryError
from kvstrata.tiers.base import Buffer, TierError
from tests.fakes import FakeTier, make_dram, open_store

SLOT = 64 * 1024
NS = "pressure@test"


class SlowDisk(FakeTier):
    """An NVMe stand-in whose writes take ``delay`` seconds of (simulated) device time."""

    def __init__(self, delay: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.delay = delay

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        await asyncio.sleep(self.delay)
        await super().put(meta, data)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _writer(store: Any, wid: int, count: int, lat: list[float]) -> None:
    payload = bytes([wid]) * SLOT
    for n in range(count):
        started = time.perf_counter()
        await store.put(NS, bytes([wid, n]) * 4, b"", payload)
        lat.append(time.perf_counter() - started)


def test_writers_get_room_in_turn_with_bounded_waits() -> None:
    """Scenario: 24 writers store 6 chunks each into a DRAM tier of 4 chunks over a disk that
    takes 20 ms per write. Every PUT succeeds and none waits longer than the queue ahead of it
    can take (24 writes' room at 20 ms each, with generous slack: 10 x)."""

    async def main() -> tuple[list[list[float]], float]:
        disk = SlowDisk(0.02, capacity=1 << 30)
        async with open_store([make_dram(4 * SLOT), disk]) as store:
            lat: list[list[float]] = [[] for _ in range(24)]
            started = time.perf_counter()
            await asyncio.gather(*(_writer(store, w, 6, lat[w]) for w in range(24)))
            return lat, time.perf_counter() - started

    lat, _ = run(main())
    flat = [x for w in lat for x in w]
    assert len(flat) == 24 * 6
    bound = 10 * 24 * 0.02
    assert max(flat) < bound, f"a PUT waited {max(flat):.2f} s (bound {bound:.2f} s)"


def test_a_waiting_writer_is_not_overtaken_by_arriving_payloads() -> None:
    """Scenario: DRAM is full; a KV.PUT needs room and waits for it. Meanwhile new payloads
    keep arriving, each asking for a DRAM slot for its bytes (``reserve_put``, as the
    connection does when a bulk header arrives). Before, they took every slot the waiting
    writer's evictions freed (it lost round after round); now the writer is first in line and
    arrivals queue behind it until it is served."""

    async def main() -> tuple[int, float]:
        disk = SlowDisk(0.02, capacity=1 << 30)
        async with open_store([make_dram(8 * SLOT), disk]) as store:
            for i in range(8):
                await store.put(NS, bytes([1, i]) * 4, b"", b"a" * SLOT)
            waiting = asyncio.Event()
            served = asyncio.Event()
            overtook = 0
            victim = ChunkKey(NS, b"victim!!")

            def victim_has_room() -> bool:
                try:
                    store.state.dram.reserved_handle(victim)
                    return True
                except TierError:
                    return bool(store.state.dram.has(victim))

            async def arrivals() -> None:
                nonlocal overtook
                n = 0
                while not served.is_set() and n < 20000:
                    n += 1
                    h = b"\x02" + n.to_bytes(4, "big")
                    sink = store.reserve_put(NS, h, b"", SLOT)
                    if sink is not None:
                        overtook += waiting.is_set() and not victim_has_room()
                        sink.view[:] = b"t" * SLOT
                        store.put_sink_now(NS, h, b"", 0, None, sink)
                    await asyncio.sleep(0)

            task = asyncio.create_task(arrivals())
            await asyncio.sleep(0)
            started = time.perf_counter()
            put = asyncio.ensure_future(store.put(NS, b"victim!!", b"", b"v" * SLOT))
            await asyncio.sleep(0)  # the PUT runs up to its first wait: it is queued now
            waiting.set()
            await put
            served.set()
            await task
            return overtook, time.perf_counter() - started

    overtook, waited = run(main())
    assert overtook == 0, f"{overtook} later payloads took DRAM room first"
    assert waited < 5


def test_queue_bound_answers_oom_instead_of_waiting_forever() -> None:
    """Scenario: DRAM holds 2 chunks, both leased away (nothing can leave); a third PUT gets
    the usual -OOM at once, and with write-wait-queue 1 a second waiter is refused at once."""

    async def main() -> None:
        async with open_store([make_dram(2 * SLOT)], write_wait_queue=1) as store:
            for i in range(2):
                await store.put(NS, bytes([i]) * 8, b"", b"x" * SLOT)
            lease = await store.lease(NS, [bytes([0]) * 8, bytes([1]) * 8], tier="dram")
            assert lease is not None
            started = time.perf_counter()
            with pytest.raises(OutOfMemoryError):
                await store.put(NS, b"\x09" * 8, b"", b"y" * SLOT)
            assert time.perf_counter() - started < 5
            assert len(store.placement.room) == 0

    run(main())


def test_wait_timeout_bounds_a_waiter() -> None:
    """Scenario: the disk stalls (a write takes 30 s); a writer behind it gives up after
    write-wait-timeout (200 ms) with -OOM naming the setting, and leaves the queue."""

    async def main() -> None:
        disk = SlowDisk(30.0, capacity=1 << 30)
        async with open_store([make_dram(2 * SLOT), disk], write_wait_timeout=200) as store:
            for i in range(2):
                await store.put(NS, bytes([i]) * 8, b"", b"x" * SLOT)
            started = time.perf_counter()
            with pytest.raises(OutOfMemoryError, match="write-wait-timeout"):
                await store.put(NS, b"\x09" * 8, b"", b"y" * SLOT)
            assert 0.15 < time.perf_counter() - started < 5
            assert len(store.placement.room) == 0
            for task in list(store.state.tasks):
                task.cancel()

    run(main())


def test_no_per_command_scan_of_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-command O(N) work is gone: a re-PUT with the same parent link does not climb the
    chain (``makes_cycle``), and the OOM message does not iterate over every record."""

    async def main() -> None:
        async with open_store([make_dram(4 * SLOT)]) as store:
            hashes = [i.to_bytes(4, "big") for i in range(4)]
            parent = b""
            for h in hashes:
                await store.put(NS, h, parent, b"c" * SLOT)
                parent = h
            climbs: list[bytes] = []
            real = store.index.makes_cycle
            monkeypatch.setattr(store.index, "makes_cycle",
                                lambda key, p: climbs.append(p) or real(key, p))  # fmt: skip
            store.check_link(NS, hashes[1], hashes[0])  # the link it already has
            assert climbs == []
            store.check_link(NS, b"new!", hashes[3])  # a new link is still checked
            assert climbs == [hashes[3]]

            def no_scan() -> Any:
                raise AssertionError("describe_full iterated over the whole index")

            monkeypatch.setattr(type(store.index), "__iter__", lambda self: no_scan())
            message = store.placement.describe_full(8 * SLOT)
            assert "cannot place a chunk" in message and "leases" in message

    run(main())
