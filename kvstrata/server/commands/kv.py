"""KV.* commands that store, read and inspect chunks (matching is in ``kv_match``, leases in
``kv_lease``).

Handlers validate every argument before touching the store, so bad input gets an error reply
and changes nothing. Chain commands name at most ``max-chain-chunks`` hashes; long but legal
work runs in slices of :data:`SLICE` hashes that yield to the event loop (KV.MATCH, KV.MGET) or
on a worker thread (the hashing of KV.MATCHTOKENS), so other clients stay served.

Trailing option words (``WITHTIERS``, ``PREFETCH``, ``CASCADE``, ``TOKENS``, ``TTL``, ``NX``…)
are matched case-insensitively; in commands that take a variable list of hashes (``KV.MATCH``)
a hash equal to an option word must not be the last argument. Hashes are opaque, so a misspelt
option (``WITHTEIRS``) is a hash: KV.MATCH logs a warning when its last hash is an option word
but for case or one edit (``_near``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstrata.chunks import (
    ChunkKey,
    validate_hash,
    validate_namespace,
    validate_parent,
    validate_tokens,
)
from kvstrata.protocol.errors import CommandError, RespError, syntax_error
from kvstrata.protocol.frames import BulkView
from kvstrata.server.commands._args import int_option
from kvstrata.server.commands._chain import (
    SLICE,
    chain_hashes,
    next_slice,
)
from kvstrata.server.commands.connection import arg_bytes, parse_int
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.kvstore import NOT_NOW, KVStore

NS = Arg("namespace", "string")
HASH = Arg("hash", "string")
HASHES = Arg("hash", "string", multiple=True)
PARENT = Arg("parent", "string")
TTL_MAX = 10 * 365 * 86_400_000


def store_of(ctx: Ctx) -> KVStore:
    store = ctx.server.store
    if store is None:
        raise CommandError("the KV store is not available on this server")
    return store


def parse_options(args: Args, start: int, spec: dict[bytes, Callable[[Any], Any] | None]) -> dict:
    """``WORD value`` / ``FLAG`` options from ``args[start:]``; ``spec`` maps upper-case words
    to a value parser (None for a flag). Unknown words and missing values are errors."""
    out: dict[bytes, Any] = {}
    i = start
    while i < len(args):
        word = arg_bytes(args[i]).upper()
        if word not in spec:
            text = word[:64].decode("utf-8", "replace")
            raise CommandError(f"unknown option '{text}'")
        parse = spec[word]
        if parse is None:
            out[word] = True
            i += 1
            continue
        if i + 1 >= len(args):
            raise syntax_error()
        out[word] = parse(args[i + 1])
        i += 2
    return out


def tokens_option(arg: Any) -> int:
    return validate_tokens(parse_int(arg, CommandError("invalid TOKENS: value is not an integer")))


def _ttl(arg: Any) -> int:
    return int_option(arg, "TTL", 1, TTL_MAX)


# -- KV.PUT --------------------------------------------------------------------------------------


def _put_sink(ctx: Any, args_so_far: list[Any], nbytes: int) -> Any:
    """A reserved DRAM slot for the payload (argument 4) of a valid KV.PUT, else None."""
    if len(args_so_far) != 4:
        return None
    store = getattr(ctx.server, "store", None)
    if store is None:
        return None
    try:
        ns = validate_namespace(args_so_far[1])
        h = validate_hash(args_so_far[2])
        parent = validate_parent(args_so_far[3], h)
    except RespError:
        return None
    return store.reserve_put(ns, h, parent, nbytes)


#: most token ids one chunk may carry (TOKENIDS): the largest chunk-tokens
MAX_TOKEN_IDS = 1 << 20


def token_ids_option(arg: Any) -> bytes:
    """TOKENIDS: the chunk's token ids, packed little-endian u32 (sent in KV events)."""
    ids = arg_bytes(arg)
    if not ids or len(ids) % 4:
        raise CommandError("invalid TOKENIDS: must be packed LE u32, a non-empty multiple of 4")
    if len(ids) // 4 > MAX_TOKEN_IDS:
        raise CommandError(f"invalid TOKENIDS: more than {MAX_TOKEN_IDS} token ids")
    return ids


def token_ids_count(opts: dict[bytes, Any]) -> int:
    """TOKENS, or the number of TOKENIDS when only those were given (they must agree)."""
    ids = opts.get(b"TOKENIDS")
    tokens = opts.get(b"TOKENS")
    if ids is None:
        return tokens or 0
    if tokens is not None and tokens != len(ids) // 4:
        raise CommandError(f"invalid TOKENIDS: {len(ids) // 4} token ids for TOKENS {tokens}")
    return len(ids) // 4


_PUT_OPTIONS: dict[bytes, Callable[[Any], Any] | None] = {
    b"TOKENS": tokens_option,
    b"TOKENIDS": token_ids_option,
    b"TTL": _ttl,
    b"NX": None,
}


@command(
    "KV.PUT",
    -5,
    "write denyoom",
    group="kv",
    summary="Stores one chunk (parent empty for the first chunk of a chain). A large payload is "
    "received straight into its DRAM slot. TTL is the chunk's time to live in ms. TOKENIDS "
    "(packed LE u32, TOKENS defaults to their number) go out in its KV events "
    "(kv-events-endpoint; ignored when off).",
    arguments=(
        NS,
        HASH,
        PARENT,
        Arg("payload", "string"),
        Arg("tokens", "integer", optional=True, token="TOKENS"),
        Arg("token-ids", "string", optional=True, token="TOKENIDS"),
        Arg("ttl", "integer", optional=True, token="TTL"),
        Arg("nx", "pure-token", optional=True, token="NX"),
    ),
    reply="Integer: 1 when stored, 0 when NX was given and the chunk already exists. "
    "-OOM when it fits in no tier; `-OOM N writes are already waiting for DRAM room "
    "(write-wait-queue)` / `-OOM no DRAM room for N bytes within S s (write-wait-timeout)` "
    "when the queue for DRAM room is full or its wait ran out. -BUSY when the chunk is stored "
    "with other bytes and leased (`-BUSY chunk … is leased; retry after KV.RELEASE`), or "
    "another client's write or free of it did not end within 30 s (`-BUSY chunk … is being "
    "written or freed; retry`).",
    sink=_put_sink,
)
def kv_put(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    h = validate_hash(args[2])
    parent = validate_parent(args[3], h)
    opts = parse_options(args, 5, _PUT_OPTIONS)
    store = store_of(ctx)
    store.check_link(ns, h, parent)
    sink = ctx.sinks.get(4)
    payload = args[4] if sink is None else sink.view
    if not memoryview(payload).nbytes:
        raise CommandError("invalid payload: empty")
    tokens, ttl = token_ids_count(opts), opts.get(b"TTL")
    ids = opts.get(b"TOKENIDS")
    events = store.events if ids is not None else None
    if events is not None and ids is not None:  # ids is not None whenever events is set
        events.expect_tokens(ChunkKey(ns, h), ids)
    if sink is not None:  # the payload is already in its arena slot: usually nothing to await
        try:
            done = store.put_sink_now(ns, h, parent, tokens, ttl, sink)
        except BaseException:
            if events is not None:
                events.forget_tokens(ChunkKey(ns, h))
            raise
        if done is not NOT_NOW:
            if events is not None:
                events.forget_tokens(ChunkKey(ns, h))
            return 1
    return _put_slow(store, ns, h, parent, payload, tokens, ttl, b"NX" in opts, sink, events)


async def _put_slow(
    store: KVStore, ns: str, h: bytes, parent: bytes, payload: Any, tokens: int,
    ttl: int | None, nx: bool, sink: Any, events: Any = None,
) -> Reply:  # fmt: skip
    try:
        return 1 if await store.put(ns, h, parent, payload, tokens, ttl, nx, sink) else 0
    finally:
        if events is not None:
            events.forget_tokens(ChunkKey(ns, h))


# -- KV.GET / KV.MGET ----------------------------------------------------------------------------


def _reply(payload: Any) -> Reply:
    return None if payload is None else BulkView(payload.view, payload.release)


def _count(ctx: Ctx, payload: Any) -> Any:
    """INFO keyspace_hits/keyspace_misses count chunk reads as Redis counts GETs."""
    if payload is None:
        ctx.server.keyspace.misses += 1
    else:
        ctx.server.keyspace.hits += 1
    return payload


@command(
    "KV.GET",
    3,
    "readonly",
    group="kv",
    summary="Returns a chunk's payload; a chunk in a cold tier is read through (and promoted).",
    arguments=(NS, HASH),
    reply="Bulk string: the payload, or null when the chunk is not cached.",
)
def kv_get(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    h = validate_hash(args[2])
    store = store_of(ctx)
    payload = store.get_now(ns, h)
    if payload is NOT_NOW:
        return _get_slow(ctx, store, ns, h)  # a coroutine: the connection awaits it, in order
    return _reply(_count(ctx, payload))


async def _get_slow(ctx: Ctx, store: KVStore, ns: str, h: bytes) -> Reply:
    return _reply(_count(ctx, await store.get(ns, h)))


@command(
    "KV.MGET",
    -3,
    "readonly",
    group="kv",
    summary="Returns the payloads of several chunks of one namespace.",
    complexity="O(N) chunks",
    arguments=(NS, HASHES),
    reply="Array: one bulk string or null per hash."
    " -ERR too many chunks when more hashes than max-chain-chunks are given.",
)
async def kv_mget(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    hashes = chain_hashes(ctx, args[2:])
    store = store_of(ctx)
    out: list[Reply] = []
    for start in range(0, len(hashes), SLICE):
        await next_slice(start)
        out += [_reply(_count(ctx, p)) for p in await store.mget(ns, hashes[start : start + SLICE])]
    return out


# -- KV.INFO / KV.DEL / KV.STATS / KV.REGIONS ----------------------------------------------------


@command(
    "KV.INFO",
    3,
    "readonly fast",
    group="kv",
    summary="Where a chunk lives and its metadata: tiers, size, tokens, parent, children, hits, "
    "last access, checksum, leases, TTL.",
    arguments=(NS, HASH),
    reply="Map, or null when the chunk is not cached. ttl is -1 without expiry.",
)
def kv_info(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    h = validate_hash(args[2])
    return store_of(ctx).info(ns, h)


@command(
    "KV.DEL",
    -3,
    "write",
    group="kv",
    summary="Deletes a chunk from every tier; CASCADE also deletes its descendants.",
    complexity="O(N) deleted chunks",
    arguments=(NS, HASH, Arg("cascade", "pure-token", optional=True, token="CASCADE")),
    reply="Integer: number of chunks deleted.",
)
async def kv_del(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    h = validate_hash(args[2])
    opts = parse_options(args, 3, {b"CASCADE": None})
    return await store_of(ctx).delete(ns, h, b"CASCADE" in opts)


@command(
    "KV.STATS",
    1,
    "readonly",
    group="kv",
    summary="Per tier: capacity, used, chunks, hits, misses, promotions, demotions, evictions, "
    "bytes in and out, errors and the tier's own fields. A chunk read (KV.GET, KV.MGET, each "
    "chunk of KV.LEASE) is one hit in the tier it was found in, before any promotion (a lease "
    "of a chunk held in NVMe is an NVMe hit and a DRAM promotion), and a miss in each faster tier.",
    reply="Map: tier name → map of counters.",
)
def kv_stats(ctx: Ctx, args: Args) -> Reply:
    return store_of(ctx).stats()


@command(
    "KV.REGIONS",
    1,
    "readonly fast",
    group="kv",
    summary="The shared memory regions a client maps once to read leased chunks.",
    reply="Array of maps {name, kind (shm|cuda), size, path, device, pci_bus_id, instance}; "
    "instance is the region's identity in this server instance (random per start), also in "
    "every handle.",
)
def kv_regions(ctx: Ctx, args: Args) -> Reply:
    return [
        {"name": r.name, "kind": r.kind, "size": r.size, "path": r.path, "device": r.device,
         "pci_bus_id": r.pci_bus_id, "instance": r.instance}
        for r in store_of(ctx).regions()
    ]  # fmt: skip
