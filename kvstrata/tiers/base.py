"""The Tier contract: one medium (gpu, dram, nvme, s3) behind one small async interface.

Primitives every tier implements (the contract suite in ``tests/test_tier_contract.py`` runs
against each of them):

- ``put(meta, data)``: store one chunk's bytes and metadata; raises :class:`TierFull` when the
  tier has no room (the store evicts, then retries) and :class:`TierIOError` on a failed write.
  Replacing an existing chunk is allowed and atomic: a reader sees the old or the new bytes.
- ``get(key, out)``: read the chunk into the caller's buffer ``out`` (exactly ``meta.size``
  bytes long) and return its metadata; raises :class:`ChunkMissing` when absent and
  :class:`IntegrityError` when the stored bytes fail their checksum (the tier drops the copy).
- ``delete(key)`` → whether something was removed; ``contains(key)``; ``meta(key)``.
- batch forms ``put_many``/``get_many``/``contains_many`` (defaults gather the single forms).
- ``capacity``/``used`` in bytes, ``stats()``, ``scan()`` (metadata of everything stored, for
  rebuilding the index at start), ``close()``.

Bookkeeping (which chunk lives where, eviction, leases) belongs to the store; a tier never
evicts on its own and never imports the server or the store. Blocking libraries (file I/O,
kvikio, boto3) run on a bounded executor owned by the tier.

Memory tiers (dram, gpu) also hand out zero-copy views and handles; see :class:`MemoryTier`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstrata.chunks import ChunkKey, ChunkMeta

Buffer = bytes | bytearray | memoryview


class TierError(Exception):
    """Base of tier failures; the store turns them into misses, counters and logs."""


class TierFull(TierError):
    """No room for the chunk right now (after eviction the store may retry)."""


class ChunkMissing(TierError, KeyError):
    """The tier does not hold the chunk."""


class IntegrityError(TierError):
    """Stored bytes failed their checksum; the tier has removed (quarantined) its copy."""


class TierIOError(TierError):
    """The medium failed (ENOSPC, EIO, permission, network); the chunk was not stored/read."""


class TierUnavailable(TierError):
    """The tier cannot be built on this machine (e.g. no CUDA); the message says why."""


class ObjectChanged(TierError):
    """A shared tier holds another version of the chunk than the reader expected (another node
    replaced it): ``meta`` is that version's metadata, valid by its own account. The reader
    adopts it; nothing is deleted."""

    def __init__(self, meta: ChunkMeta, message: str = "") -> None:
        super().__init__(message or f"chunk {meta.key.hex} was replaced")
        self.meta = meta


@dataclass(slots=True)
class TierStats:
    """Counters every tier keeps; INFO tiers and KV.STATS print them."""

    chunks: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0
    integrity_errors: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        keep_chunks = self.chunks
        for name in self.__slots__:
            if name == "extra":
                continue
            setattr(self, name, type(getattr(self, name))())
        self.chunks = keep_chunks


@dataclass(frozen=True, slots=True)
class Region:
    """A shared memory region a client maps once (KV.REGIONS)."""

    name: str  # region id used in handles, e.g. "dram0"
    kind: str  # "shm" or "cuda"
    size: int
    path: str  # shm name (for /dev/shm) or hex CUDA IPC handle
    device: int = -1  # CUDA device ordinal, -1 for host memory
    pci_bus_id: str = ""  # the GPU's PCI bus id: ordinals differ with CUDA_VISIBLE_DEVICES
    instance: str = ""  # identity of this region in this server instance (random, not a PID)


@dataclass(frozen=True, slots=True)
class Handle:
    """Where a chunk's bytes lie inside a region."""

    region: str
    offset: int
    length: int
    instance: str = ""  # the region's instance identity (Region.instance)


class Tier(ABC):
    """One storage medium. See the module docstring for the contract."""

    name: ClassVar[str]
    #: True when the tier can hand out zero-copy handles to other processes.
    shareable: ClassVar[bool] = False
    #: True when the tier keeps chunks across restarts (scan() then returns them).
    persistent: ClassVar[bool] = False

    def __init__(self) -> None:
        self.stats = TierStats()

    @property
    @abstractmethod
    def capacity(self) -> int: ...

    @property
    @abstractmethod
    def used(self) -> int: ...

    @abstractmethod
    async def put(self, meta: ChunkMeta, data: Buffer) -> None: ...

    @abstractmethod
    async def get(self, key: ChunkKey, out: memoryview) -> ChunkMeta: ...

    @abstractmethod
    async def delete(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    async def contains(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    async def meta(self, key: ChunkKey) -> ChunkMeta | None: ...

    async def scan(self) -> AsyncIterator[ChunkMeta]:
        """Everything the tier holds (only persistent tiers return anything)."""
        for _ in ():
            yield _

    async def put_many(
        self, items: Sequence[tuple[ChunkMeta, Buffer]]
    ) -> list[BaseException | None]:
        results = await asyncio.gather(*(self.put(m, d) for m, d in items), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def get_many(
        self, items: Sequence[tuple[ChunkKey, memoryview]]
    ) -> list[ChunkMeta | BaseException]:
        return list(
            await asyncio.gather(*(self.get(k, o) for k, o in items), return_exceptions=True)
        )

    async def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        return list(await asyncio.gather(*(self.contains(k) for k in keys)))

    def info(self) -> dict[str, Any]:
        """Tier-specific fields for INFO tiers (fragmentation, backend, paths…)."""
        return {}

    async def prepare(self) -> None:  # noqa: B027 - optional hook
        """Set-up left out of the constructor, awaited by the store at start (while the server
        answers ``-LOADING``): it must be quick; slow work (the dram warm-up) is started here
        as a background task of the tier, which serves meanwhile and ends it in ``close``."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryTier(Tier):
    """A tier of directly addressable memory (dram arena, gpu pool).

    Besides the async contract it offers synchronous, non-blocking primitives used on the
    event loop for the zero-copy paths:

    - ``reserve(key, nbytes)`` → a writable view of a fresh slot that no reader can see;
      raises :class:`TierFull`. ``commit(meta)`` publishes it (replacing any older copy),
      ``abort(key)`` frees it, ``rekey_reserved(old, new)`` binds it to another key.
    - ``view(key)`` → a view of a committed chunk (valid until it is deleted; the store pins
      chunks it hands out).
    - ``handle(key)`` → (region, offset, length) for other processes; ``regions()``.
    """

    shareable = True

    @abstractmethod
    def reserve(self, key: ChunkKey, nbytes: int) -> memoryview: ...

    @abstractmethod
    def commit(self, meta: ChunkMeta) -> None: ...

    @abstractmethod
    def abort(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def rekey_reserved(self, old: ChunkKey, new: ChunkKey) -> None:
        """Bind a pending reservation to another key."""

    @abstractmethod
    def view(self, key: ChunkKey) -> memoryview: ...

    @abstractmethod
    def handle(self, key: ChunkKey) -> Handle: ...

    @abstractmethod
    def reserved_handle(self, key: ChunkKey) -> Handle: ...

    @abstractmethod
    def regions(self) -> list[Region]: ...

    @abstractmethod
    def has(self, key: ChunkKey) -> bool:
        """Synchronous contains() for committed chunks."""

    def largest_free(self) -> int:
        """Largest single allocation that would succeed now (fragmentation-aware)."""
        return max(0, self.capacity - self.used)


TierFactory = Callable[..., Tier]
_REGISTRY: dict[str, TierFactory] = {}


def register_tier(name: str) -> Callable[[TierFactory], TierFactory]:
    """Class decorator: make a tier constructible by name (``build_tier``)."""

    def deco(factory: TierFactory) -> TierFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def build_tier(name: str, config: Any) -> Tier:
    """Build a registered tier from its typed config."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise TierUnavailable(f"unknown tier {name!r}; known: {sorted(_REGISTRY)}") from None
    return factory(config)
