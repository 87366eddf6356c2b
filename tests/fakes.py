"""Test doubles for the store: an in-memory slow tier with failure injection and gates, and a
helper that builds a KVStore over a real (small) DramTier plus fake lower tiers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.config import Config, load_config
from kvstrata.store.keyspace import Keyspace
from kvstrata.tiers.base import Buffer, ChunkMissing, Tier, TierFull, TierIOError
from kvstrata.tiers.checksum import checksum
from kvstrata.tiers.dram import DramConfig, DramTier

if TYPE_CHECKING:
    from kvstrata.tiers.s3 import S3Tier
    from tests.s3fixture import MotoServer


class FakeTier(Tier):
    """A dict-backed tier (nvme/s3 stand-in). ``gate`` (an Event) blocks get() until set;
    ``fail_puts``/``fail_gets`` make them raise TierIOError; ``corrupt`` flips stored bytes."""

    def __init__(self, name: str = "nvme", capacity: int = 1 << 30, persistent: bool = True):
        super().__init__()
        self.name = name  # type: ignore[misc]
        self.persistent = persistent  # type: ignore[misc]
        self._capacity = capacity
        self.data: dict[ChunkKey, tuple[ChunkMeta, bytes]] = {}
        self.gate: asyncio.Event | None = None
        self.fail_puts = False
        self.fail_gets = False
        self.puts = 0
        self.gets = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return sum(m.size for m, _ in self.data.values())

    async def put(self, meta: ChunkMeta, data: Buffer) -> None:
        await asyncio.sleep(0)
        if self.fail_puts:
            raise TierIOError(f"{self.name}: injected write failure")
        old = self.data.get(meta.key)
        if self.used - (old[0].size if old else 0) + meta.size > self._capacity:
            raise TierFull(f"{self.name}: full")
        self.puts += 1
        self.data[meta.key] = (meta, bytes(data))

    async def get(self, key: ChunkKey, out: memoryview) -> ChunkMeta:
        self.gets += 1
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.fail_gets:
            raise TierIOError(f"{self.name}: injected read failure")
        try:
            meta, blob = self.data[key]
        except KeyError:
            raise ChunkMissing(key) from None
        out[: meta.size] = blob
        return meta

    async def delete(self, key: ChunkKey) -> bool:
        await asyncio.sleep(0)
        return self.data.pop(key, None) is not None

    async def contains(self, key: ChunkKey) -> bool:
        return key in self.data

    async def meta(self, key: ChunkKey) -> ChunkMeta | None:
        item = self.data.get(key)
        return item[0] if item else None

    async def scan(self) -> AsyncIterator[ChunkMeta]:
        for meta, _ in list(self.data.values()):
            yield meta

    def corrupt(self, key: ChunkKey) -> None:
        meta, blob = self.data[key]
        self.data[key] = (meta, bytes([blob[0] ^ 0xFF]) + blob[1:])

    def holds(self, key: ChunkKey) -> bytes | None:
        item = self.data.get(key)
        return item[1] if item else None


def make_config(**overrides: Any) -> Config:
    flags = {"lease-ttl": "30000"}
    flags.update({k.replace("_", "-"): str(v) for k, v in overrides.items()})
    return load_config(flags=flags, env={})


def make_dram(capacity: int = 1 << 20) -> DramTier:
    return DramTier(DramConfig(capacity=capacity, pin="no", name_prefix="kvstrata-test"))


def meta_for(ns: str, h: bytes, data: bytes, parent: bytes = b"", tokens: int = 0) -> ChunkMeta:
    return ChunkMeta(ChunkKey(ns, h), parent, tokens, len(data), checksum(data))


def chain(n: int, prefix: bytes = b"h") -> list[bytes]:
    """n distinct hashes (a chain is formed by passing each previous one as parent)."""
    return [prefix + i.to_bytes(4, "big") for i in range(n)]


def new_keyspace() -> Keyspace:
    return Keyspace()


class open_store:  # used as ``async with open_store(...) as store``
    """Build (and optionally start) a KVStore over ``tiers`` (default: a 1 MiB DramTier)."""

    def __init__(self, tiers: list[Tier] | None = None, start: bool = True, **cfg: Any) -> None:
        from kvstrata.store.kvstore import KVStore

        self.store = KVStore(make_config(**cfg), Keyspace(), tiers or [make_dram()])
        self.start = start

    async def __aenter__(self) -> Any:
        if self.start:
            await self.store.start()
        return self.store

    async def __aexit__(self, *exc: object) -> None:
        await self.store.close()


def s3_tier(server: MotoServer, bucket: str, **kw: Any) -> S3Tier:
    """An S3Tier on a moto server: short timeouts, no retries, no negative cache (``kw`` wins)."""
    from kvstrata.tiers.s3 import S3Config, S3Tier

    settings: dict[str, Any] = {"max_connections": 4, "timeout": 2.0, "retries": 0,
                                "retry_after": 0.2, "negative_ttl": 0.0}  # fmt: skip
    settings.update(kw)
    return S3Tier(S3Config(bucket=bucket, endpoint=server.endpoint, **settings))


async def wait_until(cond: Callable[[], bool], limit: float = 5.0) -> bool:
    """Poll ``cond`` on the event loop until it holds or ``limit`` seconds pass; its last value."""
    for _ in range(int(limit / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


def wait_for(cond: Callable[[], bool], limit: float = 10.0) -> bool:
    """Poll ``cond`` from a test thread (a server in another thread or process) until it holds
    or ``limit`` seconds pass; its last value."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def cmd(*args: bytes | str) -> bytes:
    """One command as a RESP multibulk, as clients send it."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        raw = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%b\r\n" % (len(raw), raw))
    return b"".join(out)


def write_slot(r: Any, handle: list[Any], data: bytes) -> None:
    """Fill a reserved slot through the shared-memory region its handle names."""
    region, offset, length, _ = handle
    paths = {reg[b"name"]: reg[b"path"] for reg in r.execute_command("KV.REGIONS")}
    shm = shared_memory.SharedMemory(name=paths[region].decode())
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    try:
        assert shm.buf is not None and length == len(data)
        shm.buf[offset : offset + length] = data
    finally:
        shm.close()
