"""The compiled small-command path (kvstrata.server.fastpath) against its Python twin.

One suite, run on both paths (the ``path`` fixture; the Python one is the reference): the same
byte scripts must give the same replies and leave the same state behind — keyspace hits and
misses, expired and evicted keys, INFO commandstats and errorstats, the strings' LRU order and
used bytes, the slow log, commands processed and the client's last command. The direct tests at
the end call the compiled routine itself: what it runs, where it hands over to Python.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstrata.server import fastpath
from kvstrata.server.cmdstats import CommandStat
from kvstrata.store.keyspace import StringEntry
from tests.conftest import RunningServer
from tests.fakectx import FakeServer
from tests.fakes import cmd

END = b"*2\r\n$4\r\nECHO\r\n$3\r\nEND\r\n"
END_REPLY = b"$3\r\nEND\r\n"


class Session:
    """A raw connection: send bytes, read the replies up to an ``ECHO END`` marker."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, data: bytes, finish: bool = True) -> bytes:
        self.sock.sendall(data + (END if finish else b""))
        if not finish:
            return b""
        got = b""
        deadline = time.monotonic() + 10
        while not got.endswith(END_REPLY) and time.monotonic() < deadline:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        assert got.endswith(END_REPLY), got[-200:]
        return got[: -len(END_REPLY)]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["compiled", "python"])
def path(request: pytest.FixtureRequest) -> str:
    if request.param == "compiled" and not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    return str(request.param)


@pytest.fixture
def start(make_server: Callable[..., RunningServer], path: str) -> Callable[..., RunningServer]:
    """Start a server whose connections use the compiled path or only the Python one."""

    def factory(**overrides: Any) -> RunningServer:
        if path == "python":
            overrides["fast_path"] = "no"
        srv = make_server(**overrides)
        assert (srv.server.fastpath is not None) == fastpath.AVAILABLE
        return srv

    return factory


def state(srv: RunningServer) -> dict[str, Any]:
    """What a client or an operator can observe, minus timings."""
    s = srv.server

    def read() -> dict[str, Any]:
        return {
            "hits": s.keyspace.hits,
            "misses": s.keyspace.misses,
            "expired": s.keyspace.expired_keys,
            "evicted": s.strings.evicted_keys,
            "used": s.strings.used,
            "lru": list(s.strings._lru.items()),
            "keys": sorted(k for k, _ in s.keyspace.items()),
            "processed": s.stats.total_commands_processed,
            "error_replies": s.stats.total_error_replies,
            "cmdstats": {
                n: (c.calls, c.failed, c.rejected) for n, c in s.cmdstats.commands.items()
            },
            "errorstats": dict(s.cmdstats.errors),
            "clients": sorted(
                (c.client.commands, c.client.last_command) for c in s.clients.values()
            ),
        }

    return dict(srv.call(read))


def mixed_script() -> list[bytes]:
    chunk_key = b"kv:ns:6162"
    return [
        b"PING\r\nping hello\r\n" + cmd("PING") + cmd("ping", "x y") + cmd("ECHO", b"\r\n\x00"),
        cmd("GET", "k") + cmd("SET", "k", "v") + cmd("GET", "k") + cmd("get", "k"),
        cmd("Set", "k", "longer value") + cmd("GET", "k") + cmd("SET", "e", "") + cmd("GET", "e"),
        cmd("EXISTS", "k", "nope", "k") + b"EXISTS e\r\nSET i inline\r\nGET i\r\n",
        cmd("SET", "t", "1", "PX", "100000") + cmd("GET", "t") + cmd("EXISTS", "t", "k"),
        cmd("SET", "gone", "1", "PXAT", "1") + cmd("GET", "gone") + cmd("EXISTS", "gone"),
        cmd("GET", "a", "b") + cmd("SET", "k") + cmd("NOPE", "x") + cmd("PING", "a", "b"),
        cmd("KV.PUT", "ns", "ab", "", "payload") + cmd("GET", chunk_key)
        + cmd("SET", chunk_key, "plain") + cmd("GET", chunk_key),
        cmd("SET", "big", b"x" * 70_000) + cmd("GET", "k") + cmd("STRLEN", "big"),
        b"".join(cmd("SET", f"p{i % 37}", f"v{i}") + cmd("GET", f"p{i % 41}") for i in range(300)),
        # replies far larger than the requests: flushed in slices (fastpath.MAX_OUT)
        cmd("SET", "w", b"w" * 60_000) + cmd("GET", "w") * 40 + cmd("ECHO", b"y" * 70_000),
    ]  # fmt: skip


class Spy:
    """Wraps the compiled path and counts the commands it ran."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ran = 0

    def run(self, *args: Any) -> Any:
        result = self.inner.run(*args)
        self.ran += result[1]
        return result


def test_config_set_fast_path_switches_paths(make_server: Callable[..., RunningServer]) -> None:
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    srv = make_server()
    spy = Spy(srv.server.fastpath)
    srv.call(lambda: setattr(srv.server, "fastpath", spy))
    session = Session(srv.port)
    assert session.send(cmd("CONFIG", "SET", "fast-path", "no") + cmd("SET", "k", "v")) == (
        b"+OK\r\n+OK\r\n"
    )
    assert spy.ran == 0
    assert session.send(cmd("CONFIG", "SET", "fast-path", "yes")) == b"+OK\r\n"
    assert spy.ran == 0  # the setting is read once per batch: this one started without it
    assert session.send(cmd("GET", "k")) == b"$1\r\nv\r\n"
    assert spy.ran == 2  # GET k and the ECHO END marker
    session.close()


def test_config_set_fast_path_no_mid_batch(make_server: Callable[..., RunningServer]) -> None:
    """``CONFIG SET fast-path no`` as a quoted inline command (the Python decoder's), then
    multibulk GETs in the same write: none of them may run on the compiled path."""
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    srv = make_server()
    spy = Spy(srv.server.fastpath)
    srv.call(lambda: setattr(srv.server, "fastpath", spy))
    session = Session(srv.port)
    got = session.send(b"'CONFIG' SET fast-path no\r\n" + cmd("SET", "k", "v") + cmd("GET", "k"))
    session.close()
    assert got == b"+OK\r\n+OK\r\n$1\r\nv\r\n"
    assert spy.ran == 0


def observe(srv: RunningServer, script: list[bytes]) -> tuple[list[bytes], dict[str, Any]]:
    """Replies of each step of ``script`` on one connection, then the server's state."""
    session = Session(srv.port)
    replies = [session.send(step) for step in script]
    st = state(srv)
    session.close()
    return replies, st


def test_both_paths_same_replies_and_state(make_server: Callable[..., RunningServer]) -> None:
    """The reference is the Python path: a server with the compiled path must answer the same
    mixed script (fast commands, commands it hands over, errors, TTLs, other types, a large
    value, a long pipeline) byte for byte and end in the same state."""
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    compiled, python = make_server(), make_server(fast_path="no")
    spy = Spy(compiled.server.fastpath)
    compiled.call(lambda: setattr(compiled.server, "fastpath", spy))
    replies, st = observe(compiled, mixed_script())
    assert (replies, st) == observe(python, mixed_script())
    assert spy.ran > 600  # most of the script ran on the compiled path
    assert replies[0] == b"+PONG\r\n$5\r\nhello\r\n+PONG\r\n$3\r\nx y\r\n$3\r\n\r\n\x00\r\n"
    assert replies[1] == b"$-1\r\n+OK\r\n$1\r\nv\r\n$1\r\nv\r\n"
    assert replies[3] == b":2\r\n:1\r\n+OK\r\n$6\r\ninline\r\n"
    assert replies[4] == b"+OK\r\n$1\r\n1\r\n:2\r\n"
    assert replies[5] == b"+OK\r\n$-1\r\n:0\r\n"
    assert replies[6].startswith(b"-ERR wrong number of arguments for 'get' command\r\n")
    assert replies[7].count(b"-WRONGTYPE") == 1 and replies[7].endswith(b"+OK\r\n$5\r\nplain\r\n")
    one_w = b"$60000\r\n" + b"w" * 60_000 + b"\r\n"
    assert replies[-1] == b"+OK\r\n" + one_w * 40 + b"$70000\r\n" + b"y" * 70_000 + b"\r\n"
    assert st["expired"] == 1 and st["hits"] > 100 and st["misses"] > 10
    assert st["cmdstats"]["GET"][0] > 300 and st["cmdstats"]["GET"][2] == 1  # one rejected
    assert st["clients"] == [(st["processed"], "ECHO")]


def test_resp3_null_and_split_commands(start: Callable[..., RunningServer]) -> None:
    srv = start()
    session = Session(srv.port)
    assert session.send(cmd("HELLO", "3")).startswith(b"%")
    assert session.send(cmd("GET", "k") + cmd("SET", "k", "v")) == b"_\r\n+OK\r\n"
    whole = cmd("GET", "k") + cmd("SET", "k", "w")
    for cut in range(1, len(whole)):
        session.send(whole[:cut], finish=False)
        assert session.send(whole[cut:]) == b"$1\r\nv\r\n+OK\r\n"
        session.send(cmd("SET", "k", "v"))
    session.close()
    st = state(srv)
    assert st["hits"] == len(whole) - 1 and st["misses"] == 1


def test_eviction_and_lru_order(start: Callable[..., RunningServer]) -> None:
    """Keys a1..a5 are written, a1 and a2 are read (most recently used), then maxmemory is
    lowered so that the next SETs must evict: the least recently used keys (a3, a4…) go."""
    srv = start()
    session = Session(srv.port)
    session.send(b"".join(cmd("SET", f"a{i}", "x" * 100) for i in range(1, 6)))
    session.send(cmd("GET", "a1") + cmd("GET", "a2"))
    used = state(srv)["used"]
    session.send(cmd("CONFIG", "SET", "maxmemory", str(used + 100)))
    assert session.send(cmd("SET", "b1", "y" * 100) + cmd("SET", "b2", "y" * 100)) == (
        b"+OK\r\n+OK\r\n"
    )
    st = state(srv)
    assert st["evicted"] == 2
    assert [k for k, _ in st["lru"]] == [b"a5", b"a1", b"a2", b"b1", b"b2"]
    session.send(cmd("CONFIG", "SET", "maxmemory-policy", "noeviction"))
    assert session.send(cmd("SET", "b3", "z" * 500)).startswith(b"-OOM command not allowed")
    session.close()


def test_slowlog_gets_fast_commands(start: Callable[..., RunningServer]) -> None:
    srv = start(slowlog_log_slower_than=0)
    session = Session(srv.port)
    session.send(cmd("SET", "k", "v") + cmd("GET", "k") + cmd("PING"))
    log = session.send(cmd("SLOWLOG", "GET", "10"))
    session.close()
    entries = re.findall(rb"\*2\r\n\$3\r\nGET\r\n\$1\r\nk|\*3\r\n\$3\r\nSET\r\n\$1\r\nk", log)
    assert len(entries) == 2, log
    assert b"$4\r\nPING\r\n" in log


def test_noauth_then_auth(start: Callable[..., RunningServer]) -> None:
    srv = start(requirepass="pw")
    session = Session(srv.port)
    assert session.send(cmd("GET", "k"), finish=False) == b""
    got = session.sock.recv(1000)
    assert got.startswith(b"-NOAUTH")
    assert session.send(cmd("AUTH", "pw") + cmd("SET", "k", "v") + cmd("GET", "k")) == (
        b"+OK\r\n+OK\r\n$1\r\nv\r\n"
    )
    session.close()
    assert state(srv)["cmdstats"]["GET"][:3] == (1, 0, 1)


def test_monitor_sees_fast_commands(start: Callable[..., RunningServer]) -> None:
    srv = start()
    mon = Session(srv.port)
    mon.sock.sendall(b"MONITOR\r\n")
    assert mon.sock.recv(100) == b"+OK\r\n"
    client = Session(srv.port)
    client.send(cmd("SET", "k", "v") + cmd("GET", "k"))
    seen = b""
    deadline = time.monotonic() + 5
    while b'"ECHO" "END"' not in seen and time.monotonic() < deadline:
        seen += mon.sock.recv(10000)
    assert b'"SET" "k" "v"' in seen and b'"GET" "k"' in seen
    mon.close()
    client.close()


def test_protocol_error_after_fast_commands(start: Callable[..., RunningServer]) -> None:
    srv = start()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(cmd("SET", "k", "v") + cmd("GET", "k") + b"*1\r\n$x\r\n")
        got = b""
        while True:
            chunk = sock.recv(1000)
            if not chunk:
                break
            got += chunk
    assert got == b"+OK\r\n$1\r\nv\r\n-ERR Protocol error: invalid bulk length\r\n"


# -- the compiled routine itself -------------------------------------------------------------


@pytest.fixture
def compiled() -> tuple[FakeServer, Any]:
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    srv = FakeServer()
    return srv, fastpath.bind(srv)  # type: ignore[arg-type]


def run(fast: Any, data: bytes, resp3: bool = False, slow: float = 1e9) -> tuple[Any, ...]:
    out: list[bytes] = []
    pos, ran, last, slow_hit = fast.run(
        bytearray(data), 0, len(data), out, resp3, 512 * 1024 * 1024, 1024, slow, 1 << 20
    )
    return pos, ran, fastpath.NAMES[last] if ran else None, slow_hit, b"".join(out)


def test_runs_hot_commands_and_stops_at_others(compiled: tuple[FakeServer, Any]) -> None:
    srv, fast = compiled
    data = cmd("SET", "k", "v") + b"GET k\r\n" + cmd("PING") + cmd("DEL", "k") + cmd("GET", "k")
    pos, ran, last, slow_hit, out = run(fast, data)
    assert (ran, last, slow_hit) == (3, "PING", None)
    assert data[pos:] == cmd("DEL", "k") + cmd("GET", "k")
    assert out == b"+OK\r\n$1\r\nv\r\n+PONG\r\n"
    assert srv.keyspace.hits == 1 and srv.cmdstats.commands["SET"].calls == 1
    entry = srv.keyspace.lookup(b"k")
    assert isinstance(entry, StringEntry) and entry.value == b"v"
    assert srv.strings.used == 1 + 1 + 64


def test_command_names_fold_ascii_case_only(compiled: tuple[FakeServer, Any]) -> None:
    """Mixed case runs compiled; a byte that only a Latin locale would fold (0xDD, dotted İ in
    ISO-8859-9) is not a letter of EXISTS, as in the registry's ``bytes.upper()``."""
    _srv, fast = compiled
    data = cmd("gEt", "k") + cmd("ExIsTs", "k") + cmd(b"EX\xddSTS", "k")
    pos, ran, last, _slow, out = run(fast, data)
    assert (ran, last, out) == (2, "EXISTS", b"$-1\r\n:0\r\n")
    assert data[pos:] == cmd(b"EX\xddSTS", "k")


@pytest.mark.parametrize(
    "data",
    [
        cmd("SET", "k", "v", "NX"),  # an option
        cmd("GET", "a", "b"),  # wrong arity
        b'SET k "a b"\r\n',  # quoted inline
        b"\r\n",  # blank inline line
        cmd("GET", "k")[:-1],  # incomplete
        b"*1\r\n$x\r\n",  # malformed
        cmd("SET", "k", b"x" * 70_000),  # a large value (the tiers')
    ],
)
def test_hands_over_without_side_effects(compiled: tuple[FakeServer, Any], data: bytes) -> None:
    srv, fast = compiled
    assert run(fast, data) == (0, 0, None, None, b"")
    assert srv.keyspace.hits == srv.keyspace.misses == 0 and not srv.cmdstats.commands


def test_uninitialised_object_raises(compiled: tuple[FakeServer, Any]) -> None:
    srv, fast = compiled
    bare = type(fast).__new__(type(fast))  # no __init__: used to dereference NULL
    with pytest.raises(TypeError, match="not initialised"):
        bare.run(bytearray(b"PING\r\n"), 0, 6, [], False, 1024, 16, 1.0, 1024)
    stores = srv.keyspace, srv.strings, srv.cmdstats, StringEntry, CommandStat, 65536, 64
    with pytest.raises(TypeError, match="keyword"):  # used to be ignored
        type(fast)(*stores, large_value=1)


def test_hands_over_ttl_and_other_types(compiled: tuple[FakeServer, Any]) -> None:
    srv, fast = compiled
    srv.strings.store(b"t", b"1", int(time.time() * 1000) + 100_000)
    assert run(fast, cmd("GET", "t"))[1] == 0
    assert run(fast, cmd("SET", "t", "2"))[1] == 0
    assert run(fast, cmd("EXISTS", "t"))[1] == 0
    srv.keyspace.insert(b"c", _Chunk())
    assert run(fast, cmd("GET", "c"))[1] == 0
    assert run(fast, cmd("EXISTS", "c"))[:2] == (len(cmd("EXISTS", "c")), 1)
    assert srv.keyspace.hits == srv.keyspace.misses == 0


def test_slow_command_is_handed_back(compiled: tuple[FakeServer, Any]) -> None:
    _, fast = compiled
    data = cmd("SET", "k", "v") + cmd("GET", "k")
    pos, ran, last, slow_hit, out = run(fast, data, slow=-1.0)
    assert (pos, ran, last, out) == (len(cmd("SET", "k", "v")), 1, "SET", b"+OK\r\n")
    started, argv = slow_hit
    assert argv == [b"SET", b"k", b"v"] and abs(started - time.perf_counter()) < 5


def test_resp3_null_and_maxmemory(compiled: tuple[FakeServer, Any]) -> None:
    srv, fast = compiled
    assert run(fast, cmd("GET", "nope"), resp3=True)[4] == b"_\r\n"
    srv.config.values["maxmemory"] = 100
    assert run(fast, cmd("SET", "k", "x" * 10))[1] == 1
    assert run(fast, cmd("SET", "k2", "x" * 30))[1] == 0  # over maxmemory: Python evicts


@pytest.mark.parametrize(
    ("maxmemory", "capacity"), [(0, 100), (100, 1 << 30), ("100", 1 << 30), (0, "100")]
)
def test_set_reads_the_limit_of_the_string_store(
    compiled: tuple[FakeServer, Any], maxmemory: Any, capacity: Any
) -> None:
    """The C path reads StringStore.limit's two config values itself when they are ints, and
    asks the property otherwise: either way a SET that would go over it goes to Python."""
    srv, fast = compiled
    srv.config.values.update({"maxmemory": maxmemory, "dram-capacity": capacity})
    assert srv.strings.limit == 100
    assert run(fast, cmd("SET", "k", "x" * 10))[1] == 1
    assert run(fast, cmd("SET", "k2", "x" * 30))[1] == 0


def test_set_builds_and_replaces_entries_as_python_does(compiled: tuple[FakeServer, Any]) -> None:
    """A new key gets a complete StringEntry (built without its __init__); a replacement of
    the same size keeps the LRU's cost and `used`, and moves the key to the LRU's end."""
    srv, fast = compiled
    assert run(fast, cmd("SET", "a", "12") + cmd("SET", "b", "34"))[1] == 2
    entry = srv.keyspace.lookup(b"a")
    assert entry == StringEntry(b"12") and type(entry) is StringEntry
    assert (srv.strings.used, list(srv.strings._lru.items())) == (134, [(b"a", 67), (b"b", 67)])
    assert run(fast, cmd("SET", "a", "56"))[1] == 1
    assert srv.keyspace.lookup(b"a") == StringEntry(b"56")
    assert (srv.strings.used, list(srv.strings._lru.items())) == (134, [(b"b", 67), (b"a", 67)])
    assert run(fast, cmd("SET", "b", "7"))[1] == 1
    assert (srv.strings.used, list(srv.strings._lru.items())) == (133, [(b"a", 67), (b"b", 66)])


@dataclass(slots=True)
class _WiderEntry:
    value: bytes | bytearray
    expire_at: int | None = None
    type_name: str = "string"
    extra: list[int] = field(default_factory=list)


def test_other_entry_types_are_built_by_calling_them(compiled: tuple[FakeServer, Any]) -> None:
    """An entry type with more than StringEntry's three slots is built through its __init__
    (a default_factory must give each entry its own list)."""
    srv, _ = compiled
    fast = fastpath._ext.FastPath(
        srv.keyspace, srv.strings, srv.cmdstats, _WiderEntry, CommandStat, 1 << 16, 64
    )
    assert run(fast, cmd("SET", "a", "1") + cmd("SET", "b", "2"))[1] == 2
    a, b = srv.keyspace.lookup(b"a"), srv.keyspace.lookup(b"b")
    assert isinstance(a, _WiderEntry) and isinstance(b, _WiderEntry)
    assert (a.value, a.extra, b.value) == (b"1", [], b"2") and a.extra is not b.extra


class _Chunk:
    expire_at: int | None = None
    type_name = "kvchunk"

    def memory_usage(self) -> int:
        return 1


def test_reset_then_multibulk_get_needs_auth(start: Callable[..., RunningServer]) -> None:
    """An authenticated client pipelines a quoted inline RESET (which drops its authentication,
    a password being set; the quotes send it through the Python decoder) and a multibulk GET in
    one write: the GET must answer NOAUTH, as on the Python path, not the value."""
    srv = start(requirepass="pw")
    session = Session(srv.port)
    assert session.send(cmd("AUTH", "pw") + cmd("SET", "k", "v")) == b"+OK\r\n+OK\r\n"
    session.sock.sendall(b'"RESET"\r\n' + cmd("GET", "k"))
    got = b""
    deadline = time.monotonic() + 10
    while got.count(b"\r\n") < 2 and time.monotonic() < deadline:
        got += session.sock.recv(1000)
    session.close()
    assert got.startswith(b"+RESET\r\n-NOAUTH"), got


@pytest.mark.parametrize("first", [cmd("GET", "k"), b"'GET' k\r\n"])
def test_commands_before_unbalanced_quotes_still_run(
    start: Callable[..., RunningServer], first: bytes
) -> None:
    """As Redis: the commands before a malformed inline line are answered, then the protocol
    error closes the connection (the Python path used to drop them)."""
    srv = start()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(first + b'"\r\n')
        got = b""
        while chunk := sock.recv(1000):
            got += chunk
    assert got == b"$-1\r\n-ERR Protocol error: unbalanced quotes in request\r\n"


def test_failing_command_is_left_to_python(
    compiled: tuple[FakeServer, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that raises inside the compiled path (here the string store's _bind) is
    reported through sys.unraisablehook and the run stops before it: the replies and counters
    of the commands before it are kept (they were lost, and the run raised SystemError)."""
    srv, fast = compiled
    reported: list[Any] = []

    def broken(*args: Any) -> None:
        raise RuntimeError("bind failed")

    monkeypatch.setattr(srv.strings, "_bind", broken)
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    head = cmd("GET", "a") + cmd("PING")
    expected = (len(head), 2, "PING", None, b"$-1\r\n+PONG\r\n")
    assert run(fast, head + cmd("SET", "new", "v")) == expected
    assert [str(r.exc_value) for r in reported] == ["bind failed"]
    assert srv.keyspace.misses == 1 and "SET" not in srv.cmdstats.commands
    assert srv.cmdstats.commands["GET"].calls == srv.cmdstats.commands["PING"].calls == 1


def test_failing_store_answers_as_python_does(
    start: Callable[..., RunningServer], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same failure end to end: both paths answer the commands before it and an internal
    error for the SET, and the connection stays usable."""
    srv = start()
    reported: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    def broken(*args: Any) -> None:
        raise RuntimeError("bind failed")

    srv.call(lambda: setattr(srv.server.strings, "_bind", broken))
    session = Session(srv.port)
    got = session.send(cmd("GET", "a") + cmd("PING") + cmd("SET", "new", "v") + cmd("PING"))
    session.close()
    assert got == b"$-1\r\n+PONG\r\n-ERR internal error in 'set': bind failed\r\n+PONG\r\n"
    # reported by the compiled path (once per run that reached the SET), never by Python's
    assert {str(r.exc_value) for r in reported} == (
        {"bind failed"} if path == "compiled" else set()
    )


def test_protocol_error_waits_for_an_async_command(start: Callable[..., RunningServer]) -> None:
    """An async command (KV.DEL) is running when a malformed frame arrives behind it and a
    GET: as Redis, every command before the malformed frame is answered, in order, then the
    protocol error closes the connection (its reply and the GET's used to be dropped)."""
    srv = start()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(cmd("KV.DEL", "ns", "ab") + cmd("GET", "k") + b"*1\r\n$x\r\n")
        got = b""
        while chunk := sock.recv(1000):
            got += chunk
    assert got == b":0\r\n$-1\r\n-ERR Protocol error: invalid bulk length\r\n"
