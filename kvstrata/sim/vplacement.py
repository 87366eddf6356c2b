"""The simulator's placement over virtual tiers: what ``Placement`` and its ``Mover`` do, at once.

A mixin of :class:`~kvstrata.sim.engine.Simulator`: room made by rounds of LRU leaf victims
(``put_with_room``), the demoter (after every command, or at a trace's recorded ``demote`` /
``demoted`` marks), a victim written back below or dropped (``move_down``), promotions
(``copy_into``), room for chunks that wait together (``_room_for_group``: a lease's
promotions ahead, a prefetch worker's batch, served as the server's room maker serves its
waiters; a recorded demoter round in flight ends when DRAM has no other victim); the bytes
each move would carry are added to the link it crosses (:attr:`links`). The decisions are
``kvstrata.store.policy``'s, as the server's.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.sim.vtiers import VTier
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.lru import LruHeap
from kvstrata.store.policy import above_high, leaving_counter, pick_victims, write_back_needed

#: chunks a lease promotes at once (``kvstore.read._AHEAD``), and so at most the waiters the
#: DRAM room maker makes room for in one round
LEASE_AHEAD = 8


class SimPlacement:
    """Mixin of ``Simulator``: its tiers' room, victims, demoter and moves."""

    # state owned by Simulator
    tiers: list[VTier]
    by_name: dict[str, VTier]
    dram: VTier | None
    gpu: VTier | None
    heaps: dict[str, LruHeap]
    index: ChunkIndex
    links: dict[str, int]
    demoter: str
    _round: tuple[int, list[ChunkRecord]] | None

    # -- index hook, links -----------------------------------------------------------------------

    def _changed(self, rec: ChunkRecord, tier: str) -> None:
        heap = self.heaps.get(tier)
        if heap is not None:
            heap.arm(rec)
            heap.compact(self.index.count_in.get(tier, 0))

    def _link(self, src: str, dst: str, nbytes: int) -> None:
        name = f"{src}->{dst}"
        self.links[name] = self.links.get(name, 0) + nbytes

    # -- residency -------------------------------------------------------------------------------

    def _add(self, rec: ChunkRecord, tier: VTier) -> bool:
        if not tier.take(rec.key, rec.size):
            return False
        tier.counters.bytes_in += rec.size
        self.index.add_tier(rec, tier.name)
        return True

    def _drop(self, rec: ChunkRecord, tier: VTier) -> None:
        tier.give(rec.key, rec.size)
        self.index.drop_tier(rec, tier.name)

    def _fits(self, i: int, size: int) -> bool:
        """``Placement.put_with_room``: move chunks out of tier ``i`` until ``size`` fits;
        False if stuck. As the server: rounds of victims for what the payload lacks
        (``make_room``), then, while the tier cannot take the chunk's footprint (an NVMe slot
        or file is larger than its payload: the server's TierFull), one round of ``size``
        more each time."""
        tier = self.tiers[i]
        need = tier.spec.footprint(size)
        if tier.free() >= need:
            return True  # (an unbounded tier always)
        if need > tier.capacity:
            return False
        while tier.free() < size:
            if not self._evict_round(i, size - tier.free()) and not self._round_ended(i):
                break
        while tier.free() < need:
            if not self._evict_round(i, size) and not self._round_ended(i):
                return False
        return True

    def _round_ended(self, i: int) -> bool:
        """DRAM room making found no victim: as the server's room maker, wait for the
        eviction round in flight (``Placement.eviction_ended``) — a recorded demoter round
        holds its victims, the tier's leaves, until it ends — then look again. True when a
        round was in flight (it has ended now)."""
        if self._round is None or self.tiers[i] is not self.dram:
            return False
        self.demoted()
        return True

    def _evict_round(self, i: int, need: int) -> bool:
        """Victims adding up to ``need`` bytes leave tier ``i``; False when none could."""
        victims = pick_victims(self.heaps[self.tiers[i].name], max(1, need))
        return bool(victims) and any([self.move_down(r, i) for r in victims])

    def put_with_room(self, j: int, rec: ChunkRecord) -> bool:
        return self._fits(j, rec.size) and self._add(rec, self.tiers[j])

    def enforce(self) -> None:
        """The demoter after a command: every tier above its high watermark goes down to its
        low one. With ``demoter == "recorded"`` it waits for the trace's ``demote`` marks
        (:meth:`demote`) instead: the server's demoter lags the writes under load."""
        if self.demoter == "recorded":
            return
        for i, tier in enumerate(self.tiers):
            pol = tier.spec.policy
            if not above_high(pol, tier.capacity, tier.used):
                continue
            while self._demote_round(i):
                pass

    def demote(self, name: str | None) -> None:
        """A recorded ``demote`` mark: a round of the server's demoter over tier ``name``
        starts (``Placement.evict_to``): victims adding up to what is above the low watermark
        now, as this simulator's tiers stand (the mark says when, not what). They are written
        below at once and stay in the tier, moving, until the round's ``demoted`` mark."""
        self.demoted()
        tier = self.by_name.get(name or "")
        if tier is None or tier.spec.shared:
            return
        i = self.tiers.index(tier)
        target = (tier.spec.policy.low or 0.0) * tier.capacity
        if tier.capacity <= 0 or tier.used <= target:
            return
        self._round = (i, self._start_round(i, int(tier.used - target)))

    def _start_round(self, i: int, need: int) -> list[ChunkRecord]:
        """Victims adding up to ``need`` bytes, written below now; they stay in tier ``i``,
        moving, until their round ends (:meth:`_end_round`)."""
        tier = self.tiers[i]
        moving = []
        for rec in pick_victims(self.heaps[tier.name], max(1, need)):
            if tier.name in rec.tiers and self._keep_below(rec, i):
                rec.moving = True
                moving.append(rec)
            elif rec.alive and tier.name in rec.tiers:
                self._changed(rec, tier.name)
        return moving

    def demoted(self) -> None:
        """The demoter's round ends (its ``demoted`` mark, or the next round's start)."""
        if self._round is not None:
            round_, self._round = self._round, None
            self._end_round(*round_)

    def _end_round(self, i: int, moving: list[ChunkRecord]) -> None:
        """A round's victims' copies leave, unless leased, read or given a child in the tier
        meanwhile."""
        name = self.tiers[i].name
        for rec in moving:
            rec.moving = False
            if rec.alive and name in rec.tiers:
                if rec.leases or rec.pins or not rec.is_leaf_in(name):
                    self._changed(rec, name)
                else:
                    self._leave(rec, i)

    def _demote_round(self, i: int) -> bool:
        """One round toward the low watermark; False when at it, or when nothing can leave."""
        tier = self.tiers[i]
        target = (tier.spec.policy.low or 0.0) * tier.capacity
        if tier.capacity <= 0 or tier.used <= target:
            return False
        victims = pick_victims(self.heaps[tier.name], max(1, int(tier.used - target)))
        return bool(victims) and any([self.move_down(r, i) for r in victims])

    def move_down(self, rec: ChunkRecord, i: int) -> bool:
        """Placement.move_down: write back below tier ``i`` when needed, drop the copy."""
        src = self.tiers[i]
        if src.name not in rec.tiers or not self._keep_below(rec, i):
            if rec.alive and src.name in rec.tiers:
                self._changed(rec, src.name)
            return False
        self._leave(rec, i)
        return True

    def _leave(self, rec: ChunkRecord, i: int) -> None:
        src = self.tiers[i]
        self._drop(rec, src)
        if leaving_counter(rec) == "demotions":
            src.counters.demotions += 1
        else:
            src.counters.evictions += 1
            self.index.remove(rec)

    def _keep_below(self, rec: ChunkRecord, i: int) -> bool:
        src = self.tiers[i]
        dram = self.dram
        if (
            src is self.gpu
            and dram is not None
            and dram.name not in rec.tiers
            and self.copy_into(rec, dram, make_room=True)
        ):
            return True
        lower = self.tiers[i + 1 :]
        shared = [t.name for t in lower if t.spec.shared]
        if not write_back_needed(rec, [t.name for t in lower], shared):
            return True
        for j in range(i + 1, len(self.tiers)):
            dst = self.tiers[j]
            if dst.name not in rec.tiers and self.put_with_room(j, rec):
                self._link(src.name, dst.name, rec.size)
                return True
        local = [t for t in lower if not t.spec.shared]
        return any(t.name in rec.tiers for t in lower) or not local

    def copy_into(self, rec: ChunkRecord, dst: VTier, make_room: bool) -> bool:
        """Promote ``rec`` into ``dst`` from the fastest other tier holding it."""
        j = self.tiers.index(dst)
        src = next((t for t in self.tiers if t.name in rec.tiers and t is not dst), None)
        if src is None:
            return False
        if dst.free() < dst.spec.footprint(rec.size):
            if not make_room:
                return False
            rec.moving = True  # like the server's move: its copies stay while room is made
            try:
                room = self._fits(j, rec.size)
            finally:
                rec.moving = False
            if not room:
                return False
        if not rec.alive or dst.name in rec.tiers or not self._add(rec, dst):
            return False
        src.counters.bytes_out += rec.size
        dst.counters.promotions += 1
        self._link(src.name, dst.name, rec.size)
        return True

    def _ensure(self, rec: ChunkRecord, target: VTier) -> VTier | None:
        if target.name in rec.tiers or self.copy_into(rec, target, make_room=True):
            return target
        return None

    def _room_for_group(self, group: Sequence[ChunkRecord], target: VTier) -> None:
        """Chunks that wait for room in ``target`` together. In DRAM, as the server's room
        maker serves its waiters (``store/room.py``): the head is promoted when it fits, else a
        round of victims for all of the (up to :data:`LEASE_AHEAD`) waiting, then, when none
        could leave, the demoter's round in flight ends or a round for the head alone; a head
        nothing makes room for gives up. Elsewhere one round of victims for the group."""
        j = self.tiers.index(target)
        waiting = [r for r in group if target.name not in r.tiers]
        if target is not self.dram:
            need = sum(target.spec.footprint(r.size) for r in waiting) - target.free()
            if len(waiting) > 1 and need > 0:
                for victim in pick_victims(self.heaps[target.name], need):
                    self.move_down(victim, j)
            return
        while waiting:
            head = waiting[0]
            if not head.alive or not head.tiers or target.name in head.tiers:
                waiting.pop(0)
                continue
            size = target.spec.footprint(head.size)
            if target.free() >= size:
                self.copy_into(head, target, make_room=False)
                waiting.pop(0)
                continue
            ahead = waiting[:LEASE_AHEAD]
            need = sum(target.spec.footprint(r.size) for r in ahead) - target.free()
            if need > 0 and self._evict_round(j, need):
                continue
            if self._round_ended(j) or self._evict_round(j, size):
                continue
            waiting.pop(0)  # nothing can leave: the head's promotion fails
