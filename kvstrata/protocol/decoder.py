"""Incremental RESP request decoding (server side). No I/O.

:func:`parse_requests` scans a buffer the caller owns and returns the complete commands in it.
"Incomplete" is an expected state, not an error: the caller keeps the unconsumed bytes and calls
again when more arrive. Two implementations with one contract, tested together at every split
offset: a C one (``kvstrata.protocol._cresp``, built when a compiler is present) and this pure
Python one. :data:`parse_requests` is the fastest available.

The scan stops early in two cases that the caller handles in Python:

- :data:`INLINE`: the next command is an inline command with quotes (``SET k "a b"``);
  :func:`parse_inline` decodes it. Plain inline commands (``PING\\r\\n`` typed by hand,
  redis-benchmark's ``*_INLINE`` tests) are decoded by the scanner itself.
- :class:`BigBulk`: the next command has a bulk argument of at least ``big`` bytes. The caller
  chooses where those bytes land (an arena slot for ``KV.PUT``) so a payload is copied once,
  then continues with :func:`parse_args`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvstrata.protocol.errors import ProtocolError

INLINE = 1
MAX_HEADER = 64 * 1024  # longest `*N`/`$N` line or inline command, as Redis
Buf = bytearray | bytes | memoryview


class BigBulk(NamedTuple):
    """A command stopped at a large bulk: ``args`` so far, ``remaining`` arguments including the
    large one, its ``length``, and ``data_pos``, where its bytes begin in the buffer. (The C
    scanner returns the same four values as a plain tuple.)"""

    args: list[Any]
    remaining: int
    length: int
    data_pos: int


def _show(byte: int) -> str:
    return chr(byte) if 0x20 <= byte < 0x7F else f"\\x{byte:02x}"


def _header_int(buf: Buf, start: int, stop: int, what: str) -> int:
    raw = bytes(buf[start:stop])
    body = raw[1:] if raw[:1] == b"-" else raw
    if not body or not body.isdigit() or len(body) > 18:
        raise ProtocolError(f"invalid {what} length")
    return int(raw)


def py_parse_requests(
    buf: Buf, pos: int, end: int, big: int, max_bulk: int, max_args: int
) -> tuple[list[list[bytes]], int, Any]:
    """Decode complete multibulk commands in ``buf[pos:end]``; see the module docstring."""
    cmds: list[list[bytes]] = []
    good = [pos]  # where the command after the last complete one begins
    try:
        return _scan(buf, pos, end, big, max_bulk, max_args, cmds, good)
    except ProtocolError:
        if not cmds:
            raise
        # commands before the malformed one still run; the error comes on the next call
        return cmds, good[0], None


def _scan(
    buf: Buf,
    pos: int,
    end: int,
    big: int,
    max_bulk: int,
    max_args: int,
    cmds: list[Any],
    good: list[int],
) -> tuple[list[list[bytes]], int, Any]:
    find = buf.find  # type: ignore[union-attr]
    while pos < end:
        if buf[pos] != 0x2A:  # '*': an inline command
            nl = find(b"\n", pos, end)
            if nl < 0:
                if end - pos > MAX_HEADER:
                    raise ProtocolError("too big inline request")
                break
            line = bytes(buf[pos:nl])
            if b'"' in line or b"'" in line:
                return cmds, pos, INLINE  # quoting rules: parse_inline
            words = line.split()
            if words:
                cmds.append(words)
            pos = good[0] = nl + 1
            continue
        nl = find(b"\r\n", pos, end)
        if nl < 0:
            if end - pos > MAX_HEADER:
                raise ProtocolError("too big mbulk count string")
            break
        n = _header_int(buf, pos + 1, nl, "multibulk")
        if n > max_args:
            raise ProtocolError("invalid multibulk length")
        if n <= 0:
            pos = good[0] = nl + 2
            continue
        args: list[Any] = []
        p, state = _parse_args(buf, nl + 2, end, n, big, max_bulk, args)
        if state is None:
            break
        if state is not True:
            return cmds, pos, state
        cmds.append(args)
        pos = good[0] = p
    return cmds, pos, None


def _parse_args(
    buf: Buf, p: int, end: int, n: int, big: int, max_bulk: int, args: list[Any]
) -> tuple[int, Any]:
    """Parse ``n`` bulk arguments into ``args``. Returns (pos, True) when complete,
    (pos, None) when more bytes are needed, (pos, BigBulk) at a large bulk."""
    find = buf.find  # type: ignore[union-attr]
    for i in range(n):
        if p >= end:
            return p, None
        if buf[p] != 0x24:  # '$'
            raise ProtocolError(f"expected '$', got '{_show(buf[p])}'")
        nl = find(b"\r\n", p, end)
        if nl < 0:
            if end - p > MAX_HEADER:
                raise ProtocolError("too big bulk count string")
            return p, None
        ln = _header_int(buf, p + 1, nl, "bulk")
        if ln < 0 or ln > max_bulk:
            raise ProtocolError("invalid bulk length")
        data = nl + 2
        if ln >= big:
            return p, BigBulk(args, n - i, ln, data)
        if data + ln + 2 > end:
            return p, None
        if buf[data + ln] != 13 or buf[data + ln + 1] != 10:
            raise ProtocolError("expected CRLF after bulk data")
        args.append(bytes(buf[data : data + ln]))
        p = data + ln + 2
    return p, True


def py_parse_args(
    buf: Buf, pos: int, end: int, n: int, big: int, max_bulk: int, args: list[Any]
) -> tuple[int, Any]:
    """Continue a command after a large bulk: parse its ``n`` remaining arguments.

    Arguments parsed before the bytes run out stay in ``args``; the returned position is where
    to resume. Returns (pos, True | None | BigBulk) like the internal scanner."""
    return _parse_args(buf, pos, end, n, big, max_bulk, args)


def parse_inline(buf: Buf, pos: int, end: int) -> tuple[list[bytes] | None, int]:
    """Decode one inline command at ``pos``; (None, pos) when its line is not complete."""
    nl = buf.find(b"\n", pos, end)  # type: ignore[union-attr]
    if nl < 0:
        if end - pos > MAX_HEADER:
            raise ProtocolError("too big inline request")
        return None, pos
    line = bytes(buf[pos:nl]).rstrip(b"\r")
    if b'"' not in line and b"'" not in line:
        return line.split(), nl + 1
    return split_args(line), nl + 1


def parse_inlines(buf: Buf, pos: int, end: int) -> tuple[list[list[bytes]], int]:
    """Decode consecutive inline commands at ``pos`` up to a multibulk one or a partial line.
    Empty lines are skipped."""
    cmds: list[list[bytes]] = []
    while pos < end and buf[pos] != 0x2A:
        try:
            args, nxt = parse_inline(buf, pos, end)
        except ProtocolError:
            if not cmds:
                raise
            break  # the commands before it still run; the error comes on the next call
        if args is None:
            break
        if args:
            cmds.append(args)
        pos = nxt
    return cmds, pos


_ESCAPES = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("b"): 8, ord("a"): 7}


def split_args(line: bytes) -> list[bytes]:
    """Split an inline command like Redis's sdssplitargs (quotes and escapes)."""
    args: list[bytes] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in b" \t\r\n\v\f":
            i += 1
        if i >= n:
            return args
        cur = bytearray()
        quote = 0
        while i < n:
            c = line[i]
            if quote == 0x22:  # "
                if c == 0x5C and i + 1 < n:  # backslash
                    nxt = line[i + 1]
                    hexpart = line[i + 2 : i + 4]
                    if nxt == ord("x") and len(hexpart) == 2 and _is_hex(hexpart):
                        cur.append(int(hexpart, 16))
                        i += 3
                    else:
                        cur.append(_ESCAPES.get(nxt, nxt))
                        i += 1
                elif c == 0x22:
                    if i + 1 < n and line[i + 1] not in b" \t\r\n\v\f":
                        raise ProtocolError("unbalanced quotes in request")
                    quote = 0
                    i += 1
                    break
                else:
                    cur.append(c)
            elif quote == 0x27:  # '
                if c == 0x5C and i + 1 < n and line[i + 1] == 0x27:
                    cur.append(0x27)
                    i += 1
                elif c == 0x27:
                    if i + 1 < n and line[i + 1] not in b" \t\r\n\v\f":
                        raise ProtocolError("unbalanced quotes in request")
                    quote = 0
                    i += 1
                    break
                else:
                    cur.append(c)
            elif c in b" \t\r\n\v\f":
                break
            elif c in (0x22, 0x27):
                quote = c
            else:
                cur.append(c)
            i += 1
        if quote:
            raise ProtocolError("unbalanced quotes in request")
        args.append(bytes(cur))


def _is_hex(b: bytes) -> bool:
    return all(ch in b"0123456789abcdefABCDEF" for ch in b)


def _load_fast() -> Any:
    try:
        from kvstrata.protocol import _cresp
    except ImportError:
        return None
    _cresp.set_error_class(ProtocolError)
    return _cresp


_fast = _load_fast()
c_parse_requests = None if _fast is None else _fast.parse_requests
c_parse_args = None if _fast is None else _fast.parse_args
parse_requests = c_parse_requests or py_parse_requests
parse_args = c_parse_args or py_parse_args
ACCELERATED = c_parse_requests is not None
