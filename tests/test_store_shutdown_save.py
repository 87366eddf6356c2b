"""Store level: ``KVStore.close(save_budget=…)`` writes the chunks held only in memory tiers (the
GPU pool and the DRAM arena) to the disk tier, and a new store over that tier finds them all;
a failing disk write is counted, not fatal; without a budget nothing is written."""

from __future__ import annotations

import asyncio
from typing import Any

from kvstrata.chunks import ChunkKey
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.kvstore import KVStore
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import HostMemory
from tests.fakes import FakeTier, make_config, make_dram, open_store

NS = "save@c4"
MiB = 1024 * 1024


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def blob(i: int) -> bytes:
    return bytes([i % 251]) * (64 * 1024 + i)


def test_close_with_a_budget_saves_dram_and_gpu_only_chunks() -> None:
    """Scenario: chunk a lives only in the GPU pool (leased there, its DRAM copy dropped),
    b and c only in DRAM; the disk tier is empty. close(save_budget=10) puts all three on disk;
    a new store over the same disk tier serves them intact."""

    async def main() -> None:
        disk = FakeTier("nvme")
        gpu = GpuTier(GpuConfig(capacity=MiB), memory=HostMemory(MiB))
        store = KVStore(make_config(), Keyspace(), [gpu, make_dram(4 * MiB), disk])
        await store.start()
        for i, h in enumerate((b"a", b"b", b"c")):
            assert await store.put(NS, h, b"", blob(i))
        lease = await store.lease(NS, [b"a"], tier="gpu")
        assert lease is not None
        store.release(lease.id)
        rec = store.index.get(ChunkKey(NS, b"a"))
        await store.state.delete_copy(rec, "dram")
        assert rec.tiers == {"gpu"} and disk.data == {}
        report = await store.close(save_budget=10.0)
        assert report is not None and (report.wanted, report.saved, report.failed) == (3, 3, 0)
        assert not report.timed_out and report.tier == "nvme"
        async with open_store([make_dram(4 * MiB), disk]) as again:
            for i, h in enumerate((b"a", b"b", b"c")):
                payload = await again.get(NS, h)
                assert payload is not None and bytes(payload.view) == blob(i)
                if payload.release:
                    payload.release()

    run(main())


def test_close_without_a_budget_writes_nothing() -> None:
    async def main() -> None:
        disk = FakeTier("nvme")
        async with open_store([make_dram(4 * MiB), disk]) as store:
            assert await store.put(NS, b"a", b"", blob(1))
        assert disk.data == {}

    run(main())


def test_a_failing_disk_is_counted_and_close_finishes() -> None:
    async def main() -> None:
        disk = FakeTier("nvme")
        store = open_store([make_dram(4 * MiB), disk]).store
        await store.start()
        assert await store.put(NS, b"a", b"", blob(1))
        disk.fail_puts = True
        report = await store.close(save_budget=10.0)
        assert report is not None and (report.saved, report.failed) == (0, 1)
        assert store.state.counters["nvme"].errors >= 1

    run(main())
