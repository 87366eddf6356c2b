"""Limits and slicing shared by the commands that take a chain of hashes (issue 12).

A chain command (KV.MATCH, KV.MGET, KV.LEASE, KV.PREFETCH) names at most ``max-chain-chunks``
hashes; KV.MATCHTOKENS takes at most ``max-match-tokens`` tokens, in chunks of at least
``min-chunk-tokens``, making at most ``max-chain-chunks`` hashes. Long but legal work yields to
the event loop every :data:`SLICE` hashes, and large token lists are hashed on one worker
thread, so one client's big command does not stall the others. Importing this module registers
no command.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvstrata.chunks import MAX_HASH_BYTES, validate_hash
from kvstrata.protocol.errors import CommandError, syntax_error
from kvstrata.server.commands._args import int_option
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Args

if TYPE_CHECKING:
    from kvstrata.store.kvstore import KVStore

SLICE = 4096  # hashes handled between two yields to the event loop
THREAD_TOKENS = 65536  # KV.MATCHTOKENS hashes more tokens than this on the hashing thread
_hash_pool: ThreadPoolExecutor | None = None


def check_hashes(raw: Args) -> list[bytes]:
    """Hashes of a chain (1–64 bytes each), cheaply: no copy when they are already bytes."""
    out = []
    for h in raw:
        b = h if type(h) is bytes else bytes(h)
        if not 1 <= len(b) <= MAX_HASH_BYTES:
            validate_hash(b)
        out.append(b)
    return out


def chain_hashes(ctx: Ctx, raw: Args) -> list[bytes]:
    """:func:`check_hashes`, refusing more than ``max-chain-chunks`` of them."""
    limit = ctx.server.config.values["max-chain-chunks"]
    if len(raw) > limit:
        raise CommandError(f"too many chunks: {len(raw)} given, max-chain-chunks is {limit}")
    return check_hashes(raw)


def check_token_limits(values: Mapping[str, Any], ntokens: int, chunk: int) -> None:
    """KV.MATCHTOKENS's limits: tokens, smallest chunk, chunks made."""
    if ntokens > values["max-match-tokens"]:
        raise CommandError(
            f"too many tokens: {ntokens} given, max-match-tokens is {values['max-match-tokens']}"
        )
    if chunk < values["min-chunk-tokens"]:
        raise CommandError(f"invalid CHUNK: min-chunk-tokens is {values['min-chunk-tokens']}")
    if ntokens // chunk > values["max-chain-chunks"]:
        raise CommandError(
            f"too many chunks: {ntokens // chunk} of {chunk} tokens, max-chain-chunks is "
            f"{values['max-chain-chunks']}"
        )


def packed_tokens(tokens: Any) -> int:
    """How many token ids a packed little-endian u32 argument holds (refused unless whole)."""
    nbytes = memoryview(tokens).nbytes
    if nbytes % 4:
        raise CommandError("invalid tokens: length must be a multiple of 4 (packed LE u32)")
    return nbytes // 4


def chunk_options(args: Args, start: int, chunk: int) -> tuple[int, list[bytes]]:
    """``[CHUNK n] [EXTRA x …]`` from ``args[start:]`` (KV.MATCHTOKENS, KV.TIERMATCH TOKENS):
    the chunk size (``chunk`` when not given) and the extra hash inputs, EXTRA taking every
    remaining argument. A word without its value is a syntax error; any other word is an
    unknown option, named in the reply."""
    extra: list[bytes] = []
    i = start
    while i < len(args):
        word = bytes(args[i]).upper()
        if word == b"CHUNK" and i + 1 < len(args):
            chunk = int_option(args[i + 1], "CHUNK", 1, 1 << 20)
            i += 2
        elif word == b"EXTRA" and i + 1 < len(args):
            extra = [bytes(x) for x in args[i + 1 :]]
            break
        elif word in (b"CHUNK", b"EXTRA"):
            raise syntax_error()
        else:
            raise CommandError(f"unknown option '{word[:64].decode('utf-8', 'replace')}'")
    return chunk, extra


async def next_slice(start: int) -> None:
    """Between two slices of a long command, let the other clients run."""
    if start:
        await asyncio.sleep(0)


async def matched_sliced(store: KVStore, ns: str, hashes: list[bytes]) -> list[Any]:
    """``store.matched`` over a long chain, a slice at a time with yields between."""
    records: list[Any] = []
    for start in range(0, len(hashes), SLICE):
        await next_slice(start)
        part = store.matched(ns, hashes[start : start + SLICE])
        records += part
        if len(part) < min(SLICE, len(hashes) - start):
            break
    return records


async def hash_off_loop(tokens: Any, ns: str, chunk: int, extra: list[bytes]) -> list[bytes]:
    """``chunk_hashes`` on the one hashing thread (the bulk stays untouched while it runs)."""
    from kvstrata.store.hashing import chunk_hashes

    global _hash_pool
    if _hash_pool is None:
        _hash_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-hash")
    return await asyncio.get_running_loop().run_in_executor(
        _hash_pool, chunk_hashes, tokens, ns, chunk, extra
    )
