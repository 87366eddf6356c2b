"""A warning for option words misspelt into a chain of hashes (``KV.MATCH ns h0 WITHTEIRS``).

``KV.MATCH ns hash… [WITHTIERS] [PREFETCH]`` takes each trailing argument that is an option
word (in any case) as that option. Hashes are opaque byte strings, so a misspelt option is a
legal hash: the server cannot refuse it, and the reply is a plain count where the client
expected tiers. When the last hash is an option word, or one edit from one (ignoring case; a
swap of two neighbouring letters counts as one edit, so ``WITHTEIRS`` is caught), the server
logs a warning naming the client, the word and the option.

The warning is not sent in the reply as a RESP3 attribute (``|``): redis-cli 7 stops with
``Protocol error, got "|" as reply type byte`` and redis-py 8's RESP3 parser has no case for
it, so an attribute would break the very clients that mistype. The log is rate-limited to one
line per :data:`WARN_INTERVAL` seconds, which counts the warnings it left out.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("kvstrata.server")

WARN_INTERVAL = 10.0


class _Limit:
    last = -WARN_INTERVAL  # when the last line was logged
    left_out = 0  # warnings not logged since


def _now() -> float:
    return time.monotonic()


def _within_one_edit(a: bytes, b: bytes) -> bool:
    """Optimal-string-alignment distance of ``a`` and ``b`` is at most 1."""
    if a == b:
        return True
    if len(a) == len(b):
        diffs = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diffs) == 1:
            return True
        i = diffs[0]
        return len(diffs) == 2 and diffs[1] == i + 1 and a[i] == b[i + 1] and a[i + 1] == b[i]
    if abs(len(a) - len(b)) != 1:
        return False
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((k for k in range(len(short)) if short[k] != long[k]), len(short))
    return short[i:] == long[i + 1 :]


def near_option(word: bytes, options: tuple[bytes, ...]) -> bytes | None:
    """The option ``word`` equals but for case or one edit; None when it is none of them."""
    if not 1 < len(word) <= 1 + max(len(o) for o in options):
        return None
    upper = word.upper()
    return next((o for o in options if _within_one_edit(upper, o)), None)


def warn_if_option_like(command: str, word: bytes, options: tuple[bytes, ...], client: str) -> None:
    """Log (rate-limited) that ``word``, taken as the last hash, looks like an option."""
    option = near_option(word, options)
    if option is None:
        return
    now = _now()
    if now - _Limit.last < WARN_INTERVAL:
        _Limit.left_out += 1
        return
    left_out, _Limit.left_out, _Limit.last = _Limit.left_out, 0, now
    more = f" ({left_out} more such warnings in the last {WARN_INTERVAL:g} s)" if left_out else ""
    log.warning(
        "%s from %s: the last hash %r is taken as a hash, but looks like the option %s "
        "(options are matched whole, in any case; a hash equal to an option must not be "
        "last)%s", command, client, word, option.decode(), more,
    )  # fmt: skip
