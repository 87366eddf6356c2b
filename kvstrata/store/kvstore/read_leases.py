"""Read leases: KV.LEASE (pinned handles into a shareable tier: the GPU pool or the DRAM arena)
and KV.RELEASE, and where a leased chunk counts as a read.

A mixin of :class:`~kvstrata.store.kvstore.read.ReadPath`. KV.LEASE leases into the GPU
(``TIER gpu``, the default when a GPU tier exists) through ``kvstore.gpu``; a chunk that cannot
be brought there is leased from DRAM instead, so one lease may mix ``cuda`` and ``shm`` handles.
The leading chunks below the lease tier are promoted together first (``_promote_ahead``); each
leased chunk counts as a read of the tier it was found in before those promotions
(``_found_in``, ``_count_read``), as KV.GET counts one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import CommandError, LeaseError
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.gpu import GpuPath
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.leases import NO_HOLDER, Holder, ReadLease, deadline_after
from kvstrata.tiers.base import Handle

_AHEAD = 8  # chunks a lease promotes at once


def handle_tier(state: StoreState, handle: Handle) -> str:
    """The tier a lease handle points into (its region is the GPU pool's or the arena's)."""
    gpu = state.gpu
    if gpu is not None and handle.region == gpu.region_name:
        return gpu.name
    assert state.dram is not None
    return state.dram.name


class ReadLeases:
    """Mixin of ``ReadPath``: read leases granted, counted and ended."""

    # state owned by ReadPath
    state: StoreState
    remote: RemotePath | None
    gpu: GpuPath | None

    if TYPE_CHECKING:  # ReadPath's (a stub here would shadow it)

        async def ensure_dram(self, rec: ChunkRecord, make_room: bool = True) -> bool: ...

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
        counted: list[str] = []  # the tier each leased chunk is a read of (for the trace)
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
                counted.append(found.get(rec.key) or handle_tier(state, handle))
                self._count_read(counted[-1])
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
        state.trace(
            "lease", ns, hashes, to=target, lease=lease.id, since=since, found=tuple(counted)
        )
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
