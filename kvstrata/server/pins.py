"""Reply buffers that must stay pinned until the transport no longer references them.

A ``BulkView`` reply (an arena view, also nested in a ``KV.MGET`` array) is handed to the
transport without a copy. uvloop keeps a reference to that memory until libuv has written it,
so the chunk stays pinned until the transport's write buffer is empty (a closing transport
still sends what is queued); the connection releases everything when it is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvstrata.protocol.frames import BulkView

log = logging.getLogger("kvstrata.server")
POLL_SECONDS = 0.0005


class ReplyPins:
    def __init__(self) -> None:
        self._releases: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None

    def collect(self, value: Any) -> None:
        """Remember the release callbacks of every BulkView in a reply."""
        t = type(value)
        if t is BulkView:
            if value.release is not None:
                self._releases.append(value.release)
        elif t is list or t is tuple:
            for item in value:
                if type(item) is BulkView or type(item) is list:
                    self.collect(item)

    def written(self, transport: asyncio.Transport) -> None:
        """The replies collected so far were handed to ``transport``."""
        self._transport = transport
        if self._releases and self._timer is None:
            self._check()

    def _check(self) -> None:
        self._timer = None
        if not self._releases:
            return
        transport = self._transport
        if transport is None or transport.get_write_buffer_size() == 0:
            self.release_all()
        else:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(POLL_SECONDS, self._check)

    def release_all(self) -> None:
        releases, self._releases = self._releases, []
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
