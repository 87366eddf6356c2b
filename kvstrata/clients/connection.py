"""Blocking RESP connection and a thread-safe pool of them.

A :class:`Connection` sends each command as a list of buffers with ``socket.sendmsg`` (a large
payload is never concatenated with its header) and receives with ``recv_into`` into the buffer
that :class:`~kvstrata.clients.resp.ReplyReader` chooses: its own read buffer for small replies,
the caller's ``out`` (or one preallocated ``bytearray``) for large bulks. On connect it sends
``HELLO 3`` (with ``AUTH`` and ``SETNAME`` when given) and ``CLIENT SETINFO LIB-NAME/LIB-VER``
in one round trip, falling back to RESP2 (and ``AUTH``) when the server refuses ``HELLO 3``.

A failed or timed-out I/O leaves the reply stream in an unknown state, so the connection closes
itself and raises :class:`ConnectionClosedError`; a pool drops closed connections.

:class:`ConnectionSettings` (where and how to connect, and :func:`settings_from_url`, the same
from a URL) are shared by the sync and async clients.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from kvstrata import __version__
from kvstrata.clients.resp import BIG_BULK, OutSpec, ReplyReader, command_buffers
from kvstrata.protocol.errors import LeaseError, NoAuthError, RespError, WrongPassError
from kvstrata.protocol.frames import Push

__all__ = [
    "ConnectionClosedError",
    "ConnectionPool",
    "ConnectionSettings",
    "SyncConnection",
    "handshake_commands",
    "handshake_result",
    "settings_from_url",
]

_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


#: what ending a lease says once the connection that took it is closed (no other may end it)
LEASE_CONN_CLOSED = "the connection that took this lease is closed: the lease ended with it"


class ConnectionClosedError(ConnectionError):
    """The connection is closed or broke while a command was in flight."""


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """Where and how to connect; shared by the sync and async connections and pools."""

    host: str = "127.0.0.1"
    port: int = 7379
    path: str | None = None  # Unix socket path instead of host/port
    password: str | None = None
    username: str | None = None
    client_name: str | None = None
    protocol: int = 3  # 2 to skip HELLO 3
    timeout: float | None = None  # per blocking operation, seconds
    connect_timeout: float | None = 10.0
    big_bulk: int = BIG_BULK
    #: TLS to the server's ``tls-port`` (sync and async clients); None: plain TCP
    tls: ssl.SSLContext | None = None
    tls_server_name: str | None = None  # for certificate checks; default: host
    #: how long a command the server refuses with ``-LOADING`` (its tiers are being built, its
    #: NVMe index rebuilt: nothing was done) is sent again, seconds; 0: raise LoadingError
    loading_timeout: float = 60.0


def loading_delays(timeout: float) -> Iterator[float]:
    """Pauses between the tries of a command refused with ``-LOADING``: 10 ms doubling to
    200 ms, until ``timeout`` seconds of them have passed (then the iterator ends)."""
    delay, waited = 0.01, 0.0
    while waited < timeout:
        step = min(delay, timeout - waited)
        yield step
        waited += step
        delay = min(delay * 2, 0.2)


def settings_from_url(url: str, **overrides: Any) -> dict[str, Any]:
    """``kvstrata://[user:password@]host[:port]`` (also ``redis://``, ``unix:///path``)."""
    u = urlparse(url)
    out: dict[str, Any] = {}
    if u.scheme == "unix":
        out["path"] = u.path
    elif u.scheme in ("kvstrata", "redis"):
        out["host"] = u.hostname or "127.0.0.1"
        out["port"] = u.port or 7379
    else:
        raise ValueError(f"unsupported URL scheme {u.scheme!r}")
    if u.password is not None:
        out["password"] = unquote(u.password)
        if u.username:
            out["username"] = unquote(u.username)
    out.update(overrides)
    return out


def handshake_commands(s: ConnectionSettings) -> list[list[Any]]:
    """HELLO (with AUTH/SETNAME) and CLIENT SETINFO, sent together on connect."""
    cmds: list[list[Any]] = []
    if s.protocol == 3:
        hello: list[Any] = ["HELLO", 3]
        if s.password is not None:
            hello += ["AUTH", s.username or "default", s.password]
        if s.client_name:
            hello += ["SETNAME", s.client_name]
        cmds.append(hello)
    else:
        if s.password is not None:
            cmds.append(["AUTH", *([s.username] if s.username else []), s.password])
        if s.client_name:
            cmds.append(["CLIENT", "SETNAME", s.client_name])
    cmds.append(["CLIENT", "SETINFO", "LIB-NAME", "kvstrata-py"])
    cmds.append(["CLIENT", "SETINFO", "LIB-VER", __version__])
    return cmds


def handshake_result(s: ConnectionSettings, replies: list[Any]) -> tuple[int, list[list[Any]]]:
    """The protocol in use and the commands still to send (RESP2 fallback), or raise."""
    if s.protocol != 3:
        for reply in replies[: len(replies) - 2]:
            if isinstance(reply, RespError):
                raise reply
        return 2, []
    hello = replies[0]
    if not isinstance(hello, RespError):
        return 3, []
    if isinstance(hello, NoAuthError | WrongPassError):
        raise hello
    fallback: list[list[Any]] = []
    if s.password is not None:
        fallback.append(["AUTH", *([s.username] if s.username else []), s.password])
    if s.client_name:
        fallback.append(["CLIENT", "SETNAME", s.client_name])
    return 2, fallback


def raise_first_error(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, RespError):
            raise reply


class SyncConnection:
    """One blocking connection. Not thread-safe: share a :class:`ConnectionPool` instead."""

    def __init__(self, settings: ConnectionSettings | None = None) -> None:
        self.settings = s = settings or ConnectionSettings()
        self._pending: deque[OutSpec] = deque()
        self._replies: deque[Any] = deque()
        self._reader = ReplyReader(self._on_reply, self._peek_out, s.big_bulk)
        self.protocol = 2
        self.closed = False
        self._poller: select.poll | None = None  # made by the first receive_ready
        self._sock = self._open()
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _open(self) -> socket.socket:
        s = self.settings
        if s.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(s.connect_timeout)
            sock.connect(s.path)
        else:
            sock = socket.create_connection((s.host, s.port), timeout=s.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if s.tls is not None:
                try:
                    sock = s.tls.wrap_socket(sock, server_hostname=s.tls_server_name or s.host)
                except BaseException:
                    sock.close()
                    raise
        sock.settimeout(s.timeout)
        return sock

    def _handshake(self) -> None:
        cmds = handshake_commands(self.settings)
        self.protocol, fallback = handshake_result(self.settings, self.pipeline(cmds))
        if fallback:
            raise_first_error(self.pipeline(fallback))

    def _on_reply(self, value: Any) -> None:
        if isinstance(value, Push):
            return  # out-of-band (RESP3 push); kvstrata clients subscribe to nothing
        self._pending.popleft()
        self._replies.append(value)

    def _peek_out(self) -> OutSpec:
        return self._pending[0] if self._pending else None

    def execute(self, *args: Any, out: OutSpec = None) -> Any:
        """Send one command and return its reply; an error reply is raised."""
        reply = self.pipeline([args], [out])[0]
        if isinstance(reply, RespError):
            raise reply
        return reply

    def pipeline(
        self, commands: Sequence[Sequence[Any]], outs: Sequence[OutSpec] | None = None
    ) -> list[Any]:
        """Send all commands, then read all replies (error replies are returned, not raised)."""
        buffers, outs = self._prepare(commands, outs)
        with self._closing_on_error():
            self._pending.extend(outs)
            self._sendall(buffers)
            return self._read(len(commands))

    def send(
        self, commands: Sequence[Sequence[Any]], outs: Sequence[OutSpec] | None = None
    ) -> None:
        """Send commands without reading their replies; :meth:`receive` reads them, in order
        (a write batch publishes chunks this way while it fills the next ones)."""
        buffers, outs = self._prepare(commands, outs)
        with self._closing_on_error():
            self._pending.extend(outs)
            self._sendall(buffers)

    def receive(self, count: int) -> list[Any]:
        """The next ``count`` replies of commands sent with :meth:`send` (error replies are
        returned, not raised)."""
        with self._closing_on_error():
            return self._read(count)

    def receive_ready(self, count: int) -> list[Any] | None:
        """The next ``count`` replies of commands sent with :meth:`send` when they have all
        arrived, else None; never waits for the server (what has arrived is parsed and kept
        for the next call). A scheduler polls its lookups with this instead of handing them
        to a thread."""
        with self._closing_on_error():
            reader, sock, replies = self._reader, self._sock, self._replies
            if self._poller is None:
                self._poller = select.poll()  # poll, not select: any fd number
                self._poller.register(sock, select.POLLIN)
            while len(replies) < count:
                # a socket with a timeout waits inside recv_into until bytes come: ask first
                # (TLS: a record already decrypted is pending without the fd being readable)
                tls_pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
                if not tls_pending and not self._poller.poll(0):
                    return None
                n = sock.recv_into(reader.get_buffer())
                if n == 0:
                    raise ConnectionClosedError("server closed the connection")
                reader.buffer_updated(n)
            return [replies.popleft() for _ in range(count)]

    def _prepare(
        self, commands: Sequence[Sequence[Any]], outs: Sequence[OutSpec] | None
    ) -> tuple[list[Any], list[OutSpec]]:
        """The buffers to send for ``commands``, and one out per command."""
        if self.closed:
            raise ConnectionClosedError("connection is closed")
        buffers: list[Any] = []
        for cmd in commands:
            buffers += command_buffers(cmd)
        outs = list(outs) if outs is not None else [None] * len(commands)
        if len(outs) != len(commands):
            raise ValueError("one out per command")
        return buffers, outs

    @contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """A failed read or write leaves the stream out of step: close the connection."""
        try:
            yield
        except (OSError, RespError) as exc:
            self.close()
            if isinstance(exc, RespError | TimeoutError):  # protocol error, socket timeout
                raise
            raise ConnectionClosedError(f"connection lost: {exc}") from exc
        except BaseException:
            self.close()  # e.g. KeyboardInterrupt mid-reply
            raise

    def _sendall(self, buffers: list[Any]) -> None:
        bufs = [b if isinstance(b, bytes) else memoryview(b).cast("B") for b in buffers]
        if isinstance(self._sock, ssl.SSLSocket):  # no sendmsg over TLS: one buffer at a time
            for buf in bufs:
                self._sock.sendall(buf)
            return
        i = 0
        while i < len(bufs):
            sent = self._sock.sendmsg(bufs[i : i + _IOV_MAX])
            while sent:
                size = len(bufs[i])
                if sent >= size:
                    sent -= size
                    i += 1
                else:
                    bufs[i] = memoryview(bufs[i])[sent:]
                    sent = 0

    def _read(self, count: int) -> list[Any]:
        reader, sock, replies = self._reader, self._sock, self._replies
        while len(replies) < count:
            n = sock.recv_into(reader.get_buffer())
            if n == 0:
                raise ConnectionClosedError("server closed the connection")
            reader.buffer_updated(n)
        return [replies.popleft() for _ in range(count)]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pending.clear()
        self._replies.clear()
        sock = getattr(self, "_sock", None)
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> SyncConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ConnectionPool:
    """A thread-safe pool of :class:`SyncConnection`, created on demand up to a maximum."""

    def __init__(self, settings: ConnectionSettings, max_connections: int = 16) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.settings = settings
        self.max_connections = max_connections
        self._idle: list[SyncConnection] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        #: bumped for every new connection: a server restart always means new connections,
        #: so clients drop what they cached about the server's regions when it changes
        self.generation = 0

    def acquire(self, timeout: float | None = None) -> SyncConnection:
        with self._cond:
            while True:
                if self._closed:
                    raise ConnectionClosedError("pool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.max_connections:
                    self._count += 1
                    break
                if not self._cond.wait(timeout):
                    raise TimeoutError("no free connection in the pool")
        try:
            conn = SyncConnection(self.settings)  # connect outside the lock
            self.generation += 1
            return conn
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def release(self, conn: SyncConnection) -> None:
        with self._cond:
            if conn.closed or self._closed:
                self._count -= 1
                conn.close()
            else:
                self._idle.append(conn)
            self._cond.notify()

    def acquire_this(self, conn: SyncConnection, timeout: float | None = None) -> SyncConnection:
        """``conn`` itself, once no other thread is using it: the commands that end a lease
        must come from the connection that took it (the server refuses them from any other).
        Raises LeaseError when ``conn`` is closed (its leases are unusable: as -NOLEASE)."""
        with self._cond:
            while True:
                if self._closed:
                    raise ConnectionClosedError("pool is closed")
                if conn.closed:
                    raise LeaseError(LEASE_CONN_CLOSED)
                if any(c is conn for c in self._idle):
                    self._idle.remove(conn)
                    return conn
                if not self._cond.wait(timeout):
                    raise TimeoutError("the connection that took this lease stays busy")

    @contextmanager
    def connection(self, conn: SyncConnection | None = None) -> Iterator[SyncConnection]:
        """A connection of the pool for one use: any, or ``conn`` (see :meth:`acquire_this`)."""
        conn = self.acquire() if conn is None else self.acquire_this(conn)
        try:
            yield conn
        finally:
            self.release(conn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()
