"""A bound on the index records of chunks held only in the shared tier (s3).

A node adopts a record for every chunk it finds in S3 (``kvstore.remote``), and chunks it
wrote back to S3 keep theirs after leaving the local tiers. Without a bound the index of a
long-running node grows with everything the cluster ever stored. :class:`RemoteRecords`
keeps those records in least-recently-used order (``s3-max-remote-records``); above the
limit the oldest are *forgotten*: taken out of the index and keyspace, the object in the bucket
untouched (the next lookup finds it again with one HEAD).

The order is kept from the index's residency hook (O(1) per change). Reads do not reorder it
(``KV.MATCH`` stays index-only); instead a record used since it entered the order gets a
second chance when it reaches the old end. Pinned, leased or moving records are skipped.
Synchronous bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvstrata.chunks import ChunkKey
from kvstrata.store.index import ChunkRecord


class RemoteRecords:
    """Keys of records resident only in tier ``tier``, oldest first; see the module docstring."""

    def __init__(self, tier: str, limit: int) -> None:
        self.tier = tier
        self.limit = limit  # 0: no bound
        self._order: OrderedDict[ChunkKey, float] = OrderedDict()  # key → last_access seen
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._order)

    def note(self, rec: ChunkRecord) -> None:
        """The residency of ``rec`` changed (index hook)."""
        tiers = rec.tiers
        if rec.alive and len(tiers) == 1 and self.tier in tiers:
            if rec.key not in self._order:
                self._order[rec.key] = rec.last_access
        else:
            self._order.pop(rec.key, None)

    def over(self) -> bool:
        return 0 < self.limit < len(self._order)

    def trim(self, lookup: Callable[[ChunkKey], ChunkRecord | None],
             forget: Callable[[ChunkRecord], None]) -> int:  # fmt: skip
        """Forget the least recently used records until the limit holds; how many."""
        order = self._order
        done = 0
        for _ in range(2 * len(order)):  # each key is looked at twice at most per trim
            if not self.over():
                break
            key, seen = order.popitem(last=False)
            rec = lookup(key)
            if rec is None or not rec.alive or rec.tiers != {self.tier}:
                continue
            if rec.pins or rec.leases or rec.moving or rec.last_access > seen:
                order[key] = rec.last_access  # in use, or used since: to the young end
                continue
            forget(rec)
            order.pop(key, None)
            done += 1
        self.forgotten += done
        return done
