"""Leases: time-limited permissions handed to engines for zero-copy access.

- A **read lease** (``KV.LEASE``) pins chunks resident in a shareable tier and carries one
  :class:`~kvstrata.tiers.base.Handle` per chunk; pinned chunks are never evicted, moved or
  freed until the lease ends.
- A **write lease** (``KV.RESERVE``) owns one reserved, invisible DRAM slot (a payload sink)
  until ``KV.COMMIT`` publishes it or ``KV.ABORT`` frees it.
- A **batch write lease** (``KV.MRESERVE``) owns the slots of several chunks of one chain;
  ``KV.COMMIT`` publishes them all (in chain order) or the ones it names, ``KV.ABORT`` or
  expiry frees the rest.

Every lease has a deadline. :func:`run_sweeper` (one asyncio task per store) ends expired leases
every ``interval`` seconds through a callback, and the store's tick ends the leases of
connections that closed (:meth:`LeaseTable.take_gone`), so a crashed client leaks nothing.
Lease ids are random (``secrets.token_hex(8)``) but not secrets (MONITOR and SLOWLOG show them):
what guards a lease is its holder, checked by every command that ends one.

A lease remembers its :class:`Holder` (the connection that took it). The table bounds how many
leases one holder and all holders together may have (``lease-max-per-client``,
``lease-max``); past either bound a new lease is refused with ``-LEASELIMIT``.

This module keeps only the table; what ending a lease means (unpinning, aborting a slot, fencing
the slots of a holder that may still touch them) is the store's callback.
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

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import LeaseLimitError
from kvstrata.store.index import ChunkRecord
from kvstrata.tiers.base import Handle

log = logging.getLogger(__name__)


def _never_alive() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Holder:
    """Who took a lease: a connection id and a way to ask whether that connection is still
    open. Slots of an expired lease stay fenced while ``alive()``; see ``store.fences``."""

    id: int
    alive: Callable[[], bool] = _never_alive


#: Leases taken in-process (tests, benchmarks): nobody outside can touch their slots.
NO_HOLDER = Holder(0)


@dataclass(frozen=True, slots=True)
class ReadLease:
    """Pins ``records`` (leading present chunks of a chain); ``handles`` line up with them."""

    id: str
    namespace: str
    records: tuple[ChunkRecord, ...]
    handles: tuple[Handle, ...]
    deadline: float  # time.monotonic() seconds
    holder: Holder = NO_HOLDER

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
    sink: Any  # kvstrata.store.kvstore.sink.StoreSink (kept untyped to avoid an import cycle)
    deadline: float
    holder: Holder = NO_HOLDER

    kind = "write"


@dataclass(frozen=True, slots=True)
class ReservedChunk:
    """One slot of a batch write lease: ``key``'s reserved ``size`` bytes behind ``handle``;
    ``index`` is the chunk's position in the KV.MRESERVE request."""

    index: int
    key: ChunkKey
    parent: bytes
    tokens: int
    size: int
    handle: Handle
    sink: Any  # a StoreSink or GpuSink, as in WriteLease


@dataclass(frozen=True, slots=True)
class BatchWriteLease:
    """Owns the reserved slots ``pending`` (by request position, in chain order) until each is
    committed or the rest aborted; the lease ends when none is left."""

    id: str
    pending: dict[int, ReservedChunk]
    deadline: float
    holder: Holder = NO_HOLDER

    kind = "write"

    @property
    def chunks(self) -> tuple[ReservedChunk, ...]:
        return tuple(self.pending.values())

    @property
    def handles(self) -> tuple[Handle, ...]:
        return tuple(c.handle for c in self.pending.values())

    @property
    def size(self) -> int:
        return sum(c.size for c in self.pending.values())


Lease = ReadLease | WriteLease | BatchWriteLease


def deadline_after(ttl_ms: int, clock: Callable[[], float] = time.monotonic) -> float:
    return clock() + ttl_ms / 1000.0


class LeaseTable:
    """Lease id → lease, with a deadline heap for the sweeper (lazy deletion) and a count of
    leases per holder. ``max_per_holder``/``max_total`` (0: unbounded) bound :meth:`admit`."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_per_holder: int = 0,
        max_total: int = 0,
    ) -> None:
        self.clock = clock
        self.max_per_holder = max_per_holder
        self.max_total = max_total
        self._leases: dict[str, Lease] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._per_holder: dict[int, int] = {}
        self._ids_of: dict[int, set[str]] = {}  # holder id -> its lease ids (not NO_HOLDER's)
        self.expired = 0
        self.refused = 0

    def held_by(self, holder: Holder) -> int:
        return self._per_holder.get(holder.id, 0)

    def leases_of(self, holder: Holder) -> list[Lease]:
        """The leases ``holder`` holds now (none for NO_HOLDER, which is not tracked)."""
        ids = self._ids_of.get(holder.id, ())
        return [self._leases[i] for i in ids if i in self._leases]

    def admit(self, holder: Holder) -> None:
        """Raise LeaseLimitError when ``holder`` may not take one more lease now."""
        if self.max_total and len(self._leases) >= self.max_total:
            self.refused += 1
            raise LeaseLimitError(
                f"the server holds {len(self._leases)} leases (lease-max {self.max_total}); "
                "release some or retry later"
            )
        if self.max_per_holder and holder.id:
            mine = self.held_by(holder)
            if mine >= self.max_per_holder:
                self.refused += 1
                raise LeaseLimitError(
                    f"this connection holds {mine} leases (lease-max-per-client "
                    f"{self.max_per_holder}); release some first"
                )

    def __len__(self) -> int:
        return len(self._leases)

    def new_id(self) -> str:
        while True:
            lease_id = secrets.token_hex(8)
            if lease_id not in self._leases:
                return lease_id

    def add(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        hid = lease.holder.id
        self._per_holder[hid] = self._per_holder.get(hid, 0) + 1
        if hid:
            self._ids_of.setdefault(hid, set()).add(lease.id)
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: str) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._forget(lease)
        return lease

    def expire(self, lease_id: str) -> Lease | None:
        """Remove a lease a command found past its deadline before the sweeper did (counted
        as expired, like those :meth:`take_expired` returns)."""
        lease = self.pop(lease_id)
        if lease is not None:
            self.expired += 1
        return lease

    def _forget(self, lease: Lease) -> None:
        hid = lease.holder.id
        ids = self._ids_of.get(hid)
        if ids is not None:
            ids.discard(lease.id)
            if not ids:
                del self._ids_of[hid]
        left = self._per_holder.get(hid, 0) - 1
        if left > 0:
            self._per_holder[hid] = left
        else:
            self._per_holder.pop(hid, None)

    def take_gone(self) -> list[Lease]:
        """Remove and return the leases of holders whose connection is closed: nobody can
        commit, abort or release them any more, and nobody still touches their slots."""
        out: list[Lease] = []
        for ids in list(self._ids_of.values()):
            first = self._leases.get(next(iter(ids)))
            if first is None or first.holder.alive():
                continue
            for lease_id in list(ids):
                lease = self.pop(lease_id)
                if lease is not None:
                    out.append(lease)
        return out

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
                self._forget(lease)
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
        self._per_holder.clear()
        self._ids_of.clear()
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
    every_tick: Callable[[], object] | None = None,
) -> None:
    """End expired leases forever (cancel the task to stop), then call ``every_tick`` (the
    store ends the fences of holders that went away). A failing callback is logged and counted
    through ``on_error``; it never stops the sweeper."""
    while True:
        await asyncio.sleep(interval)
        if every_tick is not None:
            try:
                every_tick()
            except Exception as exc:
                log.exception("lease sweeper tick failed")
                if on_error is not None:
                    on_error(exc)
        for lease in table.take_expired():
            try:
                on_expired(lease)
            except Exception as exc:
                log.exception("ending expired lease %s failed", lease.id)
                if on_error is not None:
                    on_error(exc)
