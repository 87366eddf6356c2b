"""The simulated store: the server's index, LRU heaps and placement decisions over virtual tiers.

:class:`Simulator` mirrors :class:`~kvstrata.store.placement.Placement` and the store's read,
write and prefetch paths step by step, but synchronously and without bytes: every decision (which
victim, whether it is written back, demotion or eviction, whether a cold hit is promoted, which
chunks a prefetch queues, a session's chain) is taken by the same functions the server calls
(``kvstrata.store.policy``) over the same :class:`~kvstrata.store.index.ChunkIndex` and
:class:`~kvstrata.store.lru.LruHeap`. Where the server moves bytes in the background (the
demoter, prefetch workers) the simulator moves them at once, after the command that caused
them; the time they would take is charged to the link they cross (:attr:`Simulator.links`) and
to prefetch timeliness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstrata.chunks import ChunkKey
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
_NO_SUM = b"\0" * 8  # records carry no checksum: there are no bytes


@dataclass(slots=True)
class MatchResult:
    """One KV.MATCH as an engine request: the tier each matched chunk was found in."""

    time: float
    chunks: int  # chunks asked for
    tokens: int  # prompt tokens (0: unknown, the economics use chunks × chunk tokens)
    found: list[tuple[str, int, int]] = field(default_factory=list)  # (tier, size, tokens)


class Simulator:
    """See the module docstring. ``specs`` in any order; they are stacked gpu, dram, nvme, s3."""

    def __init__(self, specs: Sequence[TierSpec]) -> None:
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
        self.prefetch = {"requests": 0, "chunks": 0, "bytes": 0, "timely": 0, "late": 0}
        self._ready: dict[ChunkKey, float] = {}
        self._prefetch_busy = 0.0
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
        self.stamp += 1.0
        self.ops += 1

    def _link(self, src: str, dst: str, nbytes: int) -> None:
        name = f"{src}->{dst}"
        self.links[name] = self.links.get(name, 0) + nbytes

    # -- residency -------------------------------------------------------------------------------

    def _add(self, rec: ChunkRecord, tier: VTier) -> None:
        tier.used += tier.spec.footprint(rec.size)
        tier.counters.bytes_in += rec.size
        self.index.add_tier(rec, tier.name)

    def _drop(self, rec: ChunkRecord, tier: VTier) -> None:
        tier.used -= tier.spec.footprint(rec.size)
        self.index.drop_tier(rec, tier.name)

    def _fits(self, i: int, size: int) -> bool:
        """make_room: move chunks out of tier ``i`` until ``size`` fits; False if stuck."""
        tier = self.tiers[i]
        need = tier.spec.footprint(size)
        while tier.free() < need:
            if need > tier.capacity:
                return False
            victims = pick_victims(self.heaps[tier.name], max(1, need - tier.free()))
            if not victims or not any([self.move_down(r, i) for r in victims]):
                return tier.free() >= need
        return True

    def put_with_room(self, j: int, rec: ChunkRecord) -> bool:
        if not self._fits(j, rec.size):
            return False
        self._add(rec, self.tiers[j])
        return True

    def enforce(self) -> None:
        """The demoter: every tier above its high watermark goes down to its low one."""
        for i, tier in enumerate(self.tiers):
            pol = tier.spec.policy
            if not above_high(pol, tier.capacity, tier.used):
                continue
            target = (pol.low or 0.0) * tier.capacity
            while tier.used > target:
                victims = pick_victims(self.heaps[tier.name], max(1, int(tier.used - target)))
                if not victims or not any([self.move_down(r, i) for r in victims]):
                    break

    def move_down(self, rec: ChunkRecord, i: int) -> bool:
        """Placement.move_down: write back below tier ``i`` when needed, drop the copy."""
        src = self.tiers[i]
        if src.name not in rec.tiers or not self._keep_below(rec, i):
            if rec.alive and src.name in rec.tiers:
                self._changed(rec, src.name)
            return False
        self._drop(rec, src)
        if leaving_counter(rec) == "demotions":
            src.counters.demotions += 1
        else:
            src.counters.evictions += 1
            self.index.remove(rec)
        return True

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
        if not rec.alive or dst.name in rec.tiers:
            return False
        self._add(rec, dst)
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
                return True  # an identical re-put (the trace has no checksums)
            self.delete(old)
        rec = ChunkRecord(key, parent, tokens, size, _NO_SUM, last_access=self.stamp)
        rec.tiers = set()
        self.index.add(rec)
        placed = False
        for j, tier in enumerate(self.tiers):
            if tier.spec.policy.write_through and tier is not self.dram:
                placed = self.put_with_room(j, rec) or placed
        if self.dram is not None and size <= self.dram.capacity:
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
            tier = next(t.name for t in self.tiers if t.name in rec.tiers)
            result.found.append((tier, rec.size, rec.tokens))
            found.append(h)
        self.requests.append(result)
        if prefetch and found:
            self.prefetch_chain(ns, found)
        return len(found)

    def lease(self, ns: str, hashes: Sequence[bytes], tier: str | None = None) -> int:
        """KV.LEASE: promote the leading chunks into the lease tier, count a hit there each
        (the simulator releases at once: a lease holds nothing between commands)."""
        target = self.by_name.get(tier or ("gpu" if self.gpu else "dram"))
        if target is None or self.dram is None:
            return 0
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
            where.counters.hits += 1
            self._link(where.name, "engine", rec.size)
            n += 1
        self.enforce()
        return n

    def _ensure(self, rec: ChunkRecord, target: VTier) -> VTier | None:
        if target.name in rec.tiers or self.copy_into(rec, target, make_room=True):
            return target
        return None

    def session(self, ns: str, sid: bytes, tail: bytes, ttl_ms: int = 3_600_000) -> None:
        self.sessions.record(ns, sid, tail, ttl_ms)

    def prefetch_session(self, ns: str, sid: bytes, to: str | None = None) -> int:
        entry = self.sessions.get(ns, sid)
        if entry is None:
            return 0
        chain = chain_to(entry.tail, lambda h: self.index.get(ChunkKey(ns, h)), MAX_CHAIN)
        return self.prefetch_chain(ns, chain, to)

    def prefetch_chain(self, ns: str, hashes: Sequence[bytes], to: str | None = None) -> int:
        """KV.PREFETCH: the server's choice of chunks, moved at once; each chunk is ready when
        the prefetch channel (one after the other, at the source link's bandwidth) gets it."""
        target = self.by_name.get(to or "dram")
        if target is None or target.spec.shared:
            return 0
        budget = prefetch_budget(target.spec.policy, target.capacity)
        todo = prefetch_todo(hashes, lambda h: self.index.get(ChunkKey(ns, h)), target.name, budget)
        self.prefetch["requests"] += 1
        moved = 0
        for h in todo:
            rec = self.index.get(ChunkKey(ns, h))
            if rec is None:
                continue
            src = next((t for t in self.tiers if t.name in rec.tiers), None)
            if src is None or not self._ensure(rec, target):
                continue
            rec.last_access = self.stamp
            start = max(self.now, self._prefetch_busy)
            self._prefetch_busy = start + src.spec.latency + rec.size / src.spec.bandwidth
            self._ready[rec.key] = self._prefetch_busy
            self.prefetch["chunks"] += 1
            self.prefetch["bytes"] += rec.size
            moved += 1
        self.enforce()
        return moved

    def _arrived(self, rec: ChunkRecord) -> None:
        """A prefetched chunk is used: was it there in time?"""
        ready = self._ready.pop(rec.key, None) if self._ready else None
        if ready is not None:
            self.prefetch["timely" if ready <= self.now else "late"] += 1
