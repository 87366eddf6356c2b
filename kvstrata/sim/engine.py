"""The simulated store: the server's index, LRU heaps and placement decisions over virtual tiers.

:class:`Simulator` mirrors :class:`~kvstrata.store.placement.Placement` and the store's read,
write and prefetch paths step by step, but synchronously and without bytes: every decision (which
victim, whether it is written back, demotion or eviction, whether a cold hit is promoted, which
chunks a prefetch queues, a session's chain) is taken by the same functions the server calls
(``kvstrata.store.policy``) over the same :class:`~kvstrata.store.index.ChunkIndex` and
:class:`~kvstrata.store.lru.LruHeap`. Where the server moves bytes in the background (the
demoter, prefetch workers) the simulator moves them at once, after the command that caused
them (or, replaying a trace with the server's ``demote`` marks, the demoter's rounds at those
marks: :attr:`Simulator.demoter`); the time they would take is charged to the link they
cross (:attr:`Simulator.links`) and to prefetch timeliness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.chunks import ChunkKey
from kvstrata.sim.prefetch import PrefetchModel
from kvstrata.sim.vtiers import ORDER, TierSpec, VTier
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.lru import LruHeap
from kvstrata.store.policy import (
    above_high,
    chain_to,
    leaving_counter,
    pick_victims,
    prefetch_budget,
    prefetch_todo,
    write_back_needed,
)
from kvstrata.store.sessions import SessionTable

MAX_CHAIN = 65_536
#: chunks a lease promotes at once (``kvstore.read._AHEAD``)
LEASE_AHEAD = 8
_NO_SUM = b"\0" * 8  # records carry no checksum: there are no bytes


def _slot_key(key: ChunkKey) -> ChunkKey:
    """A reserved slot's key until its chunk is committed (the chunk's own key may still name
    an older copy in the same tier)."""
    return ChunkKey("\0reserved:" + key.namespace, key.hash)


@dataclass(slots=True)
class MatchResult:
    """One KV.MATCH as an engine request: the tier each matched chunk was found in."""

    time: float
    chunks: int  # chunks asked for
    tokens: int  # prompt tokens (0: unknown, the economics use chunks × chunk tokens)
    found: list[tuple[str, int, int]] = field(default_factory=list)  # (tier, size, tokens)


class Simulator:
    """See the module docstring. ``specs`` in any order; they are stacked gpu, dram, nvme, s3."""

    def __init__(
        self,
        specs: Sequence[TierSpec],
        prefetch_concurrency: int = 4,
        prefetch_queue: int = 1024,
        prefetch_bandwidth: float = 0.0,
    ) -> None:
        self.tiers = [VTier(s) for s in sorted(specs, key=lambda s: ORDER.index(s.name))]
        self.by_name = {t.name: t for t in self.tiers}
        self.dram = self.by_name.get("dram")
        self.gpu = self.by_name.get("gpu")
        self.heaps = {t.name: LruHeap(t.name) for t in self.tiers if not t.spec.shared}
        self.index = ChunkIndex(on_change=self._changed)
        self.now = 0.0
        self.stamp = 0.0
        self.sessions = SessionTable(clock=lambda: self.now)
        self.links: dict[str, int] = {}
        self.requests: list[MatchResult] = []
        #: the server's prefetch scheduler: ``prefetch-concurrency`` workers, ``prefetch-queue``
        #: requests, ``prefetch-bandwidth`` bytes/s
        self.prefetcher = PrefetchModel(
            self, prefetch_concurrency, prefetch_queue, float(prefetch_bandwidth)
        )
        self._leases: dict[str, list[ChunkRecord]] = {}
        #: leases started, not granted yet: where their chunks were, promotions left to do
        self._begun: dict[str, tuple[dict[ChunkKey, VTier], list[list[ChunkRecord]]]] = {}
        #: when the demoter runs: "immediate" (after every command that may need it, as a
        #: server whose demoter keeps up) or "recorded" (at a trace's ``demote`` marks)
        self.demoter = "immediate"
        self._passes: set[int] = set()
        self._reserved: dict[ChunkKey, int] = {}  # write-lease slots not committed yet
        #: the recorded demoter round in flight: (tier index, its victims, moving)
        self._round: tuple[int, list[ChunkRecord]] | None = None
        self.ops = 0
        self.oom = 0

    # -- index hook, clock -----------------------------------------------------------------------

    def _changed(self, rec: ChunkRecord, tier: str) -> None:
        heap = self.heaps.get(tier)
        if heap is not None:
            heap.arm(rec)
            heap.compact(self.index.count_in.get(tier, 0))

    def tick(self, t: float) -> None:
        """Advance to trace time ``t``; every command gets its own LRU stamp (order is what the
        server's monotonic clock gives too)."""
        self.now = max(self.now, t)
        self.prefetcher.advance(self.now)  # the prefetch workers' moves up to now come first
        self.stamp += 1.0
        self.ops += 1

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
        moving = []
        for rec in pick_victims(self.heaps[tier.name], max(1, int(tier.used - target))):
            if tier.name in rec.tiers and self._keep_below(rec, i):
                rec.moving = True
                moving.append(rec)
            elif rec.alive and tier.name in rec.tiers:
                self._changed(rec, tier.name)
        self._round = (i, moving)

    def demoted(self) -> None:
        """The demoter's round ends (its ``demoted`` mark, or the next round's start): the
        victims' copies leave, unless leased, read or given a child in the tier meanwhile."""
        if self._round is None:
            return
        i, moving = self._round
        self._round = None
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

    # -- commands ----------------------------------------------------------------------------------

    def put(self, ns: str, h: bytes, parent: bytes, size: int, tokens: int = 0) -> bool:
        """KV.PUT: write-through tiers, then DRAM (making room), else the first lower tier."""
        key = ChunkKey(ns, h)
        old = self.index.get(key)
        if old is not None:
            if old.size == size:
                self.abort(ns, h)  # (a slot reserved for it is not needed)
                return True  # an identical re-put (the trace has no checksums)
            self.delete(old)
        rec = ChunkRecord(key, parent, tokens, size, _NO_SUM, last_access=self.stamp)
        rec.tiers = set()
        self.index.add(rec)
        placed = False
        for j, tier in enumerate(self.tiers):
            if tier.spec.policy.write_through and tier is not self.dram:
                placed = self.put_with_room(j, rec) or placed
        if key in self._reserved and self.dram is not None:  # KV.COMMIT: its slot is there
            self._reserved.pop(key)
            self.dram.slots[key] = self.dram.slots.pop(_slot_key(key))
            self.dram.counters.bytes_in += size
            self.index.add_tier(rec, self.dram.name)
            placed = True
        elif self.dram is not None and size <= self.dram.capacity:
            placed = self.put_with_room(self.tiers.index(self.dram), rec) or placed
        if not placed:
            placed = any(
                self.put_with_room(j, rec)
                for j, t in enumerate(self.tiers)
                if t is not self.dram and t is not self.gpu
            )
        if not placed:
            self.index.remove(rec)
            self.oom += 1
            return False
        self.enforce()
        return True

    def reserve(self, ns: str, h: bytes, size: int) -> bool:
        """KV.RESERVE / a chunk of KV.MRESERVE: a DRAM slot now (making room), the chunk
        at its ``put`` (commit)."""
        key = ChunkKey(ns, h)
        dram = self.dram
        if dram is None or key in self._reserved or not self._fits(self.tiers.index(dram), size):
            return False
        if not dram.take(_slot_key(key), size):
            return False
        self._reserved[key] = size
        return True

    def abort(self, ns: str, h: bytes) -> None:
        """A reserved slot given back unpublished."""
        key = ChunkKey(ns, h)
        size = self._reserved.pop(key, None)
        if size is not None and self.dram is not None:
            self.dram.give(_slot_key(key), size)

    def delete(self, rec: ChunkRecord) -> None:
        for name in list(rec.tiers):
            self._drop(rec, self.by_name[name])
        self.index.remove(rec)

    def get(self, ns: str, h: bytes) -> str | None:
        """KV.GET: per-tier hits and misses as the read path counts them; a hit in a cold tier
        is promoted into DRAM when DRAM has room now (no eviction for a read-through)."""
        rec = self.index.get(ChunkKey(ns, h))
        if rec is None or not rec.tiers:
            for tier in self.tiers:
                tier.counters.misses += 1
            return None
        rec.last_access = self.stamp
        rec.hits += 1
        self._arrived(rec)
        dram = self.dram
        for tier in self.tiers:
            if tier.name not in rec.tiers:
                tier.counters.misses += 1
                continue
            if tier is self.gpu and dram is not None and dram.name in rec.tiers:
                continue
            tier.counters.hits += 1
            if tier is not dram and dram is not None and self.copy_into(rec, dram, False):
                self.enforce()  # copy_into counted the bytes out of the cold tier
            else:
                tier.counters.bytes_out += rec.size
            self._link(tier.name, "engine", rec.size)
            return tier.name
        return None

    def match(
        self, ns: str, hashes: Sequence[bytes], tokens: int = 0, prefetch: bool = False
    ) -> int:
        """KV.MATCH: the known leading chunks (touched); one engine request for economics."""
        get = self.index.get
        result = MatchResult(self.now, len(hashes), tokens)
        found: list[bytes] = []
        for h in hashes:
            rec = get(ChunkKey(ns, h))
            if rec is None or not rec.tiers:
                break
            rec.last_access = self.stamp
            # a chunk a prefetch worker is still moving is loaded as from where it comes
            tier = self.prefetcher.moving_from(rec, self.now) if self.prefetcher.ready else None
            tier = tier or next(t.name for t in self.tiers if t.name in rec.tiers)
            result.found.append((tier, rec.size, rec.tokens))
            found.append(h)
        self.requests.append(result)
        if prefetch and found:
            self.prefetch_chain(ns, found)
        return len(found)

    def lease(
        self, ns: str, hashes: Sequence[bytes], tier: str | None = None, lease_id: str = ""
    ) -> int:
        """KV.LEASE: promote the leading chunks into the lease tier, count a read each where
        it was found. With ``lease_id`` (a recorded trace) the chunks stay leased, so never
        victims, until its ``release``; without (a generated workload) the lease ends at once.
        A lease whose start was replayed (:meth:`lease_start`) did its promotions then."""
        target = self.by_name.get(tier or ("gpu" if self.gpu else "dram"))
        if target is None or self.dram is None:
            return 0
        begun = self._begun.pop(lease_id, None) if lease_id else None
        if begun is None:
            found = self._found_in(ns, hashes, target)  # before any promotion
            groups = self._ahead_groups(ns, hashes, target)
        else:
            found, groups = begun  # the groups its replayed parts did not reach
        for group in groups:
            self._promote_group(group, target)
        held: list[ChunkRecord] = []
        n = 0
        for h in hashes:
            rec = self.index.get(ChunkKey(ns, h))
            if rec is None or not rec.tiers:
                break
            where = self._ensure(rec, target) or self._ensure(rec, self.dram)
            if where is None:
                break
            rec.last_access = self.stamp
            rec.hits += 1
            self._arrived(rec)
            self._count_read(found.get(rec.key) or where)
            self._link(where.name, "engine", rec.size)
            n += 1
            if lease_id:
                rec.leases += 1
                held.append(rec)
        if held:
            self._leases[lease_id] = held
        self.enforce()
        return n

    def lease_start(
        self, ns: str, hashes: Sequence[bytes], tier: str | None, lease_id: str, part: int = 0
    ) -> None:
        """A recorded lease in progress (its record's ``t`` minus ``since``, then ``part`` 1,
        2 … spread until its record): at the start, where its chunks are now; at each part,
        one group of its promotions ahead. On the server those run beside the commands
        recorded until the lease's record: writes may evict a promoted chunk before the
        lease pins it, and the lease promotes it again."""
        target = self.by_name.get(tier or ("gpu" if self.gpu else "dram"))
        if target is None or self.dram is None or not lease_id:
            return
        if part == 0:
            found = self._found_in(ns, hashes, target)
            self._begun[lease_id] = (found, self._ahead_groups(ns, hashes, target))
        begun = self._begun.get(lease_id)
        if begun is not None and begun[1]:
            self._promote_group(begun[1].pop(0), target)
            self.enforce()

    def _found_in(self, ns: str, hashes: Sequence[bytes], target: VTier) -> dict[ChunkKey, VTier]:
        """``ReadPath._found_in``: the lease tier when it holds a leading chunk, else the
        fastest tier that does."""
        found: dict[ChunkKey, VTier] = {}
        for h in hashes:
            rec = self.index.get(ChunkKey(ns, h))
            if rec is None or not rec.tiers:
                break
            moving = self.prefetcher.moving_from(rec, self.now)  # not landed: found below
            if moving is not None:
                found[rec.key] = self.by_name[moving]
                continue
            hit = target.name in rec.tiers
            found[rec.key] = target if hit else next(t for t in self.tiers if t.name in rec.tiers)
        return found

    def _count_read(self, tier: VTier) -> None:
        """``ReadPath._count_read``: a leased chunk is a read of the tier it was found in (a
        miss in each faster tier, a hit there), as KV.GET counts one."""
        for t in self.tiers:
            if t is tier:
                t.counters.hits += 1
                return
            t.counters.misses += 1

    def _ahead_groups(
        self, ns: str, hashes: Sequence[bytes], target: VTier
    ) -> list[list[ChunkRecord]]:
        """``ReadPath._promote_ahead``: when two or more leading chunks are below the lease
        tier and fit in half of it, they are promoted together, room made for up to
        :data:`LEASE_AHEAD` of them in one round (the server's room maker serves its waiters
        so), before any of them is pinned: those groups."""
        below: list[ChunkRecord] = []
        for h in hashes:
            rec = self.index.get(ChunkKey(ns, h))
            if rec is None or not rec.tiers:
                break
            if target.name not in rec.tiers:
                below.append(rec)
        if len(below) < 2 or sum(r.size for r in below) > target.capacity // 2:
            return []
        return [below[i : i + LEASE_AHEAD] for i in range(0, len(below), LEASE_AHEAD)]

    def _promote_group(self, group: Sequence[ChunkRecord], target: VTier) -> None:
        self._room_for_group(group, target)
        for rec in group:
            if rec.alive and rec.tiers:
                self._ensure(rec, target)

    def release(self, lease_id: str) -> None:
        """The end of a recorded lease (KV.RELEASE, expiry, a closed connection)."""
        for rec in self._leases.pop(lease_id, ()):
            rec.leases -= 1
            if rec.alive:
                for name in rec.tiers:
                    self._changed(rec, name)  # a victim candidate again

    def delete_key(self, ns: str, h: bytes) -> None:
        """A recorded deletion (KV.DEL, DEL, expiry by TTL, a replacing PUT)."""
        rec = self.index.get(ChunkKey(ns, h))
        if rec is not None:
            self.delete(rec)

    def _ensure(self, rec: ChunkRecord, target: VTier) -> VTier | None:
        if target.name in rec.tiers or self.copy_into(rec, target, make_room=True):
            return target
        return None

    def session(self, ns: str, sid: bytes, tail: bytes, ttl_ms: int = 3_600_000) -> None:
        self.sessions.record(ns, sid, tail, ttl_ms)

    def prefetch_session(
        self, ns: str, sid: bytes, to: str | None = None, deadline_ms: int = 0
    ) -> int:
        entry = self.sessions.get(ns, sid)
        if entry is None:
            return 0
        chain = chain_to(entry.tail, lambda h: self.index.get(ChunkKey(ns, h)), MAX_CHAIN)
        return self.prefetch_chain(ns, chain, to, deadline_ms, sid)

    def prefetch_chain(
        self,
        ns: str,
        hashes: Sequence[bytes],
        to: str | None = None,
        deadline_ms: int = 0,
        session: bytes | None = None,
    ) -> int:
        """KV.PREFETCH: the chunks the server's scheduler would queue (``prefetch_todo``),
        handed to :attr:`prefetcher`, which moves them when its workers would
        (:mod:`kvstrata.sim.prefetch`); the chunks queued (0: none, deduplicated into a
        queued request, or dropped at a full queue)."""
        target = self.by_name.get(to or "dram")
        if target is None or target.spec.shared:
            return 0
        budget = prefetch_budget(target.spec.policy, target.capacity)
        todo = prefetch_todo(hashes, lambda h: self.index.get(ChunkKey(ns, h)), target.name, budget)
        if not todo:
            return 0
        before = self.prefetcher.counts["deduped"]
        req = self.prefetcher.submit(ns, todo, target.name, deadline_ms, session)
        if req is None or self.prefetcher.counts["deduped"] != before:
            return 0
        self.prefetcher.advance(self.now)  # a free worker starts at once
        return len(todo)

    @property
    def prefetch(self) -> dict[str, int]:
        """The prefetch counters (:data:`kvstrata.sim.prefetch.COUNTERS`)."""
        return self.prefetcher.counts

    def finish(self) -> None:
        """The end of a run: the prefetch queue runs to its end, as the server's does before
        its counters are read."""
        self.prefetcher.drain()

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

    def _arrived(self, rec: ChunkRecord) -> None:
        """A prefetched chunk is used: was it there in time?"""
        if self.prefetcher.ready:
            self.prefetcher.arrived(rec, self.now)
