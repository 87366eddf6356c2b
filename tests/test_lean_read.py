"""The lean read path of ``Connection.buffer_updated`` against the general one.

Where the extension is built, the connection's read callbacks are C (``_fastpath.ConnBase``);
every comparison runs the C callbacks, their Python twins (``PyConnection``) and the general
path, and asserts all three alike.

A read whose small commands all run on the compiled path, with nothing queued, paused or
pending, is answered straight from ``buffer_updated`` (one C run, one transport write) instead
of going through ``_process`` and ``_flush``. These tests drive a connection read by read with
a fake transport, on a real server, and compare it with a connection that always takes the
general path (the code before the lean path): the same writes, byte for byte and call by call,
and the same state — keyspace, LRU order, INFO stats and commandstats, the client's counters,
the slow log. They also check that the lean path is taken where it should be, and not where
it must not be (a paused writer, a command for the Python path, a request split across reads).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from kvstrata.server import fastpath
from kvstrata.server.connection import Connection, PyConnection
from kvstrata.server.writeside import OUT_HIGH
from tests.conftest import RunningServer
from tests.fakes import cmd

pytestmark = pytest.mark.skipif(
    not fastpath.AVAILABLE, reason="kvstrata.server._fastpath is not built (setup.py build_ext)"
)


class FakeTransport:
    """Records writes; with ``stall`` set, keeps what it is given queued (as a client that
    does not read): ``pause_writing`` at once, ``resume_writing`` on :meth:`drain`."""

    def __init__(self, protocol: Connection) -> None:
        self.protocol = protocol
        self.writes: list[bytes] = []
        self.queued = 0
        self.stall = False
        self.reading = True
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        if self.stall:
            if not self.queued:
                self.protocol.pause_writing()
            self.queued += len(data)

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(bytes(p) for p in parts))

    def drain(self) -> None:
        self.stall = False
        if self.queued:
            self.queued = 0
            self.protocol.resume_writing()

    def get_write_buffer_size(self) -> int:
        return self.queued

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 7379)}.get(name)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Counting(Connection):
    """The connection under test; counts the reads that went the general way."""

    general = 0

    def _process(self, declined: int = -1) -> None:
        self.general += 1
        super()._process(declined)


class PyCounting(PyConnection):
    """The lean path's Python twin (the callbacks without ConnBase)."""

    general = 0

    def _process(self, declined: int = -1) -> None:
        self.general += 1
        super()._process(declined)


class GeneralOnly(Connection):
    """The reference: every read through ``_process`` (buffer_updated before the lean path)."""

    general = 0

    def buffer_updated(self, nbytes: int) -> None:
        self.general += 1
        self.server.stats.total_net_input_bytes += nbytes
        self.client.last_interaction = time.monotonic()
        if self._in.received(nbytes):
            self._process()


class Wire:
    """A connection of ``kind`` on ``srv``, fed read by read on the server's loop."""

    def __init__(self, srv: RunningServer, kind: type[Connection]) -> None:
        self.srv = srv

        def make() -> tuple[Connection, FakeTransport]:
            conn = kind(srv.server)
            transport = FakeTransport(conn)
            conn.connection_made(transport)  # type: ignore[arg-type]
            return conn, transport

        self.conn, self.transport = srv.call(make)

    def read(self, data: bytes) -> None:
        """One read of ``data`` (as the transport does it: get_buffer, then buffer_updated),
        or as many as the buffers it is given need."""

        def feed() -> None:
            rest = memoryview(data)
            while rest:
                view = self.conn.get_buffer(-1)
                n = min(len(view), len(rest))
                view[:n] = rest[:n]
                rest = rest[n:]
                self.conn.buffer_updated(n)

        self.srv.call(feed)

    def drain(self) -> None:
        self.srv.call(self.transport.drain)

    def close(self) -> None:
        self.srv.call(lambda: self.conn.connection_lost(None))


def observe(srv: RunningServer, wire: Wire) -> dict[str, Any]:
    s = srv.server

    def read() -> dict[str, Any]:
        client = wire.conn.client
        return {
            "hits": (s.keyspace.hits, s.keyspace.misses),
            "used": s.strings.used,
            "lru": list(s.strings._lru.items()),
            "stats": (
                s.stats.total_commands_processed, s.stats.total_net_input_bytes,
                s.stats.total_net_output_bytes, s.stats.total_error_replies,
            ),
            "cmdstats": {
                n: (c.calls, c.failed, c.rejected) for n, c in s.cmdstats.commands.items()
            },
            "client": (client.commands, client.last_command),
            "slowlog": [list(e.argv) for e in s.slowlog.get(-1)],
        }  # fmt: skip

    return dict(srv.call(read))


Script = Callable[[Wire], None]


def both(
    make_server: Callable[..., RunningServer],
    script: Script,
    setup: Callable[[Any], None] | None = None,
    **overrides: Any,
) -> Wire:
    """Run ``script`` on a lean connection (C callbacks), its Python twin and a general one
    (fresh servers, ``setup`` applied to each); assert the same writes and state, and the
    same reads taken the general way by both lean ones; return the C one."""
    wires = []
    for kind in (Counting, PyCounting, GeneralOnly):
        srv = make_server(**overrides)
        deadline = time.monotonic() + 10
        while srv.server.loading and time.monotonic() < deadline:
            time.sleep(0.01)
        if setup is not None:
            srv.call(partial(setup, srv.server))
        wire = Wire(srv, kind)
        script(wire)
        wires.append((wire, observe(srv, wire)))
        wire.close()
    (lean, lean_state), (twin, twin_state), (ref, ref_state) = wires
    for other, other_state in ((twin, twin_state), (ref, ref_state)):
        assert lean.transport.writes == other.transport.writes
        assert lean_state == other_state
        assert lean.transport.reading == other.transport.reading
    assert lean.conn.general == twin.conn.general  # type: ignore[attr-defined]
    return lean


def test_small_reads_take_the_lean_path(make_server: Callable[..., RunningServer]) -> None:
    def script(w: Wire) -> None:
        w.read(cmd("SET", "k", "v"))
        w.read(cmd("GET", "k"))
        w.read(cmd("GET", "nope"))
        w.read(b"PING\r\n")
        w.read(cmd("EXISTS", "k", "nope", "k"))
        w.read(cmd("SET", "k", "w") + cmd("GET", "k") + cmd("PING") * 20)  # pipelined

    lean = both(make_server, script)
    assert lean.conn.general == 0  # type: ignore[attr-defined]
    assert lean.transport.writes[:5] == [b"+OK\r\n", b"$1\r\nv\r\n", b"$-1\r\n", b"+PONG\r\n",
                                         b":2\r\n"]  # fmt: skip
    assert lean.transport.writes[5] == b"+OK\r\n$1\r\nw\r\n" + b"+PONG\r\n" * 20
    assert lean.conn.client.commands == 27


def test_the_read_callbacks_are_compiled(make_server: Callable[..., RunningServer]) -> None:
    """With the extension, a lean read is answered by ConnBase without its Python twins; a
    buffer it cannot hand out (after a partial request) and a read it cannot answer (the
    fast path switched off) go to the twins."""
    assert Connection.buffer_updated is fastpath.CONN_BASE.buffer_updated
    assert Connection.get_buffer is fastpath.CONN_BASE.get_buffer
    twins: list[str] = []

    class Watched(Connection):
        def _buffer_updated(self, nbytes: int) -> None:
            twins.append("buffer_updated")
            super()._buffer_updated(nbytes)

        def _get_buffer(self, sizehint: int) -> memoryview:
            twins.append("get_buffer")
            return super()._get_buffer(sizehint)

    srv = make_server()
    wire = Wire(srv, Watched)
    wire.read(cmd("SET", "k", "v") + cmd("GET", "k"))
    assert twins == [] and wire.transport.writes == [b"+OK\r\n$1\r\nv\r\n"]
    request = cmd("GET", "k")
    wire.read(request[:5])  # incomplete: declined in C, kept; the next buffer is after it
    wire.read(request[5:])
    assert twins == ["get_buffer"]
    assert wire.transport.writes[-1] == b"$1\r\nv\r\n"
    wire.read(cmd("CONFIG", "SET", "fast-path", "no"))
    wire.read(cmd("GET", "k"))
    assert twins == ["get_buffer", "buffer_updated"]
    assert wire.transport.writes[-2:] == [b"+OK\r\n", b"$1\r\nv\r\n"]
    assert srv.call(lambda: wire.conn.client.commands) == 5
    wire.close()


def test_split_requests(make_server: Callable[..., RunningServer]) -> None:
    """A request cut at every offset: the first read holds an incomplete command (the general
    path keeps it), the second completes it."""
    whole = cmd("SET", "key", "value") + cmd("GET", "key")

    def script(w: Wire) -> None:
        for cut in range(1, len(whole)):
            w.read(whole[:cut])
            w.read(whole[cut:])

    lean = both(make_server, script)
    assert b"".join(lean.transport.writes) == b"+OK\r\n$5\r\nvalue\r\n" * (len(whole) - 1)
    assert lean.conn.general > 0  # type: ignore[attr-defined]  # the incomplete first reads


def test_hand_over_mid_buffer(make_server: Callable[..., RunningServer]) -> None:
    """Fast commands, then ones for the Python path (STRLEN, DEL, errors, a TTL), then fast
    ones again, in one read; a read that starts with a command for the Python path; a
    protocol error after fast commands (it closes the connection)."""

    def script(w: Wire) -> None:
        w.read(cmd("SET", "n", "1") + cmd("STRLEN", "n") + cmd("GET", "n") + cmd("DEL", "n"))
        w.read(cmd("GET", "a", "b") + cmd("NOPE") + cmd("PING"))
        w.read(cmd("TTL", "n") + cmd("GET", "n"))
        w.read(b"PING\r\n" + cmd("SET", "t", "1", "PX", "100000") + cmd("GET", "t"))
        w.read(cmd("SET", "k", "v") + b"*1\r\n$x\r\n")

    lean = both(make_server, script)
    assert lean.transport.writes[0] == b"+OK\r\n:1\r\n$1\r\n1\r\n:1\r\n"
    assert lean.transport.writes[2] == b":-2\r\n$-1\r\n"
    assert lean.transport.writes[-1].endswith(b"-ERR Protocol error: invalid bulk length\r\n")
    assert lean.transport.closed


def test_large_values(make_server: Callable[..., RunningServer]) -> None:
    """Replies of one read flushed in slices (fastpath.MAX_OUT); a value received in place
    (a bulk of BIG bytes or more), split across reads, followed by fast commands."""
    big = cmd("SET", "big", b"y" * 100_000) + cmd("GET", "w")

    def script(w: Wire) -> None:
        w.read(cmd("SET", "w", b"w" * 60_000))
        w.read(cmd("GET", "w") * 12 + cmd("PING"))
        w.read(big[:30_000])
        w.read(big[30_000:70_000])
        w.read(big[70_000:])
        w.read(cmd("STRLEN", "big") + cmd("EXISTS", "big", "w"))

    lean = both(make_server, script)
    assert len(lean.transport.writes) > 4  # the replies of one read went in several writes
    assert lean.transport.writes[-1] == b":100000\r\n:2\r\n"


def test_paused_writer(make_server: Callable[..., RunningServer]) -> None:
    """A client that does not read: its output stays queued, commands stop above OUT_HIGH,
    reading pauses once enough input is buffered, and all resumes when the output drains."""
    value = b"x" * 60_000
    gets = OUT_HIGH // len(value) + 2

    def script(w: Wire) -> None:
        w.read(cmd("SET", "v", value))
        w.transport.stall = True
        w.read(cmd("GET", "v"))  # leaves bytes unsent: _after_write must run
        for _ in range(gets):
            w.read(cmd("GET", "v") + cmd("SET", "k", "x"))
        w.read(cmd("PING") * 3)  # queued behind the paused writer
        assert w.srv.call(lambda: (w.conn._write_paused, len(w.conn._queue) >= 3)) == (True, True)
        w.drain()
        w.read(cmd("GET", "k"))

    lean = both(make_server, script)
    assert b"".join(lean.transport.writes).endswith(b"+PONG\r\n" * 3 + b"$1\r\nx\r\n")
    assert lean.conn.general > 0  # type: ignore[attr-defined]


def test_slowlog_setting_changes_between_reads(
    make_server: Callable[..., RunningServer],
) -> None:
    def script(w: Wire) -> None:
        config = w.srv.server.config
        w.read(cmd("SET", "a", "1"))
        w.srv.call(lambda: config.set("slowlog-log-slower-than", "0"))
        w.read(cmd("SET", "b", "2"))
        w.read(cmd("GET", "b"))
        w.srv.call(lambda: config.set("slowlog-log-slower-than", "-1"))
        w.read(cmd("GET", "a"))

    lean = both(make_server, script)
    entries = observe(lean.srv, lean)["slowlog"]
    assert entries == [[b"GET", b"b"], [b"SET", b"b", b"2"]]


def test_idle_time_and_fast_path_switch(make_server: Callable[..., RunningServer]) -> None:
    def script(w: Wire) -> None:
        w.srv.call(lambda: setattr(w.conn.client, "last_interaction", 0.0))
        w.read(cmd("PING"))
        assert w.srv.call(lambda: w.conn.idle_seconds) < 5
        w.srv.call(lambda: w.srv.server.config.set("fast-path", "no"))
        w.read(cmd("GET", "k"))

    lean = both(make_server, script)
    assert lean.conn.general == 1  # type: ignore[attr-defined]  # the read after fast-path no


def test_one_compiled_run_per_declined_read(make_server: Callable[..., RunningServer]) -> None:
    """A read that starts with a command for the Python path costs one compiled run (the one
    that declines it), not one more per place the general path would try again."""
    srv = make_server()
    calls = []
    inner = srv.server.fastpath

    class Spy:
        def run(self, *args: Any) -> Any:
            calls.append(args[1])
            return inner.run(*args)

    srv.call(lambda: setattr(srv.server, "fastpath", Spy()))
    wire = Wire(srv, Counting)
    wire.read(cmd("STRLEN", "k"))
    assert calls == [0]
    wire.read(cmd("STRLEN", "k") + cmd("GET", "k"))
    assert calls == [0, 0]  # declined; the general path decodes and runs both
    assert wire.transport.writes == [b":0\r\n", b":0\r\n$-1\r\n"]
    wire.close()


def test_run_that_leaves_several_reply_buffers(make_server: Callable[..., RunningServer]) -> None:
    """Should the compiled path ever append its replies as several buffers, the lean path
    hands them to the general flush instead of writing one of them."""

    class Split:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def run(self, *args: Any) -> Any:
            out = args[3]
            before = len(out)
            result = self.inner.run(*args)
            if len(out) > before and len(out[-1]) > 1:
                last = out.pop()
                out += [last[:1], last[1:]]
            return result

    def split(server: Any) -> None:
        server.fastpath = Split(server.fastpath)

    def script(w: Wire) -> None:
        w.read(cmd("SET", "k", "v"))
        w.read(cmd("GET", "k") + cmd("PING"))
        w.read(cmd("GET", "k") + cmd("STRLEN", "k"))

    lean = both(make_server, script, setup=split)
    assert lean.transport.writes == [b"+OK\r\n", b"$1\r\nv\r\n+PONG\r\n", b"$1\r\nv\r\n:1\r\n"]
