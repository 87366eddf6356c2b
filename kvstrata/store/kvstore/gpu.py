"""The GPU tier as the store's top tier: promotion on lease, writes reserved in device memory.

The GPU pool has no host view, so every move in or out of it is an explicit copy:

- **into the GPU** (:meth:`GpuPath.ensure_gpu`, for ``KV.LEASE … TIER gpu`` and
  ``KV.PREFETCH … TO gpu``): from a DRAM copy, ``gpu.put`` of the arena slot (a DMA from the
  pinned arena on a CUDA machine); from an NVMe copy, :func:`~kvstrata.tiers.gpu_nvme.
  load_from_nvme` (kvikio straight into the slot where it can, header and payload checksum
  checked before the slot is published; a bad file is dropped from the NVMe tier); from any
  other tier (s3), the checksummed bytes through a host buffer. The chunk keeps its other
  copies. When the pool has no room even after demoting its LRU leaves, the caller falls back
  to DRAM.
- **written in the GPU** (``KV.RESERVE … TIER gpu``): :class:`GpuSink` owns a reserved,
  invisible slot. ``KV.COMMIT`` copies it into a DRAM reservation (``gpu.get_reserved``; a
  plain host buffer when DRAM has no room), checksums those bytes and commits both copies; an
  abort or an expired lease frees the slot.
- **out of the GPU**: demotion to DRAM is placement's (``Placement.copy_to_dram``); KV.GET of a
  GPU-only chunk copies it into DRAM through the read path.

The record is held with ``begin_move`` (pinned, one mover) during a copy, as every other move.
"""

from __future__ import annotations

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.mover import check_bytes
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import (
    ChunkMissing,
    Handle,
    IntegrityError,
    Tier,
    TierError,
    TierFull,
)
from kvstrata.tiers.gpu import GpuTier
from kvstrata.tiers.gpu_nvme import load_from_nvme
from kvstrata.tiers.nvme import NvmeTier


class GpuSink:
    """A reserved, invisible GPU slot owned by one writer (a ``KV.RESERVE … TIER gpu`` lease).

    Same life cycle as :class:`~kvstrata.store.kvstore.sink.StoreSink`: ``host_bytes()`` (at
    commit) copies the slot to the host, ``place()`` commits the copies, ``abort()`` frees
    whatever is still reserved and ends the writer's ownership of the key (a no-op once
    committed).
    """

    def __init__(self, state: StoreState, placement: Placement, key: ChunkKey, nbytes: int):
        self.state = state
        self.placement = placement
        self.key = key
        self.nbytes = nbytes
        self.dram_view: memoryview | None = None
        self.consumed = False
        self.done = False

    @property
    def gpu(self) -> GpuTier:
        assert self.state.gpu is not None
        return self.state.gpu

    def consume(self) -> GpuSink:
        self.consumed = True
        return self

    async def host_bytes(self) -> memoryview:
        """The slot's bytes on the host: in a DRAM reservation (committed with the GPU slot)
        when DRAM has room, else in a scratch buffer."""
        view = await self.placement.reserve_dram(self.key, self.nbytes)
        self.dram_view = view
        host = view if view is not None else memoryview(bytearray(self.nbytes))
        try:
            await self.gpu.get_reserved(self.key, host)
        except TierError as exc:
            self.state.tier_error(self.gpu.name, f"read of reserved {self.key.hex[:16]}", exc)
            raise
        return host

    def place(self, meta: ChunkMeta) -> list[str]:
        """Commit the GPU slot (and the DRAM copy, when one was reserved)."""
        self.gpu.commit(meta)
        names = [self.gpu.name]
        dram = self.state.dram
        if self.dram_view is not None and dram is not None:
            dram.commit(meta)
            names.append(dram.name)
        return names

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.gpu.abort(self.key)
        if self.dram_view is not None and self.state.dram is not None:
            self.state.dram.abort(self.key)
        self.state.release_claim(self.key)

    def committed(self) -> None:
        self.done = True
        self.state.release_claim(self.key)


class GpuPath:
    """Moves into the GPU tier (see the module docstring); only built with a GPU tier."""

    def __init__(self, state: StoreState, placement: Placement) -> None:
        self.state = state
        self.placement = placement

    @property
    def gpu(self) -> GpuTier:
        assert self.state.gpu is not None
        return self.state.gpu

    # -- KV.RESERVE … TIER gpu -------------------------------------------------------------------

    async def reserve(self, key: ChunkKey, nbytes: int) -> tuple[GpuSink, Handle] | None:
        """A reserved GPU slot for a key the caller has claimed, making room if needed; None
        when the pool cannot take it (the caller reserves in DRAM instead)."""
        gpu = self.gpu
        if nbytes > gpu.capacity:
            return None
        for attempt in range(2):
            try:
                handle = gpu.reserve_handle(key, nbytes)
                return GpuSink(self.state, self.placement, key, nbytes), handle
            except TierFull:
                if attempt or not await self.placement.make_room(self._index(), nbytes):
                    return None
        return None

    # -- promotion -------------------------------------------------------------------------------

    async def ensure_gpu(self, rec: ChunkRecord, make_room: bool = True) -> bool:
        """Bring ``rec`` into the GPU tier (demoting LRU leaves there if needed). False when
        it cannot be (no room, every source failed, deleted): the caller falls back to DRAM."""
        state = self.state
        gpu = self.gpu
        if rec.size > gpu.capacity:
            return False
        for _ in range(4):
            if gpu.name in rec.tiers:
                return True
            if not rec.alive or not rec.tiers:
                return False
            if rec.moving:
                await state.wait_move(rec)
                continue
            if self.placement.free_for(gpu) < rec.size:
                if not make_room or not await self.placement.make_room(self._index(), rec.size):
                    return False
                continue
            if not state.begin_move(rec):
                continue
            try:
                loaded = await self._load(rec)
            finally:
                state.end_move(rec)
            if not loaded:
                return False
        return gpu.name in rec.tiers

    async def _load(self, rec: ChunkRecord) -> bool:
        """Copy ``rec`` into the GPU from its fastest other copy (the caller holds the move)."""
        state = self.state
        gpu = self.gpu
        found = next((t for t in state.tiers if t.name in rec.tiers and t is not gpu), None)
        if found is None:
            return False
        src: Tier = found
        dram = state.dram
        meta = rec.meta()
        try:
            if dram is not None and src is dram:
                view = dram.view(rec.key)
                check_bytes(rec, dram, view)  # never promote corrupt bytes
                await gpu.put(meta, view)
            elif isinstance(src, NvmeTier):  # kvikio straight into the slot where it can
                await load_from_nvme(gpu, src.root, meta, at=src.locate(meta.key))
            else:
                data = await self.placement.read_copy(rec, src)  # checksummed
                if data is None:
                    return False
                await gpu.put(meta, data)
        except TierFull:
            return False
        except IntegrityError as exc:  # the source copy is corrupt: the chunk goes everywhere
            what = f"read of {rec.key.hex[:16]} into gpu"
            await state.drop_corrupt(rec, src.name, what, exc, False)
            return False
        except (ChunkMissing, OSError) as exc:  # the source copy is gone or unreadable
            state.tier_error(src.name, f"read of {rec.key.hex[:16]} into gpu", exc)
            if not isinstance(exc, OSError):
                await state.delete_copy(rec, src.name)
                state.drop_if_gone(rec)
            return False
        except TierError as exc:  # a device copy failed
            state.tier_error(gpu.name, f"load of {rec.key.hex[:16]}", exc)
            return False
        state.index.add_tier(rec, gpu.name)  # a retired record frees this copy with the rest
        if not rec.alive:
            return False
        counters = state.counters
        counters[gpu.name].promotions += 1
        counters[gpu.name].bytes_in += rec.size
        counters[src.name].bytes_out += rec.size
        self.placement.kick()
        return True

    def _index(self) -> int:
        return self.state.tier_index(self.gpu.name)
