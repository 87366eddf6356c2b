"""The read path: KV.GET (zero-copy from DRAM, read-through and promotion from cold tiers);
KV.LEASE / RELEASE are its mixin's, ``kvstore.read_leases`` (pinned handles into a shareable
tier: the GPU pool or the DRAM arena). Chunks the index does not know are looked up in the
shared tier first (``kvstore.remote``).

A DRAM hit returns a view of the arena slot, pinned until the caller's ``release()``; a chunk
held in both the GPU and DRAM is served from DRAM. A hit in the GPU or a lower tier reads
straight into a fresh DRAM reservation when there is room (``get`` into the slot, checksum,
commit; the other copy is kept) and otherwise into a new buffer. The record is pinned while its
bytes are read, so a concurrent delete, replacement or eviction waits for the read instead of
freeing the copy under it; a chunk deleted meanwhile is reported as a miss. A chunk whose S3
object another node replaced is looked up again and the new version served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.chunks import ChunkKey
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.gpu import GpuPath
from kvstrata.store.kvstore.read_leases import ReadLeases
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.state import NOT_NOW, NotNow, StoreState
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import MemoryTier, Tier, TierError

log = logging.getLogger("kvstrata.store")


@dataclass(frozen=True, slots=True)
class Payload:
    """A chunk's bytes; call ``release`` (when set) once done with ``view``."""

    view: memoryview
    release: Callable[[], None] | None = None
    tier: str = ""  # the tier that served it (the trace's ``get`` records say so)


class ReadPath(ReadLeases):
    """KV.GET and the promotions behind it; KV.LEASE / KV.RELEASE are :class:`ReadLeases`'s
    (``kvstore.read_leases``)."""

    def __init__(
        self,
        state: StoreState,
        placement: Placement,
        remote: RemotePath | None = None,
        gpu: GpuPath | None = None,
    ) -> None:
        self.state = state
        self.placement = placement
        self.remote = remote
        self.gpu = gpu

    def _unpinner(self, rec: ChunkRecord) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.state.unpin(rec)

        return release

    # -- KV.GET ----------------------------------------------------------------------------------

    def get_now(self, ns: str, hash: bytes) -> Payload | NotNow | None:
        """KV.GET without awaiting when nothing needs I/O: a DRAM hit on top of the hierarchy,
        or a miss with no shared tier to ask. :data:`NOT_NOW` means: use :meth:`get`."""
        state = self.state
        dram = state.dram
        if dram is None or state.tiers[0] is not dram:
            return NOT_NOW
        rec = state.live(ChunkKey(ns, hash))
        if rec is None:
            if state.remote is not None:
                return NOT_NOW
            for tier in state.tiers:
                state.counters[tier.name].misses += 1
            if state.tracer is not None:  # (the hot path builds nothing when not tracing)
                state.trace("get", ns, (hash,), tier="")
            return None
        if rec.moving or dram.name not in rec.tiers:
            return NOT_NOW
        try:
            view = dram.view(rec.key)
        except TierError:
            return NOT_NOW  # the slow path records and repairs it
        rec.touch()
        rec.hits += 1
        state.pin(rec)
        counters = state.counters[dram.name]
        counters.hits += 1
        counters.bytes_out += rec.size
        if state.tracer is not None:
            state.trace("get", ns, (hash,), tier=dram.name)
        return Payload(view, self._unpinner(rec), dram.name)

    async def get(self, ns: str, hash: bytes) -> Payload | None:
        """KV.GET (and each chunk of KV.MGET) that may need tier I/O."""
        payload = await self._get(ns, hash)
        if self.state.tracer is not None:  # after the lookup: an expiry it caused comes first
            self.state.trace("get", ns, (hash,), tier=payload.tier if payload else "")
        return payload

    async def _get(self, ns: str, hash: bytes) -> Payload | None:
        key = ChunkKey(ns, hash)
        state = self.state
        dram = state.dram
        for attempt in range(4):
            rec = state.live(key)
            if rec is None and self.remote is not None:
                rec = await self.remote.find(key)  # stored by another node?
            if rec is None:
                for tier in state.tiers:
                    state.counters[tier.name].misses += 1
                return None
            if rec.moving and attempt < 3 and (dram is None or dram.name not in rec.tiers):
                await state.wait_move(rec)  # a promotion is landing it in DRAM: share it
                continue
            rec.touch()
            rec.hits += 1
            payload = await self._read(rec)
            if payload is None and self.remote is not None and self.remote.was_replaced(rec):
                continue  # another node replaced the object: look it up again, adopt it
            return payload
        return None

    async def _read(self, rec: ChunkRecord) -> Payload | None:
        state = self.state
        dram = state.dram
        for tier in state.tiers:
            counters = state.counters[tier.name]
            if tier.name not in rec.tiers:
                counters.misses += 1
                continue
            if tier is state.gpu and dram is not None and dram.name in rec.tiers:
                continue  # DRAM serves it without a copy
            if isinstance(tier, MemoryTier) and tier.name != "gpu":
                try:
                    view = tier.view(rec.key)
                except TierError as exc:
                    state.tier_error(tier.name, f"view of {rec.key.hex[:16]}", exc)
                    state.index.drop_tier(rec, tier.name)
                    continue
                state.pin(rec)
                counters.hits += 1
                counters.bytes_out += rec.size
                return Payload(view, self._unpinner(rec), tier.name)
            payload = await self._read_through(rec, tier)
            if payload is not None:
                counters.hits += 1
                return payload
            if not rec.alive:
                return None
        state.drop_if_gone(rec)
        return None

    async def _read_through(self, rec: ChunkRecord, src: Tier) -> Payload | None:
        state = self.state
        dram = state.dram
        state.pin(rec)
        try:
            if (
                dram is not None
                and rec.size <= self.placement.free_for(dram)
                and state.begin_move(rec)
            ):
                try:
                    promoted = await self.promote(rec, src)
                    if promoted:
                        view = dram.view(rec.key)  # before pinning: a raise leaks no pin
                        state.pin(rec)
                        return Payload(view, self._unpinner(rec), src.name)
                finally:
                    state.end_move(rec)
                if promoted is None:
                    return None
            data = await self.placement.read_copy(rec, src)
            if data is None or not rec.alive:
                return None
            return Payload(memoryview(data), None, src.name)
        finally:
            state.unpin(rec)

    async def promote(self, rec: ChunkRecord, src: Tier) -> bool | None:
        """Read ``rec`` from ``src`` into a new DRAM slot and commit it there (the caller holds
        the move). True: promoted; False: no room (the copy is fine); None: the copy is bad or
        unreadable, or the chunk was deleted meanwhile."""
        state = self.state
        assert state.dram is not None
        done = await self.placement.copy_to_dram(rec, src, make_room=False)
        if done:
            state.counters[state.dram.name].promotions += 1
            self.placement.kick()
        return done

    async def ensure_dram(self, rec: ChunkRecord, make_room: bool = True) -> bool:
        """Bring ``rec`` into DRAM (promoting it from the fastest lower tier holding it)."""
        state = self.state
        dram = state.dram
        assert dram is not None
        for _ in range(4):
            if dram.name in rec.tiers:
                return True
            if not rec.alive:
                return False
            if rec.moving:
                await state.wait_move(rec)
                continue
            src = next((t for t in state.tiers if t.name in rec.tiers and t is not dram), None)
            if src is None:
                return False
            if self.placement.free_for(dram) < rec.size:
                if not make_room:
                    return False
                if not await self.placement.room.room_for(rec.size):  # in turn with writers
                    return False
                continue
            if not state.begin_move(rec):
                continue
            try:
                await self.promote(rec, src)
            finally:
                state.end_move(rec)
        return dram.name in rec.tiers
