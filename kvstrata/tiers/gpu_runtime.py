"""The few CUDA runtime calls the GPU tier makes, through libcudart (ctypes) or CuPy.

Why not torch: ``torch.cuda.cudart()`` binds only cudaGetErrorString, the profiler,
cudaHostRegister/Unregister, cudaStreamCreate/Destroy and cudaMemGetInfo
(``torch/csrc/cuda/shared/cudart.cpp``): no cudaMalloc, no IPC handles, no memcpy. And a
``torch.empty(..., device="cuda")`` pool comes from torch's caching allocator, whose segments
may be larger than the tensor or (with ``expandable_segments``) not exportable with
``cudaIpcGetMemHandle`` at all. So the pool is one plain ``cudaMalloc`` that this module owns:

- :class:`CudartRuntime` calls the ``libcudart`` that torch (or the ``nvidia-cuda-runtime-cu12``
  wheel) already loaded, by ctypes; preferred because it needs nothing beyond torch.
- :class:`CupyRuntime` calls ``cupy.cuda.runtime`` (``malloc``, ``ipcGetMemHandle``,
  ``memcpyAsync``…) when libcudart cannot be found but CuPy is installed.

Both use the primary context of the device, which torch, CuPy and kvikio share, so a pointer
from one is valid in the others. Nothing here runs on a machine without CUDA; the GPU tier's
tests and ``scripts/gpu_check.py`` exercise it where a GPU exists.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any, Protocol

#: cudaMemcpyDefault: direction inferred from the pointers (unified virtual addressing).
MEMCPY_DEFAULT = 4
#: cudaStreamNonBlocking: the stream does not synchronize with the legacy default stream.
STREAM_NON_BLOCKING = 1
IPC_HANDLE_BYTES = 64
_CUDART_NAMES = ("libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so")


class CudaCallError(RuntimeError):
    """A CUDA runtime call returned an error; the message names the call and the error."""


class CudaRuntime(Protocol):
    """What the GPU pool needs from a CUDA runtime binding."""

    name: str

    def set_device(self, device: int) -> None: ...

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


def find_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library, preferring the one already loaded into this process."""
    for name in _CUDART_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    try:  # the pip wheel torch and CuPy depend on (a namespace package)
        import nvidia.cuda_runtime as wheel

        for folder in wheel.__path__:
            for name in _CUDART_NAMES:
                path = os.path.join(folder, "lib", name)
                if os.path.exists(path):
                    return ctypes.CDLL(path)
    except (ImportError, OSError):
        pass
    found = ctypes.util.find_library("cudart")
    return ctypes.CDLL(found) if found else None


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
        }
        for fn, args in sigs.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, call: str, rc: int) -> None:
        if rc != 0:
            text = self._lib.cudaGetErrorString(rc) or b"unknown error"
            raise CudaCallError(f"{call} failed: {text.decode(errors='replace')} ({rc})")

    def set_device(self, device: int) -> None:
        self._check("cudaSetDevice", self._lib.cudaSetDevice(device))

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
    """libcudart by ctypes when it can be found, else CuPy; raises CudaCallError if neither."""
    try:  # importing torch loads its libcudart, which find_cudart() then picks up by soname
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()
    except ImportError:
        pass
    lib = find_cudart()
    if lib is not None:
        return CudartRuntime(lib)
    try:
        return CupyRuntime()
    except ImportError:
        raise CudaCallError(
            "no CUDA runtime: libcudart was not found and CuPy is not installed"
        ) from None
