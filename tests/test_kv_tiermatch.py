"""KV.TIERMATCH and ``/tiermatch``: the per-tier longest prefix a router that polls asks for,
by hashes or token ids, through redis-py and HTTP against a real server; the poll touches no
chunk (it is no access, so it cannot keep chunks hot)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import redis

from kvstrata.chunks import ChunkKey
from kvstrata.store.hashing import chunk_hashes
from tests.conftest import free_port

NS = "route@bf16@c16"


def _ids(n: int) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in range(n))


def _wait_tiers(r: redis.Redis, h: bytes, want: list[bytes]) -> None:
    deadline = time.monotonic() + 20
    while r.execute_command("KV.INFO", NS, h)[b"tiers"] != want:
        assert time.monotonic() < deadline, r.execute_command("KV.INFO", NS, h)
        time.sleep(0.02)


def test_per_tier_prefixes_by_hashes_tokens_and_http(make_server) -> None:
    """Scenario: a chain of four chunks (hashed from token ids as KV.MATCHTOKENS hashes them) is
    demoted to NVMe, then its first chunk is read back (promoted into DRAM). A poll by hashes
    and one by token ids both say: 4 chunks (64 tokens) held, the longest DRAM-only prefix is 1,
    the longest NVMe prefix 4; /tiermatch says the same in JSON; no chunk's last access moved."""
    port = free_port()
    srv = make_server(metrics_port=port, kv_events_node="node-a")
    r = redis.Redis(port=srv.port)
    hashes = chunk_hashes(_ids(72), NS, 16, [])  # 4 full chunks, 8 tokens left over
    assert len(hashes) == 4
    for i, h in enumerate(hashes):
        r.execute_command("KV.PUT", NS, h, hashes[i - 1] if i else b"", b"v" * 65536,
                          "TOKENS", 16)  # fmt: skip
    r.execute_command("CONFIG", "SET", "dram-low-watermark", "0.0001",
                      "dram-high-watermark", "0.0001")  # fmt: skip
    for h in hashes:
        _wait_tiers(r, h, [b"nvme"])
    r.execute_command("CONFIG", "SET", "dram-high-watermark", "0.95", "dram-low-watermark", "0.85")
    assert r.execute_command("KV.GET", NS, hashes[0]) == b"v" * 65536
    _wait_tiers(r, hashes[0], [b"dram", b"nvme"])

    index = srv.server.store.state.index
    before = [index.get(ChunkKey(NS, h)).last_access for h in hashes]
    by_hash = r.execute_command("KV.TIERMATCH", NS, "HASHES", *hashes, b"unknown")
    assert by_hash == {b"node": b"node-a", b"matched": 4, b"tokens": 64,
                       b"tiers": {b"dram": 1, b"nvme": 4}}  # fmt: skip
    by_tokens = r.execute_command("KV.TIERMATCH", NS, "TOKENS", _ids(72), "CHUNK", 16)
    assert by_tokens[b"hashes"] == hashes
    assert (by_tokens[b"matched"], by_tokens[b"tokens"], by_tokens[b"tiers"]) == (
        4, 64, {b"dram": 1, b"nvme": 4}
    )  # fmt: skip
    assert [index.get(ChunkKey(NS, h)).last_access for h in hashes] == before

    url = f"http://127.0.0.1:{port}/tiermatch?ns={NS}&tokens=" + ",".join(map(str, range(72)))
    with urllib.request.urlopen(url + "&chunk=16", timeout=10) as reply:
        assert reply.headers["Content-Type"] == "application/json"
        body = json.loads(reply.read())
    want = {"node": "node-a", "matched": 4, "tokens": 64, "tiers": {"dram": 1, "nvme": 4}}
    assert body == {**want, "hashes": [h.hex() for h in hashes]}
    hexes = ",".join(h.hex() for h in hashes[:2])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/tiermatch?ns={NS}&hashes={hexes}",
                                timeout=10) as reply:  # fmt: skip
        assert json.loads(reply.read())["tiers"] == {"dram": 1, "nvme": 2}
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/tiermatch?ns={NS}&hashes=zz", timeout=10)
    assert bad.value.code == 400


def test_bad_queries_are_errors(make_server) -> None:
    r = redis.Redis(port=make_server().port)
    with pytest.raises(redis.ResponseError, match="HASHES or TOKENS"):
        r.execute_command("KV.TIERMATCH", NS, "CHAIN", b"x")
    with pytest.raises(redis.ResponseError, match="multiple of 4"):
        r.execute_command("KV.TIERMATCH", NS, "TOKENS", b"abc")
    with pytest.raises(redis.ResponseError, match="syntax"):
        r.execute_command("KV.TIERMATCH", NS, "TOKENS", _ids(16), "CHUNK")
    # KV.TIERMATCH TOKENS and KV.MATCHTOKENS read their options with one parser: the same
    # words, the same replies
    for cmd in (("KV.TIERMATCH", NS, "TOKENS"), ("KV.MATCHTOKENS", NS)):
        with pytest.raises(redis.ResponseError, match="unknown option 'CHUNKS'"):
            r.execute_command(*cmd, _ids(16), "chunks", 16)
        with pytest.raises(redis.ResponseError, match="syntax"):
            r.execute_command(*cmd, _ids(16), "EXTRA")
        with pytest.raises(redis.ResponseError, match="invalid CHUNK: value is not an integer"):
            r.execute_command(*cmd, _ids(16), "CHUNK", "x")
    empty = r.execute_command("KV.TIERMATCH", NS, "HASHES", b"h")
    assert empty[b"matched"] == 0 and empty[b"node"].endswith(b":%d" % r.connection_pool
                                                                .connection_kwargs["port"])
