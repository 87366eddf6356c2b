"""The chunk index: one :class:`ChunkRecord` per committed chunk, looked up by ChunkKey in O(1).

Besides the records the index keeps, per ``(namespace, parent hash)``, the set of child hashes
(children may arrive before their parent), and per record and tier the number of its children
resident in that tier (``child_res``). Both are maintained on every residency change
(:meth:`ChunkIndex.add_tier` / :meth:`ChunkIndex.drop_tier`) in O(1), so that

- CASCADE delete walks descendants without scanning, and
- "has a resident child in tier T" (the eviction rule: leaves first) is one dict read.

Whenever a record's eligibility as an eviction candidate in a tier may have changed (it entered
or left the tier, or its resident-children count there moved between 0 and non-zero) the index
calls ``on_change(record, tier)``; the placement module keeps its LRU heaps from that hook.
Every residency change itself (a copy gained or lost by an indexed record, or the record
removed) goes through one method, ``_residency``, which also tells ``on_residency`` when set:
the tier events routers follow (``store.events``).

Everything here is synchronous bookkeeping; no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta

#: Bytes a record costs besides its payload (MEMORY USAGE): the record, its key and dict slots.
RECORD_OVERHEAD = 320


@dataclass(slots=True, eq=False)
class ChunkRecord:
    """What the store knows about one chunk. Implements the keyspace ``Entry`` protocol."""

    key: ChunkKey
    parent: bytes
    tokens: int
    size: int
    checksum: bytes
    codec: str = "raw"
    #: False while ``checksum`` is a client's claim (``KV.COMMIT … DIGEST``) that no byte of the
    #: chunk was checked against yet; set by the first check (``mover.check_bytes``), which
    #: every copy out of DRAM passes first (docs/architecture.md, "Client digests")
    verified: bool = True
    tiers: set[str] = field(default_factory=set)
    last_access: float = field(default_factory=time.monotonic)
    hits: int = 0
    leases: int = 0
    #: readers, leases and movers holding the chunk's bytes in place (never evicted, never freed)
    pins: int = 0
    expire_at: int | None = None
    created: float = field(default_factory=time.time)
    #: hashes of the children (shared with the index's per-parent set)
    children: set[bytes] = field(default_factory=set)
    #: tier → number of children resident in that tier
    child_res: dict[str, int] = field(default_factory=dict)
    #: tier → generation of the record's eviction-heap entry (placement's lazy deletion)
    gen: dict[str, int] = field(default_factory=dict)
    #: False once removed from the index (a "retired" record whose copies are being freed)
    alive: bool = True
    #: True while a promotion or demotion moves its bytes
    moving: bool = False
    type_name: str = "kvchunk"

    def memory_usage(self) -> int:
        return self.size + RECORD_OVERHEAD

    def meta(self) -> ChunkMeta:
        return ChunkMeta(self.key, self.parent, self.tokens, self.size, self.checksum, self.codec)

    def redis_key(self) -> bytes:
        return self.key.redis_key()

    def is_leaf_in(self, tier: str) -> bool:
        """True when no child of this chunk is resident in ``tier``."""
        return not self.child_res.get(tier, 0)

    def touch(self, now: float | None = None) -> None:
        self.last_access = time.monotonic() if now is None else now


def record_from_meta(meta: ChunkMeta, expire_at: int | None = None) -> ChunkRecord:
    return ChunkRecord(
        key=meta.key,
        parent=meta.parent,
        tokens=meta.tokens,
        size=meta.size,
        checksum=meta.checksum,
        codec=meta.codec,
        expire_at=expire_at,
    )


ChangeHook = Callable[[ChunkRecord, str], None]
#: (record, tier, +1 entered / -1 left)
ResidencyHook = Callable[[ChunkRecord, str, int], None]


_LOOK_UP: Any = object()  # _residency's parent: not given, look it up


def _noop(rec: ChunkRecord, tier: str) -> None:
    pass


class ChunkIndex:
    """Records by key, children by parent, residency counts per tier. All operations O(1)
    except :meth:`descendants` (O(size of the subtree))."""

    def __init__(self, on_change: ChangeHook = _noop) -> None:
        self._records: dict[ChunkKey, ChunkRecord] = {}
        self._children: dict[ChunkKey, set[bytes]] = {}
        self.on_change = on_change
        self.on_residency: ResidencyHook | None = None
        #: tier → (chunks, bytes) resident according to the index
        self.count_in: dict[str, int] = {}
        self.bytes_in: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[ChunkRecord]:
        return iter(list(self._records.values()))

    def get(self, key: ChunkKey) -> ChunkRecord | None:
        return self._records.get(key)

    def parent_of(self, rec: ChunkRecord) -> ChunkRecord | None:
        if not rec.parent:
            return None
        return self._records.get(ChunkKey(rec.key.namespace, rec.parent))

    def makes_cycle(self, key: ChunkKey, parent: bytes) -> bool:
        """Whether linking ``key`` under ``parent`` closes a loop of parent links (possible
        only when ``key`` already has children, stored before it)."""
        if not parent or not self._children.get(key):
            return False
        link = ChunkKey(key.namespace, parent)
        for _ in range(len(self._records) + 1):  # each step climbs one parent link
            if link == key:
                return True
            rec = self._records.get(link)
            if rec is None or not rec.parent:
                return False
            link = ChunkKey(key.namespace, rec.parent)
        return False

    def children_of(self, rec: ChunkRecord) -> list[ChunkRecord]:
        ns = rec.key.namespace
        out = []
        for h in rec.children:
            child = self._records.get(ChunkKey(ns, h))
            if child is not None:
                out.append(child)
        return out

    def descendants(self, rec: ChunkRecord) -> list[ChunkRecord]:
        """Every live descendant, parents before children (breadth first)."""
        out: list[ChunkRecord] = []
        seen = {rec.key}
        frontier = [rec]
        while frontier:
            nxt: list[ChunkRecord] = []
            for r in frontier:
                for child in self.children_of(r):
                    if child.key not in seen:
                        seen.add(child.key)
                        out.append(child)
                        nxt.append(child)
            frontier = nxt
        return out

    # -- membership -----------------------------------------------------------------------

    def add(self, rec: ChunkRecord) -> None:
        """Insert a record (its ``tiers`` already filled in). The key must not be present."""
        key = rec.key
        if key in self._records:
            raise KeyError(f"chunk {key.hex} already indexed")
        rec.alive = True
        self._records[key] = rec
        rec.children = kids = self._children.setdefault(key, set())
        counts: dict[str, int] = {}
        if kids:  # children stored before their parent (rare: a new chunk has none)
            for child in self.children_of(rec):
                for tier in child.tiers:
                    counts[tier] = counts.get(tier, 0) + 1
        rec.child_res = counts
        parent = None
        if rec.parent:
            pkey = ChunkKey(key.namespace, rec.parent)  # made and hashed once for both uses
            self._children.setdefault(pkey, set()).add(key.hash)
            parent = self._records.get(pkey)
        tiers = rec.tiers  # (a set: no tier twice) each added in turn to a fresh one
        rec.tiers = set()
        for tier in tiers:  # add_tier of a record just indexed, its parent known
            if tier not in rec.tiers:
                rec.tiers.add(tier)
                self._residency(rec, tier, +1, parent)
                parent = _LOOK_UP  # a hook may have changed the index meanwhile
                self.on_change(rec, tier)

    def remove(self, rec: ChunkRecord) -> None:
        """Take a record out of the index; ``rec.tiers`` still says where its copies are."""
        if self._records.get(rec.key) is not rec:
            return
        for tier in list(rec.tiers):
            self._residency(rec, tier, -1)
        rec.alive = False
        del self._records[rec.key]
        if not rec.children:
            self._children.pop(rec.key, None)
        if rec.parent:
            pkey = ChunkKey(rec.key.namespace, rec.parent)
            siblings = self._children.get(pkey)
            if siblings is not None:
                siblings.discard(rec.key.hash)
                if not siblings and pkey not in self._records:
                    del self._children[pkey]
        for tier in list(rec.tiers):
            self.on_change(rec, tier)

    # -- residency ------------------------------------------------------------------------

    def add_tier(self, rec: ChunkRecord, tier: str) -> None:
        if tier in rec.tiers:
            return
        rec.tiers.add(tier)
        if rec.alive and self._records.get(rec.key) is rec:
            self._residency(rec, tier, +1)
            self.on_change(rec, tier)

    def drop_tier(self, rec: ChunkRecord, tier: str) -> None:
        if tier not in rec.tiers:
            return
        if rec.alive and self._records.get(rec.key) is rec:
            self._residency(rec, tier, -1)
            rec.tiers.discard(tier)
            self.on_change(rec, tier)
        else:
            rec.tiers.discard(tier)

    def _residency(
        self, rec: ChunkRecord, tier: str, delta: int, parent: Any = _LOOK_UP
    ) -> None:
        """``parent``: the record's parent record (or None) when the caller has it."""
        if self.on_residency is not None:
            self.on_residency(rec, tier, delta)
        self.count_in[tier] = self.count_in.get(tier, 0) + delta
        self.bytes_in[tier] = self.bytes_in.get(tier, 0) + delta * rec.size
        if parent is _LOOK_UP:
            parent = self.parent_of(rec)
        if parent is None:
            return
        before = parent.child_res.get(tier, 0)
        after = before + delta
        if after:
            parent.child_res[tier] = after
        else:
            parent.child_res.pop(tier, None)
        if (before == 0) != (after == 0) and tier in parent.tiers:
            self.on_change(parent, tier)
