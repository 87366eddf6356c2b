"""The simulator's leases: KV.LEASE's promotions ahead, where each leased chunk counts a read.

A mixin of :class:`~kvstrata.sim.engine.Simulator`, as ``kvstore.read``'s lease path: the
leading chunks below the lease tier promoted in groups of :data:`LEASE_AHEAD` before any is
pinned (``_ahead_groups``), every chunk a read of the tier it was found in before those
promotions (``_found_in``, ``_count_read``), held until the lease's ``release`` when the trace
names it. A recorded lease's start (``lease_start``) does those promotions spread over the
commands recorded while the server granted it; a read of a prefetched chunk is timed by the
prefetch model (``_arrived``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.chunks import ChunkKey
from kvstrata.sim.prefetch import PrefetchModel
from kvstrata.sim.vplacement import LEASE_AHEAD, SimPlacement
from kvstrata.sim.vtiers import VTier
from kvstrata.store.index import ChunkRecord


class SimLeases(SimPlacement):
    """Mixin of ``Simulator``: KV.LEASE, a recorded lease's start and its release."""

    # state owned by Simulator
    now: float
    stamp: float
    prefetcher: PrefetchModel
    _leases: dict[str, list[ChunkRecord]]
    #: the tier each chunk of the last lease was counted a read of
    counted: list[str]
    #: leases started, not granted yet: where their chunks were, promotions left to do
    _begun: dict[str, tuple[dict[ChunkKey, VTier], list[list[ChunkRecord]]]]

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
        self.counted = []
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
            self.counted.append((found.get(rec.key) or where).name)
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

    def _arrived(self, rec: ChunkRecord) -> None:
        """A prefetched chunk is used: was it there in time?"""
        if self.prefetcher.ready:
            self.prefetcher.arrived(rec, self.now)
