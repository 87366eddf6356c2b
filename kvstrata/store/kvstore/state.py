"""Shared state of the KV store: tiers, index, counters, pins, key ownership, background tasks.

The store's modules (placement, the read and write paths, the facade) all work on one
:class:`StoreState`. Bookkeeping is synchronous; only tier I/O is awaited.

Key ownership — why no torn or lost chunk can appear although tier I/O is awaited:

- At most one *record object* owns a key's copies in the tiers at any time: the live record,
  or a *retired* one (deleted, replaced or expired) whose copies are still being freed.
- A **writer** (a PUT in flight, a reserved payload sink, a write lease) claims the key in
  ``writers`` before it reserves or writes anything, and only while no live or retired record
  exists (a replacing PUT retires the old record first and waits for its copies to be freed).
  Other writers of the key wait for the claim to end (async PUT) or get ``None``/``BUSY``
  (synchronous reservations).
- A **mover** (promotion, demotion, eviction) flags the live record ``moving`` and pins it;
  at most one mover per record. A retired record is freed only once it is unpinned and not
  moving, so no copy disappears under a reader, a lease or a mover.

These are ownership markers, not locks: each operation owns at most one key at a time, and
no waiter holds anything, so there is no lock order and no deadlock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from kvstrata.chunks import ChunkKey
from kvstrata.config import Config
from kvstrata.protocol.errors import BusyError
from kvstrata.store.fences import FenceTable
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.keyspace import Entry, Keyspace, now_ms
from kvstrata.store.leases import Holder, LeaseTable
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import Handle, MemoryTier, Tier, TierError
from kvstrata.tiers.gpu import GpuTier


class NotNow:
    """The answer needs tier I/O: call the async form of the operation."""

    __slots__ = ()


NOT_NOW = NotNow()

log = logging.getLogger("kvstrata.store")

#: Namespaces starting with this are the server's own (never valid for a client): their chunks
#: stay out of the keyspace and the shared tier, and are not kept across restarts.
INTERNAL_NS = "\0"
#: large plain string values (``store.strings``)
STRING_NS = "\0string"


def is_internal(key: ChunkKey) -> bool:
    return key.namespace.startswith(INTERNAL_NS)


#: Tier names in fast → slow order; unknown names sort after them in the given order.
TIER_ORDER = ("gpu", "dram", "nvme", "s3")


@dataclass(slots=True)
class TierCounters:
    """What the store counts per tier (KV.STATS, INFO tiers)."""

    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Tracer(Protocol):
    """Where placement-changing operations are reported (``serve --trace-file``: the recorder
    in ``kvstrata.tracefile``). The store calls it from its write, read and delete paths only,
    so every command that reaches those paths is recorded (STYLE rule 19)."""

    def record(self, op: str, ns: str, hashes: Sequence[bytes], **kw: Any) -> None: ...


def is_shared(tier: Tier) -> bool:
    """A tier shared by every node of a cluster (s3): never scanned at start, found on demand,
    and not a local copy (demotion still writes a local one below it)."""
    return bool(getattr(tier, "shared", False)) or tier.name == "s3"


def order_tiers(tiers: list[Tier]) -> list[Tier]:
    def rank(item: tuple[int, Tier]) -> tuple[int, int]:
        i, tier = item
        return (TIER_ORDER.index(tier.name) if tier.name in TIER_ORDER else len(TIER_ORDER), i)

    return [t for _, t in sorted(enumerate(tiers), key=rank)]


class StoreState:
    """See the module docstring."""

    def __init__(self, config: Config, keyspace: Keyspace, tiers: list[Tier]) -> None:
        self.config = config
        self.keyspace = keyspace
        self.tiers = order_tiers(tiers)
        self.by_name = {t.name: t for t in self.tiers}
        if len(self.by_name) != len(self.tiers):
            raise ValueError(f"two tiers share a name: {[t.name for t in self.tiers]}")
        dram = self.by_name.get("dram")
        self.dram: MemoryTier | None = dram if isinstance(dram, MemoryTier) else None
        gpu = self.by_name.get("gpu")
        #: the top tier (a device pool shared by CUDA IPC), or None without one
        self.gpu: GpuTier | None = gpu if isinstance(gpu, GpuTier) else None
        #: the cluster-wide tier (s3) consulted for chunks this node does not know, or None
        self.remote: Tier | None = next((t for t in self.tiers if is_shared(t)), None)
        self.index = ChunkIndex()
        self.counters = {t.name: TierCounters() for t in self.tiers}
        #: key → its writer's event, made only once someone waits for the key (``wait_key``):
        #: most claims end with nobody waiting, and an Event costs more than the claim itself
        self.writers: dict[ChunkKey, asyncio.Event | None] = {}
        self.retired: dict[ChunkKey, asyncio.Event] = {}
        self.moves: dict[ChunkKey, asyncio.Event] = {}
        self.freeing: set[ChunkKey] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.leases = LeaseTable()
        self.fences = FenceTable()
        #: region name → the tier whose slots its handles point into
        self.regions = {t.region_name: t for t in self.tiers if isinstance(t, ArenaTier)}
        self.errors = 0
        self.integrity_errors = 0
        #: of those, chunks whose checksum was a writer's unverified KV.COMMIT DIGEST
        self.digest_failures = 0
        #: commits refused because a DIGEST did not match bytes the commit hashed anyway
        self.digest_refused = 0
        #: the trace recorder (``trace-file``), None when off: see :meth:`trace`
        self.tracer: Tracer | None = None
        keyspace.register_type("kvchunk", self._on_keyspace_delete)

    # -- lookups ----------------------------------------------------------------------------

    def live(self, key: ChunkKey, now: int | None = None) -> ChunkRecord | None:
        """The committed, unexpired record of ``key`` (an expired one is deleted here)."""
        rec = self.index.get(key)
        if rec is None:
            return None
        if rec.expire_at is not None and rec.expire_at <= (now_ms() if now is None else now):
            self.keyspace.lookup(rec.redis_key())  # expires it: calls _on_keyspace_delete
            if rec.alive:  # not in the keyspace (should not happen): retire directly
                self.retire(rec)
            return None
        return rec

    def region_tier(self, handle: Handle) -> ArenaTier:
        return self.regions[handle.region]

    def admit_lease(self, holder: Holder) -> None:
        """Raise LeaseLimitError when ``holder`` may not take another lease now (lease-max,
        lease-max-per-client, lease-fence-max: read at each call, CONFIG SET applies)."""
        values = self.config.values
        self.leases.max_total = values["lease-max"]
        self.leases.max_per_holder = values["lease-max-per-client"]
        self.fences.max_bytes = values["lease-fence-max"]
        self.fences.admit(holder)
        self.leases.admit(holder)

    def tier_index(self, name: str) -> int:
        for i, tier in enumerate(self.tiers):
            if tier.name == name:
                return i
        raise KeyError(name)

    def key_busy(self, key: ChunkKey) -> bool:
        return key in self.writers or key in self.retired

    # -- errors and tasks -------------------------------------------------------------------

    def corrupt(
        self, rec: ChunkRecord, tier: str, what: str, exc: BaseException, tier_counted: bool
    ) -> None:
        """A copy of ``rec`` in ``tier`` failed its checksum: count an integrity error (in the
        tier's stats too unless the tier already did, ``tier_counted``) and drop the chunk from
        every tier (its copies are freed once nobody pins them). Never kept, never served."""
        self.integrity_errors += 1
        if not rec.verified:
            self.digest_failures += 1
        found = self.by_name.get(tier)
        if found is not None and not tier_counted:
            found.stats.integrity_errors += 1
        self.tier_error(tier, what, exc)
        log.error("chunk %s dropped from every tier: %s", rec.key.hex[:16], exc)
        self.retire(rec)

    async def drop_corrupt(
        self, rec: ChunkRecord, tier: str, what: str, exc: BaseException, tier_counted: bool
    ) -> None:
        """:meth:`corrupt`, and a bad copy outside memory tiers is deleted now rather than with
        the other copies (a memory copy may still be under a lease: it goes once unpinned). An
        object in a shared tier is never deleted on this node's finding: only forgotten."""
        found = self.by_name.get(tier)
        if found is not None and is_shared(found):
            self.index.drop_tier(rec, tier)
        self.corrupt(rec, tier, what, exc, tier_counted)
        if found is not None and not is_shared(found) and not isinstance(found, MemoryTier):
            await self.delete_copy(rec, tier)

    def tier_error(self, tier: str, what: str, exc: BaseException) -> None:
        self.errors += 1
        if tier in self.counters:
            self.counters[tier].errors += 1
        log.warning("%s on %s failed: %s: %s", what, tier, type(exc).__name__, exc)

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=what)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.errors += 1
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    async def drain(self) -> None:
        """Wait until every background task started so far (and their successors) is done."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    # -- pins, moves, writers ---------------------------------------------------------------

    def pin(self, rec: ChunkRecord) -> None:
        rec.pins += 1

    def unpin(self, rec: ChunkRecord) -> None:
        rec.pins -= 1
        if rec.pins < 0:
            log.error("chunk %s unpinned more often than pinned", rec.key.hex)
            rec.pins = 0
        if not rec.alive:
            self.maybe_free(rec)

    def begin_move(self, rec: ChunkRecord) -> bool:
        if rec.moving or not rec.alive:
            return False
        rec.moving = True
        rec.pins += 1
        self.moves[rec.key] = asyncio.Event()
        return True

    def end_move(self, rec: ChunkRecord) -> None:
        rec.moving = False
        event = self.moves.pop(rec.key, None)
        if event is not None:
            event.set()
        self.unpin(rec)

    async def wait_move(self, rec: ChunkRecord) -> None:
        event = self.moves.get(rec.key)
        if event is not None and rec.moving:
            await event.wait()

    def claim(self, key: ChunkKey) -> bool:
        """Become the key's writer (synchronous); False when it is owned by someone else."""
        if key in self.writers or key in self.retired:  # (key_busy, inlined: per chunk)
            return False
        self.writers[key] = None  # the Event comes with the first waiter (wait_key)
        return True

    def release_claim(self, key: ChunkKey) -> None:
        event = self.writers.pop(key, None)
        if event is not None:
            event.set()

    async def wait_key(self, key: ChunkKey, timeout: float | None = None) -> None:
        """Wait until no writer and no retired record owns ``key``; BusyError after
        ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if key in self.writers:
                        event = self.writers[key]
                        if event is None:
                            event = self.writers[key] = asyncio.Event()
                    else:
                        event = self.retired.get(key)
                        if event is None:
                            return
                    await event.wait()
        except TimeoutError:
            raise BusyError(f"chunk {key.hex} is being written or freed; retry") from None

    def trace(self, op: str, ns: str, hashes: Sequence[bytes], **kw: Any) -> None:
        """Report one placement-changing operation to the trace recorder (the server's own
        namespaces are not traced: the simulator knows only client chunks)."""
        if self.tracer is not None and not ns.startswith(INTERNAL_NS):
            self.tracer.record(op, ns, hashes, **kw)

    # -- creating and retiring records ------------------------------------------------------

    def publish(self, rec: ChunkRecord) -> None:
        """Make a committed record visible (index and keyspace)."""
        self.index.add(rec)
        if not is_internal(rec.key):
            self.keyspace.insert(rec.redis_key(), rec)

    def retire(self, rec: ChunkRecord) -> asyncio.Event | None:
        """Take a live record out of the index and keyspace; free its copies once unpinned.
        Returns the event set when its copies are gone (None if it was not live)."""
        if not rec.alive:
            return self.retired.get(rec.key)
        self.keyspace.remove(rec.redis_key())
        return self._retire_removed(rec)

    def _retire_removed(self, rec: ChunkRecord) -> asyncio.Event:
        # every way a live chunk is deleted passes here: KV.DEL, DEL/UNLINK, expiry by TTL,
        # FLUSHALL, a replacing PUT, a corrupt copy
        self.trace("del", rec.key.namespace, [rec.key.hash])
        self.index.remove(rec)
        event = asyncio.Event()
        self.retired[rec.key] = event
        self.maybe_free(rec)
        return event

    def _on_keyspace_delete(self, key: bytes, entry: Entry) -> None:
        """DEL/UNLINK/expiry/FLUSHALL of a ``kv:`` key: the keyspace already dropped it."""
        if isinstance(entry, ChunkRecord) and entry.alive:
            self._retire_removed(entry)

    def maybe_free(self, rec: ChunkRecord) -> None:
        if rec.alive or rec.pins or rec.moving or rec.key in self.freeing:
            return
        if rec.key not in self.retired:
            return
        self.freeing.add(rec.key)
        if not rec.tiers:
            self._freed(rec)
            return
        try:
            self.spawn(self._free(rec), f"free {rec.key.hex[:16]}")
        except RuntimeError:  # no running loop (interpreter shutdown): nothing to await
            self._freed(rec)

    async def _free(self, rec: ChunkRecord) -> None:
        try:
            for name in list(rec.tiers):
                await self.delete_copy(rec, name)
        finally:
            self._freed(rec)

    def _freed(self, rec: ChunkRecord) -> None:
        self.freeing.discard(rec.key)
        event = self.retired.get(rec.key)
        if event is not None and not event.is_set():
            del self.retired[rec.key]
            event.set()

    async def delete_copy(self, rec: ChunkRecord, name: str) -> bool:
        """Drop ``rec``'s copy in tier ``name`` (index first, then the medium)."""
        self.index.drop_tier(rec, name)
        tier = self.by_name.get(name)
        if tier is None:
            return False
        try:
            return await tier.delete(rec.key)
        except TierError as exc:
            self.tier_error(name, f"delete {rec.key.hex[:16]}", exc)
            return False

    def drop_if_gone(self, rec: ChunkRecord) -> None:
        """A live record left in no tier is removed (its chunk is no longer cached)."""
        if rec.alive and not rec.tiers:
            self.keyspace.remove(rec.redis_key())
            self.index.remove(rec)

    def now(self) -> float:
        return time.monotonic()
