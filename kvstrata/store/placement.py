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
from kvstrata.store.kvstore.state import StoreState, is_shared
from kvstrata.store.lru import LruHeap
from kvstrata.store.mover import Mover
from kvstrata.store.policy import TierPolicy, is_bounded, pick_victims, tier_policy
from kvstrata.store.policy import above_high as _above_high
from kvstrata.store.policy import eligible as _eligible
from kvstrata.store.room import RoomQueue
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import Buffer, MemoryTier, Tier, TierFull

log = logging.getLogger("kvstrata.store.placement")


class Placement(Mover):
    """Watermarks, victim choice, demotion and eviction for one store; moving one chunk (the
    write-back, copies into DRAM, each verified) is :class:`Mover`'s (``store.mover``)."""

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
        return max(0, tier.capacity - self.filled(tier))  # (nvme: its writes in flight too)

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

    @staticmethod
    def filled(tier: Tier) -> int:
        """What the tier holds once the writes it already counts land: its committed bytes
        plus NVMe's writes in flight (``pending``; a write-back of a DRAM victim). The
        demoter measures this, not ``used`` alone: a round started while write-backs are
        in flight would otherwise leave too little room for them, and each would then make
        room for itself."""
        return tier.used + int(getattr(tier, "pending", 0))

    def above_high(self, tier: Tier) -> bool:
        landing = self.landing.get(tier.name, 0)
        return _above_high(self.policy(tier.name), tier.capacity, self.filled(tier), landing)

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
        while self.filled(tier) > target_used:
            # when the demoter's rounds start and end is timing a replay needs (kvstrata.sim's
            # "demote" marks): under load they lag the writes, the tiers stay fuller
            if demoter:
                self.state.trace("demote", "", (), to=tier.name)
            try:
                if not await self._evict_round(i, int(self.filled(tier) - target_used)):
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
