"""INFO behind the facade: a row per tier, and the sections ``tiers``, ``persistence``, ``prefetch``
and ``events`` that the server's INFO shows.

Functions of :class:`~kvstrata.store.kvstore.KVStore`'s ``stats`` and ``info_sections``; the
facade is named by :class:`Reported` (what these read of it), not imported.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvstrata.store.events import TierEvents
from kvstrata.store.kvstore.prefetch import PrefetchPath
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import Tier


class Reported(Protocol):
    """What :func:`info_sections` reads of the facade."""

    state: StoreState
    placement: Placement
    remote: RemotePath
    hints: PrefetchPath
    events: TierEvents | None
    gpu_status: str
    rebuild: dict[str, float]

    @property
    def tiers(self) -> list[Tier]: ...

    def stats(self) -> dict[str, dict[str, Any]]: ...


def tier_stats(state: StoreState, placement: Placement) -> dict[str, dict[str, Any]]:
    """``KVStore.stats``: a row per tier (capacity, use, counters, policy, the tier's info)."""
    out: dict[str, dict[str, Any]] = {}
    for tier in state.tiers:
        row: dict[str, Any] = {
            "capacity": tier.capacity,
            "used": tier.used,
            "chunks": state.index.count_in.get(tier.name, 0),
            "bytes": state.index.bytes_in.get(tier.name, 0),
        }
        row.update(state.counters[tier.name].as_dict())
        row["integrity_errors"] = tier.stats.integrity_errors
        pol = placement.policy(tier.name)
        row["write_policy"] = "write-through" if pol.write_through else "write-back"
        for k, v in tier.info().items():
            row.setdefault(k, v)
        out[tier.name] = row
    return out


def info_sections(store: Reported) -> dict[str, list[tuple[str, object]]]:
    """``KVStore.info_sections``: the store's INFO sections, by name."""
    tiers: list[tuple[str, object]] = [
        ("tiers", ",".join(t.name for t in store.tiers)),
        ("gpu_status", store.gpu_status),
    ]
    for name, row in store.stats().items():
        tiers.extend((f"{name}_{k}", v) for k, v in row.items()
                     if isinstance(v, int | float | str))  # fmt: skip
    tiers += [
        ("kv_chunks", len(store.state.index)),
        ("kv_leases", len(store.state.leases)),
        ("kv_leases_expired", store.state.leases.expired),
        ("kv_leases_refused", store.state.leases.refused),
        ("kv_leased_bytes", store.state.leases.pinned_bytes()),
        ("kv_fenced_leases", len(store.state.fences)),
        ("kv_fenced_bytes", store.state.fences.nbytes),
        ("kv_fenced_total", store.state.fences.fenced_total),
        ("kv_integrity_errors", store.state.integrity_errors),
        ("kv_digest_failures", store.state.digest_failures),
        ("kv_digest_refused", store.state.digest_refused),
        ("kv_store_errors", store.state.errors),
        ("kv_write_waiting", len(store.placement.room)),
        ("kv_write_waited", store.placement.room.waited),
        ("kv_write_wait_timeouts", store.placement.room.timeouts),
        ("kv_moves_in_flight", len(store.state.moves)),
    ]
    persistence: list[tuple[str, object]] = [
        (f"rebuild_{k}", round(v, 3) if isinstance(v, float) else v)
        for k, v in store.rebuild.items()
    ]
    tiers += store.remote.info()
    return {
        "tiers": tiers,
        "persistence": persistence,
        "prefetch": store.hints.info(),
        "events": store.events.info() if store.events is not None else [("kv_events", 0)],
    }
