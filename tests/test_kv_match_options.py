"""KV.MATCH and option words: a misspelt WITHTIERS is a hash (hashes are opaque), answered as
one and warned about in the log; the option itself in any case is the option, unwarned."""

from __future__ import annotations

import logging
import subprocess
from typing import Any

import pytest
import redis

from kvstrata.server.commands import _near
from kvstrata.server.commands._near import near_option

WORDS = (b"WITHTIERS", b"PREFETCH")


@pytest.mark.parametrize(
    ("word", "option"),
    [
        (b"WITHTEIRS", b"WITHTIERS"),  # two neighbours swapped: one edit
        (b"withtiers", b"WITHTIERS"),  # case only
        (b"WITHTIER", b"WITHTIERS"),  # one letter missing
        (b"WITHTIERSS", b"WITHTIERS"),  # one letter too many
        (b"PREFETCj", b"PREFETCH"),  # one letter replaced
        (b"prefecth", b"PREFETCH"),
        (b"WTIHTEIRS", None),  # two swaps
        (b"WITHTI", None),
        (b"\x8f" * 9, None),  # a binary hash of that length
        (bytes(range(32)), None),
    ],
)
def test_near_option(word: bytes, option: bytes | None) -> None:
    assert near_option(word, WORDS) == option


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(_near._Limit, "last", -_near.WARN_INTERVAL)
    monkeypatch.setattr(_near._Limit, "left_out", 0)
    caplog.set_level(logging.WARNING, logger="kvstrata.server")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "looks like the option" in r.getMessage()]

    return lines


def test_misspelt_option_is_a_hash_and_is_warned_about(server: Any, warnings: Any) -> None:
    r = redis.Redis(port=server.port)
    r.execute_command("KV.PUT", "ns", "h0", "", b"x" * 10)
    # WITHTEIRS is a second hash, not cached: a count of 1, not [1, [tiers]]
    assert r.execute_command("KV.MATCH", "ns", "h0", "WITHTEIRS") == 1
    [line] = warnings()
    assert "KV.MATCH from 127.0.0.1:" in line
    assert "b'WITHTEIRS'" in line and "the option WITHTIERS" in line
    # the option in any case is the option, and nothing is logged
    assert r.execute_command("KV.MATCH", "ns", "h0", "withtiers") == [1, [b"dram"]]
    assert r.execute_command("KV.MATCH", "ns", "h0", "PREFETCH", "WITHTIERS") == [1, [b"dram"]]
    # a real 32-byte hash of a chain is not warned about
    assert r.execute_command("KV.MATCH", "ns", "h0", bytes(range(32))) == 1
    assert len(warnings()) == 1
    r.close()


def test_warnings_are_rate_limited_and_counted(
    server: Any, warnings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(_near, "_now", lambda: clock[0])
    r = redis.Redis(port=server.port)
    for _ in range(3):
        assert r.execute_command("KV.MATCH", "ns", "h0", "PREFETHC") == 0
    assert len(warnings()) == 1
    clock[0] += _near.WARN_INTERVAL
    assert r.execute_command("KV.MATCH", "ns", "h0", "WITHTIERZ") == 0
    assert len(warnings()) == 2
    assert "(2 more such warnings in the last 10 s)" in warnings()[1]
    r.close()


def test_redis_cli_reads_the_reply(server: Any, warnings: Any, redis_server_bin: str) -> None:
    """The warning is not in the reply: redis-cli (RESP3; not a tty, so no "(integer)")
    reads a plain integer."""
    out = subprocess.run(
        ["redis-cli", "-p", str(server.port), "-3", "KV.MATCH", "ns", "h0", "WITHTEIRS"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert (out.returncode, out.stdout.strip()) == (0, "0")
    assert len(warnings()) == 1
