"""Plain string values (GET/SET): where they live, how they are counted, and ``maxmemory``.

- A **small** value (under :data:`LARGE_VALUE`, 64 KiB) lives in the Python heap
  (:class:`~kvstrata.store.keyspace.StringEntry`) and counts ``len(key) + len(value) +``
  :data:`ENTRY_OVERHEAD` bytes.
- A **large** value lives in the tiers as a chunk of the internal namespace :data:`STRING_NS`
  (never a client namespace, never in the keyspace, never uploaded to s3, dropped at restart):
  in the DRAM arena first (SET receives it into its slot, GET replies from it: no copy),
  demoted to NVMe and evicted from the last tier by the tiers' own LRU, like KV chunks. Its
  key (:class:`LargeEntry`) counts ``len(key) +`` :data:`ENTRY_OVERHEAD`; its bytes count in
  the tiers (``INFO tiers``), which bound them. A large value the tiers evicted reads as a
  miss and its key is deleted then. Without a KV store (no tiers) large values stay in the
  heap and count in full.

``maxmemory`` bounds the counted bytes (0: the DRAM tier's size). Before a write that would go
over it, keys are evicted by ``maxmemory-policy`` as Redis does — ``allkeys-lru`` (exact LRU),
``allkeys-random``, ``volatile-lru`` / ``volatile-random`` / ``volatile-ttl`` (among keys with a
TTL; sampled, as Redis samples) — and counted in ``evicted_keys``; ``noeviction``, or nothing left
to evict, answers Redis's ``-OOM command not allowed when used memory > 'maxmemory'.``
KV chunks are not evicted by this policy: their tiers' watermarks govern them.
"""

from __future__ import annotations

import random
import secrets
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from kvstrata.chunks import ChunkKey
from kvstrata.config import Config
from kvstrata.protocol.errors import OutOfMemoryError
from kvstrata.store.keyspace import Entry, Keyspace, StringEntry
from kvstrata.store.kvstore.state import NOT_NOW, STRING_NS

LARGE_VALUE = 64 * 1024
#: what a string key costs besides its key and value bytes (entry object, dict slots)
ENTRY_OVERHEAD = 64
_SAMPLE = 16  # candidates a volatile-* or random policy looks at per eviction
OOM_MESSAGE = "command not allowed when used memory > 'maxmemory'."


@dataclass(slots=True)
class LargeEntry:
    """A key whose value is the chunk ``ChunkKey(STRING_NS, chunk)`` in the tiers."""

    chunk: bytes
    size: int
    expire_at: int | None = None
    type_name: str = "string"

    def memory_usage(self) -> int:
        return self.size + ENTRY_OVERHEAD

    @property
    def chunk_key(self) -> ChunkKey:
        return ChunkKey(STRING_NS, self.chunk)


class _KeyBag:
    """A set with O(1) add, remove and uniform random choice."""

    def __init__(self) -> None:
        self._keys: list[bytes] = []
        self._pos: dict[bytes, int] = {}

    def add(self, key: bytes) -> None:
        if key not in self._pos:
            self._pos[key] = len(self._keys)
            self._keys.append(key)

    def discard(self, key: bytes) -> None:
        i = self._pos.pop(key, None)
        if i is None:
            return
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._pos[last] = i

    def choice(self) -> bytes | None:
        return random.choice(self._keys) if self._keys else None


class StringStore:
    """See the module docstring. ``kv`` (the KVStore) is set once the tiers exist."""

    def __init__(self, keyspace: Keyspace, config: Config) -> None:
        self.keyspace = keyspace
        self.config = config
        self.kv: Any = None
        self.used = 0
        self.evicted_keys = 0
        #: string keys, least recently used first → the bytes each one counts
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._bag = _KeyBag()
        keyspace.register_type("string", self._on_delete)

    # -- limits ---------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        configured = int(self.config.values.get("maxmemory", 0))
        return configured or int(self.config.values["dram-capacity"])

    @property
    def policy(self) -> str:
        return str(self.config.values.get("maxmemory-policy", "allkeys-lru"))

    @staticmethod
    def cost(key: bytes, entry: Entry) -> int:
        if isinstance(entry, StringEntry):
            return len(key) + len(entry.value) + ENTRY_OVERHEAD
        return len(key) + ENTRY_OVERHEAD

    def make_room(self, need: int) -> None:
        """Evict by policy until ``need`` more bytes fit; OutOfMemoryError when they cannot."""
        limit = self.limit
        while self.used + need > limit:
            victim = None if self.policy == "noeviction" else self._victim()
            if victim is None:
                raise OutOfMemoryError(OOM_MESSAGE)
            if not self.keyspace.delete(victim):  # expired just now: forgotten all the same
                self._forget(victim, None)
            else:
                self.evicted_keys += 1

    def _victim(self) -> bytes | None:
        policy = self.policy
        if policy == "allkeys-lru":
            return next(iter(self._lru), None)
        if policy == "allkeys-random":
            return self._bag.choice()
        if policy == "volatile-lru":
            for i, key in enumerate(self._lru):
                if i >= 4 * _SAMPLE:
                    break
                if self._ttl_of(key) is not None:
                    return key
            return None
        sample = {k for k in (self._bag.choice() for _ in range(_SAMPLE)) if k is not None}
        volatile = [(ttl, k) for k in sample if (ttl := self._ttl_of(k)) is not None]
        if not volatile:
            return None
        return min(volatile)[1] if policy == "volatile-ttl" else random.choice(volatile)[1]

    def _ttl_of(self, key: bytes) -> int | None:
        entry = self.keyspace.peek(key)
        return None if entry is None else entry.expire_at

    # -- reads ----------------------------------------------------------------------------

    def lookup(self, key: bytes, count: bool = True) -> Entry | None:
        """The key's entry (any type; counted as a hit or miss when ``count``), made most
        recently used."""
        entry = self.keyspace.get_string(key) if count else self.keyspace.lookup(key)
        if entry is not None and key in self._lru:
            self._lru.move_to_end(key)
        return entry

    def read_large_now(self, key: bytes, entry: LargeEntry) -> Any:
        """The payload of a large value (a ``Payload`` to release), None when the tiers lost
        it (the key is deleted), or NOT_NOW: call :meth:`read_large`."""
        if self.kv is None:
            return None
        payload = self.kv.get_now(STRING_NS, entry.chunk)
        if payload is None:
            self._lost(key, entry)
        return payload

    async def read_large(self, key: bytes, entry: LargeEntry) -> Any:
        payload = await self.kv.get(STRING_NS, entry.chunk)
        if payload is None:
            self._lost(key, entry)
        return payload

    def _lost(self, key: bytes, entry: LargeEntry) -> None:
        if self.keyspace.lookup(key) is entry:
            self.keyspace.delete(key)

    # -- writes ---------------------------------------------------------------------------

    def reserve_sink(self, nbytes: int) -> Any:
        """A DRAM slot to receive a large SET value straight into (a ``StoreSink``), or None
        (the value is then received into a buffer and copied by :meth:`store`)."""
        if nbytes < LARGE_VALUE or self.kv is None or self.kv.state.dram is None:
            return None
        return self.kv.reserve_put(STRING_NS, secrets.token_bytes(16), b"", nbytes)

    def store(
        self,
        key: bytes,
        value: bytes | bytearray | memoryview,
        expire_at: int | None,
        sink: Any = None,
    ) -> Awaitable[None] | None:
        """Set ``key`` to ``value`` (received into ``sink`` when one was reserved). Returns
        None when done, or an awaitable when a large value needs tier I/O first."""
        if sink is not None:
            self.make_room(len(key) + ENTRY_OVERHEAD)
            large = LargeEntry(sink.key.hash, sink.nbytes, expire_at)
            return self._store_sink(key, large, sink)
        if len(value) < LARGE_VALUE or self.kv is None or self.kv.state.dram is None:
            data = value if isinstance(value, bytes | bytearray) else bytes(value)
            cost = len(key) + len(data) + ENTRY_OVERHEAD
            if self.used + cost > self.limit:
                self.make_room(cost)
            self._bind(key, StringEntry(data, expire_at), cost)
            return None
        self.make_room(len(key) + ENTRY_OVERHEAD)
        chunk = secrets.token_bytes(16)
        large = LargeEntry(chunk, len(value), expire_at)
        sink = self.kv.reserve_put(STRING_NS, chunk, b"", len(value))
        if sink is not None:
            sink.view[:] = value
            if self.kv.put_sink_now(STRING_NS, chunk, b"", 0, None, sink) is not NOT_NOW:
                self._bind(key, large, self.cost(key, large))
                return None
        return self._store_slow(key, large, value, sink)

    def _store_sink(self, key: bytes, large: LargeEntry, sink: Any) -> Awaitable[None] | None:
        if self.kv.put_sink_now(STRING_NS, large.chunk, b"", 0, None, sink) is not NOT_NOW:
            self._bind(key, large, self.cost(key, large))
            return None
        return self._store_slow(key, large, None, sink)

    async def _store_slow(self, key: bytes, large: LargeEntry, value: Any, sink: Any) -> None:
        data = sink.view if sink is not None else value
        await self.kv.put(STRING_NS, large.chunk, b"", data, sink=sink)
        self._bind(key, large, self.cost(key, large))

    def _bind(self, key: bytes, entry: StringEntry | LargeEntry, cost: int) -> None:
        old = self.keyspace.peek(key)
        if old is not None and type(old) is not StringEntry:
            if isinstance(old, LargeEntry):
                self._drop_chunk(old)
            else:
                self.keyspace.delete(key)  # another type's owner must hear that it is gone
        lru = self._lru
        before = lru.get(key)
        lru[key] = cost
        if before is None:
            self._bag.add(key)
            self.used += cost
        else:  # replaced in place: the key keeps its SCAN order
            lru.move_to_end(key)
            self.used += cost - before
        self.keyspace.insert(key, entry)

    # -- removal --------------------------------------------------------------------------

    def _on_delete(self, key: bytes, entry: Entry) -> None:
        """DEL, UNLINK, expiry, FLUSHALL or eviction removed a string key."""
        self._forget(key, entry)

    def _forget(self, key: bytes, entry: Entry | None) -> None:
        cost = self._lru.pop(key, None)
        if cost is not None:
            self._bag.discard(key)
            self.used -= cost
        if isinstance(entry, LargeEntry):
            self._drop_chunk(entry)

    def _drop_chunk(self, entry: LargeEntry) -> None:
        if self.kv is not None:
            rec = self.kv.state.live(entry.chunk_key)
            if rec is not None:
                self.kv.state.retire(rec)
