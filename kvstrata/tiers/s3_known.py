"""The S3 tier's account of the bucket: the objects it knows of (their sizes: ``used``, the
``chunks`` stat), the misses it remembers (the negative cache), the objects it rejects (invalid
or not authentic: counted, logged at most every few seconds, left in the bucket) and those it
quarantines (bytes that disagree with their own metadata: that version deleted).

A mixin of :class:`~kvstrata.tiers.s3.S3Tier`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvstrata.chunks import ChunkKey
from kvstrata.tiers.base import TierError, TierStats
from kvstrata.tiers.s3_failures import NegativeCache
from kvstrata.tiers.s3_objects import AuthFailure, CorruptObject, object_name
from kvstrata.tiers.s3_requests import S3Requests

log = logging.getLogger("kvstrata.tiers.s3")  # the tier's logger, as before the split
T = TypeVar("T")

_LOG_EVERY = 5.0  # seconds between two warnings about rejected objects


class KnownObjects:
    """Mixin of ``S3Tier``: what it knows of the bucket's objects, and its verdicts on them."""

    # state owned by S3Tier
    stats: TierStats
    prefix: str
    _req: S3Requests
    _negative: NegativeCache
    _sizes: dict[ChunkKey, int]
    _used: int
    _logged: float

    if TYPE_CHECKING:  # S3Tier's (a stub here would shadow it)

        async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...

    async def _quarantine(self, key: ChunkKey, name: str, exc: CorruptObject) -> None:
        """Delete an object whose bytes disagree with its own metadata: the version that was
        read, not one written since (best effort; counted)."""
        self.stats.integrity_errors += 1
        log.warning("s3: chunk %s/%s is corrupt (%s); deleting it", key.namespace, key.hex,
                    exc.args[0])  # fmt: skip
        since = self._negative.seq()
        etag = str(exc.args[1]) if len(exc.args) > 1 else ""
        try:
            if not await self._call("delete", self._req.delete_version, name, etag):
                self.stats.extra["kept_objects"] += 1  # replaced meanwhile: not ours to drop
        except TierError as err:
            log.warning("s3: could not delete corrupt chunk %s: %s", key.hex, err)
        self._forget(key)
        self._negative.miss(key, since)

    def _rejected(self, key: ChunkKey, since: int, exc: Exception) -> None:
        """An object this node may not use (invalid or not authentic): a miss, left alone."""
        self._count_rejected(object_name(self.prefix, key), exc)
        self._missed(key, since)

    def _count_rejected(self, name: str, exc: Exception) -> None:
        auth = isinstance(exc, AuthFailure)
        self.stats.extra["auth_failures" if auth else "invalid_objects"] += 1
        now = time.monotonic()
        if now - self._logged >= _LOG_EVERY:
            self._logged = now
            what = "fails authentication" if auth else "is not a valid kvstrata object"
            log.warning("s3: object %s %s (%s); treated as a miss, left in the bucket",
                        name, what, exc)  # fmt: skip

    def _missed(self, key: ChunkKey, since: int) -> None:
        self.stats.misses += 1
        self._negative.miss(key, since)
        self._forget(key)

    def _remember(self, key: ChunkKey, size: int) -> None:
        self._used += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self.stats.chunks = len(self._sizes)

    def _forget(self, key: ChunkKey) -> None:
        self._used -= self._sizes.pop(key, 0)
        self.stats.chunks = len(self._sizes)
