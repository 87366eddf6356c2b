"""Failure handling of the S3 tier: error translation, the negative cache and the breaker.

:func:`translate_error` maps a boto3/botocore failure to a tier error and says whether the
endpoint itself failed. :class:`Breaker` then fails calls fast for ``retry_after`` seconds, so a
dead endpoint costs no request per call and the tier recovers by itself when S3 comes back.
:class:`NegativeCache` remembers misses for ``negative_ttl`` seconds (a chain tail probed by every
MATCH costs one HEAD, not one per MATCH); our own puts invalidate them, including puts that finish
while a HEAD is in flight. All of it is synchronous bookkeeping; :mod:`kvstrata.tiers.s3` does
the requests.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from kvstrata.chunks import ChunkKey
from kvstrata.tiers.base import ChunkMissing, TierError, TierIOError

try:
    from botocore.exceptions import ClientError
except ImportError:  # pragma: no cover - boto3 is the optional [s3] extra

    class ClientError(Exception):  # type: ignore[no-redef]
        """Stand-in so ``isinstance`` works without botocore; never raised."""


# The tier's logger, so that configuring logging for the S3 tier covers its breaker too.
log = logging.getLogger("kvstrata.tiers.s3")

_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_BUSY_CODES = frozenset({"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"})


def translate_error(exc: Exception, what: str) -> tuple[TierError, bool]:
    """The tier error for a boto3/botocore failure, and whether the endpoint itself failed."""
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _MISSING_CODES:
            return ChunkMissing(what), False
        down = status >= 500 or code in _BUSY_CODES
        return TierIOError(f"s3 {what}: {code or status} {err.get('Message', '')}".strip()), down
    return TierIOError(f"s3 {what}: {type(exc).__name__}: {exc}"), True


class NegativeCache:
    """Recent misses, invalidated by our own writes (even ones racing an in-flight HEAD).

    A lookup records ``seq()`` before its request; ``miss(key, since)`` then refuses to cache
    when a write of that key finished after ``since``. Writes are remembered in a bounded
    history; when entries newer than ``since`` may have been dropped from it, nothing is cached.
    """

    def __init__(self, ttl: float, limit: int = 65536) -> None:
        self.ttl, self.limit = ttl, limit
        self._misses: OrderedDict[ChunkKey, float] = OrderedDict()
        self._writes: OrderedDict[ChunkKey, int] = OrderedDict()
        self._seq = 0
        self._dropped_upto = 0

    def __len__(self) -> int:
        return len(self._misses)

    def seq(self) -> int:
        return self._seq

    def hit(self, key: ChunkKey) -> bool:
        expires = self._misses.get(key)
        if expires is None:
            return False
        if expires > time.monotonic():
            return True
        del self._misses[key]
        return False

    def miss(self, key: ChunkKey, since: int) -> None:
        if self.ttl <= 0 or self._dropped_upto > since or self._writes.get(key, 0) > since:
            return
        now = time.monotonic()
        self._misses[key] = now + self.ttl
        self._misses.move_to_end(key)
        while self._misses and (
            len(self._misses) > self.limit or next(iter(self._misses.values())) <= now
        ):
            self._misses.popitem(last=False)

    def wrote(self, key: ChunkKey) -> None:
        self._seq += 1
        self._misses.pop(key, None)
        self._writes[key] = self._seq
        self._writes.move_to_end(key)
        while len(self._writes) > self.limit:
            _, seq = self._writes.popitem(last=False)
            self._dropped_upto = max(self._dropped_upto, seq)


class Breaker:
    """Fail fast for ``retry_after`` seconds after the endpoint failed; then try again."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        self.until = 0.0
        self.trips = 0
        self.rejected = 0
        self.last_error = ""

    @property
    def open(self) -> bool:
        return time.monotonic() < self.until

    def check(self) -> None:
        if self.open:
            self.rejected += 1
            raise TierIOError(
                f"s3 unavailable ({self.last_error}); retrying in "
                f"{max(0.0, self.until - time.monotonic()):.1f} s"
            )

    def trip(self, error: str) -> None:
        if not self.open:
            self.trips += 1
            log.warning(
                "s3: endpoint failed (%s); failing fast for %.1f s", error, self.retry_after
            )
        self.last_error = error
        self.until = time.monotonic() + self.retry_after
