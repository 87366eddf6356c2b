"""Batched zero-copy writes: KV.MRESERVE reserves the slots of several chunks of one chain under
one write lease; KV.COMMIT of that lease publishes them all, KV.ABORT (or expiry) frees them all.

The batch keeps every guarantee of a single reservation:

- A chunk is visible only after the commit, and each chunk is checksummed and published on its
  own, in chain order (a parent before its children).
- Reserving is all-or-nothing for memory: when one slot cannot be made (``-OOM``, the wait for
  room ran out), the slots already reserved by the command are freed and nothing is leased.
  A chunk that already exists, or that another client is writing right now, gets no slot and
  is reported as such (``exists`` / ``busy``): the engine has nothing to write for it.
- ``KV.COMMIT lease index…`` publishes the chunks it names (at their request positions) and
  leaves the others reserved, so a writer can publish each chunk as soon as it is written
  while it fills the next (the server checksums one chunk while the client copies another);
  ``KV.COMMIT lease`` publishes all that are left, and the lease ends when none is left.
  ``KV.COMMIT lease index… DIGEST d…`` adds the writer's checksum of each named slot, adopted
  unverified until the chunk's first copy out of DRAM (``kvstore.write``).
- Committing stops at the first chunk that cannot be published (a write-through tier failed):
  the chunks named before it are published, it and the rest of the command's are discarded,
  and the error says which.
- The common case costs no awaiting: a slot that fits DRAM now, with no writer queued for
  room, is reserved at once, and a batch of DRAM slots with no write-through tier is published
  in one loop (the same steps per chunk as ``WritePath.commit_new``, the policy looked up and
  the demoter woken once per batch); the GPU pool, a wait for room and write-through tiers
  take the awaited per-chunk path.
- The batch is one lease (``lease-max``, ``lease-max-per-client`` count it once), of the
  connection that reserved it: no other connection can commit or abort it. Expiry while its
  holder is still connected fences each slot still reserved (a published one is the stored
  chunk's already); ``KV.COMMIT lease i…`` of the expired lease then ends the fence of the
  named slots only, since the holder may still be filling the others (``store.fences``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.protocol.errors import CommandError, OutOfMemoryError, RespError
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.sink import StoreSink
from kvstrata.store.kvstore.write import WritePath
from kvstrata.store.leases import (
    NO_HOLDER,
    BatchWriteLease,
    Holder,
    ReservedChunk,
    WriteLease,
    deadline_after,
)
from kvstrata.tiers.alloc import round_up
from kvstrata.tiers.arena import ArenaTier
from kvstrata.tiers.base import Handle, TierError, TierFull

__all__ = [
    "BUSY",
    "EXISTS",
    "BatchItem",
    "BatchReservation",
    "check_room",
    "commit_batch",
    "commit_lease",
    "reserve_batch",
    "slot_unit",
    "take_chunks",
]

#: Per-chunk outcomes of a reservation that made no slot for the chunk.
EXISTS = "exists"  # the chunk is stored already
BUSY = "busy"  # another client is writing (or freeing) it right now


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One chunk of a KV.MRESERVE: its hash and the size of its slot."""

    hash: bytes
    nbytes: int


@dataclass(frozen=True, slots=True)
class BatchReservation:
    """The lease (None when no chunk needed a slot) and, per requested chunk in order, the
    handle of its slot or :data:`EXISTS` / :data:`BUSY`."""

    lease: BatchWriteLease | None
    entries: tuple[Handle | str, ...]


def check_batch(items: Sequence[BatchItem], parent: bytes, limit: int, unit: int = 1) -> None:
    """Refuse duplicate hashes, a first chunk that is its own parent, and a batch larger than
    the tier (it could never be reserved whole). Sizes count in whole allocation units of
    ``unit`` bytes, as the slots take them: 65,536 one-byte chunks need 256 MiB, not 64 KiB."""
    hashes = {item.hash for item in items}
    if len(hashes) != len(items):
        raise CommandError("duplicate hash in the batch: each chunk may appear once")
    if parent and parent in hashes:
        raise CommandError("invalid parent: the chain would loop back to a chunk of the batch")
    total = sum(round_up(item.nbytes, unit) for item in items)
    if total > limit:
        raise CommandError(
            f"invalid nbytes: the batch needs {total} bytes as {len(items)} slots of whole "
            f"{unit}-byte allocation units, the tier has {limit}"
        )


def slot_unit(writes: WritePath) -> int:
    """The allocation unit of the slots KV.MRESERVE makes (DRAM's; the GPU pool's is the same
    4096 bytes)."""
    dram = writes.state.dram
    return dram.unit if isinstance(dram, ArenaTier) else 1


def check_room(
    writes: WritePath,
    ns: str,
    items: Sequence[BatchItem],
    keys: Sequence[ChunkKey] = (),
    found: Sequence[object] = (),
) -> None:
    """Refuse with -OOM, before anything is evicted, a DRAM batch whose new slots exceed what
    evicting every chunk that may leave would free (leased, pinned, moving and fenced chunks
    and other reservations stay): making room for it would empty DRAM and still fail.
    ``keys``: the items' chunk keys when the caller made them already; ``found``: their
    ``state.live`` records, looked up just now."""
    dram = writes.state.dram
    if not isinstance(dram, ArenaTier):
        return
    if not found:
        live = writes.state.live
        keys = keys or [ChunkKey(ns, item.hash) for item in items]
        found = [live(key) for key in keys]
    slot_size = dram.slot_size
    need = sum(
        slot_size(item.nbytes) for item, rec in zip(items, found, strict=True) if rec is None
    )
    if need <= dram.largest_free():
        return  # fits without evicting anything
    most = writes.placement.reclaimable(dram)
    if need > most:
        raise OutOfMemoryError(
            f"the batch needs {need} bytes of DRAM slots but at most {most} of "
            f"{dram.capacity} can be freed (the rest is reserved, leased, pinned or fenced); "
            "nothing was evicted: reserve fewer or smaller chunks, or retry after leases end"
        )


async def reserve_batch(
    writes: WritePath,
    ns: str,
    parent: bytes,
    items: Sequence[BatchItem],
    tokens: int,
    ttl_ms: int,
    tier: str | None = None,
    holder: Holder = NO_HOLDER,
    keys: Sequence[ChunkKey] = (),
) -> BatchReservation:
    """Reserve a slot for each chunk of the chain ``items`` (the first one's parent is
    ``parent``, each next one's the one before it) that is neither stored nor being written.
    ``keys``: the items' chunk keys, given by a caller that ran :func:`check_batch` on
    ``items`` already (``KVStore.reserve_batch``)."""
    state = writes.state
    limit = writes.slot_limit(tier)
    for item in items:
        if not 0 < item.nbytes <= limit:
            raise CommandError(f"invalid nbytes: must be 1 to {limit} (the tier's size)")
    if not keys:
        check_batch(items, parent, limit, slot_unit(writes))
        keys = [ChunkKey(ns, item.hash) for item in items]
    # the chunks stored now, found once for the room check and the loop; valid until the loop
    # first awaits (another writer may publish one of them meanwhile: looked up again then)
    found = [state.live(key) for key in keys]
    if tier != "gpu":
        check_room(writes, ns, items, keys, found)
    reserved: list[ReservedChunk] = []
    entries: list[Handle | str] = []
    live, claim = state.live, state.claim
    awaited = False
    try:
        for i, (item, key) in enumerate(zip(items, keys, strict=True)):
            if (live(key) if awaited else found[i]) is not None:
                entries.append(EXISTS)
            elif not claim(key):
                entries.append(BUSY)
            else:
                chunk = _reserve_now(writes, i, key, parent, tokens, item.nbytes, tier)
                if chunk is None:  # no room now, or the GPU pool: in turn, as KV.RESERVE does
                    awaited = True
                    chunk = await _reserve_one(writes, i, key, parent, tokens, item.nbytes, tier)
                reserved.append(chunk)
                entries.append(chunk.handle)
            parent = item.hash
    except BaseException:
        for chunk in reserved:
            chunk.sink.abort()  # frees the slot and the key's claim
        raise
    if not reserved:
        return BatchReservation(None, tuple(entries))
    lease = BatchWriteLease(
        id=state.leases.new_id(),
        pending={c.index: c for c in reserved},
        deadline=deadline_after(ttl_ms, state.leases.clock),
        holder=holder,
    )
    state.leases.add(lease)
    return BatchReservation(lease, tuple(entries))


def _reserve_now(
    writes: WritePath,
    index: int,
    key: ChunkKey,
    parent: bytes,
    tokens: int,
    nbytes: int,
    tier: str | None,
) -> ReservedChunk | None:
    """:func:`_reserve_one` without awaiting, for the common case: a DRAM slot that fits now
    with no writer queued for room (what ``WritePath.reserve_slot`` does first, in the same
    order: the slot, its trace record, its sink and handle). None: take the awaited path
    (nothing was done). The caller holds the key's claim (released here when this fails)."""
    dram = writes.state.dram
    if tier == "gpu" or dram is None or nbytes > dram.capacity or len(writes.placement.room):
        return None
    try:
        view = dram.reserve(key, nbytes)
    except TierFull:
        return None
    except BaseException:
        writes.state.release_claim(key)
        raise
    if writes.state.tracer is not None:  # (``trace`` would drop it; no arguments built)
        writes.state.trace("reserve", key.namespace, [key.hash], size=nbytes)
    sink = StoreSink(writes.state, key, view)
    return ReservedChunk(index, key, parent, tokens, nbytes, dram.reserved_handle(key), sink)


async def _reserve_one(
    writes: WritePath,
    index: int,
    key: ChunkKey,
    parent: bytes,
    tokens: int,
    nbytes: int,
    tier: str | None,
) -> ReservedChunk:
    """A slot for ``key``, whose claim the caller took (released here when this fails)."""
    try:
        slot = await writes.reserve_slot(key, nbytes, tier == "gpu")
    except BaseException:
        writes.state.release_claim(key)
        raise
    if slot is None:
        writes.state.release_claim(key)
        raise OutOfMemoryError(writes.placement.describe_full(nbytes))
    sink, handle = slot
    return ReservedChunk(index, key, parent, tokens, nbytes, handle, sink)


def take_chunks(
    writes: WritePath, lease_id: str, indexes: Sequence[int], holder: Holder = NO_HOLDER
) -> tuple[BatchWriteLease, list[ReservedChunk]]:
    """The reserved chunks at request positions ``indexes`` of ``holder``'s live KV.MRESERVE
    lease, taken out of it (in chain order); the lease leaves the table when none is left. Of
    an expired lease, only the fences of those slots end (``store.fences``)."""
    wanted = sorted(set(indexes))
    lease = writes.find_write_lease(lease_id, "KV.COMMIT", holder, wanted)
    if not isinstance(lease, BatchWriteLease):
        raise CommandError(f"lease {lease_id} is a KV.RESERVE lease: KV.COMMIT takes no index")
    for i in wanted:
        if i not in lease.pending:
            raise CommandError(
                f"chunk {i} has no reserved slot in lease {lease_id} (stored already, busy, "
                "published already, or no such position)"
            )
    chunks = [lease.pending.pop(i) for i in wanted]
    if not lease.pending:
        writes.state.leases.pop(lease_id)
    return lease, chunks


async def commit_batch(
    writes: WritePath, chunks: Sequence[ReservedChunk], claims: dict[int, bytes] | None = None
) -> None:
    """Publish ``chunks`` (taken out of their lease) in order; on the first failure the rest
    are discarded and the error names the chunk. ``claims``: request position → the writer's
    checksum of that slot (KV.COMMIT DIGEST, see ``WritePath.commit_new``)."""
    for chunk in chunks:
        chunk.sink.consume()
    now = _publishes_now(writes, chunks)
    try:
        for i, chunk in enumerate(chunks):
            try:
                claim = None if claims is None else claims.get(chunk.index)
                if now:
                    _publish_now(writes, chunk, claim)
                    continue
                try:
                    data = await chunk.sink.host_bytes()  # a GPU slot is copied to the host
                except TierError as exc:
                    raise CommandError(f"the reserved slot cannot be read: {exc}") from exc
                await writes.commit_new(
                    chunk.key, chunk.parent, chunk.tokens, None, data, chunk.sink, claim
                )
            except RespError as exc:
                where = (
                    f"KV.COMMIT: chunk {chunk.index} ({chunk.key.hex}) was not published, the "
                    f"{i} named before it were, it and the {len(chunks) - i - 1} after it were "
                    f"discarded: {exc.message}"
                )
                raise CommandError(where, prefix=exc.prefix) from exc
    finally:
        for chunk in chunks:
            chunk.sink.abort()  # a no-op for the published ones
        if now:
            writes.placement.kick()  # once: the chunks' commits changed no tier's fill


def _publishes_now(writes: WritePath, chunks: Sequence[ReservedChunk]) -> bool:
    """True when committing ``chunks`` is bookkeeping only: every slot is in DRAM and no
    write-through tier takes the bytes (``WritePath.commit_new`` would await nothing), so
    the batch is published in one synchronous loop (:func:`_publish_now`) with the policy
    looked up once."""
    return (
        writes.state.dram is not None
        and all(type(chunk.sink) is StoreSink for chunk in chunks)
        and not writes._copied_at_commit()
    )


def _publish_now(writes: WritePath, chunk: ReservedChunk, claim: bytes | None) -> None:
    """``WritePath.commit_new`` of a DRAM slot when no tier takes it at commit, the same steps
    in the same order (checksum or the writer's claim, the trace record, the slot committed,
    the record published) without the per-chunk policy lookups; the caller wakes the
    demoter once for the batch."""
    sink = chunk.sink
    key = chunk.key
    csum, verified = (sink.checksum(), True) if claim is None else (claim, False)
    meta = ChunkMeta(key, chunk.parent, chunk.tokens, sink.nbytes, csum)
    state = writes.state
    if state.tracer is not None:
        writes._trace_put(meta, None)
    try:
        placed = sink.place(meta)
    except Exception:
        state.trace("del", key.namespace, [key.hash])
        raise
    # WritePath._publish of a record with no TTL, its steps in the same order, inlined
    rec = ChunkRecord(key, meta.parent, meta.tokens, meta.size, csum, meta.codec, verified)
    rec.tiers = set(placed)
    state.publish(rec)
    sink.committed()  # the slot belongs to the chunk now; the key is free again
    counters = state.counters
    for name in placed:
        counters[name].bytes_in += meta.size


async def commit_lease(
    writes: WritePath,
    lease_id: str,
    indexes: Sequence[int] = (),
    holder: Holder = NO_HOLDER,
    digests: Sequence[bytes | None] = (),
) -> None:
    """``KVStore.commit``: KV.COMMIT of a KV.RESERVE lease (its slot, ``WritePath.commit``) or
    of a KV.MRESERVE lease (the chunks at ``indexes``, or all that are left)."""
    claims = {i: d for i, d in zip(indexes, digests, strict=False) if d is not None}
    if indexes:
        _, chunks = take_chunks(writes, lease_id, indexes, holder)
        await commit_batch(writes, chunks, claims)
        return
    lease = writes.find_write_lease(lease_id, "KV.COMMIT", holder)
    if digests and not isinstance(lease, WriteLease):  # the lease stays as it was
        raise CommandError("DIGEST with a KV.MRESERVE lease needs the chunks' indexes")
    writes.state.leases.pop(lease_id)
    if isinstance(lease, WriteLease):
        await writes.commit(lease, digests[0] if digests else None)
    else:
        await commit_batch(writes, lease.chunks)
