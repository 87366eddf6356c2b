"""What only a GPU can show about the CUDA paths (issue 18); every test is marked ``gpu`` and
skipped with the reason on machines without CUDA. ``scripts/gpu-check.sh`` runs this file
first. Servers run in a subprocess: a CUDA IPC handle cannot be opened by the process that
exported it.

- release/commit racing a copy queued behind a long kernel (``torch.cuda._sleep``);
- a region's device found by PCI bus id; one libcudart per process;
- kvikio (or the POSIX path when kvikio is absent) with truncated and missing files, real pool;
- the HF integration leasing from a GPU-tier server: decoded from the pool, no MGET;
- a server restarting while this client holds a mapping of its old pool.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.tiers.gpu_select import gpu_available
from tests.conftest import RunningServer, start_process_server

CUDA_OK, CUDA_WHY = gpu_available(0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason=f"needs CUDA: {CUDA_WHY}")]

MiB = 1024 * 1024
NS = "gpucheck@ipc"
SLEEP_CYCLES = 400_000_000  # ~0.2 s on a 2 GHz GPU: long enough to lose the race without a fence


@pytest.fixture
def gpu_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    started: list[RunningServer] = []

    def start(name: str = "a", **kw: Any) -> RunningServer:
        srv = start_process_server(tmp_path / name, gpu_capacity="256MiB", **kw)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def _pattern(n: int, seed: int) -> Any:
    import torch

    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).cuda()


def test_commit_waits_for_a_write_queued_behind_a_long_kernel(gpu_server: Any) -> None:
    """The engine queues a long kernel, then the write into its reserved slot, then commits:
    the server must checksum the written bytes, not what the slot held before."""
    import torch

    from kvstrata.clients import Client

    srv = gpu_server()
    with Client(port=srv.port) as kv:
        src = _pattern(4 * MiB, 1)
        torch.cuda.synchronize()
        wl = kv.reserve(NS, b"w" * 16, None, src.numel(), tier="gpu")
        slot = wl.tensor()
        assert slot.is_cuda, "the reservation did not land in the GPU pool"
        torch.cuda._sleep(SLEEP_CYCLES)
        slot.copy_(src)  # queued behind the sleep
        wl.commit()
        got = kv.get(NS, b"w" * 16)
        assert bytes(got) == src.cpu().numpy().tobytes()


def test_release_waits_for_a_copy_queued_behind_a_long_kernel(gpu_server: Any) -> None:
    """The engine queues a long kernel, then a copy out of a leased chunk, then releases; the
    server deletes the chunk and fills the freed slot with other bytes at once. The engine's
    copy must still see the leased bytes."""
    import torch

    from kvstrata.clients import Client

    srv = gpu_server()
    with Client(port=srv.port) as kv:
        a = _pattern(4 * MiB, 2).cpu().numpy().tobytes()
        b = _pattern(4 * MiB, 3).cpu().numpy().tobytes()
        kv.put(NS, b"a" * 16, None, a)
        lease = kv.lease(NS, [b"a" * 16], tier="gpu")
        assert lease is not None
        view = lease.tensors()[0]
        assert view.is_cuda
        engine = torch.empty_like(view)
        torch.cuda._sleep(SLEEP_CYCLES)
        engine.copy_(view)  # queued behind the sleep
        lease.release()
        kv.delete(NS, b"a" * 16)
        kv.put(NS, b"b" * 16, None, b)
        again = kv.lease(NS, [b"b" * 16], tier="gpu")  # promoted into the freed slot
        assert again is not None
        again.release()
        torch.cuda.synchronize()
        assert engine.cpu().numpy().tobytes() == a


def test_region_device_by_bus_id_and_one_cudart(gpu_server: Any) -> None:
    """The region names its GPU by PCI bus id; the client maps it on the local device with that
    bus id; this process runs one libcudart (torch's), never a second one beside it."""
    from kvstrata.clients import Client, handles
    from kvstrata.cudart import load_cudart, mapped_cudart
    from kvstrata.tiers.gpu_runtime import CudartRuntime

    srv = gpu_server()
    with Client(port=srv.port) as kv:
        kv.put(NS, b"c" * 16, None, b"x" * MiB)
        lease = kv.lease(NS, [b"c" * 16], tier="gpu")
        assert lease is not None
        with lease:
            t = lease.tensors()[0]
            assert bytes(t.cpu().numpy()) == b"x" * MiB
            region = next(r for r in kv.regions(refresh=False) if r.kind == "cuda")
            assert region.pci_bus_id, "the server published no PCI bus id"
            local = handles._cuda[region.name].device
            assert t.device.index == local
            lib = load_cudart(search=False)
            assert CudartRuntime(lib).pci_bus_id(local).lower() == region.pci_bus_id.lower()
            del t
    maps = mapped_cudart()
    print(f"\n  client process maps {maps}; IPC through {handles._ipc_runtime().name}")
    assert len({os.path.realpath(p) for p in maps}) == 1, maps


def test_kvikio_truncated_and_missing_files_on_a_real_pool(tmp_path: Path) -> None:
    from kvstrata.chunks import ChunkKey, ChunkMeta
    from kvstrata.tiers.base import ChunkMissing, IntegrityError
    from kvstrata.tiers.checksum import checksum
    from kvstrata.tiers.gpu import GpuConfig, GpuTier
    from kvstrata.tiers.gpu_nvme import chunk_path, kvikio_mode, load_from_nvme
    from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

    async def body() -> None:
        gpu = GpuTier(GpuConfig(capacity=64 * MiB))
        nvme = NvmeTier(NvmeConfig(str(tmp_path / "nvme"), capacity=64 * MiB, io_threads=2))
        async for _ in nvme.scan():
            pass
        metas = []
        for i in range(3):
            data = _pattern(2 * MiB + 4096 * i, 10 + i).cpu().numpy().tobytes()
            meta = ChunkMeta(ChunkKey(NS, bytes([i]) * 16), b"", 0, len(data), checksum(data))
            await nvme.put(meta, data)
            metas.append(meta)
        how = await load_from_nvme(gpu, nvme.root, metas[0])
        print(f"\n  kvikio mode {kvikio_mode()}; good file read by {how}")
        os.truncate(chunk_path(nvme.root, metas[1]), 4096 + MiB)
        with pytest.raises(IntegrityError):
            await load_from_nvme(gpu, nvme.root, metas[1])
        os.unlink(chunk_path(nvme.root, metas[2]))
        with pytest.raises(ChunkMissing):
            await load_from_nvme(gpu, nvme.root, metas[2])
        assert gpu.info()["chunks"] == 1
        out = bytearray(metas[0].size)
        await gpu.get(metas[0].key, memoryview(out))
        assert checksum(out) == metas[0].checksum
        await nvme.close()
        await gpu.close()

    asyncio.run(body())


def test_hf_leases_from_a_gpu_tier_server(gpu_server: Any) -> None:
    """A CUDA process restores a cached prefix from a GPU-tier server through its pool."""
    pytest.importorskip("transformers", reason="the HF integration needs transformers")
    import torch

    from kvstrata.clients import Client
    from kvstrata.clients.hf import HFPrefixCache
    from tests.hf_fakes import tiny_llama

    srv = gpu_server()
    model = tiny_llama().cuda()
    ids = torch.randint(0, 500, (1, 70), generator=torch.Generator().manual_seed(4))

    class Counting(Client):
        mgets = 0

        def mget(self, *args: Any, **kw: Any) -> Any:
            Counting.mgets += 1
            return super().mget(*args, **kw)

    with Counting(port=srv.port) as kv:
        warm = HFPrefixCache(model, kv, chunk_tokens=16)
        warm.prefill(ids[:, :64])
        warm.wait_stored()
        pc = HFPrefixCache(model, kv, chunk_tokens=16)
        res = pc.prefill(ids)
        assert res.reused_tokens == 64
        assert pc.load == "auto" and Counting.mgets == 0, "fell back to MGET"


def test_server_restart_while_a_client_holds_a_mapping(gpu_server: Any) -> None:
    """Server A goes away while this process still holds a tensor over its pool; server B's
    pool is mapped afresh under the same region name, the old mapping is closed once the
    tensor goes, and CUDA in this process stays healthy."""
    import torch

    from kvstrata.clients import Client, handles

    first = gpu_server("a")
    with Client(port=first.port) as kv:
        kv.put(NS, b"r" * 16, None, b"1" * MiB)
        lease = kv.lease(NS, [b"r" * 16], tier="gpu")
        assert lease is not None
        held = lease.tensors()[0]
        old = handles._cuda[lease.handles[0].region]
        old_finalizer = old.finalizer
        del old
    first.stop()  # its pool is freed; we still hold `held` (never read it again)
    second = gpu_server("b")
    with Client(port=second.port) as kv:
        kv.put(NS, b"s" * 16, None, b"2" * MiB)
        with kv.lease(NS, [b"s" * 16], tier="gpu") as lease2:  # type: ignore[union-attr]
            assert bytes(lease2.tensors()[0].cpu().numpy()) == b"2" * MiB
    assert old_finalizer.alive  # `held` keeps the old mapping
    del held, lease
    gc.collect()
    assert not old_finalizer.alive, "the old pool's IPC mapping was never closed"
    torch.cuda.synchronize()
    torch.ones(16, device="cuda").sum().item()  # no sticky error from the closed mapping
