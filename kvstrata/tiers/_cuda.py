"""Lazy CUDA probing and host-memory registration, shared by the dram and nvme tiers.

Nothing here imports torch or cupy at module import: the probe first looks for the device
nodes a CUDA driver needs (cheap, and true on every machine without a GPU), and only then
imports torch (or cupy) to ask the runtime.
"""

from __future__ import annotations

import functools
import glob
import logging
from typing import Any

from kvstrata.cudart import clear_last_error

log = logging.getLogger(__name__)


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """None when CUDA is usable from this process, else a short reason ("no CUDA", …)."""
    if not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/dev/dxg"):
        return "no CUDA"
    try:
        import torch

        if torch.cuda.is_available():
            return None
        return "no CUDA (torch sees no device)"
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
    except Exception as exc:  # cupy raises its own runtime errors without a driver
        return f"no CUDA ({type(exc).__name__})"
    return "no CUDA (neither torch nor cupy is installed)"


def _runtime() -> tuple[str, Any]:
    try:
        import torch

        return "torch", torch.cuda.cudart()
    except ImportError:
        import cupy

        return "cupy", cupy.cuda.runtime


def host_register(ptr: int, size: int) -> str | None:
    """cudaHostRegister(ptr, size); None on success, else the reason it failed.

    torch's binding returns the error code and leaves it in the thread's last-error slot,
    where torch's next kernel-launch check would find it: it is cleared here (CuPy clears its
    own failures)."""
    try:
        kind, rt = _runtime()
        if kind == "torch":
            rc = rt.cudaHostRegister(ptr, size, 0)
            code = int(getattr(rc, "value", rc))
            if code == 0:
                return None
            clear_last_error()
            return f"cudaHostRegister failed with error {code}"
        rt.hostRegister(ptr, size, 0)
        return None
    except Exception as exc:  # any runtime failure means "not pinned", never a crash
        return f"cudaHostRegister failed: {exc}"


def host_unregister(ptr: int) -> None:
    try:
        kind, rt = _runtime()
        if kind == "torch":
            rc = rt.cudaHostUnregister(ptr)
            if int(getattr(rc, "value", rc)) != 0:
                clear_last_error()
                log.warning("cudaHostUnregister failed with error %s", rc)
        else:
            rt.hostUnregister(ptr)
    except Exception as exc:
        log.warning("cudaHostUnregister failed: %s", exc)
