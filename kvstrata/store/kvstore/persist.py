"""Planned shutdown: write the chunks that only memory tiers hold to the local disk tier.

On ``SHUTDOWN`` (``SAVE`` or no argument), SIGTERM and SIGINT the store copies every live chunk
that is in the GPU pool or the DRAM arena but not yet on the NVMe tier to NVMe, hottest first,
so that a restart finds it again (the index is rebuilt from NVMe at start). The save is bounded
by a time budget (``shutdown-timeout``): when it runs out, the chunks not written yet are lost
like after ``SHUTDOWN NOSAVE``, and the log says how many. A progress line is logged about
every second. Without an NVMe tier nothing can be saved: the log says how many chunks are lost.

Chunks already on NVMe (``nvme-write-policy write-through``, or demoted earlier) cost nothing.
NVMe writes follow ``nvme-fsync``: the chunk is power-loss durable when its put returns, except
with ``never`` (then it survives the restart, not a power cut right after it). TTLs are not
kept on NVMe (see ``docs/tiers.md``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvstrata.store.index import ChunkRecord
from kvstrata.store.keyspace import now_ms
from kvstrata.store.kvstore.state import StoreState, is_internal, is_shared
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import MemoryTier, TierError

log = logging.getLogger("kvstrata.store")

SAVE_WORKERS = 4


@dataclass(frozen=True, slots=True)
class SaveReport:
    """What a shutdown save did (also logged)."""

    wanted: int  # chunks only in memory tiers when the save started
    saved: int
    failed: int
    nbytes: int  # bytes written
    seconds: float
    timed_out: bool
    tier: str  # the disk tier written, "" when there is none


def memory_only(state: StoreState, disk: str) -> list[ChunkRecord]:
    """Live, unexpired chunks held by a memory tier and not by ``disk``, hottest first (large plain
    values are internal chunks whose keys do not survive a restart: they are not saved)."""
    memory = {t.name for t in state.tiers if isinstance(t, MemoryTier)}
    now = now_ms()
    out = [
        rec for rec in state.index
        if rec.alive and disk not in rec.tiers and rec.tiers & memory and not is_internal(rec.key)
        and (rec.expire_at is None or rec.expire_at > now)
    ]  # fmt: skip
    out.sort(key=lambda r: r.last_access, reverse=True)
    return out


def _size(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


async def save_to_disk(state: StoreState, placement: Placement, budget: float) -> SaveReport:
    """Copy memory-only chunks to the first local persistent tier within ``budget`` seconds."""
    started = time.monotonic()
    disk = next((t for t in state.tiers if t.persistent and not is_shared(t)), None)
    if disk is None:
        todo = memory_only(state, "")
        log.warning(
            "shutdown: no NVMe tier (nvme-capacity 0): %d chunks (%s) held in memory are not "
            "saved and will be gone after a restart", len(todo), _size(sum(r.size for r in todo))
        )  # fmt: skip
        return SaveReport(len(todo), 0, 0, 0, 0.0, False, "")
    todo = memory_only(state, disk.name)
    total = sum(r.size for r in todo)
    if not todo:
        log.info("shutdown: every chunk is already on %s", disk.name)
        return SaveReport(0, 0, 0, 0, 0.0, False, disk.name)
    log.info("shutdown: saving %d chunks (%s) from memory to %s (at most %g s)",
             len(todo), _size(total), disk.name, budget)  # fmt: skip
    saver = _Saver(state, placement, state.tier_index(disk.name), started + budget)
    progress = asyncio.ensure_future(saver.report_progress(len(todo), total))
    queue = iter(todo)
    try:
        await asyncio.gather(*(saver.work(queue) for _ in range(SAVE_WORKERS)))
    finally:
        progress.cancel()
    seconds = time.monotonic() - started
    left = len(todo) - saver.saved - saver.failed
    report = SaveReport(len(todo), saver.saved, saver.failed, saver.nbytes, seconds, left > 0,
                        disk.name)  # fmt: skip
    log.info("shutdown: saved %d of %d chunks (%s) to %s in %.2f s", saver.saved, len(todo),
             _size(saver.nbytes), disk.name, seconds)  # fmt: skip
    if saver.failed:
        log.warning("shutdown: %d chunks could not be saved (see the errors above)", saver.failed)
    if left:
        log.warning("shutdown: shutdown-timeout (%g s) ran out: %d chunks not saved", budget, left)
    return report


class _Saver:
    """Workers pulling chunks from one iterator until it is empty or the deadline passes."""

    def __init__(self, state: StoreState, placement: Placement, disk: int, deadline: float):
        self.state = state
        self.placement = placement
        self.disk = disk
        self.deadline = deadline
        self.saved = self.failed = self.nbytes = 0

    async def work(self, queue: Iterator[ChunkRecord]) -> None:
        while time.monotonic() < self.deadline:
            rec = next(queue, None)
            if rec is None:
                return
            if await self.save(rec):
                self.saved += 1
                self.nbytes += rec.size
            else:
                self.failed += 1

    async def save(self, rec: ChunkRecord) -> bool:
        state = self.state
        disk = state.tiers[self.disk]
        if not state.begin_move(rec):
            return False
        try:
            src = next(t for t in state.tiers if t.name in rec.tiers and t is not disk)
            data = await self.placement.read_copy(rec, src)
            if data is None:
                return False
            await self.placement.put_with_room(self.disk, rec.meta(), data)
            state.index.add_tier(rec, disk.name)
            state.counters[disk.name].bytes_in += rec.size
            return True
        except TierError as exc:
            state.tier_error(disk.name, f"shutdown save of {rec.key.hex[:16]}", exc)
            return False
        finally:
            state.end_move(rec)

    async def report_progress(self, count: int, total: int) -> None:
        while True:
            await asyncio.sleep(1.0)
            log.info("shutdown: saved %d of %d chunks (%s of %s)", self.saved, count,
                     _size(self.nbytes), _size(total))  # fmt: skip
