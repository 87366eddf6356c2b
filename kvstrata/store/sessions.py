"""Sessions: where each conversation currently ends (``KV.SESSION ns session hash [TTL ms]``).

An engine records, after each turn, the tail chunk of a session's conversation. A prefetch hint
for the session (``KV.PREFETCH ns SESSION id``) then promotes that tail's whole chain (the tail
and its ancestors, found through the parent links of the index) toward a fast tier before the
next turn arrives.

The table is per node (``shared_sessions`` also writes each session to S3 for other nodes),
bounded (least recently recorded sessions are forgotten first) and every entry expires after
its TTL. Synchronous bookkeeping, no I/O.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TTL_MS = 3_600_000  # one hour
MAX_TTL_MS = 30 * 86_400_000  # KV.SESSION's TTL limit: 30 days
#: how far another node's wall clock may run ahead of ours when it wrote a session object
MAX_CLOCK_SKEW_MS = 3_600_000
MAX_SESSIONS = 100_000
MAX_SESSION_BYTES = 256


@dataclass(frozen=True, slots=True)
class Session:
    namespace: str
    id: bytes
    tail: bytes  # hash of the last chunk of the conversation
    expires: float  # monotonic seconds


class SessionTable:
    """(namespace, session id) → :class:`Session`; see the module docstring."""

    def __init__(
        self, limit: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.clock = clock
        self._items: OrderedDict[tuple[str, bytes], Session] = OrderedDict()
        self.recorded = 0
        self.forgotten = 0  # pushed out by the limit

    def __len__(self) -> int:
        return len(self._items)

    def record(self, ns: str, session: bytes, tail: bytes, ttl_ms: int = DEFAULT_TTL_MS) -> bool:
        """Remember the session's tail; True when the tail moved (or the session is new)."""
        key = (ns, session)
        entry = Session(ns, session, tail, self.clock() + ttl_ms / 1000.0)  # before the pop:
        old = self._items.pop(key, None)  # a failure above leaves the old record in place
        self._items[key] = entry
        self.recorded += 1
        while len(self._items) > self.limit:
            self._items.popitem(last=False)
            self.forgotten += 1
        return old is None or old.tail != tail

    def get(self, ns: str, session: bytes) -> Session | None:
        key = (ns, session)
        entry = self._items.get(key)
        if entry is None:
            return None
        if entry.expires <= self.clock():
            del self._items[key]
            return None
        return entry

    def forget(self, ns: str, session: bytes) -> bool:
        return self._items.pop((ns, session), None) is not None

    def sweep(self, budget: int = 64) -> int:
        """Drop up to ``budget`` expired entries from the oldest end (cheap, called often)."""
        now = self.clock()
        removed = 0
        items = self._items
        for key in list(itertools.islice(items, budget)):
            if items[key].expires <= now:
                del items[key]
                removed += 1
        return removed
