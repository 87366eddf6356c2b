"""The write path: KV.PUT (bytes or a payload sink), KV.RESERVE / COMMIT / ABORT.

A chunk becomes visible only when its bytes are complete and checksummed: it is written into
an invisible DRAM reservation (the connection receives a large payload straight into it, see
:meth:`WritePath.reserve_put`), copied to the write-through tiers, then committed and published
in the index and keyspace in one synchronous step. ``KV.RESERVE … TIER gpu`` reserves the slot
in the GPU pool instead (:class:`~kvstrata.store.kvstore.gpu.GpuSink`); its commit copies the
slot to the host first (into a DRAM reservation when there is room), checksums those bytes and
commits the GPU and DRAM copies together. The key is owned by its writer from the
first reservation to the publication (see ``kvstore.state``), so with ``NX`` exactly one of
concurrent writers stores the chunk and the others wait for it and answer 0.

``KV.COMMIT … DIGEST d…`` carries the writer's own checksum of each slot (computed while it
copied the bytes in, ``clients.copysum``): a DRAM slot's claim is adopted without hashing the
slot again, and the record says it is unverified until the first copy out of DRAM checks it
(:func:`~kvstrata.store.mover.check_bytes`; a wrong claim then drops the chunk like a
corrupt copy). Where the commit copies the bytes anyway (a GPU slot, a write-through tier) the
claim is checked at once and a wrong one refuses the chunk.
"""

from __future__ import annotations

from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.protocol.errors import BusyError, CommandError, OutOfMemoryError
from kvstrata.store.index import ChunkRecord, record_from_meta
from kvstrata.store.keyspace import now_ms
from kvstrata.store.kvstore.gpu import GpuPath, GpuSink
from kvstrata.store.kvstore.sink import PayloadSlots, StoreSink
from kvstrata.store.kvstore.state import NOT_NOW, NotNow, StoreState, is_internal, is_shared
from kvstrata.store.kvstore.write_leases import WriteLeases
from kvstrata.store.leases import NO_HOLDER, Holder, WriteLease, deadline_after
from kvstrata.store.mover import check_bytes
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import Buffer, Handle, TierError, TierFull
from kvstrata.tiers.checksum import checksum


def byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


KEY_WAIT_SECONDS = 30.0  # a writer waiting for another writer of the same key gives up (BUSY)


def _checksum(data: memoryview, sink: Any) -> bytes:
    """The checksum of ``data``; a payload received into a StoreSink was hashed as it came."""
    return sink.checksum() if type(sink) is StoreSink and data is sink.view else checksum(data)


class WritePath(PayloadSlots, WriteLeases):
    """KV.PUT and KV.RESERVE / COMMIT: see the module docstring. The slots of payloads still
    arriving are :class:`PayloadSlots`'s (``kvstore.sink``), finding and ending write leases
    :class:`WriteLeases`'s (``kvstore.write_leases``)."""

    def __init__(self, state: StoreState, placement: Placement, gpu: GpuPath | None = None) -> None:
        self.state = state
        self.placement = placement
        self.gpu = gpu
        self.receiving = 0  # bytes of provisional slots whose payload is still arriving

    # -- KV.PUT ----------------------------------------------------------------------------------

    async def put(
        self,
        ns: str,
        hash: bytes,
        parent: bytes,
        payload: Buffer,
        tokens: int = 0,
        ttl_ms: int | None = None,
        nx: bool = False,
        sink: Any = None,
    ) -> bool:
        key = ChunkKey(ns, hash)
        if sink is not None:
            _check_sink(sink, key)
            sink.consume()
            data = sink.view
        else:
            data = byte_view(payload)
        state = self.state
        try:
            while True:
                rec = state.live(key)
                if rec is not None:
                    if nx:
                        return False
                    if rec.size == data.nbytes and self._same_bytes(rec, data, sink):
                        self._refresh(rec.redis_key(), ttl_ms)
                        return True
                    if not rec.alive:
                        continue  # its unverified DRAM copy just failed the check: dropped
                    if rec.leases:
                        raise BusyError(f"chunk {key.hex} is leased; retry after KV.RELEASE")
                    state.retire(rec)
                if state.key_busy(key):
                    await state.wait_key(key, KEY_WAIT_SECONDS)
                    continue
                break
            state.claim(key)
            try:
                await self.commit_new(key, parent, tokens, ttl_ms, data, sink)
            finally:
                state.release_claim(key)
            return True
        finally:
            if sink is not None:
                sink.abort()  # a no-op once committed

    def put_sink_now(
        self, ns: str, hash: bytes, parent: bytes, tokens: int, ttl_ms: int | None, sink: Any
    ) -> bool | NotNow:
        """Publish a payload already received into its DRAM slot without awaiting, when no
        other tier must take the bytes first (no write-through below DRAM); else NOT_NOW."""
        if self.state.dram is None or self._copied_at_commit():
            return NOT_NOW
        key = ChunkKey(ns, hash)
        state = self.state
        _check_sink(sink, key)
        if state.live(key) is not None or state.key_busy(key):
            return NOT_NOW  # NX, identical re-put, replacement or waiting: the async path
        state.claim(key)
        sink.consume()
        try:
            meta = ChunkMeta(key, parent, tokens, sink.view.nbytes, sink.checksum())
            self._trace_put(meta, ttl_ms)
            self._publish(meta, sink.place(meta), ttl_ms, sink)
        finally:
            state.release_claim(key)
            sink.abort()  # a no-op once committed
        return True

    def _same_bytes(self, rec: ChunkRecord, data: memoryview, sink: Any) -> bool:
        """True when ``data`` is the stored chunk's content. An unverified checksum (a
        writer's claim) is checked against the DRAM copy first: a claim that equals the new
        bytes' checksum says nothing about the bytes actually stored."""
        dram = self.state.dram
        if not rec.verified and dram is not None and dram.name in rec.tiers:
            try:
                check_bytes(rec, dram, dram.view(rec.key))
            except TierError as exc:
                self.state.corrupt(rec, dram.name, f"re-put of {rec.key.hex[:16]}", exc, False)
                return False
        return rec.verified and rec.checksum == _checksum(data, sink)

    def _refresh(self, rkey: bytes, ttl_ms: int | None) -> None:
        self.state.keyspace.set_expire(rkey, None if ttl_ms is None else now_ms() + ttl_ms)

    async def commit_new(
        self,
        key: ChunkKey,
        parent: bytes,
        tokens: int,
        ttl_ms: int | None,
        data: memoryview,
        sink: StoreSink | GpuSink | None,
        claim: bytes | None = None,
    ) -> None:
        """Place, checksum and publish a chunk whose key the caller owns. ``claim``: the
        writer's checksum of ``data`` (KV.COMMIT DIGEST), adopted unverified for a DRAM slot
        that no other tier takes now, else checked here (CommandError when wrong)."""
        if claim is None:
            csum, verified = _checksum(data, sink), True
        elif type(sink) is StoreSink and data is sink.view and not self._copied_at_commit():
            csum, verified = claim, False
        else:
            csum, verified = checksum(data), True
            if csum != claim:
                self.state.digest_refused += 1
                raise CommandError(
                    f"the DIGEST of chunk {key.hex} does not match its bytes (xxh3-128 "
                    f"{csum.hex()}, the writer sent {claim.hex()})"
                )
        meta = ChunkMeta(key, parent, tokens, data.nbytes, csum)
        placed: list[str] = []
        # traced before the tiers take it: a write-through lands in NVMe before the chunk is
        # published, and the demoter may already act on what it added (a failure: "del")
        self._trace_put(meta, ttl_ms)
        try:
            await self._place(meta, data, sink, placed)
        except Exception:
            self.state.trace("del", key.namespace, [key.hash])
            for name in placed:
                if name != "dram":
                    await self._undo(key, name)
            raise
        self._publish(meta, placed, ttl_ms, sink, verified)

    def _copied_at_commit(self) -> bool:
        """True when a commit writes the bytes to a tier besides DRAM (write-through)."""
        dram = self.state.dram
        return any(self.state.tiers[j] is not dram for j in self.placement.write_through_tiers())

    def _trace_put(self, meta: ChunkMeta, ttl_ms: int | None) -> None:
        """KV.PUT, KV.COMMIT of KV.RESERVE and of KV.MRESERVE (in commit order) all come here
        (``commit_new`` or ``put_sink_now``)."""
        self.state.trace(
            "put", meta.key.namespace, [meta.key.hash], parent=meta.parent, size=meta.size,
            tokens=meta.tokens, ttl=ttl_ms or 0,
        )  # fmt: skip

    def _publish(
        self,
        meta: ChunkMeta,
        placed: list[str],
        ttl_ms: int | None,
        sink: StoreSink | GpuSink | None,
        verified: bool = True,
        kick: bool = True,
    ) -> None:
        """Make a placed chunk visible (index, keyspace) and account for it (``kick``: wake
        the demoter if a tier is above its high mark; a batch does that once)."""
        rec = record_from_meta(meta, None if ttl_ms is None else now_ms() + ttl_ms)
        rec.verified = verified
        rec.tiers = set(placed)
        self.state.publish(rec)
        if sink is not None:
            sink.committed()  # the slot belongs to the chunk now; the key is free again
        for name in placed:
            self.state.counters[name].bytes_in += meta.size
        if kick:
            self.placement.kick()

    async def _place(
        self,
        meta: ChunkMeta,
        data: memoryview,
        sink: StoreSink | GpuSink | None,
        placed: list[str],
    ) -> None:
        state = self.state
        dram = state.dram
        for j in self.placement.write_through_tiers():
            tier = state.tiers[j]
            if tier is dram or (is_shared(tier) and is_internal(meta.key)):
                continue
            try:
                await self.placement.put_with_room(j, meta, data)
            except TierError as exc:
                state.tier_error(tier.name, "write-through", exc)
                if is_shared(tier):
                    # s3 write-through shows chunks to other nodes at once; during an outage
                    # the chunk is still stored locally (and written back on eviction).
                    continue
                if isinstance(exc, TierFull):
                    raise OutOfMemoryError(f"write-through to {tier.name} failed: {exc}") from exc
                raise CommandError(f"write-through to {tier.name} failed: {exc}") from exc
            placed.append(tier.name)
        if sink is not None:
            placed.extend(sink.place(meta))
        elif dram is not None and meta.size <= dram.capacity:
            view = await self.reserve_dram(meta.key, meta.size)
            if view is not None:
                view[:] = data
                dram.commit(meta)
                placed.append(dram.name)
        if not placed:
            await self._place_below(meta, data, placed)
        if not placed:
            raise OutOfMemoryError(self.placement.describe_full(meta.size))

    async def _place_below(self, meta: ChunkMeta, data: memoryview, placed: list[str]) -> None:
        """DRAM cannot take the chunk: store it directly in the first lower tier that can."""
        for j, tier in enumerate(self.state.tiers):
            if tier is self.state.dram or tier.name == "gpu":
                continue
            if is_shared(tier) and is_internal(meta.key):
                continue
            try:
                await self.placement.put_with_room(j, meta, data)
            except TierError as exc:
                self.state.tier_error(tier.name, f"put of {meta.key.hex[:16]}", exc)
                continue
            placed.append(tier.name)
            return

    async def _undo(self, key: ChunkKey, name: str) -> None:
        try:
            await self.state.by_name[name].delete(key)
        except TierError as exc:
            self.state.tier_error(name, f"undo of {key.hex[:16]}", exc)

    async def reserve_dram(self, key: ChunkKey, nbytes: int) -> memoryview | None:
        """A DRAM reservation for a key the caller owns, making room if needed."""
        return await self.placement.reserve_dram(key, nbytes)

    # -- KV.RESERVE / COMMIT / ABORT -------------------------------------------------------------

    async def reserve(
        self,
        ns: str,
        hash: bytes,
        parent: bytes,
        nbytes: int,
        tokens: int,
        ttl_ms: int,
        tier: str | None = None,
        holder: Holder = NO_HOLDER,
    ) -> WriteLease:
        """A write lease on a fresh slot: in DRAM by default, in the GPU pool with ``tier``
        ``gpu`` (in DRAM when the pool has no room); raises CommandError/BusyError/OOM."""
        state = self.state
        self.check_slot_size(nbytes, tier)
        key = ChunkKey(ns, hash)
        if state.live(key) is not None:
            raise CommandError(f"chunk {key.hex} already exists (KV.DEL it to replace it)")
        if not state.claim(key):
            raise BusyError(f"chunk {key.hex} is being written or freed by another client")
        try:
            slot = await self.reserve_slot(key, nbytes, tier == "gpu")
        except BaseException:
            state.release_claim(key)
            raise
        if slot is None:
            state.release_claim(key)
            raise OutOfMemoryError(self.placement.describe_full(nbytes))
        sink, handle = slot
        lease = WriteLease(
            id=state.leases.new_id(),
            key=key,
            parent=parent,
            tokens=tokens,
            size=nbytes,
            handle=handle,
            sink=sink,
            deadline=deadline_after(ttl_ms, state.leases.clock),
            holder=holder,
        )
        state.leases.add(lease)
        return lease

    def check_slot_size(self, nbytes: int, tier: str | None) -> None:
        """CommandError for a slot ``tier`` could never hold (before any bound is checked, so a
        bad argument is reported as such)."""
        limit = self.slot_limit(tier)
        if not 0 < nbytes <= limit:
            raise CommandError(f"invalid nbytes: must be 1 to {limit} (the tier's size)")

    def slot_limit(self, tier: str | None) -> int:
        """The largest slot KV.RESERVE/KV.MRESERVE can make in ``tier``; raises CommandError
        for a tier this server does not have."""
        state = self.state
        dram = state.dram
        if dram is None:
            raise CommandError("KV.RESERVE needs a dram tier")
        if tier not in (None, "dram", "gpu"):
            raise CommandError(f"invalid TIER '{tier}': must be gpu or dram")
        if tier == "gpu" and (state.gpu is None or self.gpu is None):
            raise CommandError("TIER gpu: this server has no gpu tier (INFO tiers: gpu_status)")
        limit = dram.capacity
        if tier == "gpu" and state.gpu is not None:
            limit = max(limit, state.gpu.capacity)
        return limit

    async def reserve_slot(
        self, key: ChunkKey, nbytes: int, in_gpu: bool
    ) -> tuple[StoreSink | GpuSink, Handle] | None:
        if in_gpu and self.gpu is not None:
            slot = await self.gpu.reserve(key, nbytes)
            if slot is not None:
                return slot
        view = await self.reserve_dram(key, nbytes)
        if view is None:
            return None
        dram = self.state.dram
        assert dram is not None
        # KV.RESERVE and KV.MRESERVE: the slot takes DRAM room now, the chunk comes at commit
        self.state.trace("reserve", key.namespace, [key.hash], size=nbytes)
        return StoreSink(self.state, key, view), dram.reserved_handle(key)

    async def commit(self, lease: WriteLease, claim: bytes | None = None) -> None:
        """Publish the slot of a lease taken with :meth:`take_write_lease` (``claim``: see
        :meth:`commit_new`)."""
        sink: StoreSink | GpuSink = lease.sink
        sink.consume()
        try:
            try:
                data = await sink.host_bytes()  # a GPU slot is copied to the host first
            except TierError as exc:
                raise CommandError(f"KV.COMMIT: the reserved slot cannot be read: {exc}") from exc
            await self.commit_new(lease.key, lease.parent, lease.tokens, None, data, sink, claim)
        finally:
            sink.abort()


def _check_sink(sink: Any, key: ChunkKey) -> None:
    if not isinstance(sink, StoreSink) or sink.key != key or sink.done:
        raise CommandError("payload sink does not belong to this chunk")
