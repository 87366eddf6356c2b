"""KV.MATCH and KV.MGET on the compiled path (issue 31) against the Python handlers.

The Python handlers (``commands/kv.py``) are the reference. Scenario of the differential test:
two servers, one compiled and one with ``fast-path no``, get the same script — a chain of
chunks stored, matched whole, in part and not at all, in every letter case and inline, with
option words, invalid namespaces and hashes, a chunk with a TTL in the chain, more hashes than
``max-chain-chunks``; read back with KV.MGET (hits, misses, RESP2 and RESP3, a payload too large
for the compiled path) — and must answer byte for byte the same and end in the same state:
per-record hits, pins and LRU order, per-tier counters, keyspace hits and misses, INFO
commandstats, commands processed, the client's last command. The direct tests run the compiled
routine inside a real server and check where it hands over: before any side effect.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvstrata.chunks import ChunkKey
from kvstrata.server import fastpath
from tests.conftest import RunningServer
from tests.fakes import cmd, wait_for
from tests.test_fastpath import Session, Spy, state

CHAIN = [b"c%d" % i for i in range(6)]


def payload(h: bytes, size: int = 1000) -> bytes:
    return (h * (size // len(h) + 1))[:size]


def closed(srv: RunningServer, session: Session) -> None:
    """Close ``session`` and wait until the server has dropped its connection (``state``
    lists the clients: one still closing would differ from the same state a moment later)."""
    session.close()
    gone = wait_for(lambda: not srv.call(lambda: len(srv.server.clients)))
    assert gone, "the closed session is still listed"


def kv_state(srv: RunningServer) -> dict[str, Any]:
    """What the KV store shows of the commands: records, tier counters, arena stats."""
    s = srv.server

    def read() -> dict[str, Any]:
        store = s.store
        records = sorted(store.index, key=lambda r: (r.last_access, r.key.hash))
        return {
            "records": [
                (r.key.namespace, r.key.hash, r.hits, r.pins, r.leases, sorted(r.tiers), r.alive)
                for r in records
            ],
            "lru": [r.key.hash for r in records],
            "counters": {n: c.as_dict() for n, c in store.state.counters.items()},
            "dram": asdict(store.state.dram.stats),
        }

    return {**state(srv), **dict(srv.call(read))}


def put_chain(ns: str = "ns") -> bytes:
    out, parent = b"", b""
    for h in CHAIN:
        out += cmd("KV.PUT", ns, h, parent, payload(h))
        parent = h
    return out


def script() -> list[bytes]:
    """Steps sent one after the other (the commands after one the compiled path hands over
    are decoded by Python with it, so most steps hold one command), then long pipelines."""
    c = CHAIN
    setup = put_chain() + cmd("KV.PUT", "ns", "t0", "c5", "ttl", "TTL", "100000")
    setup += cmd("KV.PUT", "ns", "big", "", b"B" * 70_000)
    single = [
        cmd("KV.MATCH", "ns", *c), cmd("kv.match", "ns", *c[:3], "zz", *c[3:]),
        cmd("KV.MATCH", "ns", "zz"), cmd("Kv.Match", "ns", c[1], c[2]), b"KV.MATCH ns c0 c1\r\n",
        cmd("KV.MATCH", "ns", *c, "t0"), cmd("KV.MATCH", "ns", *c, "WITHTIERS"),
        cmd("KV.MATCH", "ns", "c0", "prefetch"), cmd("KV.MATCH", "n s", "c0"),
        cmd("KV.MATCH", "ns", ""), cmd("KV.MATCH", "ns", b"x" * 65), cmd("KV.MATCH", "ns"),
        cmd("KV.MATCH", "other", *c), cmd("KV.MATCH", "ns", "WITHTIERS"),
        cmd("KV.MGET", "ns", *c), cmd("kv.mget", "ns", "c0", "zz", "c5", "zz"),
        cmd("KV.MGET", "ns", "zz"), cmd("KV.MGET", "ns", "c0", "t0"), b"KV.MGET ns c1 c2\r\n",
        cmd("KV.MGET", "ns", "big", "c0"), cmd("KV.MGET", "ns", "c1", "big"),
        cmd("KV.MGET", "n s", "a"), cmd("KV.MGET", "ns", ""), cmd("KV.GET", "ns", "c3"),
        cmd("HELLO", "3"), cmd("KV.MGET", "ns", "c0", "zz"), cmd("KV.MATCH", "ns", *c),
        cmd("HELLO", "2"), cmd("CONFIG", "SET", "max-chain-chunks", "3"),
        cmd("KV.MATCH", "ns", *c), cmd("KV.MGET", "ns", *c), cmd("KV.MATCH", "ns", *c[:3]),
        cmd("KV.MGET", "ns", *c[:3]), cmd("CONFIG", "SET", "max-chain-chunks", "65536"),
    ]  # fmt: skip
    long = b"".join(
        cmd("KV.MATCH", "ns", *c[: i % 6 + 1]) + cmd("KV.MGET", "zz", c[i % 6])[: 99 * (i % 9 == 0)]
        for i in range(400)
    )  # fmt: skip
    tail = cmd("KV.DEL", "ns", "c3") + cmd("KV.MATCH", "ns", *c) + cmd("KV.MGET", "ns", *c)
    return [setup, *single, long, long.replace(b"c1", b"c9") + cmd("KV.MATCH", "ns"), tail]


def observe(srv: RunningServer) -> tuple[list[bytes], dict[str, Any]]:
    session = Session(srv.port)
    replies = [session.send(step) for step in script()]
    closed(srv, session)
    # the state is read once the server has seen the close (its client table is empty): a
    # loaded machine may run the read before the loop handles the disconnect
    deadline = time.monotonic() + 10
    while srv.call(lambda: len(srv.server.clients)):
        assert time.monotonic() < deadline, "the server did not see the session close in 10 s"
        time.sleep(0.01)
    return replies, kv_state(srv)


def test_both_paths_same_replies_and_state(make_server: Callable[..., RunningServer]) -> None:
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    compiled, python = make_server(), make_server(fast_path="no")
    spy = Spy(compiled.server.fastpath)
    compiled.call(lambda: setattr(compiled.server, "fastpath", spy))
    got = observe(compiled)
    want = observe(python)
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert a == b, f"step {i}"
    assert got[1] == want[1]
    replies, st = got
    assert spy.ran > 850  # most of it ran compiled
    assert replies[1:5] == [b":6\r\n", b":3\r\n", b":0\r\n", b":2\r\n"]  # not from a root
    assert replies[15] == b"*6\r\n" + b"".join(b"$1000\r\n" + payload(h) + b"\r\n" for h in CHAIN)
    assert replies[16] == b"*4\r\n$1000\r\n%b\r\n$-1\r\n$1000\r\n%b\r\n$-1\r\n" % (
        payload(b"c0"),
        payload(b"c5"),
    )
    assert replies[26] == b"*2\r\n$1000\r\n%b\r\n_\r\n" % payload(b"c0")  # RESP3
    assert replies[30].startswith(b"-ERR too many chunks")
    assert all(r[3] == 0 for r in st["records"])  # no pin outlives its reply
    assert st["counters"]["dram"]["hits"] > 20 and st["cmdstats"]["KV.MATCH"][0] > 800


@pytest.fixture
def kv_server(make_server: Callable[..., RunningServer]) -> RunningServer:
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    srv = make_server()
    session = Session(srv.port)
    session.send(put_chain())
    closed(srv, session)
    return srv


def run_in(srv: RunningServer, data: bytes, resp3: bool = False) -> tuple[Any, ...]:
    """The compiled routine of ``srv`` on ``data``, on the server's loop."""

    def go() -> tuple[Any, ...]:
        out: list[bytes] = []
        pos, ran, last, _slow = srv.server.fastpath.run(
            bytearray(data), 0, len(data), out, resp3, 1 << 20, 1 << 20, 1e9, 1 << 20
        )
        return pos, ran, fastpath.NAMES[last] if ran else None, b"".join(out)

    return tuple(srv.call(go))


def test_bound_with_the_cheap_probes(kv_server: RunningServer) -> None:
    """On this CPython a ChunkKey is built from its two slots and hashes as the tuple of its
    fields, so the compiled path's index probes run no Python code (else it still answers
    correctly, through ChunkKey's own __init__ and __hash__)."""
    assert kv_server.call(kv_server.server.fastpath.kv_info) == (1, 1, 1, 0)


def test_match_and_mget_run_compiled(kv_server: RunningServer) -> None:
    data = cmd("KV.MATCH", "ns", *CHAIN) + cmd("KV.MGET", "ns", "c1", "nope")
    before = kv_state(kv_server)
    pos, ran, last, out = run_in(kv_server, data)
    assert (pos, ran, last) == (len(data), 2, "KV.MGET")
    assert out == b":6\r\n*2\r\n$1000\r\n" + payload(b"c1") + b"\r\n$-1\r\n"
    after = kv_state(kv_server)
    assert after["lru"][-6:] == [b"c0", b"c2", b"c3", b"c4", b"c5", b"c1"]  # matched, then read
    assert (after["hits"], after["misses"]) == (before["hits"] + 1, before["misses"] + 1)
    dram, b_dram = after["counters"]["dram"], before["counters"]["dram"]
    assert (dram["hits"], dram["bytes_out"]) == (b_dram["hits"] + 1, b_dram["bytes_out"] + 1000)
    assert dram["misses"] == b_dram["misses"] + 1
    rec = {r[1]: r for r in after["records"]}
    assert (rec[b"c1"][2], rec[b"c1"][3]) == (1, 0)  # one hit, no pin left


def _with_ttl(srv: RunningServer, h: bytes, expire_at: int) -> None:
    srv.call(lambda: setattr(srv.server.store.index.get(ChunkKey("ns", h)), "expire_at", expire_at))


@pytest.mark.parametrize(
    "data",
    [
        cmd("KV.MATCH", "ns", "c0", "WITHTIERS"),
        cmd("KV.MATCH", "ns", "c0", "c1", "prefetch"),
        cmd("KV.MATCH", "ns", "c0", "WITHTEIRS"),  # one edit from an option: Python warns
        cmd("KV.MATCH", "ns", "c0", "prefetc"),
        cmd("KV.MATCH", "ns", "c0", "xWITHTIERS"),
        cmd("KV.MATCH", "ns", "c0", b"\xffITHTIERS"),
        cmd("KV.MATCH", "n s", "c0"),
        cmd("KV.MATCH", "ns", "c0", ""),
        cmd("KV.MATCH", "ns", "c0", b"h" * 65),
        cmd("KV.MATCH", "ns", *CHAIN[:2], "ttl"),  # c2 gets an expired TTL below
        cmd("KV.MGET", "ns", "c0", "ttl"),
        cmd("KV.MGET", "ns", "c0", "big"),
        cmd("KV.MGET", "ns"),
        cmd("KV.MATCH", "ns", *[b"h%d" % i for i in range(1100)]),  # more than MAX_ARGV
    ],
)
def test_hands_over_before_any_side_effect(kv_server: RunningServer, data: bytes) -> None:
    srv = kv_server
    session = Session(srv.port)
    session.send(
        cmd("KV.PUT", "ns", "ttl", "c1", "x") + cmd("KV.PUT", "ns", "big", "", b"B" * 70_000)
    )
    closed(srv, session)
    _with_ttl(srv, b"ttl", int(time.time() * 1000) - 1000)  # expired: Python deletes it
    before = kv_state(srv)
    assert run_in(srv, data) == (0, 0, None, b"")
    assert kv_state(srv) == before


def test_short_match_with_a_shared_tier_goes_to_python(kv_server: RunningServer) -> None:
    """With a shared tier (s3) a short local match may be extended there (I/O): Python's; a
    full match is answered compiled. KV.MGET, whose first step asks s3, is always Python's."""
    srv = kv_server
    fast = srv.server.fastpath
    store = srv.server.store
    state_ = store.state

    def rebind(remote: bool) -> None:
        fast.bind_kv(
            state_.index._records, ChunkKey, type(store.index.get(ChunkKey("ns", b"c0"))), store,
            fastpath.NOT_NOW, state_.dram, state_.dram._chunks, state_.tiers, remote,
            srv.server.config.values,
        )  # fmt: skip

    srv.call(lambda: rebind(True))
    assert run_in(srv, cmd("KV.MATCH", "ns", *CHAIN))[1:3] == (1, "KV.MATCH")
    assert run_in(srv, cmd("KV.MATCH", "ns", *CHAIN, "zz"))[1] == 0
    assert run_in(srv, cmd("KV.MGET", "ns", "c0"))[1] == 0
    srv.call(lambda: rebind(False))
    assert run_in(srv, cmd("KV.MATCH", "ns", *CHAIN, "zz"))[1:] == (1, "KV.MATCH", b":6\r\n")


def test_not_bound_while_tracing(make_server: Callable[..., RunningServer], tmp_path: Path) -> None:
    """With ``trace-file`` every KV command goes through the Python handlers, which record it."""
    if not fastpath.AVAILABLE:
        pytest.skip("kvstrata.server._fastpath is not built (python3 setup.py build_ext)")
    trace = tmp_path / "trace.jsonl"
    srv = make_server(trace_file=str(trace))
    session = Session(srv.port)
    session.send(put_chain())
    assert run_in(srv, cmd("KV.MATCH", "ns", *CHAIN))[1] == 0
    assert session.send(cmd("KV.MATCH", "ns", *CHAIN)) == b":6\r\n"
    closed(srv, session)
    srv.call(lambda: srv.server.tracer.close())
    assert '"match"' in trace.read_text()


def test_a_failing_read_is_reported(
    kv_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV.MGET whose read raises inside the compiled path is reported (sys.unraisablehook)
    and left to the Python path, the commands before it answered."""
    srv = kv_server
    reported: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    def broken(ns: str, h: bytes) -> Any:
        raise RuntimeError("read failed")

    srv.call(lambda: setattr(srv.server.store, "get_now", broken))
    head = cmd("KV.MATCH", "ns", "c0")
    assert run_in(srv, head + cmd("KV.MGET", "ns", "c0")) == (len(head), 1, "KV.MATCH", b":1\r\n")
    assert [str(r.exc_value) for r in reported] == ["read failed"]


def test_a_declined_read_is_answered_by_python(
    kv_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should ``KVStore.get_now`` ever decline a chunk the first pass found servable (its
    conditions changed without the compiled path's), the command is reported and answered by
    the Python path: the right bytes, never a partial reply."""
    srv = kv_server
    reported: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    srv.call(lambda: setattr(srv.server.store, "get_now", lambda ns, h: fastpath.NOT_NOW))
    session = Session(srv.port)
    got = session.send(cmd("KV.MGET", "ns", "c0", "c1"))
    closed(srv, session)
    assert got == b"*2\r\n" + b"".join(b"$1000\r\n" + payload(h) + b"\r\n" for h in CHAIN[:2])
    assert [type(r.exc_value) for r in reported] == [RuntimeError]


@pytest.mark.parametrize("last", [b"WXTHTXERS", b"PREFETCHED", b"cccccccc", b"PRE-FETCH!"])
def test_a_hash_two_edits_from_an_option_runs_compiled(
    kv_server: RunningServer, last: bytes
) -> None:
    """Only a last hash one edit from WITHTIERS/PREFETCH goes to Python (which warns)."""
    data = cmd("KV.MATCH", "ns", "c0", last)
    assert run_in(kv_server, data) == (len(data), 1, "KV.MATCH", b":1\r\n")


def test_option_like_last_hashes_match_the_python_check(kv_server: RunningServer) -> None:
    """The compiled path hands KV.MATCH over exactly when the Python handler would warn about
    its last hash (``commands/_near.near_option``): random words near WITHTIERS/PREFETCH."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvstrata.server.commands._near import near_option

    def mutate(word: bytes, edits: list[tuple[int, int, int]]) -> bytes:
        out = bytearray(word)
        for kind, at, byte in edits:
            at %= len(out) + 1
            if kind == 0 and at < len(out):
                out[at] = byte  # substitute
            elif kind == 1:
                out.insert(at, byte)
            elif kind == 2 and at < len(out):
                del out[at]
            elif kind == 3 and at + 1 < len(out):
                out[at], out[at + 1] = out[at + 1], out[at]  # swap neighbours
        return bytes(out)

    letters = st.sampled_from(b"WITHERSPFCwithersfc-\xff")
    edit = st.tuples(st.integers(0, 3), st.integers(0, 10), letters)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from([b"WITHTIERS", b"PREFETCH", b"withtiers"]), st.lists(edit, max_size=2))
    def check(word: bytes, edits: list[tuple[int, int, int]]) -> None:
        last = mutate(word, edits)
        if not 1 <= len(last) <= 64:
            return
        data = cmd("KV.MATCH", "ns", "c0", last)
        ran = run_in(kv_server, data)[1]
        python_warns = 7 <= len(last) <= 10 and near_option(last, (b"WITHTIERS", b"PREFETCH"))
        assert ran == (0 if python_warns or last.upper() in (b"WITHTIERS", b"PREFETCH") else 1)

    check()
