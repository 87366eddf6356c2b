"""Sessions in the shared tier: ``KV.SESSION`` on one node, ``KV.PREFETCH … SESSION`` on any.

A load balancer may send a conversation's next turn to another worker. So every session
recorded on a node with an S3 tier is also written as a small object beside the chunks
(``{prefix}/{namespace}/sessions/{hex id}``: namespace, id, tail hash, expiry as wall-clock
time; see ``tiers/s3_objects``), and a node asked to prefetch a session reads it from there.

When the object is written follows the node's S3 write policy: at once with write-through
(the chunks are already there), and with write-back when the tail chunk reaches S3 (demoted
there, or already known there), so no node reads a session whose tail it cannot find. Until
then the session waits in a bounded table here.

:meth:`SharedSessions.chain` walks a session's chain from its tail to the root through the
parent links: the local index first, the shared tier (one HEAD per chunk, each adopted into the
index the way KV.MATCH adopts them) for ancestors this node does not know, within one
lookup timeout. Failures never escape: S3 errors are counted and logged like other lookups.

The bucket is untrusted input: the tier checks every field of a session object
(``s3_objects.decode_session``: JSON types, hash lengths, an expiry at most
:data:`~kvstrata.store.sessions.MAX_TTL_MS` plus :data:`MAX_CLOCK_SKEW_MS` ahead) and counts a
bad one with the invalid chunk objects; here it is absent, and this node's own record of the
session stays as it was.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvstrata.chunks import ChunkKey
from kvstrata.store.index import ChunkRecord
from kvstrata.store.kvstore.remote import RemotePath
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.sessions import MAX_CLOCK_SKEW_MS, MAX_TTL_MS
from kvstrata.tiers.base import TierError
from kvstrata.tiers.s3_objects import SessionObject

log = logging.getLogger("kvstrata.store.sessions")

MAX_PENDING = 100_000
MAX_CHAIN = 65_536


@runtime_checkable
class SessionStore(Protocol):
    """A shared tier that keeps session objects (the S3 tier)."""

    name: str

    async def put_session(self, obj: SessionObject) -> None: ...

    async def get_session(
        self, ns: str, session: bytes, max_ttl_ms: int
    ) -> SessionObject | None: ...


class SharedSessions:
    """See the module docstring. ``write_through()`` says whether the shared tier is written
    at PUT time (then session objects are written at once)."""

    def __init__(
        self, state: StoreState, remote: RemotePath, write_through: Callable[[], bool]
    ) -> None:
        self.state = state
        self.remote = remote
        self.write_through = write_through
        tier = state.remote
        self.tier: SessionStore | None = tier if isinstance(tier, SessionStore) else None
        #: sessions waiting for their tail to reach S3 (write-back), oldest first
        self._pending: OrderedDict[tuple[str, bytes], SessionObject] = OrderedDict()
        self._tails: dict[ChunkKey, set[tuple[str, bytes]]] = {}
        self.written = 0
        self.fetched = 0
        if self.tier is not None:
            remote.on_shared = self._reached_s3

    @property
    def enabled(self) -> bool:
        return self.tier is not None

    def pending(self, ns: str, session: bytes) -> bool:
        """True while a session recorded here waits for its tail to reach S3."""
        return (ns, session) in self._pending

    def record(self, ns: str, session: bytes, tail: bytes, ttl_ms: int) -> None:
        """KV.SESSION: write the session object now, or when its tail reaches S3."""
        remote = self.state.remote
        if self.tier is None or remote is None:
            return
        obj = SessionObject(ns, session, tail, int(time.time() * 1000) + ttl_ms)
        self._unpend((ns, session))  # an earlier tail of this session no longer counts
        key = ChunkKey(ns, tail)
        rec = self.state.live(key)
        if rec is None or remote.name in rec.tiers or self.write_through():
            self._write(obj)
            return
        self._pending[(ns, session)] = obj
        self._tails.setdefault(key, set()).add((ns, session))
        while len(self._pending) > MAX_PENDING:
            self._unpend(next(iter(self._pending)))

    def _unpend(self, which: tuple[str, bytes]) -> SessionObject | None:
        obj = self._pending.pop(which, None)
        if obj is not None:
            key = ChunkKey(obj.namespace, obj.tail)
            waiting = self._tails.get(key)
            if waiting is not None:
                waiting.discard(which)
                if not waiting:
                    del self._tails[key]
        return obj

    def _reached_s3(self, rec: ChunkRecord) -> None:
        for which in list(self._tails.get(rec.key, ())):
            obj = self._unpend(which)
            if obj is not None:
                self._write(obj)

    def _write(self, obj: SessionObject) -> None:
        tier = self.tier
        assert tier is not None

        async def write() -> None:
            try:
                await tier.put_session(obj)
                self.written += 1
            except TierError as exc:
                self.state.tier_error(tier.name, f"session {obj.id.hex()[:16]}", exc)

        try:
            self.state.spawn(write(), f"session {obj.id.hex()[:16]}")
        except RuntimeError:  # no running loop (interpreter shutdown)
            pass

    async def fetch(self, ns: str, session: bytes) -> SessionObject | None:
        """The session as another node recorded it (None: unknown, expired, or S3 failed)."""
        if self.tier is None:
            return None
        try:
            obj = await self.tier.get_session(ns, session, MAX_TTL_MS + MAX_CLOCK_SKEW_MS)
        except TierError as exc:
            self.state.tier_error(self.tier.name, f"session {session.hex()[:16]}", exc)
            return None
        if obj is not None:
            self.fetched += 1
        return obj

    async def chain(self, ns: str, tail: bytes) -> list[bytes]:
        """Hashes of the chain ending at ``tail``, root first: parent links of the local
        index, then of the shared tier for ancestors this node does not know."""
        out: list[bytes] = []
        seen: set[bytes] = set()
        deadline = time.monotonic() + self.remote.timeout
        h = tail
        while h and h not in seen and len(out) < MAX_CHAIN:
            seen.add(h)
            out.append(h)
            rec = self.state.live(ChunkKey(ns, h))
            if rec is None and self.remote.enabled and time.monotonic() < deadline:
                rec = await self.remote.find(ChunkKey(ns, h))
            if rec is None:
                break
            h = rec.parent
        out.reverse()
        return out
