"""Tier events: every chunk entering or leaving a tier, for routers that follow a node's cache.

The index calls :meth:`TierEvents.residency` from the one place residency changes
(``ChunkIndex._residency``: a live record gained or lost a copy in a tier, or was removed), so
no write, read, move, delete or expiry path can be left out. This module turns those calls into
plain event tuples, gathers them for :data:`FLUSH_DELAY` (a millisecond: the loop ticks of a
pipeline of commands) and hands each such list, in order, to a sink
(``kvstrata.server.events`` encodes them in vLLM's wire format and publishes them on ZMQ). It
does no I/O itself and never blocks: the sink must not either.

Events (tuples, first item the kind):

- ``(STORED, namespace, hash, parent, block_size, medium, token_ids)`` — the chunk now has a
  copy in the tier named by ``medium`` (:data:`MEDIA`); ``token_ids`` is the packed
  little-endian u32 token ids given with the chunk (``KV.PUT … TOKENIDS``), or ``b""``;
- ``(REMOVED, namespace, hash, medium)`` — that copy is gone (demoted, evicted, deleted,
  expired, dropped as corrupt);
- ``(CLEARED,)`` — everything is gone: at start (before the index is rebuilt, whose chunks
  then follow as STORED) and on ``FLUSHALL`` (whose per-chunk removals are not sent).

Chunks of the server's own namespaces (large plain strings) are never reported.

Token ids cost memory only for the chunks they were given with: the packed ids (4 bytes per
token, plus a 33-byte ``bytes`` header) and one dict slot and a two-item list (~150 bytes),
held while the chunk has a copy in some tier; they are not kept across restarts. Ids given
with a reservation wait for its KV.COMMIT in a map of at most :data:`EXPECTED_MAX` bytes (an
abandoned batch's ids are pushed out by newer ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from kvstrata.chunks import ChunkKey

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"

#: tier → the ``medium`` string of vLLM-format events. Dynamo's router
#: (``StorageTier::from_kv_medium``) maps GPU → device, CPU_PINNED → host pinned,
#: DISK → disk, EXTERNAL → external; SGLang's ``StorageMedium`` uses the same four strings.
MEDIA = {"gpu": "GPU", "dram": "CPU_PINNED", "nvme": "DISK", "s3": "EXTERNAL"}

Event = tuple[Any, ...]
#: seconds events wait to be sent with the ones that follow: pipelined KV.PUTs each run in a
#: loop tick of their own (they await), so a flush per tick sent one message per event
FLUSH_DELAY = 0.001
#: most bytes of token ids waiting for their chunks' publication (KV.MRESERVE … KV.COMMIT)
EXPECTED_MAX = 64 * 1024**2


class EventSink(Protocol):
    """Where each flush's events go (``kvstrata.server.events.ZmqPublisher``)."""

    def send(self, events: list[Event]) -> None: ...

    def info(self) -> list[tuple[str, object]]: ...


class _Record(Protocol):  # the part of ChunkRecord read here (no import of the index)
    key: ChunkKey
    parent: bytes
    tokens: int


class TierEvents:
    """See the module docstring. ``block_size`` is what a chunk stored without TOKENS counts
    (``chunk-tokens``); ``internal`` tells the server's own chunks (never reported)."""

    def __init__(
        self, sink: EventSink, block_size: int, internal: Callable[[ChunkKey], bool]
    ) -> None:
        self.sink = sink
        self.block_size = block_size
        self._internal = internal
        self._pending: list[Event] = []
        self._scheduled = False
        self._muted = 0
        #: key → [packed token ids, copies reported]: ids given with a chunk, kept while it has one
        self.tokens: dict[ChunkKey, list[Any]] = {}
        #: ids given with a write in flight (KV.PUT/KV.MRESERVE … TOKENIDS), taken by its
        #: first STORED; the oldest go past :data:`EXPECTED_MAX` bytes (a batch never committed)
        self._expected: dict[ChunkKey, bytes] = {}
        self._expected_bytes = 0
        self.token_bytes = 0
        self.events = 0
        self.cleared()  # a router that knew this node's earlier life forgets it

    # -- from the index ---------------------------------------------------------------------

    def residency(self, rec: _Record, tier: str, delta: int) -> None:
        key = rec.key
        if self._muted or self._internal(key):
            return
        medium = MEDIA.get(tier, tier.upper())
        if delta > 0:
            held = self.tokens.get(key)
            if held is None:
                ids = self._expected.pop(key, None)
                if ids is not None:
                    self._expected_bytes -= len(ids)
                    held = self.tokens[key] = [ids, 0]
                    self.token_bytes += len(ids)
            if held is not None:
                held[1] += 1
            size = rec.tokens or self.block_size
            ids = held[0] if held is not None else b""
            self._add((STORED, key.namespace, key.hash, rec.parent, size, medium, ids))
        else:
            held = self.tokens.get(key)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self.tokens[key]
                    self.token_bytes -= len(held[0])
            self._add((REMOVED, key.namespace, key.hash, medium))

    # -- from the keyspace (FLUSHALL) and the commands ---------------------------------------

    def flushing(self, starts: bool) -> None:
        """FLUSHALL: its per-chunk removals are left out, one CLEARED follows."""
        self._muted += 1 if starts else -1
        if not starts and not self._muted:
            self.cleared()

    def cleared(self) -> None:
        self.tokens.clear()
        self.token_bytes = 0
        self._add((CLEARED,))

    def expect_tokens(self, key: ChunkKey, ids: bytes) -> None:
        """The token ids of a chunk about to be written; :meth:`forget_tokens` after the
        write, stored or not (a stored chunk has taken them by then)."""
        self.forget_tokens(key)
        self._expected[key] = ids = bytes(ids)
        self._expected_bytes += len(ids)
        while self._expected_bytes > EXPECTED_MAX and len(self._expected) > 1:
            self.forget_tokens(next(iter(self._expected)))

    def forget_tokens(self, key: ChunkKey) -> None:
        ids = self._expected.pop(key, None)
        if ids is not None:
            self._expected_bytes -= len(ids)

    def info(self) -> list[tuple[str, object]]:
        """INFO events: what the store reported, the token ids it keeps, then the sink's."""
        return [
            ("kv_events", 1),
            ("kv_events_total", self.events + len(self._pending)),
            ("kv_events_token_chunks", len(self.tokens)),
            ("kv_events_token_bytes", self.token_bytes),
            *self.sink.info(),
        ]

    # -- batching, a millisecond at a time ---------------------------------------------------

    def _add(self, event: Event) -> None:
        self._pending.append(event)
        if self._scheduled:
            return
        try:
            asyncio.get_running_loop().call_later(FLUSH_DELAY, self.flush)
        except RuntimeError:  # no loop (tests building a store by hand): sent on next flush
            return
        self._scheduled = True

    def flush(self) -> None:
        """Hand the events gathered so far to the sink (:data:`FLUSH_DELAY` after the first)."""
        self._scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        self.events += len(events)
        self.sink.send(events)


# -- the polling side: per-tier longest prefixes (KV.TIERMATCH, /tiermatch) ---------------------


class TierWalk:
    """Walks a chain through the index without touching it (a router's poll is no access: it
    must not keep chunks hot): how many leading chunks this node holds in any tier, their
    tokens, and per tier the longest prefix whose every chunk has a copy there. Feed it the
    chain in slices; it stops at the first chunk absent or expired. Only local knowledge: no
    I/O, so a chunk only in s3 that this node never saw is not counted."""

    def __init__(
        self, get: Callable[[ChunkKey], Any], ns: str, tiers: list[str], now_ms: int
    ) -> None:
        self._get = get
        self._ns = ns
        self._now = now_ms
        self.tiers = dict.fromkeys(tiers, 0)
        self._open = list(tiers)
        self.matched = 0
        self.tokens = 0
        self.done = False

    def feed(self, hashes: list[bytes]) -> None:
        for h in hashes:
            if self.done:
                return
            rec = self._get(ChunkKey(self._ns, h))
            if rec is None or not rec.tiers or (
                rec.expire_at is not None and rec.expire_at <= self._now
            ):
                self.done = True
                return
            self.matched += 1
            self.tokens += rec.tokens
            still = []
            for tier in self._open:
                if tier in rec.tiers:
                    self.tiers[tier] += 1
                    still.append(tier)
            self._open = still
