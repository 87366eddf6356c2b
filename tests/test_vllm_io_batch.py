"""The vLLM tier's byte mover (``clients/vllm_io.py``, no vLLM needed) stores a job's chunks with
one KV.MRESERVE and one KV.COMMIT per chain, against a real server on port 0."""

from __future__ import annotations

import numpy as np
import redis

from kvstrata.clients import Client
from kvstrata.clients.vllm_io import ChunkMover, StoreItem, chains_of
from tests.conftest import RunningServer

NS = "vllm-io@u8@c16"
ROW = 4096


def items(rows: list[int], chain_from: bytes = b"", tokens: int = 16) -> list[StoreItem]:
    out, parent = [], chain_from
    for row in rows:
        h = b"k%03d" % row
        out.append(StoreItem(h, parent, row, tokens))
        parent = h
    return out


def test_chains_of_cuts_at_broken_links_and_token_changes() -> None:
    a = items([0, 1, 2])
    b = items([5, 6], chain_from=b"elsewhere")
    c = [StoreItem(b"t", b"k006", 7, 8)]  # links to b's last chunk but has other tokens
    assert chains_of(a + b + c) == [a, b, c]
    assert chains_of([]) == []


def test_store_reserves_each_chain_once_and_skips_stored_chunks(server: RunningServer) -> None:
    """Scenario: a store job of two chains (rows 0-3, and rows 6-7 under another parent), whose
    row 1 is stored already: two KV.MRESERVE and two KV.COMMIT, no KV.RESERVE; 5 written; every
    stored chunk holds its row's exact bytes and the chains match."""
    rows = np.random.default_rng(1).integers(0, 255, (8, ROW), dtype=np.uint8)
    r = redis.Redis(port=server.port)
    r.execute_command("KV.PUT", NS, b"k001", b"k000", rows[1].tobytes())
    r.config_resetstat()
    mover = ChunkMover(lambda: Client(port=server.port), NS, rows)
    try:
        job = items([0, 1, 2, 3]) + items([6, 7], chain_from=b"x")
        assert mover.store(job) == 5
        stats = r.info("commandstats")
        assert stats["cmdstat_kv.mreserve"]["calls"] == 2
        assert stats["cmdstat_kv.commit"]["calls"] == 2
        assert "cmdstat_kv.reserve" not in stats
        got = r.execute_command("KV.MGET", NS, *[b"k%03d" % i for i in (0, 1, 2, 3, 6, 7)])
        assert got == [rows[i].tobytes() for i in (0, 1, 2, 3, 6, 7)]
        assert r.execute_command("KV.MATCH", NS, b"k000", b"k001", b"k002", b"k003") == 4
        assert mover.store(job) == 0  # all stored: nothing written
        loaded = [False, False]
        mover.rows = np.zeros_like(rows)
        mover.load([b"k002", b"k007"], [0, 1], loaded)
        assert loaded == [True, True] and np.array_equal(mover.rows[1], rows[7])
    finally:
        mover.close()
