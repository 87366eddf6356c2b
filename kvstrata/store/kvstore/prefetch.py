"""Sessions and prefetch as the store sees them: which chunks a hint names, where they go.

:class:`PrefetchPath` owns the session table (``sessions``) and the background scheduler
(``prefetch``); it turns ``KV.PREFETCH`` / ``KV.MATCH … PREFETCH`` into scheduler requests
(a session becomes its tail's chain, root first, through the index's parent links) and moves
one chunk at a time for the scheduler's workers:

- target ``dram`` (the default): promotion from the fastest lower tier holding the chunk,
  making room by the usual LRU demotion (pinned and leased chunks are never moved);
- target ``gpu`` (with a GPU tier): the same promotion into the GPU pool as ``KV.LEASE … TIER
  gpu`` (``kvstore.gpu.GpuPath.ensure_gpu``: from DRAM, straight from NVMe, or through a host
  buffer from s3);
- a local tier below DRAM (``nvme``): a copy from a slower tier (s3), so that the next load
  is local;
- a chunk this node does not know yet is looked up in the shared tier first.

With a shared tier, sessions are shared too (``shared_sessions``): KV.SESSION also writes a
session object to S3, and :meth:`PrefetchPath.submit_session_shared` reads it and walks the
chain's ancestors through S3, so a session recorded on one node is prefetched in full on any.

A request is trimmed to the chunks that fit in the target's low watermark (so a chain larger
than the tier does not evict its own first chunks), and chunks already in the target (as far as
the index knows) are not queued.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import CommandError
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.gpu import GpuPath
from kvstrata.store.kvstore.read import ReadPath
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.state import StoreState, is_shared
from kvstrata.store.placement import Placement
from kvstrata.store.policy import chain_to, prefetch_budget, prefetch_todo
from kvstrata.store.prefetch import PrefetchRequest, PrefetchScheduler
from kvstrata.store.sessions import DEFAULT_TTL_MS, SessionTable
from kvstrata.store.shared_sessions import SharedSessions
from kvstrata.tiers.base import MemoryTier, TierError

MAX_CHAIN = 65_536


class PrefetchPath:
    def __init__(
        self,
        state: StoreState,
        placement: Placement,
        reads: ReadPath,
        remote: RemotePath,
        gpu: GpuPath | None = None,
    ) -> None:
        self.state = state
        self.placement = placement
        self.reads = reads
        self.remote = remote
        self.gpu = gpu
        self.sessions = SessionTable()
        remote_name = state.remote.name if state.remote is not None else ""
        self.shared = SharedSessions(
            state, remote, lambda: placement.policy(remote_name).write_through
        )
        config = state.config
        self.prefetch = PrefetchScheduler(
            self.fetch_one,
            int(config.prefetch_queue),
            int(config.prefetch_concurrency),
            lambda: int(config.get("prefetch-bandwidth")),
            self._size_of,
        )

    # -- targets and chains ----------------------------------------------------------------------

    def default_target(self) -> str | None:
        state = self.state
        if state.dram is not None:
            return state.dram.name
        return next((t.name for t in state.tiers if not is_shared(t)), None)

    def check_target(self, name: str | None) -> str:
        target = self.default_target() if name is None else name.lower()
        if target is None:
            raise CommandError("prefetch needs a local tier")
        tier = self.state.by_name.get(target)
        if tier is None:
            raise CommandError(f"unknown tier '{target}' (tiers: {self._names()})")
        memory = isinstance(tier, MemoryTier) and tier not in (self.state.dram, self.state.gpu)
        if is_shared(tier) or memory:
            raise CommandError(f"cannot prefetch to tier '{target}'")
        return target

    def _names(self) -> str:
        return ", ".join(t.name for t in self.state.tiers)

    def session_chain(self, ns: str, session: bytes) -> list[bytes]:
        """The hashes of the session's chain, root first ([] for an unknown session). The walk
        follows parent links of the local index; a chunk it does not know ends it."""
        entry = self.sessions.get(ns, session)
        if entry is None:
            return []
        return chain_to(entry.tail, lambda h: self.state.live(ChunkKey(ns, h)), MAX_CHAIN)

    def _todo(self, ns: str, hashes: Sequence[bytes], target: str) -> list[bytes]:
        """Hashes worth queueing: the prefix that fits the target, minus chunks already there."""
        tier = self.state.by_name[target]
        budget = prefetch_budget(self.placement.policy(target), tier.capacity)
        live = self.state.live
        return prefetch_todo(
            hashes, lambda h: live(ChunkKey(ns, h)), target, budget, self.remote.enabled
        )

    # -- requests --------------------------------------------------------------------------------

    def record_session(self, ns: str, session: bytes, tail: bytes, ttl_ms: int | None) -> None:
        ttl = DEFAULT_TTL_MS if ttl_ms is None else ttl_ms
        self.state.trace("session", ns, [tail], session=session, ttl=ttl)
        self.sessions.record(ns, session, tail, ttl)
        self.shared.record(ns, session, tail, ttl)

    def submit(
        self,
        ns: str,
        hashes: Sequence[bytes],
        target: str | None = None,
        deadline_ms: int | None = None,
        session: bytes | None = None,
    ) -> tuple[int, int]:
        """Queue a prefetch; (request id, chunks queued), (0, 0) when nothing was queued."""
        name = self.check_target(target)
        todo = self._todo(ns, hashes, name)
        # every prefetch (KV.PREFETCH, of a session, KV.MATCH PREFETCH) comes here with its
        # chain resolved: the trace has the chunks the server chose from, not the session;
        # after the lookups, so that an expiry they caused is recorded first
        # (with its session: a newer request of a session cancels the older one)
        self.state.trace(
            "prefetch", ns, hashes, to=name, deadline=deadline_ms or 0, session=session
        )
        if not todo:
            return 0, 0
        req: PrefetchRequest | None = self.prefetch.submit(ns, todo, name, deadline_ms, session)
        return (0, 0) if req is None else (req.id, len(req.hashes))

    def submit_session(
        self, ns: str, session: bytes, target: str | None = None, deadline_ms: int | None = None
    ) -> tuple[int, int]:
        self.check_target(target)
        chain = self.session_chain(ns, session)
        if not chain:
            return 0, 0
        return self.submit(ns, chain, target, deadline_ms, session)

    async def submit_session_shared(
        self, ns: str, session: bytes, target: str | None = None, deadline_ms: int | None = None
    ) -> tuple[int, int]:
        """:meth:`submit_session` across nodes: the session as recorded last on any node (its
        object in S3, unless this node's own record still waits to be written there), its
        chain walked through S3 where this node lacks the ancestors."""
        self.check_target(target)
        entry = self.sessions.get(ns, session)
        tail = entry.tail if entry is not None else None
        if not self.shared.pending(ns, session):
            obj = await self.shared.fetch(ns, session)
            if obj is not None:
                tail = obj.tail
                self.sessions.record(ns, session, tail, obj.ttl_ms())  # local copy only
        if tail is None:
            return 0, 0
        chain = await self.shared.chain(ns, tail)
        return self.submit(ns, chain, target, deadline_ms, session)

    # -- moving one chunk (scheduler workers) ----------------------------------------------------

    def _size_of(self, key: ChunkKey) -> int:
        rec = self.state.index.get(key)
        return rec.size if rec is not None else 0

    async def fetch_one(self, key: ChunkKey, target: str) -> int:
        """Bring one chunk into tier ``target``; the bytes moved (0: nothing to do, or failed)."""
        rec = await self.remote.find(key)
        if rec is None or not rec.alive or target in rec.tiers:
            return 0
        state = self.state
        state.trace("fetch", key.namespace, [key.hash], to=target)  # a worker starts it now
        if self.gpu is not None and target == self.gpu.gpu.name:
            ok = await self.gpu.ensure_gpu(rec, make_room=True)
        elif state.dram is not None and target == state.dram.name:
            ok = await self.reads.ensure_dram(rec, make_room=True)
        else:
            ok = await self._copy_into(rec, state.tier_index(target))
        if not ok or not rec.alive:
            return 0
        rec.touch()  # just prefetched: the last chunk to evict, not the first
        return rec.size

    async def _copy_into(self, rec: ChunkRecord, j: int) -> bool:
        """Copy ``rec`` into the local tier ``j`` from a slower tier holding it."""
        state = self.state
        dst = state.tiers[j]
        src = next((t for t in state.tiers[j + 1 :] if t.name in rec.tiers), None)
        if src is None or not state.begin_move(rec):
            return False
        try:
            data = await self.placement.read_copy(rec, src)
            if data is None or not rec.alive:
                return False
            try:
                await self.placement.put_with_room(j, rec.meta(), data)
            except TierError as exc:
                state.tier_error(dst.name, f"prefetch of {rec.key.hex[:16]}", exc)
                return False
            state.index.add_tier(rec, dst.name)
            state.counters[dst.name].promotions += 1
            state.counters[dst.name].bytes_in += rec.size
            return True
        finally:
            state.end_move(rec)

    def info(self) -> list[tuple[str, object]]:
        return [
            *self.prefetch.info(),
            ("sessions", len(self.sessions)),
            ("sessions_shared_written", self.shared.written),
            ("sessions_shared_fetched", self.shared.fetched),
        ]
