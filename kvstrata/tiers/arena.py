"""The chunk table shared by the memory tiers that carve one region into slots (dram, gpu).

:class:`ArenaTier` keeps the bookkeeping of a region handed out by an
:class:`~kvstrata.tiers.alloc.OffsetAllocator`, and nothing that touches its bytes:

- committed chunks map key → :class:`Slot`; reserved slots (``reserve``, not yet ``commit``-ed)
  are kept apart and are invisible to ``has``/``contains``/``meta``/``handle`` and to the
  subclass's ``get``/``view``;
- replacing a chunk (``commit`` or a subclass's ``put`` of a key already present) publishes the
  new slot first, then frees the old one;
- every slot given back goes through :meth:`ArenaTier._free`, which defers the free while the
  slot is *held* (:meth:`ArenaTier.hold`): the GPU tier holds a slot while a copy reads it, the
  store holds (fences) the slot of an expired lease whose holder may still touch it;
- every region has an ``instance`` identity, random per tier object (never derived from the
  PID), carried in every handle and region so that a client never resolves a handle of one
  server instance through its mapping of another;
- capacity, handles and the allocator's share of ``info()``.

Subclasses own the memory: ``reserve``/``view``/``regions`` and the byte moves of
``put``/``get`` (a memcpy into the shared-memory arena; device copies on an executor).
Everything here is synchronous and never blocks.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.tiers.alloc import OffsetAllocator
from kvstrata.tiers.base import (
    Buffer,
    ChunkMissing,
    Handle,
    MemoryTier,
    TierError,
    TierFull,
    TierUnavailable,
)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one chunk (or one reservation) lies in the region."""

    offset: int
    length: int
    meta: ChunkMeta | None  # None while reserved


def byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view of ``data`` (no copy)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def new_instance_id() -> str:
    """A fresh region identity: 16 hex digits from the OS's random source."""
    return secrets.token_hex(8)


class ArenaTier(MemoryTier):
    """A memory tier over one region of ``capacity`` bytes; see the module docstring."""

    def __init__(self, capacity: int, region_name: str, instance: str | None = None) -> None:
        super().__init__()
        self.region_name = region_name
        self.instance = instance or new_instance_id()
        self._alloc = OffsetAllocator(capacity)
        self._chunks: dict[ChunkKey, Slot] = {}
        self._reserved: dict[ChunkKey, Slot] = {}
        self._holds: dict[int, int] = {}  # offset -> holders that keep it from being reused
        self._deferred: set[int] = set()  # held offsets already given back: freed at unhold
        self._closed = False

    # -- capacity -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def used(self) -> int:
        """Bytes of allocated slots (committed, reserved, being filled), 4096-rounded each."""
        return self._alloc.used

    def largest_free(self) -> int:
        return self._alloc.largest_free

    @property
    def unit(self) -> int:
        """The allocation unit: every slot takes a whole number of them (at least one)."""
        return self._alloc.alignment

    def slot_size(self, nbytes: int) -> int:
        """The bytes a slot of ``nbytes`` takes in the region."""
        return self._alloc.round_up(nbytes)

    def evictable_slots(self) -> Iterator[tuple[ChunkKey, int]]:
        """(key, slot bytes) of every committed chunk whose slot is not held: the memory its
        eviction would give back at once (O(chunks); for a refusal that must not evict)."""
        holds = self._holds
        for key, slot in self._chunks.items():
            if not holds.get(slot.offset):
                yield key, self._alloc.round_up(slot.length)

    # -- chunk table --------------------------------------------------------------------

    def commit(self, meta: ChunkMeta) -> None:
        self._check_open()
        slot = self._reserved_slot(meta.key)
        if meta.size != slot.length:
            raise ValueError(f"commit of {meta.size} bytes into a {slot.length}-byte reservation")
        del self._reserved[meta.key]
        self._publish(meta, slot.offset)

    def rekey_reserved(self, old: ChunkKey, new: ChunkKey) -> None:
        """Bind a pending reservation to another key (a payload that arrived before its
        chunk's identity was claimed)."""
        if new in self._reserved:
            raise TierError(f"{self.name}: chunk {new.hex} already has a pending reservation")
        self._reserved[new] = self._reserved_slot(old)
        del self._reserved[old]

    def abort(self, key: ChunkKey) -> None:
        slot = self._reserved.pop(key, None)
        if slot is not None and not self._closed:
            self._free(slot.offset)

    def handle(self, key: ChunkKey) -> Handle:
        slot = self._lookup(key)
        return Handle(self.region_name, slot.offset, slot.length, self.instance)

    def reserved_handle(self, key: ChunkKey) -> Handle:
        slot = self._reserved_slot(key)
        return Handle(self.region_name, slot.offset, slot.length, self.instance)

    # -- holds: slots that must not be reused yet ---------------------------------------

    def hold(self, offset: int) -> None:
        """Keep the allocated slot at ``offset`` from being reused until :meth:`unhold`, even
        when its chunk is deleted, replaced or its reservation aborted meanwhile."""
        self._holds[offset] = self._holds.get(offset, 0) + 1

    def unhold(self, offset: int) -> None:
        """End one :meth:`hold`; the last one frees the slot if it was given back meanwhile."""
        left = self._holds.get(offset, 0) - 1
        if left > 0:
            self._holds[offset] = left
            return
        self._holds.pop(offset, None)
        if offset in self._deferred:
            self._deferred.discard(offset)
            if not self._closed:
                self._alloc.free(offset)

    @property
    def deferred_frees(self) -> int:
        """Slots given back but still held (their memory is not reusable yet)."""
        return len(self._deferred)

    def has(self, key: ChunkKey) -> bool:
        return key in self._chunks

    async def delete(self, key: ChunkKey) -> bool:
        slot = self._chunks.pop(key, None)
        if slot is None:
            return False
        self._free(slot.offset)
        self.stats.deletes += 1
        self.stats.chunks = len(self._chunks)
        return True

    async def contains(self, key: ChunkKey) -> bool:
        return key in self._chunks

    async def meta(self, key: ChunkKey) -> ChunkMeta | None:
        slot = self._chunks.get(key)
        return slot.meta if slot is not None else None

    # -- for subclasses -----------------------------------------------------------------

    def _table_info(self) -> dict[str, Any]:
        """The allocator's and the table's fields of ``info()``."""
        a = self._alloc.stats()
        return {
            "region": self.region_name,
            "capacity": a.capacity,
            "used": a.used,
            "chunks": len(self._chunks),
            "reserved": len(self._reserved),
            "fragmentation": round(a.fragmentation, 4),
            "largest_free": a.largest_free,
            "free_extents": a.free_extents,
            "instance": self.instance,
            "held_slots": len(self._holds),
        }

    def _clear_table(self) -> None:
        """Forget every chunk and reservation (at close; the region goes away with them)."""
        self._chunks.clear()
        self._reserved.clear()
        self._holds.clear()
        self._deferred.clear()
        self.stats.chunks = 0

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"{self.name} tier is closed")

    def _reserve(self, key: ChunkKey, nbytes: int) -> int:
        """Offset of a fresh, invisible slot of ``nbytes`` reserved for ``key``."""
        self._check_open()
        if key in self._reserved:
            raise TierError(f"{self.name}: chunk {key.hex} already has a pending reservation")
        offset = self._allocate(nbytes)
        self._reserved[key] = Slot(offset, nbytes, None)
        return offset

    def _allocate(self, nbytes: int) -> int:
        offset = self._alloc.allocate(nbytes)
        if offset is None:
            raise TierFull(
                f"{self.name}: no free extent of {nbytes} bytes (free {self._alloc.free_bytes}, "
                f"largest {self._alloc.largest_free})"
            )
        return offset

    def _free(self, offset: int) -> None:
        """Give a slot back to the allocator, or defer that while it is held."""
        if self._holds.get(offset):
            self._deferred.add(offset)
        else:
            self._alloc.free(offset)

    def _lookup(self, key: ChunkKey) -> Slot:
        slot = self._chunks.get(key)
        if slot is None:
            self.stats.misses += 1
            raise ChunkMissing(key)
        return slot

    def _reserved_slot(self, key: ChunkKey) -> Slot:
        slot = self._reserved.get(key)
        if slot is None:
            raise ChunkMissing(key)
        return slot

    def _publish(self, meta: ChunkMeta, offset: int) -> None:
        old = self._chunks.get(meta.key)
        self._chunks[meta.key] = Slot(offset, meta.size, meta)
        if old is not None:
            self._free(old.offset)
        self.stats.puts += 1
        self.stats.bytes_in += meta.size
        self.stats.chunks = len(self._chunks)
