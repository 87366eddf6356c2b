"""End to end: the Python clients (sync and async) and plain redis-py against a real kvstrata
server in a subprocess: puts, matches, server-side token hashing equal to the client's,
receive into a tensor, zero-copy leases and reserves over the server's shared-memory arena."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from kvstrata.clients import (
    AsyncClient,
    Client,
    LeaseError,
    MatchResult,
    TokenMatch,
    chunk_hashes,
)
from tests.conftest import RunningServer, start_process_server

NS = "e2e-model@bf16@tp1r0@c16"
CHUNK = 16
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_process_server(tmp_path_factory.mktemp("e2e"), dram_capacity="96MiB")
    yield server
    server.stop()


def _prompt(seed: int, chunks: int) -> tuple[np.ndarray, list[bytes]]:
    tokens = np.random.default_rng(seed).integers(0, 128_000, chunks * CHUNK + 5, dtype=np.uint32)
    return tokens, chunk_hashes(tokens, NS, CHUNK)


def test_put_match_get_and_server_hashing(srv: RunningServer) -> None:
    tokens, hs = _prompt(1, 4)
    payloads = [np.full(MiB, i, dtype=np.uint8) for i in range(4)]
    with Client(port=srv.port) as kv:
        for i in range(3):
            assert kv.put(NS, hs[i], hs[i - 1] if i else None, payloads[i], tokens=CHUNK)
        assert kv.put(NS, hs[0], None, payloads[0], nx=True) is False
        assert kv.match(NS, hs) == 3
        assert kv.match_tiers(NS, hs) == MatchResult(3, ("dram",) * 3)
        got = kv.match_tokens(NS, tokens, chunk_tokens=CHUNK)
        assert isinstance(got, TokenMatch) and got.matched_chunks == 3
        assert got.matched_tokens == 3 * CHUNK
        assert list(got.hashes[:3]) == hs[:3]  # the server hashes exactly as the client
        out = np.zeros(2 * MiB, dtype=np.uint8)
        view = kv.get(NS, hs[1], out=out)
        assert view.nbytes == MiB and (out[:MiB] == 1).all() and not out[MiB:].any()
        assert kv.get(NS, hs[3]) is None
        many = kv.mget(NS, hs)
        assert [bytes(m[:1]) if m is not None else None for m in many] == [
            b"\0", b"\1", b"\2", None,
        ]  # fmt: skip
        info = kv.info(NS, hs[1])
        assert (
            info is not None
            and info["size"] == MiB
            and info["parent"] in (hs[0], hs[0].hex().encode())
        )
        assert kv.delete(NS, hs[1], cascade=True) == 2
        assert kv.match(NS, hs) == 1
        assert "dram" in kv.stats()


def test_32mib_into_tensor(srv: RunningServer) -> None:
    torch = pytest.importorskip("torch")
    _, hs = _prompt(2, 1)
    payload = torch.randn(16 * MiB, dtype=torch.float32).to(torch.bfloat16)
    with Client(port=srv.port) as kv:
        assert kv.put(NS, hs[0], None, payload)
        out = torch.empty(16 * MiB, dtype=torch.bfloat16)
        view = kv.get(NS, hs[0], out=out)
        assert view.nbytes == 32 * MiB and torch.equal(out, payload)
        assert kv.delete(NS, hs[0]) == 1


def test_lease_and_reserve_zero_copy(srv: RunningServer) -> None:
    _, hs = _prompt(3, 2)
    with Client(port=srv.port) as kv:
        with kv.reserve(NS, hs[0], None, 4096, tokens=CHUNK) as w:
            arr = w.array(np.float32)
            arr[:] = np.arange(1024, dtype=np.float32)
        assert kv.get(NS, hs[0]) == np.arange(1024, dtype=np.float32).tobytes()
        with pytest.raises(RuntimeError), kv.reserve(NS, hs[1], hs[0], 64) as w2:
            raise RuntimeError("engine failed mid-write")
        assert kv.get(NS, hs[1]) is None
        lease = kv.lease(NS, hs, ttl_ms=5000)
        assert lease is not None and len(lease) == 1
        with lease:
            assert np.array_equal(lease.arrays(np.float32)[0], np.arange(1024, dtype=np.float32))
            assert {h.region for h in lease.handles} <= {r.name for r in kv.regions()}
        with pytest.raises(LeaseError):
            kv.release(lease.lease_id)
        with pytest.raises(LeaseError):
            kv.commit(w2.lease_id)
        assert kv.lease(NS, [hs[1]]) is None
        assert [r.kind for r in kv.regions()] == ["shm"]


def test_async_client_end_to_end(srv: RunningServer) -> None:
    tokens, hs = _prompt(4, 3)

    async def main() -> None:
        async with AsyncClient(port=srv.port, max_connections=4) as kv:
            await asyncio.gather(
                *(kv.put(NS, h, hs[i - 1] if i else None, bytes([i]) * 70_000) for i, h in
                  enumerate(hs))
            )  # fmt: skip
            assert await kv.match(NS, hs) == 3
            assert (await kv.match_tokens(NS, tokens, CHUNK)).hashes[:3] == tuple(hs)
            out = bytearray(70_000)
            await kv.get(NS, hs[2], out=out)
            assert out == b"\2" * 70_000
            lease = await kv.lease(NS, hs)
            assert lease is not None
            async with lease:
                assert bytes(lease.views()[1][:3]) == b"\1\1\1"
            async with await kv.reserve(NS, b"\x42" * 32, hs[2], 10) as w:
                w.write(b"0123456789")
            assert await kv.get(NS, b"\x42" * 32) == b"0123456789"
            assert await kv.delete(NS, hs[0], cascade=True) == 4

    asyncio.run(main())


def test_plain_redis_py_drives_kv_commands(srv: RunningServer) -> None:
    redis = pytest.importorskip("redis")
    _, hs = _prompt(5, 2)
    r = redis.Redis(port=srv.port, protocol=3)
    assert r.execute_command("KV.PUT", NS, hs[0], b"", b"x" * 1000, "TOKENS", CHUNK) == 1
    assert r.execute_command("KV.PUT", NS, hs[1], hs[0], b"y" * 1000) == 1
    assert r.execute_command("KV.MATCH", NS, *hs) == 2
    assert r.execute_command("KV.GET", NS, hs[1]) == b"y" * 1000
    assert r.exists(f"kv:{NS}:{hs[0].hex()}") == 1
    assert r.execute_command("KV.DEL", NS, hs[0], "CASCADE") == 2
    r.close()
