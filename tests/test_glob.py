"""Glob patterns (KEYS, SCAN MATCH, CONFIG GET) match exactly what redis-server matches: the
same keys and patterns are asked of a real redis-server and of kvstrata's matcher."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis

from kvstrata.store.glob import glob_match
from tests.test_client_redis import start_redis

KEYS = [b"a", b"b", b"z", b"]", b"-", b"^", b"[a", b"\\", b"hello", b"hallo", b"hxllo",
        b"hllo", b"heeeello", b"kv:ns:ab12", b"kv:ns2:ff", b"a*b", b"a?b", b"a[b", b""]  # fmt: skip
PATTERNS = [b"*", b"h?llo", b"h*llo", b"h[ae]llo", b"h[^e]llo", b"h[a-b]llo", b"[z-a]",
            b"[]a]", b"[a-", b"[a", b"[a-]", b"[^]", b"\\[a", b"a\\*b", b"a[*]b", b"kv:*",
            b"kv:ns:*", b"*:*", b"[\\]]", b"[\\", b"**a", b"a*", b"?", b"", b"[", b"[^a-y]",
            b"\\"]  # fmt: skip


@pytest.fixture(scope="module")
def reference() -> Iterator[redis.Redis]:
    proc, port = start_redis()
    r = redis.Redis(port=port)
    r.mset({k: b"1" for k in KEYS if k})
    yield r
    proc.terminate()
    proc.wait(10)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_same_keys_as_redis(reference: redis.Redis, pattern: bytes) -> None:
    expected = sorted(reference.keys(pattern))
    assert sorted(k for k in KEYS if k and glob_match(pattern, k)) == expected


def test_random_patterns_agree_with_redis(reference: redis.Redis) -> None:
    rnd = random.Random(7)
    alphabet = b"ab]-^[*?\\hxz"
    for _ in range(150):
        pattern = bytes(rnd.choice(alphabet) for _ in range(rnd.randint(1, 6)))
        expected = sorted(reference.keys(pattern))
        got = sorted(k for k in KEYS if k and glob_match(pattern, k))
        assert got == expected, pattern
