"""The GPU tier: its bookkeeping on CPU (over a host stand-in) and its CUDA paths (marked gpu).

On machines without CUDA every test here that does not need a device runs over
:class:`~kvstrata.tiers.gpu_memory.HostMemory`: the shared contract suite, the allocator, the
chunk table, handles and regions, deferred frees during copies, the NVMe → GPU read path (its
POSIX variant) and the client-side refusal of ``cuda`` regions. Tests marked ``gpu`` need CUDA
and are skipped with the reason elsewhere; ``scripts/gpu-check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.alloc import OffsetAllocator
from kvstrata.tiers.base import ChunkMissing, IntegrityError, Tier, TierError, TierFull
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import HostMemory, NoHostView
from kvstrata.tiers.gpu_nvme import chunk_path, load_from_nvme
from kvstrata.tiers.gpu_runtime import CudaCallError
from kvstrata.tiers.gpu_select import gpu_available
from tests.test_tier_contract import (  # the shared contract suite, run here over the gpu tier
    CAPACITY,
    TierCase,
    test_batch_forms,
    test_capacity_and_used_accounting,
    test_close_is_idempotent,
    test_delete_and_contains,
    test_get_accepts_memoryview_of_numpy,
    test_get_into_too_small_buffer_errors,
    test_meta_is_kept,
    test_missing_key,
    test_replace_frees_old_space,
    test_replace_is_atomic,
    test_round_trip_exact_bytes,
    test_stats_move,
    test_tier_full,
)

CONTRACT = [
    test_batch_forms, test_capacity_and_used_accounting, test_close_is_idempotent,
    test_delete_and_contains, test_get_accepts_memoryview_of_numpy,
    test_get_into_too_small_buffer_errors, test_meta_is_kept, test_missing_key,
    test_replace_frees_old_space, test_replace_is_atomic, test_round_trip_exact_bytes,
    test_stats_move, test_tier_full,
]  # fmt: skip

MiB = 1024 * 1024
CUDA_OK, CUDA_WHY = gpu_available(0)
needs_cuda = pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_WHY}")


def gpu_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a test as needing CUDA (``-m gpu`` selects it; skipped with the reason elsewhere)."""
    return pytest.mark.gpu(needs_cuda(fn))


def host_tier(capacity: int = CAPACITY, **kw: Any) -> GpuTier:
    return GpuTier(GpuConfig(capacity=capacity, **kw), memory=HostMemory(capacity))


def cuda_tier(capacity: int = CAPACITY) -> GpuTier:
    if not CUDA_OK:
        pytest.skip(f"needs CUDA: {CUDA_WHY}")
    return GpuTier(GpuConfig(capacity=capacity))


async def _make_host(tmp_path: Path) -> Tier:
    return host_tier()


async def _make_cuda(tmp_path: Path) -> Tier:
    return cuda_tier()


@pytest.fixture(
    params=[
        pytest.param(TierCase("gpu-host", _make_host), id="gpu-host"),
        pytest.param(TierCase("gpu-cuda", _make_cuda), id="gpu-cuda", marks=pytest.mark.gpu),
    ]
)
def case(request: pytest.FixtureRequest) -> TierCase:
    """Overrides the contract suite's fixture: the imported tests run against these tiers."""
    param: TierCase = request.param
    return param


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def meta_of(data: bytes, i: int = 1, ns: str = "gpu@test") -> ChunkMeta:
    return ChunkMeta(ChunkKey(ns, i.to_bytes(8, "big")), b"", 0, len(data), checksum(data))


def payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class DeviceLikeMemory(HostMemory):
    """HostMemory that behaves like device memory: no host views."""

    host_addressable = False

    def host_view(self, offset: int, nbytes: int) -> memoryview:
        raise NoHostView("device memory")


class GatedMemory(HostMemory):
    """HostMemory whose device → host copies wait for ``gate`` (to hold a read in flight)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.gate = threading.Event()
        self.started = threading.Event()

    def to_host(self, offset: int, dst: memoryview) -> None:
        self.started.set()
        self.gate.wait(10)
        super().to_host(offset, dst)


# -- bookkeeping over the host stand-in -------------------------------------------------------


def test_pool_uses_the_dram_allocator_and_aligned_slots() -> None:
    async def body() -> None:
        tier = host_tier(capacity=CAPACITY + 100)
        assert isinstance(tier._alloc, OffsetAllocator)
        assert tier.capacity == CAPACITY  # the tail shorter than 4096 is never handed out
        for i, size in enumerate([1, 4095, 4097, 10_000]):
            data = payload(size, i)
            await tier.put(meta_of(data, i), data)
            assert tier.handle(meta_of(data, i).key).offset % 4096 == 0
        assert tier.used == 4096 + 4096 + 8192 + 12288
        assert tier.info()["backend"] == "host" and tier.info()["chunks"] == 4
        await tier.close()

    run(body)


def test_regions_and_handles() -> None:
    """KV.REGIONS lists the pool once as kind cuda with its device and hex IPC handle; handles
    of committed and reserved chunks lie inside it."""

    async def body() -> None:
        tier = GpuTier(GpuConfig(device=3, capacity=4 * MiB), memory=HostMemory(4 * MiB, 3))
        [region] = tier.regions()
        assert (region.name, region.kind, region.size, region.device) == (
            "gpu3",
            "cuda",
            4 * MiB,
            3,
        )
        assert bytes.fromhex(region.path) == tier.memory.ipc_handle() and len(region.path) == 128
        data = payload(5000)
        meta = meta_of(data)
        await tier.put(meta, data)
        h = tier.handle(meta.key)
        assert (h.region, h.length) == ("gpu3", 5000) and h.offset + h.length <= region.size
        r = tier.reserve_handle(meta_of(b"x", 2).key, 7000)
        assert r == tier.reserved_handle(meta_of(b"x", 2).key) and r.offset != h.offset
        with pytest.raises(ChunkMissing):
            tier.handle(meta_of(b"x", 2).key)  # reserved chunks have no read handle
        await tier.close()

    run(body)


def test_reserve_commit_abort() -> None:
    torch = pytest.importorskip("torch")

    async def body() -> None:
        tier = host_tier()
        data = payload(10_000, 5)
        meta = meta_of(data)
        tier.reserve_handle(meta.key, meta.size)
        assert not tier.has(meta.key) and not await tier.contains(meta.key)
        with pytest.raises(TierError, match="pending reservation"):
            tier.reserve_handle(meta.key, meta.size)
        tier.reserved_tensor(meta.key).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with pytest.raises(ValueError):
            tier.commit(meta_of(data[:-1]))
        tier.commit(meta)
        assert bytes(tier.tensor(meta.key).numpy()) == data
        out = bytearray(meta.size)
        assert await tier.get(meta.key, memoryview(out)) == meta and out == data
        used = tier.used
        tier.reserve_handle(meta_of(b"y", 2).key, 4096)
        assert tier.used == used + 4096
        tier.abort(meta_of(b"y", 2).key)
        tier.abort(meta_of(b"y", 2).key)  # a second abort is a no-op
        assert tier.used == used
        with pytest.raises(ChunkMissing):
            tier.commit(meta_of(b"y", 2))
        await tier.close()

    run(body)


def test_device_memory_has_no_host_views() -> None:
    """Over device memory view()/reserve() refuse (NoHostView is a TierError) and reserve()
    allocates nothing; tensors, handles and host copies still work."""

    async def body() -> None:
        tier = GpuTier(GpuConfig(capacity=MiB), memory=DeviceLikeMemory(MiB))
        data = payload(3000)
        meta = meta_of(data)
        await tier.put(meta, data)
        with pytest.raises(NoHostView):
            tier.view(meta.key)
        with pytest.raises(TierError):
            tier.reserve(meta_of(b"z", 9).key, 100)
        assert tier.used == 4096
        out = bytearray(3000)
        await tier.get(meta.key, memoryview(out))
        assert out == data
        await tier.close()

    run(body)


def test_delete_during_a_read_defers_the_free() -> None:
    """Scenario: a device → host copy is in flight when the chunk is deleted and another chunk
    is put; the slot being read is not handed out again until the copy ends."""

    async def body() -> None:
        mem = GatedMemory(2 * 4096)
        tier = GpuTier(GpuConfig(capacity=2 * 4096), memory=mem)
        a, b = payload(4096, 1), payload(4096, 2)
        await tier.put(meta_of(a, 1), a)
        out = bytearray(4096)
        reader = asyncio.ensure_future(tier.get(meta_of(a, 1).key, memoryview(out)))
        await asyncio.get_running_loop().run_in_executor(None, mem.started.wait, 10)
        assert await tier.delete(meta_of(a, 1).key)
        assert tier.used == 4096  # deferred
        await tier.put(meta_of(b, 2), b)  # takes the other slot
        with pytest.raises(TierFull):
            await tier.put(meta_of(b, 3), b)
        mem.gate.set()
        assert await reader == meta_of(a, 1) and out == a
        assert tier.used == 4096
        await tier.put(meta_of(b, 3), b)
        await tier.close()

    run(body)


def test_failed_copy_frees_the_slot_and_counts() -> None:
    class Failing(HostMemory):
        def to_device(self, offset: int, src: memoryview) -> None:
            raise CudaCallError("cudaMemcpyAsync failed: an illegal memory access (700)")

    async def body() -> None:
        tier = GpuTier(GpuConfig(capacity=MiB), memory=Failing(MiB))
        with pytest.raises(TierError, match="illegal memory access"):
            await tier.put(meta_of(b"abc"), b"abc")
        assert tier.used == 0 and tier.stats.errors == 1 and not tier.has(meta_of(b"abc").key)
        await tier.close()

    run(body)


def test_put_checks_size_and_closed_tier_refuses() -> None:
    async def body() -> None:
        tier = host_tier()
        with pytest.raises(ValueError):
            await tier.put(meta_of(b"abcd"), b"abc")
        await tier.close()
        with pytest.raises(TierError, match="closed"):
            await tier.put(meta_of(b"abc"), b"abc")
        with pytest.raises(TierError, match="closed"):
            tier.reserve_handle(meta_of(b"abc").key, 3)

    run(body)


# -- NVMe → GPU (POSIX path over the stand-in; kvikio path under -m gpu) ----------------------


async def _nvme_with(tmp_path: Path, meta: ChunkMeta, data: bytes, slab_max: int = 0) -> Any:
    """An NVMe tier holding one chunk: as a chunk file (``slab_max`` 0) or in a slab slot."""
    from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

    config = NvmeConfig(str(tmp_path / "nvme"), capacity=64 * MiB, io_threads=2, slab_max=slab_max)
    nvme = NvmeTier(config)
    async for _ in nvme.scan():
        pass
    await nvme.put(meta, data)
    return nvme


def test_nvme_to_gpu_posix_path(tmp_path: Path) -> None:
    async def body() -> None:
        data = payload(MiB + 123, 7)
        meta = meta_of(data)
        nvme = await _nvme_with(tmp_path, meta, data)
        tier = host_tier()
        assert await load_from_nvme(tier, nvme.root, meta) == "posix"
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out == data
        await tier.close()
        await nvme.close()

    run(body)


def test_nvme_to_gpu_reads_a_slab_slot_and_refuses_a_corrupt_one(tmp_path: Path) -> None:
    """A chunk held in a slab slot loads from the offset the tier locates; a flipped payload
    byte in the slot never publishes."""

    async def body() -> None:
        data = payload(20_000, 9)
        meta = meta_of(data)
        nvme = await _nvme_with(tmp_path, meta, data, slab_max=MiB)
        path, base = nvme.locate(meta.key)
        assert path.endswith(".slab") and base >= 4096
        tier = host_tier()
        assert await load_from_nvme(tier, nvme.root, meta, at=(path, base)) == "posix"
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out == data
        await tier.delete(meta.key)
        with open(path, "r+b") as f:
            f.seek(base + 4096 + 10_000)
            byte = f.read(1)
            f.seek(base + 4096 + 10_000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError, match="checksum"):
            await load_from_nvme(tier, nvme.root, meta, at=(path, base))
        assert not tier.has(meta.key) and nvme.locate(meta_of(data, 2).key) is None
        await tier.close()
        await nvme.close()

    run(body)


def test_nvme_to_gpu_refuses_wrong_bytes(tmp_path: Path) -> None:
    """A flipped payload byte, a file of another chunk and a missing file never publish."""

    async def body() -> None:
        data = payload(20_000, 8)
        meta = meta_of(data)
        nvme = await _nvme_with(tmp_path, meta, data)
        tier = host_tier()
        path = chunk_path(nvme.root, meta)
        with open(path, "r+b") as f:
            f.seek(4096 + 10_000)
            byte = f.read(1)
            f.seek(4096 + 10_000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(IntegrityError, match="checksum"):
            await load_from_nvme(tier, nvme.root, meta)
        other = meta_of(data, 2)
        os.makedirs(os.path.dirname(chunk_path(nvme.root, other)), exist_ok=True)
        os.replace(path, chunk_path(nvme.root, other))
        with pytest.raises(IntegrityError, match="header"):
            await load_from_nvme(tier, nvme.root, other)
        with pytest.raises(ChunkMissing):
            await load_from_nvme(tier, nvme.root, meta)
        assert tier.used == 0 and not tier.has(meta.key) and not tier.has(other.key)
        await tier.close()
        await nvme.close()

    run(body)


def test_gpu_check_script_dry_run(tmp_path: Path) -> None:
    """scripts/gpu_check.py runs its whole benchmark over the host stand-in (no CUDA)."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "gpu_check.py"), "--dry-run", "--chunk-mib", "1",
         "--chunks", "2", "--repeat", "1", "--nvme-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"].split()[0] for r in rows] == ["DRAM→GPU", "GPU→DRAM", "NVMe→GPU"]


# -- client side without CUDA -----------------------------------------------------------------


@pytest.mark.skipif(CUDA_OK, reason="checks the refusal on machines without CUDA")
def test_client_refuses_cuda_regions_without_cuda() -> None:
    """The region a GPU tier lists, seen by a client process without CUDA: a clear error."""
    from kvstrata.clients.handles import CudaUnavailable, handle_tensor
    from kvstrata.clients.results import Handle, RegionInfo

    tier = host_tier()
    r = tier.regions()[0]
    region = RegionInfo(r.name, r.kind, r.size, r.path, r.device)
    with pytest.raises(CudaUnavailable, match="CUDA"):
        handle_tensor(region, Handle(r.name, 0, 4096))
    asyncio.run(tier.close())


# -- store: leases and expiry ------------------------------------------------------------------


def _store_lease_expiry(make: Callable[[], GpuTier]) -> None:
    from tests.fakes import make_dram, open_store

    async def body() -> None:
        gpu = make()
        base = gpu.used
        async with open_store([gpu, make_dram(4 * MiB)]) as store:
            data = payload(64 * 1024, 3)
            await store.put("gpu@test", b"h0", b"", data)
            lease = await store.lease("gpu@test", [b"h0"], ttl_ms=30)  # default tier: gpu
            assert lease is not None and lease.handles[0].region == gpu.region_name
            assert gpu.used > base
            await store.delete("gpu@test", b"h0")  # pinned by the lease: freed at expiry
            for _ in range(100):
                if gpu.used == base:
                    break
                await asyncio.sleep(0.02)
            assert gpu.used == base and len(store.leases) == 0

    asyncio.run(body())


def test_lease_expiry_frees_gpu_memory_host() -> None:
    _store_lease_expiry(host_tier)


# -- on a GPU ---------------------------------------------------------------------------------


@gpu_test
def test_lease_expiry_frees_gpu_memory() -> None:
    _store_lease_expiry(cuda_tier)


@gpu_test
def test_cuda_put_get_and_tensor_view() -> None:
    import torch

    async def body() -> None:
        tier = cuda_tier(64 * MiB)
        data = payload(8 * MiB + 5, 11)
        meta = meta_of(data)
        await tier.put(meta, data)
        t = tier.tensor(meta.key)
        assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == meta.size
        expected = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
        assert torch.equal(t, expected)
        t[:4] = 7  # a view, not a copy: the chunk changes
        torch.cuda.synchronize()  # the tier copies on its own streams, not torch's
        out = bytearray(meta.size)
        await tier.get(meta.key, memoryview(out))
        assert out[:4] == b"\x07" * 4 and out[4:] == data[4:]
        assert tier.memory.backend in ("cudart", "cupy")
        await tier.close()

    run(body)


_CHILD = r"""
import json, sys
import torch, xxhash
from kvstrata.clients.handles import handle_tensor
from kvstrata.clients.results import Handle, RegionInfo
spec = json.loads(sys.argv[1])
region = RegionInfo(**spec["region"])
read = handle_tensor(region, Handle(**spec["read"]))
print(xxhash.xxh3_128_hexdigest(read.cpu().numpy().tobytes()), flush=True)
write = handle_tensor(region, Handle(**spec["write"]))
n = write.numel()
write.copy_(torch.arange(n, device=write.device).remainder(251).to(torch.uint8))
torch.cuda.synchronize()
"""


@gpu_test
def test_second_process_reads_and_writes_through_ipc() -> None:
    """Another process opens the pool's IPC handle, reads a committed chunk (same checksum) and
    fills a reserved slot that this process then commits and reads back."""

    async def body() -> None:
        tier = cuda_tier(64 * MiB)
        data = payload(3 * MiB + 1, 12)
        meta = meta_of(data)
        await tier.put(meta, data)
        wkey = meta_of(b"w", 2).key
        wh = tier.reserve_handle(wkey, 2 * MiB)
        r = tier.regions()[0]
        h = tier.handle(meta.key)
        spec = {
            "region": {"name": r.name, "kind": r.kind, "size": r.size, "path": r.path,
                       "device": r.device},
            "read": {"region": h.region, "offset": h.offset, "length": h.length},
            "write": {"region": wh.region, "offset": wh.offset, "length": wh.length},
        }  # fmt: skip
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", _CHILD, json.dumps(spec)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == checksum(data).hex()
        written = (np.arange(2 * MiB) % 251).astype(np.uint8).tobytes()
        tier.commit(ChunkMeta(wkey, b"", 0, 2 * MiB, checksum(written)))
        out = bytearray(2 * MiB)
        await tier.get(wkey, memoryview(out))
        assert checksum(out) == checksum(written)
        await tier.close()

    run(body)


@gpu_test
def test_gpu_dram_nvme_gpu_round_trip(tmp_path: Path) -> None:
    """GPU → DRAM (pinned arena) → NVMe → GPU with the checksum checked at every hop."""
    from kvstrata.tiers.dram import DramConfig, DramTier
    from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

    async def body() -> None:
        gpu = cuda_tier(64 * MiB)
        dram = DramTier(DramConfig(capacity=64 * MiB, name_prefix="kvstrata-gpu-test"))
        nvme = NvmeTier(NvmeConfig(str(tmp_path / "nvme"), capacity=256 * MiB))
        async for _ in nvme.scan():
            pass
        data = payload(16 * MiB + 77, 13)
        meta = meta_of(data)
        await gpu.put(meta, data)
        view = dram.reserve(meta.key, meta.size)
        await gpu.get(meta.key, view)
        assert checksum(view) == meta.checksum
        dram.commit(meta)
        await nvme.put(meta, dram.view(meta.key))
        await gpu.delete(meta.key)
        assert gpu.used == 0
        await load_from_nvme(gpu, nvme.root, meta)
        out = bytearray(meta.size)
        await gpu.get(meta.key, memoryview(out))
        assert checksum(out) == meta.checksum
        for t in (gpu, dram, nvme):
            await t.close()

    run(body)


@gpu_test
def test_kvikio_reads_straight_into_gpu_memory(tmp_path: Path) -> None:
    pytest.importorskip("kvikio", reason="kvikio is not installed (pip install kvikio-cu12)")

    async def body() -> None:
        data = payload(32 * MiB, 14)
        meta = meta_of(data)
        nvme = await _nvme_with(tmp_path, meta, data)
        gpu = cuda_tier(64 * MiB)
        how = await load_from_nvme(gpu, nvme.root, meta, use_kvikio=True)
        assert how.startswith("kvikio-")
        out = bytearray(meta.size)
        await gpu.get(meta.key, memoryview(out))
        assert out == data
        path = chunk_path(nvme.root, meta)
        with open(path, "r+b") as f:
            f.seek(4096 + 5)
            f.write(b"\x00\x01\x02")
        await gpu.delete(meta.key)
        with pytest.raises(IntegrityError):
            await load_from_nvme(gpu, nvme.root, meta, use_kvikio=True)
        assert gpu.used == 0
        await gpu.close()
        await nvme.close()

    run(body)
