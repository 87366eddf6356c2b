"""The few CUDA runtime calls the GPU tier makes, through libcudart (ctypes) or CuPy.

Why not torch: ``torch.cuda.cudart()`` binds only cudaGetErrorString, the profiler,
cudaHostRegister/Unregister, cudaStreamCreate/Destroy and cudaMemGetInfo
(``torch/csrc/cuda/shared/cudart.cpp``): no cudaMalloc, no IPC handles, no memcpy. And a
``torch.empty(..., device="cuda")`` pool comes from torch's caching allocator, whose segments
may be larger than the tensor or (with ``expandable_segments``) not exportable with
``cudaIpcGetMemHandle`` at all. So the pool is one plain ``cudaMalloc`` that this module owns:

- :class:`CudartRuntime` calls, by ctypes, the ``libcudart`` that torch (or CuPy) already
  loaded into the process, found in ``/proc/self/maps`` (:mod:`kvstrata.cudart`): never a
  second runtime beside it, whose own last-error and device state would diverge.
- :class:`CupyRuntime` calls ``cupy.cuda.runtime`` (``malloc``, ``ipcGetMemHandle``,
  ``memcpyAsync``…) when no libcudart is loaded but CuPy is installed; only when neither is
  there is a libcudart looked for on disk (wheels' CUDA 13 then CUDA 12 layouts, sonames).

A failed call clears the runtime's last error (``cudaGetLastError``, as CuPy does), so that
torch's next kernel-launch check does not report it against an unrelated kernel.

Both use the primary context of the device, which torch, CuPy and kvikio share, so a pointer
from one is valid in the others. Nothing here runs on a machine without CUDA; the GPU tier's
tests and ``scripts/gpu_check.py`` exercise it where a GPU exists.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

from kvstrata.cudart import clear_last_error, load_cudart

#: cudaMemcpyDefault: direction inferred from the pointers (unified virtual addressing).
MEMCPY_DEFAULT = 4
#: cudaStreamNonBlocking: the stream does not synchronize with the legacy default stream.
STREAM_NON_BLOCKING = 1
IPC_HANDLE_BYTES = 64
PCI_BUS_ID_CHARS = 64  # "0000:17:00.0" needs 13; CUDA's docs ask for at least 13


class CudaCallError(RuntimeError):
    """A CUDA runtime call returned an error; the message names the call and the error."""


class CudaRuntime(Protocol):
    """What the GPU pool needs from a CUDA runtime binding."""

    name: str

    def set_device(self, device: int) -> None: ...

    def pci_bus_id(self, device: int) -> str: ...

    def malloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def ipc_get_mem_handle(self, ptr: int) -> bytes: ...

    def stream_create(self) -> int: ...

    def stream_destroy(self, stream: int) -> None: ...

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def stream_synchronize(self, stream: int) -> None: ...

    def memset(self, ptr: int, value: int, nbytes: int) -> None: ...


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def find_cudart(search: bool = True) -> ctypes.CDLL | None:
    """The CUDA runtime library: the one torch or CuPy already loaded into this process, else
    (with ``search``) one found by the wheels' layouts and sonames (:mod:`kvstrata.cudart`)."""
    lib: ctypes.CDLL | None = load_cudart(search=search)
    return lib


class CudartRuntime:
    """libcudart through ctypes."""

    name = "cudart"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        vp, size_t = ctypes.c_void_p, ctypes.c_size_t
        sigs: dict[str, list[Any]] = {
            "cudaSetDevice": [ctypes.c_int],
            "cudaMalloc": [ctypes.POINTER(vp), size_t],
            "cudaFree": [vp],
            "cudaIpcGetMemHandle": [ctypes.POINTER(_IpcMemHandle), vp],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaStreamDestroy": [vp],
            "cudaMemcpyAsync": [vp, vp, size_t, ctypes.c_int, vp],
            "cudaStreamSynchronize": [vp],
            "cudaMemset": [vp, ctypes.c_int, size_t],
            "cudaDeviceGetPCIBusId": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
        }
        for fn, args in sigs.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int

    def _check(self, call: str, rc: int) -> None:
        if rc != 0:
            clear_last_error(self._lib)  # else torch's next launch check reports this error
            text = self._lib.cudaGetErrorString(rc) or b"unknown error"
            raise CudaCallError(f"{call} failed: {text.decode(errors='replace')} ({rc})")

    def set_device(self, device: int) -> None:
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device))

    def pci_bus_id(self, device: int) -> str:
        buf = ctypes.create_string_buffer(PCI_BUS_ID_CHARS)
        rc = self._lib.cudaDeviceGetPCIBusId(buf, PCI_BUS_ID_CHARS, device)
        self._check("cudaDeviceGetPCIBusId", rc)
        return buf.value.decode("ascii", "replace")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(f"cudaMalloc({nbytes})", self._lib.cudaMalloc(ctypes.byref(ptr), nbytes))
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self._lib.cudaFree(ptr))

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        handle = _IpcMemHandle()
        self._check("cudaIpcGetMemHandle", self._lib.cudaIpcGetMemHandle(ctypes.byref(handle), ptr))
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)

    def stream_create(self) -> int:
        stream = ctypes.c_void_p()
        rc = self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), STREAM_NON_BLOCKING)
        self._check("cudaStreamCreateWithFlags", rc)
        return int(stream.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self._lib.cudaStreamDestroy(stream))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._lib.cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream)
        self._check("cudaMemcpyAsync", rc)

    def stream_synchronize(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self._lib.cudaStreamSynchronize(stream))

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check("cudaMemset", self._lib.cudaMemset(ptr, value, nbytes))


class CupyRuntime:
    """``cupy.cuda.runtime`` (raises CuPy's CUDARuntimeError, re-raised as CudaCallError)."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self._rt = cupy.cuda.runtime

    def _call(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self._rt, fn)(*args)
        except Exception as exc:  # cupy_backends' CUDARuntimeError
            raise CudaCallError(f"cupy.cuda.runtime.{fn} failed: {exc}") from exc

    def set_device(self, device: int) -> None:
        self._call("setDevice", device)

    def pci_bus_id(self, device: int) -> str:
        return str(self._call("deviceGetPCIBusId", device))

    def malloc(self, nbytes: int) -> int:
        return int(self._call("malloc", nbytes))

    def free(self, ptr: int) -> None:
        self._call("free", ptr)

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        return bytes(self._call("ipcGetMemHandle", ptr))

    def stream_create(self) -> int:
        return int(self._call("streamCreateWithFlags", STREAM_NON_BLOCKING))

    def stream_destroy(self, stream: int) -> None:
        self._call("streamDestroy", stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("memcpyAsync", dst, src, nbytes, MEMCPY_DEFAULT, stream)

    def stream_synchronize(self, stream: int) -> None:
        self._call("streamSynchronize", stream)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._call("memset", ptr, value, nbytes)


def load_runtime() -> CudaRuntime:
    """The runtime torch or CuPy already runs in this process (never a second one): libcudart
    by ctypes when one is loaded (importing torch loads its own), else CuPy, else a libcudart
    found on disk; raises CudaCallError if there is none."""
    lib = find_cudart(search=False)
    if lib is not None:
        return CudartRuntime(lib)
    try:
        return CupyRuntime()
    except ImportError:
        pass
    lib = find_cudart(search=True)
    if lib is not None:
        return CudartRuntime(lib)
    raise CudaCallError("no CUDA runtime: libcudart was not found and CuPy is not installed")
