"""A checksum mismatch anywhere drops the chunk from every tier and counts an integrity error
(issue 10): on demotion (DRAM → NVMe), on promotion (DRAM → GPU), on a move out of the GPU.
Never kept, never served again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis

from kvstrata.chunks import ChunkKey
from kvstrata.clients import Client
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import HostMemory
from tests.conftest import RunningServer
from tests.fakes import FakeTier, make_dram, open_store, wait_for

NS = "integrity@u8@c16"
SLOT = 256 * 1024


def test_chunk_corrupted_in_dram_is_dropped_everywhere_on_demotion(
    make_server: Callable[..., RunningServer],
) -> None:
    """Scenario (issue 10, reproduction 3's aftermath): a client commits chunk X through a
    write lease and then keeps writing into its view, so X's DRAM bytes no longer match its
    checksum. When DRAM pressure demotes X, the mismatch is found: X leaves every tier (no
    KV.GET, no KV.INFO, nothing on NVMe), INFO counts one integrity error, and the other chunks
    are demoted normally."""
    srv = make_server(dram_capacity=f"{16 * SLOT}", nvme_capacity="64MiB")
    r = redis.Redis(port=srv.port)
    with Client(port=srv.port) as kv:
        w = kv.reserve(NS, b"X", None, SLOT)
        w.write(b"x" * SLOT)
        w.commit()
        w.view()[:4] = b"BAD!"  # a buggy holder writing after its commit
    for i in range(40):
        r.execute_command("KV.PUT", NS, b"f%d" % i, b"", bytes([i + 1]) * SLOT)
    assert wait_for(lambda: r.execute_command("KV.INFO", NS, b"X") is None), (
        f"the corrupt chunk is still stored: {r.execute_command('KV.MATCH', NS, b'X', 'WITHTIERS')}"
    )
    assert r.execute_command("KV.GET", NS, b"X") is None
    stats = r.info("tiers")
    assert stats["kv_integrity_errors"] == 1 and stats["dram_integrity_errors"] == 1
    assert r.execute_command("KV.MATCH", NS, b"f0", "WITHTIERS") == [1, [b"nvme"]]
    assert r.execute_command("KV.GET", NS, b"f0") == b"\x01" * SLOT
    r.close()


def host_gpu(capacity: int = 1 << 20) -> GpuTier:
    return GpuTier(GpuConfig(capacity=capacity), memory=HostMemory(capacity))


def test_corrupt_dram_copy_is_never_promoted_into_the_gpu() -> None:
    """A chunk in DRAM and (write-through) in NVMe whose DRAM bytes were changed behind the
    store's back: KV.LEASE TIER gpu checks the bytes before the copy, finds the mismatch and
    drops the chunk from DRAM, NVMe and the GPU; the lease is a miss, not wrong KV."""

    async def main() -> None:
        gpu, nvme = host_gpu(), FakeTier("nvme")
        async with open_store(
            [gpu, make_dram(4 << 20), nvme], nvme_write_policy="write-through"
        ) as store:
            data = b"k" * 50_000
            assert await store.put(NS, b"k", b"", data)
            dram = store.state.dram
            h = dram.handle(ChunkKey(NS, b"k"))
            dram._buf[h.offset] ^= 0xFF  # type: ignore[attr-defined]
            assert await store.lease(NS, [b"k"], tier="gpu") is None
            assert store.info(NS, b"k") is None
            await store.drain()
            assert nvme.holds(ChunkKey(NS, b"k")) is None and dram.used == 0 and gpu.used == 0
            assert store.state.integrity_errors == 1 and dram.stats.integrity_errors == 1

    asyncio.run(main())


def test_corrupt_gpu_copy_is_dropped_everywhere_when_demoted() -> None:
    """A GPU-only chunk whose pool bytes changed: demotion to DRAM verifies the copy, finds the
    mismatch and the chunk leaves every tier (it is not kept in the GPU either)."""

    async def main() -> None:
        gpu, nvme = host_gpu(), FakeTier("nvme")
        async with open_store([gpu, make_dram(4 << 20), nvme], start=False) as store:
            assert await store.put(NS, b"g", b"", b"g" * 40_000)
            lease = await store.lease(NS, [b"g"], tier="gpu")
            assert lease is not None
            store.release(lease.id)
            rec = store.index.get(ChunkKey(NS, b"g"))
            await store.state.delete_copy(rec, "dram")
            gpu.memory.host_view(lease.handles[0].offset, 1)[0] ^= 0xFF
            assert not await store.placement.move_down(rec, 0)
            await store.drain()
            assert store.info(NS, b"g") is None and gpu.used == 0 and store.state.dram.used == 0
            assert gpu.stats.integrity_errors == 1

    asyncio.run(main())
