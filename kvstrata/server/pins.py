"""Reply buffers that must stay pinned until the transport no longer references them.

A ``BulkView`` reply (an arena view, also nested in a ``KV.MGET`` array) is handed to the
transport without a copy, so its chunk stays pinned until the transport has written it. No timer
watches for that: the connection sets its transport's write-buffer high-water mark to zero, so
the transport calls ``pause_writing`` whenever bytes stay queued and ``resume_writing`` once the
queue is empty, and :meth:`ReplyPins.drained` releases everything handed over until then. A
reply written at once (the common case) is released by :meth:`ReplyPins.written`; the connection
releases everything when it is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstrata.protocol.frames import BulkView

log = logging.getLogger("kvstrata.server")


class ReplyPins:
    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []  # replies not handed to the transport yet
        self._handed: list[Callable[[], None]] = []  # handed over, maybe not written yet

    def collect(self, value: Any) -> None:
        """Remember the release callbacks of every BulkView in a reply."""
        t = type(value)
        if t is BulkView:
            if value.release is not None:
                self._pending.append(value.release)
        elif t is list or t is tuple:
            for item in value:
                if type(item) is BulkView or type(item) is list:
                    self.collect(item)

    def written(self, unsent: bool) -> None:
        """The replies collected so far were handed to the transport; ``unsent``: some bytes
        stay queued there (``resume_writing`` will come)."""
        if self._pending:
            self._handed += self._pending
            self._pending = []
        if not unsent and self._handed:
            self.drained()

    def drained(self) -> None:
        """The transport's write buffer is empty: what it was handed is written."""
        handed, self._handed = self._handed, []
        _release(handed)

    def release_all(self) -> None:
        pending, handed = self._pending, self._handed
        self._pending, self._handed = [], []
        _release(handed + pending)

    def __len__(self) -> int:
        return len(self._pending) + len(self._handed)


def _release(releases: list[Callable[[], None]]) -> None:
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
