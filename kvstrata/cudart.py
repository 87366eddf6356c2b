"""Which ``libcudart`` to call through ctypes: the one this process already runs, never a second.

Two CUDA runtimes in one process (say torch's ``libcudart.so.13`` and a system
``libcudart.so.12`` found by name) each keep their own state: their own last-error slot,
their own idea of the current device, and a version that may not match the driver. Both the
server's GPU pool (:mod:`kvstrata.tiers.gpu_runtime`) and the client's IPC mapping
(:mod:`kvstrata.clients.handles`) therefore pick the runtime in this order:

1. a ``libcudart.so*`` already mapped into the process (``/proc/self/maps``): what torch or
   CuPy loaded;
2. after importing torch (its CUDA build links libcudart, so importing it maps the library),
   the same look again;
3. only when nothing is loaded: the pip wheels' layouts (CUDA 13 ``nvidia/cu13/lib``, then CUDA
   12 ``nvidia/cuda_runtime/lib``) and the sonames, newest major first, never the unversioned
   ``libcudart.so`` (a toolkit's development symlink, of any version).

Also here: :func:`clear_last_error`, because a failed runtime call leaves its error in the
thread's last-error slot, and torch's next kernel-launch check (``cudaGetLastError``) would
report it against an unrelated kernel; CuPy clears it after every failed call, so do we.
This module imports nothing from kvstrata: tiers and clients both use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "SONAMES",
    "clear_last_error",
    "load_cudart",
    "mapped_cudart",
    "wheel_cudart_paths",
]

#: Newest major first: a machine with CUDA 13 wheels and a stray CUDA 12 toolkit gets 13.
SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
#: (namespace package, folder below it) of the runtime wheels, CUDA 13 layout first.
WHEEL_LAYOUTS = (
    ("nvidia", "cu13/lib"),
    ("nvidia.cuda_runtime", "lib"),
)


def mapped_cudart(maps_text: str | None = None) -> list[str]:
    """Paths of the ``libcudart.so*`` files mapped into this process (``/proc/self/maps``)."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            return []
    found: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if os.path.basename(path).startswith("libcudart.so") and path not in found:
            found.append(path)
    return found


def wheel_cudart_paths() -> list[str]:
    """libcudart files inside installed ``nvidia-cuda-runtime`` wheels (CUDA 13 layout first)."""
    out: list[str] = []
    for package, sub in WHEEL_LAYOUTS:
        try:
            folders = list(importlib.import_module(package).__path__)
        except (ImportError, AttributeError):
            continue
        for folder in folders:
            for name in SONAMES:
                path = os.path.join(folder, sub, name)
                if os.path.exists(path) and path not in out:
                    out.append(path)
    return out


def _import_torch() -> None:
    """Import torch so that its CUDA build maps its libcudart; a seam the tests replace."""
    try:
        importlib.import_module("torch")
    except ImportError:
        pass


def _first_loadable(names: Iterable[str], load: Callable[[str], Any]) -> Any | None:
    for name in names:
        try:
            return load(name)
        except OSError:
            continue
    return None


def load_cudart(
    load: Callable[[str], Any] = ctypes.CDLL,
    mapped: Callable[[], list[str]] = mapped_cudart,
    import_torch: Callable[[], None] = _import_torch,
    search: bool = True,
) -> Any | None:
    """The CUDA runtime library to call (see the module docstring for the order), or None.

    With ``search`` False only a runtime already loaded (by torch or CuPy) is returned: the
    server then prefers CuPy's own runtime to loading a fresh one. ``load``, ``mapped`` and
    ``import_torch`` are seams for tests."""
    lib = _first_loadable(mapped(), load)
    if lib is not None:
        return lib
    import_torch()
    lib = _first_loadable(mapped(), load)
    if lib is not None or not search:
        return lib
    lib = _first_loadable(wheel_cudart_paths(), load)
    if lib is not None:
        return lib
    lib = _first_loadable(SONAMES, load)
    if lib is not None:
        return lib
    found = ctypes.util.find_library("cudart")
    return _first_loadable([found], load) if found else None


def clear_last_error(lib: Any | None = None) -> None:
    """Reset the calling thread's CUDA last error (``cudaGetLastError``) after a failed call.

    ``lib`` is the runtime that failed; by default the one already mapped (never loads one)."""
    if lib is None:
        paths = mapped_cudart()
        lib = _first_loadable(paths, ctypes.CDLL) if paths else None
        if lib is None:
            return
    try:
        lib.cudaGetLastError()
    except (AttributeError, OSError):  # not a CUDA runtime after all: nothing to clear
        pass
