"""Reply buffers that must stay pinned until the transport no longer references them.

A ``BulkView`` reply (an arena view, also nested in a ``KV.MGET`` array) is handed to the
transport without a copy, so its chunk stays pinned until the transport has written it. No timer
watches for that: the connection sets its transport's write-buffer high-water mark to zero, so
the transport calls ``pause_writing`` whenever bytes stay queued and ``resume_writing`` once the
queue is empty, and :meth:`ReplyPins.drained` releases everything handed over until then. A
reply written at once (the common case) is released by :meth:`ReplyPins.written`; the connection
releases everything when it is lost. Replies larger than the connection's window wait in a
``backlog.ReplyBacklog`` first, which hands their pins over here piece by piece.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvstrata.protocol.frames import BulkView
from kvstrata.server.backlog import Pinned

log = logging.getLogger("kvstrata.server")


class ReplyPins:
    def __init__(self) -> None:
        self._pending: list[Pinned] = []  # replies not handed to the transport yet
        self._handed: list[Callable[[], None]] = []  # handed over, maybe not written yet
        self.pending_bytes = 0  # bytes of the chunks pinned by _pending
        self.handed_bytes = 0  # … by _handed

    def collect(self, value: Any) -> None:
        """Remember the views and release callbacks of every BulkView in a reply."""
        t = type(value)
        if t is BulkView:
            if value.release is not None:
                self._pending.append((value.view, value.release))
                self.pending_bytes += value.view.nbytes
        elif t is list or t is tuple:
            for item in value:
                if type(item) is BulkView or type(item) is list:
                    self.collect(item)

    def take_pending(self) -> list[Pinned]:
        """The pins collected since the last write (their replies go to the backlog)."""
        pending, self._pending = self._pending, []
        self.pending_bytes = 0
        return pending

    def hand(self, pins: Iterable[tuple[Callable[[], None], int]]) -> None:
        """Pins whose views were handed to the transport (released once it is drained)."""
        for release, nbytes in pins:
            self._handed.append(release)
            self.handed_bytes += nbytes

    def written(self, unsent: bool) -> None:
        """The replies collected so far were handed to the transport; ``unsent``: some bytes
        stay queued there (``resume_writing`` will come)."""
        if self._pending:
            self._handed += [release for _, release in self._pending]
            self.handed_bytes += self.pending_bytes
            self._pending = []
            self.pending_bytes = 0
        if not unsent and self._handed:
            self.drained()

    def drained(self) -> None:
        """The transport's write buffer is empty: what it was handed is written."""
        handed, self._handed = self._handed, []
        self.handed_bytes = 0
        release_each(handed)

    def release_all(self) -> None:
        pending, handed = self._pending, self._handed
        self._pending, self._handed = [], []
        self.pending_bytes = self.handed_bytes = 0
        release_each(handed + [release for _, release in pending])

    def __len__(self) -> int:
        return len(self._pending) + len(self._handed)


def release_each(releases: list[Callable[[], None]]) -> None:
    for release in releases:
        try:
            release()
        except Exception:
            log.exception("releasing a reply buffer failed")


def release_now(value: Any) -> None:
    """Release the buffers of a reply that will never be sent."""
    pins = ReplyPins()
    pins.collect(value)
    pins.release_all()
