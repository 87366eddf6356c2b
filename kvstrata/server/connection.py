"""One client connection: receive, decode, dispatch in order, encode, flow control.

The protocol callbacks never await. Synchronous handlers run inline; an ``async def`` handler
runs as a task and the commands behind it wait (replies stay in pipeline order). Reading
pauses while an async command runs and more than :data:`HIGH_WATER` bytes are buffered, and
while the client does not drain its replies (``pause_writing``).

Large bulk arguments (≥ :data:`BIG`) are received in place: the command's ``sink`` (see the
registry) provides the destination — for ``KV.PUT`` an arena slot — and ``get_buffer`` hands
that memory to the transport so the kernel writes the payload where it will live.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import deque
from time import perf_counter
from types import CoroutineType
from typing import TYPE_CHECKING, Any

from kvstrata.protocol import decoder
from kvstrata.protocol.encoder import encode_reply, join_small
from kvstrata.protocol.errors import (
    CommandError,
    NoAuthError,
    ProtocolError,
    RespError,
    wrong_arity,
)
from kvstrata.protocol.frames import NO_REPLY, BulkView, Simple
from kvstrata.server.context import ClientState

if TYPE_CHECKING:
    from kvstrata.server.app import Server
    from kvstrata.server.registry import CommandSpec

log = logging.getLogger("kvstrata.server")

BIG = 64 * 1024  # bulk arguments at least this large are received in place
INITIAL_BUFFER = 256 * 1024
HIGH_WATER = 4 * 1024 * 1024  # unexecuted bytes buffered before reading pauses
JOIN_LIMIT = 64 * 1024  # replies up to this size are joined into one write
FLUSH_PARTS = 48  # reply buffers gathered before they are handed to the transport
_NO_SINKS: dict[int, Any] = {}
#: as Redis: AUTH/HELLO and admin commands (CONFIG SET requirepass …) are not shown to MONITOR
_NOT_MONITORED = frozenset({"no_auth", "admin"})
DENIED = (
    b"-DENIED kvstrata is running in protected mode because protected mode is enabled and no "
    b"password is set for the default user. In this mode connections are only accepted from "
    b"the loopback interface. If you want to connect from external computers to kvstrata you "
    b"may adopt one of the following solutions: 1) Just disable protected mode sending the "
    b"command 'CONFIG SET protected-mode no' from the loopback interface by connecting to "
    b"kvstrata from the same host the server is running, however MAKE SURE kvstrata is not "
    b"publicly accessible from internet if you do so. 2) Alternatively you can just disable the "
    b"protected mode by setting the protected-mode option to 'no' (--protected-mode no), and "
    b"then restarting the server. 3) Set up an authentication password for the default user "
    b"(--requirepass). NOTE: You only need to do one of the above things in order for the "
    b"server to start accepting connections from the outside.\r\n"
)


class _BytesSink:
    """Default destination of a large bulk: a bytearray that becomes the argument."""

    __slots__ = ("data", "view")

    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)
        self.view = memoryview(self.data)

    def consume(self) -> bytearray:
        return self.data

    def abort(self) -> None:
        pass


class _Partial:
    """A command whose large bulk is being received."""

    __slots__ = ("args", "need_crlf", "remaining", "sinks")

    def __init__(self, args: list[Any], remaining: int, sinks: dict[int, Any]) -> None:
        self.args = args
        self.remaining = remaining
        self.sinks = sinks
        self.need_crlf = True


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host in ("localhost", "") or host.startswith("/")


class Connection(asyncio.BufferedProtocol):
    """Implements ``server.context.Ctx`` for the handlers."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.sinks: dict[int, Any] = _NO_SINKS
        self.transport: asyncio.Transport | None = None
        self.client = ClientState(id=0, addr="?", laddr="?")
        self._buf = bytearray(INITIAL_BUFFER)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._partial: _Partial | None = None
        self._direct: memoryview | None = None
        self._filled = 0
        self._out: list[Any] = []
        self._out_bytes = 0
        self._releases: list[Any] = []
        self._busy = False
        self._closing = False
        self._close_after = False
        self._read_paused = False
        self._write_paused = False
        self._resp3 = False
        self._monitor = False
        self._task: asyncio.Task[None] | None = None
        self._queue: deque[list[Any]] = deque()
        self._slow = 0.0  # slow-log threshold in seconds, refreshed per batch

    # -- asyncio callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        peer = transport.get_extra_info("peername") or ("", 0)
        sock = transport.get_extra_info("sockname") or ("", 0)
        self.client = ClientState(
            id=server.next_client_id(), addr=_fmt_addr(peer), laddr=_fmt_addr(sock)
        )
        server.stats.total_connections_received += 1
        cfg = server.config
        if len(server.clients) >= cfg.maxclients:
            server.stats.rejected_connections += 1
            transport.write(b"-ERR max number of clients reached\r\n")  # type: ignore[attr-defined]
            transport.close()
            self._closing = True
            return
        host = peer[0] if isinstance(peer, tuple) else str(peer)
        if cfg.protected_mode and not cfg.requirepass and not is_loopback(host):
            server.stats.rejected_connections += 1
            transport.write(DENIED)  # type: ignore[attr-defined]
            transport.close()
            self._closing = True
            return
        self.client.authenticated = not cfg.requirepass
        server.clients[self.client.id] = self
        transport.set_write_buffer_limits(high=1024 * 1024)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.clients.pop(self.client.id, None)
        self.server.monitors.discard(self)
        if self._partial is not None:
            _abort_sinks(self._partial.sinks)
            self._partial = None
        self._direct = None
        self._queue.clear()
        self._run_releases()  # a running async command finishes; its reply is dropped

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._filled :]
        if self._end == len(self._buf):
            self._make_room()
        return self._mv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.server.stats.total_net_input_bytes += nbytes
        self.client.last_interaction = time.monotonic()
        if self._direct is not None:
            self._filled += nbytes
            if self._filled < self._direct.nbytes:
                return
            self._direct = None
        else:
            self._end += nbytes
        self._process()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._run_releases_if_drained()
        self._process()

    # -- input ----------------------------------------------------------------------------
    def _make_room(self) -> None:
        pending = self._end - self._start
        if self._start > 0:
            data = bytes(self._mv[self._start : self._end])
            self._buf[:pending] = data
            self._start, self._end = 0, pending
            return
        limit = self.server.config.client_query_buffer_limit
        if len(self._buf) >= limit:
            # Drop what is buffered (the client is being closed) and report the error from a
            # fresh callback: closing the transport inside get_buffer is not allowed.
            self._start = self._end = 0
            if not self._closing:
                self._closing = True
                error = ProtocolError("client query buffer limit reached")
                asyncio.get_running_loop().call_soon(self._protocol_error, error)
            return
        bigger = bytearray(len(self._buf) * 2)
        bigger[:pending] = self._mv[:pending]
        self._mv.release()
        self._buf = bigger
        self._mv = memoryview(bigger)

    def _process(self) -> None:
        """Decode what is buffered and run it, unless paused or an async command is running."""
        values = self.server.config.values
        self._slow = self.server.slowlog_threshold
        queue = self._queue
        executed = 0
        try:
            while (
                not self._busy
                and not self._closing
                and not self._write_paused
                and not self._close_after
            ):
                if queue:
                    self._execute(queue.popleft(), _NO_SINKS)
                    executed += 1
                    if len(self._out) >= FLUSH_PARTS:
                        self._flush()  # lets the transport push back (pause_writing)
                elif self._partial is not None:
                    executed += 1
                    if not self._continue_partial():
                        executed -= 1
                        break
                elif self._direct is not None or not self._decode(
                    values["proto-max-bulk-len"], values["max-multibulk-len"]
                ):
                    break
        except ProtocolError as exc:
            self._protocol_error(exc)
        self.server.stats.total_commands_processed += executed
        self.client.commands += executed
        if self._start == self._end and self._direct is None:
            self._start = self._end = 0
        self._flush()
        self._update_reading()

    def _decode(self, max_bulk: int, max_args: int) -> bool:
        """Decode buffered commands into the queue; False when nothing more can be decoded."""
        cmds, pos, state = decoder.parse_requests(
            self._buf, self._start, self._end, BIG, max_bulk, max_args
        )
        self._start = pos
        self._queue.extend(cmds)
        if state is None:
            return bool(cmds)
        if state == decoder.INLINE:
            inline, pos = decoder.parse_inlines(self._buf, self._start, self._end)
            self._start = pos
            self._queue.extend(inline)
            return bool(cmds) or pos != self._start or bool(inline)
        self._begin_big(state, {})
        return True

    def _begin_big(self, state: decoder.BigBulk, sinks: dict[int, Any]) -> None:
        args = state.args
        sink = None
        index = len(args)
        spec = self.server.registry.lookup(args[0]) if args else None
        if spec is not None and spec.sink is not None and self.client.authenticated:
            try:
                sink = spec.sink(self, args, state.length)
            except RespError:
                sink = None
            except Exception:
                log.exception("payload sink of %s failed", spec.name)
                sink = None
        if sink is None:
            sink = _BytesSink(state.length)
            args.append(sink.data)
        else:
            args.append(sink.view)
            sinks[index] = sink
        self._partial = _Partial(args, state.remaining - 1, sinks)
        have = min(self._end - state.data_pos, state.length)
        if have > 0:
            sink.view[:have] = self._mv[state.data_pos : state.data_pos + have]
        if have < state.length:
            self._direct = sink.view.cast("B") if sink.view.format != "B" else sink.view
            self._filled = have
            self._start = self._end = 0
        else:
            self._start = state.data_pos + state.length

    def _continue_partial(self) -> bool:
        """Finish the command of a large bulk; False when more bytes are needed."""
        part = self._partial
        assert part is not None
        if self._direct is not None:
            return False
        if part.need_crlf:
            if self._end - self._start < 2:
                return False
            if self._buf[self._start : self._start + 2] != b"\r\n":
                raise ProtocolError("expected CRLF after bulk data")
            self._start += 2
            part.need_crlf = False
        if part.remaining:
            cfg = self.server.config
            before = len(part.args)
            pos, state = decoder.parse_args(
                self._buf, self._start, self._end, part.remaining, BIG,
                cfg.proto_max_bulk_len, part.args,
            )  # fmt: skip
            part.remaining -= len(part.args) - before
            self._start = pos
            if state is None:
                return False
            if state is not True:
                self._partial = None
                state.args = part.args
                self._begin_big(state, part.sinks)
                return self._direct is None
        self._partial = None
        self._execute(part.args, part.sinks)
        return True

    # -- dispatch -------------------------------------------------------------------------
    def _execute(self, args: list[Any], sinks: dict[int, Any]) -> None:
        """Run one command and queue its reply. This is the hot path: keep it lean."""
        server = self.server
        spec = server.fast_specs.get(args[0])
        if (
            spec is None
            or (spec.arity > 0 and len(args) != spec.arity)
            or len(args) < -spec.arity
            or not self.client.authenticated
        ):
            try:
                spec = self._resolve(server.registry.lookup(args[0]), args)
            except RespError as exc:
                _abort_sinks(sinks)
                self._reply_error(exc)
                return
        if server.monitors and not spec.flags & _NOT_MONITORED:
            server.feed_monitors(self, args)
        self.client.last_command = spec.name
        self.sinks = sinks
        started = perf_counter()
        try:
            result = spec.handler(self, args)  # type: ignore[misc]
        except RespError as exc:
            result = exc
        except Exception as exc:  # a bug must not kill the connection
            result = self._internal_error(spec, exc)
        # A sync handler may return a coroutine when it needs I/O only sometimes (KV.MATCH
        # asking S3 about the part of a chain not held locally): it then runs like an async one.
        if spec.is_async or type(result) is CoroutineType:
            self._busy = True
            self._task = asyncio.ensure_future(self._finish_async(result, spec, args, started))
            return
        if sinks:
            self.sinks = _NO_SINKS
            _abort_sinks(sinks)
        t = type(result)
        if t is bytes or t is Simple or t is int or result is None or t is list:
            encode_reply(result, self._resp3, self._out)
        else:
            self._reply(result)
        if perf_counter() - started > self._slow:
            server.slowlog_record(started, args, self.client)

    def _internal_error(self, spec: CommandSpec, exc: Exception) -> CommandError:
        log.exception("command %s failed", spec.name)
        self.server.stats.unexpected_errors += 1
        return CommandError(f"internal error in '{spec.wire_name}': {exc}")

    def _resolve(self, spec: CommandSpec | None, args: list[Any]) -> CommandSpec:
        if spec is None:
            raise _unknown_command(args)
        if spec.subcommands and (len(args) >= 2 or spec.handler is None):
            if len(args) < 2:
                raise wrong_arity(spec.name)
            sub = spec.subcommands.get(bytes(args[1]).upper().decode("utf-8", "replace"))
            if sub is None:
                raise CommandError(f"unknown subcommand '{_trunc(args[1])}'. Try {spec.name} HELP.")
            spec = sub
        arity = spec.arity
        if (arity > 0 and len(args) != arity) or len(args) < -arity:
            raise CommandError(
                f"wrong number of arguments for '{spec.name.lower().replace('|', ' ')}' command"
            )
        if not self.client.authenticated and "no_auth" not in spec.flags:
            raise NoAuthError("Authentication required.")
        return spec

    async def _finish_async(
        self, coro: Any, spec: CommandSpec, args: list[Any], started: float
    ) -> None:
        sinks = self.sinks
        try:
            result = await coro if asyncio.iscoroutine(coro) else coro
        except RespError as exc:
            result = exc
        except Exception as exc:
            result = self._internal_error(spec, exc)
        finally:
            self.sinks = _NO_SINKS
            if sinks:
                _abort_sinks(sinks)
        self._busy = False
        self._task = None
        if self._closing:
            if isinstance(result, BulkView) and result.release is not None:
                result.release()
            return
        self._reply(result)
        if perf_counter() - started > self.server.slowlog_threshold:
            self.server.slowlog_record(started, args, self.client)
        self._process()

    # -- output ---------------------------------------------------------------------------
    def _reply(self, value: Any) -> None:
        if value is NO_REPLY:
            return
        if isinstance(value, RespError):
            self._reply_error(value)
            return
        if type(value) is BulkView and value.release is not None:
            self._releases.append(value.release)
        encode_reply(value, self._resp3, self._out)

    def _reply_error(self, exc: RespError) -> None:
        self.server.stats.total_error_replies += 1
        self._out.append(b"-%b\r\n" % exc.reply_line())

    def _flush(self) -> None:
        out = self._out
        if not out or self.transport is None:
            return
        self._out = []
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
        if self._releases:
            self._run_releases_if_drained()
        if self._close_after:
            self._closing = True
            self.transport.close()

    def _run_releases_if_drained(self) -> None:
        if not self._releases:
            return
        transport = self.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() == 0:
            self._run_releases()
        else:
            asyncio.get_running_loop().call_later(0.0005, self._run_releases_if_drained)

    def _run_releases(self) -> None:
        releases, self._releases = self._releases, []
        for release in releases:
            try:
                release()
            except Exception:
                log.exception("releasing a reply buffer failed")

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self._closing:
            return
        backlog = self._end - self._start
        should_pause = self._write_paused or (self._busy and backlog > HIGH_WATER)
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
        if self._partial is not None:
            _abort_sinks(self._partial.sinks)
            self._partial = None
        self._direct = None
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
        self._monitor = True
        self.client.flags.add("O")
        self.server.monitors.add(self)

    def stop_monitor(self) -> None:
        self._monitor = False
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

    @property
    def idle_seconds(self) -> float:
        return time.monotonic() - self.client.last_interaction

    @property
    def busy(self) -> bool:
        return self._busy


def _abort_sinks(sinks: dict[int, Any]) -> None:
    for sink in sinks.values():
        try:
            sink.abort()
        except Exception:
            log.exception("aborting a payload sink failed")


def _trunc(arg: Any, limit: int = 128) -> str:
    return bytes(arg[:limit]).decode("utf-8", "replace")


def _unknown_command(args: list[Any]) -> CommandError:
    rest = " ".join(f"'{_trunc(a)}'" for a in args[1:8])
    return CommandError(
        f"unknown command '{_trunc(args[0])}', with args beginning with: {rest}".rstrip()
        + (" " if rest else "")
    )


def _fmt_addr(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr)
