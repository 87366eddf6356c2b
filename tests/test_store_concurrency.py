"""Races between writers, readers, deletes and moves of one chunk (single event loop, tier
I/O that yields), checking there is one winner and never a torn or freed-under-a-reader
chunk."""

from __future__ import annotations

import asyncio
from typing import Any

from kvstrata.chunks import ChunkKey
from tests.fakes import FakeTier, make_dram, open_store

NS = "m@c4"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_concurrent_put_nx_one_winner_never_torn() -> None:
    """Scenario: 12 clients put the same hash with NX and different payloads at once (half
    through payload sinks, half with bytes, NVMe write-through making every put yield) while
    readers poll it. Exactly one put answers 1, every read sees nothing or exactly the
    winner's bytes, and the stored chunk is the winner's."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(), nvme], nvme_write_policy="write-through") as store:
            payloads = [bytes([65 + i]) * 20_000 for i in range(12)]
            seen: list[bytes] = []
            stop = False

            async def writer(i: int) -> bool:
                await asyncio.sleep(0)
                sink = store.reserve_put(NS, b"h", b"", 20_000) if i % 2 else None
                if sink is not None:
                    sink.view[:] = payloads[i]
                    await asyncio.sleep(0)
                    return await store.put(NS, b"h", b"", sink.view, nx=True, sink=sink)
                return await store.put(NS, b"h", b"", payloads[i], nx=True)

            async def reader() -> None:
                while not stop:
                    p = await store.get(NS, b"h")
                    if p is not None:
                        seen.append(bytes(p.view))
                        if p.release:
                            p.release()
                    await asyncio.sleep(0)

            readers = [asyncio.create_task(reader()) for _ in range(3)]
            results = await asyncio.gather(*(writer(i) for i in range(12)))
            stop = True
            await asyncio.gather(*readers)
            assert results.count(True) == 1
            winner = payloads[results.index(True)]
            p = await store.get(NS, b"h")
            assert bytes(p.view) == winner
            p.release()
            assert all(s == winner for s in seen)
            assert nvme.holds(ChunkKey(NS, b"h")) == winner
            assert store.state.dram.info()["reserved"] == 0 and not store.state.writers

    run(main())


def test_arriving_payload_does_not_block_other_writers() -> None:
    """Scenario: a large KV.PUT payload is still arriving (its slot is reserved) when another
    client's small NX put of the same key runs. The key is claimed only when a PUT runs, so the
    small put wins at once; the late upload, run with NX afterwards, loses and frees its slot."""

    async def main() -> None:
        async with open_store() as store:
            sink = store.reserve_put(NS, b"h", b"", 70_000)
            assert sink is not None
            assert await asyncio.wait_for(store.put(NS, b"h", b"", b"b" * 10, nx=True), 5)
            sink.view[:] = b"a" * 70_000
            assert not await store.put(NS, b"h", b"", sink.view, nx=True, sink=sink)
            assert store.state.dram.info()["reserved"] == 0
            p = await store.get(NS, b"h")
            assert bytes(p.view) == b"b" * 10
            p.release()

    run(main())


def test_chunk_deleted_while_get_awaits_nvme() -> None:
    """Scenario: a chunk lives only on (slow) NVMe; a KV.GET starts reading it, a KV.DEL
    arrives meanwhile. The delete answers 1 at once, the read ends as a miss (no promotion of
    a deleted chunk), and the NVMe copy is freed once the read let go of it."""

    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(), nvme], start=False) as store:
            assert await store.put(NS, b"x", b"", b"x" * 5000)
            rec = store.index.get(ChunkKey(NS, b"x"))
            assert await store.placement.move_down(rec, 0)
            nvme.gate = asyncio.Event()
            reading = asyncio.create_task(store.get(NS, b"x"))
            await asyncio.sleep(0.01)
            assert rec.pins >= 1
            assert await store.delete(NS, b"x") == 1
            assert ChunkKey(NS, b"x") in nvme.data  # still pinned by the read
            nvme.gate.set()
            assert await reading is None
            await store.drain()
            assert nvme.data == {} and store.state.dram.used == 0
            assert not store.state.retired

    run(main())


def test_replacing_put_waits_for_reader_release() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"r", b"", b"old" * 1000)
            p = await store.get(NS, b"r")
            task = asyncio.create_task(store.put(NS, b"r", b"", b"new" * 1000))
            await asyncio.sleep(0.01)
            assert not task.done()
            assert bytes(p.view) == b"old" * 1000  # the reader's bytes stay intact
            p.release()
            assert await task is True
            q = await store.get(NS, b"r")
            assert bytes(q.view) == b"new" * 1000
            q.release()

    run(main())


def test_concurrent_gets_of_cold_chunk_promote_once() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        async with open_store([make_dram(), nvme], start=False) as store:
            data = bytes(range(256)) * 40
            assert await store.put(NS, b"c", b"", data)
            rec = store.index.get(ChunkKey(NS, b"c"))
            assert await store.placement.move_down(rec, 0)
            nvme.gets = 0
            payloads = await asyncio.gather(*(store.get(NS, b"c") for _ in range(5)))
            assert all(bytes(p.view) == data for p in payloads)
            assert store.stats()["dram"]["promotions"] == 1
            assert nvme.gets == 1
            for p in payloads:
                if p.release:
                    p.release()
            assert rec.pins == 0

    run(main())


def test_write_through_failure_publishes_nothing() -> None:
    async def main() -> None:
        nvme = FakeTier("nvme")
        nvme.fail_puts = True
        async with open_store([make_dram(), nvme], nvme_write_policy="write-through") as store:
            try:
                await store.put(NS, b"f", b"", b"f" * 100)
            except Exception as exc:
                assert "write-through to nvme failed" in str(exc)
            else:
                raise AssertionError("put succeeded although write-through failed")
            assert store.match(NS, [b"f"]) == 0
            assert store.state.dram.used == 0 and not store.state.writers
            assert store.stats()["nvme"]["errors"] == 1

    run(main())
