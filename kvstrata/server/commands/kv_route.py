"""KV.TIERMATCH: what a router that polls (rather than following KV events) asks a node.

One call, by hashes or by token ids (hashed server side as KV.MATCHTOKENS does): the node's
name (``kv-events-node``, the one in its event topics), how many leading chunks it holds in any
tier and their tokens, and per tier the longest prefix held entirely in that tier, so a router
can price a load from DRAM against one from NVMe or S3. Read only: no chunk is touched (a poll
is not an access), nothing is looked up in s3. The same answer is served as JSON on the metrics
port (``GET /tiermatch?ns=…&hashes=hex,hex`` or ``&tokens=1,2,3&chunk=16``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.chunks import validate_namespace
from kvstrata.protocol.errors import CommandError
from kvstrata.server.commands._chain import (
    SLICE,
    chain_hashes,
    check_hashes,
    check_token_limits,
    chunk_options,
    hash_off_loop,
    next_slice,
    packed_tokens,
)
from kvstrata.server.commands.connection import arg_bytes
from kvstrata.server.commands.kv import NS, store_of
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.events import TierWalk
from kvstrata.store.keyspace import now_ms

if TYPE_CHECKING:
    from kvstrata.store.kvstore import KVStore


@command(
    "KV.TIERMATCH",
    -4,
    "readonly",
    group="kv",
    summary="For routers that poll: the node's name, the longest prefix of a chain it holds "
    "(chunks, tokens) and, per tier, the longest prefix held entirely in that tier. HASHES "
    "takes the chain's hashes; TOKENS packed LE u32 token ids hashed as KV.MATCHTOKENS does "
    "(CHUNK, EXTRA as there). Touches nothing, looks nothing up in s3.",
    complexity="O(N) hashes",
    arguments=(
        NS,
        Arg(
            "chain",
            "oneof",
            arguments=(
                Arg("hashes", "string", token="HASHES", multiple=True),
                Arg("tokens", "string", token="TOKENS"),
            ),
        ),
        Arg("chunk", "integer", optional=True, token="CHUNK"),
        Arg("extra", "string", optional=True, multiple=True, token="EXTRA"),
    ),
    reply="Map: node, matched (chunks), tokens, tiers (map tier → chunks); with TOKENS also "
    "hashes (every full chunk's hash).",
)
def kv_tiermatch(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    store = store_of(ctx)
    word = arg_bytes(args[2]).upper()
    if word == b"HASHES":
        hashes = chain_hashes(ctx, args[3:])
        if len(hashes) <= SLICE:
            return _reply(ctx.server, _walk(store, ns, hashes), None, hashes)
        return tier_match(ctx.server, store, ns, hashes, None)
    if word != b"TOKENS":
        raise CommandError("expected HASHES or TOKENS after the namespace")
    tokens = args[3]
    ntokens = packed_tokens(tokens)
    chunk, extra = chunk_options(args, 4, int(store.config.chunk_tokens))
    check_token_limits(ctx.server.config.values, ntokens, chunk)
    return _tokens_match(ctx.server, store, ns, tokens, chunk, extra)


async def _tokens_match(
    server: Any, store: KVStore, ns: str, tokens: Any, chunk: int, extra: list[bytes]
) -> Reply:
    hashes = await hash_off_loop(tokens, ns, chunk, extra)
    return await tier_match(server, store, ns, hashes, chunk)


async def tier_match(
    server: Any, store: KVStore, ns: str, hashes: list[bytes], chunk: int | None
) -> dict[str, Any]:
    """The reply of KV.TIERMATCH (and of ``/tiermatch``), a slice at a time."""
    walk = _walk(store, ns, [])
    for start in range(0, len(hashes), SLICE):
        await next_slice(start)
        walk.feed(hashes[start : start + SLICE])
        if walk.done:
            break
    return _reply(server, walk, chunk, hashes)


def _walk(store: KVStore, ns: str, hashes: list[bytes]) -> TierWalk:
    walk = TierWalk(store.state.index.get, ns, [t.name for t in store.tiers], now_ms())
    walk.feed(hashes)
    return walk


def _reply(server: Any, walk: TierWalk, chunk: int | None, hashes: list[bytes]) -> dict[str, Any]:
    from kvstrata.server.events import node_name

    out: dict[str, Any] = {
        "node": server.events.node if server.events is not None else node_name(
            server.config, server.port
        ),
        "matched": walk.matched,
        "tokens": walk.matched * chunk if chunk is not None else walk.tokens,
        "tiers": walk.tiers,
    }
    if chunk is not None:
        out["hashes"] = hashes
    return out


async def tier_match_query(server: Any, path: bytes) -> dict[str, Any]:
    """``/tiermatch?ns=…&hashes=hex,hex`` or ``…&tokens=1,2,3&chunk=16`` → the KV.TIERMATCH
    reply as JSON-ready values (hashes in hex); ValueError with the reason for a bad query."""
    from urllib.parse import parse_qs

    query = parse_qs(path.partition(b"?")[2].decode("ascii", "replace"))
    store = server.store
    if store is None or server.loading:
        raise ValueError("the KV store is not ready")
    try:
        ns = validate_namespace(query.get("ns", [""])[0].encode())
        values = server.config.values
        if "hashes" in query:
            hashes = check_hashes([bytes.fromhex(h) for h in query["hashes"][0].split(",") if h])
            if len(hashes) > values["max-chain-chunks"]:
                limit = values["max-chain-chunks"]
                raise ValueError(f"too many chunks: max-chain-chunks is {limit}")
            chunk = None
        elif "tokens" in query:
            ids = [int(t) for t in query["tokens"][0].split(",") if t]
            if any(not 0 <= t < 2**32 for t in ids):
                raise ValueError("token ids are u32")
            chunk = int(query.get("chunk", [store.config.chunk_tokens])[0])
            check_token_limits(values, len(ids), chunk)
            packed = b"".join(t.to_bytes(4, "little") for t in ids)
            hashes = await hash_off_loop(packed, ns, chunk, [])
        else:
            raise ValueError("give hashes=HEX,HEX… or tokens=ID,ID…")
    except (CommandError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    reply = await tier_match(server, store, ns, hashes, chunk)
    if "hashes" in reply:
        reply["hashes"] = [h.hex() for h in reply["hashes"]]
    return reply
