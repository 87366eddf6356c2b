"""Each ``KV.*`` command defined once: its argument vector, its reply decoder, its ``out``.

The sync client, the async client and pipelines all build a :class:`Call` here and only differ
in how they send it, so a command's wire form and its typed result cannot diverge between them.
Their plain methods are made from the builders below (``put = _command(cmd.put)``), so a
command's parameters and docstring are written here only; :func:`method_like` gives such a
method the builder's name, docstring and signature for ``help()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvstrata.clients.results import (
    BatchGrant,
    Handle,
    LeaseGrant,
    LeaseId,
    MatchResult,
    RegionInfo,
    ReserveGrant,
    TokenMatch,
    as_int,
    as_map,
    as_str,
    parse_handle,
    parse_region,
)
from kvstrata.protocol.errors import RespError
from kvstrata.store.hashing import TokenInput, pack_tokens

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
#: A payload: bytes-like, numpy array or CPU torch tensor (sent without copying).
Payload = Any
#: A chunk hash: raw bytes (1-64); a ``str`` is taken as hex.
HashLike = bytes | bytearray | memoryview | str


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One command ready to send and the decoder of its reply."""

    args: tuple[Any, ...]
    decode: Callable[[Any], T]
    out: Any = None

    def result(self, reply: Any) -> T:
        """The typed result of ``reply``; an error reply is raised."""
        if isinstance(reply, RespError):
            raise reply
        return self.decode(reply)


def method_like(build: Callable[..., Call[Any]], method: F) -> F:
    """Name ``method`` (``self, *args, **kwargs``, sending what ``build`` makes) after ``build``
    and give it its docstring and parameters, as a method written out would have."""
    params = inspect.signature(build).parameters.values()
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__name__ = method.__qualname__ = build.__name__
    method.__doc__ = build.__doc__
    method.__signature__ = inspect.Signature([self_param, *params])  # type: ignore[attr-defined]
    return method


def _ok(reply: Any) -> None:
    return None


def _same(reply: Any) -> Any:
    return reply


def hash_bytes(value: HashLike) -> bytes | bytearray | memoryview:
    """A hash as sent on the wire; a ``str`` is read as hex."""
    return bytes.fromhex(value) if isinstance(value, str) else value


_BINARY = frozenset((bytes, bytearray, memoryview))


def chain_args(hashes: Sequence[HashLike]) -> Sequence[HashLike]:
    """A chain of hashes as sent on the wire: as it is when no hash is hex text (one type
    check per hash in C, not a Python call each: engines send chains of hundreds)."""
    if isinstance(hashes, list | tuple) and set(map(type, hashes)) <= _BINARY:
        return hashes
    return tuple(map(hash_bytes, hashes))


def _ttl(ttl_ms: int | None) -> tuple[Any, ...]:
    return () if ttl_ms is None else ("TTL", int(ttl_ms))


def put(
    ns: str,
    hash: HashLike,
    parent: HashLike | None,
    payload: Payload,
    tokens: int = 0,
    ttl_ms: int | None = None,
    nx: bool = False,
) -> Call[bool]:
    """Store one chunk; False when NX and it exists (or the server declined)."""
    args: tuple[Any, ...] = ("KV.PUT", ns, hash_bytes(hash), hash_bytes(parent or b""), payload)
    args += ("TOKENS", int(tokens)) if tokens else ()
    args += _ttl(ttl_ms) + (("NX",) if nx else ())
    return Call(args, bool)


def get(ns: str, hash: HashLike, out: Any = None) -> Call[Any]:
    """The payload (``bytes``; a ``bytearray`` for large ones) or None. With ``out``
    (bytearray, memoryview, numpy array, CPU tensor) the payload is received into it and a
    memoryview of the filled bytes is returned; ``BufferTooSmall`` when it does not fit."""
    return Call(("KV.GET", ns, hash_bytes(hash)), _same, out)


def mget(ns: str, hashes: Sequence[HashLike], outs: Sequence[Any] | None = None) -> Call[list[Any]]:
    """Payloads (or None) of several chunks; ``outs``: one buffer per hash."""
    if outs is not None and len(outs) != len(hashes):
        raise ValueError("one out buffer per hash")
    return Call(("KV.MGET", ns, *chain_args(hashes)), _mget, list(outs) if outs else None)


def _mget(reply: Any) -> list[Any]:
    for item in reply:
        if isinstance(item, RespError):  # e.g. BufferTooSmall for one element
            raise item
    return list(reply)


def match(ns: str, hashes: Sequence[HashLike], prefetch: bool = False) -> Call[int]:
    """How many leading chunks of the chain are cached."""
    extra = ("PREFETCH",) if prefetch else ()
    return Call(("KV.MATCH", ns, *chain_args(hashes), *extra), as_int)


def match_tiers(ns: str, hashes: Sequence[HashLike], prefetch: bool = False) -> Call[MatchResult]:
    extra = ("PREFETCH",) if prefetch else ()
    return Call(("KV.MATCH", ns, *chain_args(hashes), "WITHTIERS", *extra), _match_tiers)


def _match_tiers(reply: Any) -> MatchResult:
    n, tiers = reply
    return MatchResult(as_int(n), tuple(as_str(t) for t in tiers))


def match_tokens(
    ns: str,
    tokens: TokenInput,
    chunk_tokens: int | None = None,
    extra: Sequence[bytes | str] = (),
) -> Call[TokenMatch]:
    """Server-side hashing and match of token ids (see ``docs/hashing.md``)."""
    args: tuple[Any, ...] = ("KV.MATCHTOKENS", ns, pack_tokens(tokens))
    if chunk_tokens is not None:
        args += ("CHUNK", int(chunk_tokens))
    if extra:
        args += ("EXTRA", *extra)
    return Call(args, _token_match)


def _token_match(reply: Any) -> TokenMatch:
    tokens, chunks, hashes = reply
    return TokenMatch(as_int(tokens), as_int(chunks), tuple(bytes(h) for h in hashes))


def _tier(tier: str | None) -> tuple[Any, ...]:
    return () if tier is None else ("TIER", tier)


def lease(
    ns: str, hashes: Sequence[HashLike], ttl_ms: int | None = None, tier: str | None = None
) -> Call[LeaseGrant | None]:
    """``tier`` ("gpu" or "dram"): where the handles should point; None: the server's default
    (gpu when it has a GPU tier)."""
    args = ("KV.LEASE", ns, *chain_args(hashes), *_ttl(ttl_ms), *_tier(tier))
    return Call(args, _lease)


def _lease(reply: Any) -> LeaseGrant | None:
    lease_id, handles = reply
    if lease_id is None:
        return None
    return LeaseGrant(_lease_id(lease_id), tuple(parse_handle(h) for h in handles or ()))


def _lease_id(value: Any) -> LeaseId:
    return value if isinstance(value, int) else bytes(value)


def reserve(
    ns: str,
    hash: HashLike,
    parent: HashLike | None,
    nbytes: int,
    tokens: int = 0,
    ttl_ms: int | None = None,
    tier: str | None = None,
) -> Call[ReserveGrant]:
    args: tuple[Any, ...] = (
        "KV.RESERVE",
        ns,
        hash_bytes(hash),
        hash_bytes(parent or b""),
        int(nbytes),
    )
    args += ("TOKENS", int(tokens)) if tokens else ()
    return Call(args + _ttl(ttl_ms) + _tier(tier), _reserve)


def _reserve(reply: Any) -> ReserveGrant:
    lease_id, handle = reply
    return ReserveGrant(_lease_id(lease_id), parse_handle(handle))


def mreserve(
    ns: str,
    parent: HashLike | None,
    hashes: Sequence[HashLike],
    sizes: Sequence[int],
    tokens: int = 0,
    ttl_ms: int | None = None,
    tier: str | None = None,
) -> Call[BatchGrant]:
    """Slots for the chain ``hashes`` (the first linked to ``parent``) under one write lease;
    ``sizes[i]`` bytes for chunk ``i``; ``tokens`` for each chunk."""
    if len(sizes) != len(hashes) or not hashes:
        raise ValueError("one size per hash, at least one hash")
    args: list[Any] = ["KV.MRESERVE", ns, hash_bytes(parent or b""), len(hashes)]
    for h, n in zip(hashes, sizes, strict=True):
        args += (hash_bytes(h), int(n))
    args += ("TOKENS", int(tokens)) if tokens else ()
    return Call((*args, *_ttl(ttl_ms), *_tier(tier)), _mreserve)


def _mreserve(reply: Any) -> BatchGrant:
    lease_id, entries = reply
    handles: list[Handle | None] = []
    states: list[str] = []
    names: dict[bytes, str] = {}  # region and instance names, decoded once per reply
    for entry in entries:
        if type(entry) is list and len(entry) == 4:  # the common shape: [bytes, int, int, bytes]
            region, offset, length, instance = entry
            if type(region) is bytes and type(instance) is bytes and type(offset) is int:
                r = names.get(region) or names.setdefault(region, as_str(region))
                i = names.get(instance) or names.setdefault(instance, as_str(instance))
                handles.append(Handle(r, offset, int(length), i))
                states.append("reserved")
                continue
        if isinstance(entry, list | tuple):
            handles.append(parse_handle(entry))
            states.append("reserved")
        else:
            handles.append(None)
            states.append(as_str(entry))
    lid = None if lease_id is None else _lease_id(lease_id)
    return BatchGrant(lid, tuple(handles), tuple(states))


def commit(lease_id: LeaseId, *indexes: int, digests: Sequence[bytes] = ()) -> Call[None]:
    """Publish a reserved chunk, a batch's chunks, or (``indexes``) those chunks of a batch;
    ``digests``: the writer's xxh3-128 of each (one per index, or one for a KV.RESERVE slot;
    ``b""`` for none)."""
    tail = ("DIGEST", *digests) if digests else ()
    return Call(("KV.COMMIT", lease_id, *indexes, *tail), _ok)


def refuses_digests(exc: BaseException) -> bool:
    """True for a server before ``KV.COMMIT … DIGEST`` (it read ``DIGEST`` as an index and
    touched no lease): the client commits again without digests, the server hashing the slots."""
    return "invalid index: value is not an integer" in str(exc)


def abort(lease_id: LeaseId) -> Call[None]:
    return Call(("KV.ABORT", lease_id), _ok)


def release(lease_id: LeaseId) -> Call[None]:
    return Call(("KV.RELEASE", lease_id), _ok)


def regions() -> Call[list[RegionInfo]]:
    return Call(("KV.REGIONS",), _regions)


def _regions(reply: Any) -> list[RegionInfo]:
    return [parse_region(r) for r in reply]


def info(ns: str, hash: HashLike) -> Call[dict[str, Any] | None]:
    return Call(("KV.INFO", ns, hash_bytes(hash)), _info)


def _info(reply: Any) -> dict[str, Any] | None:
    return None if reply is None else as_map(reply)


def delete(ns: str, hash: HashLike, cascade: bool = False) -> Call[int]:
    """Chunks deleted (with ``cascade``, the chunk and its descendants)."""
    return Call(("KV.DEL", ns, hash_bytes(hash), *(("CASCADE",) if cascade else ())), as_int)


def stats() -> Call[dict[str, dict[str, Any]]]:
    return Call(("KV.STATS",), _stats)


def _stats(reply: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, value in as_map(reply).items():
        try:
            out[name] = as_map(value)
        except TypeError:  # not a map: keep the value as it came
            out[name] = {"value": value}
    return out


def ping() -> Call[bool]:
    return Call(("PING",), lambda r: r == b"PONG")


def raw(args: Sequence[Any], out: Any = None) -> Call[Any]:
    return Call(tuple(args), _same, out)


__all__ = [
    "Call",
    "Handle",
    "abort",
    "commit",
    "delete",
    "get",
    "hash_bytes",
    "info",
    "lease",
    "match",
    "match_tiers",
    "match_tokens",
    "method_like",
    "mget",
    "mreserve",
    "ping",
    "put",
    "raw",
    "regions",
    "release",
    "reserve",
    "stats",
]
