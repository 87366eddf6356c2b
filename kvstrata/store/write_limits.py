"""Per-connection bounds of write leases: how long one may live and how much DRAM one
connection may hold through them.

A write lease (``KV.RESERVE``, ``KV.MRESERVE``) holds invisible DRAM slots that nothing can
evict. Without a bound one connection reserved 60 of 64 MiB for a day (``TTL 86400000``) and
every other writer got ``-OOM``. Two keys bound it, both read at each call (``CONFIG SET``
applies to the next reservation):

- ``write-lease-ttl-max`` (default 60 s): an explicit longer TTL is refused with
  ``-LEASELIMIT``; a default ``lease-ttl`` above it is cut to it. An engine writes a chunk in
  milliseconds to a few seconds (a GiB at PCIe or memcpy speed, plus a wait for DRAM room of at
  most ``write-wait-timeout``); a minute covers a slow GPU copy or a paused process with room to
  spare, and a holder that needs longer can commit what it wrote and reserve again. It is not
  made shorter because a lease that expires while its holder is connected keeps its slots
  fenced until the holder ends it (``store.fences``): a short cap would not free memory sooner,
  only fail slow writers.
- ``lease-reserve-max-per-client`` (default 50% of ``dram-capacity``): the bytes of live write
  lease slots one connection holds, counted in allocation units as the arena takes them;
  a reservation that would go past it is refused whole (nothing reserved) with ``-LEASELIMIT``,
  before any eviction. Half the arena leaves an engine room for several chains in flight
  while no single connection can take everything. Fenced slots of expired leases are bounded
  apart (``lease-fence-max``). In-process leases (``NO_HOLDER``) are not bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvstrata.config import share_or_size
from kvstrata.protocol.errors import LeaseLimitError
from kvstrata.store.leases import NO_HOLDER, BatchWriteLease, Holder, LeaseTable, WriteLease


def write_lease_ttl(values: dict[str, Any], ttl_ms: int | None) -> int:
    """The TTL of a new write lease: ``ttl_ms``, or ``lease-ttl`` cut to the cap; raises
    LeaseLimitError for an explicit TTL above ``write-lease-ttl-max``."""
    most = int(values["write-lease-ttl-max"])
    if ttl_ms is None:
        ttl = int(values["lease-ttl"])
        return min(ttl, most) if most else ttl
    if most and ttl_ms > most:
        raise LeaseLimitError(
            f"TTL {ttl_ms} ms is above write-lease-ttl-max ({most} ms): reserve with a shorter "
            "TTL, commit what is written and reserve again for the rest"
        )
    return ttl_ms


def reserved_by(leases: LeaseTable, holder: Holder, slot_size: Callable[[int], int]) -> int:
    """Bytes of the live write-lease slots ``holder`` holds, in allocation units."""
    total = 0
    for lease in leases.leases_of(holder):
        if isinstance(lease, WriteLease):
            total += slot_size(lease.size)
        elif isinstance(lease, BatchWriteLease):
            total += sum(slot_size(c.size) for c in lease.pending.values())
    return total


def admit_reserve(
    values: dict[str, Any],
    leases: LeaseTable,
    holder: Holder,
    sizes: Iterable[int],
    capacity: int,
    slot_size: Callable[[int], int],
) -> None:
    """Raise LeaseLimitError when slots of ``sizes`` would take ``holder``'s live reserved
    bytes past ``lease-reserve-max-per-client`` of an arena of ``capacity`` bytes."""
    most = share_or_size(values["lease-reserve-max-per-client"], capacity)
    if not most or holder is NO_HOLDER or not holder.id:
        return
    need = sum(slot_size(n) for n in sizes)
    held = reserved_by(leases, holder, slot_size)
    if held + need > most:
        leases.refused += 1
        raise LeaseLimitError(
            f"this connection holds {held} bytes of write-lease slots and asks for {need} more "
            f"(lease-reserve-max-per-client {most}): commit or abort its reservations first, "
            "or reserve fewer chunks at a time"
        )
