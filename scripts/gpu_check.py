"""GPU tier benchmark and environment report, run by ``scripts/gpu-check.sh`` on a GPU machine.

Measures, side by side with the peer each figure should be judged against (DESIGN: benchmarks
print a table with the peer measured in the same run; they are never assertions):

- lease load: a second process opens the pool's CUDA IPC handle once, views each leased chunk
  as a tensor (``kvstrata.clients.handles``) and copies it into an engine tensor; peer: a
  device-to-device ``copy_`` between two torch tensors in that process.
- DRAM → GPU: ``GpuTier.put`` from the DRAM arena; peer: torch ``copy_`` from a host tensor
  pinned exactly when the arena is (``pin_memory()``), so pinned is compared with pinned and
  pageable with pageable. GPU → DRAM the same way back, into arena reservations.
- NVMe → GPU: ``load_from_nvme`` (kvikio when importable, else POSIX + copy), page cache
  dropped before each pass (``fdatasync`` + ``POSIX_FADV_DONTNEED`` per file, and
  ``vm.drop_caches`` where the process may write it; never in a dry run), payload checksum
  verified; peer: the NVMe tier reading the same files into the DRAM arena. kvikio, the NVMe
  tier and the GPU tier's copy executor all get the same number of threads (``THREADS``).

Every copy is checked (checksums); wrong bytes end the run with exit status 1. ``--dry-run``
runs the same code over the host stand-in (no CUDA, numbers meaningless) so that the script
itself can be tested on CPU machines. ``--json PATH`` writes the results too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.dram import DramConfig, DramTier
from kvstrata.tiers.gpu import GpuConfig, GpuTier
from kvstrata.tiers.gpu_memory import HostMemory
from kvstrata.tiers.gpu_nvme import kvikio_mode, load_from_nvme
from kvstrata.tiers.gpu_select import gpu_available
from kvstrata.tiers.nvme import NvmeConfig, NvmeTier

MiB = 1024 * 1024
THREADS = 4  # the same for the GPU tier's copies, the NVMe tier's reads and kvikio
DROP_SYSTEM_CACHE = False  # set by main() outside dry runs


class WrongBytes(AssertionError):
    """A copy delivered bytes other than those stored."""


@dataclass(frozen=True)
class Row:
    name: str
    nbytes: int
    seconds: float
    peer: str
    peer_seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def peer_gbps(self) -> float:
        return self.nbytes / self.peer_seconds / 1e9 if self.peer_seconds else 0.0


def environment(dry_run: bool) -> dict[str, Any]:
    _, why = gpu_available(0)
    env: dict[str, Any] = {"python": platform.python_version(), "cuda": why, "dry_run": dry_run}
    try:
        import torch

        env["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        env["torch"] = "absent"
    for mod in ("cupy", "kvikio"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = "absent"
    env["kvikio_mode"] = kvikio_mode()
    return env


def meta_of(i: int, data: Any) -> ChunkMeta:
    view = memoryview(data)
    return ChunkMeta(ChunkKey("gpucheck@bench", i.to_bytes(8, "big")), b"", 0, view.nbytes,
                     checksum(view))  # fmt: skip


def best(times: list[float]) -> float:
    return min(times)


async def timed(fn: Callable[[], Awaitable[None]], repeat: int) -> float:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - started)
    return best(out)


def sync() -> None:
    import torch

    torch.cuda.synchronize()


# -- DRAM <-> GPU -------------------------------------------------------------------------------


async def bench_dram_gpu(gpu: GpuTier, dram: DramTier, size: int, n: int, repeat: int,
                         dry: bool) -> list[Row]:  # fmt: skip
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    metas = [meta_of(i, data) for i in range(n)]
    src = metas[0]
    dram.reserve(src.key, size)[:] = data.data
    dram.commit(src)
    view = dram.view(src.key)

    async def h2d() -> None:
        for m in metas:
            await gpu.delete(m.key)
        await asyncio.gather(*(gpu.put(m, view) for m in metas))

    up = await timed(h2d, repeat)
    # into DRAM arena reservations, as the store does: pinned like the source (not bytearrays)
    out_keys = [meta_of(90 + i, b"").key for i in range(2)]
    outs = [dram.reserve(k, size) for k in out_keys]

    async def d2h() -> None:
        await asyncio.gather(*(gpu.get(m.key, memoryview(outs[i % 2])) for i, m in
                               enumerate(metas)))  # fmt: skip

    down = await timed(d2h, repeat)
    for out in outs:
        if checksum(out) != src.checksum:
            raise WrongBytes("GPU → host copy returned other bytes")
    for k in out_keys:
        dram.abort(k)
    pinned = dram.pinned >= dram.capacity  # the peer's host tensor is pinned iff the arena is
    peer_up, peer_down = torch_host_copies(size, n, repeat, dry, pinned)
    for m in metas:
        await gpu.delete(m.key)
    await dram.delete(src.key)
    total = size * n
    kind = "pinned" if pinned else "pageable"
    peer = "numpy copy (dry run)" if dry else f"torch {kind} copy_"
    return [
        Row(f"DRAM→GPU GpuTier.put ({kind} arena)", total, up, f"{peer} H2D", peer_up),
        Row(f"GPU→DRAM GpuTier.get ({kind} arena)", total, down, f"{peer} D2H", peer_down),
    ]


def torch_host_copies(size: int, n: int, repeat: int, dry: bool,
                      pinned: bool) -> tuple[float, float]:  # fmt: skip
    if dry:
        a, b = np.ones(size, np.uint8), np.empty(size, np.uint8)
        started = time.perf_counter()
        for _ in range(n):
            np.copyto(b, a)
        t = time.perf_counter() - started
        return t, t
    import torch

    host = torch.empty(size, dtype=torch.uint8)
    host = host.pin_memory() if pinned else host
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    ups, downs = [], []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            dev.copy_(host, non_blocking=True)
        sync()
        t1 = time.perf_counter()
        for _ in range(n):
            host.copy_(dev, non_blocking=True)
        sync()
        ups.append(t1 - t0)
        downs.append(time.perf_counter() - t1)
    return best(ups), best(downs)


# -- lease load in a second process ---------------------------------------------------------------

_CHILD = r"""
import json, sys, time
import torch, xxhash
from kvstrata.clients.handles import handle_tensor
from kvstrata.clients.results import Handle, RegionInfo
spec = json.loads(sys.argv[1])
region = RegionInfo(**spec["region"])
handles = [Handle(**h) for h in spec["handles"]]
t0 = time.perf_counter()
first = handle_tensor(region, handles[0])
torch.cuda.synchronize()
open_s = time.perf_counter() - t0
engine = torch.empty(handles[0].length, dtype=torch.uint8, device=first.device)
src = torch.empty_like(engine).fill_(3)
lease, peer = [], []
for _ in range(spec["repeat"]):
    torch.cuda.synchronize(); t = time.perf_counter()
    for h in handles:
        engine.copy_(handle_tensor(region, h))
    torch.cuda.synchronize(); lease.append(time.perf_counter() - t)
    ok = xxhash.xxh3_128_hexdigest(engine.cpu().numpy().tobytes()) == spec["checksum"]
    t = time.perf_counter()
    for _ in handles:
        engine.copy_(src)
    torch.cuda.synchronize(); peer.append(time.perf_counter() - t)
    if not ok:
        print(json.dumps({"wrong": True})); sys.exit(1)
print(json.dumps({"open_s": open_s, "lease_s": min(lease), "peer_s": min(peer)}))
"""


async def bench_lease(gpu: GpuTier, size: int, n: int, repeat: int, dry: bool) -> list[Row]:
    if dry:
        return []
    data = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    metas = [meta_of(100 + i, data) for i in range(n)]
    for m in metas:
        await gpu.put(m, data.data)
    r = gpu.regions()[0]
    spec = {
        "region": {"name": r.name, "kind": r.kind, "size": r.size, "path": r.path,
                   "device": r.device, "pci_bus_id": r.pci_bus_id},
        "handles": [{"region": h.region, "offset": h.offset, "length": h.length}
                    for h in (gpu.handle(m.key) for m in metas)],
        "checksum": metas[0].checksum.hex(),
        "repeat": repeat,
    }  # fmt: skip
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    for m in metas:
        await gpu.delete(m.key)
    if proc.returncode != 0:
        if '"wrong": true' in proc.stdout:
            raise WrongBytes("a second process read other bytes through the IPC handle")
        raise RuntimeError(f"lease child failed:\n{proc.stderr}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  IPC handle opened in the second process in {res['open_s'] * 1e3:.1f} ms")
    return [Row("lease → engine tensor (2nd process)", size * n, res["lease_s"],
                "torch D2D copy_", res["peer_s"])]  # fmt: skip


# -- NVMe -> GPU ----------------------------------------------------------------------------------


def filesystem(path: str | None) -> str:
    """Mount point and type holding ``path`` (tmpfs makes the NVMe figures memory figures)."""
    target = os.path.realpath(path or tempfile.gettempdir())
    best_mount, best_type = "?", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            mnt, fstype = line.split()[1:3]
            inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
            if inside and (best_mount == "?" or len(mnt) >= len(best_mount)):
                best_mount, best_type = mnt, fstype
    return f"{best_mount} ({best_type})"


def drop_cache(path: str) -> None:
    """Evict the file's pages: flushed first (dirty pages cannot be dropped, and the files were
    just written), then POSIX_FADV_DONTNEED; the whole page cache too where we may (root)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_all_caches() -> str:
    """Drop the whole page cache when this process may (root on the GPU machine; never in a
    dry run, which runs on shared machines); says how the cache was dropped, for the report."""
    if not DROP_SYSTEM_CACHE:
        return "fdatasync + fadvise(DONTNEED) per file (system cache left alone: dry run)"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "fdatasync + fadvise(DONTNEED) per file, and vm.drop_caches=1"
    except OSError:
        return "fdatasync + fadvise(DONTNEED) per file (vm.drop_caches not writable)"


def set_kvikio_threads(n: int) -> str:
    """Give kvikio as many threads as the NVMe tier and the GPU tier's copy executor."""
    try:
        import kvikio.defaults as kd
    except Exception as exc:  # absent or broken: the POSIX path runs
        return f"kvikio unavailable ({type(exc).__name__})"
    setter = getattr(kd, "set", None)
    if callable(setter):  # >= 25.04
        setter("num_threads", n)
    else:
        kd.num_threads_reset(n)
    return f"kvikio threads {n}"


async def bench_nvme_gpu(gpu: GpuTier, dram: DramTier, nvme: NvmeTier, size: int, n: int,
                         repeat: int) -> list[Row]:  # fmt: skip
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    metas = [meta_of(200 + i, data) for i in range(n)]
    for m in metas:
        await nvme.put(m, data.data)
    where = {m.key: nvme.locate(m.key) for m in metas}  # a chunk file, or a slab slot
    paths = sorted({loc[0] for loc in where.values() if loc is not None})
    how = ""

    async def to_gpu() -> None:
        nonlocal how
        for m in metas:
            await gpu.delete(m.key)
        for p in paths:
            drop_cache(p)
        drop_all_caches()
        for m in metas:
            how = await load_from_nvme(gpu, nvme.root, m, at=where[m.key])

    direct = await timed(to_gpu, repeat)
    out = bytearray(size)
    await gpu.get(metas[-1].key, memoryview(out))
    if checksum(out) != metas[-1].checksum:
        raise WrongBytes("NVMe → GPU delivered other bytes")
    slot = dram.reserve(metas[0].key, size)

    async def to_dram() -> None:
        for p in paths:
            drop_cache(p)
        drop_all_caches()
        for m in metas:
            await nvme.get(m.key, slot)

    peer = await timed(to_dram, repeat)
    dram.abort(metas[0].key)
    for m in metas:
        await gpu.delete(m.key)
        await nvme.delete(m.key)
    return [Row(f"NVMe→GPU load_from_nvme ({how})", size * n, direct,
                f"NVMe→DRAM ({nvme.backend.name})", peer)]  # fmt: skip


# -- main -----------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    head = f"{'measurement':<38} {'MiB':>7} {'GB/s':>8}   {'peer':<26} {'GB/s':>8} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = r.gbps / r.peer_gbps if r.peer_gbps else 0.0
        print(f"{r.name:<38} {r.nbytes // MiB:>7} {r.gbps:>8.2f}   {r.peer:<26} "
              f"{r.peer_gbps:>8.2f} {ratio:>6.2f}")  # fmt: skip


async def main(args: argparse.Namespace) -> int:
    env = environment(args.dry_run)
    for k, v in env.items():
        print(f"  {k}: {v}")
    size, n = args.chunk_mib * MiB, args.chunks
    global DROP_SYSTEM_CACHE
    DROP_SYSTEM_CACHE = not args.dry_run
    pool = size * n + 64 * MiB
    if args.dry_run:
        gpu = GpuTier(GpuConfig(capacity=pool, copy_threads=THREADS), memory=HostMemory(pool))
    else:
        ok, why = gpu_available(0)
        if not ok:
            print(f"gpu_check: CUDA is not available ({why}); use --dry-run", file=sys.stderr)
            return 2
        gpu = GpuTier(GpuConfig(capacity=pool, copy_threads=THREADS))
    dram = DramTier(DramConfig(capacity=4 * size + 64 * MiB, name_prefix="kvstrata-gpucheck"))
    print(f"  dram arena pinned: {dram.pinned} bytes ({dram.pin_reason})")
    print(f"  threads: gpu copy {THREADS}, nvme io {THREADS}, {set_kvikio_threads(THREADS)}")
    print(f"  page cache: {drop_all_caches()}")
    print(f"  nvme folder: {args.nvme_dir or tempfile.gettempdir()} on {filesystem(args.nvme_dir)}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as folder:
        nvme = NvmeTier(NvmeConfig(folder, capacity=4 * size * n + 64 * MiB, io_threads=THREADS))
        async for _ in nvme.scan():
            pass
        try:
            rows += await bench_lease(gpu, size, n, args.repeat, args.dry_run)
            rows += await bench_dram_gpu(gpu, dram, size, n, args.repeat, args.dry_run)
            rows += await bench_nvme_gpu(gpu, dram, nvme, size, max(1, n // 2), args.repeat)
        finally:
            for tier in (nvme, gpu, dram):
                await tier.close()
    print()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"environment": env, "rows": [asdict(r) | {"gbps": r.gbps, "peer_gbps": r.peer_gbps}
                                          for r in rows]}, indent=2))  # fmt: skip
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench", action="store_true", help="run the benchmark (the default)")
    p.add_argument("--dry-run", action="store_true", help="host stand-in, no CUDA needed")
    p.add_argument("--chunk-mib", type=int, default=64, help="chunk size in MiB (64)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per pass (16)")
    p.add_argument("--repeat", type=int, default=3, help="passes; the best one counts (3)")
    p.add_argument("--nvme-dir", default=None, help="folder on the NVMe disk (default: TMPDIR)")
    p.add_argument("--json", default="", help="also write the results here")
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(parse_args())))
    except WrongBytes as exc:
        print(f"gpu_check: WRONG BYTES: {exc}", file=sys.stderr)
        sys.exit(1)
