"""Zero-copy access to chunks the server shares: map each region once, view handles in it.

``shm`` regions (the server's DRAM arena) are POSIX shared memory: they are opened with
``multiprocessing.shared_memory.SharedMemory(name, create=False)`` once per process and
unregistered from Python's resource tracker, which would otherwise unlink the server's arena
when this process exits. A handle (region, offset, length) then becomes a ``memoryview``, a numpy
array (``np.frombuffer``) or a torch tensor (``torch.frombuffer``) over the same pages: no copy.
Views of a read lease are read-only (numpy) or must be treated as such (torch has no read-only
tensors); views of a reserved slot are writable.

``cuda`` regions (the server's GPU pool) carry a CUDA IPC memory handle (hex of the 64-byte
``cudaIpcMemHandle_t``) and the GPU's PCI bus id. They are opened once per process through the
CUDA runtime torch (or CuPy) already loaded, on the local device with that bus id
(:mod:`kvstrata.clients.cuda_ipc`), and exposed as torch tensors (:func:`handle_tensor`) or
CuPy arrays (:func:`handle_cupy`). A region whose handle changes (restarted server) is mapped
afresh and the old mapping closed (``cudaIpcCloseMemHandle``) when its last view goes; so is
every mapping after :func:`close_all`. Without CUDA the functions raise
:class:`CudaUnavailable` saying so.

A server with a GPU tier leases into it by default. :func:`lease_tier` is what the clients
send with ``KV.LEASE``: ``TIER dram`` when this process cannot use CUDA (no NVIDIA device
nodes, torch absent, or ``torch.cuda.is_available()`` False), so CPU-only engines never get
``cuda`` handles; otherwise nothing (the server's default).

A view stays valid while its lease is held: after ``release``/``commit`` the server may reuse the
bytes, so copy out what must outlive the lease.

Region identity: every region and every handle carries the ``instance`` identity of the server
that made it (random per start, never a PID). Mappings are kept per instance, and a handle is
only ever resolved through the mapping of its own instance: a client kept open across a server
restart never reads the previous server's arena for a new lease (the clients re-read
``KV.REGIONS`` when a handle names an instance they do not know, and refuse a handle whose
region still does not match). :func:`unmap_regions` drops the mappings of instances that are
gone; a mapping still used by live views stays until the last of them is freed (a ``cuda``
one is then closed with ``cudaIpcCloseMemHandle``, through the same mapping objects).
"""

from __future__ import annotations

import functools
import glob
import threading
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from kvstrata.clients.cuda_ipc import IpcMapping, IpcRuntime, ipc_runtime
from kvstrata.clients.results import Handle, RegionInfo

__all__ = [
    "CudaUnavailable",
    "HandleViews",
    "RegionMapError",
    "close_all",
    "cuda_usable",
    "handle_array",
    "handle_cupy",
    "handle_tensor",
    "handle_view",
    "lease_tier",
    "map_shm",
    "mapped_devices",
    "unmap_regions",
]


class RegionMapError(RuntimeError):
    """A region cannot be mapped here (another host, gone, wrong kind, out of bounds)."""


class CudaUnavailable(RegionMapError):
    """A ``cuda`` handle was given but this process has no usable CUDA."""


_lock = threading.Lock()
_shm: dict[tuple[str, str], shared_memory.SharedMemory] = {}  # (instance, path) -> mapping
_cuda: dict[tuple[str, str], IpcMapping] = {}  # (instance, region name) -> its IPC mapping
_ipc_runtime = ipc_runtime  # a seam: the tests record IPC calls with a stand-in


def _key(region: RegionInfo) -> tuple[str, str]:
    return (region.instance, region.path)


def map_shm(region: RegionInfo) -> memoryview:
    """The whole ``shm`` region as a writable memoryview (mapped once per process and
    server instance)."""
    if region.kind != "shm":
        raise RegionMapError(f"region {region.name!r} is {region.kind!r}, not shm")
    with _lock:
        shm = _shm.get(_key(region))
        if shm is None:
            shm = _open_shm(region)
            _shm[_key(region)] = shm
    buf = shm.buf
    assert buf is not None
    return buf


def _unmap_shm(shm: shared_memory.SharedMemory) -> bool:
    """Close our mapping; True when live views still use it (it is then unmapped with the
    last of them: we drop our reference to the mmap and close the descriptor)."""
    try:
        shm.close()
        return False
    except BufferError:  # the views keep the memoryview and the mmap alive on their own
        setattr(shm, "_buf", None)  # noqa: B010
        setattr(shm, "_mmap", None)  # noqa: B010
        shm.close()
        return True


def unmap_regions(regions: Iterable[RegionInfo]) -> int:
    """Forget the mappings of ``regions`` (of a server instance that is gone): no handle is
    resolved through them again. Returns how many stay mapped for live views until those are
    freed (shm), or until the last tensor/CuPy array made from them is (cuda: the
    :class:`~kvstrata.clients.cuda_ipc.IpcMapping` is then closed)."""
    busy = 0
    with _lock:
        for region in regions:
            shm = _shm.pop(_key(region), None)
            if shm is not None:
                busy += _unmap_shm(shm)
            mapping = _cuda.get((region.instance, region.name))
            if mapping is not None and mapping.path == region.path:
                del _cuda[(region.instance, region.name)]
                finalizer = mapping.finalizer
                del mapping  # closed now unless a view keeps it
                busy += finalizer.alive
    return busy


def _open_shm(region: RegionInfo) -> shared_memory.SharedMemory:
    try:
        shm = shared_memory.SharedMemory(name=region.path, create=False)
    except FileNotFoundError:
        raise RegionMapError(
            f"shared memory {region.path!r} of region {region.name!r} does not exist here "
            "(is the server on another host?)"
        ) from None
    try:  # Python registers even attached segments; the server owns (and unlinks) this one
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass
    if shm.size < region.size:
        shm.close()
        raise RegionMapError(f"region {region.name!r} is {shm.size} bytes, expected {region.size}")
    return shm


def _check_bounds(region: RegionInfo, handle: Handle) -> None:
    if handle.region != region.name:
        raise RegionMapError(f"handle is in region {handle.region!r}, not {region.name!r}")
    if handle.instance != region.instance:
        raise RegionMapError(
            f"handle of region {handle.region!r} belongs to server instance "
            f"{handle.instance or '?'!r}, the region mapped here to {region.instance or '?'!r} "
            "(the server restarted: lease again)"
        )
    if handle.offset < 0 or handle.length < 0 or handle.offset + handle.length > region.size:
        raise RegionMapError(f"handle {handle} lies outside region {region.name!r}")


def handle_view(region: RegionInfo, handle: Handle, writable: bool = False) -> memoryview:
    """The handle's bytes in an ``shm`` region as a memoryview (read-only unless writable)."""
    _check_bounds(region, handle)
    view = map_shm(region)[handle.offset : handle.offset + handle.length]
    return view if writable else view.toreadonly()


def handle_array(
    region: RegionInfo, handle: Handle, dtype: Any = np.uint8, writable: bool = False
) -> np.ndarray:
    """The handle's bytes as a 1-D numpy array of ``dtype`` (``shm`` regions only)."""
    _check_bounds(region, handle)
    dt = np.dtype(dtype)
    if handle.length % dt.itemsize:
        raise ValueError(f"{handle.length} bytes are not a whole number of {dt} items")
    arr = np.frombuffer(
        map_shm(region), dtype=dt, count=handle.length // dt.itemsize, offset=handle.offset
    )
    if not writable:
        arr.flags.writeable = False
    return arr


def handle_tensor(region: RegionInfo, handle: Handle, dtype: Any = None) -> Any:
    """The handle's bytes as a 1-D torch tensor (CPU for ``shm``, CUDA for ``cuda`` regions)."""
    import torch

    dtype = torch.uint8 if dtype is None else dtype
    _check_bounds(region, handle)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if handle.length % itemsize:
        raise ValueError(f"{handle.length} bytes are not a whole number of {dtype} items")
    if region.kind == "cuda":
        return _cuda_tensor(region, handle, dtype)
    if handle.length == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(
        map_shm(region), dtype=dtype, count=handle.length // itemsize, offset=handle.offset
    )


def _cuda_tensor(region: RegionInfo, handle: Handle, dtype: Any) -> Any:
    import torch

    mapping = _open_cuda(region)
    holder = _CudaArray(mapping.ptr + handle.offset, handle.length, mapping)
    flat = torch.as_tensor(holder, device=f"cuda:{mapping.device}")
    return flat.view(dtype)


class _CudaArray:
    """Exposes device memory through ``__cuda_array_interface__`` (no copy); the tensor made
    from it keeps it, and so ``owner`` (the IPC mapping), alive."""

    def __init__(self, ptr: int, nbytes: int, owner: Any = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def handle_cupy(region: RegionInfo, handle: Handle, dtype: Any = np.uint8) -> Any:
    """The handle's bytes in a ``cuda`` region as a 1-D CuPy array of ``dtype`` (no copy)."""
    try:
        import cupy
    except ImportError:
        raise CudaUnavailable("handle_cupy needs CuPy (cupy-cuda13x or cupy-cuda12x)") from None
    _check_bounds(region, handle)
    dt = np.dtype(dtype)
    if handle.length % dt.itemsize:
        raise ValueError(f"{handle.length} bytes are not a whole number of {dt} items")
    mapping = _open_cuda(region)
    memory = cupy.cuda.UnownedMemory(
        mapping.ptr + handle.offset, handle.length, mapping, mapping.device
    )
    pointer = cupy.cuda.MemoryPointer(memory, 0)
    return cupy.ndarray((handle.length // dt.itemsize,), dtype=dt, memptr=pointer)


@functools.cache
def cuda_usable() -> bool:
    """Whether this process can view ``cuda`` handles: NVIDIA device nodes exist and torch
    says ``torch.cuda.is_available()``. Cached; torch is imported only where the nodes exist."""
    if not (glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/dxg")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def lease_tier(tier: str | None) -> str | None:
    """The ``TIER`` a client sends with KV.LEASE: ``tier`` when given, else ``dram`` when this
    process cannot use CUDA, else None (the server's default: gpu when it has a GPU tier)."""
    if tier is not None:
        return tier
    return None if cuda_usable() else "dram"


def _open_cuda(region: RegionInfo) -> IpcMapping:
    """The mapping of ``region`` in this process, opened once per server instance. A region
    whose IPC handle changed under the same instance and name replaces the old mapping, which
    is closed once no view of it is left (:class:`~kvstrata.clients.cuda_ipc.IpcMapping`)."""
    if region.kind != "cuda":
        raise RegionMapError(f"region {region.name!r} is {region.kind!r}, not cuda")
    key = (region.instance, region.name)
    with _lock:
        mapping = _cuda.get(key)
        if mapping is None or mapping.path != region.path:
            _cuda.pop(key, None)  # the old pool: closed when its last view goes
            mapping = _ipc_map(region)
            _cuda[key] = mapping
    return mapping


def _ipc_map(region: RegionInfo) -> IpcMapping:
    runtime = _ipc_runtime()
    if runtime is None:
        raise CudaUnavailable(
            "the server shares GPU memory (cuda region) but CUDA is not available in this "
            "process (needs torch with CUDA or CuPy); use KV.GET or ask for TIER dram leases"
        )
    device = _local_device(runtime, region)
    try:
        ptr = runtime.open(bytes.fromhex(region.path), device)
    except Exception as exc:  # IpcError, CuPy's CUDARuntimeError
        why = f"could not open the CUDA IPC handle of {region.name!r}: {exc}"
        raise CudaUnavailable(why) from exc
    return IpcMapping(region.path, ptr, device, runtime)


def _local_device(runtime: IpcRuntime, region: RegionInfo) -> int:
    """This process's ordinal of the region's GPU: by PCI bus id when the server sent one."""
    if not region.pci_bus_id:
        return max(region.device, 0)
    try:
        return runtime.device_by_bus_id(region.pci_bus_id)
    except Exception as exc:
        raise CudaUnavailable(
            f"GPU {region.pci_bus_id} of region {region.name!r} is not visible in this process "
            f"(CUDA_VISIBLE_DEVICES?): {exc}"
        ) from exc


class HandleViews:
    """Views of a lease's handles; the regions they name must be in ``regions``."""

    __slots__ = ("_regions", "_writable")

    def __init__(self, regions: dict[str, RegionInfo], writable: bool) -> None:
        self._regions = regions
        self._writable = writable

    def _region(self, handle: Handle) -> RegionInfo:
        try:
            return self._regions[handle.region]
        except KeyError:
            raise RegionMapError(f"unknown region {handle.region!r} (not in KV.REGIONS)") from None

    def _view(self, handle: Handle) -> memoryview:
        return handle_view(self._region(handle), handle, self._writable)

    def _array(self, handle: Handle, dtype: Any) -> np.ndarray:
        return handle_array(self._region(handle), handle, dtype, self._writable)

    def _tensor(self, handle: Handle, dtype: Any) -> Any:
        return handle_tensor(self._region(handle), handle, dtype)


def close_all() -> int:
    """Unmap the regions this process mapped; returns how many stay mapped because a live
    numpy/torch/CuPy view still uses them (those views stay valid; a later lease maps afresh;
    a ``cuda`` mapping is closed with ``cudaIpcCloseMemHandle`` when its last view goes)."""
    with _lock:
        busy = _drop_cuda()
        for key, shm in list(_shm.items()):
            busy += _unmap_shm(shm)
            del _shm[key]
    return busy


def mapped_devices(regions: Iterable[RegionInfo]) -> set[int]:
    """Local devices of the ``cuda`` regions among ``regions`` that this process has mapped
    (a region never mapped here has no views, so no GPU work of ours can touch it)."""
    with _lock:
        maps = [_cuda.get((r.instance, r.name)) for r in regions if r.kind == "cuda"]
        return {m.device for m in maps if m is not None}


def _drop_cuda() -> int:
    """Forget every ``cuda`` mapping (caller holds ``_lock``); how many views keep open."""
    finalizers = [m.finalizer for m in _cuda.values()]
    _cuda.clear()
    return sum(1 for f in finalizers if f.alive)
