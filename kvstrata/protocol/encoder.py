"""RESP encoder: replies (server side, RESP3 downgraded for RESP2) and commands (client side).

Encoders append to a list of buffers instead of joining them, so a large payload (an arena
view) goes to the transport as it is: the caller hands the list to ``writelines``/``sendmsg``.
"""

from __future__ import annotations

from typing import Any

from kvstrata.protocol.errors import RespError
from kvstrata.protocol.frames import NULL_ARRAY, BulkView, Push, Simple, Verbatim

CRLF = b"\r\n"
#: values at least this large are appended as their own buffer instead of being copied
LARGE = 16 * 1024

_INT_CACHE = [b":%d\r\n" % i for i in range(1024)]
_NULL3 = b"_\r\n"
_NULL2 = b"$-1\r\n"


def _double_repr(value: float) -> bytes:
    if value != value:
        return b"nan"
    if value in (float("inf"), float("-inf")):
        return b"inf" if value > 0 else b"-inf"
    if value == int(value) and abs(value) < 1e17:
        return b"%d" % int(value)
    return repr(value).encode()


def encode_reply(value: Any, resp3: bool, out: list[Any]) -> None:
    """Append the RESP encoding of ``value`` to ``out`` (see frames.py for the type map)."""
    t = type(value)
    if t is bytes or t is bytearray or t is memoryview:
        n = len(value) if t is not memoryview else value.nbytes
        if n < LARGE:
            out.append(b"$%d\r\n%b\r\n" % (n, value))
        else:
            out.append(b"$%d\r\n" % n)
            out.append(value)
            out.append(CRLF)
    elif t is Simple:
        out.append(b"+%b\r\n" % value)
    elif t is int:
        out.append(_INT_CACHE[value] if 0 <= value < 1024 else b":%d\r\n" % value)
    elif value is None:
        out.append(_NULL3 if resp3 else _NULL2)
    elif t is list or t is tuple:
        out.append(b"*%d\r\n" % len(value))
        for item in value:
            encode_reply(item, resp3, out)
    elif t is str:
        data = value.encode("utf-8")
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    else:
        _encode_rare(value, resp3, out)


def _encode_rare(value: Any, resp3: bool, out: list[Any]) -> None:
    if isinstance(value, BulkView):
        out.append(b"$%d\r\n" % value.view.nbytes)
        out.append(value.view)
        out.append(CRLF)
    elif isinstance(value, RespError):
        out.append(b"-%b\r\n" % value.reply_line())
    elif isinstance(value, bool):
        out.append(
            (b"#t\r\n" if value else b"#f\r\n") if resp3 else (b":1\r\n" if value else b":0\r\n")
        )
    elif isinstance(value, float):
        text = _double_repr(value)
        out.append(b",%b\r\n" % text if resp3 else b"$%d\r\n%b\r\n" % (len(text), text))
    elif isinstance(value, dict):
        out.append((b"%%%d\r\n" if resp3 else b"*%d\r\n") % (len(value) * (1 if resp3 else 2)))
        for k, v in value.items():
            encode_reply(k, resp3, out)
            encode_reply(v, resp3, out)
    elif isinstance(value, set | frozenset):
        out.append((b"~%d\r\n" if resp3 else b"*%d\r\n") % len(value))
        for item in value:
            encode_reply(item, resp3, out)
    elif isinstance(value, Push):
        out.append((b">%d\r\n" if resp3 else b"*%d\r\n") % len(value))
        for item in value:
            encode_reply(item, resp3, out)
    elif isinstance(value, Verbatim):
        if resp3:
            body = value.format + b":" + value.data
            out.append(b"=%d\r\n%b\r\n" % (len(body), body))
        else:
            out.append(b"$%d\r\n%b\r\n" % (len(value.data), value.data))
    elif value is NULL_ARRAY:
        out.append(_NULL3 if resp3 else b"*-1\r\n")
    elif isinstance(value, int):  # int subclasses (IntEnum)
        out.append(b":%d\r\n" % value)
    elif isinstance(value, list | tuple):
        encode_reply(list(value), resp3, out)
    elif isinstance(value, bytes | bytearray | memoryview):
        encode_reply(bytes(value), resp3, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as RESP")


def encode_command(args: tuple[Any, ...] | list[Any], out: list[Any]) -> None:
    """Append a command as a RESP array of bulk strings; large arguments stay separate."""
    out.append(b"*%d\r\n" % len(args))
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode("utf-8")
        elif isinstance(arg, int) and not isinstance(arg, bool):
            arg = b"%d" % arg
        elif isinstance(arg, float):
            arg = repr(arg).encode()
        n = arg.nbytes if isinstance(arg, memoryview) else len(arg)
        if n < LARGE:
            out.append(b"$%d\r\n%b\r\n" % (n, arg))
        else:
            out.append(b"$%d\r\n" % n)
            out.append(arg)
            out.append(CRLF)


def join_small(parts: list[Any]) -> list[Any]:
    """Coalesce runs of small buffers so the transport sees few, large writes."""
    result: list[Any] = []
    run: list[Any] = []
    for part in parts:
        if len(part) < LARGE if not isinstance(part, memoryview) else part.nbytes < LARGE:
            run.append(part)
            continue
        if run:
            result.append(b"".join(run))
            run = []
        result.append(part)
    if run:
        result.append(b"".join(run))
    return result
