"""The CUDA side of ``cuda`` handles: open/close IPC mappings, find the device, fence streams.

:mod:`kvstrata.clients.handles` keeps the table of mapped regions; this module makes the calls:

- **Which runtime.** The ``libcudart`` already mapped into the process (torch's, found in
  ``/proc/self/maps`` by :func:`kvstrata.cudart.load_cudart`) through ctypes; else CuPy's
  runtime; else torch imported for its runtime. Never a second libcudart beside the one the
  engine runs (the old code tried the unversioned ``libcudart.so`` first, which may be another
  CUDA version than torch's).
- **Which device.** The server publishes the pool's PCI bus id; it is resolved here with
  ``cudaDeviceGetByPCIBusId``, because ordinals differ between processes with different
  ``CUDA_VISIBLE_DEVICES`` (ordinal 0 in the server may be ordinal 3, or invisible, here).
- **Errors.** A failed call clears the runtime's last error (``cudaGetLastError``, as CuPy
  does) so that torch's next kernel-launch check does not report it against another kernel.
- **Closing.** ``cudaIpcCloseMemHandle`` once a mapping is dropped (its region changed, the
  client closed) and no tensor made from it is alive: :class:`IpcMapping` owns the pointer and
  every view keeps it alive.
- **Fences.** :func:`stream_fence` captures the caller's current streams on the devices a lease
  uses; waiting on it before ``release``/``commit`` makes sure the engine's queued copies out
  of (or writes into) the slot have finished before the server may reuse or checksum it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvstrata.cudart import clear_last_error, load_cudart

log = logging.getLogger(__name__)

__all__ = ["IpcMapping", "IpcRuntime", "ipc_runtime", "stream_fence"]

IPC_HANDLE_BYTES = 64
IPC_LAZY_ENABLE_PEER_ACCESS = 1


class IpcError(RuntimeError):
    """A CUDA IPC call failed (the message names the call and the CUDA error)."""


class IpcRuntime(Protocol):
    """The three calls a client needs to map a ``cuda`` region."""

    name: str

    def open(self, raw: bytes, device: int) -> int: ...

    def close(self, ptr: int, device: int) -> None: ...

    def device_by_bus_id(self, bus_id: str) -> int: ...


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudartIpc:
    """libcudart by ctypes (the library torch loaded)."""

    name = "cudart"

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def _check(self, call: str, rc: int) -> None:
        if rc != 0:
            clear_last_error(self._lib)
            raise IpcError(f"{call} failed with CUDA error {rc}")

    def _on_device(self, device: int, fn: Callable[[], int], call: str) -> None:
        """Run ``fn`` with ``device`` current, then give the caller's device back."""
        current = ctypes.c_int(-1)
        self._check("cudaGetDevice", self._lib.cudaGetDevice(ctypes.byref(current)))
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device))
        try:
            self._check(call, fn())
        finally:
            self._lib.cudaSetDevice(current.value)

    def open(self, raw: bytes, device: int) -> int:
        if len(raw) != IPC_HANDLE_BYTES:
            raise IpcError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
        handle = _IpcMemHandle()
        ctypes.memmove(ctypes.byref(handle), raw, IPC_HANDLE_BYTES)
        ptr = ctypes.c_void_p()
        fn = self._lib.cudaIpcOpenMemHandle
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        flags = IPC_LAZY_ENABLE_PEER_ACCESS
        call = "cudaIpcOpenMemHandle"
        self._on_device(device, lambda: fn(ctypes.byref(ptr), handle, flags), call)
        return int(ptr.value or 0)

    def close(self, ptr: int, device: int) -> None:
        fn = self._lib.cudaIpcCloseMemHandle
        fn.argtypes = [ctypes.c_void_p]
        self._on_device(device, lambda: fn(ptr), "cudaIpcCloseMemHandle")

    def device_by_bus_id(self, bus_id: str) -> int:
        device = ctypes.c_int(-1)
        rc = self._lib.cudaDeviceGetByPCIBusId(ctypes.byref(device), bus_id.encode("ascii"))
        self._check(f"cudaDeviceGetByPCIBusId({bus_id})", rc)
        return int(device.value)


class CupyIpc:
    """``cupy.cuda.runtime`` (it clears the last error after a failure itself)."""

    name = "cupy"

    def __init__(self, cupy: Any) -> None:
        self._cupy = cupy

    def open(self, raw: bytes, device: int) -> int:
        with self._cupy.cuda.Device(device):
            return int(self._cupy.cuda.runtime.ipcOpenMemHandle(raw))

    def close(self, ptr: int, device: int) -> None:
        with self._cupy.cuda.Device(device):
            self._cupy.cuda.runtime.ipcCloseMemHandle(ptr)

    def device_by_bus_id(self, bus_id: str) -> int:
        return int(self._cupy.cuda.runtime.deviceGetByPCIBusId(bus_id))


def ipc_runtime() -> IpcRuntime | None:
    """The runtime to map ``cuda`` regions with (see the module docstring), or None."""
    lib = load_cudart(search=False, import_torch=lambda: None)
    if lib is not None:
        return CudartIpc(lib)
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        return CupyIpc(cupy)
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    lib = load_cudart(search=False)
    return CudartIpc(lib) if lib is not None else None


def _close_quietly(runtime: IpcRuntime, ptr: int, device: int) -> None:
    try:
        runtime.close(ptr, device)
    except Exception as exc:  # a finalizer must not raise; the driver frees it at exit anyway
        log.warning("cudaIpcCloseMemHandle(%#x) on device %d failed: %s", ptr, device, exc)


class IpcMapping:
    """One opened IPC handle (``ptr`` on local ``device``); closed with
    ``cudaIpcCloseMemHandle`` when the last reference goes: the handle table's and every
    tensor/CuPy array made from it (they hold it as their owner)."""

    __slots__ = ("__weakref__", "_finalizer", "device", "path", "ptr", "runtime")

    def __init__(self, path: str, ptr: int, device: int, runtime: IpcRuntime) -> None:
        self.path = path
        self.ptr = ptr
        self.device = device
        self.runtime = runtime
        self._finalizer = weakref.finalize(self, _close_quietly, runtime, ptr, device)
        self._finalizer.atexit = False  # at exit the driver unmaps everything itself

    @property
    def finalizer(self) -> weakref.finalize[Any, Any]:
        return self._finalizer


def _torch_streams(devices: Iterable[int]) -> list[Any]:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []  # torch never touched CUDA in this process: it has queued nothing
    return [torch.cuda.current_stream(d) for d in devices]


def _cupy_streams(devices: Iterable[int]) -> list[Any]:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return []
    streams = []
    for d in devices:
        with cupy.cuda.Device(d):
            streams.append(cupy.cuda.get_current_stream())
    return streams


def stream_fence(devices: Iterable[int]) -> Callable[[], None] | None:
    """A wait for the work queued so far on the calling thread's current torch and CuPy
    streams of ``devices``, or None when there is nothing to wait for.

    The streams are captured now (torch's current stream is per thread), so the returned
    function may run on another thread (the async client runs it off the event loop)."""
    devices = sorted(set(devices))
    if not devices:
        return None
    streams = _torch_streams(devices) + _cupy_streams(devices)
    if not streams:
        return None

    def wait() -> None:
        for stream in streams:
            stream.synchronize()

    return wait
