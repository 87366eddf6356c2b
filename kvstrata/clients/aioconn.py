"""asyncio RESP connection (a ``BufferedProtocol``) and an async connection pool.

The protocol lets the event loop receive straight into the buffer the
:class:`~kvstrata.clients.resp.ReplyReader` chooses (``get_buffer``): the caller's ``out`` for a
bulk reply that has one, so a 32 MiB ``KV.GET`` lands in a preallocated tensor with one kernel
copy. Commands go out as separate buffers (``transport.writelines`` on uvloop, which writes them
with one ``writev``; one ``write`` per buffer elsewhere, since CPython 3.11's default
``writelines`` joins them). Replies resolve futures in order; commands may be pipelined by many
tasks on one connection, and the pool spreads tasks over several connections.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

from kvstrata.clients.connection import (
    ConnectionClosedError,
    ConnectionSettings,
    handshake_commands,
    handshake_result,
    raise_first_error,
)
from kvstrata.clients.resp import OutSpec, ReplyReader, command_buffers
from kvstrata.protocol.errors import RespError
from kvstrata.protocol.frames import Push

__all__ = ["AsyncConnection", "AsyncConnectionPool", "open_connection"]


class _ReplyProtocol(asyncio.BufferedProtocol):
    def __init__(self, big_bulk: int) -> None:
        self.pending: deque[tuple[asyncio.Future[Any], OutSpec]] = deque()
        self.reader = ReplyReader(self._on_reply, self._peek_out, big_bulk)
        self.transport: asyncio.Transport | None = None
        self.closed_exc: BaseException | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.reader.buffer_updated(nbytes)
        except RespError as exc:  # protocol error: the stream is unusable
            self._fail(exc)
            if self.transport is not None:
                self.transport.abort()

    def _on_reply(self, value: Any) -> None:
        if isinstance(value, Push):
            return
        fut, _ = self.pending.popleft()
        if not fut.done():
            fut.set_result(value)

    def _peek_out(self) -> OutSpec:
        return self.pending[0][1] if self.pending else None

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    async def drain(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()
        if self.closed_exc is not None:
            raise ConnectionClosedError(str(self.closed_exc))

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionClosedError("server closed the connection"))
        self._can_write.set()

    def _fail(self, exc: BaseException) -> None:
        if self.closed_exc is None:
            self.closed_exc = exc
        while self.pending:
            fut, _ = self.pending.popleft()
            if not fut.done():
                fut.set_exception(_as_closed(exc))
                fut.exception()  # the awaiting task still gets it; no "never retrieved" log


def _as_closed(exc: BaseException) -> BaseException:
    if isinstance(exc, RespError | ConnectionClosedError):
        return exc
    err = ConnectionClosedError(f"connection lost: {exc}")
    err.__cause__ = exc
    return err


class AsyncConnection:
    """One asyncio connection; many tasks may use it at once (replies come back in order)."""

    def __init__(self, settings: ConnectionSettings, protocol: _ReplyProtocol) -> None:
        self.settings = settings
        self._proto = protocol
        self.protocol = 2
        transport = protocol.transport
        assert transport is not None
        self._transport: asyncio.Transport = transport
        self._writelines = type(transport).__module__.startswith("uvloop")

    @property
    def closed(self) -> bool:
        return self._proto.closed_exc is not None or self._transport.is_closing()

    @property
    def in_flight(self) -> int:
        return len(self._proto.pending)

    async def execute(self, *args: Any, out: OutSpec = None) -> Any:
        """Send one command and return its reply; an error reply is raised."""
        reply = (await self.pipeline([args], [out]))[0]
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def pipeline(
        self, commands: Sequence[Sequence[Any]], outs: Sequence[OutSpec] | None = None
    ) -> list[Any]:
        """Send all commands, then await all replies (error replies are returned, not raised)."""
        futures = self.send(commands, outs)
        try:
            await self._proto.drain()
            return [await fut for fut in futures]
        except asyncio.CancelledError:
            # the replies would arrive for nobody and an `out` could be written later: drop it
            self.close()
            raise

    def send(
        self, commands: Sequence[Sequence[Any]], outs: Sequence[OutSpec] | None = None
    ) -> list[asyncio.Future[Any]]:
        """Write all commands now and return the futures of their replies, not awaiting them
        (a streamed put sends the next part's reservation before it fills one). Whoever
        stops awaiting them must close the connection (see :meth:`pipeline`)."""
        if self.closed:
            raise _as_closed(self._proto.closed_exc or ConnectionClosedError("closed"))
        outs = list(outs) if outs is not None else [None] * len(commands)
        if len(outs) != len(commands):
            raise ValueError("one out per command")
        buffers: list[Any] = []
        for cmd in commands:
            buffers += command_buffers(cmd)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        self._proto.pending.extend(zip(futures, outs, strict=True))
        if self._writelines:
            self._transport.writelines(buffers)
        else:
            for buf in buffers:
                self._transport.write(buf)
        return futures

    def close(self) -> None:
        self._proto._fail(ConnectionClosedError("connection closed by the client"))
        self._transport.close()


async def open_connection(settings: ConnectionSettings | None = None) -> AsyncConnection:
    """Connect, run the HELLO handshake and return the connection."""
    s = settings or ConnectionSettings()
    loop = asyncio.get_running_loop()
    factory = lambda: _ReplyProtocol(s.big_bulk)  # noqa: E731
    server_name = (s.tls_server_name or s.host) if s.tls is not None else None
    connect = (
        loop.create_unix_connection(factory, s.path)
        if s.path
        else loop.create_connection(
            factory, s.host, s.port, ssl=s.tls, server_hostname=server_name
        )
    )
    _, proto = await asyncio.wait_for(connect, s.connect_timeout)
    conn = AsyncConnection(s, proto)
    try:
        replies = await conn.pipeline(handshake_commands(s))
        conn.protocol, fallback = handshake_result(s, replies)
        if fallback:
            raise_first_error(await conn.pipeline(fallback))
    except BaseException:
        conn.close()
        raise
    return conn


class AsyncConnectionPool:
    """Up to ``max_connections`` connections; a task borrows one per command (or pipeline)."""

    def __init__(self, settings: ConnectionSettings, max_connections: int = 8) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.settings = settings
        self.max_connections = max_connections
        self._idle: list[AsyncConnection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._all: set[AsyncConnection] = set()
        self._closed = False
        self.generation = 0  # bumped per new connection (see ConnectionPool.generation)

    async def acquire(self) -> AsyncConnection:
        if self._closed:
            raise ConnectionClosedError("pool is closed")
        await self._slots.acquire()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._all.discard(conn)
        try:
            conn = await open_connection(self.settings)
        except BaseException:
            self._slots.release()
            raise
        self.generation += 1
        self._all.add(conn)
        return conn

    def release(self, conn: AsyncConnection) -> None:
        if conn.closed or self._closed:
            self._all.discard(conn)
            conn.close()
        else:
            self._idle.append(conn)
        self._slots.release()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection]:
        conn = await self.acquire()
        try:
            yield conn
        finally:
            self.release(conn)

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)
