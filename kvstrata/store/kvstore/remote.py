"""Cross-node lookups: chunks that other nodes stored in the shared tier (s3).

A node knows the chunks it stored or loaded; everything else another node put in the bucket is
found on demand, never by scanning it. When a chain (KV.MATCH, KV.LEASE, KV.MGET, prefetch) runs
past what the local index holds, :meth:`RemotePath.extend` asks the shared tier about the rest
in windows of ``max_connections`` parallel HEADs (the tier's negative cache answers recent
misses from memory) and stops at the first window holding a miss, so a 500-chunk prompt whose
first 40 chunks exist costs about 48 requests, not 500. Every chunk found gets an index record
built from its object metadata (parent, tokens, size, checksum, codec) with residency
``{s3}``, so GET and LEASE load it through the ordinary read path (checksum verified, promoted
into DRAM).

The shared tier is untrusted input: the tier validates every object like a client write (see
``tiers/s3_objects``); here an object whose parent link would close a loop in the index is
refused too (``remote_invalid``). A record is never used to delete an object: when the bucket
holds another version than the record says (another node replaced it, maybe with another size),
the read path calls :meth:`RemotePath.replaced`, which drops the stale record so the next lookup
adopts the new object. Records of chunks held only in S3 are bounded (``remote_records``).

Failures never escape: a tier error or a lookup slower than ``timeout`` ends the lookup with
what was found so far (a shorter match, i.e. misses), and is counted in the store's errors and
the tier's ``errors`` counter; warnings are logged at most every few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvstrata.chunks import ChunkKey, ChunkMeta
from kvstrata.store.index import ChunkRecord, record_from_meta
from kvstrata.store.kvstore.state import StoreState
from kvstrata.store.remote_records import RemoteRecords
from kvstrata.tiers.base import TierError

log = logging.getLogger("kvstrata.store.remote")

_LOG_EVERY = 5.0  # seconds between two warnings about a failing shared tier
_STALE_KEEP = 1024  # replaced records remembered for the reader that found them stale


class RemotePath:
    """See the module docstring. ``timeout`` bounds one lookup (seconds)."""

    def __init__(self, state: StoreState, timeout: float = 2.0) -> None:
        self.state = state
        self.timeout = timeout
        self.lookups = 0  # lookups that had to ask the shared tier
        self.found = 0  # chunks adopted into the index from the shared tier
        self.timeouts = 0
        self.errors = 0
        self.invalid = 0  # objects refused here (a parent link that would close a loop)
        self.replaced_count = 0  # records found stale: the bucket held a newer version
        self._stale: OrderedDict[ChunkKey, ChunkRecord] = OrderedDict()
        self._logged = 0.0
        self._trimming = False
        remote = state.remote
        limit = int(state.config.values.get("s3-max-remote-records", 0) or 0)
        self.records = RemoteRecords(remote.name if remote is not None else "s3", limit)
        #: called when a record gains residency in the shared tier (session objects wait on it)
        self.on_shared: Callable[[ChunkRecord], None] | None = None
        if remote is not None:
            chained = state.index.on_change

            def on_change(rec: ChunkRecord, tier: str) -> None:
                chained(rec, tier)
                self._residency(rec, tier)

            state.index.on_change = on_change

    @property
    def enabled(self) -> bool:
        return self.state.remote is not None

    def window(self) -> int:
        remote = self.state.remote
        cfg: Any = getattr(remote, "config", None)
        return max(1, int(getattr(cfg, "max_connections", 16)))

    # -- lookups ---------------------------------------------------------------------------------

    async def extend(self, ns: str, hashes: Sequence[bytes], start: int) -> list[ChunkRecord]:
        """Records of ``hashes[start:]`` present locally or in the shared tier, leading ones only
        (stops at the first chunk found nowhere)."""
        out: list[ChunkRecord] = []
        if self.state.remote is None or start >= len(hashes):
            return out
        self.lookups += 1
        deadline = time.monotonic() + self.timeout
        step = self.window()
        for i in range(start, len(hashes), step):
            keys = [ChunkKey(ns, h) for h in hashes[i : i + step]]
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                found = await asyncio.wait_for(
                    asyncio.gather(*(self._lookup(k) for k in keys), return_exceptions=True), left
                )
            except TimeoutError:
                self.timeouts += 1
                self._failed(TimeoutError(f"lookup slower than {self.timeout} s"))
                return out
            for item in found:
                if isinstance(item, BaseException):
                    if not isinstance(item, Exception):
                        raise item
                    self._failed(item)
                    return out
                if item is None:
                    return out
                out.append(item)
        return out

    async def find(self, key: ChunkKey) -> ChunkRecord | None:
        """The record of one chunk, asking the shared tier when the index does not know it."""
        rec = self.state.live(key)
        if rec is not None or self.state.remote is None:
            return rec
        found = await self.extend(key.namespace, [key.hash], 0)
        return found[0] if found else None

    async def ensure_known(self, ns: str, hashes: Sequence[bytes]) -> None:
        """Adopt the records of a chain's chunks that the index lacks (before LEASE/MGET)."""
        if self.state.remote is None:
            return
        live = self.state.live
        for i, h in enumerate(hashes):
            if live(ChunkKey(ns, h)) is None:
                await self.extend(ns, hashes, i)
                return

    async def _lookup(self, key: ChunkKey) -> ChunkRecord | None:
        rec = self.state.live(key)
        if rec is not None and rec.tiers:
            return rec
        remote = self.state.remote
        assert remote is not None
        meta = await remote.meta(key)
        return None if meta is None else self.adopt(meta)

    def adopt(self, meta: ChunkMeta) -> ChunkRecord | None:
        """Index a chunk found in the shared tier (or add that residency to a known record)."""
        state = self.state
        remote = state.remote
        assert remote is not None
        rec = state.live(meta.key)
        if rec is not None:
            # an unverified checksum (a writer's KV.COMMIT DIGEST) says nothing about the local
            # bytes: the object is not taken for the same chunk until a write-back checks them
            if rec.verified and rec.checksum == meta.checksum and rec.size == meta.size:
                state.index.add_tier(rec, remote.name)
            return rec if rec.tiers else None
        if state.key_busy(meta.key):
            return None  # a local writer or a copy being freed owns the key right now
        if state.index.makes_cycle(meta.key, meta.parent):
            self.invalid += 1  # KV.PUT refuses this link too (KVStore.check_link)
            return None
        rec = record_from_meta(meta)
        rec.tiers = {remote.name}
        state.publish(rec)
        self.found += 1
        self.trim()
        return rec

    def replaced(self, rec: ChunkRecord, meta: ChunkMeta) -> None:
        """The shared tier holds another version of ``rec``'s chunk (``meta``): the record's
        residency there was stale (the caller dropped it). A record left in no tier is dropped
        without touching any tier, so the next lookup adopts the object as it is now."""
        self.replaced_count += 1
        self.state.drop_if_gone(rec)
        self._stale[rec.key] = rec
        while len(self._stale) > _STALE_KEEP:
            self._stale.popitem(last=False)
        log.info("chunk %s/%s was replaced in the shared tier; adopting the new version",
                 rec.key.namespace, rec.key.hex[:16])  # fmt: skip

    def was_replaced(self, rec: ChunkRecord) -> bool:
        """True (once) when ``rec`` was dropped by :meth:`replaced`: the reader looks again."""
        if self._stale.get(rec.key) is rec:
            del self._stale[rec.key]
            return True
        return False

    # -- bounded records -------------------------------------------------------------------------

    def _residency(self, rec: ChunkRecord, tier: str) -> None:
        self.records.note(rec)
        remote = self.state.remote
        shared = remote is not None and tier == remote.name and tier in rec.tiers
        if shared and rec.alive and self.on_shared is not None:
            self.on_shared(rec)
        if self.records.over() and not self._trimming:
            self._trimming = True
            try:
                asyncio.get_running_loop().call_soon(self.trim)
            except RuntimeError:  # no loop (synchronous use): trimmed on the next adoption
                self._trimming = False

    def trim(self) -> int:
        """Forget least recently used records of chunks held only in S3 above the limit."""
        self._trimming = False
        if not self.records.over():
            return 0
        return self.records.trim(self.state.index.get, self._forget)

    def _forget(self, rec: ChunkRecord) -> None:
        remote = self.state.remote
        assert remote is not None
        self.state.index.drop_tier(rec, remote.name)  # the object stays in the bucket
        self.state.drop_if_gone(rec)

    # -- failures --------------------------------------------------------------------------------

    def _failed(self, exc: Exception) -> None:
        state = self.state
        name = state.remote.name if state.remote is not None else "s3"
        self.errors += 1
        state.errors += 1
        if name in state.counters:
            state.counters[name].errors += 1
        now = time.monotonic()
        if now - self._logged >= _LOG_EVERY:
            self._logged = now
            kind = "tier error" if isinstance(exc, TierError) else type(exc).__name__
            log.warning("lookup in %s failed (%s: %s); answering from local tiers", name, kind, exc)

    def info(self) -> list[tuple[str, object]]:
        return [
            ("remote_lookups", self.lookups),
            ("remote_found", self.found),
            ("remote_timeouts", self.timeouts),
            ("remote_errors", self.errors),
            ("remote_invalid", self.invalid),
            ("remote_replaced", self.replaced_count),
            ("remote_records", len(self.records)),
            ("remote_records_max", self.records.limit),
            ("remote_records_forgotten", self.records.forgotten),
        ]
