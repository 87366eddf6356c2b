"""Fencing of the GPU pool (issue 10), over the host stand-in of the device memory: a lease
into the GPU that expires while its holder is connected keeps its slot out of reuse until the
holder ends it or goes away; handles and regions carry the pool's instance identity."""

from __future__ import annotations

import asyncio

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import LeaseError
from kvstrata.store.kvstore import KVStore
from kvstrata.store.leases import Holder
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import HostMemory
from tests.fakes import make_dram, open_store, wait_until

NS = "fence-gpu@c4"
CHUNK = 64 * 1024
POOL = 8 * CHUNK


def host_gpu() -> GpuTier:
    return GpuTier(GpuConfig(capacity=POOL), memory=HostMemory(POOL))


def pattern(i: int) -> bytes:
    return bytes([i + 1]) * CHUNK


class Conn:
    """A stand-in connection: alive until closed."""

    def __init__(self, cid: int) -> None:
        self.open = True
        self.holder = Holder(cid, lambda: self.open)


async def fill_gpu(store: KVStore, first: int, count: int) -> list[int]:
    """Lease chunks into the GPU one after the other (each released at once); the offsets
    their GPU copies got."""
    offsets = []
    for i in range(first, first + count):
        h = b"g%d" % i
        assert await store.put(NS, h, b"", pattern(i))
        lease = await store.lease(NS, [h], tier="gpu")
        assert lease is not None
        if lease.handles[0].region == "gpu0":
            offsets.append(lease.handles[0].offset)
        store.release(lease.id)
    return offsets


def test_expired_gpu_read_lease_keeps_its_slot_until_the_holder_goes() -> None:
    """Scenario: a holder leases chunk A into the GPU with a 30 ms TTL; the lease expires, A is
    deleted and other chunks are leased into the pool until it is full. A's slot is never
    handed out again and still holds A's bytes; when the holder's connection closes, the
    sweeper ends the fence and the slot is free."""

    async def main() -> None:
        gpu = host_gpu()
        async with open_store([gpu, make_dram(4 << 20)]) as store:
            conn = Conn(7)
            assert await store.put(NS, b"A", b"", pattern(0))
            lease = await store.lease(NS, [b"A"], 30, "gpu", conn.holder)
            assert lease is not None
            [h] = lease.handles
            assert h.region == "gpu0" and h.instance == gpu.instance
            assert gpu.regions()[0].instance == gpu.instance
            assert await wait_until(lambda: len(store.state.fences) == 1)
            await store.delete(NS, b"A")
            offsets = await fill_gpu(store, 1, 2 * (POOL // CHUNK))
            assert h.offset not in offsets
            assert bytes(gpu.memory.host_view(h.offset, h.length)) == pattern(0)
            assert store.state.fences.bytes_of(conn.holder) == CHUNK
            conn.open = False
            assert await wait_until(lambda: len(store.state.fences) == 0)
            assert h.offset in await fill_gpu(store, 100, POOL // CHUNK)

    asyncio.run(main())


def test_expired_gpu_write_lease_late_write_and_refused_commit() -> None:
    """Scenario: a holder reserves a GPU slot with a 30 ms TTL and writes after it expired;
    the other chunks leased into the pool meanwhile are intact, the commit is refused and
    ends the fence, the chunk never becomes visible."""

    async def main() -> None:
        gpu = host_gpu()
        async with open_store([gpu, make_dram(4 << 20)]) as store:
            conn = Conn(9)
            w = await store.reserve(NS, b"W", b"", CHUNK, 0, 30, "gpu", conn.holder)
            assert w.handle.region == "gpu0" and w.handle.instance == gpu.instance
            assert await wait_until(lambda: len(store.state.fences) == 1)
            offsets = await fill_gpu(store, 1, POOL // CHUNK)
            assert w.handle.offset not in offsets
            gpu.memory.host_view(w.handle.offset, CHUNK)[:] = b"\xee" * CHUNK
            for i in range(1, 1 + POOL // CHUNK):
                p = await store.get(NS, b"g%d" % i)
                assert p is not None and bytes(p.view) == pattern(i)
                if p.release is not None:
                    p.release()
            with pytest.raises(LeaseError, match="no such lease"):
                await store.commit(w.id)  # in-process: not the holder's
            assert len(store.state.fences) == 1
            with pytest.raises(LeaseError, match="expired"):
                await store.commit(w.id, (), conn.holder)
            assert len(store.state.fences) == 0 and store.info(NS, b"W") is None
            assert not gpu.has(ChunkKey(NS, b"W"))

    asyncio.run(main())


def test_lease_without_a_connected_holder_frees_at_expiry() -> None:
    """An in-process lease (no holder) or one whose holder is gone is not fenced: its slot is
    reusable as soon as the lease expires."""

    async def main() -> None:
        gpu = host_gpu()
        async with open_store([gpu, make_dram(4 << 20)]) as store:
            gone = Conn(3)
            gone.open = False
            assert await store.put(NS, b"A", b"", pattern(0))
            for holder in (gone.holder, None):
                args = (holder,) if holder is not None else ()
                lease = await store.lease(NS, [b"A"], 30, "gpu", *args)
                assert lease is not None
                assert await wait_until(lambda: len(store.leases) == 0)
                assert len(store.state.fences) == 0 and store.state.fences.fenced_total == 0

    asyncio.run(main())
