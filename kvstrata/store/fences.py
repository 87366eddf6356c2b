"""Fences: slots of expired leases that their holder may still touch are not reused.

A lease hands a client raw access to a slot of a shared region (a view of the DRAM arena, a
CUDA IPC view of the GPU pool). The server cannot revoke such a view. When a lease expires while
the connection that took it is still open, the holder may still read the slot (a read lease) or
write into it (a write lease). Reusing the slot at once would show that reader another chunk's
bytes, or let that writer corrupt another chunk. So the store *fences* the lease's slots: each
slot is held in its tier (:meth:`~kvstrata.tiers.arena.ArenaTier.hold`), so that deleting,
evicting or replacing its chunk, or aborting its reservation, gives the memory back only when
the fence ends. The chunk itself is unpinned and may leave the index meanwhile.

A fence ends when the holder says it is done with the expired lease (``KV.RELEASE``,
``KV.COMMIT`` or ``KV.ABORT`` of its id, each answered ``-NOLEASE … expired``), or when its
connection is gone (checked on every sweep of the lease table). What one connection may hold
this way is bounded by ``lease-fence-max`` bytes: past it, that connection's new
``KV.LEASE``/``KV.RESERVE`` are refused with ``-LEASELIMIT`` until it ends its fences.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstrata.protocol.errors import LeaseLimitError
from kvstrata.store.leases import Holder, Lease, WriteLease
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import Handle

log = logging.getLogger("kvstrata.store")


@dataclass(frozen=True, slots=True)
class FencedSlot:
    """One held slot: ``length`` bytes at ``offset`` in ``tier``."""

    tier: ArenaTier
    offset: int
    length: int


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
        """Called for a lease that just expired, before it ends: fence its slots when its
        holder is still connected (True), else nothing to do (False)."""
        if not lease.holder.alive():
            return False
        handles = (lease.handle,) if isinstance(lease, WriteLease) else lease.handles
        self.add(
            lease.id, lease.holder, [FencedSlot(tier_of(h), h.offset, h.length) for h in handles]
        )
        return True

    def end(self, lease_id: str) -> bool:
        """End one fence (the holder is done with the expired lease); False if none."""
        fence = self._fences.pop(lease_id, None)
        if fence is None:
            return False
        left = self._bytes.get(fence.holder.id, 0) - fence.nbytes
        if left > 0:
            self._bytes[fence.holder.id] = left
        else:
            self._bytes.pop(fence.holder.id, None)
        for slot in fence.slots:
            slot.tier.unhold(slot.offset)
        return True

    def end_gone(self) -> int:
        """End the fences of holders whose connection is closed; how many ended."""
        gone = [f.lease_id for f in self._fences.values() if not f.holder.alive()]
        for lease_id in gone:
            self.end(lease_id)
        return len(gone)

    def end_all(self) -> None:
        for lease_id in list(self._fences):
            self.end(lease_id)

    def admit(self, holder: Holder) -> None:
        """Raise LeaseLimitError when ``holder`` has more than ``max_bytes`` fenced."""
        held = self.bytes_of(holder)
        if self.max_bytes and held > self.max_bytes:
            raise LeaseLimitError(
                f"this connection holds {held} bytes through expired leases (lease-fence-max "
                f"{self.max_bytes}): KV.RELEASE/KV.ABORT them, or reconnect"
            )
