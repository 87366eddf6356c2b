"""Start-up: index what the local persistent tiers hold (``KVStore.start``).

The shared tier (s3) is not scanned: other nodes write there too and its chunks are found on
demand by lookups. A chunk found in several tiers gets one record resident in each; a copy
whose checksum disagrees with the record already built is stale and deleted. A tier whose scan
fails is logged and counted; start-up goes on with what was found. The counts land in the
``persistence`` section of INFO (``rebuild_*``).
"""

from __future__ import annotations

import logging
import time

from kvstrata.store.index import record_from_meta
from kvstrata.store.kvstore.state import StoreState, is_internal, is_shared
from kvstrata.tiers.base import Tier

log = logging.getLogger("kvstrata.store")


def empty_report() -> dict[str, float]:
    """The counters :func:`rebuild_index` fills."""
    return {"chunks": 0, "bytes": 0, "seconds": 0.0, "quarantined": 0, "errors": 0}


async def rebuild_index(state: StoreState, report: dict[str, float]) -> None:
    """Index every local persistent tier of ``state``, adding the counts to ``report``."""
    started = time.perf_counter()
    for tier in state.tiers:
        if not tier.persistent or is_shared(tier):
            continue
        try:
            await _rebuild_from(state, tier, report)
        except Exception:
            report["errors"] += 1
            state.errors += 1
            state.counters[tier.name].errors += 1
            log.exception("rebuilding the index from %s failed; starting without it", tier.name)
    report["seconds"] = time.perf_counter() - started


async def _rebuild_from(state: StoreState, tier: Tier, report: dict[str, float]) -> None:
    found = 0
    last_log = time.monotonic()
    async for meta in tier.scan():
        if time.monotonic() - last_log >= 1.0:
            last_log = time.monotonic()
            log.info("rebuilding the index from %s: %d chunks so far", tier.name, found)
        if is_internal(meta.key):  # a plain value of a previous run: its key is gone
            state.spawn(tier.delete(meta.key), f"delete leftover {meta.key.hex[:16]}")
            continue
        rec = state.index.get(meta.key)
        if rec is None:
            rec = record_from_meta(meta)
            rec.tiers = {tier.name}
            state.publish(rec)
            report["chunks"] += 1
            report["bytes"] += meta.size
        elif rec.checksum == meta.checksum:
            state.index.add_tier(rec, tier.name)
        else:
            log.warning("%s holds a stale copy of %s; deleting it", tier.name, meta.key.hex)
            state.spawn(tier.delete(meta.key), f"delete stale {meta.key.hex[:16]}")
        found += 1
    tier_report = getattr(tier, "rebuild_report", None)
    quarantined = getattr(tier_report, "quarantined", 0) if tier_report is not None else 0
    if isinstance(tier_report, dict):
        quarantined = tier_report.get("quarantined", 0)
    report["quarantined"] += (
        len(quarantined) if isinstance(quarantined, list | tuple | set) else quarantined
    )
    log.info("rebuilt %d chunks from %s", found, tier.name)
