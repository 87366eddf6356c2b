"""What the file system under the NVMe tier can really hold.

``nvme-capacity`` is what the tier may use; the disk may fill before that (other files, a
smaller partition, a quota). When a write fails with ENOSPC or EDQUOT the tier lowers its
effective capacity to what it already uses plus what the file system still offers, so that
placement evicts there and retries instead of failing every write-back; the limit is lifted
again once the file system has room for the configured capacity (checked at most once a
second, on writes and on INFO).
"""

from __future__ import annotations

import errno
import os
import time

from kvstrata.tiers.base import TierFull, TierIOError

#: errors meaning "the file system is full for us"
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
RECHECK_SECONDS = 1.0


class DiskFull(TierFull, TierIOError):
    """The file system ran out of space: an I/O error, and a full tier (evict and retry)."""


def is_full_error(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        exc = exc.__cause__
    return False


class FsSpace:
    """The effective capacity of a tier folder: ``configured`` unless the disk ran out."""

    def __init__(self, root: str, configured: int) -> None:
        self.root = root
        self.configured = configured
        #: the lowered capacity, or None while the configured one holds
        self.limit: int | None = None
        self.lowered_times = 0
        self._checked = 0.0

    @property
    def capacity(self) -> int:
        return self.configured if self.limit is None else min(self.limit, self.configured)

    def available(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def lower(self, used: int) -> int:
        """A write found the disk full: the tier can hold what it uses plus what is free."""
        try:
            free = self.available()
        except OSError:
            free = 0
        room = used + free
        self._checked = time.monotonic()
        if room >= self.configured:
            self.limit = None  # a transient failure: nothing to lower
            return self.configured
        self.limit = room
        self.lowered_times += 1
        return room

    def recheck(self, used: int) -> None:
        """Lift (or move) a lowered limit when the file system has room again."""
        if self.limit is None:
            return
        now = time.monotonic()
        if now - self._checked < RECHECK_SECONDS:
            return
        self._checked = now
        try:
            room = used + self.available()
        except OSError:
            return
        self.limit = None if room >= self.configured else max(self.limit, room)
