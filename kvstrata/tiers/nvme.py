"""The NVMe tier: checksummed chunks on local disk, written atomically, verified on every read.

Two layouts with one header format (``_nvme_format``): a chunk of at most ``nvme-slab-max``
bytes (1 MiB by default) is a slot of a preallocated slab file (``_nvme_slabs``: one aligned
write at an offset, no file per chunk); a larger one is a file ``{2 hex}/{64 hex}.kvc``,
written to a temporary file and renamed over the final name. After kill -9 a chunk is complete
or absent (a torn slot fails its checksums and is freed, never served); the ``fsync`` policy
(``_nvme_sync``: ``always``, ``batch`` — the default, group commit —, ``never``) says when it is
also power-loss durable, and a put returns only then. A read lands in the caller's buffer and is
checked against the header's xxh3-128; a mismatch quarantines the file (or invalidates the
slot) and raises :class:`IntegrityError` — wrong bytes never leave.

I/O runs on a bounded thread pool (``io_threads``) through one of two backends with the same
format: kvikio (when ``import kvikio`` works and CUDA is usable) or POSIX (O_DIRECT when the
filesystem allows it, buffered otherwise); with the ``_iopool`` extension built, O_DIRECT slab
slot reads and writes go through a C pool of POSIX threads instead (``_nvme_cpool``: no GIL,
completions through an eventfd on the loop; the same bytes on disk). ``scan()`` rebuilds the
index from headers at start: chunk files (also those of versions before slabs: served, and
replaced by a slot when the chunk is written again or evicted — never migrated in the
background) and slab slots.

``used`` counts the disk space of committed chunks: a file's 4096-byte header plus the payload
rounded up to 4096, or the size of its slot; writes in flight count against ``capacity`` too.
Writes and deletes of one key are serialized (the second waits for the first) so that the
index always agrees with the disk; reads are not, and see the old or the new copy. A read
that finds its copy missing or corrupt drops the index entry only if it is still the one the
read started from (a delete and a new put may have finished meanwhile), and quarantines only
the file it read, never one renamed over it since (a slot reused meanwhile is a plain miss).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers import _nvme_slab_scan
from kvstrata.tiers._nvme_coalesce import SlotBatcher
from kvstrata.tiers._nvme_config import NvmeConfig, prepare_folder
from kvstrata.tiers._nvme_cpool import CSlotIO, usable
from kvstrata.tiers._nvme_files import ChunkFiles, Corrupt
from kvstrata.tiers._nvme_format import WriteClock, file_bytes
from kvstrata.tiers._nvme_io import PosixBackend, choose_backend
from kvstrata.tiers._nvme_layouts import NvmeLayouts
from kvstrata.tiers._nvme_scan import QUARANTINE, RebuildReport
from kvstrata.tiers._nvme_slabs import SLAB_DIR, Slabs, SlotRef
from kvstrata.tiers._nvme_space import DiskFull, FsSpace, is_full_error
from kvstrata.tiers._nvme_sync import SYNC_MARKER, GroupSync
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

__all__ = ["NvmeConfig", "NvmeTier"]
log = logging.getLogger(__name__)
SHARDS = [f"{i:02x}" for i in range(256)]
SCAN_THREADS = 16


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class NvmeTier(NvmeLayouts, Tier):
    """Chunk files and slab files in one folder; see the module docstring. The steps that
    differ between the two layouts are :class:`NvmeLayouts`'s (``_nvme_layouts``), the jobs
    on the thread pool :class:`NvmeJobs`'s (``_nvme_jobs``)."""

    name = "nvme"
    persistent = True

    def __init__(self, config: NvmeConfig) -> None:
        super().__init__()
        self.config = config
        self.root = str(Path(config.path).absolute())
        prepare_folder(self.root, [*SHARDS, QUARANTINE, SLAB_DIR])
        self.backend, self.backend_reason = choose_backend(self.root, config.backend, config.direct)
        clock = WriteClock()  # one for both layouts: a file and a slot of one chunk compare
        self._files = ChunkFiles(self.root, self.backend, config.fsync, clock)
        self._slabs = Slabs(
            self.root, self.backend, config.slab_max, config.slab_bytes, config.fsync, clock
        )
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstrata-nvme")
        always = config.fsync == "always"  # slot writes queued together share jobs and writes
        self._slot_writes = SlotBatcher(self._slabs, self._pool, config.io_threads, always)
        self._cio: CSlotIO | None = None  # slot I/O without Python threads (``_nvme_cpool``)
        if usable(self._slabs):
            self._cio = CSlotIO(self._slabs, config.io_threads, self._pool, always)
        self._group = None
        if config.fsync == "batch":
            direct = isinstance(self.backend, PosixBackend) and self.backend.direct
            self._group = GroupSync(os.path.join(self.root, SYNC_MARKER), per_file=not direct)
        self._space = FsSpace(self.root, config.capacity)
        self._index: dict[ChunkKey, ChunkMeta] = {}
        self._where: dict[ChunkKey, SlotRef] = {}  # chunks held in a slab slot
        self._used = 0
        self._pending = 0
        self._busy: dict[ChunkKey, asyncio.Event] = {}
        self._closed = False
        self.rebuild_report: RebuildReport | None = None
        self.last_error = ""
        self.stats.extra.update(quarantined=0, enospc=0, eio=0, eacces=0, slots_invalid=0)

    # -- capacity -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """``nvme-capacity``, lowered while the file system has less room (``_nvme_space``)."""
        return self._space.capacity

    @property
    def used(self) -> int:
        """Disk space of committed chunks: a file's header + payload in 4 KiB blocks, or the
        size of the slot holding it (free slots of slab files are not counted)."""
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
        need = self._slabs.slot_size(meta.size) or file_bytes(meta.size)
        await self._acquire(meta.key)
        try:
            if self._space.limit is not None:  # only then does the disk's room matter
                self._space.recheck(self._held())
            if self._used + self._pending + need > self.capacity:
                raise TierFull(
                    f"nvme: {need} bytes do not fit ({self._used} used and {self._pending} "
                    f"being written of {self.capacity})"
                )
            self._pending += need
            started = time.perf_counter()
            try:
                stored, ref = await self._write(meta, payload)
            except IntegrityError:
                self.stats.integrity_errors += 1
                raise
            except TierIOError as exc:
                if not is_full_error(exc):
                    raise
                limit = self._space.lower(self._held())
                raise DiskFull(f"{exc}; capacity now {limit} bytes") from exc
            finally:
                self._pending -= need
            self.stats.seconds_in += time.perf_counter() - started
            old, old_ref = self._index.get(meta.key), self._where.pop(meta.key, None)
            self._used += need - (self._cost(old, old_ref) if old else 0)
            self._index[meta.key] = stored
            if ref is not None:
                self._where[meta.key] = ref
            self.stats.puts += 1
            self.stats.bytes_in += meta.size
            self.stats.chunks = len(self._index)
            if old is not None:
                await self._drop_replaced(meta.key, old_ref, ref)
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
        ref = self._where.get(key)
        try:
            if ref is not None:
                got = await self._read_slot(key, meta, ref, dst)
            else:
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
            what = "slot invalidated" if ref is not None else what
            raise IntegrityError(f"nvme chunk {key.hex}: {exc}; {what}") from None
        self.stats.seconds_out += time.perf_counter() - started
        self.stats.hits += 1
        self.stats.bytes_out += got.size
        return got

    async def delete(self, key: ChunkKey) -> bool:
        await self._acquire(key)
        try:
            ref = self._where.get(key)
            if not self._forget(key):
                return False
            self.stats.deletes += 1
            if ref is not None:
                always = self.config.fsync == "always"
                await self._run(self._slabs.invalidate, ref, always, finish=True)
                if self._group is not None:
                    await self._slot_sync(ref)
                return True
            await self._run(self._files.delete, key, finish=True)
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
        """Rebuild the index from the folder (headers only) and yield every chunk it holds
        (those written since the tier opened too)."""
        self._check_open()
        started = time.perf_counter()
        rebuilt = await asyncio.get_running_loop().run_in_executor(
            self._pool, _nvme_slab_scan.rebuild, self._files, self._slabs, SHARDS,
            max(SCAN_THREADS, self.config.io_threads), set(self._index), set(self._where),
        )  # fmt: skip
        late = [m.key for m in rebuilt.files if m.key in self._index] + rebuilt.stale_files
        late_slots = [s.ref for s in rebuilt.slots if s.meta.key in self._index]
        for meta in rebuilt.files:
            self._index.setdefault(meta.key, meta)
        for slot in rebuilt.slots:
            if slot.meta.key not in self._index:
                self._index[slot.meta.key], self._where[slot.meta.key] = slot.meta, slot.ref
        await self._drop_late(late, late_slots)
        self._used = sum(self._cost(m, self._where.get(k)) for k, m in self._index.items())
        self.stats.chunks = len(self._index)
        self.stats.extra["slots_invalid"] += rebuilt.slots_invalid
        self.stats.extra["quarantined"] += rebuilt.quarantined
        found = list(self._index.values())  # what was known already, too (a second scan)
        report = RebuildReport(
            chunks=len(found),
            bytes=sum(m.size for m in found),
            seconds=time.perf_counter() - started,
            quarantined=rebuilt.quarantined,
            temp_removed=rebuilt.temp_removed,
            slots_invalid=rebuilt.slots_invalid,
            stale=rebuilt.stale,
        )
        self.rebuild_report = report
        log.info(
            "nvme: rebuilt index from %s: %d chunks (%d in slabs), %d bytes, %d quarantined, %d "
            "temp files removed, %d torn or corrupt slots freed, %d stale copies dropped in %.3f s",
            self.root, report.chunks, len(rebuilt.slots), report.bytes, report.quarantined,
            report.temp_removed, report.slots_invalid, report.stale, report.seconds,
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
            "slab_max": self.config.slab_max,
            "slab_files": self._slabs.count(),
            "slab_chunks": len(self._where),
            "slab_spare": self._slabs.spare_bytes(),
            "slot_io": "c" if self._cio is not None else "threads",
            "slots_invalid": self.stats.extra["slots_invalid"],
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
        if self._cio is not None:
            self._cio.close()
        self._pool.shutdown(wait=True)
        if self._group is not None:
            self._group.close()
        self._files.close()
        self._slabs.close()

    def locate(self, key: ChunkKey) -> tuple[str, int] | None:
        """The file holding ``key``'s header and the header's offset there (a chunk file at 0,
        a slab slot further), for readers outside the tier (``gpu_nvme``); None if absent."""
        if key not in self._index:
            return None
        ref = self._where.get(key)
        if ref is None:
            return os.path.join(*self._files.path(key)), 0
        return self._slabs.locate(ref)

    # -- event-loop helpers -------------------------------------------------------------

    def _refreshed_capacity(self) -> int:
        self._space.recheck(self._held())
        return self.capacity

    def _held(self) -> int:
        """Disk space the tier holds: its chunks and the free slots of its slab files (what
        a full disk leaves it able to use)."""
        return self._used + self._slabs.spare_bytes()

    def _cost(self, meta: ChunkMeta, ref: SlotRef | None) -> int:
        return ref.slot_size if ref is not None else file_bytes(meta.size)

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
        self._used -= self._cost(meta, self._where.pop(key, None))
        self.stats.chunks = len(self._index)
        return True


# Registered by call rather than as a decorator so that type checkers keep the class type.
register_tier("nvme")(NvmeTier)
