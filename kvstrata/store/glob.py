"""Redis-style glob matching, byte for byte as Redis's ``stringmatchlen``: ``*``, ``?``,
``[abc]``, ``[^a]``, ``[a-z]`` (reversed ranges swapped), ``\\`` escapes, an unterminated class
closed by the end of the pattern. Patterns with only literals, ``*`` and ``?`` take a compiled
regex fast path (exactly equivalent for those)."""

from __future__ import annotations

import re
from functools import lru_cache

_MAX_NESTING = 1000  # as Redis: protection against abusive patterns


@lru_cache(maxsize=256)
def _simple_regex(pattern: bytes) -> re.Pattern[bytes] | None:
    if b"[" in pattern or b"\\" in pattern:
        return None
    out = b"".join(
        b".*" if c == 0x2A else b"." if c == 0x3F else re.escape(bytes([c])) for c in pattern
    )
    return re.compile(out, re.DOTALL)


def glob_match(pattern: bytes, key: bytes) -> bool:
    if pattern == b"*":
        return True
    simple = _simple_regex(pattern)
    if simple is not None:
        return simple.fullmatch(key) is not None
    return _match(pattern, 0, key, 0, [False], 0)


def _match(p: bytes, pi: int, s: bytes, si: int, skip_longer: list[bool], nesting: int) -> bool:
    """Port of Redis's stringmatchlen_impl (util.c), case-sensitive."""
    if nesting > _MAX_NESTING:
        return False
    plen, slen = len(p), len(s)
    while pi < plen and si < slen:
        c = p[pi]
        if c == 0x2A:  # *
            while pi + 1 < plen and p[pi + 1] == 0x2A:
                pi += 1
            if pi + 1 == plen:
                return True
            while si < slen:
                if _match(p, pi + 1, s, si, skip_longer, nesting + 1):
                    return True
                if skip_longer[0]:
                    return False
                si += 1
            skip_longer[0] = True
            return False
        if c == 0x3F:  # ?
            si += 1
        elif c == 0x5B:  # [
            pi, matched = _match_class(p, pi + 1, s[si])
            if not matched:
                return False
            si += 1
        else:
            if c == 0x5C and pi + 1 < plen:  # \x: x literally
                pi += 1
            if p[pi] != s[si]:
                return False
            si += 1
        pi += 1
        if si == slen:
            while pi < plen and p[pi] == 0x2A:
                pi += 1
            break
    return pi == plen and si == slen


def _match_class(p: bytes, pi: int, ch: int) -> tuple[int, bool]:
    """Match ``ch`` against the class starting after ``[``; returns the index of its last
    pattern byte (``]``, or the end of an unterminated class) and whether it matched."""
    plen = len(p)
    negate = pi < plen and p[pi] == 0x5E  # ^
    if negate:
        pi += 1
    matched = False
    while True:
        if pi >= plen:  # unterminated: the end of the pattern closes the class
            pi -= 1
            break
        c = p[pi]
        if c == 0x5C and plen - pi >= 2:
            pi += 1
            if p[pi] == ch:
                matched = True
        elif c == 0x5D:  # ]
            break
        elif plen - pi >= 3 and p[pi + 1] == 0x2D:  # a-z
            lo, hi = sorted((c, p[pi + 2]))
            pi += 2
            if lo <= ch <= hi:
                matched = True
        elif c == ch:
            matched = True
        pi += 1
    return pi, matched != negate
