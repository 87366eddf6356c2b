"""NVMe tier throughput against fio --direct=1 on the same folder, and index rebuild time.

    python bench/bench_nvme.py --dir /tmp/x [--sizes 256KiB,1MiB,8MiB,32MiB] [--total-mib 512]
                               [--threads 4]
                               [--in-flight N[,N…]] [--fsync always,batch,never] [--repeat 3]
                               [--scan-counts 10000,100000]

For each chunk size and ``nvme-fsync`` policy: the tier writes ``--total-mib`` of chunks (up to
``nvme-slab-max``, 1 MiB by default, each a slot of a slab file: one O_DIRECT write at an offset;
larger ones each a file: temp file, O_DIRECT writes, rename; then the policy's syncs; the layout
column says which) on ``--threads`` io threads
with ``--in-flight`` puts awaited at once (default: as many as threads; more let ``batch``
group its syncs while the disk still sees ``--threads`` writes, and the puts that reach the tier
together share pool jobs and ``pwritev`` calls, as an eviction round's victims do: the store
demotes all of a round's victims at once; a list gives one table each), then reads them all back
(checksum verified). fio runs in the same folder with the same block size and job count,
``--direct=1 --ioengine=psync``, plain (read and write) and with ``--fsync=1`` (an fsync after
every block). The runs alternate (tier under every policy, then
fio) ``--repeat`` times and the table gives medians: the disk of a shared VM swings by ±50 %.
Under each table, the tier's CPU per put and per get (the whole process: event loop and I/O
threads), which those swings move least.
The rebuild part lays out N small chunks of 1 KiB, as chunk files (the format of versions before
slabs, and of chunks over ``nvme-slab-max``) and as slab slots, and times ``scan()`` of a fresh
tier ``--repeat`` times (page cache dropped first when allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.config import format_size, parse_size
from kvstrata.tiers import _nvme_format as fmt
from kvstrata.tiers._nvme_sync import POLICIES
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

MiB = 1024 * 1024


def aligned(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))


async def tier_rw(
    folder: Path, size: int, count: int, threads: int, policy: str, in_flight: int = 0
) -> tuple[float, float, str, float, float]:
    """(write GB/s, read GB/s, io mode, CPU µs per put, per get) of the tier for ``count``
    chunks of ``size`` bytes; CPU is the whole process's (event loop and I/O threads, user and
    system), the figure a loaded machine's swings move least."""
    config = NvmeConfig(str(folder), capacity=1 << 50, io_threads=threads, fsync=policy)
    tier = NvmeTier(config)
    src = aligned(size)
    src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    csum = checksum(src)
    metas = [
        ChunkMeta(ChunkKey("bench", i.to_bytes(8, "big")), b"", i, size, csum) for i in range(count)
    ]
    sem = asyncio.Semaphore(in_flight or threads)

    async def put(meta: ChunkMeta) -> None:
        async with sem:
            await tier.put(meta, src)

    started, cpu = time.perf_counter(), process_cpu()
    await asyncio.gather(*(put(m) for m in metas))
    write = size * count / (time.perf_counter() - started) / 1e9
    cpu_put = (process_cpu() - cpu) / count * 1e6
    outs = [aligned(size) for _ in range(in_flight or threads)]
    free = list(range(in_flight or threads))

    async def get(meta: ChunkMeta) -> None:
        async with sem:
            slot = free.pop()
            try:
                await tier.get(meta.key, outs[slot])
            finally:
                free.append(slot)

    started, cpu = time.perf_counter(), process_cpu()
    await asyncio.gather(*(get(m) for m in metas))
    read = size * count / (time.perf_counter() - started) / 1e9
    cpu_get = (process_cpu() - cpu) / count * 1e6
    info = tier.info()
    mode = f"{info['io']}, {'slabs' if info.get('slab_chunks') else 'files'}"
    await tier.close()
    return write, read, mode, cpu_put, cpu_get


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


async def lay_out_slabs(folder: Path, count: int, payload: int) -> None:
    """Write ``count`` chunks into slab slots through the tier (fsync never)."""
    tier = NvmeTier(NvmeConfig(str(folder), capacity=1 << 50, fsync="never"))
    data = b"\x5a" * payload
    csum = checksum(data)
    for start in range(0, count, 1024):
        await tier.put_many([
            (ChunkMeta(ChunkKey("scan", i.to_bytes(8, "big")), b"", i, payload, csum), data)
            for i in range(start, min(count, start + 1024))
        ])  # fmt: skip
    assert tier.info()["slab_chunks"] == count
    await tier.close()


async def timed_scan(folder: Path, threads: int) -> tuple[float, int]:
    tier = NvmeTier(NvmeConfig(str(folder), capacity=1 << 50, io_threads=threads))
    started = time.perf_counter()
    found = sum([1 async for _ in tier.scan()])
    seconds = time.perf_counter() - started
    await tier.close()
    return seconds, found


def rw_table(a: argparse.Namespace, policies: list[str], flight: int) -> None:
    """Median GB/s per size of the tier under each policy and of fio, runs alternated."""
    head = f"{'op':<6}{'chunk':>7}{'fio':>7}{'fio+fsync':>10}"
    head += "".join(f"{p:>9}{'ratio':>6}" for p in policies)
    print(f"GB/s, median of {a.repeat} alternated runs; ratio = tier / plain fio; {a.threads} io "
          f"threads = fio jobs, {flight} tier ops in flight\n{head}")  # fmt: skip
    for size in (parse_size(s) for s in a.sizes.split(",") if s):
        count, mib = max(a.threads, a.total_mib * MiB // size), format_size(size)
        runs: dict[str, list[float]] = {}
        mode = ""
        for _ in range(a.repeat):
            for policy in policies:
                tier_dir = a.dir / f"tier-{mib}-{policy}"
                args = (tier_dir, size, count, a.threads, policy, flight)
                w, r, mode, cpu_w, cpu_r = asyncio.run(tier_rw(*args))
                runs.setdefault(f"write {policy}", []).append(w)
                runs.setdefault(f"read {policy}", []).append(r)
                runs.setdefault(f"write cpu {policy}", []).append(cpu_w)
                runs.setdefault(f"read cpu {policy}", []).append(cpu_r)
                shutil.rmtree(tier_dir)
            if a.skip_fio:
                continue
            fio_dir = a.dir / f"fio-{mib}"
            for op, sync in (("write", False), ("read", False), ("write", True)):
                got = fio(fio_dir, op, size, size * count, a.threads, fsync=sync)
                runs.setdefault(f"{op} fio{'+fsync' if sync else ''}", []).append(got)
            shutil.rmtree(fio_dir, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        for op in ("write", "read"):
            plain = med.get(f"{op} fio", math.nan)
            synced = med.get("write fio+fsync", math.nan) if op == "write" else math.nan
            row = f"{op:<6}{mib:>7}{plain:>7.2f}{synced:>10.2f}"
            for policy in policies:
                got = med[f"{op} {policy}"]
                row += f"{got:>9.2f}{got / plain:>6.2f}"
            print(f"{row}  {mode}")
        cpu = "  ".join(
            f"{p} {med[f'write cpu {p}']:.0f}/{med[f'read cpu {p}']:.0f}" for p in policies
        )
        print(f"{'':<13}tier CPU µs per put/get (process): {cpu}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, type=Path, help="folder on the disk to measure")
    p.add_argument("--sizes", default="256KiB,1MiB,8MiB,32MiB", help="chunk sizes")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per size and test")
    p.add_argument("--threads", type=int, default=4, help="io threads = puts in flight = fio jobs")
    p.add_argument(
        "--in-flight", default="", help="puts/gets in flight, a list (default: --threads)"
    )
    p.add_argument("--fsync", default=",".join(POLICIES), help="nvme-fsync policies to run")
    p.add_argument("--repeat", type=int, default=3, help="alternated runs per size (median)")
    p.add_argument("--scan-counts", default="10000,100000", help="chunk counts for scan()")
    p.add_argument("--skip-fio", action="store_true")
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    policies = [x for x in a.fsync.split(",") if x]
    for flight in [int(n) for n in a.in_flight.split(",") if n] or [a.threads]:
        if a.sizes:
            rw_table(a, policies, flight)
    layouts = ["files"] + (["slabs"] if "slab_max" in NvmeConfig.__dataclass_fields__ else [])
    print(f"\n{'layout':<7}{'scan chunks':>12}{'seconds':>10}{'chunks/s':>11}  cache")
    for count, layout in itertools.product(
        (int(c) for c in a.scan_counts.split(",") if c), layouts
    ):
        folder = a.dir / f"scan-{count}-{layout}"
        if layout == "files":
            lay_out(folder, count, 1024)
        else:
            asyncio.run(lay_out_slabs(folder, count, 1024))
        for _ in range(a.repeat):
            cold = drop_caches()
            seconds, found = asyncio.run(timed_scan(folder, a.threads))
            assert found == count, (found, count)
            rate = count / seconds
            print(f"{layout:<7}{count:>12}{seconds:>10.2f}{rate:>11.0f}  "
                  f"{'cold' if cold else 'warm'}")  # fmt: skip
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
