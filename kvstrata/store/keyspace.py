"""The keyspace: every key the server holds, plain blobs (GET/SET) and KV chunks alike.

Chunks join it as ``kv:{namespace}:{hex hash}`` (their records implement :class:`Entry`), so
SCAN, KEYS, TYPE, TTL, EXPIRE, DEL and DBSIZE work on them. The owner of a type registers an
``on_delete`` callback that runs when a user (DEL, UNLINK, expiry, FLUSHALL) removes one of its
keys; the owner itself removes keys with :meth:`Keyspace.remove`, which calls nothing.
``flush_hooks`` are told when a FLUSHALL starts (``True``) and ends (``False``).

SCAN cursors are insertion sequence numbers: every key present for the whole iteration is
returned exactly once, keys added meanwhile may or may not be.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstrata.store.glob import glob_match
from kvstrata.store.sampleset import SampleSet

#: active expiry, as Redis's ``activeExpireCycle``: keys sampled per round, the share of a
#: sample that must have expired for another round, and the time one cycle may take
EXPIRE_SAMPLES = 20
EXPIRE_AGAIN_RATIO = 0.10
EXPIRE_CYCLE_SECONDS = 0.010


class Entry(Protocol):
    type_name: str  # TYPE reply: "string", "kvchunk"
    expire_at: int | None  # absolute ms (wall clock), None = no TTL

    def memory_usage(self) -> int: ...


@dataclass(slots=True)
class StringEntry:
    value: bytes | bytearray
    expire_at: int | None = None
    type_name: str = "string"

    def memory_usage(self) -> int:
        return len(self.value) + 56


def now_ms() -> int:
    return int(time.time() * 1000)


class Keyspace:
    def __init__(self, clock: Callable[[], int] = now_ms) -> None:
        self._clock = clock
        self._data: dict[bytes, Entry] = {}
        self._seq_of: dict[bytes, int] = {}
        self._order_seq: list[int] = []
        self._order_key: list[bytes] = []
        self._next_seq = 1
        self._expiring: SampleSet[bytes] = SampleSet()
        self._on_delete: dict[str, Callable[[bytes, Entry], None]] = {}
        self.flush_hooks: list[Callable[[bool], None]] = []
        self.expired_keys = 0
        self.hits = 0
        self.misses = 0

    # -- owners -------------------------------------------------------------------------
    def register_type(self, type_name: str, on_delete: Callable[[bytes, Entry], None]) -> None:
        self._on_delete[type_name] = on_delete

    def insert(self, key: bytes, entry: Entry) -> None:
        """Add or replace (replacing calls no callback; the caller owns both entries)."""
        if key not in self._data:
            seq = self._next_seq
            self._next_seq += 1
            self._seq_of[key] = seq
            self._order_seq.append(seq)
            self._order_key.append(key)
        self._data[key] = entry
        if entry.expire_at is not None:
            self._expiring.add(key)
        else:
            self._expiring.discard(key)

    def remove(self, key: bytes) -> Entry | None:
        """Owner removal: no callback."""
        entry = self._data.pop(key, None)
        if entry is not None:
            self._seq_of.pop(key, None)
            self._expiring.discard(key)
            if len(self._order_key) > 2 * len(self._data) + 1024:
                self._compact()
        return entry

    # -- users --------------------------------------------------------------------------
    def lookup(self, key: bytes) -> Entry | None:
        entry = self._data.get(key)
        if entry is not None and entry.expire_at is not None and entry.expire_at <= self._clock():
            self._expire(key, entry)
            return None
        return entry

    def peek(self, key: bytes) -> Entry | None:
        """The entry as stored, expired or not; no side effect (eviction policies)."""
        return self._data.get(key)

    def get_string(self, key: bytes) -> StringEntry | Entry | None:
        entry = self.lookup(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def delete(self, key: bytes) -> bool:
        entry = self.lookup(key)
        if entry is None:
            return False
        self.remove(key)
        self._notify(key, entry)
        return True

    def set_expire(self, key: bytes, at_ms: int | None) -> bool:
        entry = self.lookup(key)
        if entry is None:
            return False
        if at_ms is not None and at_ms <= self._clock():
            self.delete(key)
            return True
        entry.expire_at = at_ms
        if at_ms is None:
            self._expiring.discard(key)
        else:
            self._expiring.add(key)
        return True

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: bytes) -> bool:
        return self.lookup(key) is not None

    def count_expiring(self) -> int:
        return len(self._expiring)

    def scan(
        self, cursor: int, count: int, match: bytes | None = None, type_name: str | None = None
    ) -> tuple[int, list[bytes]]:
        start = bisect.bisect_left(self._order_seq, cursor)
        keys: list[bytes] = []
        i = start
        end = len(self._order_seq)
        while i < end and i - start < count:
            key, seq = self._order_key[i], self._order_seq[i]
            i += 1
            if self._seq_of.get(key) != seq:
                continue
            entry = self.lookup(key)
            if entry is None:
                continue
            if type_name is not None and entry.type_name != type_name:
                continue
            if match is not None and not glob_match(match, key):
                continue
            keys.append(key)
        next_cursor = 0 if i >= end else self._order_seq[i]
        return next_cursor, keys

    def keys(self, pattern: bytes) -> list[bytes]:
        now = self._clock()
        return [
            k
            for k, e in list(self._data.items())
            if (e.expire_at is None or e.expire_at > now) and glob_match(pattern, k)
        ]

    def items(self) -> list[tuple[bytes, Entry]]:
        return list(self._data.items())

    def flush(self) -> int:
        items = list(self._data.items())
        self._data.clear()
        self._seq_of.clear()
        self._order_seq.clear()
        self._order_key.clear()
        self._expiring.clear()
        for hook in self.flush_hooks:
            hook(True)
        try:
            for key, entry in items:
                self._notify(key, entry)
        finally:
            for hook in self.flush_hooks:
                hook(False)
        return len(items)

    def expire_cycle(
        self, samples: int = EXPIRE_SAMPLES, budget: float = EXPIRE_CYCLE_SECONDS
    ) -> int:
        """Active expiry (Redis's sampling): sample ``samples`` keys with a TTL, delete the
        expired ones, and go on while more than a tenth of a sample had expired and the cycle
        has not used ``budget`` seconds. The work is bounded whatever the number of keys."""
        removed = 0
        now = self._clock()
        stop = time.perf_counter() + budget
        while self._expiring:
            sample = self._expiring.sample(samples)
            hit = 0
            for key in sample:
                entry = self._data.get(key)
                if entry is not None and entry.expire_at is not None and entry.expire_at <= now:
                    self._expire(key, entry)
                    hit += 1
            removed += hit
            if hit <= len(sample) * EXPIRE_AGAIN_RATIO or time.perf_counter() >= stop:
                break
        return removed

    # -- internals ----------------------------------------------------------------------
    def _expire(self, key: bytes, entry: Entry) -> None:
        self.remove(key)
        self.expired_keys += 1
        self._notify(key, entry)

    def _notify(self, key: bytes, entry: Entry) -> None:
        callback = self._on_delete.get(entry.type_name)
        if callback is not None:
            callback(key, entry)

    def _compact(self) -> None:
        pairs = [(s, k) for s, k in zip(self._order_seq, self._order_key, strict=True)
                 if self._seq_of.get(k) == s]  # fmt: skip
        self._order_seq = [s for s, _ in pairs]
        self._order_key = [k for _, k in pairs]
