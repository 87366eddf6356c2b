"""The read path: KV.GET (zero-copy from DRAM, read-through and promotion from cold tiers),
KV.LEASE / RELEASE (pinned handles into a shareable tier: the GPU pool or the DRAM arena).
Chunks the index does not know are looked up in the shared tier first (``kvstore.remote``).

A DRAM hit returns a view of the arena slot, pinned until the caller's ``release()``; a chunk
held in both the GPU and DRAM is served from DRAM. A hit in the GPU or a lower tier reads
straight into a fresh DRAM reservation when there is room (``get`` into the slot, checksum,
commit; the other copy is kept) and otherwise into a new buffer. The record is pinned while its
bytes are read, so a concurrent delete, replacement or eviction waits for the read instead of
freeing the copy under it; a chunk deleted meanwhile is reported as a miss. A chunk whose S3
object another node replaced is looked up again and the new version served.

KV.LEASE leases into the GPU (``TIER gpu``, the default when a GPU tier exists) through
``kvstore.gpu``; a chunk that cannot be brought there is leased from DRAM instead, so one
lease may mix ``cuda`` and ``shm`` handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import CommandError, LeaseError
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.gpu import GpuPath
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.state import NOT_NOW, NotNow, StoreState
from kvstrata.store.leases import NO_HOLDER, Holder, ReadLease, deadline_after
from kvstrata.store.placement import Placement
from kvstrata.tiers.base import (
    Handle,
    MemoryTier,
    Tier,
    TierError,
)

log = logging.getLogger("kvstrata.store")

_AHEAD = 8  # chunks a lease promotes at once


def handle_tier(state: StoreState, handle: Handle) -> str:
    """The tier a lease handle points into (its region is the GPU pool's or the arena's)."""
    gpu = state.gpu
    if gpu is not None and handle.region == gpu.region_name:
        return gpu.name
    assert state.dram is not None
    return state.dram.name


@dataclass(frozen=True, slots=True)
class Payload:
    """A chunk's bytes; call ``release`` (when set) once done with ``view``."""

    view: memoryview
    release: Callable[[], None] | None = None


class ReadPath:
    def __init__(
        self,
        state: StoreState,
        placement: Placement,
        remote: RemotePath | None = None,
        gpu: GpuPath | None = None,
    ) -> None:
        self.state = state
        self.placement = placement
        self.remote = remote
        self.gpu = gpu

    def _unpinner(self, rec: ChunkRecord) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.state.unpin(rec)

        return release

    # -- KV.GET ----------------------------------------------------------------------------------

    def get_now(self, ns: str, hash: bytes) -> Payload | NotNow | None:
        """KV.GET without awaiting when nothing needs I/O: a DRAM hit on top of the hierarchy,
        or a miss with no shared tier to ask. :data:`NOT_NOW` means: use :meth:`get`."""
        state = self.state
        dram = state.dram
        if dram is None or state.tiers[0] is not dram:
            return NOT_NOW
        rec = state.live(ChunkKey(ns, hash))
        if rec is None:
            if state.remote is not None:
                return NOT_NOW
            for tier in state.tiers:
                state.counters[tier.name].misses += 1
            if state.tracer is not None:  # (the hot path builds nothing when not tracing)
                state.trace("get", ns, (hash,))
            return None
        if rec.moving or dram.name not in rec.tiers:
            return NOT_NOW
        try:
            view = dram.view(rec.key)
        except TierError:
            return NOT_NOW  # the slow path records and repairs it
        rec.touch()
        rec.hits += 1
        state.pin(rec)
        counters = state.counters[dram.name]
        counters.hits += 1
        counters.bytes_out += rec.size
        if state.tracer is not None:
            state.trace("get", ns, (hash,))
        return Payload(view, self._unpinner(rec))

    async def get(self, ns: str, hash: bytes) -> Payload | None:
        """KV.GET (and each chunk of KV.MGET) that may need tier I/O."""
        payload = await self._get(ns, hash)
        if self.state.tracer is not None:  # after the lookup: an expiry it caused comes first
            self.state.trace("get", ns, (hash,))
        return payload

    async def _get(self, ns: str, hash: bytes) -> Payload | None:
        key = ChunkKey(ns, hash)
        state = self.state
        dram = state.dram
        for attempt in range(4):
            rec = state.live(key)
            if rec is None and self.remote is not None:
                rec = await self.remote.find(key)  # stored by another node?
            if rec is None:
                for tier in state.tiers:
                    state.counters[tier.name].misses += 1
                return None
            if rec.moving and attempt < 3 and (dram is None or dram.name not in rec.tiers):
                await state.wait_move(rec)  # a promotion is landing it in DRAM: share it
                continue
            rec.touch()
            rec.hits += 1
            payload = await self._read(rec)
            if payload is None and self.remote is not None and self.remote.was_replaced(rec):
                continue  # another node replaced the object: look it up again, adopt it
            return payload
        return None

    async def _read(self, rec: ChunkRecord) -> Payload | None:
        state = self.state
        dram = state.dram
        for tier in state.tiers:
            counters = state.counters[tier.name]
            if tier.name not in rec.tiers:
                counters.misses += 1
                continue
            if tier is state.gpu and dram is not None and dram.name in rec.tiers:
                continue  # DRAM serves it without a copy
            if isinstance(tier, MemoryTier) and tier.name != "gpu":
                try:
                    view = tier.view(rec.key)
                except TierError as exc:
                    state.tier_error(tier.name, f"view of {rec.key.hex[:16]}", exc)
                    state.index.drop_tier(rec, tier.name)
                    continue
                state.pin(rec)
                counters.hits += 1
                counters.bytes_out += rec.size
                return Payload(view, self._unpinner(rec))
            payload = await self._read_through(rec, tier)
            if payload is not None:
                counters.hits += 1
                return payload
            if not rec.alive:
                return None
        state.drop_if_gone(rec)
        return None

    async def _read_through(self, rec: ChunkRecord, src: Tier) -> Payload | None:
        state = self.state
        dram = state.dram
        state.pin(rec)
        try:
            if (
                dram is not None
                and rec.size <= self.placement.free_for(dram)
                and state.begin_move(rec)
            ):
                try:
                    promoted = await self.promote(rec, src)
                    if promoted:
                        view = dram.view(rec.key)  # before pinning: a raise leaks no pin
                        state.pin(rec)
                        return Payload(view, self._unpinner(rec))
                finally:
                    state.end_move(rec)
                if promoted is None:
                    return None
            data = await self.placement.read_copy(rec, src)
            if data is None or not rec.alive:
                return None
            return Payload(memoryview(data), None)
        finally:
            state.unpin(rec)

    async def promote(self, rec: ChunkRecord, src: Tier) -> bool | None:
        """Read ``rec`` from ``src`` into a new DRAM slot and commit it there (the caller holds
        the move). True: promoted; False: no room (the copy is fine); None: the copy is bad or
        unreadable, or the chunk was deleted meanwhile."""
        state = self.state
        assert state.dram is not None
        done = await self.placement.copy_to_dram(rec, src, make_room=False)
        if done:
            state.counters[state.dram.name].promotions += 1
            self.placement.kick()
        return done

    async def ensure_dram(self, rec: ChunkRecord, make_room: bool = True) -> bool:
        """Bring ``rec`` into DRAM (promoting it from the fastest lower tier holding it)."""
        state = self.state
        dram = state.dram
        assert dram is not None
        for _ in range(4):
            if dram.name in rec.tiers:
                return True
            if not rec.alive:
                return False
            if rec.moving:
                await state.wait_move(rec)
                continue
            src = next((t for t in state.tiers if t.name in rec.tiers and t is not dram), None)
            if src is None:
                return False
            if self.placement.free_for(dram) < rec.size:
                if not make_room:
                    return False
                if not await self.placement.room.room_for(rec.size):  # in turn with writers
                    return False
                continue
            if not state.begin_move(rec):
                continue
            try:
                await self.promote(rec, src)
            finally:
                state.end_move(rec)
        return dram.name in rec.tiers

    # -- KV.LEASE / KV.RELEASE -------------------------------------------------------------------

    def lease_target(self, tier: str | None) -> str:
        """The tier a lease asks for: ``gpu`` or ``dram``; by default the fastest shareable
        tier this store has (gpu when configured)."""
        state = self.state
        if state.dram is None:
            raise CommandError("KV.LEASE needs a dram tier")
        if tier is None:
            return state.gpu.name if state.gpu is not None else state.dram.name
        if tier == "gpu" and state.gpu is None:
            raise CommandError("TIER gpu: this server has no gpu tier (INFO tiers: gpu_status)")
        if tier not in ("gpu", "dram"):
            raise CommandError(f"invalid TIER '{tier}': must be gpu or dram")
        return tier

    async def lease(
        self,
        ns: str,
        hashes: Sequence[bytes],
        ttl_ms: int,
        tier: str | None = None,
        holder: Holder = NO_HOLDER,
    ) -> ReadLease | None:
        """Pin the leading present chunks, promoting them into ``tier`` (see
        :meth:`lease_target`; a chunk the GPU cannot take is leased from DRAM); None when the
        first chunk is not cached."""
        state = self.state
        target = self.lease_target(tier)
        began = time.monotonic()
        if self.remote is not None:
            await self.remote.ensure_known(ns, hashes)
        found = self._found_in(ns, hashes, target)  # before any promotion
        await self._promote_ahead(ns, hashes, target)
        records: list[ChunkRecord] = []
        handles: list[Handle] = []
        try:
            for h in hashes:
                rec = state.live(ChunkKey(ns, h))
                if rec is None:
                    break
                handle = await self._lease_handle(rec, target)
                if handle is None:
                    break
                state.pin(rec)
                rec.leases += 1
                rec.touch()
                rec.hits += 1
                records.append(rec)
                handles.append(handle)
                self._count_read(found.get(rec.key) or handle_tier(state, handle))
        except BaseException:
            self._unpin_all(records)
            raise
        if not records:
            state.trace("lease", ns, hashes, to=target)
            return None
        lease = ReadLease(
            id=state.leases.new_id(),
            namespace=ns,
            records=tuple(records),
            handles=tuple(handles),
            deadline=deadline_after(ttl_ms, state.leases.clock),
            holder=holder,
        )
        state.leases.add(lease)
        since = time.monotonic() - began  # its promotions ran beside other commands
        state.trace("lease", ns, hashes, to=target, lease=lease.id, since=since)
        return lease

    def _found_in(self, ns: str, hashes: Sequence[bytes], target: str) -> dict[ChunkKey, str]:
        """Where each leading chunk of a lease is now: the lease tier when it holds the chunk,
        else the fastest tier that does (what a KV.GET would read it from)."""
        state = self.state
        found: dict[ChunkKey, str] = {}
        for h in hashes:
            rec = state.live(ChunkKey(ns, h))
            if rec is None or not rec.tiers:
                break
            if target in rec.tiers:
                found[rec.key] = target
            else:
                found[rec.key] = next(t.name for t in state.tiers if t.name in rec.tiers)
        return found

    def _count_read(self, tier: str) -> None:
        """A leased chunk counts as a read of the tier it was found in, as KV.GET counts one:
        a miss in each faster tier, a hit there (its promotion into the lease tier is counted
        as the promotion it is). So a lease of a chunk held in NVMe is an NVMe hit, like a
        GET served from NVMe, and the per-tier shares say where the engine's reads came from."""
        counters = self.state.counters
        for t in self.state.tiers:
            if t.name == tier:
                counters[t.name].hits += 1
                return
            counters[t.name].misses += 1

    async def _lease_handle(self, rec: ChunkRecord, target: str) -> Handle | None:
        """Bring ``rec`` into ``target`` (or DRAM) and return its handle there; synchronous
        from the last await to the caller's pin, so the copy cannot leave in between."""
        moves = self.gpu
        if (
            moves is not None
            and target == moves.gpu.name
            and await moves.ensure_gpu(rec)
            and rec.alive
        ):
            return moves.gpu.handle(rec.key)
        dram = self.state.dram
        assert dram is not None
        if await self.ensure_dram(rec) and rec.alive:
            return dram.handle(rec.key)
        return None

    async def _promote_ahead(self, ns: str, hashes: Sequence[bytes], target: str) -> None:
        """Promote the leading chunks that are not in ``target`` in parallel (bounded), when
        they fit together, so a chain held in nvme/s3 is not read one request after the
        other."""
        state = self.state
        tier = state.by_name[target]
        below: list[ChunkRecord] = []
        total = 0
        for h in hashes:
            rec = state.live(ChunkKey(ns, h))
            if rec is None:
                break
            if target not in rec.tiers:
                below.append(rec)
                total += rec.size
        if len(below) < 2 or total > tier.capacity // 2:
            return
        gate = asyncio.Semaphore(_AHEAD)
        moves = self.gpu if tier is state.gpu else None

        async def one(rec: ChunkRecord) -> None:
            async with gate:
                if moves is not None:
                    await moves.ensure_gpu(rec)
                else:
                    await self.ensure_dram(rec)

        await asyncio.gather(*(one(r) for r in below))

    def _unpin_all(self, records: Sequence[ChunkRecord]) -> None:
        for rec in records:
            rec.leases -= 1
            self.state.unpin(rec)

    def end_read_lease(self, lease: ReadLease) -> None:
        """Every read lease ends here: KV.RELEASE, expiry, its connection closing."""
        self._unpin_all(lease.records)
        self.state.trace("release", lease.namespace, [], lease=lease.id)

    def release(self, lease_id: str, holder: Holder = NO_HOLDER) -> None:
        """KV.RELEASE of ``holder``'s read lease (another holder's is refused like an unknown
        one). Of an expired one, the fence ends: the holder is done with every slot."""
        leases = self.state.leases
        lease = leases.get(lease_id)
        if lease is None or lease.holder.id != holder.id:
            if self.state.fences.end(lease_id, holder):
                raise LeaseError(f"lease {lease_id} expired (its slots are freed now)")
            raise LeaseError(f"no such lease {lease_id!r} (unknown, ended or expired)")
        if not isinstance(lease, ReadLease):
            raise LeaseError(f"lease {lease_id} is a write lease; use KV.COMMIT or KV.ABORT")
        if leases.is_expired(lease):
            leases.expire(lease_id)  # fenced and unfenced at once: only the pins end
            self.end_read_lease(lease)
            raise LeaseError(f"lease {lease_id} expired")
        leases.pop(lease_id)
        self.end_read_lease(lease)
