"""The memory behind the GPU tier: one device pool (:class:`CudaMemory`) or a host stand-in.

The GPU tier does its bookkeeping (allocator, chunk table, handles) itself and asks a
:class:`DeviceMemory` only to move bytes and to describe the pool. That seam lets the same
:class:`~kvstrata.tiers.gpu.GpuTier` run on CPU-only machines over :class:`HostMemory`, a
plain host buffer, so the contract suite and the handle/region protocol are tested in CI;
:class:`HostMemory` is never chosen by configuration.

:class:`CudaMemory` is one ``cudaMalloc`` on the configured device, exported once with
``cudaIpcGetMemHandle``. Copies between host and device run with ``cudaMemcpyAsync`` on a
non-blocking stream per copying thread (the GPU tier's executor) and wait for that stream only,
so the event loop never blocks and copies never serialize behind compute on the default stream.
A source in the pinned DRAM arena (``cudaHostRegister``) is a DMA transfer at PCIe speed; a
pageable source is staged by the driver, correct but slower.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import numpy as np

from kvstrata.tiers.base import TierError
from kvstrata.tiers.gpu_runtime import CudaCallError, CudaRuntime

log = logging.getLogger(__name__)


class NoHostView(TierError):
    """Device memory has no host memoryview; use tensor(), get() or a CUDA handle instead."""


class DeviceMemory(Protocol):
    """One contiguous pool the GPU tier carves up; offsets are relative to its start."""

    backend: str  # "cudart", "cupy", "host"
    device: int
    pci_bus_id: str  # "" for the host stand-in
    size: int
    ptr: int
    host_addressable: bool  # True only for the host stand-in

    def ipc_handle(self) -> bytes:
        """The 64-byte ``cudaIpcMemHandle_t`` of the pool (KV.REGIONS, kind ``cuda``)."""

    def to_device(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the pool at ``offset``; returns when the bytes have landed."""

    def to_host(self, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes at ``offset`` into ``dst``; returns when they have landed."""

    def buffer(self, offset: int, nbytes: int) -> Any:
        """An object kvikio can read into / write from (``__cuda_array_interface__``)."""

    def tensor(self, offset: int, nbytes: int) -> Any:
        """A 1-D torch uint8 tensor over the bytes (no copy)."""

    def host_view(self, offset: int, nbytes: int) -> memoryview:
        """A memoryview of the bytes; raises :class:`NoHostView` for device memory."""

    def close(self) -> None: ...


def host_pointer(view: memoryview) -> int:
    """Address of a contiguous host buffer (read-only buffers included)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class CudaArray:
    """Exposes device bytes through ``__cuda_array_interface__`` v3 (no copy, no ownership).

    ``owner`` is kept alive by the holder so that the pool outlives tensors made from it.
    """

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, ptr: int, nbytes: int, owner: Any = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _check_range(size: int, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"{nbytes} bytes at {offset} lie outside a {size}-byte pool")


class CudaMemory:
    """One cudaMalloc pool on ``device``; see the module docstring."""

    host_addressable = False

    def __init__(self, runtime: CudaRuntime, device: int, size: int) -> None:
        self._rt = runtime
        self.backend = runtime.name
        self.device = device
        self.size = size
        runtime.set_device(device)
        self.pci_bus_id = runtime.pci_bus_id(device)
        self.ptr = runtime.malloc(size)
        self._ipc: bytes | None = None
        self._local = threading.local()
        self._streams: list[int] = []
        self._lock = threading.Lock()
        self._closed = False

    def ipc_handle(self) -> bytes:
        if self._ipc is None:
            self._ipc = self._rt.ipc_get_mem_handle(self.ptr)
        return self._ipc

    def _stream(self) -> int:
        stream: int | None = getattr(self._local, "stream", None)
        if stream is None:
            self._rt.set_device(self.device)  # per thread: executor threads start on device 0
            stream = self._rt.stream_create()
            self._local.stream = stream
            with self._lock:
                self._streams.append(stream)
        return stream

    def to_device(self, offset: int, src: memoryview) -> None:
        _check_range(self.size, offset, src.nbytes)
        if src.nbytes:
            stream = self._stream()
            self._rt.memcpy_async(self.ptr + offset, host_pointer(src), src.nbytes, stream)
            self._rt.stream_synchronize(stream)

    def to_host(self, offset: int, dst: memoryview) -> None:
        _check_range(self.size, offset, dst.nbytes)
        if dst.readonly:
            raise ValueError("destination buffer is read-only")
        if dst.nbytes:
            stream = self._stream()
            self._rt.memcpy_async(host_pointer(dst), self.ptr + offset, dst.nbytes, stream)
            self._rt.stream_synchronize(stream)

    def buffer(self, offset: int, nbytes: int) -> Any:
        _check_range(self.size, offset, nbytes)
        return CudaArray(self.ptr + offset, nbytes, self)

    def tensor(self, offset: int, nbytes: int) -> Any:
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=f"cuda:{self.device}")
        return torch.as_tensor(self.buffer(offset, nbytes), device=f"cuda:{self.device}")

    def host_view(self, offset: int, nbytes: int) -> memoryview:
        raise NoHostView(f"the gpu pool on cuda:{self.device} has no host view")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            streams, self._streams = self._streams, []
        try:
            for stream in streams:
                try:
                    self._rt.stream_destroy(stream)
                except CudaCallError as exc:  # a stream that will not go must not keep the pool
                    log.warning("gpu: cudaStreamDestroy failed at close: %s", exc)
        finally:
            self._rt.free(self.ptr)


class HostMemory:
    """A host-memory stand-in for a device pool (tests and dry runs; never configured)."""

    backend = "host"
    host_addressable = True
    pci_bus_id = ""

    def __init__(self, size: int, device: int = 0) -> None:
        self.device = device
        self.size = size
        self._array = np.zeros(size, dtype=np.uint8)
        self.ptr = int(self._array.ctypes.data)
        self.copies_in = 0
        self.copies_out = 0

    def ipc_handle(self) -> bytes:
        return b"kvstrata-host-memory".ljust(64, b"\0")

    def to_device(self, offset: int, src: memoryview) -> None:
        _check_range(self.size, offset, src.nbytes)
        self._array[offset : offset + src.nbytes] = np.frombuffer(src, dtype=np.uint8)
        self.copies_in += 1

    def to_host(self, offset: int, dst: memoryview) -> None:
        _check_range(self.size, offset, dst.nbytes)
        np.frombuffer(dst, dtype=np.uint8)[:] = self._array[offset : offset + dst.nbytes]
        self.copies_out += 1

    def buffer(self, offset: int, nbytes: int) -> Any:
        _check_range(self.size, offset, nbytes)
        return self._array[offset : offset + nbytes]

    def tensor(self, offset: int, nbytes: int) -> Any:
        import torch

        return torch.from_numpy(self.buffer(offset, nbytes))

    def host_view(self, offset: int, nbytes: int) -> memoryview:
        _check_range(self.size, offset, nbytes)
        return self._array[offset : offset + nbytes].data

    def close(self) -> None:
        pass
