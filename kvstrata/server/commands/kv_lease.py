"""KV.* lease commands: zero-copy reads (LEASE/RELEASE) and writes (RESERVE/COMMIT/ABORT).

A lease id is an unguessable capability over pinned memory; every lease has a TTL (``TTL ms``,
default ``lease-ttl``) after which the server ends it. In KV.RESERVE, TTL is the lifetime of
the write lease (the time to write and commit), not an expiry of the chunk; a write lease's TTL
and the bytes one connection holds through write leases are bounded (``store.write_limits``).

``TIER gpu|dram`` chooses where the handles point. KV.LEASE defaults to the fastest shareable
tier (``gpu`` when the server has a GPU tier) and falls back to DRAM per chunk when the GPU
cannot take it, so a lease may mix ``cuda`` and ``shm`` handles; a client without CUDA sends
``TIER dram``. KV.RESERVE defaults to ``dram``. In KV.LEASE a hash equal to ``TTL`` or
``TIER`` must not be second to last.

KV.MRESERVE reserves the slots of several chunks of one chain under one write lease (see
``store.kvstore.batch``); KV.COMMIT and KV.ABORT of that lease publish or discard them all.

A lease belongs to the connection that took it (:func:`holder_of`): KV.COMMIT, KV.ABORT and
KV.RELEASE of another connection's lease id, live or expired, are answered ``-NOLEASE`` exactly
as for an unknown id and touch nothing (ids appear in MONITOR and SLOWLOG). What a holder's
commands do to its own expired lease is described in ``store.fences``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from operator import contains
from typing import TYPE_CHECKING, Any

from kvstrata.chunks import ChunkKey, validate_hash, validate_namespace, validate_parent
from kvstrata.protocol.errors import CommandError, LeaseError
from kvstrata.protocol.frames import OK, Simple
from kvstrata.server.commands.connection import arg_bytes
from kvstrata.server.commands.kv import (
    HASH,
    HASHES,
    NS,
    PARENT,
    chain_hashes,
    int_option,
    parse_options,
    store_of,
    token_ids_option,
    tokens_option,
)
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.kvstore.batch import BatchItem
from kvstrata.store.leases import Holder
from kvstrata.tiers.checksum import CHECKSUM_BYTES

if TYPE_CHECKING:
    from kvstrata.store.kvstore import KVStore

LEASE_TTL_MAX = 86_400_000
TTL = Arg("ttl", "integer", optional=True, token="TTL")
TIER = Arg("tier", "string", optional=True, token="TIER")
LEASE = Arg("lease", "string")
_TIERS = ("gpu", "dram")


def _lease_ttl(arg: Any) -> int:
    return int_option(arg, "TTL", 1, LEASE_TTL_MAX)


def _tier(arg: Any) -> str:
    name = arg_bytes(arg).decode("utf-8", "replace").lower()
    if name not in _TIERS:
        raise CommandError(f"invalid TIER '{name[:32]}': must be gpu or dram")
    return name


_MRESERVE_OPTIONS: dict[bytes, Callable[[Any], Any] | None] = {
    b"TOKENS": tokens_option,
    b"TOKENIDS": token_ids_option,
    b"TTL": _lease_ttl,
    b"TIER": _tier,
}


def _handle(h: Any) -> list[Any]:
    return [h.region, h.offset, h.length, h.instance]


def holder_of(ctx: Ctx) -> Holder:
    """The connection as a lease holder: alive while the server still lists it."""
    cid = ctx.client.id
    return Holder(cid, partial(contains, ctx.server.clients, cid))


def _lease_id(arg: Any) -> str:
    raw = arg_bytes(arg)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise LeaseError("no such lease (unknown, ended or expired)") from None


@command(
    "KV.LEASE",
    -3,
    "write",
    group="kv",
    summary="Zero-copy read: promotes the leading cached chunks into a shareable tier (TIER "
    "gpu or dram; default gpu when the server has a GPU tier, else dram; a chunk the GPU cannot "
    "take is leased from DRAM), pins them and returns a handle (region, offset, length) for "
    "each, stopping at the first miss.",
    complexity="O(N) hashes",
    arguments=(NS, HASHES, TTL, TIER),
    reply="Array: [lease id or null, [[region, offset, length, instance], ...]] (null and an "
    "empty list when the first chunk is not cached); -LEASELIMIT past lease-max, "
    "lease-max-per-client or lease-fence-max; -ERR too many chunks when more hashes than "
    "max-chain-chunks are given.",
)
async def kv_lease(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    end = len(args)
    ttl: int | None = None
    tier: str | None = None
    while end >= 5:
        word = arg_bytes(args[end - 2]).upper() if len(args[end - 2]) <= 4 else b""
        if word == b"TTL" and ttl is None:
            ttl = _lease_ttl(args[end - 1])
        elif word == b"TIER" and tier is None:
            tier = _tier(args[end - 1])
        else:
            break
        end -= 2
    hashes = chain_hashes(ctx, args[2:end])
    lease = await store_of(ctx).lease(ns, hashes, ttl, tier, holder_of(ctx))
    if lease is None:
        return [None, []]
    return [lease.id, [_handle(h) for h in lease.handles]]


@command(
    "KV.RESERVE",
    -5,
    "write denyoom",
    group="kv",
    summary="Zero-copy write: reserves an invisible slot of nbytes (in DRAM; TIER gpu: in the "
    "GPU pool, or DRAM when it has no room) and returns a write lease with its handle; "
    "KV.COMMIT publishes it. TTL is the lease's lifetime in ms.",
    arguments=(
        NS,
        HASH,
        PARENT,
        Arg("nbytes", "integer"),
        Arg("tokens", "integer", optional=True, token="TOKENS"),
        TTL,
        TIER,
    ),
    reply="Array: [lease id, [region, offset, length, instance]]; -LEASELIMIT past lease-max, "
    "lease-max-per-client, lease-fence-max or lease-reserve-max-per-client (this "
    "connection's live write-lease bytes), or for a TTL above write-lease-ttl-max (without "
    "TTL, lease-ttl cut to it); -OOM when no slot can be made, or "
    "(write-wait-queue, write-wait-timeout) when the queue for DRAM room is full or its wait "
    "ran out. -BUSY when another client is writing or freeing the chunk at that moment "
    "(`-BUSY chunk … is being written or freed by another client`; retry).",
)
async def kv_reserve(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    h = validate_hash(args[2])
    parent = validate_parent(args[3], h)
    store_of(ctx).check_link(ns, h, parent)
    nbytes = int_option(args[4], "nbytes", 1, 2**62)
    opts = parse_options(
        args,
        5,
        {
            b"TOKENS": tokens_option,
            b"TTL": _lease_ttl,
            b"TIER": _tier,
        },
    )
    store = store_of(ctx)
    lease = await store.reserve(
        ns, h, parent, nbytes, opts.get(b"TOKENS", 0), opts.get(b"TTL"), opts.get(b"TIER"),
        holder_of(ctx),
    )  # fmt: skip
    return [lease.id, _handle(lease.handle)]


def _batch_items(ctx: Ctx, args: Args) -> tuple[list[BatchItem], int]:
    """The ``count`` (hash, nbytes) pairs from ``args[3]`` on, and where the options start."""
    limit = ctx.server.config.values["max-chain-chunks"]
    count = int_option(args[3], "count", 1, 2**31)
    if count > limit:
        raise CommandError(f"too many chunks: {count} given, max-chain-chunks is {limit}")
    end = 4 + 2 * count
    if len(args) < end:
        pairs = (len(args) - 4) // 2
        raise CommandError(f"count is {count} but only {pairs} hash nbytes pairs follow")
    items = [
        BatchItem(validate_hash(args[i]), int_option(args[i + 1], "nbytes", 1, 2**62))
        for i in range(4, end, 2)
    ]
    return items, end


def _batch_token_ids(store: KVStore, ns: str, items: list[BatchItem], opts: dict) -> int:
    """TOKENS of every chunk; TOKENIDS (every chunk's ids, in chain order) are split per chunk
    and handed to the KV events, which keep them until the chunk is published."""
    ids = opts.get(b"TOKENIDS")
    if ids is None:
        return int(opts.get(b"TOKENS", 0))
    n, per = len(ids) // 4, opts.get(b"TOKENS")
    if per is None:
        if n % len(items):
            raise CommandError(f"invalid TOKENIDS: {n} token ids for {len(items)} chunks")
        per = n // len(items)
    if per * len(items) != n:
        raise CommandError(f"invalid TOKENIDS: {n} token ids for {len(items)} chunks of {per}")
    events = store.events
    if events is not None:
        for i, item in enumerate(items):
            events.expect_tokens(ChunkKey(ns, item.hash), ids[4 * per * i : 4 * per * (i + 1)])
    return int(per)


@command(
    "KV.MRESERVE",
    -6,
    "write denyoom",
    group="kv",
    summary="Batched zero-copy write: reserves invisible slots for count chunks of one chain "
    "(the first linked to parent, each next one to the one before it) under one write lease. "
    "All-or-nothing for memory: when one slot cannot be made, none is kept. A chunk that is "
    "stored already or being written by another client gets no slot. KV.COMMIT publishes "
    "every slot in chain order, KV.ABORT frees them all. TOKENS applies to every chunk; "
    "TOKENIDS (every chunk's packed LE u32 ids, in order) go out in their KV events.",
    complexity="O(N) chunks",
    arguments=(
        NS,
        PARENT,
        Arg("count", "integer"),
        Arg(
            "chunk",
            "block",
            multiple=True,
            arguments=(Arg("hash", "string"), Arg("nbytes", "integer")),
        ),
        Arg("tokens", "integer", optional=True, token="TOKENS"),
        Arg("token-ids", "string", optional=True, token="TOKENIDS"),
        TTL,
        TIER,
    ),
    reply="Array: [lease id or null, [entry, ...]], one entry per chunk in order: its slot "
    "[region, offset, length, instance], or the simple string exists (stored already) or busy "
    "(another client is writing it); the lease id is null when no chunk got a slot. "
    "-ERR for a duplicate hash, a count that does not match the pairs or exceeds "
    "max-chain-chunks, or a batch larger than the tier (counting each slot in whole 4 KiB "
    "allocation units); -LEASELIMIT past lease-max, lease-max-per-client, lease-fence-max or "
    "lease-reserve-max-per-client (the whole batch counts), or for a TTL above "
    "write-lease-ttl-max; -OOM when a slot cannot be made (nothing is reserved then), at "
    "once and without evicting anything when the batch exceeds what evicting every chunk "
    "that may leave DRAM would free.",
)
async def kv_mreserve(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    parent = validate_parent(args[2])
    items, end = _batch_items(ctx, args)
    opts = parse_options(args, end, _MRESERVE_OPTIONS)
    store = store_of(ctx)
    tokens = _batch_token_ids(store, ns, items, opts)
    res = await store.reserve_batch(
        ns, parent, items, tokens, opts.get(b"TTL"), opts.get(b"TIER"), holder_of(ctx),
    )  # fmt: skip
    # each slot a tuple (the same RESP array as a list): the reply's pin scan skips tuples
    entries = [
        Simple(e.encode()) if isinstance(e, str) else (e.region, e.offset, e.length, e.instance)
        for e in res.entries
    ]
    return [None if res.lease is None else res.lease.id, entries]


@command(
    "KV.COMMIT",
    -2,
    "write",
    group="kv",
    summary="Publishes a reserved chunk (KV.RESERVE) or the chunks of a batch (KV.MRESERVE, in "
    "chain order): its checksum is computed over the written bytes (a GPU slot is first copied "
    "to DRAM), then it becomes visible (and is written to write-through tiers). With index "
    "arguments (positions in the KV.MRESERVE request), only those chunks of the batch are "
    "published and the others stay reserved, so a writer can publish each chunk as soon as "
    "it is written; without, every chunk left. The lease ends when no chunk is left. DIGEST "
    "gives the writer's xxh3-128 of each slot (16 bytes, or empty for none; one per index, or "
    "one for a KV.RESERVE lease): a DRAM slot's digest is kept instead of hashing the slot, "
    "marked unverified (KV.INFO checksum_verified 0) until the chunk's first copy out of DRAM "
    "checks it; a wrong digest then drops the chunk as corrupt (INFO kv_digest_failures), "
    "never serves other bytes. A slot the commit copies anyway (GPU, write-through) is checked "
    "at once.",
    arguments=(
        LEASE,
        Arg("index", "integer", optional=True, multiple=True),
        Arg("digest", "string", optional=True, multiple=True, token="DIGEST"),
    ),
    reply="Simple string OK; -NOLEASE for an unknown, expired or read lease, and for a lease "
    "another connection took (answered as an unknown one, untouched). An expired lease is never "
    "committed: -NOLEASE ... expired, and its slots, kept from reuse while this connection may "
    "still write them, are freed (with indexes, only the named slots of a batch; the others "
    "stay held until they are named, the lease is committed without index or aborted, or the "
    "connection closes). -ERR for an index with no reserved slot in the lease, or any index "
    "with a KV.RESERVE lease. When a chunk of a batch cannot be published, the error names it: "
    "the chunks named before it are published, it and the rest are discarded; a DIGEST that "
    "does not match bytes the commit hashes is such a failure. -ERR for DIGEST arguments that "
    "are not one per index (one without index), or not 16 bytes or empty.",
)
async def kv_commit(ctx: Ctx, args: Args) -> Reply:
    lease_id = _lease_id(args[1])
    rest = list(args[2:])
    digests: list[bytes | None] = []
    at = next(
        (i for i, a in enumerate(rest) if len(a) == 6 and arg_bytes(a).upper() == b"DIGEST"),
        None,
    )  # (the length first: 64 indexes go before it in a batch's commit)
    if at is not None:
        digests = [_digest(a) for a in rest[at + 1 :]]
        rest = rest[:at]
    indexes = [int_option(a, "index", 0, 2**31) for a in rest]
    if at is not None and len(digests) != max(1, len(indexes)):
        raise CommandError(
            f"DIGEST takes one digest per index ({len(indexes)}), or one without index; "
            f"got {len(digests)}"
        )
    await store_of(ctx).commit(lease_id, indexes, holder_of(ctx), digests)
    return OK


def _digest(arg: Any) -> bytes | None:
    raw = arg_bytes(arg)
    if not raw:
        return None
    if len(raw) != CHECKSUM_BYTES:
        raise CommandError(f"invalid DIGEST: an xxh3-128 digest is {CHECKSUM_BYTES} bytes")
    return bytes(raw)


@command(
    "KV.ABORT",
    2,
    "write fast",
    group="kv",
    summary="Discards a reserved chunk (or every chunk of a KV.MRESERVE batch) and frees its "
    "slot.",
    arguments=(LEASE,),
    reply="Simple string OK; -NOLEASE for an unknown, expired or read lease, and for a lease "
    "another connection took (answered as an unknown one, untouched); of an expired lease "
    "(-NOLEASE ... expired) every slot is freed.",
)
def kv_abort(ctx: Ctx, args: Args) -> Reply:
    store_of(ctx).abort(_lease_id(args[1]), holder_of(ctx))
    return OK


@command(
    "KV.RELEASE",
    2,
    "write fast",
    group="kv",
    summary="Ends a read lease: its chunks may be moved or evicted again.",
    arguments=(LEASE,),
    reply="Simple string OK; -NOLEASE for an unknown, expired or write lease, and for a lease "
    "another connection took (answered as an unknown one, untouched); of an expired lease "
    "(-NOLEASE ... expired) the slots are freed.",
)
def kv_release(ctx: Ctx, args: Args) -> Reply:
    store_of(ctx).release(_lease_id(args[1]), holder_of(ctx))
    return OK
