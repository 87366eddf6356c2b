"""Fences: slots of expired leases that their holder may still touch are not reused.

A lease hands a client raw access to a slot of a shared region (a view of the DRAM arena, a
CUDA IPC view of the GPU pool). The server cannot revoke such a view. When a lease expires while
the connection that took it is still open, the holder may still read the slot (a read lease) or
write into it (a write lease). Reusing the slot at once would show that reader another chunk's
bytes, or let that writer corrupt another chunk. So the store *fences* the lease's slots: each
slot is held in its tier (:meth:`~kvstrata.tiers.arena.ArenaTier.hold`), so that deleting,
evicting or replacing its chunk, or aborting its reservation, gives the memory back only when
the fence ends. The chunk itself is unpinned and may leave the index meanwhile.

A lease is fenced when it is found expired with its holder still connected, by the sweeper or
by a command of that holder that names it (whichever comes first; the same :meth:`fence_expired`
either way), never merely ended. A fence is per slot:

- A batch write lease (``KV.MRESERVE``) fences the slots still reserved when it expired, each
  under its request position. A slot published before the expiry (``KV.COMMIT lease i`` that
  answered OK) is not fenced: it is the stored chunk's now, and the holder must not touch its
  view any more (it may be evicted and reused like any chunk's slot).
- ``KV.COMMIT lease i…`` of an expired batch ends the fence of the named slots only: the holder
  is done with those, maybe not with the others it is still filling. ``KV.COMMIT lease`` (no
  index), ``KV.ABORT`` and ``KV.RELEASE`` end the whole fence. Each answers ``-NOLEASE …
  expired``; nothing is ever published from an expired lease.
- A fence ends entirely when its holder's connection is gone (checked on every sweep of the
  lease table, which also ends the gone holder's live leases), and at shutdown.

A fence belongs to its holder like the lease did: another connection naming its id is answered
as for an unknown id, and ends nothing. What one connection may hold this way is bounded by
``lease-fence-max`` bytes: past it, that connection's new ``KV.LEASE``/``KV.RESERVE`` are refused
with ``-LEASELIMIT`` until it ends its fences.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from kvstrata.protocol.errors import LeaseLimitError
from kvstrata.store.leases import BatchWriteLease, Holder, Lease, WriteLease
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import Handle

log = logging.getLogger("kvstrata.store")


@dataclass(frozen=True, slots=True)
class FencedSlot:
    """One held slot: ``length`` bytes at ``offset`` in ``tier``; ``index`` is its position in
    the lease (a batch's request position, a read lease's chunk, 0 for a single reservation)."""

    tier: ArenaTier
    offset: int
    length: int
    index: int = 0


@dataclass(frozen=True, slots=True)
class Fence:
    """The slots of one expired lease, held for ``holder``."""

    lease_id: str
    holder: Holder
    slots: tuple[FencedSlot, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.slots)


class FenceTable:
    """Fences by lease id and bytes fenced per holder; ``max_bytes`` (0: unbounded) is the
    most one holder may have fenced before its new leases are refused."""

    def __init__(self, max_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self._fences: dict[str, Fence] = {}
        self._bytes: dict[int, int] = {}
        self.fenced_total = 0  # fences ever made (INFO)

    def __len__(self) -> int:
        return len(self._fences)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._fences

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def bytes_of(self, holder: Holder) -> int:
        return self._bytes.get(holder.id, 0)

    def add(self, lease_id: str, holder: Holder, slots: Iterable[FencedSlot]) -> Fence:
        """Hold ``slots`` (allocated now) until :meth:`end` or the holder is gone."""
        fence = Fence(lease_id, holder, tuple(slots))
        for slot in fence.slots:
            slot.tier.hold(slot.offset)
        self._fences[lease_id] = fence
        self._bytes[holder.id] = self._bytes.get(holder.id, 0) + fence.nbytes
        self.fenced_total += 1
        return fence

    def fence_expired(self, lease: Lease, tier_of: Callable[[Handle], ArenaTier]) -> bool:
        """Called for a lease that just expired, before it ends: fence its slots (those still
        reserved, for a batch) when its holder is still connected (True), else nothing to do
        (False)."""
        if not lease.holder.alive():
            return False
        if isinstance(lease, BatchWriteLease):
            slots = [(i, c.handle) for i, c in lease.pending.items()]
        elif isinstance(lease, WriteLease):
            slots = [(0, lease.handle)]
        else:
            slots = list(enumerate(lease.handles))
        fenced = [FencedSlot(tier_of(h), h.offset, h.length, i) for i, h in slots]
        self.add(lease.id, lease.holder, fenced)
        return True

    def end(self, lease_id: str, holder: Holder, indexes: Collection[int] | None = None) -> bool:
        """``holder`` is done with (the slots at ``indexes`` of, default all of) its expired
        lease ``lease_id``: end their fence. False when ``holder`` has no fence of that id."""
        fence = self._fences.get(lease_id)
        if fence is None or fence.holder.id != holder.id:
            return False
        kept: tuple[FencedSlot, ...] = ()
        done = fence.slots
        if indexes is not None:
            done = tuple(s for s in fence.slots if s.index in indexes)
            kept = tuple(s for s in fence.slots if s.index not in indexes)
        if kept:
            self._fences[lease_id] = Fence(lease_id, fence.holder, kept)
        else:
            del self._fences[lease_id]
        self._unhold(fence.holder, done)
        return True

    def _unhold(self, holder: Holder, slots: tuple[FencedSlot, ...]) -> None:
        left = self._bytes.get(holder.id, 0) - sum(s.length for s in slots)
        if left > 0:
            self._bytes[holder.id] = left
        else:
            self._bytes.pop(holder.id, None)
        for slot in slots:
            slot.tier.unhold(slot.offset)

    def end_gone(self) -> int:
        """End the fences of holders whose connection is closed; how many ended."""
        gone = [f for f in self._fences.values() if not f.holder.alive()]
        for fence in gone:
            self.end(fence.lease_id, fence.holder)
        return len(gone)

    def end_all(self) -> None:
        for fence in list(self._fences.values()):
            self.end(fence.lease_id, fence.holder)

    def admit(self, holder: Holder) -> None:
        """Raise LeaseLimitError when ``holder`` has more than ``max_bytes`` fenced."""
        held = self.bytes_of(holder)
        if self.max_bytes and held > self.max_bytes:
            raise LeaseLimitError(
                f"this connection holds {held} bytes through expired leases (lease-fence-max "
                f"{self.max_bytes}): KV.RELEASE/KV.ABORT them, or reconnect"
            )
