"""Checksum throughput next to memcpy, measured in the same run (issue 4: pick the checksum).

    python bench/bench_checksum.py [--seconds 0.3]

Prints GB/s of xxh3-128 (the one kvstrata uses), xxh3-64, BLAKE3 (one thread and all threads,
when the optional ``blake3`` package is installed) and numpy ``copyto`` for 1, 8 and 32 MiB
buffers, plus each hash's ratio to memcpy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import xxhash

MiB = 1024 * 1024


def rate(fn: Callable[[], object], nbytes: int, seconds: float) -> float:
    fn()  # warm up
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or runs < 3:
        fn()
        runs += 1
    return nbytes * runs / elapsed / 1e9


def candidates(buf: np.ndarray) -> dict[str, Callable[[], object]]:
    view = buf.data
    out: dict[str, Callable[[], object]] = {
        "xxh3-128": lambda: xxhash.xxh3_128_digest(view),
        "xxh3-64": lambda: xxhash.xxh3_64_digest(view),
    }
    try:
        import blake3
    except ImportError:
        return out
    out["blake3 (1 thread)"] = lambda: blake3.blake3(view).digest()
    out["blake3 (all threads)"] = lambda: blake3.blake3(
        view, max_threads=blake3.blake3.AUTO
    ).digest()
    return out


def copier(src: np.ndarray, dst: np.ndarray) -> Callable[[], object]:
    return lambda: np.copyto(dst, src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="time per cell")
    args = parser.parse_args()
    rows: list[tuple[str, list[float]]] = []
    memcpy: list[float] = []
    sizes = [1, 8, 32]
    for size in sizes:
        src = np.random.default_rng(size).integers(0, 256, size * MiB, dtype=np.uint8)
        dst = np.empty_like(src)
        memcpy.append(rate(copier(src, dst), src.nbytes, args.seconds))
        for i, (name, fn) in enumerate(candidates(src).items()):
            if len(rows) <= i:
                rows.append((name, []))
            rows[i][1].append(rate(fn, src.nbytes, args.seconds))
    head = "".join(f"{f'{s} MiB GB/s':>14}{'x memcpy':>10}" for s in sizes)
    print(f"{'algorithm':<22}{head}")
    print(f"{'memcpy (np.copyto)':<22}" + "".join(f"{m:>14.2f}{1.0:>10.2f}" for m in memcpy))
    for name, rates in rows:
        cells = "".join(f"{r:>14.2f}{r / m:>10.2f}" for r, m in zip(rates, memcpy, strict=True))
        print(f"{name:<22}{cells}")


if __name__ == "__main__":
    main()
