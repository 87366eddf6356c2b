"""The NVMe tier: one checksummed file per chunk, written atomically, verified on every read.

Files live under the tier folder as ``{2 hex}/{64 hex}.kvc`` (format in ``_nvme_format``).
A write goes to a temporary file in the same folder and is renamed over the final name, so after
kill -9 a chunk is either complete or absent; the ``fsync`` policy (``_nvme_sync``: ``always``,
``batch`` — the default, group commit —, ``never``) says when it is also power-loss durable, and
a put returns only then. A read lands in the caller's buffer and is checked against the
header's xxh3-128; a mismatch quarantines the file and raises :class:`IntegrityError` — wrong
bytes never leave.

I/O runs on a bounded thread pool (``io_threads``) through one of two backends with the same
format: kvikio (when ``import kvikio`` works and CUDA is usable) or POSIX (O_DIRECT when the
filesystem allows it, buffered otherwise). ``scan()`` rebuilds the index from headers at start.

``used`` counts the disk space of the committed chunk files with 4 KiB blocks (4096-byte header
plus the payload rounded up to 4096); writes in flight count against ``capacity`` too.
Writes and deletes of one key are serialized (the second waits for the first) so that the
index always agrees with the file on disk; reads are not, and see the old or the new file. A
read that finds its file missing or corrupt drops the index entry only if it is still the one
the read started from (a delete and a new put may have finished meanwhile), and quarantines
only the file it read, never one renamed over it since.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.store.keys import ChunkKey, ChunkMeta
from kvstrata.tiers import _nvme_scan
from kvstrata.tiers._nvme_files import ChunkFiles, Corrupt, unlink_quietly
from kvstrata.tiers._nvme_format import file_bytes
from kvstrata.tiers._nvme_io import PosixBackend, choose_backend, probe_writable
from kvstrata.tiers._nvme_scan import QUARANTINE, RebuildReport
from kvstrata.tiers._nvme_space import DiskFull, FsSpace, is_full_error
from kvstrata.tiers._nvme_sync import POLICIES, SYNC_MARKER, GroupSync
from kvstrata.tiers.base import (
    Buffer,
    ChunkMissing,
    IntegrityError,
    Tier,
    TierFull,
    TierIOError,
    TierUnavailable,
    register_tier,
)

log = logging.getLogger(__name__)
SHARDS = [f"{i:02x}" for i in range(256)]
SCAN_THREADS = 16
#: chunk files hold prompts' KV: folders 0700, files 0600 (as the DRAM arena), whatever the umask
PRIVATE_DIR = 0o700


def make_private(folder: Path) -> None:
    """Tighten a folder (new, or left by an older version or another tool) to 0700."""
    mode = folder.stat().st_mode & 0o777
    if mode == PRIVATE_DIR:
        return
    try:
        os.chmod(folder, PRIVATE_DIR)
    except OSError as exc:
        raise TierUnavailable(
            f"nvme-path folder {folder} has mode {mode:o} and cannot be made private "
            f"(0700): {exc.strerror}"
        ) from exc


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """Settings of the NVMe tier (``nvme-*`` options)."""

    path: str
    capacity: int = 16 * 1024**3
    backend: str = "auto"  # auto | posix | kvikio
    io_threads: int = 4
    write_policy: str = "write-back"  # applied by the store; shown by INFO
    direct: str = "auto"  # POSIX backend: auto | yes | no (O_DIRECT)
    fsync: str = "batch"  # always | batch | never: see _nvme_sync

    def __post_init__(self) -> None:
        if self.fsync not in POLICIES:
            raise ValueError(f"nvme-fsync must be one of {', '.join(POLICIES)}, not {self.fsync!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> NvmeConfig:
        """Build from a :class:`kvstrata.config.Config`."""
        return cls(
            path=str(cfg.nvme_dir),
            capacity=cfg.nvme_capacity,
            backend=cfg.nvme_backend,
            io_threads=cfg.nvme_io_threads,
            write_policy=cfg.nvme_write_policy,
            fsync=cfg.values.get("nvme-fsync", "batch"),
        )


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class NvmeTier(Tier):
    """Chunk files in one folder; see the module docstring."""

    name = "nvme"
    persistent = True

    def __init__(self, config: NvmeConfig) -> None:
        super().__init__()
        self.config = config
        self.root = str(Path(config.path).absolute())
        self._prepare_folder()
        self.backend, self.backend_reason = choose_backend(self.root, config.backend, config.direct)
        self._files = ChunkFiles(self.root, self.backend, config.fsync)
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstrata-nvme")
        self._group = None
        if config.fsync == "batch":
            direct = isinstance(self.backend, PosixBackend) and self.backend.direct
            self._group = GroupSync(os.path.join(self.root, SYNC_MARKER), per_file=not direct)
        self._space = FsSpace(self.root, config.capacity)
        self._index: dict[ChunkKey, ChunkMeta] = {}
        self._used = 0
        self._pending = 0
        self._busy: dict[ChunkKey, asyncio.Event] = {}
        self._closed = False
        self.rebuild_report: RebuildReport | None = None
        self.last_error = ""
        self.stats.extra.update(quarantined=0, enospc=0, eio=0, eacces=0)

    # -- start-up -----------------------------------------------------------------------

    def _prepare_folder(self) -> None:
        root = Path(self.root)
        try:
            if not root.is_dir():
                if root.exists():
                    raise TierUnavailable(f"nvme-path {root} exists and is not a folder")
                if not root.parent.is_dir():
                    raise TierUnavailable(
                        f"nvme-path {root} does not exist, nor does its parent {root.parent}"
                    )
                root.mkdir(mode=PRIVATE_DIR)
            make_private(root)
            for sub in [*SHARDS, QUARANTINE]:
                (root / sub).mkdir(mode=PRIVATE_DIR, exist_ok=True)
                make_private(root / sub)
            probe_writable(self.root)
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise TierUnavailable(f"nvme-path {root} is not usable: {exc.strerror}") from exc

    # -- capacity -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """``nvme-capacity``, lowered while the file system has less room (``_nvme_space``)."""
        return self._space.capacity

    @property
    def used(self) -> int:
        """Disk space of committed chunk files (header + payload in 4 KiB blocks)."""
        return self._used

    @property
    def pending(self) -> int:
        """Disk space of the writes in flight; ``put`` counts it against ``capacity`` too."""
        return self._pending

    # -- async contract -----------------------------------------------------------------

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        self._check_open()
        payload = _byte_view(data)
        if payload.nbytes != meta.size:
            raise ValueError(f"payload is {payload.nbytes} bytes, meta says {meta.size}")
        need = file_bytes(meta.size)
        await self._acquire(meta.key)
        try:
            self._space.recheck(self._used)
            if self._used + self._pending + need > self.capacity:
                raise TierFull(
                    f"nvme: {need} bytes do not fit ({self._used} used and {self._pending} "
                    f"being written of {self.capacity})"
                )
            self._pending += need
            started = time.perf_counter()
            try:
                stored, fd = await self._run(self._files.write, meta, payload)
                if fd >= 0:
                    await self._group_sync(meta.key, fd)
            except IntegrityError:
                self.stats.integrity_errors += 1
                raise
            except TierIOError as exc:
                if not is_full_error(exc):
                    raise
                limit = self._space.lower(self._used)
                raise DiskFull(f"{exc}; capacity now {limit} bytes") from exc
            finally:
                self._pending -= need
            self.stats.seconds_in += time.perf_counter() - started
            old = self._index.get(meta.key)
            self._used += need - (file_bytes(old.size) if old else 0)
            self._index[meta.key] = stored
            self.stats.puts += 1
            self.stats.bytes_in += meta.size
            self.stats.chunks = len(self._index)
        finally:
            self._release(meta.key)

    async def get(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        meta = self._index.get(key)
        if meta is None:
            self.stats.misses += 1
            raise ChunkMissing(key)
        dst = _byte_view(out)
        if dst.nbytes < meta.size:
            raise ValueError(f"buffer of {dst.nbytes} bytes for a {meta.size}-byte chunk")
        started = time.perf_counter()
        try:
            got = await self._run(self._files.read, key, dst)
        except FileNotFoundError:
            self._forget(key, meta)
            self.stats.misses += 1
            raise ChunkMissing(key) from None
        except Corrupt as exc:
            self._forget(key, meta)
            self.stats.integrity_errors += 1
            self.stats.extra["quarantined"] += exc.quarantined
            self.stats.misses += 1
            what = "file quarantined" if exc.quarantined else "file replaced meanwhile"
            raise IntegrityError(f"nvme chunk {key.hex}: {exc}; {what}") from None
        self.stats.seconds_out += time.perf_counter() - started
        self.stats.hits += 1
        self.stats.bytes_out += got.size
        return got

    async def delete(self, key: ChunkKey) -> bool:
        await self._acquire(key)
        try:
            if not self._forget(key):
                return False
            self.stats.deletes += 1
            await self._run(self._files.delete, key)
            if self._group is not None:
                await self._group_sync(key, -1)
            return True
        finally:
            self._release(key)

    async def contains(self, key: ChunkKey) -> bool:
        return key in self._index

    async def meta(self, key: ChunkKey) -> ChunkMeta | None:
        return self._index.get(key)

    async def scan(self) -> AsyncIterator[ChunkMeta]:
        """Rebuild the index from the folder (headers only) and yield every chunk found."""
        self._check_open()
        started = time.perf_counter()
        in_flight = frozenset(self._files.in_flight)
        threads = max(SCAN_THREADS, self.config.io_threads)
        keep = {".kvstrata-probe", SYNC_MARKER}
        shards, moved = await asyncio.get_running_loop().run_in_executor(
            self._pool, _nvme_scan.scan_all, self.root, SHARDS, in_flight, threads, keep
        )
        found = [meta for shard in shards for meta, _ in shard.found]
        for meta in found:
            self._index[meta.key] = meta
        self._used = sum(file_bytes(m.size) for m in self._index.values())
        self.stats.chunks = len(self._index)
        quarantined = moved + sum(s.quarantined for s in shards)
        self.stats.extra["quarantined"] += quarantined
        report = RebuildReport(
            chunks=len(found),
            bytes=sum(m.size for m in found),
            seconds=time.perf_counter() - started,
            quarantined=quarantined,
            temp_removed=sum(s.temp_removed for s in shards),
        )
        self.rebuild_report = report
        log.info(
            "nvme: rebuilt index from %s: %d chunks, %d bytes, %d quarantined, %d temp files "
            "removed in %.3f s",
            self.root, report.chunks, report.bytes, report.quarantined, report.temp_removed,
            report.seconds,
        )  # fmt: skip
        for meta in found:
            yield meta

    def info(self) -> dict[str, Any]:
        report = self.rebuild_report
        return {
            "path": self.root,
            "capacity": self._refreshed_capacity(),
            "capacity_configured": self.config.capacity,
            "capacity_lowered": self._space.lowered_times,
            "enospc": self.stats.extra["enospc"],
            "used": self._used,
            "chunks": len(self._index),
            "backend": self.backend.name,
            "io": self.backend_reason,
            "io_threads": self.config.io_threads,
            "write_policy": self.config.write_policy,
            "fsync": self.config.fsync,
            "group_syncs": self._group.syncs if self._group else 0,
            "group_synced": self._group.synced if self._group else 0,
            "quarantined": self.stats.extra["quarantined"],
            "last_error": self.last_error,
            "rebuild_chunks": report.chunks if report else 0,
            "rebuild_bytes": report.bytes if report else 0,
            "rebuild_seconds": round(report.seconds, 3) if report else 0.0,
            "rebuild_quarantined": report.quarantined if report else 0,
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self._group is not None:
            self._group.close()
        self._files.close()

    # -- event-loop helpers -------------------------------------------------------------

    def _refreshed_capacity(self) -> int:
        self._space.recheck(self._used)
        return self.capacity

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("nvme tier is closed")

    async def _acquire(self, key: ChunkKey) -> None:
        """Wait until no write or delete of ``key`` is running, then mark one running."""
        while (event := self._busy.get(key)) is not None:
            await event.wait()
        self._busy[key] = asyncio.Event()

    def _release(self, key: ChunkKey) -> None:
        self._busy.pop(key).set()

    def _forget(self, key: ChunkKey, only: ChunkMeta | None = None) -> bool:
        """Drop ``key`` from the index (when ``only`` is given: if its entry is that one)."""
        meta = self._index.get(key)
        if meta is None or (only is not None and meta is not only):
            return False
        del self._index[key]
        self._used -= file_bytes(meta.size)
        self.stats.chunks = len(self._index)
        return True

    async def _run(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the pool; OSError becomes a counted, logged TierIOError."""
        self._check_open()  # close() shuts the pool down: a closed tier raises TierUnavailable
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except (FileNotFoundError, Corrupt, IntegrityError):
            raise
        except OSError as exc:
            raise self._io_error(getattr(fn, "__name__", str(fn)), exc) from exc

    async def _group_sync(self, key: ChunkKey, fd: int) -> None:
        """Wait until the group sync (``batch``) has made the write (``fd``: the new file) or
        delete (``fd`` -1) of ``key`` durable; a file it failed on is removed, never served."""
        assert self._group is not None
        path = os.path.join(*self._files.path(key))
        try:
            synced = self._group.submit(fd)
        except TierIOError:  # the tier closed while the write ran
            if fd >= 0:
                await self._unlink(path)
            self.stats.errors += 1
            raise
        try:
            await asyncio.wrap_future(synced)
        except OSError as exc:
            if fd >= 0:
                await self._unlink(path)
            raise self._io_error("group sync", exc) from exc

    async def _unlink(self, path: str) -> None:
        """Remove ``path`` on the pool, or right here once the tier is closed (no pool)."""
        if self._closed:
            unlink_quietly(path)
        else:
            await asyncio.get_running_loop().run_in_executor(self._pool, unlink_quietly, path)

    def _io_error(self, what: str, exc: OSError) -> TierIOError:
        self.stats.errors += 1
        kind = {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio",
                errno.EACCES: "eacces"}  # fmt: skip
        name = kind.get(exc.errno or 0, "eio" if exc.errno is None else "")
        if name:
            self.stats.extra[name] += 1
        self.last_error = f"{errno.errorcode.get(exc.errno or 0, 'EIO')}: {exc.strerror}"
        log.warning("nvme: %s failed: %s", what, self.last_error)
        return TierIOError(f"nvme: {self.last_error}")


# Registered by call rather than as a decorator so that type checkers keep the class type.
register_tier("nvme")(NvmeTier)
