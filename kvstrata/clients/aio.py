"""The asyncio kvstrata client: the typed ``KV.*`` methods of :class:`~kvstrata.clients.Client`,
awaited, over a pool of :class:`~kvstrata.clients.aioconn.AsyncConnection`.

    async with AsyncClient(port=7379) as kv:
        n = await kv.match(ns, hashes)
        view = await kv.get(ns, hashes[0], out=tensor)
        async with await kv.lease(ns, hashes[:n]) as lease:
            arrays = lease.arrays(np.float16)

Create it inside the event loop that uses it (``await AsyncClient.connect(...)`` or
``async with``); connections are opened lazily, at most ``max_connections`` at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvstrata.clients import commands as cmd
from kvstrata.clients.aio_leases import AsyncLease, AsyncWriteBatch, AsyncWriteLease
from kvstrata.clients.aioconn import AsyncConnection, AsyncConnectionPool
from kvstrata.clients.chain_stream import (
    READ,
    MakeBatch,
    Send,
    StreamOpts,
    pipe_slices,
    stream_chain,
)
from kvstrata.clients.commands import Call, HashLike
from kvstrata.clients.connection import (
    LEASE_CONN_CLOSED,
    ConnectionSettings,
    loading_delays,
    settings_from_url,
)
from kvstrata.clients.handles import RegionMapError, lease_tier
from kvstrata.clients.leases import batch_slices, put_states
from kvstrata.clients.pipeline import PipelineBase
from kvstrata.clients.regions import regions_stale, update_regions
from kvstrata.clients.resp import as_bytes_view
from kvstrata.clients.results import BatchGrant, Handle, LeaseId, RegionInfo
from kvstrata.protocol.errors import LeaseError, LeaseLimitError, LoadingError, RespError

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "AsyncPipeline",
    "AsyncWriteBatch",
    "AsyncWriteLease",
]

T = TypeVar("T")
P = ParamSpec("P")


def _command(
    build: Callable[P, Call[T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """An :class:`AsyncClient` method that sends the command ``build`` makes and returns its
    result."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(build(*args, **kwargs))

    return cmd.method_like(build, method)


def _fill(batch: AsyncWriteBatch, srcs: Sequence[Any]) -> list[str]:
    """Copy ``srcs`` into the slots (inside the batch's ``async with``, which commits them)."""
    for i in batch.reserved:
        batch.write(i, srcs[i])
    return put_states(batch.states)


class AsyncPipeline(PipelineBase):
    """Commands sent in one write on one connection; ``await execute()`` returns results."""

    def __init__(self, client: AsyncClient) -> None:
        super().__init__()
        self._client = client

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        calls = self._take()
        if not calls:
            return []
        async with self._client.pool.connection() as conn:
            replies = await conn.pipeline([c.args for c in calls], [c.out for c in calls])
        return self._decode(calls, replies, raise_on_error)

    async def __aenter__(self) -> AsyncPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._calls = []


class AsyncClient:
    """Async client; see the module docstring. Arguments as :class:`ConnectionSettings`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 7379, **kwargs: Any) -> None:
        max_connections = kwargs.pop("max_connections", 8)
        self.settings = ConnectionSettings(host=host, port=port, **kwargs)
        self.pool = AsyncConnectionPool(self.settings, max_connections)
        self._regions: dict[str, RegionInfo] = {}
        self._digests = True  # False once the server turned KV.COMMIT … DIGEST down
        self._regions_generation = -1
        self.shared_memory = True  # see Client.shared_memory

    @classmethod
    async def connect(cls, host: str = "127.0.0.1", port: int = 7379, **kwargs: Any) -> AsyncClient:
        """Create the client and open its first connection (fails fast on a wrong address)."""
        client = cls(host, port, **kwargs)
        client.pool.release(await client.pool.acquire())
        return client

    @classmethod
    async def from_url(cls, url: str, **kwargs: Any) -> AsyncClient:
        return await cls.connect(**settings_from_url(url, **kwargs))

    async def _run(self, call: Call[T], via: AsyncConnection | None = None) -> T:
        return (await self._take(call, via))[0]

    async def _take(
        self, call: Call[T], via: AsyncConnection | None = None
    ) -> tuple[T, AsyncConnection]:
        """The result of ``call`` run on ``via`` (default: a pooled connection; ``via`` may be
        in use by other tasks too: replies come back in order), and the connection it ran on
        (a lease taken is that connection's)."""
        delays = None
        while True:
            if via is not None:
                if via.closed:
                    raise LeaseError(LEASE_CONN_CLOSED)
                conn, reply = via, (await via.pipeline([call.args], [call.out]))[0]
            else:
                async with self.pool.connection() as conn:
                    reply = (await conn.pipeline([call.args], [call.out]))[0]
            if type(reply) is not LoadingError:
                return call.result(reply), conn
            # the server is still building its tiers: nothing was done, send it again
            delays = delays or loading_delays(self.settings.loading_timeout)
            delay = next(delays, None)
            if delay is None:
                raise reply  # still loading after loading_timeout seconds
            await asyncio.sleep(delay)

    async def execute(self, *args: Any, out: Any = None) -> Any:
        return await self._run(cmd.raw(args, out))

    def pipeline(self) -> AsyncPipeline:
        return AsyncPipeline(self)

    ping = _command(cmd.ping)
    put = _command(cmd.put)
    get = _command(cmd.get)
    mget = _command(cmd.mget)
    match = _command(cmd.match)
    match_tiers = _command(cmd.match_tiers)
    match_tokens = _command(cmd.match_tokens)

    async def regions(self, refresh: bool = True) -> list[RegionInfo]:
        if refresh or not self._regions:
            await self._refresh_regions(())
        return list(self._regions.values())

    async def _refresh_regions(self, handles: Sequence[Handle]) -> None:
        generation = self.pool.generation
        fresh = await self._run(cmd.regions())
        self._regions = update_regions(self._regions, fresh, handles)
        self._regions_generation = generation

    async def _regions_for(self, handles: Sequence[Handle]) -> dict[str, RegionInfo]:
        # see Client._regions_for: a new connection or instance may mean a restarted server
        if self._regions_generation != self.pool.generation or regions_stale(
            self._regions, handles
        ):
            await self._refresh_regions(handles)
        return self._regions

    async def lease(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> AsyncLease | None:
        """Pin chunks for zero-copy reads (see :meth:`kvstrata.clients.Client.lease`)."""
        grant, conn = await self._take(cmd.lease(ns, hashes, ttl_ms, lease_tier(tier)))
        if grant is None:
            return None
        try:
            regions = await self._regions_for(grant.handles)
            keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
            return AsyncLease(self, ns, keys, grant, regions, conn=conn)
        except BaseException:
            await self.release(grant.lease_id, via=conn)  # not pinned until the TTL
            raise

    async def reserve(
        self,
        ns: str,
        hash: HashLike,
        parent: HashLike | None,
        nbytes: int,
        tokens: int = 0,
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> AsyncWriteLease:
        call = cmd.reserve(ns, hash, parent, nbytes, tokens, ttl_ms, tier)
        grant, conn = await self._take(call)
        try:
            regions = await self._regions_for((grant.handle,))
            key = bytes(cmd.hash_bytes(hash))
            return AsyncWriteLease(self, ns, key, grant, regions, conn=conn)
        except BaseException:
            await self.abort(grant.lease_id, via=conn)  # free the slot now, not at the TTL
            raise

    async def reserve_chain(
        self,
        ns: str,
        parent: HashLike | None,
        hashes: Sequence[HashLike],
        sizes: Sequence[int],
        tokens: int = 0,
        ttl_ms: int | None = None,
        tier: str | None = None,
    ) -> AsyncWriteBatch:
        """Slots for a chain in one round trip (see
        :meth:`kvstrata.clients.Client.reserve_chain`)."""
        call = cmd.mreserve(ns, parent, hashes, sizes, tokens, ttl_ms, tier)
        grant, conn = await self._take(call)
        return await self._write_batch(ns, hashes, grant, conn)

    async def _write_batch(
        self, ns: str, hashes: Sequence[HashLike], grant: BatchGrant, conn: AsyncConnection
    ) -> AsyncWriteBatch:
        """The batch of a KV.MRESERVE reply; its lease is aborted when that fails."""
        try:
            return await self._batch_of(ns, hashes, grant, conn)
        except BaseException:
            if grant.lease_id is not None:
                await self.abort(grant.lease_id, via=conn)  # free the slots now, not at the TTL
            raise

    async def put_chain(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        payloads: Sequence[Any],
        parent: HashLike | None = None,
        tokens: int = 0,
    ) -> list[str]:
        """Store a chain, skipping chunks stored already (see
        :meth:`kvstrata.clients.Client.put_chain`: streamed when over one part)."""
        if len(payloads) != len(hashes):
            raise ValueError("put_chain needs one payload per hash")
        srcs = [as_bytes_view(p) for p in payloads]
        sizes = [len(b) for b in srcs]
        out: list[str] = []
        start = 0
        if self.shared_memory and self.pool.max_connections > 1:  # (regions: a 2nd connection)
            parts = pipe_slices(sizes)
            if len(parts) > 1:
                out, done = await self._stream(ns, hashes, srcs, sizes, parts, parent, tokens)
                start = parts[done].start if done < len(parts) else len(hashes)
        for part in batch_slices(sizes[start:]):  # what was not streamed, the ordinary way
            part = slice(start + part.start, start + part.stop)
            link = parent if part.start == 0 else hashes[part.start - 1]
            out += await self._put_batch(ns, hashes[part], srcs[part], link, tokens)
        return out

    async def _stream(
        self,
        ns: str,
        hashes: Sequence[HashLike],
        srcs: Sequence[Any],
        sizes: Sequence[int],
        parts: Sequence[slice],
        parent: HashLike | None,
        tokens: int,
    ) -> tuple[list[str], int]:
        """``chain_stream.stream_chain`` on one borrowed connection (see ``Client._stream``).
        The fills run on the event loop between the sends, as a batch's ``write`` does."""
        opts = StreamOpts(self._digests)
        async with self.pool.connection() as conn:
            steps = stream_chain(ns, hashes, srcs, sizes, parts, parent, tokens, opts)
            replies: deque[asyncio.Future[Any]] = deque()
            try:
                step = next(steps)
                while True:
                    if step is READ:
                        step = steps.send(await replies.popleft())
                    elif isinstance(step, Send):
                        replies.extend(conn.send(step.commands))
                        step = next(steps)
                    else:
                        assert isinstance(step, MakeBatch)
                        try:
                            batch = await self._batch_of(ns, step.hashes, step.grant, conn)
                        except Exception as exc:  # the stream aborts its lease
                            step = steps.throw(exc)
                        else:
                            step = steps.send(batch)
            except StopIteration as stop:
                return stop.value
            except asyncio.CancelledError:
                conn.close()  # replies in flight would arrive for nobody
                raise
            finally:
                self._digests = opts.digests

    async def _batch_of(
        self, ns: str, hashes: Sequence[HashLike], grant: BatchGrant, conn: AsyncConnection
    ) -> AsyncWriteBatch:
        """The batch of a KV.MRESERVE reply (its regions mapped); nothing aborted on failure."""
        regions = await self._regions_for([h for h in grant.handles if h is not None])
        keys = [bytes(cmd.hash_bytes(h)) for h in hashes]
        return AsyncWriteBatch(self, ns, keys, grant, regions, conn=conn)

    async def _put_batch(
        self, ns: str, hashes: Sequence[HashLike], srcs: Sequence[Any], parent: Any, tokens: int
    ) -> list[str]:
        """One batch, halved on -LEASELIMIT (see :meth:`kvstrata.clients.Client._put_batch`)."""
        try:
            return await self._put_batch_once(ns, hashes, srcs, parent, tokens)
        except LeaseLimitError:
            if len(hashes) < 2:
                raise
        mid = len(hashes) // 2
        first = await self._put_batch(ns, hashes[:mid], srcs[:mid], parent, tokens)
        rest = await self._put_batch(ns, hashes[mid:], srcs[mid:], hashes[mid - 1], tokens)
        return first + rest

    async def _put_batch_once(
        self, ns: str, hashes: Sequence[HashLike], srcs: Sequence[Any], parent: Any, tokens: int
    ) -> list[str]:
        if self.shared_memory:
            sizes = [len(b) for b in srcs]
            try:
                batch = await self.reserve_chain(ns, parent, hashes, sizes, tokens, tier="dram")
                async with batch:
                    return _fill(batch, srcs)
            except RegionMapError:
                self.shared_memory = False  # the server is on another host: bytes over TCP
        p = self.pipeline()
        for h, src in zip(hashes, srcs, strict=True):
            p.put(ns, h, parent, src, tokens=tokens, nx=True)
            parent = h
        return ["stored" if ok else "exists" for ok in await p.execute()]

    async def commit(
        self,
        lease_id: LeaseId,
        *indexes: int,
        via: AsyncConnection | None = None,
        digests: Sequence[bytes] = (),
    ) -> None:
        """``KV.COMMIT lease [index…] [DIGEST digest…]`` on ``via``, the connection that took
        the lease (see :meth:`kvstrata.clients.Client.commit`)."""
        if digests and self._digests:
            try:
                await self._run(cmd.commit(lease_id, *indexes, digests=digests), via)
                return
            except RespError as exc:
                if not cmd.refuses_digests(exc):
                    raise
                self._digests = False  # an older server: it hashes the slots itself
        await self._run(cmd.commit(lease_id, *indexes), via)

    async def abort(self, lease_id: LeaseId, via: AsyncConnection | None = None) -> None:
        await self._run(cmd.abort(lease_id), via)

    async def release(self, lease_id: LeaseId, via: AsyncConnection | None = None) -> None:
        await self._run(cmd.release(lease_id), via)

    info = _command(cmd.info)
    delete = _command(cmd.delete)
    stats = _command(cmd.stats)

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> AsyncClient:
        if not self.pool._all:
            self.pool.release(await self.pool.acquire())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
