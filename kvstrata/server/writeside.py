"""The write side of a connection: transport write events, pins and per-client limits.

The connection sets its transport's write-buffer high-water mark to zero, so ``pause_writing``
means "bytes stay queued" and ``resume_writing`` "all written". Those events release the chunks
pinned by zero-copy replies (see ``pins``; no timer per connection) and bound what a client
that does not read may cost: commands stop running while more than :data:`OUT_HIGH` bytes are
unsent, and Redis's ``client-output-buffer-limit`` (normal and monitor classes) is checked
whenever output stays queued and once a second (:meth:`WriteSide.cron`). The same cron closes
a connection whose half-received command made no progress for ``payload-timeout`` seconds
(its payload's DRAM slot is freed when the connection is lost).

Zero-copy replies pin DRAM only within a bound (``reply-pin-max``, ``reply-pin-timeout``):
replies beyond a window (half the bound) wait in a ``backlog`` and are handed on as the
transport drains; when a connection's replies have pinned more than the bound for longer than
the timeout, the cron copies the waiting ones out of the arena (the reader loses nothing), and
closes a connection whose transport alone still pins more than the bound one timeout later
(what the transport was handed cannot be taken back).

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
from typing import TYPE_CHECKING, Any

from kvstrata.protocol.encoder import join_small
from kvstrata.server.admission import is_loopback
from kvstrata.server.backlog import ReplyBacklog
from kvstrata.server.context import ClientState
from kvstrata.server.intake import Intake
from kvstrata.server.pins import ReplyPins, release_each

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
    _backlog: ReplyBacklog
    _pin_since: float  # when its replies went over reply-pin-max (0: they are not)
    _close_after: bool
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
        self._pin_since = 0.0
        self._pins.drained()
        if self._backlog:
            self._feed()
            if self._backlog:
                return  # commands wait until the backlog is handed over
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
        self._enforce_output_limit(size + self._backlog.nbytes, time.monotonic())

    # -- the window of zero-copy replies (``backlog``) ---------------------------------------

    def _window(self) -> int:
        """Bytes of pinned views handed to the transport at once (0 bound: no window)."""
        most = self.server.config.values["reply-pin-max"]
        return most // 2 if most else 1 << 62

    def _queue_out(self, out: list[Any]) -> None:
        """Reply buffers that go through the backlog (it holds some, or their pinned views
        exceed the window): commands wait until it is handed over."""
        self._pins.hand(self._backlog.add(out, self._pins.take_pending()))
        if not self._write_paused:
            self._write_paused = True
            self._update_reading()
        self._feed()

    def _feed(self) -> None:
        """Hand the transport backlog bytes up to the window, again while it writes them at
        once; a QUIT waiting behind them closes once all are handed."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        window = self._window()
        backlog = self._backlog
        while backlog:
            budget = window - (transport.get_write_buffer_size() if self._unsent else 0)
            if budget <= 0:
                break
            parts, done = backlog.take(budget)
            self._pins.hand(done)
            self.server.stats.total_net_output_bytes += sum(map(len, parts))
            transport.writelines(join_small(parts))
            self._after_write()
            if self._unsent or self._closing:
                break
        if not backlog and self._close_after:
            self._closing = True
            transport.close()

    def _bound_pins(self, now: float) -> None:
        """Once a second: replies that pinned more than reply-pin-max for reply-pin-timeout
        are copied out of the arena; if the transport alone still pins more a timeout later,
        the client is closed."""
        values = self.server.config.values
        most = values["reply-pin-max"]
        pinned = self._pins.handed_bytes + self._backlog.pinned
        if not most or pinned <= most:
            self._pin_since = 0.0
            return
        if not self._pin_since:
            self._pin_since = now
            return
        timeout = values["reply-pin-timeout"]
        if now - self._pin_since < timeout:
            return
        stats = self.server.stats
        if self._backlog.pinned:
            before = self._backlog.copied
            now_released, later = self._backlog.copy_out()
            release_each(now_released)
            self._pins.hand(later)
            stats.reply_copyouts += 1
            stats.reply_copied_bytes += self._backlog.copied - before
            log.info(
                "client %s has not read %d bytes of replies for %d s: copied %d bytes of them "
                "out of DRAM (reply-pin-max)", self.client.addr, pinned, timeout,
                self._backlog.copied - before,
            )  # fmt: skip
            self._pin_since = now
            return
        log.warning(
            "closing client %s: its unread replies pin %d bytes of DRAM for %d s "
            "(reply-pin-max, reply-pin-timeout)", self.client.addr, pinned, 2 * timeout,
        )  # fmt: skip
        stats.reply_pin_disconnections += 1
        self.drop()

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
        if self._unsent or self._backlog:
            size = self.transport.get_write_buffer_size() + self._backlog.nbytes
            self._enforce_output_limit(size, now)
            if not self._closing:
                self._bound_pins(now)
        elif self._pin_since:
            self._pin_since = 0.0
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
