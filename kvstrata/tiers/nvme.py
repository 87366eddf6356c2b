"""The NVMe tier: one checksummed file per chunk, written atomically, verified on every read.

Files live under the tier folder as ``{2 hex}/{64 hex}.kvc`` (format in ``_nvme_format``).
A write goes to a temporary file in the same folder, is fsynced, renamed over the final name
and the folder is fsynced, so after kill -9 (or power loss) a chunk is either complete or
absent. A read lands in the caller's buffer and is checked against the header's xxh3-128; a
mismatch quarantines the file and raises :class:`IntegrityError` — wrong bytes never leave.

I/O runs on a bounded thread pool (``io_threads``) through one of two backends with the same
format: kvikio (when ``import kvikio`` works and CUDA is usable) or POSIX (O_DIRECT when the
filesystem allows it, buffered otherwise). ``scan()`` rebuilds the index from headers at start.

``used`` counts the disk space of the committed chunk files with 4 KiB blocks (4096-byte header
plus the payload rounded up to 4096); writes in flight count against ``capacity`` too.
Writes and deletes of one key are serialized (the second waits for the first) so that the
index always agrees with the file on disk; reads are not, and see the old or the new file.
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvstrata.store.keys import ChunkKey, ChunkMeta
from kvstrata.tiers import _cuda, _nvme_scan
from kvstrata.tiers._nvme_format import (
    TMP_SUFFIX,
    BadHeader,
    chunk_digest,
    decode_header,
    encode_header,
    file_bytes,
)
from kvstrata.tiers._nvme_io import (
    Backend,
    KvikioBackend,
    PosixBackend,
    probe_direct,
    probe_writable,
)
from kvstrata.tiers._nvme_scan import QUARANTINE, RebuildReport
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
from kvstrata.tiers.checksum import checksum

log = logging.getLogger(__name__)
SHARDS = [f"{i:02x}" for i in range(256)]
SCAN_THREADS = 16
_tmp_numbers = itertools.count()


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """Settings of the NVMe tier (``nvme-*`` options)."""

    path: str
    capacity: int = 16 * 1024**3
    backend: str = "auto"  # auto | posix | kvikio
    io_threads: int = 4
    write_policy: str = "write-back"  # applied by the store; shown by INFO
    direct: str = "auto"  # POSIX backend: auto | yes | no (O_DIRECT)

    @classmethod
    def from_config(cls, cfg: Any) -> NvmeConfig:
        """Build from a :class:`kvstrata.config.Config`."""
        return cls(
            path=str(cfg.nvme_dir),
            capacity=cfg.nvme_capacity,
            backend=cfg.nvme_backend,
            io_threads=cfg.nvme_io_threads,
            write_policy=cfg.nvme_write_policy,
        )


class _Corrupt(Exception):
    """Raised on the I/O thread when a file failed verification (and was quarantined)."""


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
        self._dir_fds: dict[str, int] = {}
        self._dir_lock = threading.Lock()  # guards _dir_fds only, never held during I/O
        self._prepare_folder()
        self.backend, self.backend_reason = self._choose_backend()
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstrata-nvme")
        self._index: dict[ChunkKey, ChunkMeta] = {}
        self._used = 0
        self._pending = 0
        self._busy: dict[ChunkKey, asyncio.Event] = {}
        self._in_flight: set[str] = set()
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
                root.mkdir()
            for sub in [*SHARDS, QUARANTINE]:
                (root / sub).mkdir(exist_ok=True)
            probe_writable(self.root)
            self._fsync_dir(self.root)
        except OSError as exc:
            raise TierUnavailable(f"nvme-path {root} is not usable: {exc.strerror}") from exc

    def _choose_backend(self) -> tuple[Backend, str]:
        wanted = self.config.backend
        if wanted not in ("auto", "posix", "kvikio"):
            raise TierUnavailable(f"nvme backend must be auto, posix or kvikio, not {wanted!r}")
        if wanted != "posix":
            why = None if importlib.util.find_spec("kvikio") else "kvikio is not installed"
            why = why or _cuda.cuda_unavailable_reason()
            if why is None:
                return KvikioBackend(), "kvikio with CUDA"
            if wanted == "kvikio":
                raise TierUnavailable(f"nvme backend kvikio is not usable: {why}")
        if self.config.direct == "no":
            return PosixBackend(direct=False), "buffered (nvme direct=no)"
        try:
            direct, why = probe_direct(self.root)
        except OSError as exc:
            raise TierUnavailable(f"nvme-path {self.root} is not writable: {exc}") from exc
        if not direct:
            if self.config.direct == "yes":
                raise TierUnavailable(f"nvme O_DIRECT requested but {why}")
            log.info("nvme: %s at %s; using buffered I/O", why, self.root)
            return PosixBackend(direct=False), f"buffered ({why})"
        return PosixBackend(direct=True), "O_DIRECT"

    # -- capacity -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def used(self) -> int:
        """Disk space of committed chunk files (header + payload in 4 KiB blocks)."""
        return self._used

    # -- async contract -----------------------------------------------------------------

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        self._check_open()
        payload = _byte_view(data)
        if payload.nbytes != meta.size:
            raise ValueError(f"payload is {payload.nbytes} bytes, meta says {meta.size}")
        need = file_bytes(meta.size)
        await self._acquire(meta.key)
        try:
            if self._used + self._pending + need > self.capacity:
                raise TierFull(f"nvme: {need} bytes do not fit ({self._used} of {self.capacity})")
            self._pending += need
            started = time.perf_counter()
            try:
                stored = await self._run(self._write_sync, meta, payload)
            except IntegrityError:
                self.stats.integrity_errors += 1
                raise
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
            got = await self._run(self._read_sync, key, dst)
        except FileNotFoundError:
            self._forget(key)
            self.stats.misses += 1
            raise ChunkMissing(key) from None
        except _Corrupt as exc:
            self._forget(key)
            self.stats.integrity_errors += 1
            self.stats.extra["quarantined"] += 1
            self.stats.misses += 1
            raise IntegrityError(f"nvme chunk {key.hex}: {exc}; file quarantined") from None
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
            await self._run(self._delete_sync, key)
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
        loop = asyncio.get_running_loop()
        in_flight = frozenset(self._in_flight)
        # Cold header reads are latency bound: a wider, short-lived pool keeps the disk busy.
        with ThreadPoolExecutor(max(SCAN_THREADS, self.config.io_threads)) as pool:
            shards = await asyncio.gather(
                *(
                    loop.run_in_executor(pool, _nvme_scan.scan_shard, self.root, s, in_flight)
                    for s in SHARDS
                )
            )
            keep = {".kvstrata-probe"}
            moved = await loop.run_in_executor(
                pool, _nvme_scan.scan_root, self.root, keep.__contains__
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
            "capacity": self.capacity,
            "used": self._used,
            "chunks": len(self._index),
            "backend": self.backend.name,
            "io": self.backend_reason,
            "io_threads": self.config.io_threads,
            "write_policy": self.config.write_policy,
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
        with self._dir_lock:
            for fd in self._dir_fds.values():
                os.close(fd)
            self._dir_fds.clear()

    # -- event-loop helpers -------------------------------------------------------------

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

    def _forget(self, key: ChunkKey) -> bool:
        meta = self._index.pop(key, None)
        if meta is None:
            return False
        self._used -= file_bytes(meta.size)
        self.stats.chunks = len(self._index)
        return True

    async def _run(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the pool; OSError becomes a counted, logged TierIOError."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except (FileNotFoundError, _Corrupt, IntegrityError):
            raise
        except OSError as exc:
            self.stats.errors += 1
            kind = {errno.ENOSPC: "enospc", errno.EIO: "eio", errno.EACCES: "eacces"}
            name = kind.get(exc.errno or 0, "eio" if exc.errno is None else "")
            if name:
                self.stats.extra[name] += 1
            self.last_error = f"{errno.errorcode.get(exc.errno or 0, 'EIO')}: {exc.strerror}"
            log.warning("nvme: %s failed: %s", getattr(fn, "__name__", fn), self.last_error)
            raise TierIOError(f"nvme: {self.last_error}") from exc

    # -- blocking work on the pool ------------------------------------------------------

    def _path(self, key: ChunkKey) -> tuple[str, str]:
        digest = chunk_digest(key)
        return os.path.join(self.root, digest[:2]), f"{digest}.kvc"

    def _write_sync(self, meta: ChunkMeta, payload: memoryview) -> ChunkMeta:
        csum = checksum(payload)
        if meta.checksum and meta.checksum != csum:
            raise IntegrityError(f"payload of {meta.key.hex} does not match its checksum")
        stored = ChunkMeta(meta.key, meta.parent, meta.tokens, meta.size, csum, meta.codec)
        header = encode_header(stored, csum, time.time_ns())
        folder, name = self._path(meta.key)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{next(_tmp_numbers)}{TMP_SUFFIX}")
        self._in_flight.add(tmp)
        try:
            self.backend.write_file(tmp, header, payload)
            os.replace(tmp, os.path.join(folder, name))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        finally:
            self._in_flight.discard(tmp)
        self._fsync_dir(folder)
        return stored

    def _read_sync(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        folder, name = self._path(key)
        path = os.path.join(folder, name)
        block, got = self.backend.read_file(path, out)
        try:
            meta = decode_header(block).meta
        except BadHeader as exc:
            self._quarantine(path, str(exc))
        if meta.key != key:
            self._quarantine(path, "header names another chunk")
        if meta.size > len(out):
            # A concurrent replacement wrote a larger chunk after our index lookup.
            raise ChunkMissing(key)
        if got < meta.size:
            self._quarantine(path, f"truncated payload ({got} of {meta.size} bytes)")
        if checksum(out[: meta.size]) != meta.checksum:
            self._quarantine(path, "payload checksum mismatch")
        return meta

    def _quarantine(self, path: str, reason: str) -> NoReturn:
        _nvme_scan.quarantine(self.root, path, reason)
        raise _Corrupt(reason)

    def _delete_sync(self, key: ChunkKey) -> None:
        folder, name = self._path(key)
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            return
        self._fsync_dir(folder)

    def _fsync_dir(self, folder: str) -> None:
        fd = self._dir_fds.get(folder)
        if fd is None:
            with self._dir_lock:
                fd = self._dir_fds.get(folder)
                if fd is None:
                    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    self._dir_fds[folder] = fd
        os.fsync(fd)


# Registered by call rather than as a decorator so that type checkers keep the class type.
register_tier("nvme")(NvmeTier)
