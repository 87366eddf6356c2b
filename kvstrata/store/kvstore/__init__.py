"""KVStore: the facade the KV.* commands call.

It ties together the index (``index``), leases (``leases``), placement and eviction
(``placement``), the write path (``kvstore.write``), the read path (``kvstore.read``) and the
moves into the GPU tier (``kvstore.gpu``) over the configured tiers (``kvstore.build``),
ordered fast → slow. Bookkeeping is synchronous on the event loop; only tier I/O is awaited,
and no lock is held across an await (key ownership is described in ``kvstore.state``). The
index queries are ``kvstore.query``'s, INFO's rows and sections ``kvstore.info``'s.

Lifecycle: ``await KVStore.from_config(config, keyspace)`` (or ``KVStore(config, keyspace,
tiers)``), then ``await store.start()`` (rebuilds the index from the local persistent tiers,
see ``kvstore.rebuild``; starts the lease sweeper, the demoter and the prefetch workers) and
finally ``await store.close()`` (``close(save_budget=s)`` first writes the chunks only memory
tiers hold to NVMe, see ``kvstore.persist``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from kvstrata.chunks import ChunkKey
from kvstrata.config import Config
from kvstrata.store.events import EventSink, TierEvents
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.keyspace import Keyspace
from kvstrata.store.kvstore import query
from kvstrata.store.kvstore.batch import (
    BatchItem,
    BatchReservation,
    check_batch,
    commit_lease,
    reserve_batch,
    slot_unit,
)
from kvstrata.store.kvstore.build import build_tiers, status_of
from kvstrata.store.kvstore.gpu import GpuPath
from kvstrata.store.kvstore.info import info_sections, tier_stats
from kvstrata.store.kvstore.persist import SaveReport, save_to_disk
from kvstrata.store.kvstore.prefetch import PrefetchPath
from kvstrata.store.kvstore.read import Payload, ReadPath
from kvstrata.store.kvstore.rebuild import empty_report, rebuild_index
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.sink import StoreSink
from kvstrata.store.kvstore.state import NOT_NOW, NotNow, StoreState, is_internal
from kvstrata.store.kvstore.write import WritePath
from kvstrata.store.leases import (
    NO_HOLDER,
    Holder,
    Lease,
    LeaseTable,
    ReadLease,
    WriteLease,
    run_sweeper,
)
from kvstrata.store.placement import Placement
from kvstrata.store.write_limits import admit_reserve, write_lease_ttl
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import MemoryTier, Region, Tier
from kvstrata.tiers.dram import STALE_AFTER_SECONDS, DramTier

log = logging.getLogger("kvstrata.store")

__all__ = ["NOT_NOW", "KVStore", "NotNow", "Payload", "StoreSink"]


class KVStore:
    """See the module docstring."""

    def __init__(
        self,
        config: Config,
        keyspace: Keyspace,
        tiers: list[Tier],
        gpu_status: str = "",
        events: EventSink | None = None,
    ) -> None:
        self.config = config
        self.keyspace = keyspace
        self.state = StoreState(config, keyspace, tiers)
        #: the tier events routers follow (``store.events``), None without kv-events-endpoint
        self.events = self._follow(events) if events is not None else None
        #: one line for INFO tiers: why there is or is not a gpu tier
        self.gpu_status = gpu_status or status_of(tiers, int(config.gpu_device))
        self.placement = Placement(self.state)
        self.gpu = GpuPath(self.state, self.placement) if self.state.gpu is not None else None
        self.writes = WritePath(self.state, self.placement, self.gpu)
        self.remote = RemotePath(self.state)
        self.placement.on_replaced = self.remote.replaced
        self.reads = ReadPath(self.state, self.placement, self.remote, self.gpu)
        self.hints = PrefetchPath(self.state, self.placement, self.reads, self.remote, self.gpu)
        self.rebuild = empty_report()  # what start() found in the local persistent tiers
        self._background: list[asyncio.Task[Any]] = []

    def _follow(self, sink: EventSink) -> TierEvents:
        events = TierEvents(sink, int(self.config.chunk_tokens), is_internal)
        self.state.index.on_residency = events.residency
        self.keyspace.flush_hooks.append(events.flushing)
        return events

    @property
    def tiers(self) -> list[Tier]:
        return self.state.tiers

    @property
    def index(self) -> ChunkIndex:
        return self.state.index

    @property
    def leases(self) -> LeaseTable:
        return self.state.leases

    @classmethod
    async def from_config(
        cls, config: Config, keyspace: Keyspace, events: EventSink | None = None
    ) -> KVStore:
        """Build the tiers the configuration asks for (gpu when gpu-capacity > 0, dram always,
        nvme when nvme-capacity > 0, s3 when s3-bucket is set; see ``kvstore.build``) and
        return an un-started store. Raises TierUnavailable (e.g. a gpu tier without CUDA)."""
        tiers, status = await build_tiers(config)
        return cls(config, keyspace, tiers, status, events)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Prepare the tiers (starts the dram warm-up, which runs on in the background), rebuild
        the index, start background work."""
        for tier in self.state.tiers:
            await tier.prepare()
        await rebuild_index(self.state, self.rebuild)
        state = self.state
        self._background = [
            asyncio.get_running_loop().create_task(
                run_sweeper(
                    state.leases,
                    self._expire_lease,
                    0.1,
                    self._sweep_error,
                    self._end_gone,
                ),
                name="kv lease sweeper",
            ),
            asyncio.get_running_loop().create_task(
                self.placement.run_demoter(0.05), name="kv demoter"
            ),
            asyncio.get_running_loop().create_task(self.hints.prefetch.run(), name="kv prefetch"),
            asyncio.get_running_loop().create_task(self._reclaim_later(), name="kv reclaim"),
        ]

    async def _reclaim_later(self) -> None:
        """Once segments of a predecessor killed just before our start are old enough to be
        told from a server still starting, unlink them (see ``tiers.dram``)."""
        await asyncio.sleep(STALE_AFTER_SECONDS + 1)
        for tier in self.state.tiers:
            if isinstance(tier, DramTier):
                tier.reclaim_stale()

    async def close(self, save_budget: float | None = None) -> SaveReport | None:
        """Stop background work, end leases and close the tiers. With ``save_budget`` (seconds)
        the chunks only memory tiers hold are first written to NVMe (a planned restart)."""
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background = []
        await self.placement.room.close()
        for lease in self.state.leases.take_all():
            self._end_lease(lease)
        self.state.fences.end_all()
        await self.state.drain()
        report = None
        if save_budget is not None:
            try:
                report = await save_to_disk(self.state, self.placement, save_budget)
            except Exception:
                log.exception("saving the memory tiers on shutdown failed")
            await self.state.drain()
        for tier in self.state.tiers:
            try:
                await tier.close()
            except Exception:
                log.exception("closing tier %s failed", tier.name)
        return report

    def _expire_lease(self, lease: Lease) -> None:
        """The sweeper's callback. A holder whose connection is still open may still touch the
        lease's slots: fence them (``store.fences``) before the lease ends, so they are not
        reused until it releases the lease or disconnects."""
        self.state.fences.fence_expired(lease, self.state.region_tier)
        self._end_lease(lease)

    def _end_gone(self) -> None:
        """Every sweep: end the leases and fences of connections that closed (a crashed or
        disconnected engine gives its reserved and pinned memory back at once, not at TTL)."""
        for lease in self.state.leases.take_gone():
            self._end_lease(lease)
        self.state.fences.end_gone()

    def _end_lease(self, lease: Lease) -> None:
        if isinstance(lease, ReadLease):
            self.reads.end_read_lease(lease)
        else:
            self.writes.end_write_lease(lease)

    def _sweep_error(self, exc: BaseException) -> None:
        self.state.errors += 1

    async def drain(self) -> None:
        """Wait for background frees and tier deletes started so far (tests, shutdown)."""
        await self.state.drain()

    # -- writes ------------------------------------------------------------------------------------

    def reserve_put(self, ns: str, hash: bytes, parent: bytes, nbytes: int) -> StoreSink | None:
        return self.writes.reserve_put(ns, hash, parent, nbytes)

    async def put(
        self,
        ns: str,
        hash: bytes,
        parent: bytes,
        payload: Any,
        tokens: int = 0,
        ttl_ms: int | None = None,
        nx: bool = False,
        sink: Any = None,
    ) -> bool:
        return await self.writes.put(ns, hash, parent, payload, tokens, ttl_ms, nx, sink)

    def put_sink_now(
        self, ns: str, hash: bytes, parent: bytes, tokens: int, ttl_ms: int | None, sink: Any
    ) -> bool | NotNow:
        """Publish a payload received into its DRAM slot (``reserve_put``) without awaiting;
        NOT_NOW when a write-through tier must take it first (use :meth:`put`)."""
        return self.writes.put_sink_now(ns, hash, parent, tokens, ttl_ms, sink)

    async def reserve(
        self, ns: str, hash: bytes, parent: bytes, nbytes: int, tokens: int = 0,
        ttl_ms: int | None = None, tier: str | None = None, holder: Holder = NO_HOLDER,
    ) -> WriteLease:  # fmt: skip
        """KV.RESERVE: a slot in DRAM, or in the GPU pool with ``tier="gpu"``."""
        self.writes.check_slot_size(nbytes, tier)
        ttl = write_lease_ttl(self.config.values, ttl_ms)
        self.state.admit_lease(holder)
        self._admit_reserve(holder, [nbytes])
        return await self.writes.reserve(ns, hash, parent, nbytes, tokens, ttl, tier, holder)

    async def reserve_batch(
        self, ns: str, parent: bytes, items: Sequence[BatchItem], tokens: int = 0,
        ttl_ms: int | None = None, tier: str | None = None, holder: Holder = NO_HOLDER,
    ) -> BatchReservation:  # fmt: skip
        """KV.MRESERVE: slots for the chunks of a chain under one lease (``kvstore.batch``)."""
        ttl = write_lease_ttl(self.config.values, ttl_ms)
        check_batch(items, parent, self.writes.slot_limit(tier), slot_unit(self.writes))
        keys = [ChunkKey(ns, item.hash) for item in items]  # made once, for every step
        link, index = parent, self.state.index
        for item, key in zip(items, keys, strict=True):
            query.check_link(index, ns, item.hash, link, key)
            link = item.hash
        self.state.admit_lease(holder)
        self._admit_reserve(holder, [item.nbytes for item in items])
        return await reserve_batch(
            self.writes, ns, parent, items, tokens, ttl, tier, holder, keys=keys
        )

    def _admit_reserve(self, holder: Holder, sizes: list[int]) -> None:
        """-LEASELIMIT past lease-reserve-max-per-client (``write_limits``)."""
        dram = self.state.dram
        if isinstance(dram, ArenaTier):
            admit_reserve(
                self.config.values, self.state.leases, holder, sizes, dram.capacity,
                dram.slot_size,
            )  # fmt: skip

    async def commit(
        self,
        lease_id: str,
        indexes: Sequence[int] = (),
        holder: Holder = NO_HOLDER,
        digests: Sequence[bytes | None] = (),
    ) -> None:
        """KV.COMMIT of ``holder``'s KV.RESERVE or KV.MRESERVE lease; with ``indexes``, only
        those chunks of a KV.MRESERVE lease (by request position). ``digests``: the writer's
        checksum of each named slot (``indexes[i]``'s, or the KV.RESERVE slot's), None for
        none; the caller checked that they pair up."""
        await commit_lease(self.writes, lease_id, indexes, holder, digests)

    def abort(self, lease_id: str, holder: Holder = NO_HOLDER) -> None:
        self.writes.abort(lease_id, holder)

    # -- reads -------------------------------------------------------------------------------------

    def get_now(self, ns: str, hash: bytes) -> Payload | NotNow | None:
        """KV.GET without awaiting when possible (a DRAM hit); NOT_NOW: use :meth:`get`."""
        return self.reads.get_now(ns, hash)

    async def get(self, ns: str, hash: bytes) -> Payload | None:
        return await self.reads.get(ns, hash)

    async def mget(self, ns: str, hashes: Sequence[bytes]) -> list[Payload | None]:
        await self.remote.ensure_known(ns, hashes)
        return [await self.reads.get(ns, h) for h in hashes]

    async def lease(
        self,
        ns: str,
        hashes: Sequence[bytes],
        ttl_ms: int | None = None,
        tier: str | None = None,
        holder: Holder = NO_HOLDER,
    ) -> ReadLease | None:
        """KV.LEASE into ``tier`` (gpu or dram; default: gpu when this store has one)."""
        ttl = self.config.lease_ttl if ttl_ms is None else ttl_ms
        self.state.admit_lease(holder)
        return await self.reads.lease(ns, hashes, ttl, tier, holder)

    def release(self, lease_id: str, holder: Holder = NO_HOLDER) -> None:
        self.reads.release(lease_id, holder)

    def regions(self) -> list[Region]:
        out: list[Region] = []
        for tier in self.state.tiers:
            if isinstance(tier, MemoryTier):
                out.extend(tier.regions())
        return out

    # -- index queries -----------------------------------------------------------------------------

    def matched(self, ns: str, hashes: Sequence[bytes]) -> list[ChunkRecord]:
        """Records of the leading chunks of the chain this node knows (present, committed,
        unexpired; a chunk known to be in s3 counts). Index only: no I/O."""
        return query.matched(self.state, ns, hashes)

    def wants_remote(self, found: int, wanted: int) -> bool:
        """True when a match that found ``found`` of ``wanted`` chunks should ask s3."""
        return found < wanted and self.remote.enabled

    async def match_remote(
        self, ns: str, hashes: Sequence[bytes], local: list[ChunkRecord]
    ) -> list[ChunkRecord]:
        """``local`` (from :meth:`matched`) extended by what the shared tier holds."""
        return [*local, *await self.remote.extend(ns, hashes, len(local))]

    async def match_all(self, ns: str, hashes: Sequence[bytes]) -> list[ChunkRecord]:
        """The matched records, asking the shared tier when the local match is short."""
        local = self.matched(ns, hashes)
        if self.wants_remote(len(local), len(hashes)):
            return await self.match_remote(ns, hashes, local)
        return local

    def check_link(self, ns: str, hash: bytes, parent: bytes) -> None:
        """Refuse a parent link that would close a loop (a chunk in a loop is never a leaf,
        so it could never be evicted)."""
        query.check_link(self.state.index, ns, hash, parent)

    def match(self, ns: str, hashes: Sequence[bytes]) -> int:
        """Number of leading chunks of the chain this node knows (index only)."""
        return len(self.matched(ns, hashes))

    def tiers_of(self, records: Sequence[ChunkRecord]) -> list[str]:
        """The fastest tier holding each record."""
        return query.tiers_of(self.state.tiers, records)

    def match_tiers(self, ns: str, hashes: Sequence[bytes]) -> list[str]:
        """The fastest tier holding each locally matched chunk."""
        return self.tiers_of(self.matched(ns, hashes))

    # -- sessions and prefetch ---------------------------------------------------------------------

    def prefetch(
        self,
        ns: str,
        hashes: Sequence[bytes],
        target: str | None = None,
        deadline_ms: int | None = None,
    ) -> int:
        """Queue a background promotion of the chain's chunks (returns at once); how many
        chunks were queued (0: all already in the target, or the queue is full)."""
        return self.hints.submit(ns, hashes, target, deadline_ms)[1]

    def prefetch_request(
        self,
        ns: str,
        hashes: Sequence[bytes],
        target: str | None = None,
        deadline_ms: int | None = None,
    ) -> tuple[int, int]:
        """Like :meth:`prefetch`; (request id, chunks queued), (0, 0) when nothing was."""
        return self.hints.submit(ns, hashes, target, deadline_ms)

    def prefetch_session(
        self, ns: str, session: bytes, target: str | None = None, deadline_ms: int | None = None
    ) -> tuple[int, int]:
        """Queue the promotion of a session's chain; (request id, chunks queued). Local:
        see :meth:`prefetch_session_shared` for a store with a shared tier."""
        return self.hints.submit_session(ns, session, target, deadline_ms)

    @property
    def shares_sessions(self) -> bool:
        """True when sessions are also kept in the shared tier (an S3 tier is configured)."""
        return self.hints.shared.enabled

    async def prefetch_session_shared(
        self, ns: str, session: bytes, target: str | None = None, deadline_ms: int | None = None
    ) -> tuple[int, int]:
        """The promotion of a session's chain recorded on any node (its object in S3), with
        the chain's ancestors looked up in S3; (request id, chunks queued)."""
        return await self.hints.submit_session_shared(ns, session, target, deadline_ms)

    def cancel_prefetch(self, request_id: int) -> bool:
        return self.hints.prefetch.cancel(request_id)

    def record_session(
        self, ns: str, session: bytes, tail: bytes, ttl_ms: int | None = None
    ) -> None:
        """KV.SESSION: the session's conversation currently ends at chunk ``tail``."""
        self.hints.record_session(ns, session, tail, ttl_ms)

    async def prefetch_idle(self) -> None:
        """Wait until no prefetch is queued or running (tests, benchmarks)."""
        await self.hints.prefetch.idle()

    def info(self, ns: str, hash: bytes) -> dict[str, Any] | None:
        return query.chunk_info(self.state, ns, hash)

    async def delete(self, ns: str, hash: bytes, cascade: bool = False) -> int:
        """Delete a chunk (and with ``cascade`` its descendants) from every tier; waits for the
        copies that nobody pins to be freed. Returns how many chunks were deleted."""
        rec = self.state.live(ChunkKey(ns, hash))
        if rec is None:
            return 0
        victims = [rec, *(self.state.index.descendants(rec) if cascade else ())]
        events = [self.state.retire(r) for r in victims]
        waits = [e.wait() for r, e in zip(victims, events, strict=True)
                 if e is not None and not r.pins]  # fmt: skip
        await asyncio.gather(*waits)
        return len(victims)

    # -- statistics --------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, Any]]:
        return tier_stats(self.state, self.placement)

    def info_sections(self) -> dict[str, list[tuple[str, object]]]:
        return info_sections(self)

    def tier_error_count(self) -> int:
        return self.state.errors
