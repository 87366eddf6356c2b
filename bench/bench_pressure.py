"""KV.PUT latency under sustained write pressure, beside the disk's own write limit.

    python bench/bench_pressure.py [--seconds 60] [--writers 8] [--chunk-mib 1]
                                   [--dram 32MiB] [--nvme 4GiB] [--dir /var/tmp] [--leasers 2]

``--writers`` clients store distinct ``--chunk-mib`` chunks as fast as they can for
``--seconds`` into a server whose DRAM tier (``--dram``) is far smaller than what they write,
over an NVMe tier in ``--dir``: every PUT beyond the first few needs DRAM room, made by writing
older chunks back to NVMe. The table gives p50/p99/max KV.PUT latency, errors, and the
throughput beside the disk's sequential write limit measured in the same run on the same folder
(the same number of bytes in chunk-sized O_DIRECT writes, then fsync; and ``fio`` when
installed): with write-back, sustained PUT throughput cannot exceed what the disk absorbs.
``--leasers`` clients meanwhile take KV.LEASE on random recently stored chunks (most of them
on NVMe: each lease promotes into DRAM, waiting for room in turn with the writers) and release
them; their p50/p99/max are given too.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import kvstrata_server

MiB = 1024 * 1024


def disk_limit(folder: Path, nbytes: int, block: int) -> float:
    """MB/s of sequential O_DIRECT writes of ``nbytes`` in ``block`` pieces, fsync'd."""
    path = folder / "bench-pressure-disk.tmp"
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(block))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered + fsync
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    started = time.perf_counter()
    try:
        for _ in range(max(1, nbytes // block)):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return max(1, nbytes // block) * block / (time.perf_counter() - started) / 1e6


def fio_limit(folder: Path, nbytes: int, block: int) -> float | None:
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(
        ["fio", "--name=seqwrite", f"--directory={folder}", "--rw=write", "--direct=1",
         f"--bs={block}", f"--size={nbytes}", "--ioengine=psync", "--end_fsync=1",
         "--output-format=terse", "--terse-version=3"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    try:
        return float(out.stdout.split(";")[47]) * 1024 / 1e6  # write bandwidth, KiB/s
    except (IndexError, ValueError):
        return None


STORED: list[bytes] = []  # hashes stored so far (list.append is atomic in CPython)


def writer(port: int, wid: int, size: int, until: float, out: list[float], errs: list[str]) -> None:
    r = redis.Redis(port=port, socket_timeout=120)
    payload = os.urandom(size)
    n = 0
    while time.monotonic() < until:
        h = wid.to_bytes(2, "big") + n.to_bytes(6, "big")
        started = time.perf_counter()
        try:
            r.execute_command("KV.PUT", "pressure@bench", h, b"", payload)
            STORED.append(h)
        except redis.RedisError as exc:
            errs.append(str(exc)[:80])
        out.append(time.perf_counter() - started)
        n += 1
    r.close()


def leaser(port: int, seed: int, until: float, out: list[float], errs: list[str]) -> None:
    r = redis.Redis(port=port, socket_timeout=120)
    rng = random.Random(seed)
    while time.monotonic() < until:
        if len(STORED) < 64:
            time.sleep(0.01)
            continue
        h = STORED[-rng.randrange(1, min(len(STORED), 2000))]
        started = time.perf_counter()
        try:
            lease = r.execute_command("KV.LEASE", "pressure@bench", h, "TTL", 5000)
            out.append(time.perf_counter() - started)
            if lease and lease[0]:
                r.execute_command("KV.RELEASE", lease[0])
        except redis.RedisError as exc:
            errs.append(str(exc)[:80])
            out.append(time.perf_counter() - started)
    r.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--chunk-mib", type=float, default=1.0)
    ap.add_argument("--dram", default="32MiB")
    ap.add_argument("--nvme", default="4GiB")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--leasers", type=int, default=2)
    args = ap.parse_args()
    size = int(args.chunk_mib * MiB)
    folder = Path(tempfile.mkdtemp(prefix="kvstrata-pressure-", dir=args.dir))
    lat: list[list[float]] = [[] for _ in range(args.writers)]
    errs: list[str] = []
    lease_lat: list[float] = []
    lease_errs: list[str] = []
    try:
        flags = ("--dram-capacity", args.dram, "--nvme-capacity", args.nvme,
                 "--nvme-path", str(folder / "nvme"))  # fmt: skip
        with kvstrata_server(*flags) as srv:
            until = time.monotonic() + args.seconds
            started = time.perf_counter()
            threads = [
                threading.Thread(target=writer, args=(srv.port, w, size, until, lat[w], errs))
                for w in range(args.writers)
            ] + [
                threading.Thread(target=leaser, args=(srv.port, k, until, lease_lat, lease_errs))
                for k in range(args.leasers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - started
            info = redis.Redis(port=srv.port).info("tiers")
        all_lat = [x for w in lat for x in w]
        written = len(all_lat) * size
        limit = disk_limit(folder, min(written, 2048 * MiB), size)
        fio = fio_limit(folder, min(written, 2048 * MiB), size)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per_writer = [len(w) for w in lat]
    print(f"{args.writers} writers x {args.chunk_mib:g} MiB chunks, {args.seconds:g} s, "
          f"DRAM {args.dram} over NVMe {args.nvme} in {args.dir}")  # fmt: skip
    print(f"{'what':<34}{'value':>14}")
    rows = [
        ("KV.PUT count", f"{len(all_lat)}"),
        ("KV.PUT errors", f"{len(errs)}"),
        ("PUTs per writer min/max", f"{min(per_writer)}/{max(per_writer)}"),
        ("KV.PUT p50 (s)", f"{statistics.median(all_lat):.3f}"),
        ("KV.PUT p99 (s)", f"{pct(all_lat, 0.99):.3f}"),
        ("KV.PUT max (s)", f"{max(all_lat):.3f}"),
        ("KV.LEASE count / errors", f"{len(lease_lat)} / {len(lease_errs)}"),
        ("KV.LEASE p50 (s)", f"{statistics.median(lease_lat):.3f}" if lease_lat else "-"),
        ("KV.LEASE p99 (s)", f"{pct(lease_lat, 0.99):.3f}" if lease_lat else "-"),
        ("KV.LEASE max (s)", f"{max(lease_lat):.3f}" if lease_lat else "-"),
        ("PUT throughput (MB/s)", f"{written / elapsed / 1e6:.0f}"),
        ("disk O_DIRECT+fsync (MB/s)", f"{limit:.0f}"),
        ("fio --direct=1 (MB/s)", "not installed" if fio is None else f"{fio:.0f}"),
        ("PUT / disk", f"{written / elapsed / 1e6 / limit:.2f}"),
        ("nvme demotions (dram)", f"{info.get('dram_demotions', 0)}"),
    ]
    for name, value in rows:
        print(f"{name:<34}{value:>14}")
    if errs or lease_errs:
        print("first errors:", *sorted(set(errs + lease_errs))[:3], sep="\n  ")


if __name__ == "__main__":
    main()
