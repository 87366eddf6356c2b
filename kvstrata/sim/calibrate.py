"""``--hardware local``: a :class:`~kvstrata.sim.economics.Hardware` for *this* machine, from a
short measurement (about a second), instead of the H100-class presets.

- compute: float32 matrix products with numpy (the rate a CPU prefill can hope for; an engine's
  real prefill reaches a fraction of it, which ``--mfu`` expresses);
- ``dram``: copying a 64 MiB buffer into another (bandwidth) and a 4 KiB one (latency);
- ``nvme``: a 64 MiB file written and fsynced in ``folder``, dropped from the page cache
  (``posix_fadvise``), read back (bandwidth), then 4 KiB reads at spread offsets (latency); where
  the kernel keeps the pages anyway (tmpfs) this measures memory, and says so in the name;
- ``gpu``: none here (the DRAM figures), ``s3``: the 100 Gbit/s preset.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from kvstrata.sim.economics import NET, Hardware

MIB = 1 << 20


def _best(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def compute_flops() -> float:
    import numpy as np

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    secs = _best(lambda: a @ b, 20)
    return 2.0 * n**3 / secs


def dram_link(size: int = 64 * MIB) -> tuple[float, float]:
    import numpy as np

    src, dst = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
    bandwidth = size / _best(lambda: np.copyto(dst, src), 5)
    small_src, small_dst = src[:4096], dst[:4096]
    latency = _best(lambda: np.copyto(small_dst, small_src), 200)
    return bandwidth, latency


def nvme_link(folder: str | Path, size: int = 64 * MIB) -> tuple[float, float]:
    data = os.urandom(MIB) * (size // MIB)
    fd, path = tempfile.mkstemp(prefix=".kvstrata-calibrate-", dir=folder)
    try:
        os.write(fd, data)
        os.fsync(fd)

        def drop() -> None:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        drop()
        start = time.perf_counter()
        done = 0
        while done < size:
            done += len(os.pread(fd, 4 * MIB, done))
        bandwidth = size / (time.perf_counter() - start)
        drop()
        offsets = [(i * 7919 * MIB // 16) % (size - 4096) // 4096 * 4096 for i in range(32)]
        start = time.perf_counter()
        for off in offsets:
            os.pread(fd, 4096, off)
        latency = (time.perf_counter() - start) / len(offsets)
    finally:
        os.close(fd)
        os.unlink(path)
    return bandwidth, latency


def local_hardware(folder: str | Path | None = None) -> Hardware:
    """Measure this machine (``folder``: where the NVMe tier would live; default: the temp
    folder)."""
    dram = dram_link()
    nvme = nvme_link(folder or tempfile.gettempdir())
    cached = nvme[0] > 0.5 * dram[0]  # the file was read from memory, not from a drive
    name = "local(cpu" + (", nvme figures from the page cache)" if cached else ")")
    links = {"gpu": dram, "dram": dram, "nvme": nvme, "s3": NET["100g"]}
    return Hardware(name, compute_flops(), links)
