"""One client connection: receive, decode, dispatch in order, encode, flow control.

Running one command (its spec, the handler, stats and slow log, async completion) is the
``Dispatch`` mixin's (``dispatch``); this module feeds it commands in pipeline order.

The protocol callbacks never await. Synchronous handlers run inline; an ``async def`` handler
runs as a task and the commands behind it wait (replies stay in pipeline order). Reading
pauses while an async command runs and more than :data:`HIGH_WATER` bytes are buffered, and
while the client does not drain its replies (the write side, pins released by transport
events and the limits that close a client, is in ``writeside``).

Large bulk arguments (≥ :data:`BIG`) are received in place: the command's ``sink`` (see the
registry) provides the destination — for ``KV.PUT`` an arena slot — and ``get_buffer`` hands
that memory to the transport so the kernel writes the payload where it will live.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from time import monotonic
from typing import TYPE_CHECKING, Any

from kvstrata.protocol.encoder import encode_reply, join_small
from kvstrata.protocol.errors import ProtocolError, RespError
from kvstrata.protocol.frames import NO_REPLY, Simple
from kvstrata.server.admission import fmt_addr, refusal
from kvstrata.server.backlog import ReplyBacklog
from kvstrata.server.context import ClientState
from kvstrata.server.dispatch import _NO_SINKS, Dispatch
from kvstrata.server.fastpath import CONN_BASE, usable
from kvstrata.server.fastread import FLUSH_PARTS, FastRead
from kvstrata.server.intake import Intake, WithSinks, abort_sinks
from kvstrata.server.pins import ReplyPins, release_each
from kvstrata.server.writeside import WriteSide

if TYPE_CHECKING:
    from kvstrata.server.app import Server

log = logging.getLogger("kvstrata.server")

HIGH_WATER = 4 * 1024 * 1024  # undecoded bytes buffered before reading pauses
QUEUE_AHEAD = 1024  # commands decoded ahead while the client does not read its replies
UNAUTH_MAX_BULK = 16 * 1024  # frame limits before AUTH (as Redis 7)
UNAUTH_MAX_ARGS = 10
JOIN_LIMIT = 64 * 1024  # replies up to this size are joined into one write


class Connection(FastRead, WriteSide, Dispatch, CONN_BASE, asyncio.BufferedProtocol):
    """Implements ``server.context.Ctx`` for the handlers.

    With the compiled path built, ``CONN_BASE`` is ``_fastpath.ConnBase``: the transport's
    ``get_buffer`` and ``buffer_updated`` are C, answer the common (lean) read themselves and
    hand every other read to :meth:`_get_buffer` and :meth:`_buffer_updated`, the reference
    (and the callbacks themselves without the extension, or in :class:`PyConnection`)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.sinks: dict[int, Any] = _NO_SINKS
        self.transport: asyncio.Transport | None = None
        self.client = ClientState(id=0, addr="?", laddr="?")
        self._in = Intake(self._sink_for)
        self._out: list[Any] = []
        self._pins = ReplyPins()
        self._backlog = ReplyBacklog()
        self._pin_since = 0.0  # when its replies went over reply-pin-max (0: they are not)
        self._busy = False
        self._closing = False
        self._close_after = False
        self._read_paused = False
        self._write_paused = False
        self._unsent = False
        self._soft_since = 0.0
        self._resp3 = False
        self._task: asyncio.Task[None] | None = None
        self._queue: deque[Any] = deque()  # plain argument lists, or WithSinks
        self._slow = 0.0  # slow-log threshold in seconds, refreshed per batch
        self._slow_micros: int | None = None  # the setting self._slow was computed from
        self._values = server.config.values  # CONFIG SET changes it in place
        #: a protocol error met while commands before it still wait (queued, or async running)
        self._error: ProtocolError | None = None

    # -- asyncio callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        peer = transport.get_extra_info("peername") or ("", 0)
        sock = transport.get_extra_info("sockname") or ("", 0)
        self.client = ClientState(
            id=server.next_client_id(), addr=fmt_addr(peer), laddr=fmt_addr(sock),
            fd=_fileno(transport),
        )  # fmt: skip
        server.stats.total_connections_received += 1
        cfg = server.config
        refused = refusal(cfg, len(server.clients), peer)
        if refused is not None:
            server.stats.rejected_connections += 1
            transport.write(refused)  # type: ignore[attr-defined]
            transport.close()
            self._closing = True
            return
        self.client.authenticated = not cfg.requirepass
        server.clients[self.client.id] = self
        self.set_write_events(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.clients.pop(self.client.id, None)
        self.server.monitors.discard(self)
        self._abort_sinks(self._in.drop())
        for item in self._queue:
            if type(item) is WithSinks:
                self._abort_sinks(item.sinks)
        self._queue.clear()
        self._pins.release_all()  # a running async command finishes; its reply is dropped
        release_each(self._backlog.release_all())

    def _get_buffer(self, sizehint: int) -> memoryview:
        view = self._in.get_buffer(self._values["client-query-buffer-limit"])
        if self._in.overflow and not self._closing:
            # Closing the transport inside get_buffer is not allowed: report from a callback.
            self._closing = True
            error = ProtocolError("client query buffer limit reached")
            asyncio.get_running_loop().call_soon(self._protocol_error, error)
        return view

    def _buffer_updated(self, nbytes: int) -> None:
        server = self.server
        stats = server.stats
        stats.total_net_input_bytes += nbytes
        client = self.client
        client.last_interaction = monotonic()
        intake = self._in
        if not intake.received(nbytes):
            return
        # the common case (small commands, an idle connection) takes the lean path
        fast = server.fastpath
        values = self._values
        if (
            fast is None
            or self._queue
            or self._busy
            or self._write_paused
            or self._read_paused
            or self._closing
            or self._close_after
            or self._error is not None
            or self._out
            or intake.partial is not None
            or intake.yielded
            or not client.authenticated
            or server.loading
            or server.monitors
            or server.cmdstats.histograms
            or not values["fast-path"]
        ):
            self._process()
        else:
            self._run_lean(fast, values)

    if CONN_BASE is object:  # no compiled callbacks: the Python twins are the callbacks
        get_buffer = _get_buffer
        buffer_updated = _buffer_updated

    def eof_received(self) -> bool:
        return False

    # -- input ----------------------------------------------------------------------------
    def _process(self, declined: int = -1) -> None:
        """Decode what is buffered and run it, unless paused or an async command is running;
        ``declined``: the buffer offset where the compiled path just ran nothing."""
        server = self.server
        values = self._values
        self._slow_threshold(values)  # once per batch
        queue = self._queue
        intake = self._in
        executed = 0
        fast = server.fastpath
        if fast is not None and not usable(server, self.client.authenticated):
            fast = None
        if (
            fast is not None
            and not queue
            and not self._closing
            and not self._close_after
            and intake.start != declined
        ):
            # the common case in one step: the whole batch runs on the compiled path
            limits = values["proto-max-bulk-len"], values["max-multibulk-len"]
            executed = self._run_fast(fast, limits)
            if executed and intake.start == intake.end:
                server.stats.total_commands_processed += executed
                self.client.commands += executed
                intake.start = intake.end = 0
                self._flush()
                if self._read_paused:  # paused while it was busy: resume
                    self._update_reading()
                return
        try:
            while not self._closing and not self._close_after:
                if queue and not self._busy and not self._write_paused:
                    item = queue.popleft()
                    if type(item) is list:
                        self._execute(item, _NO_SINKS)
                    else:
                        intake.queued_payload -= item.nbytes
                        self._execute(item.args, item.sinks)
                    executed += 1
                    if len(self._out) >= FLUSH_PARTS:
                        self._flush()  # lets the transport push back (pause_writing)
                    continue
                # Nothing runnable: decode ahead (bounded), so that a client still sending a
                # large payload while we wait for it to read its replies is not deadlocked.
                if queue and self._ahead_full():
                    break
                if self._error is not None:  # answered once all before it are
                    if not queue and not self._busy:
                        self._protocol_error(self._error)
                    break
                if self._authenticated():
                    limits = values["proto-max-bulk-len"], values["max-multibulk-len"]
                else:  # as Redis: tiny frames until AUTH, so no one can make us allocate
                    limits = UNAUTH_MAX_BULK, UNAUTH_MAX_ARGS
                # usable() again: a command run meanwhile (RESET, MONITOR, CONFIG SET) may
                # have changed what it depends on
                if (
                    fast is not None
                    and not queue
                    and intake.start != declined
                    and usable(server, self.client.authenticated)
                    and (ran := self._run_fast(fast, limits))
                ):
                    executed += ran
                    if intake.start == intake.end:
                        break  # all consumed: nothing left to decode
                    continue
                if not intake.decode(queue, *limits):
                    break
        except ProtocolError as exc:
            if queue or self._busy:  # as Redis: the commands before it are answered first
                self._error = exc
            else:
                self._protocol_error(exc)
        self.server.stats.total_commands_processed += executed
        self.client.commands += executed
        self._in.compact()
        self._flush()
        self._update_reading()
        if intake.yielded and not self._closing:  # a long command is parsed in slices
            asyncio.get_running_loop().call_soon(self._process)

    def _authenticated(self) -> bool:
        """Authenticated, or no password is required any more (CONFIG SET requirepass "")."""
        return self.client.authenticated or not self.server.config.values["requirepass"]

    def _sink_for(self, args: list[Any], nbytes: int) -> Any:
        """The command's payload sink for a large bulk argument (None: a plain bytearray)."""
        spec = self.server.registry.lookup(args[0]) if args else None
        if spec is None or spec.sink is None or not self._authenticated():
            return None
        try:
            return spec.sink(self, args, nbytes)
        except RespError:
            return None
        except Exception:
            log.exception("payload sink of %s failed", spec.name)
            return None

    # -- output ---------------------------------------------------------------------------
    def _reply(self, value: Any) -> None:
        if value is NO_REPLY:
            return
        if isinstance(value, RespError):
            self._reply_error(value)
            return
        self._pins.collect(value)
        encode_reply(value, self._resp3, self._out)

    def _reply_error(self, exc: RespError) -> None:
        self.server.stats.total_error_replies += 1
        self.server.cmdstats.error(exc.prefix)
        self._out.append(b"-%b\r\n" % exc.reply_line())

    def _flush(self) -> None:
        out = self._out
        if not out or self.transport is None:
            return
        self._out = []
        if self._backlog or self._pins.pending_bytes > self._window():
            self._queue_out(out)  # past the window: handed on as the transport drains
            return
        if len(out) == 1:
            data = out[0]
            self.server.stats.total_net_output_bytes += len(data)
            self.transport.write(data)
        else:
            total = sum(map(len, out))  # arena views are byte-formatted: len == nbytes
            self.server.stats.total_net_output_bytes += total
            if total <= JOIN_LIMIT:
                self.transport.write(b"".join(out))
            else:
                self.transport.writelines(join_small(out))
        self._after_write()
        if self._close_after:
            self._closing = True
            self.transport.close()

    def _ahead_full(self) -> bool:
        """Decoded-but-waiting commands reached their bound (count or payload bytes)."""
        limit = self.server.config.values["client-query-buffer-limit"]
        return len(self._queue) >= QUEUE_AHEAD or self._in.queued_payload >= limit

    def _update_reading(self) -> None:
        if not (self._read_paused or self._write_paused or self._busy):
            return  # the common case: reading and nothing that could stop it
        transport = self.transport
        if transport is None or self._closing:
            return
        intake = self._in
        should_pause = (
            (self._write_paused or self._busy)
            and not intake.receiving_payload  # let a large payload finish arriving
            and (intake.backlog > HIGH_WATER or self._ahead_full())
        )
        if should_pause and not self._read_paused:
            self._read_paused = True
            transport.pause_reading()
        elif not should_pause and self._read_paused:
            self._read_paused = False
            transport.resume_reading()

    def _protocol_error(self, exc: ProtocolError) -> None:
        self.server.stats.protocol_errors += 1
        log.debug("protocol error from %s: %s", self.client.addr, exc.message)
        self._out.append(b"-%b\r\n" % exc.reply_line())
        self._close_after = True
        self._abort_sinks(self._in.drop())
        self._flush()
        self._closing = True

    # -- Ctx ------------------------------------------------------------------------------
    def close_after_reply(self) -> None:
        self._close_after = True

    def kill(self) -> None:
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def set_protocol(self, version: int) -> None:
        self._resp3 = version == 3
        self.client.protocol = version

    def start_monitor(self) -> None:
        self.client.flags.add("O")
        self.server.monitors.add(self)

    def stop_monitor(self) -> None:
        self.client.flags.discard("O")
        self.server.monitors.discard(self)

    def send_push(self, value: Any) -> None:
        if self._closing or self.transport is None:
            return
        encode_reply(value, self._resp3, self._out)
        if not self._busy:
            self._flush()

    def send_simple(self, line: bytes) -> None:
        self.send_push(Simple(line))

    def _abort_sinks(self, sinks: dict[int, Any]) -> None:
        if sinks:
            abort_sinks(sinks, lambda exc: log.error("aborting a payload sink failed: %r", exc))

    @property
    def idle_seconds(self) -> float:
        return monotonic() - self.client.last_interaction

    @property
    def busy(self) -> bool:
        return self._busy


class PyConnection(Connection):
    """A connection whose read callbacks are the Python twins even where ``ConnBase`` is built
    (the reference its tests compare it with)."""

    get_buffer = Connection._get_buffer
    buffer_updated = Connection._buffer_updated


def _fileno(transport: asyncio.BaseTransport) -> int:
    sock = transport.get_extra_info("socket")
    try:
        return int(sock.fileno()) if sock is not None else -1
    except (OSError, ValueError):
        return -1
