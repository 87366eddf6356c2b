"""Offset allocator for one contiguous region (the DRAM arena, the GPU pool).

The region is ``capacity`` bytes; the allocator hands out offsets into it and never touches
the memory. Every offset and size is a multiple of ``alignment`` (4096 by default) so that a
slot can be the source or target of O_DIRECT and GPUDirect Storage transfers as it is.

Policy: best fit over the free extents (the smallest extent that fits; the lowest offset among
equals), splitting the rest off; ``free`` coalesces with both neighbours, so freeing everything
gives back one extent. Free extents are kept twice, sorted by offset (to find neighbours) and
by (size, offset) (to find the best fit), each searched with ``bisect``: O(log n) comparisons
per operation plus a list insertion/removal (a memmove, fast for the thousands of extents a
cache sees).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

DEFAULT_ALIGNMENT = 4096


def round_up(nbytes: int, alignment: int) -> int:
    """The size a request of ``nbytes`` occupies in units of ``alignment`` (at least one)."""
    size = (nbytes + alignment - 1) // alignment * alignment
    return size if size > alignment else alignment  # (not max(): a builtin call per slot)


@dataclass(frozen=True, slots=True)
class AllocStats:
    """A snapshot of the allocator for INFO."""

    capacity: int
    used: int
    free_bytes: int
    largest_free: int
    fragmentation: float
    allocations: int
    free_extents: int


class OffsetAllocator:
    """Best-fit allocator of aligned offsets in ``[0, capacity)``."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.alignment = alignment
        # A tail shorter than one alignment unit can never be handed out.
        self.capacity = capacity - capacity % alignment
        self._free_offsets: list[int] = []  # sorted offsets of free extents
        self._free_size: dict[int, int] = {}  # offset -> size of each free extent
        self._by_size: list[tuple[int, int]] = []  # sorted (size, offset) of free extents
        self._allocated: dict[int, int] = {}  # offset -> rounded size
        self._used = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    def round_up(self, nbytes: int) -> int:
        """The size a request of ``nbytes`` occupies (at least one alignment unit)."""
        return round_up(nbytes, self.alignment)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a fresh slot of at least ``nbytes``; None when no extent fits."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = self.round_up(nbytes)
        i = bisect_left(self._by_size, (size, -1))
        if i == len(self._by_size):
            return None
        ext_size, offset = self._by_size[i]
        self._remove_free(offset, ext_size, i)
        if ext_size > size:
            self._add_free(offset + size, ext_size - size)
        self._allocated[offset] = size
        self._used += size
        return offset

    def free(self, offset: int) -> int:
        """Give back the slot at ``offset``; returns its size. Unknown offsets raise ValueError."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not allocated")
        self._used -= size
        start, end = offset, offset + size
        i = bisect_left(self._free_offsets, offset)
        if i > 0:
            prev = self._free_offsets[i - 1]
            prev_size = self._free_size[prev]
            if prev + prev_size == start:
                self._remove_free(prev, prev_size)
                start = prev
        nxt = end
        if nxt in self._free_size:
            end += self._free_size[nxt]
            self._remove_free(nxt, self._free_size[nxt])
        self._add_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int:
        """Rounded size of the allocated slot at ``offset`` (KeyError when not allocated)."""
        return self._allocated[offset]

    @property
    def used(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def fragmentation(self) -> float:
        """0.0 when all free space is one extent, towards 1.0 as it splinters."""
        free = self.free_bytes
        return 1.0 - self.largest_free / free if free else 0.0

    def stats(self) -> AllocStats:
        return AllocStats(
            capacity=self.capacity,
            used=self._used,
            free_bytes=self.free_bytes,
            largest_free=self.largest_free,
            fragmentation=self.fragmentation,
            allocations=len(self._allocated),
            free_extents=len(self._free_offsets),
        )

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, by offset (for tests and debugging)."""
        return [(o, self._free_size[o]) for o in self._free_offsets]

    def allocations(self) -> list[tuple[int, int]]:
        """(offset, size) of every allocated slot, by offset."""
        return sorted(self._allocated.items())

    def _add_free(self, offset: int, size: int) -> None:
        insort(self._free_offsets, offset)
        insort(self._by_size, (size, offset))
        self._free_size[offset] = size

    def _remove_free(self, offset: int, size: int, size_index: int | None = None) -> None:
        if size_index is None:
            size_index = bisect_left(self._by_size, (size, offset))
        del self._by_size[size_index]
        del self._free_offsets[bisect_left(self._free_offsets, offset)]
        del self._free_size[offset]
