"""The NVMe tier's two layouts: which one a chunk takes, and the steps that differ between them.

A mixin of :class:`~kvstrata.tiers.nvme.NvmeTier`. A chunk of at most ``nvme-slab-max`` bytes
is a slot of a slab file (``_nvme_slabs``), a larger one a chunk file (``_nvme_files``):
writing either durably (``nvme-fsync``; ``batch`` waits for the group sync), dropping the old
copy after an overwrite, reading a slot that an overwrite may move meanwhile, and the stale
copies the start-up rebuild leaves behind.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers._nvme_coalesce import SlotBatcher
from kvstrata.tiers._nvme_config import NvmeConfig
from kvstrata.tiers._nvme_cpool import CSlotIO
from kvstrata.tiers._nvme_files import ChunkFiles, Corrupt
from kvstrata.tiers._nvme_jobs import NvmeJobs
from kvstrata.tiers._nvme_slabs import Slabs, SlotMismatch, SlotRef
from kvstrata.tiers._nvme_sync import GroupSync
from kvstrata.tiers.base import TierIOError

SLOT_READ_TRIES = 3  # a read whose slot keeps being replaced under it gives up (a miss)


class NvmeLayouts(NvmeJobs):
    """Mixin of ``NvmeTier``: the slot-or-file steps of its put, get and scan."""

    # state owned by NvmeTier
    config: NvmeConfig
    _files: ChunkFiles
    _slabs: Slabs
    _slot_writes: SlotBatcher
    _cio: CSlotIO | None
    _group: GroupSync | None
    _index: dict[ChunkKey, ChunkMeta]
    _where: dict[ChunkKey, SlotRef]

    if TYPE_CHECKING:  # NvmeTier's (a stub here would shadow them)

        async def _acquire(self, key: ChunkKey) -> None: ...
        def _release(self, key: ChunkKey) -> None: ...
        def _forget(self, key: ChunkKey, only: ChunkMeta | None = None) -> bool: ...

    async def _write(
        self, meta: ChunkMeta, payload: memoryview
    ) -> tuple[ChunkMeta, SlotRef | None]:
        """Write a slot (small chunks) or a file, durable as ``nvme-fsync`` says."""
        if not self._slabs.slot_size(meta.size):
            stored, fd = await self._run(self._files.write, meta, payload)
            if fd >= 0:
                await self._group_sync(meta.key, fd)
            return stored, None
        self._check_open()
        try:
            done = None
            if self._cio is not None and not self._slot_writes.busy:
                done = await self._cio.write(meta, payload)
            stored, ref = done or await self._slot_writes.write(meta, payload)
        except OSError as exc:
            raise self._io_error("write", exc) from exc
        if self._group is not None:
            try:
                await self._slot_sync(ref)
            except TierIOError:
                await self._run_quietly(self._slabs.discard, ref)
                raise
            except asyncio.CancelledError:  # the put did not happen: its slot must not stay
                try:
                    self._pool.submit(self._slabs.discard, ref)
                except RuntimeError:  # the pool is shut down (closing): here, then
                    self._slabs.discard(ref)
                raise
        return stored, ref

    async def _drop_replaced(self, key: ChunkKey, old: SlotRef | None, new: SlotRef | None) -> None:
        """After an overwrite: invalidate the old slot, or remove the old file when the new
        copy is a slot (a new file was renamed over it already). A failure is counted; the
        stale copy then loses to the newer one at the next start."""
        if old is not None:
            await self._run_quietly(self._slabs.invalidate, old)
        elif new is not None:
            await self._run_quietly(self._files.delete, key)

    async def _read_slot(
        self, key: ChunkKey, meta: ChunkMeta, ref: SlotRef, dst: memoryview
    ) -> ChunkMeta:
        """Read a slot; one that fails its checks while still the chunk's copy is invalidated
        (free for reuse, never served). When an overwrite moved the chunk to another slot
        meanwhile, that slot is read instead; a chunk deleted meanwhile is a plain miss."""
        for _ in range(SLOT_READ_TRIES):
            try:
                got = await self._cio_read(key, ref, dst, meta)
                return got or await self._run(self._slabs.read, key, ref, dst, meta)
            except SlotMismatch as exc:
                current = self._where.get(key)
                if current is ref:
                    self._forget(key, meta)  # before the await: no other reader frees it too
                    self.stats.extra["slots_invalid"] += 1
                    await self._run_quietly(self._slabs.invalidate, ref)
                    raise Corrupt(str(exc), quarantined=False) from None
                if current is None or self._index[key].size > dst.nbytes:
                    break
                ref, meta = current, self._index[key]
        raise FileNotFoundError(key.hex)

    async def _cio_read(
        self, key: ChunkKey, ref: SlotRef, dst: memoryview, meta: ChunkMeta
    ) -> ChunkMeta | None:
        """A slot read through the C pool (None: the pool way); errors as ``_run``'s."""
        if self._cio is None:
            return None
        self._check_open()
        try:
            return await self._cio.read(key, ref, dst, meta)
        except OSError as exc:
            raise self._io_error("read", exc) from exc

    async def _drop_late(self, keys: list[ChunkKey], refs: list[SlotRef]) -> None:
        """Drop the stale copies the start-up rebuild found: slots of chunks written while it
        ran, and chunk files that lost to a slot — only while the chunk's copy is a slot (a
        put while the rebuild ran may have renamed a new file over the stale one)."""
        for ref in refs:
            await self._run_quietly(self._slabs.invalidate, ref)
        for key in keys:
            await self._acquire(key)
            try:
                if key in self._where:
                    await self._run_quietly(self._files.delete, key)
            finally:
                self._release(key)

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

    async def _slot_sync(self, ref: SlotRef) -> None:
        """``batch``: wait for the group sync covering a slot write or invalidation."""
        assert self._group is not None
        try:
            fd = self._slabs.dup(ref) if self._group.per_file else -1  # O_DIRECT: no fsync
            await asyncio.wrap_future(self._group.submit(fd))
        except OSError as exc:
            raise self._io_error("group sync", exc) from exc
