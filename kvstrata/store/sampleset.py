"""A set of keys with O(1) add, discard and uniform random sampling.

Active expiry samples the keys that have a TTL (as Redis samples its ``expires`` dict), so the
work of one expiry cycle does not depend on how many such keys exist. A list holds the members
and a dict their positions; a discard moves the last member into the hole.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class SampleSet(Generic[T]):
    __slots__ = ("_items", "_pos")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._pos: dict[T, int] = {}

    def add(self, item: T) -> None:
        if item not in self._pos:
            self._pos[item] = len(self._items)
            self._items.append(item)

    def discard(self, item: T) -> None:
        pos = self._pos.pop(item, None)
        if pos is None:
            return
        last = self._items.pop()
        if pos < len(self._items):
            self._items[pos] = last
            self._pos[last] = pos

    def clear(self) -> None:
        self._items.clear()
        self._pos.clear()

    def sample(self, k: int, rng: random.Random | None = None) -> list[T]:
        """Up to ``k`` members drawn uniformly (with replacement, duplicates removed): O(k)."""
        n = len(self._items)
        if n == 0:
            return []
        if n <= k:
            return list(self._items)
        pick = (rng or random).randrange
        return list(dict.fromkeys(self._items[pick(n)] for _ in range(k)))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._pos

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items))
