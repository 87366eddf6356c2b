"""Leases: time-limited permissions handed to engines for zero-copy access.

- A **read lease** (``KV.LEASE``) pins chunks resident in a shareable tier and carries one
  :class:`~kvstrata.tiers.base.Handle` per chunk; pinned chunks are never evicted, moved or
  freed until the lease ends.
- A **write lease** (``KV.RESERVE``) owns one reserved, invisible DRAM slot (a payload sink)
  until ``KV.COMMIT`` publishes it or ``KV.ABORT`` frees it.

Every lease has a deadline. :func:`run_sweeper` (one asyncio task per store) ends expired leases
every ``interval`` seconds through a callback, so a crashed client leaks nothing. Lease ids are
unguessable (``secrets.token_hex(8)``): a lease id is a capability over pinned memory.

This module keeps only the table; what ending a lease means (unpinning, aborting a slot) is the
store's callback.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.store.index import ChunkRecord
from kvstrata.store.keys import ChunkKey
from kvstrata.tiers.base import Handle

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadLease:
    """Pins ``records`` (leading present chunks of a chain); ``handles`` line up with them."""

    id: str
    namespace: str
    records: tuple[ChunkRecord, ...]
    handles: tuple[Handle, ...]
    deadline: float  # time.monotonic() seconds

    kind = "read"


@dataclass(frozen=True, slots=True)
class WriteLease:
    """Owns the reserved slot ``sink`` for ``key`` until commit or abort."""

    id: str
    key: ChunkKey
    parent: bytes
    tokens: int
    size: int
    handle: Handle
    sink: Any  # kvstrata.store.kvstore_write.StoreSink (kept untyped to avoid an import cycle)
    deadline: float

    kind = "write"


Lease = ReadLease | WriteLease


def deadline_after(ttl_ms: int, clock: Callable[[], float] = time.monotonic) -> float:
    return clock() + ttl_ms / 1000.0


class LeaseTable:
    """Lease id → lease, with a deadline heap for the sweeper (lazy deletion)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def new_id(self) -> str:
        while True:
            lease_id = secrets.token_hex(8)
            if lease_id not in self._leases:
                return lease_id

    def add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: str) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def is_expired(self, lease: Lease) -> bool:
        return lease.deadline <= self.clock()

    def take_expired(self) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = self.clock()
        out: list[Lease] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                del self._leases[lease_id]
                out.append(lease)
        if len(heap) > 2 * len(self._leases) + 1024:
            self._deadlines = [(x.deadline, x.id) for x in self._leases.values()]
            heapq.heapify(self._deadlines)
        self.expired += len(out)
        return out

    def take_all(self) -> list[Lease]:
        out = list(self._leases.values())
        self._leases.clear()
        self._deadlines.clear()
        return out

    def pinned_bytes(self) -> int:
        total = 0
        for lease in self._leases.values():
            if isinstance(lease, ReadLease):
                total += sum(r.size for r in lease.records)
            else:
                total += lease.size
        return total


async def run_sweeper(
    table: LeaseTable,
    on_expired: Callable[[Lease], None],
    interval: float = 0.1,
    on_error: Callable[[BaseException], None] | None = None,
) -> None:
    """End expired leases forever (cancel the task to stop). A failing callback is logged and
    counted through ``on_error``; it never stops the sweeper."""
    while True:
        await asyncio.sleep(interval)
        for lease in table.take_expired():
            try:
                on_expired(lease)
            except Exception as exc:
                log.exception("ending expired lease %s failed", lease.id)
                if on_error is not None:
                    on_error(exc)
