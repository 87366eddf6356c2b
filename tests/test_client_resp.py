"""Client reply parser (kvstrata.clients.resp): byte-level cases for every RESP2/RESP3 type,
input split at every offset, receive-in-place into caller buffers, and command encoding."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvstrata.clients.resp import (
    BufferTooSmall,
    ReplyReader,
    as_bytes_view,
    as_writable_view,
    command_buffers,
)
from kvstrata.protocol.errors import CommandError, LeaseError, ProtocolError, RespError
from kvstrata.protocol.frames import Push, Simple


def parse_all(data: bytes, outs: list[Any] | None = None, big: int = 64 * 1024) -> list[Any]:
    replies: list[Any] = []
    pending = list(outs or [])

    def on_reply(v: Any) -> None:
        replies.append(v)
        if pending and not isinstance(v, Push):
            pending.pop(0)

    reader = ReplyReader(on_reply, lambda: pending[0] if pending else None, big=big, bufsize=64)
    reader.feed(data)
    assert reader.idle
    return replies


CASES: list[tuple[bytes, Any]] = [
    (b"+OK\r\n", Simple(b"OK")),
    (b":-42\r\n", -42),
    (b"$5\r\nhello\r\n", b"hello"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"_\r\n", None),
    (b"*0\r\n", []),
    (b"%0\r\n", {}),
    (b"#t\r\n", True),
    (b"#f\r\n", False),
    (b",3.5\r\n", 3.5),
    (b",inf\r\n", float("inf")),
    (b"(12345678901234567890123\r\n", 12345678901234567890123),
    (b"=15\r\ntxt:Some string\r\n", b"Some string"),
    (b"*3\r\n:1\r\n$1\r\na\r\n*2\r\n+x\r\n_\r\n", [1, b"a", [b"x", None]]),
    (b"%2\r\n+first\r\n:1\r\n$2\r\nk2\r\n*1\r\n:2\r\n", {b"first": 1, b"k2": [2]}),
    (b"~2\r\n+a\r\n+b\r\n", [b"a", b"b"]),
    (b"|1\r\n+ttl\r\n:3\r\n:7\r\n", 7),
    (b"*2\r\n|1\r\n+a\r\n+b\r\n:1\r\n:2\r\n", [1, 2]),
    (b"%1\r\n*2\r\n:1\r\n:2\r\n+v\r\n", {(1, 2): b"v"}),
]


@pytest.mark.parametrize(("wire", "want"), CASES, ids=lambda x: repr(x)[:30])
def test_every_type(wire: bytes, want: Any) -> None:
    assert parse_all(wire) == [want]


def test_every_split_offset_of_a_stream() -> None:
    stream = b"".join(w for w, _ in CASES)
    want = [v for _, v in CASES]
    for cut in range(1, len(stream)):
        got: list[Any] = []
        reader = ReplyReader(got.append, bufsize=32)
        reader.feed(stream[:cut])
        reader.feed(stream[cut:])
        assert got == want, cut
    got = []
    reader = ReplyReader(got.append, bufsize=16)
    for i in range(len(stream)):
        reader.feed(stream[i : i + 1])
    assert got == want


def test_errors_are_values_with_classes() -> None:
    got = parse_all(b"-ERR unknown command 'x'\r\n-NOLEASE no such lease\r\n!9\r\nOOM full!\r\n")
    assert isinstance(got[0], CommandError) and got[0].message == "unknown command 'x'"
    assert isinstance(got[1], LeaseError) and got[1].prefix == "NOLEASE"
    assert isinstance(got[2], RespError) and got[2].prefix == "OOM"
    nested = parse_all(b"*2\r\n:1\r\n-WRONGTYPE bad\r\n")[0]
    assert nested[0] == 1 and nested[1].prefix == "WRONGTYPE"


def test_push_is_delivered_and_does_not_consume_an_out() -> None:
    out = bytearray(8)
    got = parse_all(b">2\r\n+message\r\n$3\r\nabc\r\n$3\r\nxyz\r\n", outs=[out])
    assert isinstance(got[0], Push) and got[0] == [b"message", b"abc"]
    assert bytes(got[1]) == b"xyz" and out[:3] == b"xyz"


@pytest.mark.parametrize("data", [b"?x\r\n", b"#x\r\n", b":abc\r\n", b"$3\r\nabcXY", b",zz\r\n"])
def test_protocol_errors_raise(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_all(data)


def test_big_bulk_lands_in_one_bytearray() -> None:
    payload = bytes(range(256)) * 1000
    wire = b"$%d\r\n%b\r\n+OK\r\n" % (len(payload), payload)
    got = parse_all(wire, big=1024)
    assert isinstance(got[0], bytearray) and got[0] == payload and got[1] == b"OK"


def _receive_in_chunks(reader: ReplyReader, wire: bytes, step: int) -> list[int]:
    """Simulate recv_into: write into whatever get_buffer returns, ``step`` bytes at a time."""
    sizes, pos = [], 0
    while pos < len(wire):
        buf = reader.get_buffer()
        n = min(step, buf.nbytes, len(wire) - pos)
        buf[:n] = wire[pos : pos + n]
        sizes.append(buf.nbytes)
        reader.buffer_updated(n)
        pos += n
    return sizes


def test_out_buffer_is_the_receive_buffer() -> None:
    payload = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    wire = b"$%d\r\n%b\r\n" % (len(payload), payload)
    out = np.zeros(400_000, dtype=np.uint8)
    got: list[Any] = []
    reader = ReplyReader(got.append, lambda: out, bufsize=4096)
    sizes = _receive_in_chunks(reader, wire, 50_000)
    assert max(sizes) > 4096  # the reader handed out the caller's buffer, not its own
    assert len(got) == 1 and isinstance(got[0], memoryview) and got[0].nbytes == len(payload)
    assert out[: len(payload)].tobytes() == payload and not out[len(payload) :].any()


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "numpy16", "torch"])
def test_out_buffer_kinds(kind: str) -> None:
    payload = bytes(range(256)) * 4
    buf: Any
    if kind == "bytearray":
        buf = bytearray(2048)
    elif kind == "memoryview":
        buf = memoryview(bytearray(2048))
    elif kind == "numpy16":
        buf = np.zeros(1024, dtype=np.float16)
    else:
        torch = pytest.importorskip("torch")
        buf = torch.zeros(1024, dtype=torch.bfloat16)
    got = parse_all(b"$1024\r\n%b\r\n" % payload, outs=[buf])
    assert bytes(got[0]) == payload
    assert bytes(as_writable_view(buf)[:1024]) == payload


def test_small_out_buffer_reports_and_keeps_stream_in_step() -> None:
    got = parse_all(b"$10\r\n0123456789\r\n:5\r\n", outs=[bytearray(4), None])
    assert isinstance(got[0], BufferTooSmall) and "10 bytes" in str(got[0])
    assert got[1] == 5


def test_null_and_error_with_out() -> None:
    out = bytearray(b"untouched")
    got = parse_all(b"$-1\r\n-ERR nope\r\n", outs=[out, out])
    assert got[0] is None and isinstance(got[1], CommandError) and out == b"untouched"


def test_array_outs_for_mget() -> None:
    a, b = bytearray(4), np.zeros(8, dtype=np.uint8)
    got = parse_all(b"*3\r\n$4\r\nabcd\r\n$-1\r\n$8\r\n01234567\r\n", outs=[[a, None, b]])
    assert bytes(got[0][0]) == b"abcd" and a == b"abcd"
    assert got[0][1] is None
    assert bytes(got[0][2]) == b"01234567" and b.tobytes() == b"01234567"


def test_long_line_grows_buffer_and_limit() -> None:
    line = b"+" + b"x" * 10_000 + b"\r\n"
    assert parse_all(line) == [b"x" * 10_000]
    with pytest.raises(ProtocolError, match="too long"):
        parse_all(b"+" + b"x" * 70_000)


def test_command_buffers_keep_large_arguments_separate() -> None:
    payload = np.arange(100_000, dtype=np.uint32)
    bufs = command_buffers(["KV.PUT", "ns", b"\x01" * 32, b"", payload, "TOKENS", 256])
    big = [b for b in bufs if isinstance(b, memoryview)]
    assert len(big) == 1 and big[0].nbytes == payload.nbytes
    assert np.shares_memory(np.frombuffer(big[0], dtype=np.uint8), payload)
    wire = b"".join(bytes(b) for b in bufs)
    assert wire.startswith(b"*7\r\n$6\r\nKV.PUT\r\n$2\r\nns\r\n$32\r\n")
    assert wire.endswith(b"\r\n$6\r\nTOKENS\r\n$3\r\n256\r\n")
    assert b"$400000\r\n" + payload.tobytes() + b"\r\n" in wire


def _wire_of(args: list[Any]) -> bytes:
    """The general encoder's bytes for ``args`` (the reference of the chain fast path)."""
    from kvstrata.protocol.encoder import encode_command

    parts: list[Any] = []
    encode_command([a if isinstance(a, str | bytes | int | float) else as_bytes_view(a)
                    for a in args], parts)  # fmt: skip
    return b"".join(bytes(p) for p in parts)


def test_chain_fast_path_writes_what_the_general_encoder_writes() -> None:
    """Commands carrying a chain of hashes are encoded by one join (``_chain_wire``): every
    shape, chain or not, must come out byte for byte as the general encoder writes it."""
    import random

    from kvstrata.clients import resp

    rng = random.Random(31)
    chain_seen = 0
    for case in range(400):
        n = rng.choice([0, 1, 7, 8, 9, 30, 500])
        size = rng.choice([1, 32, 36, 64])
        run: list[Any] = [rng.randbytes(size) for _ in range(n)]
        if n and case % 5 == 0:  # one odd one out: a different length, a str, a bytearray
            odd = rng.choice([rng.randbytes(size + 1), "ab", bytearray(b"x" * size), 7])
            run[rng.randrange(n)] = odd
        tail = rng.choice([[], ["PREFETCH"], ["WITHTIERS", "PREFETCH"], ["TIER", "dram"],
                           ["TTL", 5000], [b"\r\n"], [np.arange(5000, dtype=np.uint32)],
                           ["a", "b", "c", "d", "e"]])  # fmt: skip
        args = ["KV.MATCH", rng.choice(["ns", "vllm:m@b4096#ab", "é"]), *run, *tail]
        fast = resp._chain_wire(args)
        chain_seen += fast is not None
        assert b"".join(bytes(b) for b in command_buffers(args)) == _wire_of(args), (n, tail)
        if fast is not None:
            assert fast == _wire_of(args)
    assert chain_seen > 100  # the fast path was taken, not only the general one
    hashes = [i.to_bytes(36, "big") for i in range(500)]
    assert resp._chain_wire(["KV.MATCH", "ns", *hashes]) is not None
    assert resp._chain_wire(["KV.MATCH", "ns", *hashes[:6]]) is None  # short: general path


def test_payload_views() -> None:
    assert as_bytes_view(b"ab") == b"ab"
    assert bytes(as_bytes_view(np.array([1, 2], dtype="<u2"))) == b"\x01\x00\x02\x00"
    with pytest.raises(ValueError):
        as_bytes_view(np.arange(10)[::2])
    with pytest.raises(ValueError, match="read-only"):
        as_writable_view(b"abc")


def test_torch_payload_view() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    view = as_bytes_view(t)
    assert len(view) == 12
    assert bytes(view) == t.view(torch.uint8).numpy().tobytes()


def test_large_verbatim_and_blob_error_decode_like_small_ones() -> None:
    """A verbatim string or blob error received in place (above the in-place threshold) is
    decoded as a small one would be: no ``txt:`` prefix, an error object."""
    from kvstrata.clients.resp import ReplyReader
    from kvstrata.protocol.errors import RespError

    got: list[object] = []
    reader = ReplyReader(got.append, big=16, bufsize=64)
    text = b"x" * 100
    reader.feed(b"=%d\r\ntxt:%b\r\n" % (len(text) + 4, text))
    reader.feed(b"!%d\r\nERR %b\r\n" % (len(text) + 4, text))
    assert got[0] == text
    assert isinstance(got[1], RespError) and got[1].message == text.decode()
