"""Index queries behind the facade: the chain a node knows, where each chunk is, one chunk's record.

Functions of :class:`~kvstrata.store.kvstore.KVStore`'s ``matched``, ``check_link``,
``tiers_of`` and ``info`` (KV.MATCH and its variants, the parent link of a write, KV.INFO).
Index only: no I/O. A match refreshes LRU order and is traced (it is placement).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvstrata.chunks import ChunkKey
from kvstrata.protocol.errors import CommandError
from kvstrata.store.index import ChunkIndex, ChunkRecord
from kvstrata.store.keyspace import now_ms
from kvstrata.store.kvstore.state import StoreState
from kvstrata.tiers.base import Tier


def matched(state: StoreState, ns: str, hashes: Sequence[bytes]) -> list[ChunkRecord]:
    """``KVStore.matched``: the records of the chain's leading chunks this node knows."""
    get = state.index.get
    now = now_ms()
    stamp = time.monotonic()
    out: list[ChunkRecord] = []
    for h in hashes:
        rec = get(ChunkKey(ns, h))
        if rec is None or not rec.tiers:
            break
        if rec.expire_at is not None and rec.expire_at <= now:
            state.live(rec.key, now)  # deletes it
            break
        rec.last_access = stamp
        out.append(rec)
    state.trace("match", ns, hashes)  # a match refreshes LRU order: it is placement
    return out


def check_link(
    index: ChunkIndex, ns: str, hash: bytes, parent: bytes, key: ChunkKey | None = None
) -> None:
    """``KVStore.check_link``: CommandError for a parent link that would close a loop.
    ``key``: ``ChunkKey(ns, hash)`` when the caller has made it already."""
    if key is None:
        key = ChunkKey(ns, hash)
    rec = index.get(key)
    if rec is not None and rec.parent == parent:
        return  # the same link again (a re-PUT): no climb up the chain
    if index.makes_cycle(key, parent):
        raise CommandError("invalid parent: the chain would loop back to this chunk")


def tiers_of(tiers: Sequence[Tier], records: Sequence[ChunkRecord]) -> list[str]:
    """``KVStore.tiers_of``: the fastest tier holding each record."""
    order = [t.name for t in tiers]
    return [next(n for n in order if n in rec.tiers) for rec in records]


def chunk_info(state: StoreState, ns: str, hash: bytes) -> dict[str, Any] | None:
    """``KVStore.info`` (KV.INFO): one chunk's record; None when it is not stored."""
    rec = state.live(ChunkKey(ns, hash))
    if rec is None:
        return None
    order = [t.name for t in state.tiers]
    ttl = -1 if rec.expire_at is None else max(0, rec.expire_at - now_ms())
    return {
        "tiers": [n for n in order if n in rec.tiers],
        "size": rec.size,
        "tokens": rec.tokens,
        "parent": rec.parent.hex(),
        "children": len(state.index.children_of(rec)),
        "hits": rec.hits,
        "last_access_ms_ago": int((time.monotonic() - rec.last_access) * 1000),
        "checksum": rec.checksum.hex(),
        "checksum_verified": int(rec.verified),
        "codec": rec.codec,
        "leases": rec.leases,
        "ttl": ttl,
    }
