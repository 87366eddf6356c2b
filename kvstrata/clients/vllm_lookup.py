"""The vLLM tier's memory of recent hits, so that a lookup can answer without a round trip.

vLLM asks the tier about every key of a request's chain on the scheduler's path. Asking the
server costs one ``KV.MATCH`` on the tier's lookup thread and at least one more scheduler step
(the first scan answers ``RETRY``). Most lookups are of chunks this tier stored itself a moment
ago, or of a prefix another request just matched; :class:`RecentHits` remembers those keys for
``ttl_s`` seconds (at most ``max_keys``, the oldest leave first) and the tier answers ``HIT``
from it at once.

A remembered hit may be stale (the server evicted the chunk since, or restarted). That costs
what an eviction between lookup and load always cost: the load job reports only the keys that
landed (``successful_keys``) and vLLM recomputes the rest; the tier forgets every key a load or
a ``KV.MATCH`` found missing, and everything when the server cannot be reached. Misses are never
remembered: a chunk another instance stores is found by the next ``KV.MATCH``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

__all__ = ["RecentHits", "group_chains"]


class RecentHits:
    """Keys known to be stored, each until ``ttl_s`` after it was last seen (thread-safe: the
    tier's store and lookup threads add, the scheduler thread asks)."""

    __slots__ = ("_clock", "_keys", "_lock", "max_keys", "ttl_s")

    def __init__(
        self, ttl_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s < 0 or max_keys < 0:
            raise ValueError("lookup_cache_s and lookup_cache_keys must be >= 0")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[bytes, float] = OrderedDict()  # key → expiry, oldest first
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0 and self.max_keys > 0

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[bytes]) -> None:
        """The server holds ``keys`` now (a store succeeded, or a KV.MATCH said so)."""
        if not self.enabled:
            return
        fresh = dict.fromkeys(keys, self._clock() + self.ttl_s)
        known = self._keys
        with self._lock:
            seen = known.keys() & fresh.keys()  # renewed: they move to the young end
            known.update(fresh)  # (in C, as below: a KV.MATCH adds hundreds at once)
            if seen:
                deque(map(known.move_to_end, seen), maxlen=0)
            while len(known) > self.max_keys:
                known.popitem(last=False)

    def hit(self, key: bytes) -> bool:
        """True when ``key`` was seen stored less than ``ttl_s`` ago."""
        until = self._keys.get(key)
        if until is None:
            return False
        if until > self._clock():
            return True
        with self._lock:
            if self._keys.get(key, 0.0) <= self._clock():
                self._keys.pop(key, None)
        return False

    def forget(self, keys: Iterable[bytes]) -> None:
        """The server does not hold ``keys`` (a load or a KV.MATCH missed them)."""
        with self._lock:
            deque(map(self._keys.pop, keys, repeat(None)), maxlen=0)

    def clear(self) -> None:
        """The server could not be reached: nothing is known any more."""
        with self._lock:
            self._keys.clear()


def group_chains(keys: list[bytes], chain: dict[Any, bytes]) -> list[list[bytes]]:
    """``keys`` cut into one chain per KV group (the key's last 4 bytes), in chain order."""
    position = {key: end for (_, end), key in chain.items()}
    groups: dict[bytes, list[bytes]] = {}
    for key in keys:
        groups.setdefault(key[-4:], []).append(key)
    return [sorted(g, key=lambda k: position.get(k, 0)) for g in groups.values()]
