"""The clients' batched writes against a real server on port 0: ``reserve_chain`` (one
KV.MRESERVE, slots filled in place, one KV.COMMIT), ``put_chain`` (the same, cut into batches;
KV.PUT over the socket when the arena cannot be mapped), sync and async, and a client kept open
across a server restart (its old batch is never committed, its new one lands in the new arena).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from kvstrata.clients import AsyncClient, Client, LeaseError, chain_stream
from kvstrata.clients import handles as client_handles
from kvstrata.clients.handles import RegionMapError
from kvstrata.clients.leases import batch_slices
from kvstrata.protocol.errors import LeaseLimitError
from tests.conftest import RunningServer, free_port, start_process_server
from tests.fakes import wait_for

NS = "cbatch@u8@c16"


def payload(i: int, n: int = 4096) -> bytes:
    return bytes([i % 251 + 1]) * n


def hashes(n: int, tag: bytes = b"h") -> list[bytes]:
    return [tag + b"%03d" % i for i in range(n)]


def used(srv: RunningServer) -> int:
    return int(redis.Redis(port=srv.port).info("tiers")["dram_used"])


def test_reserve_chain_commits_all_on_success_and_aborts_all_on_error(
    server: RunningServer,
) -> None:
    hs = hashes(3)
    with Client(port=server.port) as kv:
        assert kv.put(NS, hs[0], None, payload(0))
        with kv.reserve_chain(NS, None, hs, [4096, 8, 16], tokens=16) as batch:
            assert batch.states == ("exists", "reserved", "reserved")
            assert batch.reserved == [1, 2]
            with pytest.raises(KeyError, match="exists"):
                batch.view(0)
            batch.array(1)[:] = 7
            batch.write(2, b"x" * 16)
            with pytest.raises(ValueError, match="do not fit"):
                batch.write(2, b"y" * 17)
            assert kv.match(NS, hs) == 1  # invisible until the commit
        assert batch.done
        assert kv.match(NS, hs) == 3
        assert kv.mget(NS, hs[1:]) == [b"\x07" * 8, b"x" * 16]
        info = kv.info(NS, hs[2])
        assert info is not None and info["tokens"] == 16
        with (
            pytest.raises(RuntimeError, match="boom"),
            kv.reserve_chain(NS, hs[2], hashes(2, b"g"), [10, 10]) as failing,
        ):
            failing.write(0, b"z" * 10)
            raise RuntimeError("boom")
        assert kv.match(NS, hashes(2, b"g")) == 0
        with pytest.raises(LeaseError):
            kv.commit(failing.lease_id)
        assert wait_for(lambda: used(server) == 3 * 4096)  # only the three chunks stored


def test_all_stored_gives_a_batch_without_lease(server: RunningServer) -> None:
    hs = hashes(2)
    with Client(port=server.port) as kv:
        assert kv.put_chain(NS, hs, [payload(0), payload(1)]) == ["stored", "stored"]
        with kv.reserve_chain(NS, None, hs, [4096, 4096]) as batch:
            assert batch.lease_id is None and batch.reserved == [] and batch.done
        assert kv.put_chain(NS, hs, [payload(0), payload(1)]) == ["exists", "exists"]


class Wire:
    """What a blocking client sends and reads on the connection of its first KV.MRESERVE, and
    the slots it fills, in order: ``"> KV.MRESERVE 3"`` (a reservation of 3 chunks),
    ``"> KV.COMMIT + KV.MRESERVE 2"`` (two commands in one write), ``"< Simple"`` (a reply read,
    by type), ``"fill"`` (a slot written). Other connections (one opened to map the arena) and
    KV.REGIONS are left out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvstrata.clients.connection import SyncConnection
        from kvstrata.clients.sync_leases import WriteBatch

        self.events: list[tuple[int, str]] = []
        send, receive, pipeline = (
            SyncConnection.send,
            SyncConnection.receive,
            SyncConnection.pipeline,
        )
        write = WriteBatch.write

        def sent(conn: SyncConnection, commands: Any) -> None:
            names = [
                f"{c[0]} {int(c[3])}" if c[0] == "KV.MRESERVE" else str(c[0]) for c in commands
            ]
            self.events.append((id(conn), "> " + " + ".join(names)))  # one write

        def read(conn: SyncConnection, replies: list[Any]) -> list[Any]:
            self.events += [(id(conn), f"< {type(r).__name__}") for r in replies]
            return replies

        def on_send(conn: SyncConnection, commands: Any, outs: Any = None) -> None:
            sent(conn, commands)
            send(conn, commands, outs)

        def on_receive(conn: SyncConnection, count: int) -> list[Any]:
            return read(conn, receive(conn, count))

        def on_pipeline(conn: SyncConnection, commands: Any, outs: Any = None) -> list[Any]:
            sent(conn, commands)
            return read(conn, pipeline(conn, commands, outs))

        def on_write(batch: WriteBatch, i: int, data: Any, offset: int = 0) -> None:
            self.events.append((0, "fill"))
            write(batch, i, data, offset)

        monkeypatch.setattr(SyncConnection, "send", on_send)
        monkeypatch.setattr(SyncConnection, "receive", on_receive)
        monkeypatch.setattr(SyncConnection, "pipeline", on_pipeline)
        monkeypatch.setattr(WriteBatch, "write", on_write)

    def kv(self) -> list[str]:
        main = next(c for c, e in self.events if e.startswith("> KV.MRESERVE"))
        out, regions = [], False  # (a KV.REGIONS round trip on it: the arena mapped)
        for c, e in self.events:
            if c not in (0, main):
                continue
            if e == "> KV.REGIONS" or (regions and e.startswith("<")):
                regions = not regions
                continue
            out.append(e)
        return out


def test_put_chain_streams_long_chains_and_links_them(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With parts of 3 chunks (PIPE_BYTES, PIPE_CHUNKS), a chain of 8 goes in three KV.MRESERVE on
    one connection, each part's reservation sent before the part ahead of it is filled (the
    server reserves while the client copies) and with the commit of the part before, each
    commit's reply read before the next commit is sent; the links cross part borders and the
    parent of the first chunk is kept."""
    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 3000)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    with Client(port=server.port) as kv:
        kv.put(NS, b"root", None, b"r")
        hs = hashes(8)
        data = [np.full(1000 + i, i, np.uint8) for i in range(8)]
        wire = Wire(monkeypatch)
        assert kv.put_chain(NS, hs, data, parent=b"root", tokens=16) == ["stored"] * 8
        fill3 = ["fill"] * 3
        assert wire.kv() == [
            "> KV.MRESERVE 3", "< list",
            "> KV.MRESERVE 3", *fill3, "< list", "> KV.COMMIT + KV.MRESERVE 2",
            *fill3, "< Simple", "< list", "> KV.COMMIT",
            "fill", "fill", "< Simple", "> KV.COMMIT", "< Simple",
        ]  # fmt: skip
        monkeypatch.undo()
        assert kv.match(NS, [b"root", *hs]) == 9
        assert kv.mget(NS, hs) == [d.tobytes() for d in data]
        assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


def test_streams_from_threads_sharing_a_client_each_hold_their_own_connection(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads stream chains of 12 chunks (parts of 2) through one Client at once: each
    stream holds a pooled connection of its own, so replies never cross; every chunk reads
    back exactly and no lease is left."""
    import threading

    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    chains = [hashes(12, b"th%d-" % t) for t in range(4)]
    data = [[payload(t * 16 + i) for i in range(12)] for t in range(4)]
    results: dict[int, Any] = {}
    start = threading.Barrier(4)

    with Client(port=server.port) as kv:

        def run(t: int) -> None:
            start.wait()
            try:
                results[t] = kv.put_chain(NS, chains[t], data[t])
            except BaseException as exc:
                results[t] = exc

        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert results == {t: ["stored"] * 12 for t in range(4)}
        for t in range(4):
            assert kv.mget(NS, chains[t]) == data[t]
            assert kv.match(NS, chains[t]) == 12
    assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


def test_streamed_put_chain_reports_existing_chunks_and_whole_existing_parts(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of 2: the second one holds a stored chunk, the third is stored whole (no lease:
    nothing to fill or commit); every state is right and the bytes read back exactly, no lease
    left."""
    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    hs = hashes(8)
    with Client(port=server.port) as kv:
        for i in (2, 4, 5):
            assert kv.put(NS, hs[i], hs[i - 1], payload(i))
        states = kv.put_chain(NS, hs, [payload(i) for i in range(8)])
        want = ["stored", "stored", "exists", "stored", "exists", "exists", "stored", "stored"]
        assert states == want
        assert kv.mget(NS, hs) == [payload(i) for i in range(8)]
        assert kv.match(NS, hs) == 8
        assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


def test_async_put_chain_streams_and_aborts_the_reservation_ahead_of_a_failed_commit(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async client does as the blocking one: parts of 2 chunks (stored chunks and a
    whole stored part reported as such, exact bytes, no lease left); a refused commit aborts
    the part filled after it before raising."""
    from kvstrata.clients.aio_leases import AsyncWriteBatch

    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    hs = hashes(8, b"q")

    async def main() -> None:
        async with AsyncClient(port=server.port) as kv:
            for i in (2, 4, 5):
                assert await kv.put(NS, hs[i], hs[i - 1], payload(i))
            states = await kv.put_chain(NS, hs, [payload(i) for i in range(8)])
            want = ["stored", "stored", "exists", "stored", "exists", "exists", "stored"]
            assert states == [*want, "stored"]
            assert await kv.mget(NS, hs) == [payload(i) for i in range(8)]
            real = AsyncWriteBatch.commit_args

            def bad_digests(self: AsyncWriteBatch, indexes: Any) -> Any:
                named, digests = real(self, indexes)
                return named, tuple(d[:15] for d in digests)

            monkeypatch.setattr(AsyncWriteBatch, "commit_args", bad_digests)
            more = hashes(4, b"r")
            with pytest.raises(Exception, match="DIGEST"):
                await kv.put_chain(NS, more, [payload(i) for i in range(4)])
            monkeypatch.setattr(AsyncWriteBatch, "commit_args", real)
            assert await kv.match(NS, more) == 0
            async with AsyncClient(port=server.port) as other:
                batch = await other.reserve_chain(NS, more[1], more[2:], [4096, 4096])
                assert batch.states == ("reserved", "reserved")  # the lease was aborted
                await batch.abort()

    asyncio.run(main())
    # the refused part's own lease ends with its connection
    assert wait_for(lambda: redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0)


def test_a_refused_reservation_ends_the_stream_and_the_rest_is_halved(
    make_server: Callable[..., RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second part (3 MiB), reserved while the first (1 MiB) is filled, is refused
    (-LEASELIMIT: 2 MiB per client on a 4 MiB arena, nothing reserved): the first part is
    committed, and put_chain puts the rest the ordinary way, halving it, and stores the chain
    exactly."""
    import kvstrata.clients.sync as sync_mod

    monkeypatch.setattr(sync_mod, "pipe_slices", lambda sizes: [slice(0, 1), slice(1, 4)])
    srv = make_server(dram_capacity="4MiB", nvme_capacity="64MiB")
    data = [bytes([i + 1]) * (1 << 20) for i in range(4)]
    with Client(port=srv.port) as kv:
        wire = Wire(monkeypatch)
        assert kv.put_chain(NS, hashes(4), data, tokens=16) == ["stored"] * 4
        events = wire.kv()
        assert events[:6] == [
            "> KV.MRESERVE 1", "< list", "> KV.MRESERVE 3", "fill", "< LeaseLimitError",
            "> KV.COMMIT",
        ]  # fmt: skip
        assert events[6:] == [
            "< Simple",
            "> KV.MRESERVE 3", "< LeaseLimitError",  # the ordinary way: refused again, halved
            "> KV.MRESERVE 1", "< list", "fill", "> KV.COMMIT", "< Simple",
            "> KV.MRESERVE 2", "< list", "fill", "fill", "> KV.COMMIT", "< Simple",
        ]  # fmt: skip
        monkeypatch.undo()
        assert kv.match(NS, hashes(4)) == 4
        assert kv.mget(NS, hashes(4)) == data
        assert redis.Redis(port=srv.port).info("tiers")["kv_leases"] == 0


def test_a_failed_commit_aborts_the_part_filled_after_it(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first part's KV.COMMIT is refused (a malformed digest: the server touches no
    lease); the second part, reserved ahead and filled meanwhile, is aborted before the error
    is raised: its chunks are free for another client at once, nothing of it is stored."""
    from kvstrata.clients.sync_leases import WriteBatch

    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    real = WriteBatch.commit_args

    def bad_digests(self: WriteBatch, indexes: Any) -> Any:
        named, digests = real(self, indexes)
        return named, tuple(d[:15] for d in digests)

    monkeypatch.setattr(WriteBatch, "commit_args", bad_digests)
    hs = hashes(4)
    with Client(port=server.port) as kv, Client(port=server.port) as other:
        with pytest.raises(Exception, match="DIGEST"):
            kv.put_chain(NS, hs, [payload(i) for i in range(4)])
        monkeypatch.setattr(WriteBatch, "commit_args", real)
        assert kv.match(NS, hs) == 0
        with other.reserve_chain(NS, hs[1], hs[2:], [4096, 4096]) as batch:
            assert batch.states == ("reserved", "reserved")  # not "busy": the lease is gone
            batch.abort()


def test_an_exception_while_filling_aborts_that_part_and_the_one_reserved_ahead(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of 2; copying chunk 3 (the second part) raises: the exception reaches the caller,
    the first part stays stored (its commit was in flight), the second part's slots and the
    third part's reservation (sent before the second was filled) are aborted at once: another
    client reserves all four chunks, nothing is left leased, and the stream's connection
    serves the next call in step."""
    from kvstrata.clients.sync_leases import WriteBatch

    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    real = WriteBatch.write

    def failing(self: WriteBatch, i: int, data: Any, offset: int = 0) -> None:
        if self.hashes[i] == hs[3]:
            raise RuntimeError("copy failed")
        real(self, i, data, offset)

    monkeypatch.setattr(WriteBatch, "write", failing)
    hs = hashes(6, b"x")
    with Client(port=server.port, max_connections=2) as kv, Client(port=server.port) as other:
        with pytest.raises(RuntimeError, match="copy failed"):
            kv.put_chain(NS, hs, [payload(i) for i in range(6)])
        monkeypatch.setattr(WriteBatch, "write", real)
        assert kv.match(NS, hs) == 2
        assert kv.mget(NS, hs[:2]) == [payload(0), payload(1)]
        with other.reserve_chain(NS, hs[1], hs[2:], [4096] * 4) as batch:
            assert batch.states == ("reserved",) * 4  # none "busy": both leases are gone
            batch.abort()
        assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0
        assert (
            kv.put_chain(NS, hs, [payload(i) for i in range(6)]) == ["exists"] * 2 + ["stored"] * 4
        )
        assert kv.mget(NS, hs) == [payload(i) for i in range(6)]


def test_put_chain_halves_a_batch_the_servers_per_client_reserve_limit_refuses(
    make_server: Callable[..., RunningServer],
) -> None:
    """On a 4 MiB arena, lease-reserve-max-per-client (50 %) is 2 MiB: one KV.MRESERVE of a
    4 MiB chain is refused whole (-LEASELIMIT, nothing reserved), so put_chain (sync and
    async) halves the batch until the server takes it, links kept across the halves; a single
    chunk over the limit is still refused."""
    srv = make_server(dram_capacity="4MiB", nvme_capacity="64MiB")
    data = [bytes([i + 1]) * (1 << 20) for i in range(4)]
    with Client(port=srv.port) as kv:
        with pytest.raises(LeaseLimitError):  # what put_chain used to raise: one 4 MiB batch
            kv.reserve_chain(NS, None, hashes(4), [1 << 20] * 4, tokens=16)
        assert kv.put_chain(NS, hashes(4), data, tokens=16) == ["stored"] * 4
        assert kv.match(NS, hashes(4)) == 4
        assert kv.mget(NS, hashes(4)) == data
        with pytest.raises(LeaseLimitError):
            kv.put_chain(NS, [b"big"], [b"x" * (3 << 20)], tokens=16)

    async def main() -> None:
        async with AsyncClient(port=srv.port) as kv:
            hs = hashes(4, b"a")
            assert await kv.put_chain(NS, hs, data, tokens=16) == ["stored"] * 4
            assert await kv.match(NS, hs) == 4

    asyncio.run(main())


def test_pipe_slices() -> None:
    """Parts of at least PIPE_CHUNKS chunks and PIPE_BYTES bytes, the rest in the last one;
    never over a batch's bounds."""
    from kvstrata.clients.chain_stream import pipe_slices

    assert pipe_slices([]) == []
    mib = 1 << 20
    assert pipe_slices([mib] * 40) == [slice(0, 16), slice(16, 32), slice(32, 40)]
    assert pipe_slices([mib // 4] * 40) == [slice(0, 32), slice(32, 40)]  # 8 MiB
    assert pipe_slices([8 * mib] * 16) == [slice(0, 16)]  # one part: not streamed
    assert pipe_slices([5] * 5, min_bytes=8, min_chunks=1) == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 5),
    ]
    assert pipe_slices([1] * 600, min_bytes=10**9) == [
        slice(0, 256),
        slice(256, 512),
        slice(512, 600),
    ]


def test_batch_slices() -> None:
    assert batch_slices([]) == []
    assert batch_slices([5] * 5, max_chunks=2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert batch_slices([4, 4, 9, 1], max_bytes=8) == [slice(0, 2), slice(2, 3), slice(3, 4)]


def test_put_chain_falls_back_to_tcp_when_the_arena_cannot_be_mapped(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server on another host: mapping its region fails; the batch is aborted (no slot
    left), the chain goes over the socket, and the client stops trying shared memory."""

    def unmappable(region: Any) -> Any:
        raise RegionMapError("not on this host")

    monkeypatch.setattr(client_handles, "map_shm", unmappable)
    monkeypatch.setattr(client_handles, "_shm", {})
    hs = hashes(3)
    with Client(port=server.port) as kv:
        states = kv.put_chain(NS, hs, [payload(i) for i in range(3)])
        assert states == ["stored"] * 3 and not kv.shared_memory
        assert kv.mget(NS, hs) == [payload(i) for i in range(3)]
        assert wait_for(lambda: used(server) == 3 * 4096)  # the aborted slots are free
        assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_streamed_chain_falls_back_to_tcp_when_the_arena_cannot_be_mapped(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """The same from a stream (parts of 2): the first part's reservation is aborted, the
    reservation is never sent ahead, and the whole chain goes over the socket (sync and async);
    an exception while filling a streamed part aborts it in the async client too."""

    def unmappable(region: Any) -> Any:
        raise RegionMapError("not on this host")

    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    monkeypatch.setattr(client_handles, "map_shm", unmappable)
    monkeypatch.setattr(client_handles, "_shm", {})
    hs = hashes(6, b"t")
    data = [payload(i) for i in range(6)]
    if asynchronous:

        async def main() -> tuple[list[str], bool]:
            async with AsyncClient(port=server.port) as kv:
                return await kv.put_chain(NS, hs, data), kv.shared_memory

        states, shared = asyncio.run(main())
    else:
        with Client(port=server.port) as kv:
            states, shared = kv.put_chain(NS, hs, data), kv.shared_memory
    assert states == ["stored"] * 6 and not shared
    with Client(port=server.port) as kv:
        assert kv.mget(NS, hs) == data
        assert kv.match(NS, hs) == 6
    assert wait_for(lambda: used(server) == 6 * 4096)  # the aborted slots are free
    assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


def test_async_stream_aborts_a_part_whose_fill_raises(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of 2, the async client: copying chunk 3 raises; the first part stays stored, the
    second and the third (reserved ahead) are aborted: another client reserves them all."""
    from kvstrata.clients.aio_leases import AsyncWriteBatch

    monkeypatch.setattr(chain_stream, "PIPE_BYTES", 2 * 4096)
    monkeypatch.setattr(chain_stream, "PIPE_CHUNKS", 1)
    real = AsyncWriteBatch.write
    hs = hashes(6, b"y")

    def failing(self: AsyncWriteBatch, i: int, data: Any, offset: int = 0) -> None:
        if self.hashes[i] == hs[3]:
            raise RuntimeError("copy failed")
        real(self, i, data, offset)

    monkeypatch.setattr(AsyncWriteBatch, "write", failing)

    async def main() -> None:
        async with AsyncClient(port=server.port) as kv:
            with pytest.raises(RuntimeError, match="copy failed"):
                await kv.put_chain(NS, hs, [payload(i) for i in range(6)])
            assert await kv.match(NS, hs) == 2

    asyncio.run(main())
    monkeypatch.setattr(AsyncWriteBatch, "write", real)
    with (
        Client(port=server.port) as other,
        other.reserve_chain(NS, hs[1], hs[2:], [4096] * 4) as batch,
    ):
        assert batch.states == ("reserved",) * 4  # none "busy": both leases are gone
        batch.abort()
    assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


def test_async_reserve_chain_and_put_chain(server: RunningServer) -> None:
    async def main() -> None:
        async with AsyncClient(port=server.port) as kv:
            hs = hashes(4)
            assert await kv.put_chain(NS, hs[:2], [payload(0), payload(1)]) == ["stored"] * 2
            batch = await kv.reserve_chain(NS, hs[1], hs[2:], [10, 20])
            async with batch:
                batch.write(0, b"a" * 10)
                batch.array(1)[:] = 2
            assert await kv.match(NS, hs) == 4
            assert await kv.mget(NS, hs[2:]) == [b"a" * 10, b"\x02" * 20]
            failing = await kv.reserve_chain(NS, hs[3], [b"z"], [5])
            with pytest.raises(RuntimeError):
                async with failing:
                    raise RuntimeError("boom")
            assert await kv.get(NS, b"z") is None

    asyncio.run(main())


def test_a_client_across_a_restart_never_commits_the_old_batch(
    tmp_path: Path, make_process_server: Callable[..., RunningServer]
) -> None:
    """Scenario: a client reserves a batch, the server is stopped (SIGKILL) and started again
    on the same port before the commit. The commit is refused (-NOLEASE: the new server never
    made that lease) and nothing of the batch is visible; the client's next batch is reserved
    in the new instance's arena (its handles name that instance) and reads back exactly."""
    port = free_port()
    flags: dict[str, Any] = {"port": port, "nvme_capacity": "0", "dram_capacity": "8MiB"}
    first = start_process_server(tmp_path / "a", **flags)
    kv = Client(port=port)
    try:
        old = kv.reserve_chain(NS, None, hashes(2), [4096, 4096])
        old.write(0, payload(9))
        old_instance = kv.regions(refresh=False)[0].instance
        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(15)
        second = make_process_server(data_dir=tmp_path / "b", **flags)
        assert second.port == port
        deadline_ok = wait_for(lambda: _reconnects(kv))
        assert deadline_ok
        with pytest.raises(LeaseError):
            old.commit()
        assert kv.match(NS, hashes(2)) == 0
        assert kv.put_chain(NS, hashes(2, b"n"), [payload(1), payload(2)]) == ["stored"] * 2
        with kv.reserve_chain(NS, b"n001", [b"n002"], [4096]) as batch:
            batch.write(0, payload(3))
            [handle] = [h for h in batch.grant.handles if h is not None]
        [region] = kv.regions(refresh=False)
        assert region.instance != old_instance and handle.instance == region.instance
        assert kv.mget(NS, [b"n000", b"n001", b"n002"]) == [payload(1), payload(2), payload(3)]
    finally:
        kv.close()
        first.stop()


def _reconnects(kv: Client) -> bool:
    try:
        return kv.ping()
    except OSError:
        return False


def test_publish_sends_each_chunk_without_waiting_and_commit_collects(
    server: RunningServer,
) -> None:
    """``publish(i)`` makes chunk i visible (once its reply is read at commit) while the rest
    are still being written; commit publishes what is left; an exception after a publish
    aborts only the chunks not published; publishing twice or a chunk without slot raises."""
    hs = hashes(4)
    with Client(port=server.port) as kv:
        with kv.reserve_chain(NS, None, hs, [100] * 4) as batch:
            batch.write(0, b"a" * 100)
            batch.publish(0)
            batch.write(1, b"b" * 100)
            batch.publish(1)
            with pytest.raises(ValueError, match="published already"):
                batch.publish(1)
            batch.write(2, b"c" * 100)
            with pytest.raises(ValueError, match="published already"):
                batch.publish(2, 1)
            batch.write(3, b"d" * 100)
        assert batch.published == [(0,), (1,)] and batch.unpublished() == [2, 3] and batch.done
        assert kv.mget(NS, hs) == [b"a" * 100, b"b" * 100, b"c" * 100, b"d" * 100]
        more = hashes(3, b"m")
        with (
            pytest.raises(RuntimeError, match="boom"),
            kv.reserve_chain(NS, hs[3], more, [10] * 3) as failing,
        ):
            failing.write(0, b"x" * 10)
            failing.publish(0)
            raise RuntimeError("boom")
        assert kv.mget(NS, more) == [b"x" * 10, None, None]
        assert kv.match(NS, [*hs, *more]) == 5
        with kv.reserve_chain(NS, None, [hs[0], b"z"], [100, 5]) as partial:
            with pytest.raises(KeyError, match="exists"):
                partial.publish(0)
            partial.write(1, b"z" * 5)
        assert kv.get(NS, b"z") == b"z" * 5
        assert redis.Redis(port=server.port).info("tiers")["kv_leases"] == 0


def test_async_publish(server: RunningServer) -> None:
    async def main() -> None:
        async with AsyncClient(port=server.port) as kv:
            hs = hashes(3)
            batch = await kv.reserve_chain(NS, None, hs, [8, 8, 8])
            async with batch:
                for i in batch.reserved:
                    batch.write(i, bytes([65 + i]) * 8)
                    if i < 2:
                        await batch.publish(i)
            assert await kv.mget(NS, hs) == [b"A" * 8, b"B" * 8, b"C" * 8]

    asyncio.run(main())


def test_publish_groups_hand_over_about_publish_bytes() -> None:
    from kvstrata.clients.leases import PUBLISH_BYTES, PublishGroups

    sent: list[tuple[int, ...]] = []
    group = PublishGroups(lambda *ix: sent.append(ix))
    for i in range(5):
        group.add(i, PUBLISH_BYTES // 2)
    assert sent == [(0, 1), (2, 3)]  # chunk 4 is left for the final commit
    group.add(5, PUBLISH_BYTES * 3)
    assert sent[-1] == (4, 5)
