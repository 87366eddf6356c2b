"""Redis-style glob matching (``*``, ``?``, ``[abc]``, ``[^a]``, ``[a-z]``, ``\\`` escapes)."""

from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=256)
def compile_glob(pattern: bytes) -> re.Pattern[bytes]:
    out = bytearray()
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i : i + 1]
        if c == b"*":
            out += b".*"
        elif c == b"?":
            out += b"."
        elif c == b"\\" and i + 1 < n:
            i += 1
            out += re.escape(pattern[i : i + 1])
        elif c == b"[":
            j = i + 1
            cls = bytearray(b"[")
            if j < n and pattern[j : j + 1] == b"^":
                cls += b"^"
                j += 1
            start = j
            while j < n and (pattern[j : j + 1] != b"]" or j == start):
                ch = pattern[j : j + 1]
                if ch == b"\\" and j + 1 < n:
                    j += 1
                    cls += re.escape(pattern[j : j + 1])
                elif ch == b"-" and j != start and j + 1 < n and pattern[j + 1 : j + 2] != b"]":
                    cls += b"-"
                else:
                    cls += re.escape(ch)
                j += 1
            if j >= n:  # unterminated class: Redis matches it literally up to the end
                out += re.escape(pattern[i:])
                break
            out += bytes(cls) + b"]"
            i = j
        else:
            out += re.escape(c)
        i += 1
    return re.compile(bytes(out), re.DOTALL)


def glob_match(pattern: bytes, key: bytes) -> bool:
    if pattern == b"*":
        return True
    return compile_glob(pattern).fullmatch(key) is not None
