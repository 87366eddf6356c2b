"""KV.MATCH and KV.MATCHTOKENS: how much of a chain (of hashes, or of token ids hashed server
side) is cached, in one round trip.

A chain the index holds is matched on the compiled path when it is in DRAM
(``server/_fastpath_kv.h``); these handlers are its Python twin and take everything else: long
chains in slices of :data:`SLICE` hashes, token lists hashed on the hashing thread, the part of
a chain looked up in s3. ``WITHTIERS`` and ``PREFETCH`` are matched case-insensitively and must
be last; a misspelt one is a hash, and logs a warning (``_near``).
"""

from __future__ import annotations

from typing import Any

from kvstrata.chunks import validate_namespace
from kvstrata.server.commands._chain import (
    SLICE,
    THREAD_TOKENS,
    chain_hashes,
    check_token_limits,
    chunk_options,
    hash_off_loop,
    matched_sliced,
    packed_tokens,
)
from kvstrata.server.commands._near import warn_if_option_like
from kvstrata.server.commands.connection import arg_bytes
from kvstrata.server.commands.kv import HASHES, NS, store_of
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.kvstore import KVStore

# -- KV.MATCH / KV.MATCHTOKENS -------------------------------------------------------------------

_MATCH_WORDS = (b"WITHTIERS", b"PREFETCH")


@command(
    "KV.MATCH",
    -3,
    "readonly fast",
    group="kv",
    summary="Length of the longest cached prefix of a hash chain, in one round trip. The part "
    "of the chain this node does not hold is looked up in s3 (chunks stored by other nodes). "
    "WITHTIERS adds the fastest tier of each matched chunk; PREFETCH queues the matched "
    "chunks for promotion into DRAM in the background. A hash equal to an option word must not "
    "be last; hashes are opaque, so a misspelt option (WITHTEIRS) is taken as a hash, and the "
    "server logs a warning when the last hash is an option but for case or one edit.",
    complexity="O(N) hashes",
    arguments=(
        NS,
        HASHES,
        Arg("withtiers", "pure-token", optional=True, token="WITHTIERS"),
        Arg("prefetch", "pure-token", optional=True, token="PREFETCH"),
    ),
    reply="Integer: number of leading chunks cached; with WITHTIERS an array [count, [tier, ...]]."
    " -ERR too many chunks when more hashes than max-chain-chunks are given.",
)
def kv_match(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    end = len(args)
    flags: set[bytes] = set()
    while end > 3 and len(args[end - 1]) <= 9 and arg_bytes(args[end - 1]).upper() in _MATCH_WORDS:
        flags.add(arg_bytes(args[end - 1]).upper())
        end -= 1
    if 7 <= len(args[end - 1]) <= 10:  # WITHTIERS, PREFETCH but for case or one edit?
        warn_if_option_like("KV.MATCH", arg_bytes(args[end - 1]), _MATCH_WORDS, ctx.client.addr)
    hashes = chain_hashes(ctx, args[2:end])
    store = store_of(ctx)
    if len(hashes) > SLICE:
        return _match_sliced(store, ns, hashes, flags)
    records = store.matched(ns, hashes)
    if store.wants_remote(len(records), len(hashes)):
        # Only now is there I/O: the connection awaits the returned coroutine.
        return _match_remote(store, ns, hashes, records, flags)
    return _match_reply(store, ns, records, flags)


async def _match_sliced(store: KVStore, ns: str, hashes: list[bytes], flags: set[bytes]) -> Reply:
    records = await matched_sliced(store, ns, hashes)
    if store.wants_remote(len(records), len(hashes)):
        records = await store.match_remote(ns, hashes, records)
    return _match_reply(store, ns, records, flags)


def _match_reply(store: KVStore, ns: str, records: list[Any], flags: set[bytes]) -> Reply:
    if b"PREFETCH" in flags and records:
        store.prefetch(ns, [r.key.hash for r in records])
    if b"WITHTIERS" in flags:
        return [len(records), store.tiers_of(records)]
    return len(records)


async def _match_remote(
    store: KVStore, ns: str, hashes: list[bytes], records: list[Any], flags: set[bytes]
) -> Reply:
    return _match_reply(store, ns, await store.match_remote(ns, hashes, records), flags)


@command(
    "KV.MATCHTOKENS",
    -3,
    "readonly",
    group="kv",
    summary="Hashes packed little-endian u32 token ids server side (docs/hashing.md) and matches "
    "the chain. CHUNK defaults to chunk-tokens; EXTRA takes every remaining argument.",
    complexity="O(N) tokens",
    arguments=(
        NS,
        Arg("tokens", "string"),
        Arg("chunk", "integer", optional=True, token="CHUNK"),
        Arg("extra", "string", optional=True, multiple=True, token="EXTRA"),
    ),
    reply="Array: [matched tokens, matched chunks, [hash of every full chunk, ...]]. -ERR too "
    "many tokens above max-match-tokens; -ERR invalid CHUNK below min-chunk-tokens; -ERR too "
    "many chunks when the tokens make more chunks than max-chain-chunks.",
)
def kv_matchtokens(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    tokens = args[2]
    ntokens = packed_tokens(tokens)
    store = store_of(ctx)
    chunk, extra = chunk_options(args, 3, int(store.config.chunk_tokens))
    check_token_limits(ctx.server.config.values, ntokens, chunk)
    from kvstrata.store.hashing import chunk_hashes

    if ntokens > THREAD_TOKENS:
        return _matchtokens_threaded(store, ns, tokens, chunk, extra)
    hashes = chunk_hashes(arg_bytes(tokens), ns, chunk, extra)
    records = store.matched(ns, hashes)
    if store.wants_remote(len(records), len(hashes)):
        return _matchtokens_remote(store, ns, hashes, records, chunk)
    return [len(records) * chunk, len(records), hashes]


async def _matchtokens_threaded(
    store: KVStore, ns: str, tokens: Any, chunk: int, extra: list[bytes]
) -> Reply:
    """Hash on the hashing thread, then match in slices: the loop never waits on either."""
    hashes = await hash_off_loop(tokens, ns, chunk, extra)
    return await _matchtokens_remote(
        store, ns, hashes, await matched_sliced(store, ns, hashes), chunk
    )


async def _matchtokens_remote(
    store: KVStore, ns: str, hashes: list[bytes], records: list[Any], chunk: int
) -> Reply:
    if store.wants_remote(len(records), len(hashes)):
        records = await store.match_remote(ns, hashes, records)
    matched = len(records)
    return [matched * chunk, matched, hashes]
