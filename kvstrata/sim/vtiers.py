"""Virtual tiers: a capacity, a bandwidth and a latency; they hold sizes, never bytes.

A chunk occupies what the real tier would charge for it (:meth:`TierSpec.footprint`): DRAM
and the GPU pool allocate 4096-aligned slots, an NVMe chunk file is a 4096-byte header plus the
payload rounded up to 4 KiB. The policy (watermarks, write policy) is the server's
:class:`~kvstrata.store.policy.TierPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.store.kvstore_state import TierCounters
from kvstrata.store.policy import TierPolicy

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

    @property
    def shared(self) -> bool:
        return self.name == "s3"

    def footprint(self, size: int) -> int:
        block, header = _BLOCKS.get(self.name, (1, 0))
        return header + max(block, -(-size // block) * block)


@dataclass(slots=True)
class VTier:
    spec: TierSpec
    used: int = 0
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    def free(self) -> int:
        """Room left now (huge for an unbounded tier)."""
        if self.spec.policy.high is None or self.spec.capacity <= 0:
            return UNBOUNDED
        return max(0, self.spec.capacity - self.used)
