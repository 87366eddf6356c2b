"""The vLLM tier's memory of recent hits, so that a lookup can answer without a round trip.

vLLM asks the tier about every key of a request's chain on the scheduler's path. Asking the
server costs one ``KV.MATCH`` round trip and at least one more scheduler step (the first scan
answers ``RETRY``). Most lookups are of chunks this tier stored itself a moment
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
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from itertools import islice, repeat
from operator import itemgetter

__all__ = ["RecentHits", "group_chains"]

_GROUP = itemgetter(slice(-4, None))  # an offload key's KV group index


class RecentHits:
    """Keys known to be stored, each until ``ttl_s`` after it was last seen (thread-safe: the
    tier's store threads and the scheduler thread add, the scheduler thread asks; changes
    hold the lock, a lookup is one ``dict.get``)."""

    __slots__ = ("_clock", "_keys", "_lock", "max_keys", "ttl_s")

    def __init__(
        self, ttl_s: float, max_keys: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s < 0 or max_keys < 0:
            raise ValueError("lookup_cache_s and lookup_cache_keys must be >= 0")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        # key → expiry, oldest first: a plain dict (an OrderedDict inserts 40× slower)
        self._keys: dict[bytes, float] = {}
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
            size = len(known)
            known.update(fresh)  # in C, with no Python per key: a KV.MATCH adds hundreds
            if len(known) - size < len(fresh):  # some were known: they move to the young end
                known.update(zip(fresh, map(known.pop, fresh), strict=True))
            excess = len(known) - self.max_keys
            if excess > 0:  # the oldest leave (a dict keeps insertion order)
                deque(map(known.pop, list(islice(known, excess))), maxlen=0)

    @property
    def until(self) -> Callable[[bytes], float | None]:
        """``key`` → its expiry, or None when not remembered: the dict's own ``get`` (the
        tier's lookup asks it first; most keys are not there, and this costs no Python call)."""
        return self._keys.get

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


def group_chains(keys: list[bytes], positions: Mapping[bytes, int]) -> list[list[bytes]]:
    """``keys`` cut into one chain per KV group (the key's last 4 bytes), each in chain order
    (``positions``: key → end token; a key without one sorts first). A step's hundreds of
    keys are usually one group already in order (vLLM scans a prompt's chunks from the first;
    a sliding-window group from the last): that case runs in C, with no Python per key."""
    if len(set(map(_GROUP, keys))) == 1:
        groups = [keys]
    else:
        by_group: dict[bytes, list[bytes]] = {}
        for key in keys:
            by_group.setdefault(key[-4:], []).append(key)
        groups = list(by_group.values())
    chains = []
    for group in groups:
        pos = list(map(positions.get, group, repeat(0)))
        if pos != sorted(pos):
            group = list(map(group.__getitem__, sorted(range(len(group)), key=pos.__getitem__)))
        chains.append(group)
    return chains
