"""The write side of a connection: transport write events, pins and per-client limits.

The connection sets its transport's write-buffer high-water mark to zero, so ``pause_writing``
means "bytes stay queued" and ``resume_writing`` "all written". Those events release the chunks
pinned by zero-copy replies (see ``pins``; no timer per connection) and bound what a client
that does not read may cost: commands stop running while more than :data:`OUT_HIGH` bytes are
unsent, and Redis's ``client-output-buffer-limit`` (normal and monitor classes) is checked
whenever output stays queued and once a second (:meth:`WriteSide.cron`). The same cron closes
a connection whose half-received command made no progress for ``payload-timeout`` seconds
(its payload's DRAM slot is freed when the connection is lost).

A connection from a loopback client gets a small send buffer (``loopback-sndbuf``): a large
reply is then copied into the socket in pieces the client takes while they are still in the
CPU cache, instead of megabytes at a time that it reads back from memory. Remote clients keep
the kernel's autotuning, which sizes the buffer to the bandwidth-delay product.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING

from kvstrata.server.admission import is_loopback
from kvstrata.server.context import ClientState
from kvstrata.server.intake import Intake
from kvstrata.server.pins import ReplyPins

if TYPE_CHECKING:
    from kvstrata.server.app import Server

log = logging.getLogger("kvstrata.server")

OUT_HIGH = 1024 * 1024  # unsent reply bytes above which commands stop running (flow control)


class WriteSide:
    """Mixin of ``Connection``: the write-side callbacks and the limits that close a client."""

    # state owned by Connection
    server: Server
    client: ClientState
    transport: asyncio.Transport | None
    _in: Intake
    _pins: ReplyPins
    _closing: bool
    _read_paused: bool
    _write_paused: bool
    _unsent: bool  # the transport holds bytes not written yet
    _soft_since: float  # when the output buffer went over its soft limit (0: it is not)

    def _process(self) -> None:
        raise NotImplementedError

    def _update_reading(self) -> None:
        raise NotImplementedError

    def set_write_events(self, transport: asyncio.BaseTransport) -> None:
        """Have ``transport`` pause as soon as one byte stays queued and resume when empty
        (uvloop's TLS transport pauses at >= high, its TCP transport at > high)."""
        high = 1 if transport.get_extra_info("sslcontext") is not None else 0
        transport.set_write_buffer_limits(high=high, low=0)  # type: ignore[attr-defined]
        size = self.server.config.values["loopback-sndbuf"]
        if size:
            size_loopback_send_buffer(transport, size)

    def pause_writing(self) -> None:
        self._unsent = True  # _after_write checks how much (flow control, output limits)

    def resume_writing(self) -> None:
        self._unsent = False
        self._soft_since = 0.0
        self._pins.drained()
        if self._write_paused:
            self._write_paused = False
            self._process()

    def _after_write(self) -> None:
        """Replies were handed to the transport: release their pins once written, pause
        commands above OUT_HIGH unsent bytes, apply client-output-buffer-limit."""
        self._pins.written(self._unsent)
        transport = self.transport
        if not self._unsent or transport is None or self._closing:
            return
        size = transport.get_write_buffer_size()
        if size > OUT_HIGH and not self._write_paused:
            self._write_paused = True
            self._update_reading()
        self._enforce_output_limit(size, time.monotonic())

    def _enforce_output_limit(self, size: int, now: float) -> None:
        limits = self.server.config.values["client-output-buffer-limit"]
        limit = limits.monitor if "O" in self.client.flags else limits.normal
        over_soft = limit.soft and size >= limit.soft
        if not over_soft:
            self._soft_since = 0.0
        elif not self._soft_since:
            self._soft_since = now
        if (limit.hard and size >= limit.hard) or (
            over_soft and now - self._soft_since > limit.soft_seconds
        ):
            log.warning(
                "closing client %s: %d bytes of output not read (client-output-buffer-limit)",
                self.client.addr, size,
            )  # fmt: skip
            self.server.stats.output_limit_disconnections += 1
            self.drop()

    def cron(self, now: float) -> None:
        """Once a second (from the server's cron): the limits that need no event to trip."""
        if self._closing or self.transport is None:
            return
        if self._unsent:
            self._enforce_output_limit(self.transport.get_write_buffer_size(), now)
        timeout = self.server.config.values["payload-timeout"]
        if (
            timeout
            and self._in.partial is not None
            and not self._read_paused
            and now - self.client.last_interaction > timeout
        ):
            log.warning(
                "closing client %s: its command made no progress for %d s (payload-timeout)",
                self.client.addr, timeout,
            )  # fmt: skip
            self.drop()

    def drop(self) -> None:
        """Close at once, discarding unsent output (a client that does not read would keep a
        closing transport, and the chunks its replies pin, forever)."""
        self._closing = True
        if self.transport is not None:
            self.transport.abort()


def size_loopback_send_buffer(transport: asyncio.BaseTransport, size: int) -> bool:
    """Set SO_SNDBUF of a TCP connection whose peer is on loopback; True when set."""
    sock = transport.get_extra_info("socket")
    peer = transport.get_extra_info("peername")
    if (
        sock is None
        or sock.family not in (socket.AF_INET, socket.AF_INET6)
        or not isinstance(peer, tuple)
        or not is_loopback(str(peer[0]))
    ):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    except OSError as exc:  # the kernel's default is a correct (if slower) fallback
        log.debug("cannot set SO_SNDBUF of %s: %s", peer, exc)
        return False
    return True
