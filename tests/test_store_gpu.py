"""The store with a GPU tier on top, on CPU: a :class:`GpuTier` over the ``HostMemory``
stand-in (device bookkeeping, handles, copies in and out) below which the store runs unchanged.

What these tests show is the store's wiring (promotion on lease, reservations in the pool,
demotion to DRAM, reads of GPU-only chunks, start-up and INFO); none of it ran on a GPU. The
CUDA forms of the same paths are in ``tests/test_gpu_tier.py`` under ``-m gpu``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.config import load_config
from kvstrata.protocol.errors import CommandError
from kvstrata.store.index import ChunkRecord
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.kvstore import KVStore
from kvstrata.tiers import gpu as gpu_module
from kvstrata.tiers import gpu_select
from kvstrata.tiers.base import TierUnavailable
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import HostMemory
from kvstrata.tiers.gpu_nvme import chunk_path
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier
from tests.fakes import make_dram, meta_for, open_store, wait_until

NS = "gpu@c4"
KiB = 1024
MiB = 1024 * KiB
CHUNK = 64 * KiB


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


CUDA_OK, CUDA_WHY = gpu_select.gpu_available(0)


@pytest.fixture(
    params=[
        pytest.param("host", id="host"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]
)
def new_gpu(request: pytest.FixtureRequest) -> Callable[..., GpuTier]:
    """Makes the GPU tier of a test: over the host stand-in, or (``-m gpu``, CUDA only) a real
    pool, so the same scenarios can be run on a GPU machine."""
    if request.param == "cuda" and not CUDA_OK:
        pytest.skip(f"needs CUDA: {CUDA_WHY}")

    def make(capacity: int = MiB) -> GpuTier:
        if request.param == "cuda":
            return GpuTier(GpuConfig(capacity=capacity))
        return GpuTier(GpuConfig(capacity=capacity), memory=HostMemory(capacity))

    return make


def host_gpu(capacity: int = MiB) -> GpuTier:
    return GpuTier(GpuConfig(capacity=capacity), memory=HostMemory(capacity))


def gpu_bytes(gpu: GpuTier, offset: int, length: int) -> bytes:
    """Bytes of the pool at ``offset`` (a device → host copy: works on both memories)."""
    out = bytearray(length)
    gpu.memory.to_host(offset, memoryview(out))
    return bytes(out)


def record(store: KVStore, h: bytes) -> ChunkRecord:
    rec = store.index.get(ChunkKey(NS, h))
    assert rec is not None
    return rec


async def gpu_only(store: KVStore, h: bytes, data: bytes) -> ChunkRecord:
    """Store a chunk, lease it into the GPU, release it and drop its DRAM copy."""
    assert await store.put(NS, h, b"", data)
    lease = await store.lease(NS, [h], tier="gpu")
    assert lease is not None
    store.release(lease.id)
    rec = record(store, h)
    await store.state.delete_copy(rec, "dram")
    assert rec.tiers == {"gpu"}
    return rec


# -- promotion on lease ----------------------------------------------------------------------


def test_lease_tier_gpu_promotes_a_dram_chunk(new_gpu: Callable[..., GpuTier]) -> None:
    """Scenario: a chunk PUT lands in DRAM; KV.LEASE TIER gpu copies it into the pool and hands
    out a handle in the gpu region over the same bytes; TIER dram hands out the arena slot."""

    async def main() -> None:
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            data = payload(CHUNK + 123, 1)
            assert await store.put(NS, b"a", b"", data)
            assert record(store, b"a").tiers == {"dram"}
            lease = await store.lease(NS, [b"a"], tier="gpu")
            assert lease is not None
            [h] = lease.handles
            assert h.region == gpu.region_name == "gpu0" and h.length == len(data)
            assert gpu_bytes(gpu, h.offset, h.length) == data
            assert record(store, b"a").tiers == {"gpu", "dram"}
            assert store.stats()["gpu"]["promotions"] == 1 and gpu.used >= len(data)
            assert store.info(NS, b"a")["tiers"] == ["gpu", "dram"]
            store.release(lease.id)
            default = await store.lease(NS, [b"a"])  # the fastest shareable tier: gpu
            assert default is not None and default.handles[0].region == "gpu0"
            store.release(default.id)
            host = await store.lease(NS, [b"a"], tier="dram")
            assert host is not None and host.handles[0].region.startswith("dram")
            store.release(host.id)
            assert store.stats()["gpu"]["promotions"] == 1  # already there: no second copy

    run(main())


def test_lease_falls_back_to_dram_when_the_gpu_has_no_room(new_gpu: Callable[..., GpuTier]) -> None:
    """Every slot of the pool is leased: the next chunk is leased from DRAM in the same lease."""

    async def main() -> None:
        gpu = new_gpu(2 * CHUNK)
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            for i, h in enumerate((b"a", b"b", b"c")):
                assert await store.put(NS, h, b"", payload(CHUNK, i))
            first = await store.lease(NS, [b"a", b"b"], tier="gpu")
            assert first is not None and {x.region for x in first.handles} == {"gpu0"}
            second = await store.lease(NS, [b"c"], tier="gpu")
            assert second is not None and second.handles[0].region.startswith("dram")
            assert "gpu" not in record(store, b"c").tiers

    run(main())


def test_lease_tier_errors_without_a_gpu_tier() -> None:
    async def main() -> None:
        async with open_store() as store:
            assert await store.put(NS, b"a", b"", b"x" * 100)
            with pytest.raises(CommandError, match="no gpu tier"):
                await store.lease(NS, [b"a"], tier="gpu")
            lease = await store.lease(NS, [b"a"])  # default without a gpu tier: dram
            assert lease is not None and lease.handles[0].region.startswith("dram")
            assert store.info_sections()["tiers"][1][0] == "gpu_status"

    run(main())


async def _nvme_with(root: Path, chunks: dict[bytes, bytes], slab_max: int = MiB) -> NvmeTier:
    """An NVMe tier holding ``chunks``: in slab slots, or chunk files with ``slab_max`` 0."""
    config = NvmeConfig(str(root), capacity=64 * MiB, io_threads=2, slab_max=slab_max)
    nvme = NvmeTier(config)
    async for _ in nvme.scan():
        pass
    for h, data in chunks.items():
        await nvme.put(meta_for(NS, h, data), data)
    return nvme


def test_nvme_only_chunk_is_leased_straight_into_the_gpu(
    tmp_path: Path, new_gpu: Callable[..., GpuTier]
) -> None:
    """A chunk held only on NVMe is read from its file into a GPU slot (load_from_nvme, the
    POSIX form over the stand-in): no DRAM copy is made, the bytes are identical."""

    async def main() -> None:
        data = payload(CHUNK * 2 + 5, 2)
        nvme = await _nvme_with(tmp_path / "nvme", {b"n": data})
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB), nvme]) as store:
            assert record(store, b"n").tiers == {"nvme"}
            lease = await store.lease(NS, [b"n"], tier="gpu")
            assert lease is not None
            [h] = lease.handles
            assert h.region == "gpu0" and gpu_bytes(gpu, h.offset, h.length) == data
            assert record(store, b"n").tiers == {"gpu", "nvme"}
            assert store.stats()["gpu"]["promotions"] == 1

    run(main())


@pytest.mark.parametrize("slab_max", [0, MiB], ids=["file", "slot"])
def test_corrupt_nvme_file_is_never_leased_into_the_gpu(
    tmp_path: Path, new_gpu: Callable[..., GpuTier], slab_max: int
) -> None:
    """A flipped payload byte in the NVMe chunk file or slab slot: the slot is not published,
    the bad copy is dropped (counted as an integrity error) and the lease is a miss, not
    wrong KV."""

    async def main() -> None:
        data = payload(CHUNK, 3)
        nvme = await _nvme_with(tmp_path / "nvme", {b"n": data}, slab_max)
        path, base = nvme.locate(ChunkKey(NS, b"n"))
        assert path == chunk_path(nvme.root, meta_for(NS, b"n", data)) or base > 0
        with open(path, "r+b") as f:
            f.seek(base + 4096 + 100)
            byte = f.read(1)
            f.seek(base + 4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB), nvme]) as store:
            assert await store.lease(NS, [b"n"], tier="gpu") is None
            assert store.index.get(ChunkKey(NS, b"n")) is None
            assert gpu.used == 0 and nvme.stats.integrity_errors == 1
            assert nvme.locate(ChunkKey(NS, b"n")) is None
            if not slab_max:
                assert not os.path.exists(path)

    run(main())


# -- leases end ------------------------------------------------------------------------------


def test_read_lease_expiry_lets_the_gpu_copy_go(new_gpu: Callable[..., GpuTier]) -> None:
    """A chunk deleted while leased from the GPU keeps its slot until the lease expires."""

    async def main() -> None:
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            assert await store.put(NS, b"a", b"", payload(CHUNK, 4))
            lease = await store.lease(NS, [b"a"], ttl_ms=30, tier="gpu")
            assert lease is not None and gpu.used > 0
            await store.delete(NS, b"a")
            assert gpu.used > 0  # pinned by the lease
            assert await wait_until(lambda: gpu.used == 0)
            assert len(store.leases) == 0

    run(main())


def test_write_lease_in_the_gpu_expires_and_aborts(new_gpu: Callable[..., GpuTier]) -> None:
    async def main() -> None:
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            lease = await store.reserve(NS, b"w", b"", CHUNK, ttl_ms=30, tier="gpu")
            assert lease.handle.region == "gpu0" and gpu.used == CHUNK
            assert await wait_until(lambda: gpu.used == 0)
            assert store.index.get(ChunkKey(NS, b"w")) is None
            again = await store.reserve(NS, b"w", b"", CHUNK, tier="gpu")  # the key is free
            store.abort(again.id)
            assert gpu.used == 0

    run(main())


# -- writes into the GPU ---------------------------------------------------------------------


def test_reserve_commit_in_the_gpu(new_gpu: Callable[..., GpuTier]) -> None:
    """Scenario: an engine reserves a slot in the pool, fills it through its handle and
    commits; the server copies the slot to DRAM, checksums it and commits both copies."""

    async def main() -> None:
        gpu = new_gpu()
        dram = make_dram(4 * MiB)
        async with open_store([gpu, dram]) as store:
            data = payload(CHUNK + 7, 5)
            lease = await store.reserve(NS, b"w", b"", len(data), tokens=4, tier="gpu")
            h = lease.handle
            assert h.region == "gpu0" and not gpu.has(ChunkKey(NS, b"w"))
            gpu.memory.to_device(h.offset, memoryview(data))  # what the engine writes
            await store.commit(lease.id)
            rec = record(store, b"w")
            assert rec.tiers == {"gpu", "dram"} and rec.checksum == checksum(data)
            assert rec.tokens == 4
            assert bytes(dram.view(rec.key)) == data
            assert gpu_bytes(gpu, gpu.handle(rec.key).offset, len(data)) == data
            got = await store.get(NS, b"w")
            assert got is not None and bytes(got.view) == data
            if got.release:
                got.release()
            aborted = await store.reserve(NS, b"x", b"", CHUNK, tier="gpu")
            used = gpu.used
            store.abort(aborted.id)
            assert gpu.used == used - CHUNK and store.index.get(ChunkKey(NS, b"x")) is None

    run(main())


def test_reserve_tier_gpu_falls_back_to_dram_and_needs_a_gpu_tier() -> None:
    async def main() -> None:
        gpu = host_gpu(CHUNK)
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            held = await store.reserve(NS, b"a", b"", CHUNK, tier="gpu")
            assert held.handle.region == "gpu0"
            other = await store.reserve(NS, b"b", b"", CHUNK, tier="gpu")  # pool is full
            assert other.handle.region.startswith("dram")
            for lease in (held, other):
                store.abort(lease.id)
        async with open_store() as store:
            with pytest.raises(CommandError, match="no gpu tier"):
                await store.reserve(NS, b"a", b"", 100, tier="gpu")

    run(main())


# -- demotion and reads ----------------------------------------------------------------------


def test_gpu_eviction_demotes_lru_chunks_to_dram_with_identical_bytes(
    new_gpu: Callable[..., GpuTier],
) -> None:
    """Scenario: four GPU-only chunks fill a four-slot pool; leasing a fifth demotes the least
    recently used one to DRAM (gpu.get into a DRAM reservation, checksummed), and lowering the
    watermarks at run time makes the demoter move more of them; every demoted chunk has its
    original bytes in DRAM."""

    async def main() -> None:
        gpu = new_gpu(4 * CHUNK)
        dram = make_dram(4 * MiB)
        no_demoter = {"gpu_high_watermark": "1.0", "gpu_low_watermark": "1.0"}
        async with open_store([gpu, dram], **no_demoter) as store:  # type: ignore[arg-type]
            chunks = {bytes([65 + i]): payload(CHUNK, 10 + i) for i in range(5)}
            names = list(chunks)
            for h in names[:4]:
                await gpu_only(store, h, chunks[h])
            assert gpu.used == 4 * CHUNK
            assert await store.put(NS, names[4], b"", chunks[names[4]])
            lease = await store.lease(NS, [names[4]], tier="gpu")
            assert lease is not None and lease.handles[0].region == "gpu0"
            first = record(store, names[0])
            assert first.tiers == {"dram"}  # the LRU one left the pool for DRAM
            assert checksum(dram.view(first.key)) == first.checksum
            assert bytes(dram.view(first.key)) == chunks[names[0]]
            assert store.stats()["gpu"]["demotions"] == 1
            store.config.set("gpu-low-watermark", "0.25")
            store.config.set("gpu-high-watermark", "0.5")
            store.placement.kick()
            assert await wait_until(lambda: gpu.used <= CHUNK)
            for h in names[1:4]:
                rec = record(store, h)
                if "gpu" not in rec.tiers:
                    assert "dram" in rec.tiers and bytes(dram.view(rec.key)) == chunks[h]
            assert "gpu" in record(store, names[4]).tiers  # leased: never moved
            store.release(lease.id)

    run(main())


def test_get_of_a_gpu_only_chunk_returns_the_exact_bytes(new_gpu: Callable[..., GpuTier]) -> None:
    """KV.GET copies a GPU-only chunk into a DRAM slot (checksummed) and serves that; a chunk
    in both tiers is served from DRAM without a device copy."""

    async def main() -> None:
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            data = payload(CHUNK + 1, 6)
            rec = await gpu_only(store, b"g", data)
            before = gpu.stats.hits  # device → host copies
            got = await store.get(NS, b"g")
            assert got is not None and bytes(got.view) == data
            if got.release:
                got.release()
            assert gpu.stats.hits == before + 1 and rec.tiers == {"gpu", "dram"}
            again = await store.get(NS, b"g")
            assert again is not None and bytes(again.view) == data
            if again.release:
                again.release()
            assert gpu.stats.hits == before + 1  # served from DRAM

    run(main())


def test_prefetch_to_gpu(new_gpu: Callable[..., GpuTier]) -> None:
    async def main() -> None:
        gpu = new_gpu()
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            hashes = [b"p0", b"p1", b"p2"]
            parent = b""
            for i, h in enumerate(hashes):
                assert await store.put(NS, h, parent, payload(CHUNK, 20 + i))
                parent = h
            _, queued = store.prefetch_request(NS, hashes, "gpu")
            assert queued == 3
            await store.prefetch_idle()
            assert all("gpu" in record(store, h).tiers for h in hashes)
            assert store.match_tiers(NS, hashes) == ["gpu"] * 3

    run(main())


# -- start-up and INFO -----------------------------------------------------------------------


def _config(tmp_path: Path, **flags: str) -> Any:
    base = {"dram-capacity": "4MiB", "nvme-capacity": "0", "data-dir": str(tmp_path)}
    return load_config(flags={**base, **flags}, env={})


def test_from_config_refuses_a_gpu_tier_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = "torch.cuda.is_available() is False: torch 2.13.0+cpu is a CPU-only build"
    monkeypatch.setattr(gpu_select, "gpu_available", lambda device=0: (False, why))

    async def main() -> None:
        with pytest.raises(TierUnavailable) as info:
            await KVStore.from_config(_config(tmp_path, **{"gpu-capacity": "1GiB"}), Keyspace())
        assert str(info.value) == (
            f"gpu-capacity is 1GiB but CUDA is not available ({why}); set --gpu-capacity 0"
        )

    run(main())


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """from_config builds the gpu tier over the host stand-in (the probe says CUDA is there)."""
    monkeypatch.setattr(
        gpu_select, "gpu_available", lambda device=0: (True, f"cuda:{device} (Fake) via torch")
    )
    monkeypatch.setattr(gpu_module, "open_device_memory", lambda c: HostMemory(c.capacity))


def test_from_config_builds_the_gpu_tier_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_cuda(monkeypatch)

    async def main() -> None:
        cfg = _config(tmp_path, **{"gpu-capacity": "2MiB", "gpu-copy-threads": "3"})
        store = await KVStore.from_config(cfg, Keyspace())
        try:
            assert [t.name for t in store.tiers] == ["gpu", "dram"]
            gpu = store.state.gpu
            assert gpu is not None and gpu.capacity == 2 * MiB and gpu.config.copy_threads == 3
            tiers = dict(store.info_sections()["tiers"])
            assert tiers["gpu_status"] == "enabled: cuda:0 (Fake) via torch"
            assert tiers["gpu_backend"] == "host" and tiers["tiers"] == "gpu,dram"
        finally:
            await store.close()
        plain = await KVStore.from_config(_config(tmp_path / "b"), Keyspace())
        try:
            status = dict(plain.info_sections()["tiers"])["gpu_status"]
            assert str(status).startswith(("disabled: gpu-capacity is 0", "absent: no CUDA"))
        finally:
            await plain.close()

    run(main())


def test_server_info_and_client_tiers(
    make_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real server (gpu tier over the stand-in) and the Python client: INFO tiers
    says why there is a gpu tier; a client process without CUDA gets DRAM handles by default
    (it sends TIER dram), and gets gpu handles only when it asks for them."""
    from kvstrata.clients import Client
    from kvstrata.clients import handles as client_handles

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(client_handles, "cuda_usable", lambda: False)
    srv = make_server(gpu_capacity="2MiB", nvme_capacity="0")
    with Client(port=srv.port) as kv:
        info = kv.execute("INFO", "tiers")
        text = bytes(info).decode()
        assert "gpu_status:enabled: cuda:0 (Fake) via torch" in text and "tiers:gpu,dram" in text
        assert kv.put(NS, b"a", b"", payload(CHUNK, 30))
        host = kv.lease(NS, [b"a"])
        assert host is not None and host.handles[0].region.startswith("dram")
        assert bytes(host.views()[0]) == payload(CHUNK, 30)
        host.release()
        device = kv.lease(NS, [b"a"], tier="gpu")
        assert device is not None and device.handles[0].region == "gpu0"
        device.release()
        assert {r.kind for r in kv.regions()} == {"shm", "cuda"}
        grant = kv.reserve(NS, b"w", b"", CHUNK, tier="gpu")
        assert grant.handle.region == "gpu0"
        grant.abort()


def test_client_sends_tier_dram_only_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstrata.clients import commands as cmd
    from kvstrata.clients import handles as client_handles

    monkeypatch.setattr(client_handles, "cuda_usable", lambda: False)
    assert client_handles.lease_tier(None) == "dram"
    assert client_handles.lease_tier("gpu") == "gpu"
    monkeypatch.setattr(client_handles, "cuda_usable", lambda: True)
    assert client_handles.lease_tier(None) is None
    assert cmd.lease(NS, [b"a"], 100, "dram").args == ("KV.LEASE", NS, b"a", "TTL", 100, "TIER",
                                                       "dram")  # fmt: skip
    assert cmd.lease(NS, [b"a"]).args == ("KV.LEASE", NS, b"a")
