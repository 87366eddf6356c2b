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
from kvstrata.sim.vleases import SimLeases
from kvstrata.sim.vtiers import ORDER, TierSpec, VTier
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.lru import LruHeap
from kvstrata.store.policy import chain_to, prefetch_budget, prefetch_todo
from kvstrata.store.sessions import SessionTable

MAX_CHAIN = 65_536
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


class Simulator(SimLeases):
    """See the module docstring. ``specs`` in any order; they are stacked gpu, dram, nvme, s3.
    Placement over the tiers is :class:`SimPlacement`'s (``sim.vplacement``), leases
    :class:`SimLeases`'s (``sim.vleases``), prefetch :attr:`prefetcher`'s (``sim.prefetch``)."""

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
        self.counted: list[str] = []
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
        #: reads of a trace that says which tier served each (``get`` records with ``tier``):
        #: how many, how many the replay served from the same tier, the first few that differ
        self.checked = {"reads": 0, "same": 0}
        self.differ: list[tuple[float, str, str]] = []  # (trace time, server, replay)

    # -- clock -------------------------------------------------------------------------------------

    def tick(self, t: float) -> None:
        """Advance to trace time ``t``; every command gets its own LRU stamp (order is what the
        server's monotonic clock gives too)."""
        self.now = max(self.now, t)
        self.prefetcher.advance(self.now)  # the prefetch workers' moves up to now come first
        self.stamp += 1.0
        self.ops += 1

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
        if not placed and not self.place_below(rec):
            return False
        self.enforce()
        return True

    def place_below(self, rec: ChunkRecord) -> bool:
        """DRAM cannot take the chunk: the first lower tier that can (``_place_below``); an
        OOM when none can."""
        if any(
            self.put_with_room(j, rec)
            for j, t in enumerate(self.tiers)
            if t is not self.dram and t is not self.gpu
        ):
            return True
        self.index.remove(rec)
        self.oom += 1
        return False

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

    def delete_key(self, ns: str, h: bytes) -> None:
        """A recorded deletion (KV.DEL, DEL, expiry by TTL, a replacing PUT)."""
        rec = self.index.get(ChunkKey(ns, h))
        if rec is not None:
            self.delete(rec)

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
