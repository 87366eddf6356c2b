"""Typed results of the ``KV.*`` commands (frozen dataclasses) and reply-shape helpers.

Replies arrive in RESP3 shapes (maps, booleans) or, from a RESP2 connection, as flat arrays and
integers; the helpers here accept both so the client works with either protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BatchGrant",
    "Handle",
    "LeaseGrant",
    "LeaseId",
    "MatchResult",
    "RegionInfo",
    "ReserveGrant",
    "TokenMatch",
    "as_map",
    "as_str",
]

#: A lease id as the server sent it (bulk string or integer); send it back unchanged.
LeaseId = bytes | int


@dataclass(frozen=True, slots=True)
class MatchResult:
    """``KV.MATCH … WITHTIERS``: chunks of the longest cached prefix and the tier of each."""

    matched: int
    tiers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TokenMatch:
    """``KV.MATCHTOKENS``: the cached prefix in tokens and chunks, and the hashes the server
    computed (of every full chunk of the tokens sent; the first ``matched_chunks`` are cached)."""

    matched_tokens: int
    matched_chunks: int
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """A shared region (``KV.REGIONS``): ``shm`` (shared-memory name) or ``cuda`` (IPC handle).
    ``instance`` is the region's identity in one server instance (random per start; empty from
    servers that do not send one)."""

    name: str
    kind: str
    size: int
    path: str
    device: int = -1  # the server's ordinal; map by pci_bus_id where it is given
    pci_bus_id: str = ""
    instance: str = ""


@dataclass(frozen=True, slots=True)
class Handle:
    """Where one chunk's bytes lie: ``length`` bytes at ``offset`` inside region ``region`` of
    the server instance ``instance`` (see :class:`RegionInfo`)."""

    region: str
    offset: int
    length: int
    instance: str = ""


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """``KV.LEASE``: a read lease on the chunks and one handle per leased chunk (in order)."""

    lease_id: LeaseId
    handles: tuple[Handle, ...]


@dataclass(frozen=True, slots=True)
class ReserveGrant:
    """``KV.RESERVE``: a write lease and the handle of the (invisible) reserved slot."""

    lease_id: LeaseId
    handle: Handle


@dataclass(frozen=True, slots=True)
class BatchGrant:
    """``KV.MRESERVE``: one write lease over the slots of a chain's chunks (None when no chunk
    got one) and, per chunk in order, its slot's handle or None; ``states[i]`` is
    ``"reserved"``, ``"exists"`` (stored already) or ``"busy"`` (another client writes it)."""

    lease_id: LeaseId | None
    handles: tuple[Handle | None, ...]
    states: tuple[str, ...]


def as_str(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def as_int(value: Any) -> int:
    if isinstance(value, bytes | bytearray):
        return int(value)
    return int(value)


def as_map(value: Any) -> dict[str, Any]:
    """A RESP3 map or a RESP2 flat ``[key, value, …]`` array as a dict with str keys."""
    if isinstance(value, Mapping):
        return {as_str(k): v for k, v in value.items()}
    if isinstance(value, list | tuple) and len(value) % 2 == 0:
        return {as_str(value[i]): value[i + 1] for i in range(0, len(value), 2)}
    raise TypeError(f"expected a map reply, got {type(value).__name__}")


def parse_handle(value: Any) -> Handle:
    region, offset, length, *rest = value
    instance = as_str(rest[0]) if rest and rest[0] is not None else ""
    return Handle(as_str(region), as_int(offset), as_int(length), instance)


def parse_region(value: Any) -> RegionInfo:
    m = as_map(value)
    device = m.get("device", -1)
    return RegionInfo(
        name=as_str(m["name"]),
        kind=as_str(m["kind"]),
        size=as_int(m["size"]),
        path=as_str(m.get("path", b"")),
        device=-1 if device is None else as_int(device),
        pci_bus_id=as_str(m.get("pci_bus_id") or b""),
        instance=as_str(m.get("instance") or b""),
    )
