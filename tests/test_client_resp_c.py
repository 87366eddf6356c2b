"""The compiled whole-reply parser (``_cresp.parse_reply``) against the Python ReplyReader: the
same values of the same types for every reply, whole or split anywhere, and the replies it does
not take (other types, odd headers, partial input, large bulks, caller buffers) left to Python
with the same results and errors."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvstrata.clients import resp
from kvstrata.clients.resp import ReplyReader
from kvstrata.protocol.errors import ProtocolError, RespError
from kvstrata.protocol.frames import Simple
from tests.test_client_resp import CASES


@pytest.fixture(params=["c", "python"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "c":
        assert resp._c_parse_reply is not None  # setup.py builds it here
    else:
        monkeypatch.setattr(resp, "_c_parse_reply", None)
    yield request.param


def typed(v: Any) -> Any:
    """A value with the type of every part, to compare Simple/bytes/bytearray/int/... exactly."""
    if isinstance(v, list):
        return ("list", [typed(x) for x in v])
    if isinstance(v, dict):
        return ("dict", {k: typed(x) for k, x in v.items()})
    if isinstance(v, RespError):
        return (type(v).__name__, str(v))
    return (type(v).__name__, v)


def parse(stream: bytes, cut: int | None = None, big: int = 64 * 1024) -> list[Any]:
    got: list[Any] = []
    reader = ReplyReader(got.append, big=big, bufsize=256)
    if cut is None:
        reader.feed(stream)
    else:
        reader.feed(stream[:cut])
        reader.feed(stream[cut:])
    assert reader.idle
    return [typed(v) for v in got]


def random_reply(rng: random.Random, depth: int = 0) -> bytes:
    kind = rng.choice("$$::+_*-*" if depth < 3 else "$:+_")
    if kind == "$":
        n = rng.choice((-1, 0, 1, 5, 300))
        return b"$-1\r\n" if n < 0 else b"$%d\r\n%s\r\n" % (n, rng.randbytes(n))
    if kind == ":":
        return b":%d\r\n" % rng.choice((0, -7, 2**40, 10**17, -(10**17)))
    if kind == "+":
        return b"+%s\r\n" % rng.choice((b"OK", b"exists", b"busy", b""))
    if kind == "-":
        return b"-NOLEASE no such lease\r\n"
    if kind == "_":
        return b"_\r\n"
    n = rng.choice((-1, 0, 1, 4, 9))
    if n < 0:
        return b"*-1\r\n"
    return b"*%d\r\n" % n + b"".join(random_reply(rng, depth + 1) for _ in range(n))


def mreserve_reply(n: int) -> bytes:
    """KV.MRESERVE's reply shape: a lease id and a handle (or exists/busy) per chunk."""
    out = [b"*2\r\n$32\r\n" + b"f" * 32 + b"\r\n*%d\r\n" % n]
    for i in range(n):
        if i % 7 == 3:
            out.append(b"+exists\r\n")
        else:
            handle = b"*4\r\n$10\r\nkvstrata-1\r\n:%d\r\n:1048576\r\n$8\r\nabcdefgh\r\n"
            out.append(handle % (i << 20))
    return b"".join(out)


def test_the_compiled_parser_takes_whole_plain_replies() -> None:
    fn = resp._c_parse_reply
    assert fn is not None
    wire = bytearray(mreserve_reply(5) + b"+OK\r\n")
    value, end = fn(wire, 0, len(wire), 65536, Simple)
    assert end == len(wire) - 5 and value[0] == b"f" * 32
    assert value[1][0] == [b"kvstrata-1", 0, 1048576, b"abcdefgh"]
    assert type(value[1][3]) is Simple and value[1][3] == b"exists"
    assert type(fn(wire, end, len(wire), 65536, Simple)[0]) is Simple
    for partial in range(1, end):  # incomplete: left to the Python reader
        assert fn(wire, 0, partial, 65536, Simple) is None
    others = (b"-ERR x\r\n", b"%1\r\n:1\r\n:2\r\n", b",1.5\r\n", b"*1\r\n#t\r\n", b":1_0\r\n",
              b":12345678901234567890\r\n", b"$5\r\nabcdeXY", b"$4\r\nab\r\n")  # fmt: skip
    for other in others:
        assert fn(bytearray(other), 0, len(other), 65536, Simple) is None, other
    assert fn(bytearray(b"$3\r\nabc\r\n"), 0, 9, 3, Simple) is None  # a bulk of >= big bytes


def test_same_values_as_python_every_case_and_split(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = b"".join(w for w, _ in CASES) + mreserve_reply(9)
    compiled = [parse(stream, cut) for cut in range(1, len(stream))]
    monkeypatch.setattr(resp, "_c_parse_reply", None)
    want = parse(stream)
    assert len(want) == len(CASES) + 1
    for cut in range(1, len(stream)):
        assert compiled[cut - 1] == want == parse(stream, cut), cut


def test_random_replies_match_the_python_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(31)
    stream = b"".join(random_reply(rng) for _ in range(300)) + mreserve_reply(64)
    compiled = parse(stream)
    cuts = [rng.randrange(1, len(stream)) for _ in range(40)]
    compiled_cut = [parse(stream, c) for c in cuts]
    small_big = parse(stream, big=100)  # bulks of 300 bytes are received in place then
    monkeypatch.setattr(resp, "_c_parse_reply", None)
    assert parse(stream) == compiled and len(compiled) == 301
    assert [parse(stream, c) for c in cuts] == compiled_cut
    assert parse(stream, big=100) == small_big
    assert all(got == compiled for got in compiled_cut)


def test_malformed_replies_raise_the_same_errors(parser: str) -> None:
    for bad in (b"$5\r\nabcdeXY\r\n", b"*1\r\n:x\r\n", b"?1\r\n", b"#x\r\n"):
        with pytest.raises(ProtocolError):
            parse(bad)


def test_a_caller_buffer_still_receives_its_bulk_in_place(parser: str) -> None:
    out = np.zeros(8, np.uint8)
    pending = [out]
    got: list[Any] = []

    def on_reply(v: Any) -> None:
        got.append(v)
        if pending:
            pending.pop(0)

    reader = ReplyReader(on_reply, lambda: pending[0] if pending else None)
    reader.feed(b"$8\r\n12345678\r\n:5\r\n")
    assert bytes(out) == b"12345678" and isinstance(got[0], memoryview) and got[1] == 5


def test_mreserve_grant_fast_path_matches_parse_handle() -> None:
    """``commands._mreserve`` reads the common handle shape directly: the same grant as
    ``parse_handle`` for it and for the other shapes (a missing or null instance, bytes
    numbers), and the states of the chunks without a slot."""
    from kvstrata.clients import commands
    from kvstrata.clients.results import parse_handle

    entries: list[Any] = [
        [b"kvstrata-1", 0, 4096, b"abc"],
        Simple(b"exists"),
        [b"kvstrata-1", 4096, 8192],
        [b"kvstrata-2", b"12288", b"4096", None],
        Simple(b"busy"),
        [b"kvstrata-1", 16384, 4096, b""],
    ]
    grant = commands._mreserve([b"lease-1", entries])
    assert grant.states == ("reserved", "exists", "reserved", "reserved", "busy", "reserved")
    want = [None if isinstance(e, Simple) else parse_handle(e) for e in entries]
    assert list(grant.handles) == want
    assert grant.handles[0] is not None and grant.handles[0].instance == "abc"
    assert grant.handles[3] is not None and grant.handles[3].offset == 12288
