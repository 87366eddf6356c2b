"""Write leases found and ended: the lookups of KV.COMMIT and KV.ABORT, and what ending one frees.

A mixin of :class:`~kvstrata.store.kvstore.write.WritePath`. A lease is found only for its
holder; an expired one is fenced as the sweeper does (``store.fences``) before it is refused.
Ending a lease aborts its slots (one of KV.RESERVE, each still reserved of KV.MRESERVE).
"""

from __future__ import annotations

from collections.abc import Collection

from kvstrata.protocol.errors import LeaseError
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.leases import NO_HOLDER, BatchWriteLease, Holder, ReadLease, WriteLease


class WriteLeases:
    """Mixin of ``WritePath``: its write leases looked up, taken and ended."""

    # state owned by WritePath
    state: StoreState

    def find_write_lease(
        self,
        lease_id: str,
        verb: str,
        holder: Holder = NO_HOLDER,
        indexes: Collection[int] | None = None,
    ) -> WriteLease | BatchWriteLease:
        """A live write lease (of KV.RESERVE or KV.MRESERVE) of ``holder`` for ``verb``, left
        in the table. Another holder's lease is refused like an unknown one. An expired one is
        fenced as the sweeper does (``store.fences``), then the fence of the slots at
        ``indexes`` (default all) ends, since the holder says it is done with them; refused."""
        leases = self.state.leases
        lease = leases.get(lease_id)
        if lease is None or lease.holder.id != holder.id:
            if self.state.fences.end(lease_id, holder, indexes):  # the late writer is done
                raise LeaseError(f"lease {lease_id} expired: nothing was committed")
            raise LeaseError(f"no such lease {lease_id!r} (unknown, ended or expired)")
        if isinstance(lease, ReadLease):
            raise LeaseError(f"lease {lease_id} is a read lease; {verb} needs a KV.RESERVE lease")
        if leases.is_expired(lease):
            leases.expire(lease_id)
            self.state.fences.fence_expired(lease, self.state.region_tier)
            self.end_write_lease(lease)
            self.state.fences.end(lease_id, holder, indexes)
            raise LeaseError(f"lease {lease_id} expired: nothing was committed")
        return lease

    def take_write_lease(
        self, lease_id: str, verb: str, holder: Holder = NO_HOLDER
    ) -> WriteLease | BatchWriteLease:
        """:meth:`find_write_lease`, removed from the table."""
        lease = self.find_write_lease(lease_id, verb, holder)
        self.state.leases.pop(lease_id)
        return lease

    def abort(self, lease_id: str, holder: Holder = NO_HOLDER) -> None:
        self.end_write_lease(self.take_write_lease(lease_id, "KV.ABORT", holder))

    def end_write_lease(self, lease: WriteLease | BatchWriteLease) -> None:
        if isinstance(lease, WriteLease):
            lease.sink.abort()
        else:
            for chunk in lease.chunks:
                chunk.sink.abort()
