"""KV.SESSION and KV.PREFETCH: session tails and background promotion hints.

``KV.SESSION ns session hash [TTL ms]`` records where a session's conversation ends now.
``KV.PREFETCH`` queues a background promotion and returns at once:

- ``KV.PREFETCH ns hash… [TO tier] [DEADLINE ms]``: the given chain, root first;
- ``KV.PREFETCH ns SESSION session [TO tier] [DEADLINE ms]``: the session's recorded chain;
- ``KV.PREFETCH ns CANCEL id``: takes a queued request out of the queue.

The target defaults to ``dram``; ``TO gpu`` promotes into the GPU tier (as ``KV.LEASE … TIER
gpu`` does); ``TO nvme`` copies chunks held only in s3 to the local disk.
With an S3 tier, KV.SESSION also records the session in the bucket, and ``KV.PREFETCH …
SESSION`` finds sessions recorded on any node and walks the chain's ancestors through S3 (the
reply then waits for those lookups, bounded by the remote lookup timeout).
In the chain form a hash equal to ``TO`` or ``DEADLINE`` must not be second to last, and the
first hash must not be ``SESSION`` or ``CANCEL`` when exactly one more argument follows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.chunks import validate_hash, validate_namespace
from kvstrata.protocol.errors import CommandError, syntax_error
from kvstrata.protocol.frames import OK
from kvstrata.server.commands.connection import arg_bytes
from kvstrata.server.commands.kv import (
    HASH,
    HASHES,
    NS,
    chain_hashes,
    int_option,
    store_of,
)
from kvstrata.server.context import Ctx
from kvstrata.server.registry import Arg, Args, Reply, command
from kvstrata.store.sessions import MAX_TTL_MS

if TYPE_CHECKING:
    from kvstrata.store.kvstore import KVStore

SESSION = Arg("session", "string")
SESSION_TTL_MAX = MAX_TTL_MS
DEADLINE_MAX = 86_400_000
MAX_SESSION_BYTES = 256


def _session_id(arg: Any) -> bytes:
    raw = arg_bytes(arg)
    if not 1 <= len(raw) <= MAX_SESSION_BYTES:
        raise CommandError(f"invalid session: must be 1 to {MAX_SESSION_BYTES} bytes")
    return bytes(raw)


@command(
    "KV.SESSION",
    -4,
    "write fast",
    group="kv",
    summary="Records that a session's conversation currently ends at this chunk (its chain is "
    "what KV.PREFETCH ns SESSION promotes). TTL (ms, default one hour) bounds how long the "
    "session is remembered. With an S3 tier the session is also written to the bucket for "
    "other nodes (at once with write-through, once the tail chunk reaches S3 with write-back).",
    arguments=(NS, SESSION, HASH, Arg("ttl", "integer", optional=True, token="TTL")),
    reply="Simple string OK.",
)
def kv_session(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    session = _session_id(args[2])
    tail = validate_hash(args[3])
    ttl = None
    if len(args) > 4:
        if len(args) != 6 or arg_bytes(args[4]).upper() != b"TTL":
            raise syntax_error()
        ttl = int_option(args[5], "TTL", 1, SESSION_TTL_MAX)
    store_of(ctx).record_session(ns, session, tail, ttl)
    return OK


def _trailing_options(args: Args, first: int) -> tuple[int, str | None, int | None]:
    """``TO tier`` / ``DEADLINE ms`` at the end of ``args`` (after ``args[first]``)."""
    end = len(args)
    target: str | None = None
    deadline: int | None = None
    while end - 2 > first:
        word = arg_bytes(args[end - 2]).upper()
        if word == b"TO" and target is None:
            target = arg_bytes(args[end - 1]).decode("utf-8", "replace")
        elif word == b"DEADLINE" and deadline is None:
            deadline = int_option(args[end - 1], "DEADLINE", 1, DEADLINE_MAX)
        else:
            break
        end -= 2
    return end, target, deadline


@command(
    "KV.PREFETCH",
    -3,
    "write fast",
    group="kv",
    summary="Queues the background promotion of a chain (or of a session's chain with "
    "SESSION) toward a fast tier (TO dram, the default, gpu, or nvme) and returns at once. "
    "DEADLINE (ms) marks the request late when it is not done in time; CANCEL id takes a "
    "request out of the queue. INFO prefetch shows the queue. With an S3 tier, SESSION finds "
    "sessions recorded on any node and walks the chain's ancestors through S3 before it "
    "answers.",
    complexity="O(N) hashes",
    arguments=(
        NS,
        HASHES,
        Arg("to", "string", optional=True, token="TO"),
        Arg("deadline", "integer", optional=True, token="DEADLINE"),
    ),
    reply="Array: [request id, chunks queued] ([0, 0] when nothing was queued: unknown "
    "session, chunks already there, or a full queue, counted in INFO prefetch as dropped). "
    "With CANCEL: integer 1 when a queued request was cancelled, else 0. -ERR too many chunks "
    "when more hashes than max-chain-chunks are given.",
)
def kv_prefetch(ctx: Ctx, args: Args) -> Reply:
    ns = validate_namespace(args[1])
    store = store_of(ctx)
    word = arg_bytes(args[2]).upper() if len(args[2]) <= 7 else b""
    if word == b"CANCEL" and len(args) == 4:
        request_id = int_option(args[3], "request id", 0, 2**62)
        return 1 if store.cancel_prefetch(request_id) else 0
    if word == b"SESSION" and len(args) >= 4:
        end, target, deadline = _trailing_options(args, 3)
        if end != 4:
            raise syntax_error()
        session = _session_id(args[3])
        if store.shares_sessions:  # the session may be recorded on another node: ask S3
            return _prefetch_shared(store, ns, session, target, deadline)
        request_id, queued = store.prefetch_session(ns, session, target, deadline)
        return [request_id, queued]
    end, target, deadline = _trailing_options(args, 2)
    hashes = chain_hashes(ctx, args[2:end])
    request_id, queued = store.prefetch_request(ns, hashes, target, deadline)
    return [request_id, queued]


async def _prefetch_shared(
    store: KVStore, ns: str, session: bytes, target: str | None, deadline: int | None
) -> Reply:
    request_id, queued = await store.prefetch_session_shared(ns, session, target, deadline)
    return [request_id, queued]
