"""Virtual tiers: a capacity, a bandwidth and a latency; they hold sizes, never bytes.

A chunk occupies what the real tier would charge for it (:meth:`TierSpec.footprint`): DRAM
and the GPU pool allocate 4096-aligned slots, with the arena's own allocator
(:class:`~kvstrata.tiers.alloc.OffsetAllocator`, best fit), so that "room" means what it means
to the server: the largest free extent, not the free bytes (a fragmented arena evicts more
before a chunk fits); on NVMe a chunk of at most ``nvme-slab-max``
bytes takes a slab slot of its size class (a 4096-byte header plus the smallest class that holds
it: a 20 KiB chunk takes 4 + 24 KiB), a larger one a chunk file (the header plus the payload
rounded up to 4 KiB). The policy (watermarks, write policy) is the server's
:class:`~kvstrata.store.policy.TierPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.chunks import ChunkKey
from kvstrata.store.kvstore.state import TierCounters
from kvstrata.store.policy import TierPolicy
from kvstrata.tiers._nvme_slabs import slot_size_for
from kvstrata.tiers.alloc import OffsetAllocator

UNBOUNDED = 1 << 62
#: tiers in the order the server stacks them (fast → slow)
ORDER = ("gpu", "dram", "nvme", "s3")
_BLOCKS = {"gpu": (4096, 0), "dram": (4096, 0), "nvme": (4096, 4096), "s3": (1, 0)}


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One virtual tier: ``capacity`` bytes (0: unbounded), ``bandwidth`` bytes/s to the GPU
    and ``latency`` seconds per access, and the server's policy for it."""

    name: str
    capacity: int
    bandwidth: float
    latency: float
    policy: TierPolicy
    #: nvme: ``nvme-slab-max`` (chunks up to it take slab slots; 0: chunk files only)
    slab_max: int = 0

    @property
    def shared(self) -> bool:
        return self.name == "s3"

    def footprint(self, size: int) -> int:
        if self.slab_max and self.name == "nvme":
            slot = slot_size_for(size, self.slab_max)
            if slot:
                return slot
        block, header = _BLOCKS.get(self.name, (1, 0))
        return header + max(block, -(-size // block) * block)


#: tiers that are one arena of slots (their room is the largest free extent)
ARENAS = ("gpu", "dram")


@dataclass(slots=True)
class VTier:
    spec: TierSpec
    used: int = 0
    counters: TierCounters = field(default_factory=TierCounters)
    #: the arena's allocator (gpu, dram) and the offset of each chunk's slot in it
    alloc: OffsetAllocator | None = None
    slots: dict[ChunkKey, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.spec.name in ARENAS and self.spec.capacity > 0:
            self.alloc = OffsetAllocator(self.spec.capacity)

    def take(self, key: ChunkKey, size: int) -> bool:
        """Occupy the chunk's footprint; False when no slot fits (arenas only)."""
        if self.alloc is not None:
            offset = self.alloc.allocate(size)
            if offset is None:
                return False
            self.slots[key] = offset
            self.used = self.alloc.used
            return True
        self.used += self.spec.footprint(size)
        return True

    def give(self, key: ChunkKey, size: int) -> None:
        """Free what :meth:`take` occupied."""
        if self.alloc is not None:
            self.alloc.free(self.slots.pop(key))
            self.used = self.alloc.used
            return
        self.used -= self.spec.footprint(size)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    def free(self) -> int:
        """Room left now: the largest chunk footprint that fits (huge for an unbounded tier)."""
        if self.spec.policy.high is None or self.spec.capacity <= 0:
            return UNBOUNDED
        if self.alloc is not None:
            return self.alloc.largest_free
        return max(0, self.spec.capacity - self.used)
