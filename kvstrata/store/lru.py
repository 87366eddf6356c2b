"""The eviction candidates of one tier: an LRU min-heap with lazy deletion (``placement``'s).

Placement keeps one :class:`LruHeap` per tier of ``(last_access, seq, generation, record)``
holding only *candidates* (resident in the tier and without resident children there). The
index calls :meth:`~kvstrata.store.placement.Placement.changed` whenever a record enters or
leaves a tier or its resident-children count there moves between zero and non-zero; that
:meth:`~LruHeap.arm`-s the record: its generation for the tier is bumped (invalidating its old
entry) and a new entry is pushed if it is a candidate: O(log n). Accesses only update
``last_access``; a popped entry whose stamp is stale is pushed back with the current stamp, so
each access costs at most one extra O(log n) re-push. Picking a victim is therefore amortized
O(log n), plus O(log n) per pinned candidate skipped. The heap is rebuilt when stale entries
outnumber live ones (O(n), amortized O(1) per change).
"""

from __future__ import annotations

import heapq
import itertools

from kvstrata.store.index import ChunkRecord


class LruHeap:
    """Eviction candidates of one tier; see the module docstring."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._heap: list[tuple[float, int, int, ChunkRecord]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def _valid(self, gen: int, rec: ChunkRecord) -> bool:
        return rec.alive and gen == rec.gen.get(self.tier) and self.tier in rec.tiers

    def arm(self, rec: ChunkRecord) -> None:
        """The record's candidacy may have changed: invalidate its entry, push a new one."""
        gen = rec.gen.get(self.tier, 0) + 1
        rec.gen[self.tier] = gen
        if rec.alive and self.tier in rec.tiers and rec.is_leaf_in(self.tier):
            heapq.heappush(self._heap, (rec.last_access, next(self._seq), gen, rec))

    def requeue(self, rec: ChunkRecord) -> None:
        """Put back a popped candidate that was skipped (same generation)."""
        gen = rec.gen.get(self.tier, 0)
        heapq.heappush(self._heap, (rec.last_access, next(self._seq), gen, rec))

    def pop(self) -> ChunkRecord | None:
        """The least recently used valid candidate, removed from the heap."""
        heap = self._heap
        while heap:
            stamp, _, gen, rec = heap[0]
            if not self._valid(gen, rec):
                heapq.heappop(heap)
            elif stamp != rec.last_access:
                heapq.heapreplace(heap, (rec.last_access, next(self._seq), gen, rec))
            else:
                heapq.heappop(heap)
                return rec
        return None

    def compact(self, live: int) -> None:
        if len(self._heap) > 2 * live + 1024:
            self._heap = [e for e in self._heap if self._valid(e[2], e[3])]
            heapq.heapify(self._heap)
