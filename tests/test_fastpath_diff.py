"""Differential test of the compiled small-command path against the Python path (hypothesis).

Scenario: two servers, one with the compiled path and one with ``fast-path no``, get the same
random pipelines — hot commands (GET, SET, EXISTS, PING, ECHO in any case, inline or
multibulk; KV.MATCH and KV.MGET over a stored chain, whole, cut, with misses, option words and
bad hashes), commands with options, TTLs (live and already expired), other commands, wrong
arity, quoted inline commands, HELLO 2/3, large values, maxmemory with ``noeviction`` or
``allkeys-lru``, sometimes a malformed frame at the end (the server closes the connection) —
cut at the same random offsets. Every reply byte and the observable state afterwards (keyspace
hits and misses, expired and evicted keys, LRU order, used bytes, commands processed, INFO
commandstats calls/failed/rejected and errorstats; per chunk its hits, pins and LRU order, and
the tiers' counters) must be identical.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.server import fastpath
from tests.conftest import RunningServer
from tests.test_fastpath import END, END_REPLY, cmd, state

KEYS = [b"a", b"b", b"c", b"k\xff", b"t"]
NAMES = {"GET": ["GET", "get", "Get"], "SET": ["SET", "set"], "EXISTS": ["EXISTS", "exists"]}
#: inline commands: plain words (the compiled scanner's) or quoted (the Python decoder's)
INLINE = [b"GET a\r\n", b"SET b inl\n", b"EXISTS a b\r\n", b'SET c "q v"\r\n', b"PING\r\n",
          b"\r\n", b"  get   b \r\n"]  # fmt: skip
#: wrong arity, unknown commands
WRONG = [cmd("GET"), cmd("GET", "a", "b"), cmd("SET", "a"), cmd("ECHO"), cmd("PING", "a", "b"),
         cmd("NOPE", "a"), cmd("EXISTS")]  # fmt: skip
#: other commands on the same keys; a large value (the tiers')
OTHERS = [cmd("DEL", "a"), cmd("EXPIRE", "b", "1000"), cmd("PERSIST", "b"), cmd("STRLEN", "c"),
          cmd("SET", "big", b"y" * 70_000), cmd("GET", "big")]  # fmt: skip


@st.composite
def one_command(draw: st.DrawFn) -> bytes:
    key = st.sampled_from(KEYS)
    value = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"x" * 3000, b"\r\n"]))
    kind = draw(st.integers(0, 18))
    if kind <= 3:
        return cmd(draw(st.sampled_from(NAMES["GET"])), draw(key))
    if kind <= 6:
        return cmd(draw(st.sampled_from(NAMES["SET"])), draw(key), draw(value))
    if kind == 7:
        keys = draw(st.lists(key, min_size=1, max_size=5))
        return cmd(draw(st.sampled_from(NAMES["EXISTS"])), *keys)
    if kind == 8:
        return draw(st.sampled_from([cmd("PING"), cmd("ping", "hi"), cmd("ECHO", b"\x00\r\n")]))
    if kind == 9:
        return draw(st.sampled_from(INLINE))
    if kind == 10:  # options, TTLs
        opt = draw(st.sampled_from([["PX", "100000"], ["PXAT", "1"], ["NX"], ["XX"], ["GET"]]))
        return cmd("SET", draw(key), draw(value), *opt)
    if kind == 11:
        return draw(st.sampled_from(WRONG))
    if kind == 12:
        return draw(st.sampled_from(OTHERS))
    if kind == 13:
        return draw(st.sampled_from([cmd("HELLO", "3"), cmd("HELLO", "2")]))
    if kind == 14:
        return cmd("KV.PUT", "ns", "ab", "", "payload") + cmd("GET", "kv:ns:ab")
    if kind == 15:  # a chain: ab <- cd <- ef
        return cmd("KV.PUT", "ns", "cd", "ab", "p2") + cmd("KV.PUT", "ns", "ef", "cd", b"x" * 900)
    if kind in (16, 17):
        hashes = draw(st.lists(st.sampled_from(CHAIN_HASHES), min_size=1, max_size=6))
        name = draw(st.sampled_from(["KV.MATCH", "kv.match", "KV.MGET", "kv.mget"]))
        return cmd(name, "ns", *hashes)
    return cmd("CONFIG", "SET", "maxmemory-policy",
               draw(st.sampled_from(["noeviction", "allkeys-lru"])))  # fmt: skip


#: hashes of the chain (kind 15), a miss, option words, a bad hash
CHAIN_HASHES = [b"ab", b"cd", b"ef", b"zz", b"WITHTIERS", b"prefetch", b"", b"h" * 65]
MALFORMED = [b"*1\r\n$x\r\n", b"*2\r\n$3\r\nGET\r\n$1\r\nab\r\n", b"*1\r\n+GET\r\n", b'"\r\n']


@st.composite
def pipeline(draw: st.DrawFn) -> tuple[bytes, list[int], bool]:
    data = b"".join(draw(st.lists(one_command(), min_size=1, max_size=25)))
    broken = draw(st.integers(0, 9)) == 0
    if broken:
        data += draw(st.sampled_from(MALFORMED))
    cuts = draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=3))
    return data, sorted(set(cuts)), broken


def exchange(port: int, data: bytes, cuts: list[int], broken: bool) -> bytes:
    """Send ``data`` in pieces at ``cuts``; the replies up to the END marker, or to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        last = 0
        for cut in [*cuts, len(data)]:
            sock.sendall(data[last:cut])
            last = cut
        if not broken:
            sock.sendall(END)
        got = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not broken and got.endswith(END_REPLY):
                return got[: -len(END_REPLY)]
            chunk = sock.recv(1 << 20)
            if not chunk:
                return got
            got += chunk
        raise AssertionError(got[-200:])


def observable(srv: RunningServer) -> dict[str, Any]:
    """:func:`state` without the per-connection entries (connections come and go here), and
    the KV store's view of the chunks of this example."""
    seen = state(srv)
    del seen["clients"]

    def chunks() -> Any:
        store = srv.server.store
        ours = (r for r in store.index if r.alive and r.key.namespace.isdigit())  # not SET's
        live = sorted(ours, key=lambda r: r.last_access)
        counters = {n: c.as_dict() for n, c in store.state.counters.items()}
        return [(r.key.hash, r.hits, r.pins, sorted(r.tiers)) for r in live], counters

    seen["chunks"], seen["tiers"] = srv.call(chunks)
    return seen


def reset(srv: RunningServer) -> None:
    """Back to an empty server, so that every example starts from the same state."""
    s = srv.server

    def clear() -> None:
        s.keyspace.flush()
        s.keyspace.hits = s.keyspace.misses = s.keyspace.expired_keys = 0
        s.strings.evicted_keys = 0
        s.cmdstats.reset()
        s.stats.total_commands_processed = s.stats.total_error_replies = 0
        s.config.values["maxmemory-policy"] = "allkeys-lru"

    srv.call(clear)


def test_random_pipelines_same_on_both_paths(make_server: Callable[..., RunningServer]) -> None:
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    compiled = make_server(maxmemory="20000")
    python = make_server(maxmemory="20000", fast_path="no")
    fresh = itertools.count()
    for srv in (compiled, python):  # no active expiry: keys expire when a command looks at them
        srv.call(lambda s=srv: setattr(s.server.keyspace, "expire_cycle", lambda: 0))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(pipeline())
    def check(case: tuple[bytes, list[int], bool]) -> None:
        data, cuts, broken = case
        # a fresh chunk namespace per example (of the same length: the cuts stay put), so that
        # a chunk retired by the previous reset is never written again while it goes
        space = b"%02d" % (next(fresh) % 100)
        data = data.replace(b"$2\r\nns\r\n", b"$2\r\n%b\r\n" % space)
        reset(compiled)
        reset(python)
        assert exchange(compiled.port, data, cuts, broken) == exchange(
            python.port, data, cuts, broken
        )
        assert observable(compiled) == observable(python)

    check()
