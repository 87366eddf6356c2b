"""NVMe tier throughput against fio --direct=1 on the same folder, and index rebuild time.

    python bench/bench_nvme.py --dir /tmp/x [--sizes 1,8,32] [--total-mib 512]
                               [--threads 4] [--scan-counts 10000,100000]

For each chunk size: the tier writes ``--total-mib`` of chunks (each a file: temp file, O_DIRECT
writes, fsync, rename, folder fsync) with ``--threads`` puts in flight, then reads them all back
(checksum verified). fio runs in the same folder with the same block size and job count,
``--direct=1 --ioengine=psync``, once plain and once with ``--fsync=1`` (an fsync after every
block, what the tier does per chunk). The rebuild part lays out N small chunk files with the
tier's format and times ``scan()`` of a fresh tier (page cache dropped first when allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from kvstrata.store.keys import ChunkKey, ChunkMeta
from kvstrata.tiers import _nvme_format as fmt
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

MiB = 1024 * 1024


def aligned(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))


async def tier_rw(folder: Path, size: int, count: int, threads: int) -> tuple[float, float, str]:
    """(write GB/s, read GB/s, io mode) of the tier for ``count`` chunks of ``size`` bytes."""
    tier = NvmeTier(NvmeConfig(str(folder), capacity=1 << 50, io_threads=threads))
    src = aligned(size)
    src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    csum = checksum(src)
    metas = [
        ChunkMeta(ChunkKey("bench", i.to_bytes(8, "big")), b"", i, size, csum) for i in range(count)
    ]
    sem = asyncio.Semaphore(threads)

    async def put(meta: ChunkMeta) -> None:
        async with sem:
            await tier.put(meta, src)

    started = time.perf_counter()
    await asyncio.gather(*(put(m) for m in metas))
    write = size * count / (time.perf_counter() - started) / 1e9
    outs = [aligned(size) for _ in range(threads)]
    free = list(range(threads))

    async def get(meta: ChunkMeta) -> None:
        async with sem:
            slot = free.pop()
            try:
                await tier.get(meta.key, outs[slot])
            finally:
                free.append(slot)

    started = time.perf_counter()
    await asyncio.gather(*(get(m) for m in metas))
    read = size * count / (time.perf_counter() - started) / 1e9
    mode = tier.info()["io"]
    await tier.close()
    return write, read, mode


def fio(folder: Path, rw: str, size: int, total: int, jobs: int, fsync: bool) -> float:
    """GB/s of one fio run (psync, direct=1)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        "fio", "--name=kv", f"--directory={folder}", f"--rw={rw}", f"--bs={size}",
        f"--size={max(size, total // jobs // size * size)}", f"--numjobs={jobs}",
        "--direct=1", "--ioengine=psync", "--group_reporting", "--output-format=json",
    ]  # fmt: skip
    if fsync:
        cmd.append("--fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["read" if rw == "read" else "write"]["bw_bytes"]) / 1e9


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def lay_out(folder: Path, count: int, payload: int) -> None:
    """Write ``count`` chunk files in the tier's format (no fsync: only scan() is timed)."""
    data = b"\x5a" * payload
    csum = checksum(data)
    for sub in range(256):
        (folder / f"{sub:02x}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        meta = ChunkMeta(ChunkKey("scan", i.to_bytes(8, "big")), b"", i, payload, csum)
        path = folder / fmt.chunk_relpath(meta.key)
        with open(path, "wb") as f:
            f.write(fmt.encode_header(meta, csum, time.time_ns()))
            f.write(data)


async def timed_scan(folder: Path, threads: int) -> tuple[float, int]:
    tier = NvmeTier(NvmeConfig(str(folder), capacity=1 << 50, io_threads=threads))
    started = time.perf_counter()
    found = sum([1 async for _ in tier.scan()])
    seconds = time.perf_counter() - started
    await tier.close()
    return seconds, found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, type=Path, help="folder on the disk to measure")
    p.add_argument("--sizes", default="1,8,32", help="chunk sizes in MiB")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per size and test")
    p.add_argument("--threads", type=int, default=4, help="io threads = puts in flight = fio jobs")
    p.add_argument("--scan-counts", default="10000,100000", help="chunk counts for scan()")
    p.add_argument("--skip-fio", action="store_true")
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    print(f"{'op':<6}{'chunk':>7}{'tier GB/s':>11}{'fio GB/s':>10}{'ratio':>7}{'fio+fsync':>11}"
          f"{'ratio':>7}  tier io")  # fmt: skip
    for mib in (int(s) for s in a.sizes.split(",") if s):
        size, count = mib * MiB, max(a.threads, a.total_mib // mib)
        tier_dir, fio_dir = a.dir / f"tier-{mib}", a.dir / f"fio-{mib}"
        w, r, mode = asyncio.run(tier_rw(tier_dir, size, count, a.threads))
        for op, got in (("write", w), ("read", r)):
            if a.skip_fio:
                print(f"{op:<6}{mib:>5}Mi{got:>11.2f}{'-':>10}{'-':>7}{'-':>11}{'-':>7}  {mode}")
                continue
            plain = fio(fio_dir, op, size, size * count, a.threads, fsync=False)
            synced = (
                fio(fio_dir, op, size, size * count, a.threads, fsync=True)
                if op == "write"
                else plain
            )
            print(f"{op:<6}{mib:>5}Mi{got:>11.2f}{plain:>10.2f}{got / plain:>7.2f}"
                  f"{synced:>11.2f}{got / synced:>7.2f}  {mode}")  # fmt: skip
        shutil.rmtree(tier_dir)
        shutil.rmtree(fio_dir, ignore_errors=True)
    print(f"\n{'scan chunks':>12}{'seconds':>10}{'chunks/s':>11}  cache")
    for count in (int(c) for c in a.scan_counts.split(",") if c):
        folder = a.dir / f"scan-{count}"
        lay_out(folder, count, 1024)
        cold = drop_caches()
        seconds, found = asyncio.run(timed_scan(folder, a.threads))
        assert found == count, (found, count)
        print(f"{count:>12}{seconds:>10.2f}{count / seconds:>11.0f}  {'cold' if cold else 'warm'}")
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
