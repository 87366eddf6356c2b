"""Moving one chunk between tiers: the write-back before a copy leaves, copies into DRAM, and
every copy checked against the record's checksum.

A mixin of :class:`~kvstrata.store.placement.Placement` (which picks the victims and runs the
demoter): :meth:`Mover.move_down` writes a victim back below its tier unless a lower tier
holds it (a GPU victim goes to DRAM first) and drops its copy; :meth:`Mover.read_copy` and
:meth:`Mover.copy_to_dram` read a copy and verify it (:func:`check_bytes`); a bad copy is
dropped (:meth:`Mover.bad_copy`), a corrupt chunk from every tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.state import StoreState, is_internal, is_shared
from kvstrata.store.policy import leaving_counter, write_back_needed
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import (
    Buffer,
    ChunkMissing,
    IntegrityError,
    MemoryTier,
    ObjectChanged,
    Tier,
    TierError,
)
from kvstrata.tiers.checksum import checksum

#: ``_write_lower``: a lower tier refused the victim itself; it is dropped, eviction goes on
_REFUSED = ""


def _read_ended(dram: ArenaTier, offset: int, reading: asyncio.Future[ChunkMeta]) -> None:
    """A read into a slot whose promotion was cancelled has ended: the slot may be reused."""
    if not reading.cancelled():
        reading.exception()  # (retrieved: the promotion that wanted it is gone)
    dram.unhold(offset)


class ChecksumMismatch(IntegrityError):
    """The store found bytes that do not match the record's checksum (the tier did not)."""


def check_bytes(rec: ChunkRecord, src: Tier, data: Buffer, meta: ChunkMeta | None = None) -> None:
    """Raise ChecksumMismatch unless ``data`` (and the tier's ``meta``) match ``rec``. A shared
    tier has checked the object against its own metadata already; an object that differs from
    the record is another node's newer version (ObjectChanged), not a corrupt one."""
    shared = meta is not None and is_shared(src)
    if shared and meta is not None and (meta.checksum != rec.checksum or meta.size != rec.size):
        raise ObjectChanged(meta)
    if (meta is not None and meta.checksum != rec.checksum) or checksum(data) != rec.checksum:
        claimed = "" if rec.verified else " (the writer's KV.COMMIT DIGEST, never verified)"
        raise ChecksumMismatch(f"{src.name}: checksum mismatch for {rec.key.hex}{claimed}")
    rec.verified = True


class Mover:
    """Mixin of ``Placement``: one chunk's moves between tiers, each copy verified."""

    # state owned by Placement
    state: StoreState
    landing: dict[str, int]
    on_replaced: Callable[[ChunkRecord, ChunkMeta], None]

    if TYPE_CHECKING:  # Placement's (a stub here would shadow them)

        def changed(self, rec: ChunkRecord, tier: str) -> None: ...
        async def put_with_room(self, j: int, meta: ChunkMeta, data: Buffer) -> None: ...
        async def reserve_dram(
            self, key: ChunkKey, nbytes: int, make_room: bool = True
        ) -> memoryview | None: ...

    async def move_down(self, rec: ChunkRecord, i: int) -> bool:
        """Write ``rec`` back below tier ``i`` (unless a lower tier has it) and drop its copy
        in tier ``i``; drop it outright from the last tier. True when the copy left."""
        state = self.state
        name = state.tiers[i].name
        if not state.begin_move(rec):
            # another mover got it first: put it back among the candidates (pick() popped it)
            if rec.alive and name in rec.tiers:
                self.changed(rec, name)
            return False
        moved = False
        try:
            if name not in rec.tiers:
                return False
            if not await self._keep_below(rec, i):
                return False
            if not rec.alive or rec.pins > 1 or not rec.is_leaf_in(name):
                # deleted meanwhile (freed later), a reader pinned it, or a child arrived in
                # this tier during the write-back: keep it
                return False
            await state.delete_copy(rec, name)
            if leaving_counter(rec) == "demotions":
                state.counters[name].demotions += 1
            else:
                state.counters[name].evictions += 1
                state.drop_if_gone(rec)
            moved = True
        finally:
            state.end_move(rec)
            if not moved and rec.alive and name in rec.tiers:
                self.changed(rec, name)
        return moved

    async def _keep_below(self, rec: ChunkRecord, i: int) -> bool:
        """Make sure the chunk survives leaving tier ``i``: written back to the next local tier
        below that lacks it (a copy in the shared tier does not count: local reads are
        cheaper), or to the shared tier from the lowest local one. False: keep the copy.

        When the lowest local tier cannot write back to the shared tier (an S3 outage) the
        chunk is dropped anyway: a cache may lose a chunk, a full local tier must not stall."""
        state = self.state
        src = state.tiers[i]
        dram = state.dram
        if src is state.gpu and dram is not None and dram.name not in rec.tiers:
            if await self.copy_to_dram(rec, src, make_room=True):
                return True
            if not rec.alive:
                return False
        lower = self.state.tiers[i + 1 :]
        if is_internal(rec.key):  # the server's own values stay on this node
            lower = [t for t in lower if not is_shared(t)]
        if not lower:
            return True
        held = any(t.name in rec.tiers for t in lower)
        local = [t for t in lower if not is_shared(t)]
        shared = [t.name for t in lower if is_shared(t)]
        if not write_back_needed(rec, [t.name for t in lower], shared):
            return True
        if await self._write_lower(rec, i) is not None:
            return True
        return rec.alive and (held or not local)

    async def _write_lower(self, rec: ChunkRecord, i: int) -> str | None:
        """Write ``rec`` to the first tier below ``i`` that takes it: that tier's name; None
        when none could; :data:`_REFUSED` when a tier refused the chunk itself (a ValueError:
        metadata its format cannot hold), so keeping the victim would only stall eviction."""
        state = self.state
        src = state.tiers[i]
        data = await self.read_copy(rec, src)
        if data is None:
            return None
        meta = rec.meta()
        refused = False
        for j in range(i + 1, len(state.tiers)):
            dst = state.tiers[j]
            if dst.name in rec.tiers or (is_internal(rec.key) and is_shared(dst)):
                continue
            try:
                await self.put_with_room(j, meta, data)
            except IntegrityError as exc:  # the tier checked the bytes: the source changed
                what = f"write-back of {rec.key.hex[:16]}"
                await state.drop_corrupt(rec, src.name, what, exc, False)
                return None
            except (TierError, ValueError) as exc:
                state.tier_error(dst.name, f"write-back of {rec.key.hex[:16]}", exc)
                refused = refused or isinstance(exc, ValueError)
                continue
            state.index.add_tier(rec, dst.name)
            state.counters[dst.name].bytes_in += rec.size
            return dst.name
        return _REFUSED if refused else None

    async def read_copy(self, rec: ChunkRecord, src: Tier) -> Buffer | None:
        """The bytes of ``rec`` in ``src`` (a view for host memory tiers, else a fresh buffer),
        checked against the record's checksum; None when unreadable (a missing copy is
        dropped, a corrupt one drops the chunk everywhere)."""
        try:
            if isinstance(src, MemoryTier) and src.name != "gpu":
                view = src.view(rec.key)
                check_bytes(rec, src, view)
                return view
            buf = bytearray(rec.size)
            meta = await src.get(rec.key, memoryview(buf))
            check_bytes(rec, src, buf, meta)
        except TierError as exc:
            await self.bad_copy(rec, src, exc)
            return None
        self.state.counters[src.name].bytes_out += rec.size
        return buf

    async def copy_to_dram(self, rec: ChunkRecord, src: Tier, make_room: bool) -> bool | None:
        """Read ``rec`` from ``src`` into a new DRAM slot, verify it and commit it there (the
        caller holds the move). True: in DRAM now; False: no room; None: the copy in ``src``
        is bad or unreadable (dropped when bad), or the chunk was deleted meanwhile."""
        state = self.state
        dram = state.dram
        assert dram is not None
        key = rec.key
        try:
            view = await self.reserve_dram(key, rec.size, make_room)
        except TierError as exc:
            state.tier_error(dram.name, f"reserve for {key.hex[:16]}", exc)
            return False
        if view is None:
            return False
        committed = False
        self.landing[dram.name] = self.landing.get(dram.name, 0) + rec.size
        # the read writes into the slot from an I/O thread (nvme) that a cancel cannot stop:
        # the slot is held until the read has ended, so that an abort here (a cancelled
        # promotion) never lets another chunk take memory a late read still writes into
        arena = dram if isinstance(dram, ArenaTier) else None
        offset = arena.reserved_handle(key).offset if arena is not None else -1
        if arena is not None:
            arena.hold(offset)
        reading = asyncio.ensure_future(src.get(key, view))
        try:
            meta = await asyncio.shield(reading)
            check_bytes(rec, src, view, meta)
            if not rec.alive:
                return None
            dram.commit(rec.meta())
            committed = True
        except TierError as exc:
            await self.bad_copy(rec, src, exc)
            if isinstance(exc, ChunkMissing | ObjectChanged):
                state.drop_if_gone(rec)  # (a corrupt chunk is gone from every tier already)
            return None
        finally:
            self.landing[dram.name] -= rec.size
            if not committed:
                dram.abort(key)
            if arena is not None and reading.done():
                arena.unhold(offset)
            elif arena is not None:  # cancelled mid-read: the slot is free once the read is
                reading.add_done_callback(partial(_read_ended, arena, offset))
        state.index.add_tier(rec, dram.name)
        state.counters[dram.name].bytes_in += rec.size
        state.counters[src.name].bytes_out += rec.size
        return True

    async def bad_copy(self, rec: ChunkRecord, src: Tier, exc: TierError) -> None:
        """A read of ``rec`` from ``src`` failed: a corrupt copy drops the chunk from every
        tier; a missing one drops that copy; anything else (I/O) is only counted. An object in
        a shared tier is never deleted on the strength of this node's record (the tier deletes
        only objects whose bytes disagree with their own metadata): its residency is dropped,
        and a newer version (ObjectChanged) is handed to :attr:`on_replaced`."""
        state = self.state
        what = f"read of {rec.key.hex[:16]}"
        if isinstance(exc, ObjectChanged):
            state.index.drop_tier(rec, src.name)
            self.on_replaced(rec, exc.meta)
            return
        if isinstance(exc, IntegrityError):
            counted = not isinstance(exc, ChecksumMismatch)  # the tier counted its own finding
            await state.drop_corrupt(rec, src.name, what, exc, counted)
            return
        state.tier_error(src.name, what, exc)
        if isinstance(exc, ChunkMissing):
            if is_shared(src):
                state.index.drop_tier(rec, src.name)
            else:
                await state.delete_copy(rec, src.name)
            state.drop_if_gone(rec)
