"""Typed KV.* client methods against a small fake RESP server that follows the wire contract
(RESP3 and RESP2 replies), incl. leases and reserves over a real shared-memory region that the
test creates the way the server's DRAM arena does, and the RESP2 fallback when HELLO fails."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest

from kvstrata.clients import (
    AsyncClient,
    BufferTooSmall,
    Client,
    LeaseError,
    MatchResult,
    RegionInfo,
    TokenMatch,
    chunk_hashes,
    pack_tokens,
)
from kvstrata.clients import handles as client_handles
from kvstrata.clients.resp import ReplyReader
from kvstrata.protocol.encoder import encode_reply
from kvstrata.protocol.errors import CommandError, RespError
from kvstrata.protocol.errors import LeaseError as NoLease
from kvstrata.protocol.frames import OK, Simple

NS = "test-model@bf16@c4"


@dataclass
class FakeKV:
    """In-memory KV.* semantics; chunk bytes live in a shared-memory arena (bump allocator)."""

    shm: shared_memory.SharedMemory
    hello: bool = True
    chunks: dict[tuple[str, bytes], tuple[bytes, int, int, int]] = field(default_factory=dict)
    leases: dict[bytes, Any] = field(default_factory=dict)
    seen: list[list[bytes]] = field(default_factory=list)
    top: int = 0
    next_lease: int = 0
    gate: threading.Event | None = None  # when set, KV.MATCH answers only once it is set

    def alloc(self, n: int) -> int:
        off, self.top = self.top, self.top + n
        assert self.top <= self.shm.size, "fake arena full"
        return off

    @property
    def buf(self) -> memoryview:
        assert self.shm.buf is not None
        return self.shm.buf

    def payload(self, key: tuple[str, bytes]) -> bytes:
        _, off, n, _ = self.chunks[key]
        return bytes(self.buf[off : off + n])

    def lease_id(self, kind: str, value: Any) -> bytes:
        self.next_lease += 1
        lid = b"L%d" % self.next_lease
        self.leases[lid] = (kind, value)
        return lid

    def prefix(self, ns: str, hashes: list[bytes]) -> int:
        n = 0
        while n < len(hashes) and (ns, hashes[n]) in self.chunks:
            n += 1
        return n


def _opts(args: list[bytes], flags: tuple[bytes, ...]) -> dict[bytes, Any]:
    out: dict[bytes, Any] = {}
    i = 0
    while i < len(args):
        word = args[i].upper()
        if word in flags:
            out[word] = True
            i += 1
        else:
            out[word] = args[i + 1]
            i += 2
    return out


def handle_command(kv: FakeKV, conn: dict[str, Any], a: list[bytes]) -> Any:
    name = a[0].upper()
    kv.seen.append(a)
    if name == b"HELLO":
        if not kv.hello:
            return CommandError("unknown command 'HELLO'")
        conn["resp3"] = a[1] == b"3"
        return {"server": "fake", "proto": 3 if conn["resp3"] else 2}
    if name in (b"CLIENT", b"AUTH"):
        return OK
    if name == b"PING":
        return Simple(b"PONG")
    ns = a[1].decode() if len(a) > 1 else ""
    if name == b"KV.PUT":
        o = _opts(a[5:], (b"NX",))
        if o.get(b"NX") and (ns, a[2]) in kv.chunks:
            return 0
        off = kv.alloc(len(a[4]))
        kv.buf[off : off + len(a[4])] = a[4]
        kv.chunks[(ns, a[2])] = (a[3], off, len(a[4]), int(o.get(b"TOKENS", 0)))
        return 1
    if name == b"KV.GET":
        return kv.payload((ns, a[2])) if (ns, a[2]) in kv.chunks else None
    if name == b"KV.MGET":
        return [kv.payload((ns, h)) if (ns, h) in kv.chunks else None for h in a[2:]]
    if name == b"KV.MATCH":
        if kv.gate is not None:
            assert kv.gate.wait(30)
        opts = {w.upper() for w in a[2:] if w.upper() in (b"WITHTIERS", b"PREFETCH")}
        hashes = [h for h in a[2:] if h.upper() not in opts]
        n = kv.prefix(ns, hashes)
        return [n, ["dram"] * n] if b"WITHTIERS" in opts else n
    if name == b"KV.MATCHTOKENS":
        extra: list[bytes] = []
        if b"EXTRA" in a:
            extra = a[a.index(b"EXTRA") + 1 :]
            a = a[: a.index(b"EXTRA")]
        chunk = int(_opts(a[3:], ()).get(b"CHUNK", 4))
        hashes = chunk_hashes(a[2], ns, chunk, extra)
        n = kv.prefix(ns, hashes)
        return [n * chunk, n, hashes[:n]]
    if name == b"KV.LEASE":
        hashes = a[2 : a.index(b"TTL")] if b"TTL" in a else a[2:]
        n = kv.prefix(ns, hashes)
        if n == 0:
            return [None, []]
        handles = [["dram0", kv.chunks[(ns, h)][1], kv.chunks[(ns, h)][2]] for h in hashes[:n]]
        return [kv.lease_id("read", None), handles]
    if name == b"KV.RESERVE":
        nbytes = int(a[4])
        off = kv.alloc(nbytes)
        tokens = int(_opts(a[5:], ()).get(b"TOKENS", 0))
        lid = kv.lease_id("write", (ns, a[2], a[3], off, nbytes, tokens))
        return [lid, ["dram0", off, nbytes]]
    if name in (b"KV.COMMIT", b"KV.ABORT", b"KV.RELEASE"):
        kind, value = kv.leases.pop(a[1], (None, None))
        if kind is None or (kind == "read") != (name == b"KV.RELEASE"):
            return NoLease("no such lease")
        if name == b"KV.COMMIT":
            ns2, h, parent, off, n, tokens = value
            kv.chunks[(ns2, h)] = (parent, off, n, tokens)
        return OK
    if name == b"KV.REGIONS":
        return [{"name": "dram0", "kind": "shm", "size": kv.shm.size, "path": kv.shm.name,
                 "device": -1}]  # fmt: skip
    if name == b"KV.INFO":
        if (ns, a[2]) not in kv.chunks:
            return None
        parent, _, size, tokens = kv.chunks[(ns, a[2])]
        return {"size": size, "tokens": tokens, "parent": parent, "tiers": ["dram"]}
    if name == b"KV.DEL":
        doomed, frontier = set(), [a[2]]
        while frontier:
            h = frontier.pop()
            if (ns, h) in kv.chunks and h not in doomed:
                doomed.add(h)
                if b"CASCADE" in a[3:]:
                    frontier += [k[1] for k, v in kv.chunks.items() if k[0] == ns and v[0] == h]
        for h in doomed:
            del kv.chunks[(ns, h)]
        return len(doomed)
    if name == b"KV.STATS":
        return {"dram": {"chunks": len(kv.chunks), "used": kv.top}, "nvme": {"chunks": 0}}
    return CommandError(f"unknown command '{a[0].decode()}'")


def _serve_conn(kv: FakeKV, sock: socket.socket) -> None:
    conn: dict[str, Any] = {"resp3": False}
    commands: list[Any] = []
    reader = ReplyReader(commands.append)  # requests are RESP arrays of bulks, too
    with sock:
        while True:
            try:
                n = sock.recv_into(reader.get_buffer())
            except OSError:
                return
            if n == 0:
                return
            reader.buffer_updated(n)
            out: list[Any] = []
            for args in commands:
                encode_reply(handle_command(kv, conn, [bytes(x) for x in args]), conn["resp3"], out)
            commands.clear()
            if out:
                sock.sendmsg(out)


@pytest.fixture
def fake() -> Iterator[tuple[FakeKV, int]]:
    shm = shared_memory.SharedMemory(create=True, size=4 * 1024 * 1024)
    kv = FakeKV(shm)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                s, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve_conn, args=(kv, s), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield kv, port
    listener.close()
    client_handles.close_all()
    shm.close()
    shm.unlink()


@pytest.fixture(params=[3, 2], ids=["resp3", "resp2"])
def client(request: pytest.FixtureRequest, fake: tuple[FakeKV, int]) -> Iterator[Client]:
    with Client(port=fake[1], protocol=request.param) as c:
        yield c


def chain(n: int, extra: tuple[bytes, ...] = ()) -> tuple[list[int], list[bytes]]:
    tokens = list(range(100, 100 + 4 * n))
    return tokens, chunk_hashes(tokens, NS, 4, extra)


def test_put_get_match(client: Client, fake: tuple[FakeKV, int]) -> None:
    _, hs = chain(3)
    assert client.put(NS, hs[0], None, b"chunk0", tokens=4) is True
    assert client.put(NS, hs[1], hs[0], np.arange(8, dtype=np.uint16), tokens=4, ttl_ms=500)
    assert client.put(NS, hs[0], None, b"other", nx=True) is False
    put = fake[0].seen[-2]
    assert put[:4] == [b"KV.PUT", NS.encode(), hs[1], hs[0]]
    assert put[5:] == [b"TOKENS", b"4", b"TTL", b"500"]
    assert fake[0].seen[-1][-1] == b"NX"
    assert client.get(NS, hs[0]) == b"chunk0"
    assert client.get(NS, hs[2]) is None
    assert client.match(NS, hs) == 2
    assert client.match_tiers(NS, hs) == MatchResult(2, ("dram", "dram"))
    assert client.mget(NS, [hs[0], hs[2]]) == [b"chunk0", None]
    assert client.get(NS, hs[0].hex()) == b"chunk0"  # a str hash is hex


def test_get_and_mget_into_buffers(client: Client) -> None:
    _, hs = chain(2)
    payload = np.random.default_rng(5).integers(0, 256, 200_000, dtype=np.uint8)
    client.put(NS, hs[0], None, payload)
    client.put(NS, hs[1], hs[0], b"small")
    out = np.zeros(250_000, dtype=np.uint8)
    view = client.get(NS, hs[0], out=out)
    assert view.nbytes == 200_000 and np.array_equal(out[:200_000], payload)
    with pytest.raises(BufferTooSmall):
        client.get(NS, hs[0], out=bytearray(10))
    a, b = bytearray(200_000), bytearray(16)
    got = client.mget(NS, hs, outs=[a, b])
    assert bytes(got[1]) == b"small" and b[:5] == b"small" and a == payload.tobytes()


def test_match_tokens(client: Client, fake: tuple[FakeKV, int]) -> None:
    tokens, hs = chain(3, (b"lora-1",))
    for i, h in enumerate(hs[:2]):
        client.put(NS, h, hs[i - 1] if i else None, b"x")
    got = client.match_tokens(NS, [*tokens, 1, 2], chunk_tokens=4, extra=[b"lora-1"])
    assert got == TokenMatch(8, 2, tuple(hs[:2]))
    sent = fake[0].seen[-1]
    assert sent[2] == pack_tokens([*tokens, 1, 2]) and sent[3:] == [b"CHUNK", b"4", b"EXTRA",
                                                                      b"lora-1"]  # fmt: skip
    assert client.match_tokens(NS, np.array(tokens), chunk_tokens=4).matched_chunks == 0


def test_lease_views(client: Client) -> None:
    _, hs = chain(3)
    client.put(NS, hs[0], None, np.arange(16, dtype=np.float32))
    client.put(NS, hs[1], hs[0], b"\x01" * 64)
    assert client.lease(NS, [hs[2]]) is None
    lease = client.lease(NS, hs, ttl_ms=1000)
    assert lease is not None
    with lease:
        assert len(lease) == 2 and lease.hashes == tuple(hs[:2])
        arrays = lease.arrays(np.float32)
        assert np.array_equal(arrays[0], np.arange(16, dtype=np.float32))
        assert not arrays[0].flags.writeable
        assert bytes(lease.views()[1]) == b"\x01" * 64
        torch = pytest.importorskip("torch")
        t = lease.tensors(torch.float32)[0]
        assert torch.equal(t, torch.arange(16, dtype=torch.float32))
    assert lease.done
    with pytest.raises(LeaseError):
        client.release(lease.lease_id)  # already released by the context manager


def test_reserve_commit_and_abort(client: Client) -> None:
    _, hs = chain(2)
    with client.reserve(NS, hs[0], None, 32, tokens=4) as w:
        arr = w.array(np.uint32)
        arr[:] = np.arange(8, dtype=np.uint32) * 3
    assert w.done
    assert client.get(NS, hs[0]) == (np.arange(8, dtype=np.uint32) * 3).tobytes()
    with pytest.raises(ValueError, match="boom"), client.reserve(NS, hs[1], hs[0], 8) as w2:
        w2.write(b"abcd", offset=4)
        raise ValueError("boom")
    assert client.get(NS, hs[1]) is None
    with pytest.raises(LeaseError):
        client.commit(w2.lease_id)
    with pytest.raises(ValueError, match="do not fit"):
        client.reserve(NS, hs[1], hs[0], 4).write(b"too long")


def test_regions_info_delete_stats(client: Client, fake: tuple[FakeKV, int]) -> None:
    regions = client.regions()
    assert regions == [RegionInfo("dram0", "shm", fake[0].shm.size, fake[0].shm.name, -1)]
    _, hs = chain(3)
    for i, h in enumerate(hs):
        client.put(NS, h, hs[i - 1] if i else None, b"p%d" % i, tokens=4)
    info = client.info(NS, hs[1])
    assert info is not None and info["size"] == 2 and info["tokens"] == 4
    assert info["parent"] == hs[0]
    assert client.info(NS, b"\x00" * 32) is None
    assert client.delete(NS, hs[2]) == 1
    assert client.delete(NS, hs[0], cascade=True) == 2
    assert client.match(NS, hs) == 0
    stats = client.stats()
    assert stats["dram"]["chunks"] == 0 and stats["nvme"] == {"chunks": 0}


def test_pipeline_of_kv_commands(client: Client) -> None:
    _, hs = chain(2)
    p = client.pipeline()
    p.put(NS, hs[0], None, b"a").put(NS, hs[1], hs[0], b"b").match(NS, hs).get(NS, hs[1])
    p.release(b"nope")
    res = p.execute(raise_on_error=False)
    assert res[:4] == [True, True, 2, b"b"] and isinstance(res[4], LeaseError)


def test_resp2_fallback_when_hello_fails(fake: tuple[FakeKV, int]) -> None:
    fake[0].hello = False
    with Client(port=fake[1], password="pw", client_name="me") as c:
        conn = c.pool.acquire()
        assert conn.protocol == 2
        c.pool.release(conn)
        assert c.ping()
    names = [cmd[:2] for cmd in fake[0].seen]
    assert [b"AUTH", b"pw"] in names and [b"CLIENT", b"SETNAME"] in names
    setinfo = [cmd for cmd in fake[0].seen if cmd[:2] == [b"CLIENT", b"SETINFO"]]
    assert [b"CLIENT", b"SETINFO", b"LIB-NAME", b"kvstrata-py"] in setinfo


def test_error_reply_types(client: Client) -> None:
    with pytest.raises(CommandError, match="unknown command"):
        client.execute("KV.NOPE")
    with pytest.raises(RespError):
        client.abort(b"L999")


def test_async_client_kv(fake: tuple[FakeKV, int]) -> None:
    async def main() -> None:
        async with AsyncClient(port=fake[1]) as c:
            _, hs = chain(2)
            assert await c.put(NS, hs[0], None, b"\x07" * 100_000)
            assert await c.match(NS, hs) == 1
            out = bytearray(100_000)
            assert (await c.get(NS, hs[0], out=out)).nbytes == 100_000 and out == b"\x07" * 100_000
            async with await c.reserve(NS, hs[1], hs[0], 16) as w:
                w.write(b"0123456789abcdef")
            lease = await c.lease(NS, hs)
            assert lease is not None
            async with lease:
                assert bytes(lease.views()[1]) == b"0123456789abcdef"
            with pytest.raises(LeaseError):
                await c.release(lease.lease_id)
            p = c.pipeline().match_tiers(NS, hs).delete(NS, hs[0], cascade=True).stats()
            tiers, deleted, stats = await p.execute()
            assert tiers == MatchResult(2, ("dram", "dram")) and deleted == 2
            assert stats["dram"]["chunks"] == 0

    asyncio.run(main())


def test_shm_is_not_unlinked_by_the_client(fake: tuple[FakeKV, int]) -> None:
    name = fake[0].shm.name
    region = RegionInfo("dram0", "shm", fake[0].shm.size, name)
    view = client_handles.map_shm(region)
    assert view.nbytes >= region.size
    view.release()
    client_handles.close_all()
    again = shared_memory.SharedMemory(name=name, create=False)  # still there
    again.close()
    with pytest.raises(client_handles.RegionMapError, match="does not exist"):
        client_handles.map_shm(RegionInfo("x", "shm", 10, "kvstrata-no-such-region"))


def test_cuda_region_without_cuda_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    region = RegionInfo("gpu0", "cuda", 1 << 20, "00" * 64, 0)
    with pytest.raises(client_handles.CudaUnavailable, match="CUDA"):
        client_handles.handle_tensor(region, client_handles.Handle("gpu0", 0, 16))
    with pytest.raises(client_handles.RegionMapError, match="not shm"):
        client_handles.handle_array(region, client_handles.Handle("gpu0", 0, 16))


def test_close_all_with_live_views_keeps_them_valid(client: Client) -> None:
    _, hs = chain(1)
    client.put(NS, hs[0], None, b"live-view")
    lease = client.lease(NS, hs)
    assert lease is not None
    arr = lease.arrays()[0]
    assert client_handles.close_all() == 1  # arr still exports the mapping
    assert arr.tobytes() == b"live-view"
    assert bytes(lease.views()[0]) == b"live-view"  # mapped again on demand
    lease.release()


def test_timeout_closes_connection_and_raises_timeout() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    try:
        with pytest.raises(TimeoutError):
            Client(port=listener.getsockname()[1], timeout=0.2)
    finally:
        listener.close()


def test_receive_ready_never_waits_for_the_server(fake: tuple[FakeKV, int]) -> None:
    """``receive_ready``: None while a reply has not arrived (the fake holds KV.MATCH on a
    gate), the replies once all have, in order; the stream stays usable afterwards."""
    import select

    from kvstrata.clients.connection import ConnectionSettings, SyncConnection

    kv, port = fake
    _, hs = chain(3)
    kv.chunks[(NS, hs[0])] = (b"", 0, 0, 4)
    kv.gate = threading.Event()
    with SyncConnection(ConnectionSettings(port=port)) as conn:
        conn.send([("KV.MATCH", NS, *hs), ("KV.MATCH", NS, hs[1])])
        assert conn.receive_ready(2) is None
        assert conn.receive_ready(2) is None  # asked again: still nothing, no wait
        kv.gate.set()
        while (got := conn.receive_ready(2)) is None:
            assert select.select([conn._sock], [], [], 10)[0], "no reply in 10 s"
        assert got == [1, 0]
        assert conn.receive_ready(0) == []
        assert conn.execute("KV.MATCH", NS, hs[0]) == 1
