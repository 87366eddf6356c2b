"""Request decoder: the C and pure-Python scanners share one contract, checked at every split."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.protocol import decoder
from kvstrata.protocol.encoder import encode_command
from kvstrata.protocol.errors import ProtocolError

PARSERS = [pytest.param(decoder.py_parse_requests, id="python")]
if decoder.c_parse_requests is not None:
    PARSERS.append(pytest.param(decoder.c_parse_requests, id="c"))

BIG = 1 << 16
MAX_BULK = 1 << 30
MAX_ARGS = 1 << 20


def encode(cmds: list[list[bytes]]) -> bytes:
    out: list[bytes] = []
    for cmd in cmds:
        encode_command(cmd, out)
    return b"".join(bytes(p) for p in out)


def drain(parse, data: bytes, cuts: list[int]) -> list[list[bytes]]:
    """Feed ``data`` in pieces (cut at ``cuts``) as a connection would; collect commands."""
    buf = bytearray()
    pos = 0
    got: list[list[bytes]] = []
    prev = 0
    for cut in [*cuts, len(data)]:
        buf += data[prev:cut]
        prev = cut
        while True:
            cmds, pos, state = parse(buf, pos, len(buf), BIG, MAX_BULK, MAX_ARGS)
            got.extend(cmds)
            if state == decoder.INLINE:
                args, pos2 = decoder.parse_inline(buf, pos, len(buf))
                if args is None:
                    break
                pos = pos2
                if args:
                    got.append(args)
                continue
            assert state is None
            break
    assert pos == len(buf)
    return got


args_st = st.lists(st.binary(min_size=0, max_size=40), min_size=1, max_size=6)


@pytest.mark.parametrize("parse", PARSERS)
@settings(max_examples=150, deadline=None)
@given(cmds=st.lists(args_st, min_size=1, max_size=5), data=st.data())
def test_round_trip_any_split(parse, cmds, data) -> None:
    wire = encode(cmds)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=4)))
    assert drain(parse, wire, cuts) == cmds


@pytest.mark.parametrize("parse", PARSERS)
def test_every_split_offset(parse) -> None:
    cmds = [[b"SET", b"key", b"va\r\nlue"], [b"GET", b"key"], [b"PING"], [b"ECHO", b""]]
    wire = encode(cmds)
    for cut in range(len(wire) + 1):
        assert drain(parse, wire, [cut]) == cmds, cut


@pytest.mark.parametrize("parse", PARSERS)
def test_large_bulk_stops_scan(parse) -> None:
    payload = b"p" * BIG
    wire = encode([[b"PING"], [b"KV.PUT", b"ns", b"h", b"", payload, b"NX"]])
    cmds, pos, state = parse(bytearray(wire), 0, len(wire), BIG, MAX_BULK, MAX_ARGS)
    assert cmds == [[b"PING"]]
    assert isinstance(state, tuple)
    state = decoder.BigBulk(*state)
    assert state.args == [b"KV.PUT", b"ns", b"h", b""]
    assert state.remaining == 2 and state.length == BIG
    assert wire[state.data_pos : state.data_pos + BIG] == payload
    assert pos == len(encode([[b"PING"]]))


@pytest.mark.parametrize("parse", PARSERS)
def test_continue_after_large_bulk(parse) -> None:
    tail = encode([[b"x"]])[4:]  # "$1\r\nx\r\n"
    args: list[bytes] = [b"A"]
    pos, state = decoder.parse_args(bytearray(tail), 0, len(tail), 1, BIG, MAX_BULK, args)
    assert state is True and args == [b"A", b"x"] and pos == len(tail)


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (b"*x\r\n", "invalid multibulk length"),
        (b"*1\r\n+PING\r\n", "expected '$', got '+'"),
        (b"*1\r\n$-5\r\n", "invalid bulk length"),
        (b"*1\r\n$99999999999999999999\r\n", "invalid bulk length"),
        (b"*1\r\n$4\r\nPINGxx", "expected CRLF after bulk data"),
        (b"*3000000\r\n", "invalid multibulk length"),
        (b"*1\r\n$2000000000\r\n", "invalid bulk length"),
        (b"*1\r\n$1 \r\n", "invalid bulk length"),
    ],
)
def test_malformed(parse, wire: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape("Protocol error: " + message)):
        parse(bytearray(wire), 0, len(wire), BIG, MAX_BULK, MAX_ARGS)


@pytest.mark.parametrize("parse", PARSERS)
def test_commands_before_garbage_still_decode(parse) -> None:
    wire = bytearray(encode([[b"PING"], [b"ECHO", b"a"]]) + b"*x\r\n")
    cmds, pos, state = parse(wire, 0, len(wire), BIG, MAX_BULK, MAX_ARGS)
    assert cmds == [[b"PING"], [b"ECHO", b"a"]] and state is None
    with pytest.raises(ProtocolError):
        parse(wire, pos, len(wire), BIG, MAX_BULK, MAX_ARGS)


@pytest.mark.parametrize("parse", PARSERS)
def test_header_without_crlf_is_bounded(parse) -> None:
    wire = bytearray(b"*" + b"1" * (decoder.MAX_HEADER + 10))
    with pytest.raises(ProtocolError, match="too big mbulk count string"):
        parse(wire, 0, len(wire), BIG, MAX_BULK, MAX_ARGS)


@pytest.mark.parametrize("parse", PARSERS)
def test_empty_multibulk_is_skipped(parse) -> None:
    wire = bytearray(b"*0\r\n*-1\r\n" + encode([[b"PING"]]))
    assert parse(wire, 0, len(wire), BIG, MAX_BULK, MAX_ARGS)[0] == [[b"PING"]]


@pytest.mark.parametrize(
    ("line", "args"),
    [
        (b"PING", [b"PING"]),
        (b"  set  a   b ", [b"set", b"a", b"b"]),
        (b'set k "hello world"', [b"set", b"k", b"hello world"]),
        (b'set k "a\\x41\\n"', [b"set", b"k", b"aA\n"]),
        (b"set k 'it\\'s'", [b"set", b"k", b"it's"]),
        (b'echo ""', [b"echo", b""]),
        (b"", []),
    ],
)
def test_inline_split(line: bytes, args: list[bytes]) -> None:
    assert decoder.split_args(line) == args


@pytest.mark.parametrize("line", [b'set k "abc', b"set k 'abc", b'set k "a"b'])
def test_inline_unbalanced_quotes(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="unbalanced quotes"):
        decoder.split_args(line)


def test_inline_needs_newline() -> None:
    buf = bytearray(b"PING")
    assert decoder.parse_inline(buf, 0, len(buf)) == (None, 0)
    buf += b"\r\nECHO x\n"
    args, pos = decoder.parse_inline(buf, 0, len(buf))
    assert args == [b"PING"] and decoder.parse_inline(buf, pos, len(buf))[0] == [b"ECHO", b"x"]


@pytest.mark.parametrize("parse", PARSERS)
def test_plain_inline_commands_are_scanned(parse) -> None:
    wire = bytearray(b"PING\r\n  set a  b\r\n\r\n*1\r\n$4\r\nPING\r\nECHO 'x y'\r\n")
    cmds, pos, state = parse(wire, 0, len(wire), BIG, MAX_BULK, MAX_ARGS)
    assert cmds == [[b"PING"], [b"set", b"a", b"b"], [b"PING"]]
    assert state == decoder.INLINE and wire[pos:].startswith(b"ECHO 'x y'")


@pytest.mark.parametrize("parse", PARSERS)
def test_inline_every_split(parse) -> None:
    wire = b"PING\r\nECHO hello\n*2\r\n$4\r\nECHO\r\n$1\r\nz\r\nSET k 'v w'\r\nDBSIZE\r\n"
    expected = [[b"PING"], [b"ECHO", b"hello"], [b"ECHO", b"z"], [b"SET", b"k", b"v w"],
                [b"DBSIZE"]]  # fmt: skip
    for cut in range(len(wire) + 1):
        assert drain(parse, wire, [cut]) == expected, cut


@pytest.mark.parametrize("parse", PARSERS)
def test_inline_line_without_newline_is_bounded(parse) -> None:
    wire = bytearray(b"P" * (decoder.MAX_HEADER + 10))
    with pytest.raises(ProtocolError, match="too big inline request"):
        parse(wire, 0, len(wire), BIG, MAX_BULK, MAX_ARGS)


@pytest.mark.parametrize("parse", PARSERS)
def test_parity_on_odd_bytes_and_long_numbers(parse) -> None:
    with pytest.raises(ProtocolError, match=re.escape("expected '$', got '\\xff'")):
        parse(bytearray(b"*1\r\n\xff"), 0, 6, BIG, MAX_BULK, MAX_ARGS)
    with pytest.raises(ProtocolError, match="invalid multibulk length"):
        wire = bytearray(b"*9999999999999999999\r\n")
        parse(wire, 0, len(wire), BIG, MAX_BULK, 1 << 62)


ARG_PARSERS = [pytest.param(decoder.py_parse_args, id="python")]
if decoder.c_parse_args is not None:
    ARG_PARSERS.append(pytest.param(decoder.c_parse_args, id="c"))


@pytest.mark.parametrize("parse_args", ARG_PARSERS)
def test_parse_args_continues_at_every_split(parse_args) -> None:
    """A long command parsed argument by argument (issue 12: never rescanned from its start):
    fed in two pieces split anywhere, it yields the same arguments, a large bulk stops it,
    and malformed input is the same protocol error."""
    words = [b"a", b"", b"bc" * 20, b"\r\n$", b"z"]
    wire = b"".join(b"$%d\r\n%b\r\n" % (len(w), w) for w in words)
    for cut in range(len(wire) + 1):
        buf = bytearray(wire[:cut])
        args: list[bytes] = []
        pos, state = parse_args(buf, 0, len(buf), len(words), BIG, MAX_BULK, args)
        assert state is (True if cut == len(wire) else None)
        buf += wire[cut:]
        rest = len(words) - len(args)
        pos, state = parse_args(buf, pos, len(buf), rest, BIG, MAX_BULK, args)
        assert state is True and args == words and pos == len(wire)
    args = []
    pos, state = parse_args(bytearray(b"$1\r\nq\r\n$70000\r\n"), 0, 17, 3, BIG, MAX_BULK, args)
    assert pos == 7 and tuple(state) == ([b"q"], 2, 70000, 15) and args == [b"q"]
    for bad, message in [
        (b"+1\r\n", "expected '$', got '+'"),
        (b"$x\r\n", "invalid bulk length"),
        (b"$1\r\nab\r\n", "expected CRLF after bulk data"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(message)):
            parse_args(bytearray(bad), 0, len(bad), 2, BIG, MAX_BULK, [])
