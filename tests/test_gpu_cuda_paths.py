"""The CUDA paths' defects found by review (issue 18), checked on CPU with stand-ins that record
the calls and their order: stream fences before release/commit/abort, IPC mappings closed when
their region changes or the client closes, devices found by PCI bus id, the runtime's last
error cleared after a failed call, the libcudart already loaded chosen over a second one,
kvikio's errors mapped (short read, vanished file, broken import → POSIX), kvikio's mode read
right across versions, a cancelled copy keeping its slot, a pool freed when a stream will not
go, and the HF integration reading ``cuda`` leases as tensors. What needs a device is in
``tests/test_gpu_ipc.py`` (marked gpu) and ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata import cudart
from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.clients import cuda_ipc, handles
from kvstrata.clients.aio import AsyncLease, AsyncWriteLease
from kvstrata.clients.regions import update_regions
from kvstrata.clients.results import Handle, LeaseGrant, RegionInfo, ReserveGrant, parse_region
from kvstrata.clients.sync import Lease, WriteLease
from kvstrata.tiers import _cuda, gpu_nvme, gpu_runtime
from kvstrata.tiers.base import ChunkMissing, IntegrityError
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import CudaMemory, HostMemory
from kvstrata.tiers.gpu_runtime import CudaCallError, CudartRuntime

MiB = 1024 * 1024
BUS = "0000:17:00.0"


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- stand-ins ------------------------------------------------------------------------------------


class FakeIpc:
    """An :class:`~kvstrata.clients.cuda_ipc.IpcRuntime` that records its calls."""

    name = "fake"

    def __init__(self, log: list[Any], devices: dict[str, int] | None = None) -> None:
        self.log = log
        self.devices = {BUS: 3} if devices is None else devices
        self.next_ptr = 0x7000_0000

    def open(self, raw: bytes, device: int) -> int:
        self.next_ptr += 0x100_0000
        self.log.append(("open", raw[:1].hex(), device, self.next_ptr))
        return self.next_ptr

    def close(self, ptr: int, device: int) -> None:
        self.log.append(("close", ptr, device))

    def device_by_bus_id(self, bus_id: str) -> int:
        if bus_id not in self.devices:
            raise RuntimeError("cudaErrorInvalidDevice")
        return self.devices[bus_id]


class FakeStream:
    def __init__(self, log: list[Any], device: int) -> None:
        self.log, self.device = log, device

    def synchronize(self) -> None:
        self.log.append(("sync", self.device))


class RecordingClient:
    """What a lease calls on its client: release/commit/abort, recorded in order."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def release(self, lease_id: Any, via: Any = None) -> None:
        self.log.append(("release", lease_id))

    def commit(self, lease_id: Any, via: Any = None, digests: Any = ()) -> None:
        self.log.append(("commit", lease_id))

    def abort(self, lease_id: Any, via: Any = None) -> None:
        self.log.append(("abort", lease_id))


class AsyncRecordingClient(RecordingClient):
    async def release(self, lease_id: Any, via: Any = None) -> None:  # type: ignore[override]
        self.log.append(("release", lease_id))

    async def commit(self, lease_id: Any, via: Any = None, digests: Any = ()) -> None:  # type: ignore[override]
        self.log.append(("commit", lease_id))

    async def abort(self, lease_id: Any, via: Any = None) -> None:  # type: ignore[override]
        self.log.append(("abort", lease_id))


def cuda_region(path: str = "ab" * 64, bus: str = BUS, name: str = "gpu0") -> RegionInfo:
    return RegionInfo(name, "cuda", 1 << 20, path, 0, bus)


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeIpc, list[Any]]:
    """A fresh mapping table and a recording IPC runtime; torch streams recorded too."""
    log: list[Any] = []
    fake = FakeIpc(log)
    monkeypatch.setattr(handles, "_cuda", {})
    monkeypatch.setattr(handles, "_ipc_runtime", lambda: fake)
    monkeypatch.setattr(cuda_ipc, "_torch_streams", lambda ds: [FakeStream(log, d) for d in ds])
    monkeypatch.setattr(cuda_ipc, "_cupy_streams", lambda ds: [])
    return fake, log


# -- 1. release/commit/abort wait for the engine's GPU work ---------------------------------------


def test_release_commit_abort_wait_for_the_callers_stream_first(ipc: Any) -> None:
    """The engine queues a copy out of a leased cuda chunk (or a write into a reserved slot)
    and ends the lease: the client synchronizes the caller's current stream on the region's
    local device (3, by bus id) before the server hears release/commit/abort."""
    _, log = ipc
    region = cuda_region()
    handles._open_cuda(region)  # a tensor was made: the region is mapped here
    regions = {region.name: region}
    client = RecordingClient(log)
    grant = LeaseGrant(b"r1", (Handle("gpu0", 0, 4096),))
    with Lease(client, "ns", [b"h"], grant, regions):  # type: ignore[arg-type]
        pass
    WriteLease(client, "ns", b"h", ReserveGrant(b"w1", Handle("gpu0", 0, 4096)), regions).commit()  # type: ignore[arg-type]
    WriteLease(client, "ns", b"h", ReserveGrant(b"w2", Handle("gpu0", 0, 4096)), regions).abort()  # type: ignore[arg-type]
    ended = [e for e in log if e[0] != "open"]
    assert ended == [
        ("sync", 3), ("release", b"r1"), ("sync", 3), ("commit", b"w1"), ("sync", 3),
        ("abort", b"w2"),
    ]  # fmt: skip


def test_async_lease_ends_wait_for_the_stream_captured_on_the_callers_thread(ipc: Any) -> None:
    _, log = ipc
    region = cuda_region()
    handles._open_cuda(region)
    regions = {region.name: region}

    async def body() -> None:
        client = AsyncRecordingClient(log)
        grant = LeaseGrant(b"r1", (Handle("gpu0", 0, 4096),))
        async with AsyncLease(client, "ns", [b"h"], grant, regions):  # type: ignore[arg-type]
            pass
        async with AsyncWriteLease(client, "ns", b"h", ReserveGrant(b"w1", Handle("gpu0", 0, 64)),  # type: ignore[arg-type]
                                   regions):  # fmt: skip
            pass

    asyncio.run(body())
    assert [e for e in log if e[0] != "open"] == [
        ("sync", 3),
        ("release", b"r1"),
        ("sync", 3),
        ("commit", b"w1"),
    ]


class BrokenStream:
    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failing_fence_still_ends_the_lease_but_never_commits(
    ipc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a CUDA error the device runs nothing more of ours: release and abort still reach
    the server (else the slots stay pinned until the TTL); commit aborts instead and raises,
    because the slot's bytes are not known to be complete."""
    _, log = ipc
    monkeypatch.setattr(cuda_ipc, "_torch_streams", lambda ds: [BrokenStream()])
    region = cuda_region()
    handles._open_cuda(region)
    regions = {region.name: region}
    client = RecordingClient(log)
    Lease(client, "ns", [b"h"], LeaseGrant(b"r", (Handle("gpu0", 0, 64),)), regions).release()  # type: ignore[arg-type]
    wl = WriteLease(client, "ns", b"h", ReserveGrant(b"w", Handle("gpu0", 0, 64)), regions)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        wl.commit()
    assert wl.done
    assert [e for e in log if e[0] != "open"] == [("release", b"r"), ("abort", b"w")]


def test_shm_leases_and_unmapped_cuda_regions_need_no_fence(ipc: Any) -> None:
    _, log = ipc
    shm = RegionInfo("dram0", "shm", 1 << 20, "nothing")
    regions = {"dram0": shm, "gpu0": cuda_region()}  # gpu0 never mapped: no views, no work
    client = RecordingClient(log)
    Lease(client, "ns", [b"a", b"b"], LeaseGrant(1, (Handle("dram0", 0, 8), Handle("gpu0", 0, 8))),  # type: ignore[arg-type]
          regions).release()  # fmt: skip
    assert log == [("release", 1)]


# -- 2. the HF integration reads cuda leases as tensors -------------------------------------------


def test_hf_reads_cuda_lease_handles_as_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with a GPU tier leases from its pool: HF decodes the chunks from tensors over
    the cuda handles instead of giving up on leases for good and paying MGET."""
    from kvstrata.clients.hf import HFPrefixCache
    from kvstrata.clients.leases import LeaseBase
    from tests.hf_fakes import FakeKVClient, tiny_llama

    pool = bytearray(1 << 20)

    def host_tensor(region: RegionInfo, h: Handle, dtype: Any) -> Any:  # stands in for cuda
        return torch.frombuffer(pool, dtype=torch.uint8, count=h.length, offset=h.offset)

    monkeypatch.setattr(handles, "_cuda_tensor", host_tensor)

    class LeasingClient(FakeKVClient):
        mgets = 0

        def mget(self, *args: Any, **kw: Any) -> list[Any]:
            self.mgets += 1
            return super().mget(*args, **kw)

        def lease(self, ns: str, hashes: list[bytes]) -> Any:
            grants, offset = [], 0
            for h in hashes:
                data = self.store[(ns, h)]
                pool[offset : offset + len(data)] = data
                grants.append(Handle("gpu0", offset, len(data)))
                offset += -(-len(data) // 4096) * 4096
            return Leased(ns, hashes, LeaseGrant(7, tuple(grants)), {"gpu0": cuda_region()})

    class Leased(LeaseBase):
        def release(self) -> None:
            pass

    model = tiny_llama()
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(3))
    client = LeasingClient()
    warm = HFPrefixCache(model, client, chunk_tokens=16)
    warm.prefill(ids[:, :32])
    warm.wait_stored()
    pc = HFPrefixCache(model, client, chunk_tokens=16)
    before = client.mgets
    res = pc.prefill(ids)
    assert res.reused_tokens == 32
    assert client.mgets == before and pc.load == "auto"


# -- 3. kvikio errors mapped, POSIX fallback ------------------------------------------------------


class _Future:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


def fake_kvikio(on_payload: Callable[[str], None] | None = None,
                mode: Any = False) -> types.ModuleType:  # fmt: skip
    """A kvikio module whose CuFile reads with os.pread into the host stand-in's buffers;
    ``on_payload(path)`` runs before the payload read (to truncate, delete or fail)."""
    mod = types.ModuleType("kvikio")

    class CuFile:
        def __init__(self, path: str, flags: str = "r") -> None:
            self.path = path
            self.fd = os.open(path, os.O_RDONLY)

        def __enter__(self) -> CuFile:
            return self

        def __exit__(self, *exc: object) -> None:
            os.close(self.fd)

        def pread(self, buf: Any, size: int, file_offset: int = 0) -> _Future:
            if file_offset and on_payload is not None:
                on_payload(self.path)
            data = os.pread(self.fd, size, file_offset)
            np.asarray(buf).reshape(-1)[: len(data)] = np.frombuffer(data, np.uint8)
            return _Future(len(data))

    defaults = types.ModuleType("kvikio.defaults")
    defaults.compat_mode = lambda: mode  # type: ignore[attr-defined]
    mod.CuFile = CuFile  # type: ignore[attr-defined]
    mod.defaults = defaults  # type: ignore[attr-defined]
    mod.__version__ = "0.fake"  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def nvme_chunk(tmp_path: Path) -> tuple[Any, ChunkMeta, bytes, str]:
    from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

    data = np.random.default_rng(5).integers(0, 256, MiB + 100, dtype=np.uint8).tobytes()
    meta = ChunkMeta(ChunkKey("gpu@kvikio", b"\x01" * 16), b"", 0, len(data), checksum(data))

    async def make() -> Any:
        nvme = NvmeTier(NvmeConfig(str(tmp_path / "nvme"), capacity=64 * MiB, io_threads=2))
        async for _ in nvme.scan():
            pass
        await nvme.put(meta, data)
        await nvme.close()
        return nvme

    nvme = asyncio.run(make())
    return nvme, meta, data, gpu_nvme.chunk_path(nvme.root, meta)


def _load(nvme: Any, meta: ChunkMeta) -> tuple[str | BaseException, GpuTier]:
    tier = GpuTier(GpuConfig(capacity=8 * MiB), memory=HostMemory(8 * MiB))

    async def body() -> str | BaseException:
        try:
            return await gpu_nvme.load_from_nvme(tier, nvme.root, meta, use_kvikio=True)
        except Exception as exc:
            return exc

    return asyncio.run(body()), tier


def _use_kvikio(monkeypatch: pytest.MonkeyPatch, mod: types.ModuleType | None) -> None:
    monkeypatch.setattr(gpu_nvme, "_kvikio_broken", "")
    monkeypatch.setitem(sys.modules, "kvikio", mod)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", getattr(mod, "defaults", None))


def _bytes_in(tier: GpuTier, meta: ChunkMeta) -> bytes:
    out = bytearray(meta.size)
    asyncio.run(tier.get(meta.key, memoryview(out)))
    return bytes(out)


def test_kvikio_reads_a_good_file(monkeypatch: pytest.MonkeyPatch, nvme_chunk: Any) -> None:
    nvme, meta, data, _ = nvme_chunk
    _use_kvikio(monkeypatch, fake_kvikio())
    how, tier = _load(nvme, meta)
    assert how == "kvikio-gds"
    assert _bytes_in(tier, meta) == data


def test_kvikio_file_truncated_before_the_read_is_an_integrity_error(
    monkeypatch: pytest.MonkeyPatch, nvme_chunk: Any
) -> None:
    nvme, meta, _, path = nvme_chunk
    _use_kvikio(monkeypatch, fake_kvikio())
    os.truncate(path, 4096 + 1000)
    err, tier = _load(nvme, meta)
    assert isinstance(err, IntegrityError) and "truncated" in str(err)
    assert tier.info()["used"] == 0  # the slot was freed


def _failing(action: Callable[[str], None]) -> Callable[[str], None]:
    def on_payload(path: str) -> None:
        action(path)
        raise RuntimeError("cuFile: (unknown) kvikio error")  # what kvikio raises for all

    return on_payload


def test_kvikio_short_read_is_an_integrity_error(monkeypatch: pytest.MonkeyPatch,
                                                 nvme_chunk: Any) -> None:  # fmt: skip
    nvme, meta, _, _ = nvme_chunk
    _use_kvikio(monkeypatch, fake_kvikio(_failing(lambda p: os.truncate(p, 8192))))
    err, tier = _load(nvme, meta)
    assert isinstance(err, IntegrityError), err
    assert tier.info()["used"] == 0


def test_kvikio_vanished_file_is_chunk_missing(monkeypatch: pytest.MonkeyPatch,
                                               nvme_chunk: Any) -> None:  # fmt: skip
    nvme, meta, _, _ = nvme_chunk
    _use_kvikio(monkeypatch, fake_kvikio(_failing(os.unlink)))
    err, _ = _load(nvme, meta)
    assert isinstance(err, ChunkMissing), err
    _use_kvikio(monkeypatch, fake_kvikio())
    err, _ = _load(nvme, meta)  # and now missing before the read
    assert isinstance(err, ChunkMissing), err


def test_kvikio_failure_on_an_intact_file_falls_back_to_posix(
    monkeypatch: pytest.MonkeyPatch, nvme_chunk: Any
) -> None:
    nvme, meta, data, _ = nvme_chunk
    _use_kvikio(monkeypatch, fake_kvikio(_failing(lambda p: None)))
    how, tier = _load(nvme, meta)
    assert how == "posix"
    assert _bytes_in(tier, meta) == data


@pytest.mark.parametrize("error", [OSError("libcufile.so.0: cannot open shared object file"),
                                   ImportError("libkvikio.so: undefined symbol")])  # fmt: skip
def test_broken_kvikio_import_falls_back_to_posix(
    monkeypatch: pytest.MonkeyPatch, nvme_chunk: Any, error: Exception
) -> None:
    nvme, meta, data, _ = nvme_chunk
    monkeypatch.setattr(gpu_nvme, "_kvikio_broken", "")

    def broken(name: str) -> Any:
        raise error

    monkeypatch.setattr(gpu_nvme, "_import", broken)
    how, tier = _load(nvme, meta)
    assert how == "posix"
    assert _bytes_in(tier, meta) == data
    assert "cannot be imported" in gpu_nvme._kvikio_broken


# -- 8. kvikio's mode across versions -------------------------------------------------------------


class CompatMode(enum.IntEnum):  # kvikio >= 24.12
    OFF = 0
    ON = 1
    AUTO = 2


def _defaults(**attrs: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**attrs)


def test_kvikio_mode_reads_each_versions_setting() -> None:
    assert gpu_nvme.compat_mode_of(_defaults(compat_mode=lambda: True)) == "compat"  # <= 24.10
    assert gpu_nvme.compat_mode_of(_defaults(compat_mode=lambda: False)) == "gds"
    # 24.12-25.02: AUTO is truthy but means "try cuFile first"
    assert gpu_nvme.compat_mode_of(_defaults(compat_mode=lambda: CompatMode.AUTO)) == "auto"
    assert gpu_nvme.compat_mode_of(_defaults(compat_mode=lambda: CompatMode.OFF)) == "gds"
    newer = _defaults(get=lambda key: {"compat_mode": CompatMode.AUTO}[key],
                      is_compat_mode_preferred=lambda: False)  # fmt: skip
    assert gpu_nvme.compat_mode_of(newer) == "auto-gds"  # >= 25.04: the global guess, named so
    on = _defaults(get=lambda key: CompatMode.ON, is_compat_mode_preferred=lambda: True)
    assert gpu_nvme.compat_mode_of(on) == "compat"


# -- 4/5. IPC mappings: closed on region change and close_all, device by PCI bus id -------------


def test_region_change_closes_the_old_mapping_once_its_views_are_gone(ipc: Any) -> None:
    _, log = ipc
    old = handles._open_cuda(cuda_region("ab" * 64))
    assert handles._open_cuda(cuda_region("ab" * 64)) is old  # mapped once
    view_owner = old  # a live tensor holds its mapping (as _CudaArray.owner)
    del old
    new = handles._open_cuda(cuda_region("cd" * 64))  # restarted server: same name, new pool
    assert new.ptr != view_owner.ptr
    assert not [e for e in log if e[0] == "close"]  # a view still uses the old pool
    old_ptr = view_owner.ptr
    del view_owner
    gc.collect()
    assert ("close", old_ptr, 3) in log
    assert handles.close_all() == 1  # the test still holds `new`, as a view would
    gc.collect()
    assert ("close", new.ptr, 3) not in log
    ptr = new.ptr
    del new
    gc.collect()
    assert ("close", ptr, 3) in log


def test_close_all_counts_cuda_mappings_kept_by_views(ipc: Any) -> None:
    _, log = ipc
    kept = handles._open_cuda(cuda_region())
    assert handles.close_all() == 1
    ptr = kept.ptr
    del kept
    gc.collect()
    assert log[-1] == ("close", ptr, 3)


def test_a_gone_instance_is_unmapped_through_the_same_mapping_objects(ipc: Any) -> None:
    """Issue 10 meets issue 18: mappings are kept per server instance; refreshing the region
    table after a restart drops the old instance's mapping, which is closed (once, through
    cudaIpcCloseMemHandle) when the last view made from it goes, never while one is alive."""
    _, log = ipc
    path = "ab" * 64
    old = replace(cuda_region(path), instance="1111")
    new = replace(cuda_region(path), instance="2222")  # same pool name (and even IPC bytes)
    view_owner = handles._open_cuda(old)
    assert handles._open_cuda(new) is not view_owner  # never resolved through 1111's mapping
    table = update_regions({"gpu0": old}, [new], [Handle("gpu0", 0, 4096, "2222")])
    assert table == {"gpu0": new}
    assert handles.mapped_devices([old]) == set()  # no longer mapped here
    assert handles.mapped_devices([new]) == {3}
    gc.collect()
    assert not [e for e in log if e[0] == "close"]  # a view still uses the old mapping
    ptr = view_owner.ptr
    del view_owner
    gc.collect()
    assert [e for e in log if e[0] == "close"] == [("close", ptr, 3)]
    assert handles.unmap_regions([new]) == 0  # nothing holds it: closed at once
    assert len([e for e in log if e[0] == "close"]) == 2


def test_device_is_found_by_pci_bus_id_not_ordinal(ipc: Any) -> None:
    _, log = ipc
    mapping = handles._open_cuda(cuda_region())  # the server's ordinal 0 is our device 3
    assert mapping.device == 3 and log[0][2] == 3
    with pytest.raises(handles.CudaUnavailable, match="CUDA_VISIBLE_DEVICES"):
        handles._open_cuda(cuda_region(bus="0000:99:00.0", name="gpu1"))
    legacy = handles._open_cuda(RegionInfo("gpu2", "cuda", 1 << 20, "ef" * 64, 1))
    assert legacy.device == 1  # an older server without a bus id: its ordinal


def test_regions_carry_the_pci_bus_id() -> None:
    region = parse_region({"name": "gpu0", "kind": "cuda", "size": 8, "path": "00", "device": 0,
                           "pci_bus_id": BUS})  # fmt: skip
    assert region.pci_bus_id == BUS
    assert parse_region({"name": "d", "kind": "shm", "size": 8, "path": "p"}).pci_bus_id == ""
    tier = GpuTier(GpuConfig(capacity=MiB), memory=HostMemory(MiB))
    assert tier.regions()[0].pci_bus_id == ""  # the stand-in has none; CudaMemory asks CUDA


# -- 6. last error cleared after a failed call ---------------------------------------------------


class FakeFn:
    def __init__(self, log: list[str], name: str, rc: int) -> None:
        self.log, self.name, self.rc = log, name, rc
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> Any:
        self.log.append(self.name)
        return self.rc


class FakeLib:
    """A libcudart whose calls return the codes in ``rcs`` (0 otherwise) and are recorded."""

    def __init__(self, rcs: dict[str, int]) -> None:
        self.calls: list[str] = []
        self.rcs = rcs

    def __getattr__(self, name: str) -> FakeFn:
        fn = (_ErrorString(self.calls) if name == "cudaGetErrorString"
              else FakeFn(self.calls, name, self.rcs.get(name, 0)))  # fmt: skip
        object.__setattr__(self, name, fn)  # argtypes set once stay set, as on a CDLL
        return fn


class _ErrorString(FakeFn):
    def __init__(self, log: list[str]) -> None:
        super().__init__(log, "cudaGetErrorString", 0)

    def __call__(self, *args: Any) -> Any:
        return b"out of memory"


def test_failed_runtime_call_clears_the_last_error() -> None:
    lib = FakeLib({"cudaMalloc": 2})
    rt = CudartRuntime(lib)  # type: ignore[arg-type]
    with pytest.raises(CudaCallError, match="out of memory"):
        rt.malloc(1 << 40)
    assert lib.calls[-2:] == ["cudaMalloc", "cudaGetLastError"]
    rt.free(0)
    assert lib.calls[-1] == "cudaFree"  # success: nothing to clear


def test_failed_ipc_open_clears_the_last_error_and_restores_the_device() -> None:
    lib = FakeLib({"cudaIpcOpenMemHandle": 201})
    with pytest.raises(cuda_ipc.IpcError):
        cuda_ipc.CudartIpc(lib).open(b"\0" * 64, 3)
    assert lib.calls == ["cudaGetDevice", "cudaSetDevice", "cudaIpcOpenMemHandle",
                         "cudaGetLastError", "cudaSetDevice"]  # fmt: skip


def test_failed_host_register_through_torch_clears_the_last_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cleared: list[bool] = []
    fake_rt = types.SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: 712)
    monkeypatch.setattr(_cuda, "_runtime", lambda: ("torch", fake_rt))
    monkeypatch.setattr(_cuda, "clear_last_error", lambda lib=None: cleared.append(True))
    assert _cuda.host_register(0x1000, 4096) == "cudaHostRegister failed with error 712"
    assert cleared == [True]


# -- 7. the libcudart already loaded, never a second one ------------------------------------------


MAPS = """\
7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6
7f20-7f30 r-xp 00000000 08:01 2 /venv/nvidia/cu13/lib/libcudart.so.13
7f30-7f40 r--p 00010000 08:01 2 /venv/nvidia/cu13/lib/libcudart.so.13
7f50-7f60 rw-p 00000000 00:00 0
"""


def test_mapped_cudart_reads_proc_maps() -> None:
    assert cudart.mapped_cudart(MAPS) == ["/venv/nvidia/cu13/lib/libcudart.so.13"]
    assert cudart.mapped_cudart("") == []


def test_load_cudart_prefers_the_runtime_already_loaded() -> None:
    loads: list[str] = []

    def load(name: str) -> str:
        loads.append(name)
        return name

    torch_imports: list[bool] = []
    mapped = ["/venv/nvidia/cu13/lib/libcudart.so.13"]
    got = cudart.load_cudart(load, lambda: mapped, lambda: torch_imports.append(True))
    assert got == mapped[0] and loads == mapped and torch_imports == []


def test_load_cudart_imports_torch_then_looks_again() -> None:
    mapped: list[str] = []
    got = cudart.load_cudart(lambda n: n, lambda: list(mapped),
                             lambda: mapped.append("/t/libcudart.so.13"))  # fmt: skip
    assert got == "/t/libcudart.so.13"


def test_load_cudart_searches_newest_soname_first_and_never_the_bare_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried: list[str] = []

    def load(name: str) -> str:
        tried.append(name)
        if name != "libcudart.so.12":
            raise OSError(name)
        return name

    monkeypatch.setattr(cudart, "wheel_cudart_paths", lambda: [])
    assert cudart.load_cudart(load, lambda: [], lambda: None) == "libcudart.so.12"
    assert tried == ["libcudart.so.13", "libcudart.so.12"]
    assert cudart.load_cudart(load, lambda: [], lambda: None, search=False) is None


def test_server_runtime_prefers_cupy_to_loading_a_fresh_libcudart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    searches: list[bool] = []

    def find(search: bool = True) -> Any:
        searches.append(search)
        return None if not search else FakeLib({})

    monkeypatch.setattr(gpu_runtime, "find_cudart", find)
    monkeypatch.setattr(gpu_runtime, "CupyRuntime", lambda: "cupy-runtime")
    assert gpu_runtime.load_runtime() == "cupy-runtime"
    assert searches == [False]


# -- 8. a cancelled copy keeps its slot; close frees the pool even if a stream will not go -------


def test_cancelled_copy_frees_its_slot_only_when_the_thread_ends() -> None:
    tier = GpuTier(GpuConfig(capacity=4 * MiB), memory=HostMemory(4 * MiB))
    started, finish = threading.Event(), threading.Event()
    meta = ChunkMeta(ChunkKey("gpu@cancel", b"\x02" * 16), b"", 0, MiB, b"\0" * 16)

    def slow_fill(mem: Any, offset: int) -> None:
        started.set()
        assert finish.wait(10)

    async def body() -> None:
        task = asyncio.create_task(tier.put_from(meta, slow_fill))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tier.info()["used"] == MiB  # the thread still writes there: not reusable
        finish.set()
        deadline = time.monotonic() + 10
        while tier.info()["used"]:
            assert time.monotonic() < deadline, "the slot was never freed"
            await asyncio.sleep(0.005)
        await tier.close()

    asyncio.run(body())


def test_cancelled_read_keeps_a_deleted_chunks_slot_until_the_thread_ends() -> None:
    tier = GpuTier(GpuConfig(capacity=4 * MiB), memory=HostMemory(4 * MiB))
    started, finish = threading.Event(), threading.Event()
    data = b"r" * MiB
    meta = ChunkMeta(ChunkKey("gpu@cancel", b"\x03" * 16), b"", 0, MiB, checksum(data))

    def slow_read(mem: Any, offset: int) -> None:
        started.set()
        assert finish.wait(10)

    async def body() -> None:
        await tier.put(meta, data)
        task = asyncio.create_task(tier.read_with(meta.key, slow_read))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await tier.delete(meta.key)
        assert tier.info()["used"] == MiB  # the reading thread still has the slot
        finish.set()
        deadline = time.monotonic() + 10
        while tier.info()["used"]:
            assert time.monotonic() < deadline, "the deferred free never ran"
            await asyncio.sleep(0.005)
        await tier.close()

    asyncio.run(body())


class StreamStuckRuntime:
    name = "fake"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def set_device(self, device: int) -> None:
        pass

    def pci_bus_id(self, device: int) -> str:
        return BUS

    def malloc(self, nbytes: int) -> int:
        return 0x1000

    def free(self, ptr: int) -> None:
        self.calls.append(f"free {ptr:#x}")

    def stream_create(self) -> int:
        return 5

    def stream_destroy(self, stream: int) -> None:
        self.calls.append("stream_destroy")
        raise CudaCallError("cudaStreamDestroy failed: an illegal memory access (700)")


def test_cuda_memory_close_frees_the_pool_when_a_stream_destroy_fails() -> None:
    rt = StreamStuckRuntime()
    mem = CudaMemory(rt, 0, MiB)  # type: ignore[arg-type]
    assert mem.pci_bus_id == BUS
    mem._stream()
    mem.close()
    assert rt.calls == ["stream_destroy", "free 0x1000"]
