"""Run-time selection of the GPU tier: is CUDA usable here, and what INFO tiers says.

Rules (``docs/gpu.md``):

- ``gpu-capacity 0`` (the default): no GPU tier; INFO tiers says ``disabled: gpu-capacity is 0``.
- ``gpu-capacity > 0`` and CUDA usable on ``gpu-device``: the tier is built.
- ``gpu-capacity > 0`` without CUDA: start-up stops with :class:`TierUnavailable` naming the
  capacity, the reason and the fix (``set --gpu-capacity 0``); the CLI prints it as
  ``kvstrata: cannot start: …``. Asking for a GPU and silently running without one would hide
  a misconfiguration that costs every request its GPU hits.

The probe asks torch first (``torch.cuda.is_available()``, ``device_count()``), then CuPy.
Unlike ``_cuda.cuda_unavailable_reason`` (a cached yes/no for pinning DRAM) it is not cached and
its messages say which library answered what, because they end up in an error a user reads.
"""

from __future__ import annotations

import glob
import importlib
from typing import Any

from kvstrata.tiers.base import TierUnavailable


def _size(n: int) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} bytes"


def _import(name: str) -> Any:
    """``importlib.import_module``; a seam the tests monkeypatch to hide torch or CuPy."""
    return importlib.import_module(name)


def _torch_answer(device: int) -> tuple[bool, str] | None:
    """torch's view of CUDA, or None when torch is not installed."""
    try:
        torch = _import("torch")
    except ImportError:
        return None
    if not torch.cuda.is_available():
        build = getattr(torch.version, "cuda", None)
        why = (
            f"torch {torch.__version__} is a CPU-only build"
            if build is None
            else f"torch {torch.__version__} (CUDA {build}) finds no usable NVIDIA driver/device"
        )
        return False, f"torch.cuda.is_available() is False: {why}"
    count = int(torch.cuda.device_count())
    if device >= count:
        return False, f"CUDA device {device} does not exist (torch sees {count} device(s))"
    return True, f"cuda:{device} ({torch.cuda.get_device_name(device)}) via torch"


def _cupy_answer(device: int) -> tuple[bool, str] | None:
    """CuPy's view of CUDA, or None when CuPy is not installed."""
    try:
        cupy = _import("cupy")
    except ImportError:
        return None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError without a driver
        return False, f"cupy.cuda.runtime.getDeviceCount() failed: {exc}"
    if device >= count:
        return False, f"CUDA device {device} does not exist (CuPy sees {count} device(s))"
    return True, f"cuda:{device} via CuPy"


def gpu_available(device: int = 0) -> tuple[bool, str]:
    """(True, what was found) when CUDA device ``device`` is usable, else (False, why not)."""
    torch_answer = _torch_answer(device)
    if torch_answer is not None and torch_answer[0]:
        return torch_answer
    cupy_answer = _cupy_answer(device)
    if cupy_answer is not None and cupy_answer[0]:
        return cupy_answer
    reasons = [a[1] for a in (torch_answer, cupy_answer) if a is not None]
    if not reasons:
        return False, "neither torch nor CuPy is installed (torch, or kvstrata[gpu-cu13] / [gpu])"
    return False, "; ".join(reasons)


def require_gpu(capacity: int, device: int) -> str:
    """Check a configuration that asks for a GPU tier; returns what was found, else raises
    :class:`TierUnavailable` with the message start-up prints."""
    ok, why = gpu_available(device)
    if not ok:
        raise TierUnavailable(
            f"gpu-capacity is {_size(capacity)} but CUDA is not available ({why}); "
            "set --gpu-capacity 0"
        )
    return why


def driver_nodes_present() -> bool:
    """Whether the device nodes a CUDA driver needs exist (cheap; imports nothing)."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/dxg"))


def gpu_status(capacity: int, device: int) -> str:
    """One line for INFO tiers (``gpu_status``); the store computes it once at start.

    With ``gpu-capacity 0`` only the device nodes are looked at, so that a server without a
    GPU tier never imports torch just to say so.
    """
    if capacity <= 0:
        if driver_nodes_present():
            return "disabled: gpu-capacity is 0"
        return "absent: no CUDA (no NVIDIA device nodes); gpu-capacity is 0"
    ok, why = gpu_available(device)
    return f"enabled: {why}" if ok else f"absent: no CUDA ({why})"
