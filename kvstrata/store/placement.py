"""Placement and eviction across tiers (fast → slow: gpu, dram, nvme, s3 — those configured).

Policy, per tier:

- ``{tier}-high-watermark`` / ``{tier}-low-watermark`` (fill ratios; a tier without them, such
  as s3, is unbounded). Above the high mark the background demoter moves chunks out until the
  tier is below the low mark; a write that does not fit makes room synchronously first.
  Promotions still landing (reserved, not committed: :attr:`Placement.landing`) do not count
  towards the high mark: their commit wakes the demoter, which then sees the chunk in place.
- Victims are chosen least-recently-used **among the chunks none of whose children are
  resident in that tier** (evicting a parent first would strand its children), never pinned
  (leased, being read, being moved) and never uncommitted (reservations are not in the index).
- A victim is written back one tier down before its copy leaves (skipped when a lower local
  tier already holds it; a copy in the shared s3 tier only counts for the lowest local tier),
  or dropped when the tier is the last one. A GPU victim goes to DRAM whenever DRAM lacks it
  (``gpu.get`` straight into a DRAM reservation, checksummed, committed), making room there by
  the same rules; only when DRAM cannot take it do the general rules apply. The lowest local
  tier drops a victim whose write-back to s3 fails (outage) rather than stall.
- ``{tier}-write-policy = write-through``: PUTs write that tier before they are acknowledged
  (done by the write path through :meth:`Placement.put_with_room`).
- Every copy between tiers is verified against the record's checksum (the source's bytes before
  a write-back, the destination's bytes after a promotion); a mismatch drops the chunk from
  every tier and counts an integrity error (``StoreState.corrupt``), so it is never kept and
  served again (an object in a shared tier is only forgotten here, never deleted on this
  node's finding; the shared tier deletes objects that disagree with their own metadata).

Victims come from one :class:`~kvstrata.store.lru.LruHeap` per tier, kept current by the
index through :meth:`Placement.changed` (amortized O(log n) per change and per victim; see
``lru``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.state import StoreState, is_internal, is_shared
from kvstrata.store.lru import LruHeap
from kvstrata.store.policy import (
    TierPolicy,
    is_bounded,
    leaving_counter,
    pick_victims,
    tier_policy,
    write_back_needed,
)
from kvstrata.store.policy import above_high as _above_high
from kvstrata.store.policy import eligible as _eligible
from kvstrata.store.room import RoomQueue
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import (
    Buffer,
    ChunkMissing,
    IntegrityError,
    MemoryTier,
    ObjectChanged,
    Tier,
    TierError,
    TierFull,
)
from kvstrata.tiers.checksum import checksum

log = logging.getLogger("kvstrata.store.placement")
#: ``_write_lower``: a lower tier refused the victim itself; it is dropped, eviction goes on
_REFUSED = ""


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


class Placement:
    """Watermarks, victim choice, demotion and eviction for one store."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        # no heap for the shared tier: it is unbounded and never evicted (and a node may hold
        # a million records of chunks only there: s3-max-remote-records)
        self.heaps = {t.name: LruHeap(t.name) for t in state.tiers if not is_shared(t)}
        self._kick = asyncio.Event()
        #: eviction rounds whose victims were picked and are still moving (they hold the only
        #: leaves of their chains until they end); ``_evicted`` is set when one ends
        self.evicting = 0
        self._evicted = asyncio.Event()
        #: writers waiting for DRAM room, first come first served
        self.room = RoomQueue(self, self._room_limits)
        #: bytes being promoted into each tier: reserved there, not committed (``above_high``)
        self.landing: dict[str, int] = {}
        state.index.on_change = self.changed
        #: told when a shared tier holds a newer version of a chunk than the record (the
        #: store's RemotePath adopts it)
        self.on_replaced: Callable[[ChunkRecord, ChunkMeta], None] = lambda rec, meta: None

    def _room_limits(self) -> tuple[int, float]:
        values = self.state.config.values
        return int(values["write-wait-queue"]), int(values["write-wait-timeout"]) / 1000

    # -- policy -------------------------------------------------------------------------------

    def policy(self, name: str) -> TierPolicy:
        return tier_policy(self.state.config.values, name)

    def write_through_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.state.tiers) if self.policy(t.name).write_through]

    def bounded(self, tier: Tier) -> bool:
        return is_bounded(self.policy(tier.name), tier.capacity)

    def free_for(self, tier: Tier) -> int:
        """Largest chunk that fits now."""
        if not self.bounded(tier):
            return 1 << 62
        if isinstance(tier, MemoryTier):
            return tier.largest_free()
        in_flight = int(getattr(tier, "pending", 0))  # writes the tier already counts (nvme)
        return max(0, tier.capacity - tier.used - in_flight)

    def reclaimable(self, tier: ArenaTier) -> int:
        """Bytes of ``tier`` free now plus the slots of the chunks that may leave it (not
        leased, pinned by a reader or a reply, moving, nor fenced): the most a writer could
        get by evicting. Reservations, held slots and pinned chunks never count."""
        free = tier.capacity - tier.used
        index = self.state.index
        for key, nbytes in tier.evictable_slots():
            rec = index.get(key)
            if rec is not None and _eligible(rec):
                free += nbytes
        return free

    def above_high(self, tier: Tier) -> bool:
        landing = self.landing.get(tier.name, 0)
        return _above_high(self.policy(tier.name), tier.capacity, tier.used, landing)

    # -- index hook and victims ---------------------------------------------------------------

    def changed(self, rec: ChunkRecord, tier: str) -> None:
        heap = self.heaps.get(tier)
        if heap is not None:
            heap.arm(rec)
            heap.compact(self.state.index.count_in.get(tier, 0))

    @staticmethod
    def eligible(rec: ChunkRecord) -> bool:
        return _eligible(rec)

    def pick(self, i: int, need: int) -> list[ChunkRecord]:
        """Pop LRU leaf candidates of tier ``i`` adding up to at least ``need`` bytes."""
        heap = self.heaps.get(self.state.tiers[i].name)
        if heap is None:
            return []
        return pick_victims(heap, need)

    # -- making room ----------------------------------------------------------------------------

    async def make_room(self, i: int, nbytes: int) -> bool:
        """Move chunks out of tier ``i`` until a chunk of ``nbytes`` fits; False if stuck."""
        tier = self.state.tiers[i]
        while True:
            free = self.free_for(tier)
            if free >= nbytes:
                return True
            if nbytes > tier.capacity:
                return False
            if not await self._evict_round(i, nbytes - free):
                return self.free_for(tier) >= nbytes

    async def evict_to(self, i: int, target_used: float, demoter: bool = False) -> bool:
        """Move chunks out of tier ``i`` until it uses at most ``target_used`` bytes."""
        tier = self.state.tiers[i]
        while tier.used > target_used:
            # when the demoter's rounds start and end is timing a replay needs (kvstrata.sim's
            # "demote" marks): under load they lag the writes, the tiers stay fuller
            if demoter:
                self.state.trace("demote", "", (), to=tier.name)
            try:
                if not await self._evict_round(i, int(tier.used - target_used)):
                    return False
            finally:
                if demoter:
                    self.state.trace("demoted", "", (), to=tier.name)
        return True

    async def evict_round(self, i: int, need: int) -> bool:
        """Move victims adding up to ``need`` bytes out of tier ``i`` at once; False when
        none could leave."""
        return await self._evict_round(i, need)

    async def _evict_round(self, i: int, need: int) -> bool:
        victims = self.pick(i, max(1, need))
        if not victims:
            return False
        self.evicting += 1
        try:
            results = await asyncio.gather(*(self.move_down(r, i) for r in victims))
        finally:
            self.evicting -= 1
            self._evicted.set()
            self._evicted = asyncio.Event()
        return any(results)

    async def eviction_ended(self) -> bool:
        """Wait until an eviction round in flight ends (room freed, or parents of the moved
        chunks now leaves to pick); False at once when none is in flight."""
        if not self.evicting:
            return False
        await self._evicted.wait()
        return True

    async def enforce(self, i: int) -> None:
        tier = self.state.tiers[i]
        if self.above_high(tier):
            pol = self.policy(tier.name)
            assert pol.low is not None
            await self.evict_to(i, pol.low * tier.capacity, demoter=True)

    def kick(self) -> None:
        """Wake the demoter when some tier is above its high watermark."""
        if any(self.above_high(t) for t in self.state.tiers):
            self._kick.set()

    def kick_now(self) -> None:
        """Wake the demoter (a writer is waiting for room)."""
        self._kick.set()

    async def run_demoter(self, interval: float = 0.05) -> None:
        """Keep every bounded tier under its high watermark (cancel the task to stop)."""
        while True:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can turn a cancel that lands
                # with the timeout into a TimeoutError, and this loop would never end
                async with asyncio.timeout(interval):
                    await self._kick.wait()
            except TimeoutError:
                pass
            self._kick.clear()
            for i in range(len(self.state.tiers)):
                try:
                    await self.enforce(i)
                except Exception as exc:
                    self.state.tier_error(self.state.tiers[i].name, "demotion", exc)
                    log.exception("demotion from %s failed", self.state.tiers[i].name)

    # -- moving one chunk -----------------------------------------------------------------------

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

    async def reserve_dram(
        self, key: ChunkKey, nbytes: int, make_room: bool = True
    ) -> memoryview | None:
        """A DRAM reservation for a key the caller owns (or moves), making room if allowed;
        None when there is no DRAM tier or no room."""
        dram = self.state.dram
        if dram is None or nbytes > dram.capacity:
            return None
        if make_room:
            return await self.room.reserve(key, nbytes)  # in turn (``room``)
        try:
            return dram.reserve(key, nbytes)
        except TierFull:
            return None

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
        try:
            meta = await src.get(key, view)
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

    async def put_with_room(self, j: int, meta: ChunkMeta, data: Buffer) -> None:
        """Store ``data`` in tier ``j``, making room first if needed; raises TierError.

        A tier may count more than :meth:`free_for` sees (NVMe adds its writes in flight and
        rounds files up to 4 KiB blocks), so ``make_room`` can report room the put then lacks.
        After a TierFull one more round of victims leaves, until the put fits or none can."""
        tier = self.state.tiers[j]
        if self.free_for(tier) < meta.size:
            await self.make_room(j, meta.size)
        while True:
            try:
                await tier.put(meta, data)
                return
            except TierFull:
                if not self.bounded(tier) or meta.size > tier.capacity:
                    raise
                if not await self._evict_round(j, meta.size):
                    raise

    def describe_full(self, nbytes: int) -> str:
        """Why a chunk of ``nbytes`` fits nowhere (for the OOM reply); O(tiers), no scan."""
        parts = [
            f"{tier.name} uses {tier.used} of {tier.capacity} bytes, largest free "
            f"{min(self.free_for(tier), tier.capacity)}"
            for tier in self.state.tiers
        ]
        parts.append(f"{len(self.state.leases)} leases pin chunks")
        return f"cannot place a chunk of {nbytes} bytes in any tier: " + "; ".join(parts)
