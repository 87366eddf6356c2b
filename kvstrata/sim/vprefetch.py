"""The simulator's prefetch: the chunks a KV.PREFETCH queues, moved by the server's workers, timed.

A mixin of :class:`~kvstrata.sim.engine.Simulator`: ``prefetch_chain`` is the server's
scheduler (``prefetch_todo`` within ``prefetch_budget``, root first, room made for a group of
:attr:`prefetch_concurrency` at once); each worker is a channel at the source link's latency
and bandwidth, which gives every chunk its ready time, and a chunk used later counts as
``timely`` or ``late`` (``_arrived``). ``prefetch_session`` prefetches a session's chain.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.chunks import ChunkKey
from kvstrata.sim.vplacement import SimPlacement
from kvstrata.store.index import ChunkRecord
from kvstrata.store.policy import chain_to, prefetch_budget, prefetch_todo
from kvstrata.store.sessions import SessionTable

MAX_CHAIN = 65_536


class SimPrefetch(SimPlacement):
    """Mixin of ``Simulator``: KV.PREFETCH and its timeliness."""

    # state owned by Simulator
    now: float
    stamp: float
    sessions: SessionTable
    prefetch: dict[str, int]
    prefetch_concurrency: int
    _channels: list[float]
    _ready: dict[ChunkKey, float]

    def prefetch_session(self, ns: str, sid: bytes, to: str | None = None) -> int:
        entry = self.sessions.get(ns, sid)
        if entry is None:
            return 0
        chain = chain_to(entry.tail, lambda h: self.index.get(ChunkKey(ns, h)), MAX_CHAIN)
        return self.prefetch_chain(ns, chain, to)

    def prefetch_chain(
        self, ns: str, hashes: Sequence[bytes], to: str | None = None, deadline_ms: int = 0
    ) -> int:
        """KV.PREFETCH as the server's scheduler runs it: the chunks it would queue
        (``prefetch_todo``), moved root first by :attr:`prefetch_concurrency` workers. Room is
        made for a group of that many at once (the writers' room maker serves its waiters
        together), each chunk is touched when it lands; each worker is a channel at the source
        link's latency and bandwidth, which gives every chunk its ready time (``timely`` /
        ``late`` when used); with a deadline, chunks that could not start before it are
        abandoned and the request counts ``expired``. The moves are done at once (their
        placement effects); only their timing is modelled."""
        target = self.by_name.get(to or "dram")
        if target is None or target.spec.shared:
            return 0
        budget = prefetch_budget(target.spec.policy, target.capacity)
        todo = prefetch_todo(hashes, lambda h: self.index.get(ChunkKey(ns, h)), target.name, budget)
        self.prefetch["requests"] += 1
        end = self.now + deadline_ms / 1000 if deadline_ms > 0 else None
        records = [r for r in map(lambda h: self.index.get(ChunkKey(ns, h)), todo) if r]
        moved = 0
        width = max(1, self.prefetch_concurrency)
        for start in range(0, len(records), width):
            group = records[start : start + width]
            if end is not None and min(self._channels) > end:
                self.prefetch["expired"] += 1  # the turn loads the rest itself
                break
            self._room_for_group(group, target)
            for rec in group:
                src = next((t for t in self.tiers if t.name in rec.tiers), None)
                if src is None or not self._ensure(rec, target):
                    continue
                moved += 1
                self.stamp += 1e-6  # landed one after the other: distinct LRU stamps
                rec.last_access = self.stamp
                i = self._channels.index(min(self._channels))
                begin = max(self.now, self._channels[i])
                self._channels[i] = begin + src.spec.latency + rec.size / src.spec.bandwidth
                self._ready[rec.key] = self._channels[i]
                self.prefetch["chunks"] += 1
                self.prefetch["bytes"] += rec.size
        self.enforce()
        return moved

    def _arrived(self, rec: ChunkRecord) -> None:
        """A prefetched chunk is used: was it there in time?"""
        ready = self._ready.pop(rec.key, None) if self._ready else None
        if ready is not None:
            self.prefetch["timely" if ready <= self.now else "late"] += 1
