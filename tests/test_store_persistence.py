"""Persistence through the real NvmeTier: write-through, rebuild at start, from_config."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvstrata.chunks import ChunkKey
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.kvstore import KVStore
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier
from tests.fakes import chain, make_config, make_dram, open_store

NS = "m@c4"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def nvme_at(path: Path) -> NvmeTier:
    return NvmeTier(NvmeConfig(path=str(path), capacity=1 << 24))


async def scan_keys(path: Path) -> set[ChunkKey]:
    tier = nvme_at(path)
    try:
        return {m.key async for m in tier.scan()}
    finally:
        await tier.close()


def test_write_through_put_is_on_disk_when_acknowledged(tmp_path: Path) -> None:
    """Scenario: with nvme-write-policy write-through, as soon as KV.PUT returns, an
    independent NvmeTier opened on the same folder finds the chunk (and a write-back store
    does not have it there yet)."""

    async def main() -> None:
        wt = tmp_path / "wt"
        async with open_store([make_dram(), nvme_at(wt)], nvme_write_policy="write-through") as s:
            assert await s.put(NS, b"a", b"", b"A" * 3000)
            assert await scan_keys(wt) == {ChunkKey(NS, b"a")}
            assert s.info(NS, b"a")["tiers"] == ["dram", "nvme"]
        wb = tmp_path / "wb"
        async with open_store([make_dram(), nvme_at(wb)], start=False) as s:
            assert await s.put(NS, b"a", b"", b"A" * 3000)
            assert await scan_keys(wb) == set()

    run(main())


def test_new_store_over_same_folder_rebuilds_index(tmp_path: Path) -> None:
    """Scenario: a store writes a 5-chunk chain through to NVMe and closes; a new store with
    an empty DRAM over the same folder rebuilds its index at start: the chain matches, lives
    in nvme, reads back identical (promoting to DRAM), and INFO persistence counts it."""

    async def main() -> None:
        folder = tmp_path / "nvme"
        hashes = chain(5)
        payloads = [bytes([i]) * (1000 + i) for i in range(5)]
        async with open_store(
            [make_dram(), nvme_at(folder)], nvme_write_policy="write-through"
        ) as s:
            parent = b""
            for h, data in zip(hashes, payloads, strict=True):
                assert await s.put(NS, h, parent, data, tokens=4)
                parent = h
        async with open_store([make_dram(), nvme_at(folder)]) as s:
            assert s.match(NS, hashes) == 5
            assert s.match_tiers(NS, hashes) == ["nvme"] * 5
            assert s.info(NS, hashes[2])["parent"] == hashes[1].hex()
            assert s.info(NS, hashes[1])["children"] == 1
            for h, data in zip(hashes, payloads, strict=True):
                p = await s.get(NS, h)
                assert bytes(p.view) == data
                if p.release:
                    p.release()
            assert s.match_tiers(NS, hashes) == ["dram"] * 5
            persistence = dict(s.info_sections()["persistence"])
            assert persistence["rebuild_chunks"] == 5
            assert persistence["rebuild_bytes"] == sum(len(p) for p in payloads)
            assert len(s.keyspace) == 5

    run(main())


def test_from_config_builds_dram_and_nvme(tmp_path: Path) -> None:
    async def main() -> None:
        config = make_config(
            data_dir=str(tmp_path), dram_capacity="1MiB", nvme_capacity="4MiB", dram_pin="no"
        )
        store = await KVStore.from_config(config, Keyspace())
        await store.start()
        try:
            assert [t.name for t in store.tiers] == ["dram", "nvme"]
            assert await store.put(NS, b"x", b"", b"x" * 10)
            regions = store.regions()
            assert regions and regions[0].kind == "shm"
        finally:
            await store.close()
        assert (tmp_path / "nvme").is_dir()

    run(main())
