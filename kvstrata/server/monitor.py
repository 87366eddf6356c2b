"""MONITOR lines in Redis's format.

``1700000000.123456 [0 127.0.0.1:5000] "set" "k" "v"``: the time with microseconds, the db
and client address, then every argument quoted with Redis's ``sdscatrepr`` escaping
(``\\\\``, ``\\"``, ``\\n``, ``\\r``, ``\\t``, ``\\a``, ``\\b``, ``\\xHH`` for other
non-printable bytes). Unlike Redis, an argument longer than :data:`MAX_ARG_BYTES` (a KV chunk
payload of megabytes) is cut: the quoted head is followed by ``... (N more bytes)``.
"""

from __future__ import annotations

import re
from typing import Any

MAX_ARG_BYTES = 4096

_ESCAPES = {
    ord("\\"): b"\\\\",
    ord('"'): b'\\"',
    ord("\n"): b"\\n",
    ord("\r"): b"\\r",
    ord("\t"): b"\\t",
    ord("\a"): b"\\a",
    ord("\b"): b"\\b",
}
_TABLE = [_ESCAPES.get(i, bytes([i]) if 0x20 <= i <= 0x7E else b"\\x%02x" % i) for i in range(256)]
_NEEDS_ESCAPE = re.compile(rb"[^\x20\x21\x23-\x5b\x5d-\x7e]")


def _escape_byte(m: re.Match[bytes]) -> bytes:
    return _TABLE[m.group()[0]]


def quote(arg: Any) -> bytes:
    """One argument as Redis's ``sdscatrepr`` writes it, quotes included."""
    if isinstance(arg, str):
        arg = arg.encode()
    view = memoryview(arg).cast("B")
    size = view.nbytes
    head = bytes(view[:MAX_ARG_BYTES])
    out = b'"' + _NEEDS_ESCAPE.sub(_escape_byte, head) + b'"'
    if size > MAX_ARG_BYTES:
        out += b"... (%d more bytes)" % (size - MAX_ARG_BYTES)
    return out


def format_monitor_line(ts: float, db: int, addr: str, argv: list[Any]) -> bytes:
    """The line every MONITOR client receives for one command (without CRLF)."""
    sec = int(ts)
    usec = round((ts - sec) * 1_000_000)
    if usec >= 1_000_000:
        sec, usec = sec + 1, usec - 1_000_000
    prefix = b"%d.%06d [%d %s]" % (sec, usec, db, addr.encode("utf-8", "replace"))
    return b" ".join([prefix, *(quote(a) for a in argv)])
